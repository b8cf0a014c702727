# The native modules: the cffi ones (_native/build_ffi.py; _native/bench/ is the bench's own,
# native baselines, not the library's) and aiohixl._span (plain C API). The rest: pyproject.toml.
import os

from setuptools import Extension, setup

# AIOHIXL_SANITIZE=1 (make test-asan): as _native/build_ffi.py does for the cffi module.
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-g"]
sanitize = os.environ.get("AIOHIXL_SANITIZE") == "1"

# All are built for the limited API (cffi's default), so one wheel serves
# every CPython from 3.10 on. aiohixl._span is plain C API: the spans' slicing.
setup(
    cffi_modules=["_native/build_ffi.py:ffibuilder", "_native/bench/build_baselines.py:ffibuilder"],
    ext_modules=[
        Extension(
            "aiohixl._span",
            ["_native/python/span.c"],
            py_limited_api=True,
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            extra_compile_args=["-Wall", "-Wextra", "-std=gnu11"] + (SANITIZE if sanitize else []),
            extra_link_args=SANITIZE if sanitize else [],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)

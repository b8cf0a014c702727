# The native modules are built by cffi; everything else is in pyproject.toml.
# _native/bench/ is the bench's own module (native baselines), not the library's.
from setuptools import Extension, setup

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
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)

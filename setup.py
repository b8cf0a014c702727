# The native modules are built by cffi; everything else is in pyproject.toml.
# _native/bench/ is the bench's own module (native baselines), not the library's.
from setuptools import setup

# Both are built for the limited API (cffi's default), so one wheel serves
# every CPython from 3.10 on.
setup(
    cffi_modules=["_native/build_ffi.py:ffibuilder", "_native/bench/build_baselines.py:ffibuilder"],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)

# The native module is built by cffi; everything else is in pyproject.toml.
from setuptools import setup

# The module is built for the limited API (cffi's default), so one wheel
# serves every CPython from 3.10 on.
setup(
    cffi_modules=["_native/build_ffi.py:ffibuilder"],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)

# The native module is built by cffi; everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["_native/build_ffi.py:ffibuilder"])

# The native modules are built by cffi; everything else is in pyproject.toml.
# _native/bench/ is the bench's own module (native baselines), not the library's.
from setuptools import setup

setup(cffi_modules=["_native/build_ffi.py:ffibuilder", "_native/bench/build_baselines.py:ffibuilder"])

"""cffi build (API mode) of the bench's native baselines: ``aiohixl.tools._baselines``.

A module of its own, apart from the library's ``aiohixl._hixl``: only
``python -m aiohixl bench`` imports it. The cdef is the block of baselines.h
between the CDEF markers.
"""

import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _cdef() -> str:
    with open(os.path.join(HERE, "baselines.h")) as f:
        text = f.read()
    block = re.search(r"/\* CDEF-BEGIN \*/(.*)/\* CDEF-END \*/", text, re.S).group(1)
    return re.sub(r"/\*.*?\*/", "", block, flags=re.S)


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "aiohixl.tools._baselines",
    '#include "baselines.h"',
    # core/stream.c: the copy engine's streaming copy, timed as a limit beside memcpy.
    sources=[os.path.relpath(os.path.join(HERE, f)) for f in ("baselines.c", "../core/stream.c")],
    include_dirs=[os.path.relpath(HERE), os.path.relpath(os.path.dirname(HERE))],
    # Portable code only, as the library's module: no CPU-specific flags (the Soft-RoCE VM lacks AVX-512).
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-std=gnu11"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

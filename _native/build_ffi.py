"""cffi build (API mode) of aiohixl's native layer: ``aiohixl._hixl``.

The cdef is the block of hixl.h between the CDEF markers, so the header is
the single statement of the native interface.
"""

import glob
import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
# Every .c of every folder: core/ (agent, registry, ring, pool, copies, the
# transport table) and one folder per transport. Headers: hixl.h (the
# interface), internal.h (shared by all), <transport>/<transport>.h (private).
# Not bench/ (the bench's own module) nor python/ (aiohixl._span, setup.py).
SOURCES = sorted(
    s
    for s in glob.glob(os.path.join(HERE, "*", "*.c"))
    if os.path.basename(os.path.dirname(s)) not in ("bench", "python")
)
# With rdma-core's headers the verbs transport is compiled in; libibverbs
# itself is only dlopen()ed when an agent opens a device.
HAVE_VERBS = os.path.exists("/usr/include/infiniband/verbs.h") and os.environ.get("AIOHIXL_NO_VERBS") != "1"
# _GNU_SOURCE for every file from here, never from a header (where it comes too
# late for a file that includes a system header first).
DEFINE_MACROS = [("_GNU_SOURCE", None)] + ([("HX_HAVE_VERBS", "1")] if HAVE_VERBS else [])
INCLUDE_DIRS = [os.path.relpath(HERE)]
# A header changed rebuilds the module: build_ext looks only at what it is told of, and a
# struct laid out anew in a header alone left objects that disagreed on it (a crash).
HEADERS = sorted(os.path.relpath(h) for h in glob.glob(os.path.join(HERE, "**", "*.h"), recursive=True))
# Portable code only: the Soft-RoCE VM and users' CPUs may lack AVX-512.
# Hidden visibility: the module exports PyInit__hixl alone (cffi marks it),
# not the hx_* symbols its files share with each other.
COMPILE_ARGS = ["-Wall", "-Wextra", "-std=gnu11", "-fvisibility=hidden"]


def _cdef() -> str:
    with open(os.path.join(HERE, "hixl.h")) as f:
        text = f.read()
    block = re.search(r"/\* CDEF-BEGIN \*/(.*)/\* CDEF-END \*/", text, re.S).group(1)
    # cffi's parser takes no comments and wants enum values it can read.
    return re.sub(r"/\*.*?\*/", "", block, flags=re.S)


# AIOHIXL_SANITIZE=1 (make test-asan): AddressSanitizer + UBSan. Python itself is not
# instrumented, so the test run preloads libasan.
SANITIZE = os.environ.get("AIOHIXL_SANITIZE") == "1"
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-g"]

ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "aiohixl._hixl",
    '#include "hixl.h"',
    sources=[os.path.relpath(s) for s in SOURCES],
    depends=HEADERS,
    include_dirs=INCLUDE_DIRS,
    extra_compile_args=["-O1" if SANITIZE else "-O2"] + COMPILE_ARGS + (SANITIZE_FLAGS if SANITIZE else []),
    extra_link_args=SANITIZE_FLAGS if SANITIZE else [],
    define_macros=DEFINE_MACROS,
    libraries=["pthread", "dl"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

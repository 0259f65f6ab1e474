"""Keep freed host memory in the process on CPU ranks instead of handing it back to the kernel.

A CPU rank's activations live in memory from the C library's ``malloc``. glibc's default returns
the top of its heap to the kernel (``brk``) whenever more than its trim threshold lies free
there, and serves blocks above its mmap threshold by ``mmap`` and unmaps them when freed; both
thresholds follow the largest block freed so far, up to 32 MiB and 64 MiB. A training step
frees a run of activation-sized blocks (16 MiB for the ``tiny`` model with n_embd 512 and 2,048
rows) at the top of the heap and allocates them again in the next step, so each step gives tens
of MiB back and then takes them again one page fault per 4 KiB: 7,000-30,000 minor faults a
step on two ``data=2`` ranks (``bench.peers``' model), each zeroing a page, in the step's own
critical path. The plain PyTorch model of the same shape, trained in the same processes, took
none (why its order of frees never leaves that much free at the top was not traced).

:func:`keep_freed_memory` fixes both thresholds (``mallopt``): blocks up to 32 MiB (glibc's
largest mmap threshold) come from the heap, and the heap is trimmed only when more than
:data:`TRIM_BYTES` lie free at its top, so a step reuses the pages of the one before (the
allocators PyTorch recommends for CPU training, jemalloc and tcmalloc, keep freed memory the same
way). A process holds at most the high-water mark of its heap, as it would at that step anyway:
two ``data=2`` ranks of that model peaked at 868 and 864 MB against 839 and 826 MB. Blocks above
32 MiB are still mapped and unmapped each time, as by default. Serving every block from the heap
(``M_MMAP_MAX`` 0) removes their faults too, but 64-byte-aligned blocks (torch's) then fragment
it: one 40 MiB tensor allocated and freed 60 times peaked at 540 MB against 260 MB.

Nothing is changed when the user has chosen: a glibc malloc variable (:data:`GLIBC_MALLOC_ENV`) or a
``glibc.malloc`` tunable in ``GLIBC_TUNABLES`` is set, or another allocator is preloaded
(``LD_PRELOAD``). Only on Linux with glibc; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: what start-up reports on a rank whose tensors are not in host memory (a GPU rank): nothing done
NOT_CPU = "left: not a CPU rank"
#: the environment variables by which glibc's allocator takes settings
GLIBC_MALLOC_ENV = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
    "MALLOC_ARENA_TEST",
    "MALLOC_CHECK_",
    "MALLOC_PERTURB_",
)
#: glibc's ``mallopt`` parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: blocks up to this size come from the heap (glibc's largest mmap threshold on 64-bit hosts)
MMAP_BYTES = 32 << 20
#: the heap is given back only when more than this lies free at its top
TRIM_BYTES = 1 << 30


def user_chose(env: dict) -> str | None:
    """The setting by which the user chose the allocator's behaviour themselves, or None."""
    for k in GLIBC_MALLOC_ENV:
        if env.get(k):
            return k
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if any(a in env.get("LD_PRELOAD", "") for a in ("jemalloc", "tcmalloc", "mimalloc")):
        return "LD_PRELOAD"
    return None


def keep_freed_memory(env: dict | None = None) -> str:
    """Fix glibc's thresholds (module docstring) in this process. Returns what was done: 'kept',
    'left: <the user's setting>', or 'left: not glibc'."""
    env = os.environ if env is None else env
    chose = user_chose(env)
    if chose is not None:
        return f"left: {chose}"
    if not sys.platform.startswith("linux"):
        return "left: not glibc"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "left: not glibc"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)):
        return "left: not glibc"
    return "kept"

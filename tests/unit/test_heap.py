"""``axo4d.dist.heap``: when start-up leaves the allocator alone, and that keeping freed memory
removes the page faults of an allocation pattern glibc's default gives back to the kernel every
time (in fresh interpreters: ``mallopt`` is process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from axo4d.dist.heap import keep_freed_memory, user_chose

# three 12 MiB blocks from malloc, written and freed, eight times: glibc's default gives them back
# to the kernel each time (the first one, mapped, raised its mmap threshold to 12 MiB and its trim
# threshold to 24 MiB; the next ones come from the heap, and 36 MiB free at its top is trimmed)
# and faults them in again in the next round
_PATTERN = """
import ctypes, json, resource
from axo4d.dist.heap import keep_freed_memory
done = keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 12 << 20
faults = []
for i in range(8):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(n) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, n)
    for b in reversed(blocks):
        libc.free(b)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"done": done, "faults": sum(faults[2:])}))
"""


def _run(extra_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", _PATTERN], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")
@pytest.mark.timeout(240)
def test_kept_memory_is_not_faulted_in_again() -> None:
    left = _run({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"})  # glibc's own default: the user chose
    kept = _run({})
    assert left["done"] == "left: GLIBC_TUNABLES" and kept["done"] == "kept"
    pages = 6 * 3 * (12 << 20) // 4096  # six rounds of three blocks
    assert left["faults"] > pages // 2, left  # the default really gives the memory back
    assert kept["faults"] < pages // 20, (kept, left)


def test_the_users_choice_is_left_alone() -> None:
    assert user_chose({}) is None
    assert user_chose({"PATH": "/bin", "LD_PRELOAD": "libfoo.so"}) is None
    assert user_chose({"MALLOC_TRIM_THRESHOLD_": "0"}) == "MALLOC_TRIM_THRESHOLD_"
    assert user_chose({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}) == "GLIBC_TUNABLES"
    assert user_chose({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}) is None
    assert user_chose({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "LD_PRELOAD"
    assert user_chose({"MALLOC_SOMETHING": "1"}) is None  # not a variable glibc reads
    assert keep_freed_memory({"MALLOC_ARENA_MAX": "2"}) == "left: MALLOC_ARENA_MAX"

"""How many intra-op (OpenMP) threads each rank uses when nobody said.

Several ranks on one node that each keep torch's default (one thread per core) oversubscribe the
cores: on this project's 2-core machine 8 CPU ranks of the ``tiny`` config took 34 s for 20 steps
with the default and 6 s with one thread each. ``torchrun`` sets ``OMP_NUM_THREADS=1`` for the
same reason; axo4d does the equivalent in every rank whatever started it (``launch.local``,
``mpiexec``, ``srun``, a test): the cores this process may run on, shared among the ranks of its
node, unless ``OMP_NUM_THREADS`` is set (then torch already follows it) or the launcher bound
this process to a subset of the cores (then that subset is this rank's own).
"""

from __future__ import annotations

import os


def default_threads(local_world_size: int, allowed: int, cores: int, env: dict | None = None) -> int | None:
    """Threads for one of ``local_world_size`` ranks on a node of ``cores`` cores, this process
    allowed on ``allowed`` of them; None to leave torch's choice (``OMP_NUM_THREADS`` given)."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return None
    if allowed < cores:  # bound by the launcher (srun --cpus-per-task, mpiexec --bind-to): its own cores
        return max(1, allowed)
    return max(1, allowed // max(1, local_world_size))


def set_default_threads(local_world_size: int) -> int | None:
    """Apply :func:`default_threads` to torch in this process; the number set, or None."""
    import torch

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = default_threads(local_world_size, allowed, os.cpu_count() or allowed)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n

"""Each rank's pid and exit status, for a launcher that cannot see them itself.

Under ``mpiexec`` the ranks are children of the MPI launcher's proxies, not of ``launch.local``:
when one is killed, MPICH's Hydra prints a banner with the pid of whichever process it was
cleaning up and exits 9, naming no rank. ``launch.local`` therefore creates a folder and passes
it in :data:`ENV` to every rank; a rank writes ``rank_K.pid`` (its pid) when it starts and
``rank_K.exit`` (its exit status) just before it ends by itself. A rank whose process is gone
without a ``rank_K.exit`` did not end by itself: a signal (SIGKILL, the kernel's out-of-memory
killer, a crash in native code) ended it. Without :data:`ENV` nothing is written.

Torch-free: ``launch.local`` reads these files and never imports torch.
"""

from __future__ import annotations

import atexit
import os

from axo4d.dist.faults import env_rank

#: environment variable naming the folder (set by ``launch.local``)
ENV = "AXO4D_RANK_FILES"
_registered: list[str] = []  # this rank's path without suffix, once registered
_recorded: list[int | None] = []  # the status written, once written


def _write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def register() -> None:
    """Write this rank's ``rank_K.pid`` (once) and arrange for ``rank_K.exit`` at a normal
    interpreter exit; does nothing without :data:`ENV`."""
    folder = os.environ.get(ENV, "")
    if not folder or _registered:
        return
    base = os.path.join(folder, f"rank_{env_rank()}")
    try:
        _write(base + ".pid", f"{os.getpid()}\n")
    except OSError:
        return  # the launcher's folder is gone: nobody is reading
    _registered.append(base)
    atexit.register(record_exit, None)


def record_exit(code: int | None) -> None:
    """Write ``rank_K.exit`` (``code``, or ``-`` where unknown: a normal interpreter exit); call
    it before ``os._exit``, which skips the exit handlers."""
    if not _registered or _recorded:
        return
    _recorded.append(code)
    try:
        _write(_registered[0] + ".exit", f"{'-' if code is None else code}\n")
    except OSError:
        pass


def read_pid(folder: str, rank: int) -> int | None:
    """The pid rank ``rank`` registered in ``folder``, or None."""
    try:
        return int(open(os.path.join(folder, f"rank_{rank}.pid")).read().strip())
    except (OSError, ValueError):
        return None


def exit_status(folder: str, rank: int) -> str | None:
    """What rank ``rank`` wrote in its ``rank_K.exit`` (its status, ``-`` where unknown), or None:
    it did not end by itself (a signal ended it), or has not ended."""
    try:
        return open(os.path.join(folder, f"rank_{rank}.exit")).read().strip()
    except OSError:
        return None


__all__ = ["ENV", "register", "record_exit", "read_pid", "exit_status"]

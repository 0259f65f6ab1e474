"""A fork server for :func:`tests.dist.harness.run_on_ranks`: ranks forked from one process that
imported torch, the package and the test's cases once.

A spawned rank spent three to five CPU-seconds importing torch, ``axo4d`` and (for the model
families) ``transformers`` before its first collective, and the suite spawns well over a hundred
of them on two cores. This server is started once per pytest session; for each request it imports
the target's module (kept for later requests), forks the ranks with the torchrun-style
environment :func:`launch.local.run_env` gives (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``
...), and each child runs :func:`tests.dist.harness._worker` exactly as a spawned rank does. Every
rank is a fresh process (nothing but the imports is shared: no process group, no torch thread pool
exists before the fork), so the ranks compute what spawned ranks compute.

Protocol: one JSON line per request on stdin, ``{"n", "target", "outdir", "args", "timeout",
"env"}``; one JSON line per answer on stdout, ``{"rc"}``: 0, the first failing rank's status
(a signal as ``128 + s``), or 124 at the timeout. When a rank fails the others get
:data:`GRACE_S` to end (they are usually waiting in a collective on it), then are killed.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time

from axo4d.dist.net import free_port
from launch.local import _status as status_of  # a signal -s as 128 + s, as the launcher reports it

GRACE_S = 5.0


def _child(rank: int, req: dict, port: int) -> None:
    code = 1
    try:
        os.environ.clear()
        os.environ.update(
            req["env"],
            RANK=str(rank),
            WORLD_SIZE=str(req["n"]),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(req["n"]),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        from tests.dist.harness import _worker

        code = _worker(req["target"], req["outdir"], json.dumps(req["args"]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill(pids: dict[int, int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in list(pids):
        os.waitpid(pid, 0)
    pids.clear()


def serve_one(req: dict) -> int:
    """Fork ``req["n"]`` ranks, wait for them; the answer's status (module docstring)."""
    try:
        importlib.import_module(req["target"].split(":")[0])  # shared by this and later requests
    except BaseException:
        pass  # each rank imports it again and reports the error in its result
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for r in range(req["n"]):
        pid = os.fork()
        if pid == 0:
            _child(r, req, port)
        pids[pid] = r
    t0, first, failed_at = time.time(), 0, None
    while pids:
        pid, st = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.time()
            if now - t0 > req["timeout"]:
                _kill(pids)
                return 124
            if failed_at is not None and now - failed_at > GRACE_S:
                _kill(pids)
                break
            time.sleep(0.02)
            continue
        del pids[pid]
        code = os.waitstatus_to_exitcode(st)
        code = 0 if code == 0 else status_of(code)
        if code != 0 and not first:
            first, failed_at = code, time.time()
    return first


def main() -> int:
    import torch  # noqa: F401  (the imports every rank shares)

    import axo4d.training.trainer  # noqa: F401
    import tests.dist.harness  # noqa: F401

    out = os.fdopen(os.dup(1), "w")  # the answers; fd 1 becomes stderr: nothing a rank or an
    os.dup2(2, 1)  # import prints (Python or native code) reaches the answer channel
    for line in sys.stdin:
        rc = serve_one(json.loads(line))
        out.write(json.dumps({"rc": rc}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

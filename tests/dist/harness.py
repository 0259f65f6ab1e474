"""Run a function on N CPU ranks (gloo), started by pytest or inside ``mpiexec -n N pytest``.

``run_on_ranks(n, "tests.dist.cases_linear:run", timeout)`` starts ``n``
processes (torchrun-style environment; forked by the session's :mod:`tests.dist.rank_forks`
server, which imported torch and the package once), each initialising torch.distributed
and calling the target with its :class:`axo4d.dist.discovery.DistInfo`; every rank
writes its JSON-able return value (or its traceback) to a file. When pytest
itself runs under a launcher with ``n`` ranks, the target runs in-process.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _resolve(target: str):
    mod, fn = target.split(":")
    return getattr(import_module(mod), fn)


def _in_launched_world() -> int:
    """World size when pytest itself was started by mpiexec/torchrun/srun, else 0."""
    from axo4d.dist.discovery import detect_launcher

    kind = detect_launcher()
    if kind == "single":
        return 0
    if kind == "env":
        return int(os.environ["WORLD_SIZE"])
    if kind == "slurm":
        return int(os.environ["SLURM_NTASKS"])
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def run_on_ranks(n: int, target: str, timeout: float = 240, *args) -> list:
    """Results of ``target(info, *args)`` on each of ``n`` ranks (list indexed by rank)."""
    world = _in_launched_world()
    if world:
        if world != n:
            pytest.skip(f"needs {n} ranks; this launch has {world}")
        from axo4d.dist.bootstrap import init_distributed

        info = init_distributed(backend="gloo", timeout_s=60)
        res = _resolve(target)(info, *args)
        import torch.distributed as dist

        out = [None] * n
        dist.all_gather_object(out, res)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        rc = _forks().run(n, target, tmp, list(args), timeout) if _may_fork() else _spawn(n, target, tmp, args, timeout)
        results = []
        for r in range(n):
            f = Path(tmp) / f"rank{r}.json"
            results.append(json.loads(f.read_text()) if f.exists() else {"error": "no result (rank died)"})
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if isinstance(res, dict) and "error" in res]
    if rc == 124:
        pytest.fail(f"{target} on {n} ranks timed out after {timeout}s\n" + "\n".join(errors))
    if rc != 0 or errors:
        pytest.fail(f"{target} on {n} ranks failed (exit {rc}):\n" + "\n".join(errors[:3]))
    return [res["result"] for res in results]


def _may_fork() -> bool:
    """Ranks forked from the server (:mod:`tests.dist.rank_forks`) unless ``AXO4D_TEST_SPAWN=1`` or
    the machine has a GPU: a process that asked CUDA or ROCm anything cannot fork usable ranks."""
    if os.environ.get("AXO4D_TEST_SPAWN") == "1":
        return False
    return not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))


def _spawn(n: int, target: str, outdir: str, args: tuple, timeout: float) -> int:
    """``n`` fresh interpreters (``launch.local``'s torchrun-style environment) running the target."""
    from launch.local import run_env

    cmd = [sys.executable, "-m", "tests.dist.harness", target, outdir, json.dumps(args)]
    env_backup = dict(os.environ)
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    try:
        return run_env(n, cmd, timeout=timeout)
    finally:
        os.environ.clear()
        os.environ.update(env_backup)


class _Forks:
    """The session's :mod:`tests.dist.rank_forks` server (started at the first request)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def run(self, n: int, target: str, outdir: str, args: list, timeout: float) -> int:
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            cmd = [sys.executable, "-m", "tests.dist.rank_forks"]
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
            )
            atexit.register(self.close)
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        req = {"n": n, "target": target, "outdir": outdir, "args": args, "timeout": timeout, "env": env}
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BaseException:  # interrupted (a test's timeout): the server and its ranks go
            self.kill()
            raise
        if not line:  # the server died: the next request starts another
            return 1
        return json.loads(line)["rc"]

    def kill(self) -> None:
        """The server and every rank it forked (one process group)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


_FORKS: list[_Forks] = []


def _forks() -> _Forks:
    if not _FORKS:
        _FORKS.append(_Forks())
    return _FORKS[0]


def _worker(target: str, outdir: str, args_json: str) -> int:
    from axo4d.dist.bootstrap import init_distributed

    rank = int(os.environ.get("RANK", 0))
    out = Path(outdir) / f"rank{rank}.json"
    try:
        info = init_distributed(backend="gloo", timeout_s=60)
        res = {"result": _resolve(target)(info, *json.loads(args_json))}
        code = 0
        from axo4d.dist.bootstrap import shutdown

        shutdown()
    except BaseException:
        res, code = {"error": traceback.format_exc()}, 1
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res))
    os.replace(tmp, out)
    return code


if __name__ == "__main__":
    sys.exit(_worker(*sys.argv[1:4]))

"""World discovery (axo4d/dist/discovery.py), start-up (axo4d/dist/bootstrap.py) and the local
launcher (launch/local.py)."""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from axo4d.config.errors import LaunchError
from axo4d.dist.bootstrap import init_distributed, shutdown
from axo4d.dist.discovery import BACKENDS, LAUNCHERS, WorldInfo, detect_launcher, discover, first_host, pick_backend
from launch import local

REPO = Path(__file__).resolve().parents[2]

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "29511",
}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS_PER_NODE": "4(x4)",
    "SLURM_NODELIST": "nid[001-004,010]",
    "SLURM_JOB_ID": "123456",
}


# ---- detect_launcher -------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, expected",
    [
        (TORCHRUN, "env"),
        ({"RANK": "0", "WORLD_SIZE": "1"}, "env"),
        ({"RANK": "0"}, "single"),  # WORLD_SIZE missing
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
        ({"PMI_RANK": "1", "PMI_SIZE": "2"}, "mpi"),
        ({"PMIX_RANK": "0"}, "mpi"),
        ({"MV2_COMM_WORLD_RANK": "0"}, "mpi"),
        ({**SLURM, "PMI_RANK": "5"}, "mpi"),  # srun --mpi: MPI wins over Slurm
        (SLURM, "slurm"),
        ({"SLURM_PROCID": "0"}, "single"),  # SLURM_NTASKS missing
        ({**TORCHRUN, **SLURM, "PMI_RANK": "5"}, "env"),  # torchrun inside an allocation
        ({}, "single"),
        ({"PATH": "/usr/bin", "HOME": "/root"}, "single"),
    ],
)
def test_detect_launcher(env, expected):
    assert detect_launcher(env) == expected
    # auto discovery agrees with the detection (mpi needs a real MPI world, skip it)
    if expected in ("env", "slurm", "single"):
        assert discover("auto", env=env).launcher == expected


# ---- discover ----------------------------------------------------------------------------
def test_discover_env():
    assert discover("env", env=TORCHRUN) == WorldInfo(3, 8, 1, 4, "10.0.0.7", 29511, "env")


def test_discover_env_defaults():
    w = discover("env", env={"RANK": "1", "WORLD_SIZE": "2"})
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (1, 2, 0, 2)
    assert (w.master_addr, w.master_port) == ("127.0.0.1", 29500)


def test_discover_slurm():
    w = discover("slurm", env=SLURM)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (5, 16, 1, 4)
    assert w.master_addr == "nid001"
    assert w.master_port == 20000 + 123456 % 20000
    assert w.launcher == "slurm"


def test_discover_slurm_variants():
    # MASTER_PORT / MASTER_ADDR given explicitly win
    w = discover("slurm", env={**SLURM, "MASTER_PORT": "12345", "MASTER_ADDR": "head"})
    assert (w.master_addr, w.master_port) == ("head", 12345)
    # the step's node list is preferred; job node list is a fallback
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"}
    assert discover("slurm", env={**env, "SLURM_JOB_NODELIST": "gpu7,gpu8"}).master_addr == "gpu7"
    assert discover("slurm", env={**SLURM, "SLURM_STEP_NODELIST": "node12"}).master_addr == "node12"
    # different jobs get different default ports
    p1 = discover("slurm", env=SLURM).master_port
    p2 = discover("slurm", env={**SLURM, "SLURM_JOB_ID": "123457"}).master_port
    assert p2 == p1 + 1 and 20000 <= p1 < 40000
    # no per-node count: all tasks assumed local
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert discover("slurm", env=env).local_world_size == 16
    # no node list at all
    with pytest.raises(LaunchError, match="SLURM_NODELIST"):
        discover("slurm", env={"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("nid[001-004,010]", "nid001"),
        ("gpu7,gpu8", "gpu7"),
        ("node12", "node12"),
        ("x1000c0s0b0n[0-1]", "x1000c0s0b0n0"),
        ("nid[010,001-004],gpu7", "nid010"),
        ("gpu-a[07-09]", "gpu-a07"),
        ("nid001,nid[002-003]", "nid001"),
        ("  node3  ", "node3"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", ",node1", "[1-2]"])
def test_first_host_malformed(nodelist):
    with pytest.raises(LaunchError, match="SLURM_NODELIST"):
        first_host(nodelist)


@pytest.mark.parametrize(
    "launcher, env, var",
    [
        ("env", {"WORLD_SIZE": "2"}, "RANK"),
        ("env", {"RANK": "0"}, "WORLD_SIZE"),
        ("slurm", {"SLURM_PROCID": "0", "SLURM_NODELIST": "n1"}, "SLURM_NTASKS"),
        ("slurm", {"SLURM_NTASKS": "2", "SLURM_NODELIST": "n1"}, "SLURM_PROCID"),
    ],
)
def test_missing_env_var(launcher, env, var):
    with pytest.raises(LaunchError, match=f"{var} is missing"):
        discover(launcher, env=env)


@pytest.mark.parametrize(
    "launcher, env, var",
    [
        ("env", {"RANK": "zero", "WORLD_SIZE": "2"}, "RANK"),
        ("env", {"RANK": "0", "WORLD_SIZE": "2.0"}, "WORLD_SIZE"),
        ("env", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK"),
        ("env", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": ""}, "LOCAL_WORLD_SIZE"),
        ("env", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT"),
        ("slurm", {**SLURM, "SLURM_PROCID": "a"}, "SLURM_PROCID"),
        ("slurm", {**SLURM, "SLURM_NTASKS": "?"}, "SLURM_NTASKS"),
        ("slurm", {**SLURM, "SLURM_LOCALID": "one"}, "SLURM_LOCALID"),
        ("slurm", {**SLURM, "SLURM_JOB_ID": "12_3a"}, "SLURM_JOB_ID"),
        ("slurm", {**SLURM, "MASTER_PORT": "p"}, "MASTER_PORT"),
    ],
)
def test_non_integer_env_var(launcher, env, var):
    with pytest.raises(LaunchError, match=f"{var}=.* is not an integer"):
        discover(launcher, env=env)


def test_slurm_master_port_does_not_need_job_id():
    w = discover("slurm", env={**SLURM, "SLURM_JOB_ID": "not-a-number", "MASTER_PORT": "2000"})
    assert w.master_port == 2000


def test_unknown_launcher_and_backend():
    with pytest.raises(LaunchError) as e:
        discover("torchrun", env={})
    assert "'torchrun'" in str(e.value)
    for name in LAUNCHERS:
        assert name in str(e.value)
    with pytest.raises(LaunchError) as e:
        pick_backend("ucc")
    assert "'ucc'" in str(e.value)
    for name in BACKENDS:
        assert name in str(e.value)


def test_pick_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_backend("auto") == "gloo"
    assert pick_backend("gloo") == "gloo"
    assert pick_backend("mpi") == "mpi"
    with pytest.raises(LaunchError, match="nccl.*CUDA"):
        pick_backend("nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_backend("auto") == "nccl"
    assert pick_backend("nccl") == "nccl"


def test_discover_mpi_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    with pytest.raises(LaunchError, match="mpi4py"):
        discover("mpi", env={})
    with pytest.raises(LaunchError, match="mpi4py"):
        discover("auto", env={"PMI_RANK": "0"})


def test_discover_single():
    w = discover("single", env={"RANK": "3", "WORLD_SIZE": "8"})  # env ignored when forced
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.launcher) == (0, 1, 0, 1, "single")
    assert 0 < w.master_port < 65536


def test_init_distributed_single_process(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.delenv("AXO4D_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        info = init_distributed(backend="gloo", timeout_s=30, launcher="single")
        assert dist.is_initialized()
        assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (0, 1, 0, 1)
        assert info.backend == "gloo" and info.launcher == "single"
        assert info.device == torch.device("cpu")
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        # idempotent: a second call reuses the group
        assert init_distributed(backend="gloo", launcher="single").world_size == 1
    finally:
        shutdown()
    assert not dist.is_initialized()
    shutdown()  # harmless when nothing is initialised


# ---- launch.local -------------------------------------------------------------------------
def _script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def test_local_target():
    assert local._target(["pkg.mod", "--a", "1"]) == [sys.executable, "-u", "-m", "pkg.mod", "--a", "1"]
    assert local._target(["-m", "pkg.mod"]) == [sys.executable, "-u", "-m", "pkg.mod"]
    assert local._target(["x/run.py", "b"]) == [sys.executable, "-u", "x/run.py", "b"]
    with pytest.raises(SystemExit, match="nothing to run"):
        local._target([])


def test_local_env_mode_end_to_end(tmp_path):
    script = _script(
        tmp_path,
        "hello.py",
        """
        import os, sys
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        # one write per line: the ranks share the launcher's stdout (print() may split the newline off)
        os.write(1, " ".join(["hello", *(os.environ[k] for k in keys), *sys.argv[1:]]).encode() + b"\\n")
    """,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run(
        [sys.executable, "-m", "launch.local", "-n", "2", "--mode", "env", "--", str(script), "arg1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    lines = sorted(l.split() for l in r.stdout.splitlines() if l.startswith("hello"))
    assert len(lines) == 2
    assert [l[1] for l in lines] == ["0", "1"]  # both ranks ran
    assert all(l[2] == "2" and l[4] == "2" and l[5] == "127.0.0.1" for l in lines)
    assert [l[3] for l in lines] == ["0", "1"]
    assert lines[0][6] == lines[1][6]  # same port
    assert all(l[7] == "arg1" for l in lines)


def test_launcher_does_not_import_torch():
    # the launcher only spawns processes; importing torch would cost every launch seconds
    code = "import sys, launch.local; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


def test_local_env_mode_stops_others_on_failure(tmp_path, capfd):
    pidfile = tmp_path / "rank0.pid"
    script = _script(
        tmp_path,
        "fail.py",
        f"""
        import os, sys, time
        if os.environ["RANK"] == "0":
            open({str(pidfile)!r} + ".tmp", "w").write(str(os.getpid()))
            os.replace({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
            time.sleep(60)
            sys.exit(0)
        deadline = time.time() + 20
        while not os.path.exists({str(pidfile)!r}) and time.time() < deadline:
            time.sleep(0.02)
        sys.exit(3)
    """,
    )
    t0 = time.time()
    rc = local.main(["-n", "2", "--mode", "env", "--", str(script)])
    elapsed = time.time() - t0
    assert rc == 3
    assert elapsed < 15
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):  # rank 0 was stopped (and reaped)
        os.kill(pid, 0)


def test_local_env_mode_timeout(tmp_path):
    script = _script(tmp_path, "slow.py", "import time\ntime.sleep(60)\n")
    t0 = time.time()
    assert local.run_env(2, [sys.executable, str(script)], timeout=0.5) == 124
    assert time.time() - t0 < 12


def test_local_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        local.main(["-n", "0", "--mode", "env", "--", "x.py"])
    assert "at least 1 rank" in capsys.readouterr().err


def test_local_mpi_mode_without_mpiexec(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(local, "find_mpiexec", lambda: None)
    assert local.main(["-n", "2", "--mode", "mpi", "--", str(tmp_path / "x.py")]) == 2
    assert "no mpiexec" in capsys.readouterr().err


def test_local_mpi_mode(tmp_path, capfd):
    mpiexec = local.find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found")
    pytest.importorskip("mpi4py")
    script = _script(
        tmp_path,
        "mpi_hello.py",
        """
        import os
        from mpi4py import MPI
        c = MPI.COMM_WORLD
        os.write(1, f"mpirank {c.Get_rank()} {c.Get_size()}\\n".encode())
    """,
    )
    rc = local.main(["-n", "2", "--mode", "mpi", "--", str(script)])
    out = capfd.readouterr().out
    assert rc == 0, out
    # mpiexec forwards each rank's output in chunks that may share a line
    assert sorted(re.findall(r"mpirank (\d+) (\d+)", out)) == [("0", "2"), ("1", "2")]


@pytest.mark.parametrize(
    "local,allowed,cores,env,expected",
    [
        (8, 2, 2, {}, 1),  # 8 ranks on 2 cores: one thread each, never 0
        (2, 16, 16, {}, 8),  # the node's cores shared among its ranks
        (3, 16, 16, {}, 5),
        (1, 4, 4, {}, 4),  # one rank: every core
        (4, 6, 64, {}, 6),  # bound by the launcher to 6 cores: those are this rank's own
        (8, 2, 2, {"OMP_NUM_THREADS": "2"}, None),  # said by the user: torch follows it
    ],
)
def test_default_threads(local, allowed, cores, env, expected):
    from axo4d.dist.threads import default_threads

    assert default_threads(local, allowed, cores, env) == expected


def test_set_default_threads_in_a_rank():
    """A rank of 2 started without OMP_NUM_THREADS uses its share of the cores (at least one)."""
    code = (
        "import os, torch; from axo4d.dist.threads import set_default_threads; "
        "n = set_default_threads(2); print(n, torch.get_num_threads(), len(os.sched_getaffinity(0)), os.cpu_count())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    n, threads, allowed, cores = map(int, out.stdout.split())
    assert n == threads == (allowed if allowed < cores else max(1, allowed // 2)), out.stdout

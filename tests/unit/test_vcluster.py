"""Tests of launch.vcluster: command construction (pure) and, as root with ip/tc, a real set-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch import vcluster as V
from launch import vcluster_commands as VC
from tests.helpers import can_netns


def test_spec_names_and_addresses():
    s = VC.Spec(tag="123")
    assert s.namespaces() == ["axo4d-123-n0", "axo4d-123-n1"] and s.world_size == 8
    assert (s.address(0), s.address(1), s.prefix_len) == ("10.231.0.1", "10.231.0.2", 30)
    assert VC.Spec(nodes=3, tag="9").namespaces()[-1] == "axo4d-9-sw" and VC.Spec(nodes=3).prefix_len == 24


def test_setup_two_nodes_is_one_veth_in_a_slash_30():
    s = VC.Spec(tag="7")
    cmds = [" ".join(c) for c in VC.setup_commands(s)]
    assert cmds[:2] == ["ip netns add axo4d-7-n0", "ip netns add axo4d-7-n1"]
    assert "ip -n axo4d-7-n0 link add vc0 type veth peer name vc0 netns axo4d-7-n1" in cmds
    assert "ip -n axo4d-7-n0 addr add 10.231.0.1/30 dev vc0" in cmds
    assert "ip -n axo4d-7-n1 addr add 10.231.0.2/30 dev vc0" in cmds
    assert all(c.startswith("ip ") for c in cmds)  # nothing touches the host's interfaces
    assert all(" -n axo4d-7-" in c or c.startswith("ip netns add axo4d-7-") for c in cmds)
    assert VC.teardown_commands(s) == [["ip", "netns", "del", "axo4d-7-n0"], ["ip", "netns", "del", "axo4d-7-n1"]]


def test_shaping_commands_on_both_ends():
    s = VC.Spec(tag="7")
    assert VC.links(s) == [("axo4d-7-n0", "vc0"), ("axo4d-7-n1", "vc0")]
    netem = VC.shape_command(s, "axo4d-7-n0", "vc0")
    assert netem[:7] == ["tc", "-n", "axo4d-7-n0", "qdisc", "add", "dev", "vc0"]
    assert netem[8:13] == ["netem", "rate", "1gbit", "delay", "0.2ms"]
    tbf = VC.shape_command(VC.Spec(tag="7", qdisc="tbf"), "axo4d-7-n1", "vc0")
    assert tbf[8:11] == ["tbf", "rate", "1gbit"] and int(tbf[tbf.index("burst") + 1]) >= 32 * 1024
    assert VC.rate_bits("1gbit") == 1e9 and VC.rate_bits("500mbit") == 5e8 and VC.rate_bits("10mbps") == 8e7
    assert len(VC.links(VC.Spec(nodes=3))) == 6


def test_rank_placement_and_environment():
    s = VC.Spec(tag="5")
    assert VC.placement(s)[:5] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3), (4, 1, 0)]
    env = VC.rank_env(s, 6, 29511, base={"PATH": "/bin"})
    assert env["RANK"] == "6" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "2"
    assert env["LOCAL_WORLD_SIZE"] == "4" and env["MASTER_ADDR"] == "10.231.0.1" and env["MASTER_PORT"] == "29511"
    assert env["GLOO_SOCKET_IFNAME"] == "vc0" and env["PATH"] == "/bin"
    assert VC.rank_command(s, 5, ["python", "x.py"]) == ["ip", "netns", "exec", "axo4d-5-n1", "python", "x.py"]
    assert VC.rank_command(s, 3, ["a"])[3] == "axo4d-5-n0"


def test_rank_cores_share_the_machine_among_all_ranks():
    """Every rank of the cluster gets its own share of the machine's cores (rank order), not a
    whole node's: two 1-rank nodes on 2 cores get a core each, so axo4d's default threads are 1."""
    from axo4d.dist.threads import default_threads

    two = VC.Spec(nodes=2, ranks_per_node=1, tag="5")
    assert [VC.rank_cores(two, r, [0, 1]) for r in range(2)] == [[0], [1]]
    assert default_threads(1, len(VC.rank_cores(two, 0, [0, 1])), 2, env={}) == 1
    assert [VC.rank_cores(two, r, list(range(16))) for r in range(2)] == [list(range(8)), list(range(8, 16))]
    eight = VC.Spec(nodes=2, ranks_per_node=4, tag="5")
    assert [VC.rank_cores(eight, r, [0, 1]) for r in range(8)] == [[0], [1]] * 4
    assert [VC.rank_cores(eight, r, [2, 3, 5]) for r in range(4)] == [[2], [3], [5], [2]]
    assert VC.rank_cores(VC.Spec(nodes=2, ranks_per_node=2, tag="5"), 3, list(range(10))) == [6, 7]
    with pytest.raises(ValueError, match="no cores"):
        VC.rank_cores(two, 0, [])


def test_target_command_and_validation():
    assert VC.target_command(["axo4d.train", "--grid", "x=2"], "py") == [
        "py",
        "-u",
        "-m",
        "axo4d.train",
        "--grid",
        "x=2",
    ]
    assert VC.target_command(["-m", "m"], "py") == ["py", "-u", "-m", "m"]
    assert VC.target_command(["s.py", "a"], "py") == ["py", "-u", "s.py", "a"]
    with pytest.raises(ValueError, match="nothing to run"):
        VC.target_command([])
    for bad in (VC.Spec(nodes=1), VC.Spec(rate="fast"), VC.Spec(delay="1 ms"), VC.Spec(tag="a-b")):
        with pytest.raises(ValueError):
            VC.validate(bad)


def test_stale_namespaces():
    names = ["axo4d-11-n0", "axo4d-11-n1", "axo4d-22-n0", "axo4d-22-sw", "other", "axo4d-x-n0"]
    assert VC.stale_namespaces(names, lambda pid: pid == 11) == ["axo4d-22-n0", "axo4d-22-sw"]


def test_cli_usage_errors(capsys):
    assert V.main(["--nodes", "2"]) == 2
    assert "nothing to run" in capsys.readouterr().err


needs_netns = pytest.mark.skipif(not can_netns(), reason="needs root with ip netns and tc")


@needs_netns
def test_real_cluster_links_and_teardown():
    spec = VC.Spec(tag=f"{os.getpid()}t")
    with V.VCluster(spec, log=lambda s: None) as vc:
        assert set(spec.namespaces()) <= set(V.list_namespaces())
        intra = vc.measure(0, 0, 20)
        inter = vc.measure(1, 0, 20)
        assert inter < 1.3, f"inter-node stream {inter:.2f} Gbit/s is not limited to ~1 Gbit/s"
        assert intra > 1.5 * inter, f"intra-node {intra:.2f} Gbit/s not faster than inter-node {inter:.2f}"
        code = "import os; raise SystemExit(int(os.environ['RANK']) == 5 and 3)"
        assert vc.run([sys.executable, "-c", code], timeout=60) == 3  # a failing rank's status
        ok = "import os, sys; sys.exit(os.environ['GLOO_SOCKET_IFNAME'] != 'vc0')"
        assert vc.run([sys.executable, "-c", ok], timeout=60) == 0
        mine = sorted(os.sched_getaffinity(0))
        want = {r: VC.rank_cores(spec, r, mine) for r in range(spec.world_size)}
        bound = f"import os, sys; sys.exit(sorted(os.sched_getaffinity(0)) != {want}[int(os.environ['RANK'])])"
        assert vc.run([sys.executable, "-c", bound], timeout=60) == 0  # each rank on its own share
        vc.bind = False
        free = f"import os, sys; sys.exit(sorted(os.sched_getaffinity(0)) != {mine})"
        assert vc.run([sys.executable, "-c", free], timeout=60) == 0  # --no-bind: every core
    assert not set(spec.namespaces()) & set(V.list_namespaces())


@needs_netns
def test_teardown_on_failure_and_cleanup():
    spec = VC.Spec(tag=f"{os.getpid()}f")
    with pytest.raises(RuntimeError):
        with V.VCluster(spec, log=lambda s: None):
            raise RuntimeError("job failed")
    assert not set(spec.namespaces()) & set(V.list_namespaces())
    dead = "axo4d-999999999-n0"  # no such pid: stale
    subprocess.run(["ip", "netns", "add", dead], check=True)
    assert dead in V.cleanup(log=lambda s: None)
    assert dead not in V.list_namespaces()

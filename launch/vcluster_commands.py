"""The virtual cluster's plan as data (:mod:`launch.vcluster` runs it): the :class:`Spec` of nodes,
ranks and link shape, and the ``ip``/``tc`` commands, rank placement, environment and command line
that set it up and tear it down -- pure functions, tested without root.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable

PREFIX = "axo4d"
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-(n\d+|sw)$")


class VClusterError(RuntimeError):
    """The virtual cluster cannot be set up (not root, no ``ip``, a failing command)."""


@dataclass(frozen=True)
class Spec:
    """Shape and links of a virtual cluster."""

    nodes: int = 2
    ranks_per_node: int = 4
    rate: str = "1gbit"
    delay: str = "0.2ms"
    tag: str = field(default_factory=lambda: str(os.getpid()))
    mtu: int = 1500
    qdisc: str = "netem"
    """'netem' (rate and delay) or 'tbf' (rate only)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def ns(self, node: int) -> str:
        """Namespace of ``node``."""
        return f"{PREFIX}-{self.tag}-n{node}"

    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}-{self.tag}-sw"

    def namespaces(self) -> list[str]:
        """Every namespace this cluster creates (nodes, then the switch if any)."""
        return [self.ns(i) for i in range(self.nodes)] + ([self.switch_ns] if self.nodes > 2 else [])

    @property
    def ifname(self) -> str:
        """The inter-node interface inside every node namespace."""
        return "vc0"

    def address(self, node: int) -> str:
        """IPv4 address of ``node`` on its inter-node interface."""
        return f"10.231.0.{node + 1}"

    @property
    def prefix_len(self) -> int:
        return 30 if self.nodes == 2 else 24


def validate(spec: Spec) -> None:
    """Raise :class:`ValueError` for shapes or link settings that cannot work."""
    if not 2 <= spec.nodes <= 200:
        raise ValueError(f"--nodes {spec.nodes}: need 2..200 nodes")
    if spec.ranks_per_node < 1:
        raise ValueError(f"--ranks-per-node {spec.ranks_per_node}: need >= 1")
    if not re.fullmatch(r"\d+(\.\d+)?([kmg]?bit|[kmg]?bps)", spec.rate):
        raise ValueError(f"--rate {spec.rate!r}: use a tc rate such as 1gbit, 500mbit")
    if not re.fullmatch(r"\d+(\.\d+)?(us|ms|s)", spec.delay):
        raise ValueError(f"--delay {spec.delay!r}: use a tc time such as 0.2ms, 50us")
    if spec.qdisc not in ("netem", "tbf"):
        raise ValueError(f"qdisc {spec.qdisc!r}: netem or tbf")
    if not re.fullmatch(r"[A-Za-z0-9]+", spec.tag):
        raise ValueError(f"tag {spec.tag!r}: letters and digits only")


# ---- commands (pure) ---------------------------------------------------------------
def rate_bits(rate: str) -> float:
    """``'1gbit'`` -> 1e9 bits/s (tc units: bit = bits/s, bps = bytes/s)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", rate)
    if not m:
        raise ValueError(f"not a tc rate: {rate!r}")
    v = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return v * (8 if m.group(3) == "bps" else 1)


def shape_command(spec: Spec, ns: str, dev: str) -> list[str]:
    """``tc`` command shaping egress of ``dev`` in ``ns`` (netem, or tbf without delay)."""
    if spec.qdisc == "netem":
        return [
            "tc",
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "netem",
            "rate",
            spec.rate,
            "delay",
            spec.delay,
            "limit",
            "100000",
        ]
    burst = max(32 * 1024, int(rate_bits(spec.rate) / 8 / 1000))  # ~1 ms of traffic, >= 32 KiB
    return [
        "tc",
        "-n",
        ns,
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        spec.rate,
        "burst",
        str(burst),
        "latency",
        "50ms",
    ]


def links(spec: Spec) -> list[tuple[str, str]]:
    """``(namespace, device)`` of every veth end to shape."""
    if spec.nodes == 2:
        return [(spec.ns(0), spec.ifname), (spec.ns(1), spec.ifname)]
    out = [(spec.ns(i), spec.ifname) for i in range(spec.nodes)]
    return out + [(spec.switch_ns, f"p{i}") for i in range(spec.nodes)]


def setup_commands(spec: Spec) -> list[list[str]]:
    """Commands creating the namespaces, links and addresses (without shaping)."""
    cmds = [["ip", "netns", "add", ns] for ns in spec.namespaces()]
    cmds += [["ip", "-n", spec.ns(i), "link", "set", "lo", "up"] for i in range(spec.nodes)]
    if spec.nodes == 2:
        cmds.append(
            [
                "ip",
                "-n",
                spec.ns(0),
                "link",
                "add",
                spec.ifname,
                "type",
                "veth",
                "peer",
                "name",
                spec.ifname,
                "netns",
                spec.ns(1),
            ]
        )
    else:
        sw = spec.switch_ns
        cmds += [["ip", "-n", sw, "link", "add", "br0", "type", "bridge"], ["ip", "-n", sw, "link", "set", "br0", "up"]]
        for i in range(spec.nodes):
            cmds += [
                [
                    "ip",
                    "-n",
                    sw,
                    "link",
                    "add",
                    f"p{i}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    spec.ifname,
                    "netns",
                    spec.ns(i),
                ],
                ["ip", "-n", sw, "link", "set", f"p{i}", "master", "br0", "mtu", str(spec.mtu), "up"],
            ]
    for i in range(spec.nodes):
        ns = spec.ns(i)
        cmds += [
            ["ip", "-n", ns, "addr", "add", f"{spec.address(i)}/{spec.prefix_len}", "dev", spec.ifname],
            ["ip", "-n", ns, "link", "set", spec.ifname, "mtu", str(spec.mtu), "up"],
        ]
    return cmds


def teardown_commands(spec: Spec) -> list[list[str]]:
    """Commands removing everything (deleting a namespace removes its veth ends)."""
    return [["ip", "netns", "del", ns] for ns in spec.namespaces()]


def placement(spec: Spec) -> list[tuple[int, int, int]]:
    """``(rank, node, local_rank)`` for every rank: ``rank = node * ranks_per_node + local``."""
    rpn = spec.ranks_per_node
    return [(n * rpn + lr, n, lr) for n in range(spec.nodes) for lr in range(rpn)]


def rank_cores(spec: Spec, rank: int, cores: list[int]) -> list[int]:
    """The cores ``rank`` is bound to: the machine's ``cores`` shared among every rank of the cluster
    in rank order, ``len(cores) // world_size`` each (one, ``cores[rank % len(cores)]``, with as
    many ranks as cores or more). The virtual nodes share one machine's cores: unbound, every rank
    took a real node's share (axo4d's default intra-op threads: the node's cores over its ranks)
    and two 1-rank nodes on 2 cores ran 4 threads, each rank's compute slower than the link."""
    n, w = len(cores), spec.world_size
    if n == 0:
        raise ValueError("no cores to bind the ranks to")
    if w >= n:
        return [cores[rank % n]]
    per = n // w
    return cores[rank * per : (rank + 1) * per]


def rank_env(spec: Spec, rank: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of ``rank`` (torchrun style plus ``GLOO_SOCKET_IFNAME``)."""
    node, local = divmod(rank, spec.ranks_per_node)
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(local),
        LOCAL_WORLD_SIZE=str(spec.ranks_per_node),
        MASTER_ADDR=spec.address(0),
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=spec.ifname,
        AXO4D_VNODE=str(node),
    )
    return env


def rank_command(spec: Spec, rank: int, cmd: list[str]) -> list[str]:
    """``cmd`` wrapped to run inside ``rank``'s node namespace."""
    return ["ip", "netns", "exec", spec.ns(rank // spec.ranks_per_node), *cmd]


def target_command(argv: list[str], python: str = sys.executable) -> list[str]:
    """``MODULE ARGS`` -> ``python -u -m MODULE ARGS`` (a ``.py`` path runs as a script)."""
    if argv[:1] == ["-m"]:
        argv = argv[1:]
    if not argv:
        raise ValueError("nothing to run; usage: python -m launch.vcluster [options] -- MODULE [ARGS]")
    return [python, "-u", argv[0], *argv[1:]] if argv[0].endswith(".py") else [python, "-u", "-m", *argv]


def stale_namespaces(names: list[str], alive: Callable[[int], bool]) -> list[str]:
    """``axo4d-<pid>-*`` namespaces whose creating process ``pid`` is gone."""
    out = []
    for n in names:
        m = _NS_RE.match(n)
        if m and not alive(int(m.group(1))):
            out.append(n)
    return out

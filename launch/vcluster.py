"""A virtual cluster on one Linux machine: "nodes" are network namespaces.

    sudo python -m launch.vcluster [--nodes 2 --ranks-per-node 4 --rate 1gbit --delay 0.2ms] -- MODULE [ARGS]
    sudo python -m launch.vcluster --check                 # set up, measure links, tear down
    sudo python -m launch.vcluster --cleanup               # remove stale axo4d-* namespaces

Each node is a namespace ``axo4d-<pid>-n<i>`` with its loopback up. With two
nodes, a veth pair joins them directly (``10.231.0.1/30`` and ``10.231.0.2/30``);
with more, every node has a veth to a bridge in ``axo4d-<pid>-sw``
(``10.231.0.<i+1>/24``). Only these namespaces hold the addresses. The
inter-node link is shaped on both ends of every veth with
``tc qdisc ... netem rate RATE delay DELAY``; kernels without ``sch_netem``
get ``tbf`` (rate only, no added delay; a warning says so).

Rank ``node * ranks_per_node + local`` runs in node ``node`` via ``ip netns
exec`` with a torchrun-style environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` = node 0's veth address,
``MASTER_PORT``) and ``GLOO_SOCKET_IFNAME`` = the node's veth: gloo binds to
that address, so ranks of one node talk through their namespace's local route
(fast, like a node's shared memory) and ranks of different nodes over the
shaped veth. With the grid's default order (x fastest) and 4 ranks a node,
x-groups of up to 4 stay inside a node. Output streams through; the exit
status is the first failing rank's; namespaces are removed at the end, also
on failure, Ctrl-C or SIGTERM. Each rank is bound to its share of this machine's cores
(:func:`~launch.vcluster_commands.rank_cores`: one core each with as many ranks as cores), so a
"node" computes with the cores it really has and axo4d's default threads follow them
(``--no-bind`` leaves the ranks free). Needs root (``CAP_NET_ADMIN``) and ``ip``/``tc``. The commands and
the placement, as data: :mod:`launch.vcluster_commands`.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import IO, Callable

from launch.local import pid_alive, wait_all
from launch.vcluster_commands import (
    _NS_RE,
    Spec,
    VClusterError,
    links,
    placement,
    rank_command,
    rank_cores,
    rank_env,
    setup_commands,
    shape_command,
    stale_namespaces,
    target_command,
    teardown_commands,
    validate,
)
from launch.vcluster_probe import ProbeError, iter_checks, measure_stream


# ---- running ---------------------------------------------------------------------------
def _sh(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise VClusterError(f"command {cmd[0]!r} not found: install iproute2 (ip, tc)") from None
    if check and p.returncode != 0:
        raise VClusterError(f"{' '.join(cmd)} failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def list_namespaces() -> list[str]:
    """Names from ``ip netns list`` (first word of each line)."""
    return [line.split()[0] for line in _sh(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def cleanup(force: bool = False, log: Callable[[str], None] = print) -> list[str]:
    """Delete stale ``axo4d-*`` namespaces (all of them with ``force``); returns their names."""
    names = list_namespaces()
    gone = [n for n in names if _NS_RE.match(n)] if force else stale_namespaces(names, pid_alive)
    for n in gone:
        _sh(["ip", "netns", "del", n], check=False)
        log(f"vcluster: removed namespace {n}")
    return gone


class VCluster:
    """Context manager: namespaces and shaped links up on enter, removed on exit."""

    def __init__(self, spec: Spec, log: Callable[[str], None] | None = None, bind: bool = True) -> None:
        validate(spec)
        self.spec, self.bind = spec, bind
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.shaping = ""
        self._up = False

    def __enter__(self) -> VCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Create namespaces, links, addresses and shaping (undone on any failure)."""
        if os.geteuid() != 0:
            raise VClusterError("launch.vcluster needs root (ip netns, tc)")
        self._up = True
        try:
            for cmd in setup_commands(self.spec):
                _sh(cmd)
            self._shape()
        except BaseException:
            self.down()
            raise
        s = self.spec
        self.log(
            f"vcluster: {s.nodes} nodes x {s.ranks_per_node} ranks, namespaces {', '.join(s.namespaces())}; "
            f"inter-node link {self.shaping}"
        )

    def _shape(self) -> None:
        spec = self.spec
        pairs = links(spec)
        first = _sh(shape_command(spec, *pairs[0]), check=False)
        if first.returncode != 0 and spec.qdisc == "netem" and "unknown" in first.stderr.lower():
            self.log(
                f"vcluster: warning: qdisc netem unavailable in this kernel; shaping with tbf "
                f"(rate {spec.rate}, NO added delay)"
            )
            spec = self.spec = Spec(**{**spec.__dict__, "qdisc": "tbf"})
            _sh(shape_command(spec, *pairs[0]))
        elif first.returncode != 0:
            raise VClusterError(f"tc failed: {first.stderr.strip()}")
        for ns, dev in pairs[1:]:
            _sh(shape_command(spec, ns, dev))
        self.shaping = (
            f"netem rate {spec.rate} delay {spec.delay}"
            if spec.qdisc == "netem"
            else f"tbf rate {spec.rate} (no delay)"
        )

    def down(self) -> None:
        """Remove the namespaces (idempotent; errors are ignored)."""
        if not self._up:
            return
        for cmd in teardown_commands(self.spec):
            _sh(cmd, check=False)
        self._up = False

    def run(
        self,
        cmd: list[str],
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        port: int = 29500,
        log: IO | None = None,
    ) -> int:
        """Run ``cmd`` on every rank; first non-zero exit stops the rest (124 on timeout).
        Output streams to this process's stdout/stderr, or into ``log`` (a file)."""
        procs = []
        out = {} if log is None else {"stdout": log, "stderr": subprocess.STDOUT}
        cores = sorted(os.sched_getaffinity(0))
        for rank, _, _ in placement(self.spec):
            mine = rank_cores(self.spec, rank, cores) if self.bind else None
            procs.append(
                subprocess.Popen(
                    rank_command(self.spec, rank, cmd),
                    env=rank_env(self.spec, rank, port, env),
                    start_new_session=True,
                    preexec_fn=None if mine is None else (lambda c=mine: os.sched_setaffinity(0, c)),
                    **out,
                )
            )
        return wait_all(procs, timeout)

    def measure(self, server_node: int, client_node: int, mbytes: float = 50) -> float:
        """Gbit/s of one TCP stream from ``client_node`` to ``server_node``'s address."""
        try:
            return measure_stream(self.spec, server_node, client_node, mbytes)
        except ProbeError as e:
            raise VClusterError(str(e)) from None


# ---- CLI -----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m launch.vcluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=4)
    ap.add_argument("--rate", default="1gbit", help="inter-node rate per direction (tc units)")
    ap.add_argument("--delay", default="0.2ms", help="added one-way delay per link end (netem)")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds (exit 124)")
    ap.add_argument(
        "--no-bind", action="store_true", help="leave the ranks unbound (default: each bound to its share of the cores)"
    )
    ap.add_argument("--check", action="store_true", help="measure intra- and inter-node bandwidth")
    ap.add_argument("--cleanup", action="store_true", help="remove stale axo4d-* namespaces and exit")
    ap.add_argument("--force", action="store_true", help="with --cleanup: remove every axo4d-* namespace")
    return ap


def _on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the job's exit status (2: usage or set-up error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    args = _parser().parse_args(argv)
    try:
        if args.cleanup:
            cleanup(args.force)
            return 0
        if not rest and not args.check:
            raise ValueError("nothing to run; usage: python -m launch.vcluster [options] -- MODULE [ARGS]")
        spec = Spec(args.nodes, args.ranks_per_node, args.rate, args.delay, mtu=args.mtu)
        cmd = target_command(rest) if rest else []
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, _on_signal)
        with VCluster(spec, bind=not args.no_bind) as vc:
            if args.check:
                for what, gbps in iter_checks(vc):
                    print(f"vcluster: {what}: {gbps:.2f} Gbit/s", flush=True)
            return vc.run(cmd, timeout=args.timeout) if cmd else 0
    except (ValueError, VClusterError) as e:
        print(f"launch.vcluster: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

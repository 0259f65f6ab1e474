"""Bandwidth probe of a :mod:`launch.vcluster`: one TCP stream between two nodes.

``python -m launch.vcluster --check`` prints an intra-node and an inter-node
figure: ranks of one node talk through their namespace's local route (several
Gbit/s on this kind of host), ranks of different nodes over the shaped veth
(about the configured rate).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Iterator


class ProbeError(RuntimeError):
    """A bandwidth probe that could not run (:mod:`launch.vcluster` reports it as its own error)."""


_STREAM = r"""
import socket, sys, time
role, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role == "s":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, port)); s.listen(1)
    print("ready", flush=True); c, _ = s.accept(); got = 0
    while got < n:
        b = c.recv(1 << 20)
        if not b: break
        got += len(b)
    c.sendall(b"k")
else:
    c = socket.create_connection((host, port)); buf = bytes(1 << 20); t0 = time.perf_counter(); sent = 0
    while sent < n:
        c.sendall(buf[: n - sent]); sent += min(len(buf), n - sent)
    c.recv(1); print(n * 8 / (time.perf_counter() - t0) / 1e9)
"""


def measure_stream(spec: Any, server_node: int, client_node: int, mbytes: float = 50, port: int = 5201) -> float:
    """Gbit/s of one TCP stream (``mbytes`` MB) between two nodes (equal: within the node) of a
    :class:`launch.vcluster.Spec` (its ``address`` and ``ns``)."""
    n = str(int(mbytes * 1e6))
    addr = spec.address(server_node)
    srv = subprocess.Popen(
        ["ip", "netns", "exec", spec.ns(server_node), sys.executable, "-c", _STREAM, "s", addr, str(port), n],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if srv.stdout is None or srv.stdout.readline().strip() != "ready":
            raise ProbeError("bandwidth probe server did not start")
        cmd = ["ip", "netns", "exec", spec.ns(client_node), sys.executable, "-c", _STREAM, "c", addr, str(port), n]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise ProbeError(f"bandwidth probe client failed: {out.stderr.strip() or out.stdout.strip()}")
        return float(out.stdout.strip())
    finally:
        srv.wait(30)


def iter_checks(vc: Any, mbytes: float = 50) -> Iterator[tuple[str, float]]:
    """``(description, Gbit/s)`` for an intra-node and an inter-node stream."""
    yield "intra-node (node 0 -> node 0)", vc.measure(0, 0, mbytes)
    yield "inter-node (node 0 -> node 1)", vc.measure(1, 0, mbytes)

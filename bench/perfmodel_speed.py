"""Time ``perfmodel rank`` on the two cases of issue 30 item 3 (gpt-80b on Perlmutter, 4,096 and
32,768 GPUs, batch 2,048)::

    python -m bench.perfmodel_speed            # both cases (targets: <= 3 s and <= 15 s on one idle core)
    python -m bench.perfmodel_speed --smoke    # a tiny case (the unit test's)
    python -m bench.perfmodel_speed --moe      # qwen3-30b-a3b on 128 GPUs of Alps (minutes)

Prints, per case, the CPU seconds of this process (user + system: what the search costs,
whatever else the machine runs), the wall seconds, the load average (wall time is only meaningful
on an idle machine) and the best grid; then the CPU seconds of a fixed pure-Python loop
(:func:`host_seconds`, code that no change to ``perfmodel`` touches) and each case in units of it,
so that figures taken on hosts of different speed can be compared (machines of one kind here have
differed by nearly 3x in this loop's time).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import sys
import time

from perfmodel.__main__ import main as perfmodel_main

CASES = {
    "gpt-80b-4096": "rank --model gpt-80b --gpus 4096 --gpus-per-node 4 --batch 2048 --machine perlmutter",
    "gpt-80b-32768": "rank --model gpt-80b --gpus 32768 --gpus-per-node 4 --batch 2048 --machine perlmutter",
}
MOE = {"qwen3-30b-a3b-128": "rank --model qwen3-30b-a3b --gpus 128 --gpus-per-node 4 --batch 512 --machine alps"}
SMOKE = {"gpt-5b-8": "rank --model gpt-5b --gpus 8 --batch 16 --seq 1024 --machine perlmutter --top 2"}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def time_case(args: str) -> tuple[float, float, str]:
    """``(cpu seconds, wall seconds, the first row of the table)`` of one ``perfmodel`` command."""
    out = io.StringIO()
    c0, w0 = _cpu(), time.perf_counter()
    with contextlib.redirect_stdout(out):
        rc = perfmodel_main(args.split())
    cpu, wall = _cpu() - c0, time.perf_counter() - w0
    if rc != 0:
        raise SystemExit(f"perfmodel {args} exited with {rc}")
    rows = [ln for ln in out.getvalue().splitlines() if ln.strip().startswith("1 ")]
    return cpu, wall, " ".join(rows[0].split()[1:3]) if rows else "no feasible grid"


def host_seconds(n: int = 2_000_000) -> float:
    """CPU seconds of a fixed loop of dictionary, float and call work (what a ranking spends its
    time on), the host's speed for this benchmark."""
    c0 = _cpu()
    d: dict[int, float] = {}
    for i in range(n):
        k = i & 1023
        d[k] = d.get(k, 0.0) + max(0.5 * i, 1.0) ** 0.5
    return _cpu() - c0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.perfmodel_speed", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one tiny case (seconds)")
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts case (minutes)")
    args = ap.parse_args(argv)
    cpus = {}
    for name, cmd in (SMOKE if args.smoke else MOE if args.moe else CASES).items():
        cpu, wall, best = time_case(cmd)
        cpus[name] = cpu
        load = os.getloadavg()[0]
        print(f"{name:14s} cpu_s {cpu:7.2f}  wall_s {wall:7.2f}  load {load:5.2f}  best {best}", flush=True)
    host = host_seconds(200_000 if args.smoke else 2_000_000) * (10 if args.smoke else 1)
    units = ", ".join(f"{k} {v / host:.2f}" for k, v in cpus.items())
    print(f"host: the fixed loop took {host:.3f} CPU-s; in its units: {units}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

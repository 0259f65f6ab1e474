"""The largest GPT that trains 3 steps on the devices here, per memory mode (docs/design.md s9).

    python -m bench.capacity                    # CPU: hidden 128, a 96 MiB "device" per rank (minutes)
    python -m bench.capacity --device cuda      # GPUs (H200: hidden 5120, seq 2048, vocab 50257, batch 1)
    python -m bench.capacity --modes sharded --cap-mib 200 --host-mib 400 --hidden 128
    python -m bench.capacity --device cuda --predict --cap-mib 140288 --host-mib 122880   # no runs

One H200 (141 GB; a full search takes too long for a short lease): the memory model's fits
(``--predict``: 25 layers = 8.4B parameters for axo4d, 43 = 14.1B with offload, 40 =
13.1B sharded on 2 GPUs) bracketed (estimated 6-10 minutes; not yet run on a GPU)::

    python -m bench.capacity --device cuda --modes plain,axo4d,offload --timeout 150 \
        --layers "plain=26,27;axo4d=25,26;offload=43,44"

``sharded`` and ``unsharded-2`` need one GPU per rank (2); on one GPU they are skipped.

Modes, each at a fixed hidden size with a growing number of layers (activation checkpointing on;
bf16 autocast on a GPU, fp32 on CPU):

* ``plain``: :class:`axo4d.models.plain.PlainGPT` with ``torch.optim.AdamW`` (fused on CUDA) --
  plain PyTorch, one rank;
* ``axo4d``: the axo4d trainer on one rank (grid 1x1x1x1);
* ``sharded``: the axo4d trainer on 2 ranks, ``data=2``, with the sharded optimizer (the cap is
  per rank); ``unsharded-2`` is the same without it (the comparison row);
* ``offload``: the axo4d trainer on one rank with ``train.offload=auto`` (optimizer state on the
  device as far as the memory model fits it, the rest in host memory).

Each candidate runs in fresh processes (``launch.local``'s spawner) with the device budget given
to axo4d as ``train.memory_budget_gb`` (its memory model refuses what it predicts will not fit:
"refused") and, on CPU, a hard address-space limit (``RLIMIT_AS``, ulimit -v style) of cap + host
cap + slack, so an allocation beyond it fails as a GPU's would ("oom"). On CPU the "device" is
measured as peak RSS minus the RSS before the model was built, minus the bytes of offloaded
(host) state, which the optimizer counts exactly; a candidate fits when it trains and that is
within the cap. On a GPU: ``torch.cuda.max_memory_allocated`` and out-of-memory errors.

The search starts at the memory model's largest predicted fit and walks up (doubling the step)
and down, then bisects: a handful of runs per mode. Printed per mode: layers, parameters, peak
device and host memory (measured and predicted), step time, optimizer state bytes per rank.
Then the measured ratio of optimizer bytes per rank, sharded / unsharded, on the same model
(the CPU target: 0.5 with data=2). What each spawned rank of a candidate runs:
:mod:`bench.capacity_worker`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.capacity_worker import GIB, MIB, MODES, worker

CPU_SHAPE = {
    "hidden": 128,
    "heads": 4,
    "seq": 32,
    "vocab": 256,
    "batch": 2,
    "cap_mib": 96,
    "host_mib": 192,
    "bucket_mb": 1.0,
}
GPU_SHAPE = {
    "hidden": 5120,
    "heads": 40,
    "seq": 2048,
    "vocab": 50257,
    "batch": 1,
    "cap_mib": 0,
    "host_mib": 0,
    "bucket_mb": 25.0,
}
#: address space a CPU rank may take beyond its caps before the hard limit (threads, arenas, libraries)
AS_SLACK = 768 * MIB
#: glibc: blocks from this size on are mmap'ed (a fixed threshold: freed tensors leave the RSS)
MMAP_THRESHOLD = 128 * 1024


def overrides(a: argparse.Namespace, mode: str, layers: int) -> list[str]:
    """The config of one candidate (config ``tiny`` with these ``--set`` values)."""
    m = MODES[mode]
    out = [
        f"model.n_layer={layers}",
        f"model.n_embd={a.hidden}",
        f"model.n_head={a.heads}",
        f"model.seq_len={a.seq}",
        f"model.vocab_size={a.vocab}",
        "model.vocab_multiple=64",
        f"train.global_batch={a.batch * m['ranks']}",
        "train.grad_accum=1",
        f"train.steps={a.steps}",
        "train.activation_checkpointing=true",
        "train.eval_interval=0",
        "parallel.tuner=false",
        "parallel.timeout_s=60",
        f"parallel.dp_bucket_mb={a.bucket_mb!r}",
        "data.max_tokens=300000",
        *m["sets"],
    ]
    if a.cap_mib:
        out.append(f"train.memory_budget_gb={a.cap_mib * MIB / GIB!r}")
    if a.host_mib:
        out.append(f"train.host_memory_gb={a.host_mib * MIB / GIB!r}")
    return out


# ---- the search, in the driver process ------------------------------------------------------------------
def run(a: argparse.Namespace, mode: str, layers: int) -> dict:
    """Train one candidate in fresh processes; its rank-0 record plus ``fits``."""
    from launch.local import run_env

    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "mode": mode,
            "sets": overrides(a, mode, layers),
            "out": str(Path(tmp) / "r"),
            "hard_limit": (a.cap_mib + a.host_mib) * MIB + AS_SLACK if a.device == "cpu" else 0,
        }
        env = dict(os.environ)
        os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
        if a.device == "cpu":  # one thread per rank (OpenMP spinning on a shared machine costs more than
            os.environ.setdefault("OMP_NUM_THREADS", "1")  # it gains); large blocks mmap'ed and returned on
            os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))  # free: RSS follows live tensors
        try:
            run_env(
                MODES[mode]["ranks"],
                [sys.executable, "-m", "bench.capacity", "--worker", json.dumps(spec)],
                timeout=a.timeout,
            )
        finally:
            os.environ.clear()
            os.environ.update(env)
        recs = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("r.*.json"))]
    if not recs:
        return {"layers": layers, "status": "failed", "why": "no rank reported", "fits": False}
    r = next((x for x in recs if x["status"] != "ok"), recs[0])
    r["layers"] = layers
    if a.device == "cpu" and r["status"] == "ok":
        r["device_measured"] = max(x["tensors"] - x.get("host_state", 0) for x in recs)
        r["fits"] = r["device_measured"] <= a.cap_mib * MIB and r.get("host_state", 0) <= a.host_mib * MIB
        if not r["fits"]:
            r["status"] = "over cap (measured)"
    else:
        r["device_measured"] = r.get("device_peak", 0)
        r["fits"] = r["status"] == "ok"
    return r


def predicted_layers(a: argparse.Namespace, mode: str) -> int:
    """The most layers the memory model fits within the caps (a starting point of the search)."""
    import torch

    from axo4d.config import load_config
    from axo4d.config.errors import MemoryBudgetError
    from axo4d.facts.grid import Grid
    from axo4d.training.memory_plan import plan_memory

    dev = torch.device("cuda" if a.device == "cuda" else "cpu")
    m = "axo4d" if mode == "plain" else mode
    grid = Grid.parse(MODES[m]["grid"])

    def fits(layers: int) -> bool:
        try:
            plan_memory(load_config("tiny", overrides(a, m, layers), MODES[m]["grid"]), grid, dev)
            return True
        except MemoryBudgetError:
            return False

    lo, hi = 0, 1
    while fits(hi) and hi < a.max_layers:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return max(1, min(lo, a.max_layers))


def largest(a: argparse.Namespace, mode: str) -> tuple[dict, list[dict]]:
    """The largest fitting candidate of ``mode`` and every run tried."""
    tried: dict[int, dict] = {}

    def ok(layers: int) -> bool:
        if layers not in tried:
            tried[layers] = run(a, mode, layers)
            r = tried[layers]
            print(
                f"  {mode:12s} {layers:4d} layers: {r['status']:8s} device {r.get('device_measured', 0) / MIB:8.1f} MiB"
                + (f"  ({r['why'][:150]})" if r.get("why") else ""),
                flush=True,
            )
        return tried[layers]["fits"]

    given = a.layers.get(mode, a.layers.get("*"))
    if given:  # the given candidates only, smallest first
        fit = [n for n in sorted(given) if ok(n)]
        best = tried[fit[-1]] if fit else {"layers": 0, "status": "nothing fits", "fits": False}
        return best, [tried[k] for k in sorted(tried)]
    start = predicted_layers(a, mode)
    lo, hi, step = (start, None, 1) if ok(start) else (None, start, 1)
    while hi is None and lo < a.max_layers:  # walk up, doubling the step
        nxt = min(a.max_layers, lo + step)
        lo, hi, step = (nxt, None, step * 2) if ok(nxt) else (lo, nxt, step)
    while lo is None:  # walk down, doubling the step
        nxt = max(0, hi - step)
        lo, hi, step = (nxt, hi, step) if nxt == 0 or ok(nxt) else (None, nxt, step * 2)
    while hi is not None and hi - lo > 1:  # bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    best = tried.get(lo, {"layers": 0, "status": "nothing fits", "fits": False})
    return best, [tried[k] for k in sorted(tried)]


def report(a: argparse.Namespace, results: dict[str, dict]) -> None:
    hw = "CPU ranks" if a.device == "cpu" else "one GPU per rank"
    print(
        f"\nlargest GPT trained {a.steps} steps ({hw}; hidden {a.hidden}, {a.heads} heads, seq {a.seq}, vocab "
        f"{a.vocab}, micro-batch {a.batch} per rank, activation checkpointing"
        + (f"; cap {a.cap_mib} MiB device + {a.host_mib} MiB host per rank" if a.cap_mib else "")
        + ")"
    )
    print(
        f"{'mode':12s} {'ranks':>5s} {'layers':>6s} {'params':>9s} {'device MiB':>11s} {'(pred.)':>8s} "
        f"{'host MiB':>9s} {'(pred.)':>8s} {'opt. state/rank MiB':>20s} {'step s':>7s}"
    )
    for mode, r in results.items():
        if not r.get("fits"):
            print(f"{mode:12s} {MODES[mode]['ranks']:5d}  nothing fits ({r.get('status')})")
            continue
        st = r.get("device_state", 0) + r.get("host_state", 0)
        print(
            f"{mode:12s} {MODES[mode]['ranks']:5d} {r['layers']:6d} {r['params'] / 1e6:8.1f}M "
            f"{r['device_measured'] / MIB:11.1f} {r.get('pred_device', 0) / MIB:8.1f} "
            f"{r.get('host_state', 0) / MIB:9.1f} {r.get('pred_host', 0) / MIB:8.1f} "
            f"{st / MIB:12.1f} ({r.get('host_state', 0) / MIB:.0f} host) {r['step_s']:7.3f}"
        )
    base = results.get("plain") or results.get("axo4d")
    if base and base.get("fits"):
        for mode, r in results.items():
            if r.get("fits") and mode != "plain":
                print(
                    f"  {mode}: {r['params'] / base['params']:.2f}x the parameters of "
                    f"{'plain PyTorch' if 'plain' in results else 'axo4d'}"
                )


def compare_sharding(a: argparse.Namespace, layers: int) -> None:
    """Optimizer bytes per rank with and without the sharded optimizer on data=2, same model."""
    un, sh = run(a, "unsharded-2", layers), run(a, "sharded", layers)
    if un["status"] == "ok" and sh["status"] == "ok":
        print(
            f"\nsame model ({layers} layers, {un['params'] / 1e6:.1f}M parameters) on data=2: optimizer state per "
            f"rank {un['device_state'] / MIB:.2f} MiB unsharded, {sh['device_state'] / MIB:.2f} MiB sharded: "
            f"ratio {sh['device_state'] / un['device_state']:.3f} (measured from the state tensors); peak device "
            f"{un['device_measured'] / MIB:.1f} -> {sh['device_measured'] / MIB:.1f} MiB"
        )
    else:
        print(f"\nsame-model comparison at {layers} layers did not run: {un['status']} / {sh['status']}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--modes", default="plain,axo4d,sharded,offload")
    for k in ("hidden", "heads", "seq", "vocab", "batch", "cap_mib", "host_mib"):
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--bucket-mb", type=float, default=None, help="parallel.dp_bucket_mb")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-layers", type=int, default=512)
    ap.add_argument(
        "--layers",
        default="",
        help="layer counts to try instead of the search: '20,21' (every mode) or 'plain=25,26;offload=43,44'",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per candidate run")
    ap.add_argument(
        "--predict",
        action="store_true",
        help="print the memory model's largest fit per mode "
        "within the caps and stop (no runs; picks --layers for a short GPU run)",
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    shape = GPU_SHAPE if a.device == "cuda" else CPU_SHAPE
    for k, v in shape.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.layers = {
        (part.split("=")[0].strip() if "=" in part else "*"): [
            int(x) for x in part.split("=")[-1].split(",") if x.strip()
        ]
        for part in a.layers.split(";")
        if part.strip()
    }
    if a.device == "cuda" and not a.cap_mib and not a.worker:
        a.cap_mib, a.host_mib = _gpu_caps()
    return a


def _gpu_caps() -> tuple[int, int]:
    """(device, host) MiB per rank on this GPU machine, asked in a child process so that this
    one never holds a CUDA context: the GPU's memory minus axo4d's reserve; available host memory."""
    import subprocess

    from axo4d.training.memory_plan import GPU_RESERVE_BYTES
    from axo4d.training.optim.offload import available_host_bytes

    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.get_device_properties(0).total_memory)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return (int(out.split()[-1]) - GPU_RESERVE_BYTES) // MIB, available_host_bytes() // MIB


def _gpu_count() -> int:
    """GPUs visible here, asked in a child process (this one never holds a CUDA context)."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.split()[-1])


def _params(a: argparse.Namespace, mode: str, layers: int) -> int:
    from axo4d.config import load_config
    from axo4d.facts.archs import model_spec
    from axo4d.facts.grid import Grid

    m = "axo4d" if mode == "plain" else mode
    cfg = load_config("tiny", overrides(a, m, layers), MODES[m]["grid"])
    return model_spec(cfg.model, Grid.parse(MODES[m]["grid"])).param_count()


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(json.loads(a.worker))
    from axo4d.config import load_config
    from axo4d.training.datasets.dataset import prepare_tokens

    prepare_tokens(load_config("tiny", ["data.max_tokens=300000"]).data)
    results = {}
    gpus = _gpu_count() if a.device == "cuda" and not a.predict else 0
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        if mode not in MODES:
            raise SystemExit(f"bench.capacity: unknown mode {mode!r}; valid: {', '.join(MODES)}")
        if a.predict:
            from axo4d.training.memory_plan import fmt_count

            n = predicted_layers(a, mode)
            print(
                f"  {mode:12s} memory model's largest fit: {n} layers ({fmt_count(_params(a, mode, n))} parameters)",
                flush=True,
            )
            continue
        if a.device == "cuda" and MODES[mode]["ranks"] > gpus:
            print(f"  {mode}: skipped: needs {MODES[mode]['ranks']} GPUs (one per rank), {gpus} here", flush=True)
            continue
        t0 = time.perf_counter()
        results[mode], _ = largest(a, mode)
        print(f"  {mode}: largest {results[mode]['layers']} layers ({time.perf_counter() - t0:.0f} s)", flush=True)
    if a.predict:
        return 0
    report(a, results)
    ref = next((r for r in results.values() if r.get("fits")), None)
    if ref is not None and a.device == "cpu":
        compare_sharding(a, max(1, ref["layers"] // 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The BLAS tuner's choice per layer and GEMM, and its speed-up over the default layout.

    python -m bench.tuner                      # CPU: 2 layers, hidden 256, seq 128, batch 4, fp32
    python -m bench.tuner --config gpt-1.3b    # on a GPU: gpt-1.3b shapes, micro-batch 8, bf16
    python -m bench.tuner --hidden 1024 --seq 256 --reps 5

Builds :class:`axo4d.models.gpt.GPT` on the 1x1x1x1 grid with a fresh :class:`axo4d.nn.blas_tuner.GemmTuner`
(a temporary cache, so every key is timed), runs one forward and backward, and prints for each
layer's forward, dX and dW GEMM the time of every layout variant, the chosen one and its
speed-up over ``a@b`` (the layout used without the tuner). Then it times whole forward+backward
passes with the tuner's decisions against no tuner.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from axo4d.config import ModelConfig, load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.models.gpt import GPT
from axo4d.nn.blas_tuner import VARIANTS, GemmTuner, device_name
from axo4d.nn.context import LayerContext
from axo4d.nn.schedule import Schedule


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.tuner", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="", help="named model config (default: small CPU shape; gpt-1.3b on GPU)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="micro-batch (default 4 on CPU, 8 on GPU)")
    ap.add_argument("--reps", type=int, default=0, help="timing repetitions per variant (default 3 CPU, 10 GPU)")
    ap.add_argument("--passes", type=int, default=5, help="timed forward+backward passes per mode")
    return ap.parse_args(argv)


def model_config(a: argparse.Namespace, cuda: bool) -> ModelConfig:
    name = a.config or ("gpt-1.3b" if cuda else "")
    if name:
        return load_config(name).model
    return ModelConfig(n_layer=a.layers, n_embd=a.hidden, n_head=4, vocab_size=256, seq_len=a.seq, vocab_multiple=64)


def fwd_bwd_times(model: GPT, x, y, dtype, passes: int) -> float:
    out = []
    for i in range(passes + 1):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x, y).float().mean()
        loss.backward()
        if x.is_cuda:
            torch.cuda.synchronize()
        if i:
            out.append(time.perf_counter() - t0)
    return statistics.median(out) if out else float("nan")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = model_config(a, cuda)
    batch = a.batch or (8 if cuda else 4)
    comm = Comm(Grid(), 0, init_groups=False)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g).to(device) for _ in "xy")
    with tempfile.TemporaryDirectory() as tmp:
        tuner = GemmTuner(comm, f"{tmp}/tuner.json", reps=a.reps or None, verbose=False)
        tuned = GPT(cfg, LayerContext(comm, Schedule(comm), tuner)).to(device)
        fwd_bwd_times(tuned, x, y, dtype, 0)  # first pass: every key timed
    print(
        f"bench.tuner on {device_name(device)}: GPT {cfg.n_layer} layers, hidden {cfg.n_embd}, seq {cfg.seq_len}, "
        f"micro-batch {batch}, {dtype}; {tuner.timed} GEMM keys timed"
    )
    print(
        f"  {'layer':10s} {'gemm':4s} {'A@B shapes, layouts':30s} "
        + " ".join(f"{v:>14s}" for v in VARIANTS)
        + f"  {'chosen':14s} {'speed-up':>8s}"
    )
    for r in tuner.rows():
        ms = " ".join(f"{m:12.3f}ms" if m is not None else f"{'-':>14s}" for m in r["ms"])
        shape = r["key"].split("|")[1] + " " + r["key"].split("|")[2]
        print(f"  {r['layer']:10s} {r['gemm']:4s} {shape:30s} {ms}  {r['variant']:14s} {r['speedup']:8.2f}")
    plain = GPT(cfg, comm).to(device)
    plain.load_state_dict(tuned.state_dict())
    t_tuned = fwd_bwd_times(tuned, x, y, dtype, a.passes)
    t_plain = fwd_bwd_times(plain, x, y, dtype, a.passes)
    t_tuned2 = fwd_bwd_times(tuned, x, y, dtype, a.passes)  # again: machine drift shows
    print(
        f"  forward+backward: default layouts {t_plain * 1e3:.1f} ms, tuned {t_tuned * 1e3:.1f} / "
        f"{t_tuned2 * 1e3:.1f} ms (before/after) -> speed-up {t_plain / min(t_tuned, t_tuned2):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

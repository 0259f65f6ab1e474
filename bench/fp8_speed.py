"""FP8 against bf16 on one device, compiled, in the same run: step time, TFLOP/s and the loss.

    python -m bench.fp8_speed                       # gpt-1.3b and llama3.2-1b on one GPU (H100/H200), ~4 min
    python -m bench.fp8_speed --recipes tensorwise,rowwise --steps 50
    python -m bench.fp8_speed --reduced             # CPU, small shapes: checks the script, times nothing

For each model, contenders built as training builds them on the 1x1x1x1 grid (overlapped schedule,
``train.compile``: each block and the head compiled): ``bf16`` (autocast) and ``fp8 <recipe>``
(``train.fp8=<recipe>``, layers by the rule ``train.fp8_layers=auto``; ``--reduced``: ``all``, the
rule leaving every small layer in bf16). Every contender trains ``--steps`` steps from the same
initialisation on the same batches of the embedded corpus (the Python standard library, bytes),
AdamW as the trainer's; the step time is the median after ``--warmup`` steps; TFLOP/s by
``6*N_matmul*tokens + 12*l*h*s*tokens`` per step (docs/design.md section 5), MFU against the vendor's
dense bf16 peak (H100/H200: 989). The ratio is bf16 step time / FP8 step time (target >= 1.25 on
gpt-1.3b, issue 23); "equal loss": the mean loss of the last 10 steps within 2% of bf16's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from axo4d.config import DataConfig, ModelConfig, TrainConfig, load_config
from axo4d.dist.comm import Comm
from axo4d.facts.archs import model_spec
from axo4d.facts.fp8_rule import fp8_layer_names
from axo4d.facts.grid import Grid
from axo4d.models import apply_compile, build_model
from axo4d.nn.context import LayerContext
from axo4d.nn.fp8_plan import plan
from axo4d.nn.overlap_schedule import OverlapSchedule
from axo4d.training.datasets.batches import StepPlan
from axo4d.training.datasets.dataset import open_dataset
from axo4d.training.optim.build import plain_adamw
from axo4d.training.perf import device_peaks

TAIL = 10


def build(cfg: ModelConfig, recipe: str, layers: str, device: torch.device, compiled: bool):
    """(model, optimizer) on one device, FP8 by ``recipe`` ('' = none), initialised from seed 0."""
    comm = Comm(Grid(), 0, init_groups=False)
    fp8 = plan(recipe, fp8_layer_names(model_spec(cfg, Grid()), recipe, layers)) if recipe else None
    model = build_model(cfg, LayerContext(comm, OverlapSchedule(comm), None, fp8), seed=0).to(device)
    if compiled:
        apply_compile(model)
    return model, plain_adamw(model, TrainConfig(), device)


def train(model, opt, batches, device, dtype) -> tuple[list[float], list[float]]:
    """(step seconds, losses) of one training step per batch."""
    times, losses = [], []
    for x, y in batches:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = model(x, y).float().mean()
        loss.backward()
        model.finish_gradients()
        opt.step()
        losses.append(float(loss.detach()))  # syncs
        times.append(time.perf_counter() - t0)
    return times, losses


def one_model(cfg: ModelConfig, batch: int, a: argparse.Namespace, device, dtype) -> dict:
    data = open_dataset(DataConfig(source="stdlib", max_tokens=4_000_000), cfg.seq_len, 0, cfg.vocab_size)
    plan = StepPlan(data, batch, 1)
    batches = [(b.x, b.y) for b in (data.batch("train", plan.samples(s)[1], device) for s in range(a.steps))]
    spec = model_spec(cfg, Grid())
    flops = spec.flops_per_step(batch)
    peaks = device_peaks(device, dtype)
    out = {"arch": cfg.arch, "layers": cfg.n_layer, "hidden": cfg.n_embd, "batch": batch, "seq": cfg.seq_len}
    out.update({"flops_per_step": flops, "formula": spec.flops_formula(), "contenders": {}})
    layers = "all" if a.reduced else "auto"
    for recipe in ["", *[r for r in a.recipes.split(",") if r]]:
        name = f"fp8 {recipe}" if recipe else "bf16"
        model, opt = build(cfg, recipe, layers, device, not a.no_compile)
        times, losses = train(model, opt, batches, device, dtype)
        med = statistics.median(times[a.warmup :])
        tf = flops / med / 1e12
        fp8_on = fp8_layer_names(spec, recipe, layers) if recipe else ()
        out["contenders"][name] = {
            "median_s": med,
            "tflops": tf,
            "mfu": peaks.mfu(tf),
            "loss_tail": sum(losses[-TAIL:]) / len(losses[-TAIL:]),
            "losses": losses,
            "fp8_layers": list(fp8_on),
        }
        print(
            f"  {name:16s} median {med * 1e3:9.1f} ms  {tf:8.3f} TFLOP/s"
            + (f"  MFU {100 * peaks.mfu(tf):5.1f}%" if peaks.mfu(tf) is not None else "  MFU n/a")
            + f"  loss (last {TAIL}) {out['contenders'][name]['loss_tail']:.4f}"
            + (f"  FP8 in {', '.join(fp8_on) or 'no layer'}" if recipe else ""),
            flush=True,
        )
        del model, opt
        if not a.no_compile:
            torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = out["contenders"]["bf16"]
    for name, c in out["contenders"].items():
        if name != "bf16":
            c["speedup"] = base["median_s"] / c["median_s"]
            c["loss_rel"] = c["loss_tail"] / base["loss_tail"] - 1
            ok = c["speedup"] >= 1.25 and abs(c["loss_rel"]) <= 0.02
            print(
                f"  {name} vs bf16: step-time ratio {c['speedup']:.3f} (target >= 1.25), "
                f"loss {100 * c['loss_rel']:+.2f}% (within 2%: {abs(c['loss_rel']) <= 0.02}) "
                f"-> {'MET' if ok else 'NOT MET'}",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="", help="comma-separated configs (default gpt-1.3b,llama3.2-1b)")
    ap.add_argument("--recipes", default="tensorwise", help="FP8 recipes to run beside bf16")
    ap.add_argument("--steps", type=int, default=0, help="steps per contender (default 50; reduced 6)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps (default 5; reduced 2)")
    ap.add_argument("--batch", type=int, default=0, help="micro-batch (default 8 gpt, 4 llama; reduced 4)")
    ap.add_argument("--reduced", action="store_true", help="CPU, small shapes (checks the script)")
    ap.add_argument("--no-compile", action="store_true", help="eager contenders")
    ap.add_argument("--json", default="", help="also write the figures here")
    a = ap.parse_args(argv)
    a.steps, a.warmup = a.steps or (6 if a.reduced else 50), a.warmup or (2 if a.reduced else 5)
    if a.reduced:
        device, dtype = torch.device("cpu"), torch.bfloat16
        small = ModelConfig(n_layer=2, n_embd=128, n_head=4, vocab_size=256, seq_len=64, vocab_multiple=64)
        models = [(small, a.batch or 4), (load_config("llama-tiny").model, a.batch or 4)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench.fp8_speed: no CUDA device; use --reduced for the CPU version")
        device, dtype = torch.device("cuda"), torch.bfloat16
        names = (a.configs or "gpt-1.3b,llama3.2-1b").split(",")
        models = [
            (dataclasses.replace(load_config(n).model, seq_len=2048), a.batch or (4 if "llama" in n else 8))
            for n in names
        ]
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "models": []}
    for cfg, batch in models:
        print(
            f"bench.fp8_speed: {cfg.arch} {cfg.n_layer} layers, hidden {cfg.n_embd}, seq {cfg.seq_len}, batch {batch}"
        )
        report["models"].append(one_model(cfg, batch, a, device, dtype))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

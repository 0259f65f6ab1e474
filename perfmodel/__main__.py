"""``python -m perfmodel``: rank grids, explain one grid, time to solution, profile.

Examples::

    python -m perfmodel rank --model gpt-20b --gpus 1024 --batch 64 --machine perlmutter --top 10
    python -m perfmodel explain --grid data=4,x=8,y=8,z=4 --model gpt-20b --batch 64 --machine perlmutter
    python -m perfmodel tts --tokens 300B --model gpt-20b --gpus 1024 --batch 64 --machine perlmutter
    python -m perfmodel profile --out mymachine.yaml      # under a distributed launcher

Errors (unknown model or machine, a grid whose size is not the number of GPUs,
batch < 1 ...) print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import re
import sys
import time
from typing import Any

from axo4d.config import ConfigError, ModelConfig, model_from_name
from axo4d.facts.grid import Grid, GridError
from axo4d.facts.spec import Dtypes

from .machine import Machine, MachineError, load_machine
from .model import Estimate, estimate_auto, rank_grids
from .tables import explain_text, rank_text

PROG = "perfmodel"
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


class UsageError(ValueError):
    """A command-line value that cannot be used."""


class _Parser(argparse.ArgumentParser):
    """argparse with one error line (not the whole usage) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see: python -m {self.prog} --help)\n")


def _tokens(s: str) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBgGtT]?)\s*", s)
    try:
        v = float(m.group(1)) * _SUFFIX[m.group(2).lower()] if m else float("nan")
    except ValueError:
        v = float("nan")
    if not v > 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"invalid token count {s!r} (e.g. 3e11, 300B, 1.5T)")
    return v


def _ckpt(s: str) -> bool | None:
    table = {"on": True, "off": False, "auto": None}
    if s.lower() not in table:
        raise argparse.ArgumentTypeError(f"--checkpointing must be on, off or auto, got {s!r}")
    return table[s.lower()]


def _common(p: argparse.ArgumentParser, need_gpus: bool) -> None:
    p.add_argument("--model", required=True, help="named config (gpt-20b, ...) or a config YAML")
    p.add_argument("--batch", type=int, required=True, help="global batch in samples per step")
    p.add_argument("--machine", required=True, help="perlmutter, frontier, alps or a machine YAML")
    if need_gpus:
        p.add_argument("--gpus", type=int, required=True, help="number of GPUs P")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs used per node (default: the machine's)")
    p.add_argument(
        "--order",
        default=None,
        help="rank layout, fastest axis first (default x,y,z,data); rank/tts: 'search' tries every "
        "order for the best grids (default for rank and tts)",
    )
    p.add_argument(
        "--cache-weights",
        default="off",
        metavar="off|all|N|auto",
        help="keep gathered weights from forward for backward (parallel.cache_weights; "
        "auto: as many blocks as fit in memory)",
    )
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step (train.grad_accum)")
    p.add_argument("--no-overlap", action="store_true", help="expose all communication")
    p.add_argument(
        "--checkpointing",
        type=_ckpt,
        default=None,
        metavar="on|off|auto",
        help="activation checkpointing (auto: off if it fits, else on)",
    )
    p.add_argument(
        "--flash-attention",
        nargs="?",
        const="on",
        default="auto",
        choices=["auto", "on", "off"],
        help="fused (flash) attention kernel: no s^2 attention scores stored (memory) or streamed through "
        "memory (time). auto (default): what the trainer runs on the target -- fused SDPA on GPUs "
        "(--dtype bf16), the unfused kernel in CPU runs (--dtype fp32); a bare --flash-attention is 'on'",
    )
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="compute dtype: element size of activations and gathered weights (fp32 for CPU runs)",
    )
    p.add_argument(
        "--fp8", default="off", choices=["off", "tensorwise", "rowwise"], help="FP8 GEMMs and gathers (train.fp8)"
    )
    p.add_argument(
        "--fp8-layers", default="auto", choices=["auto", "blocks", "all"], help="which layers (train.fp8_layers)"
    )
    p.add_argument("--seq", type=int, default=None, help="sequence length in tokens (default: the model's seq_len)")
    p.add_argument(
        "--z-split",
        default="auto",
        choices=["auto", "batch", "sequence"],
        help="what z splits (parallel.z_split; auto: the batch, or the sequence where that is the only "
        "feasible choice or faster)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Performance model of 4D-parallel GPT training.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{rank,explain,tts,profile}")
    r = sub.add_parser("rank", help="rank every grid data*x*y*z = gpus by predicted step time")
    _common(r, need_gpus=True)
    r.add_argument("--top", type=int, default=10, help="feasible grids to show (default 10; 0 = all)")
    r.add_argument("--show-infeasible", type=int, default=5, help="infeasible grids to list (default 5)")
    e = sub.add_parser("explain", help="per-collective and memory detail of one grid")
    e.add_argument("--grid", required=True, help="grid spec, e.g. data=4,x=8,y=8,z=4")
    e.add_argument("--gpus", type=int, default=None, help="check that the grid has this many ranks")
    _common(e, need_gpus=False)
    t = sub.add_parser("tts", help="time to solution for a token budget with the best grid")
    t.add_argument("--tokens", type=_tokens, required=True, help="training tokens (3e11, 300B, 1.5T)")
    t.add_argument("--grid", default=None, help="use this grid instead of the best one")
    _common(t, need_gpus=True)
    sub.add_parser(
        "profile",
        add_help=False,
        help="measure collectives and GEMM on this machine, write a machine YAML (options: perfmodel profile --help)",
    )
    return ap


def _load(args: argparse.Namespace) -> tuple[ModelConfig, Machine]:
    if args.batch < 1:
        raise UsageError(f"--batch must be >= 1 sample, got {args.batch}")
    if getattr(args, "gpus", None) is not None and args.gpus < 1:
        raise UsageError(f"--gpus must be >= 1, got {args.gpus}")
    if args.seq is not None and args.seq < 1:
        raise UsageError(f"--seq must be >= 1 token, got {args.seq}")
    machine = load_machine(args.machine)
    machine.check_gpus_per_node(args.gpus_per_node, getattr(args, "gpus", None))
    model = model_from_name(args.model)
    return (model if args.seq is None else dataclasses.replace(model, seq_len=args.seq)), machine


def flash_attention(setting: str, dtype: str) -> bool:
    """``--flash-attention``: 'on', 'off', or 'auto' -- the trainer's kernel on the target: fused SDPA
    on GPUs (bf16 runs), the unfused one in CPU runs (fp32)."""
    return setting == "on" or (setting == "auto" and dtype == "bf16")


def _kw(args: argparse.Namespace) -> dict[str, Any]:
    if args.grad_accum < 1:
        raise UsageError(f"--grad-accum must be >= 1, got {args.grad_accum}")
    cache = args.cache_weights.strip().lower()
    if not (cache in ("off", "all", "auto") or cache.isdigit()):
        raise UsageError(f"--cache-weights {args.cache_weights!r}: use off, all, auto or a number of blocks")
    return {
        "overlap": not args.no_overlap,
        "gpus_per_node": args.gpus_per_node,
        "flash_attention": flash_attention(args.flash_attention, args.dtype),
        "dtypes": Dtypes.for_compute(args.dtype),
        "cache_weights": cache,
        "grad_accum": args.grad_accum,
        "fp8": args.fp8,
        "fp8_layers": args.fp8_layers,
        "z_split": args.z_split,
    }


def _header(args: argparse.Namespace, machine: Machine, gpus: int) -> str:
    gpn = args.gpus_per_node or machine.gpus_per_node
    return (
        f"model {args.model}, {gpus} GPUs ({gpn} per node) on {machine.name}, batch {args.batch}, "
        f"order {args.order or 'x,y,z,data'}, overlap {'off' if args.no_overlap else 'on'}, "
        f"checkpointing {({True: 'on', False: 'off', None: 'auto'})[args.checkpointing]}, "
        f"cached weights {args.cache_weights}, grad_accum {args.grad_accum}"
        + (f", seq {args.seq}" if args.seq else "")
        + f", z_split {args.z_split}"
        + f", attention {'fused' if flash_attention(args.flash_attention, args.dtype) else 'unfused'}"
        + (f", fp8 {args.fp8} (layers {args.fp8_layers})" if args.fp8 != "off" else "")
    )


def _grid(spec: str, order: str | None, gpus: int | None = None) -> Grid:
    if order is not None and order.strip().lower() == "search":
        raise UsageError("--order search ranks grids; with --grid give an order such as x,y,z,data")
    g = Grid.parse(spec, order)
    if gpus is not None:
        g.check_world(gpus)
    return g


def _announce(gpus: int) -> None:
    """Say how many grids a search covers when that many take a while (stderr)."""
    from axo4d.facts.grid import all_grids

    from .model import FULL_SEARCH_MAX

    n = len(all_grids(gpus))
    if n > FULL_SEARCH_MAX:
        print(
            f"{PROG}: {gpus:,} GPUs have {n:,} grids: only those whose sizes divide the model and the "
            f"batch are estimated (the rest are listed as infeasible)",
            file=sys.stderr,
            flush=True,
        )


class _Progress:
    """``rank_grids``' progress callback: one line on stderr about every second once a ranking has
    taken longer than a second (nothing for a quick one)."""

    def __init__(self) -> None:
        self.t0 = self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.t0 > 1.0 and now - self.last >= 1.0:
            self.last = now
            print(f"{PROG}: {done:,} of {total:,} grids estimated ({now - self.t0:.0f} s)", file=sys.stderr, flush=True)


def cmd_rank(args: argparse.Namespace) -> int:
    args.order = args.order or "search"
    model, machine = _load(args)
    kw = _kw(args)
    _announce(args.gpus)
    ests = rank_grids(
        model,
        args.gpus,
        kw.pop("gpus_per_node"),
        args.batch,
        machine,
        checkpointing=args.checkpointing,
        order=args.order,
        top=args.top or None,
        progress=_Progress(),
        shown_infeasible=None if args.json else max(0, args.show_infeasible),
        **kw,
    )
    if args.json:
        print(json.dumps([e.to_dict() for e in ests], indent=1))
    else:
        print(rank_text(ests, _header(args, machine, args.gpus), args.show_infeasible))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    model, machine = _load(args)
    grid = _grid(args.grid, args.order, args.gpus)
    e = estimate_auto(model, grid, args.batch, machine, args.checkpointing, **_kw(args))
    if args.json:
        d = e.to_dict()
        d["collectives"] = [
            {
                "layer": c.layer,
                "phase": c.phase,
                "group": ",".join(c.axes),
                "kind": c.kind,
                "bytes_per_call": c.nbytes,
                "calls": reps,
                "seconds_per_call": t1,
                "overlap": c.pool,
            }
            for c, reps, t1 in e.details
        ]
        d["compute_detail"] = e.compute_detail
        print(json.dumps(d, indent=1))
    else:
        print(explain_text(e, machine, _header(args, machine, grid.world_size)))
    return 0


def cmd_tts(args: argparse.Namespace) -> int:
    if not args.grid:
        args.order = args.order or "search"
    model, machine = _load(args)
    kw = _kw(args)
    if args.grid:
        best: Estimate | None = estimate_auto(
            model, _grid(args.grid, args.order, args.gpus), args.batch, machine, args.checkpointing, **kw
        )
    else:
        _announce(args.gpus)
        ests = rank_grids(
            model,
            args.gpus,
            kw.pop("gpus_per_node"),
            args.batch,
            machine,
            checkpointing=args.checkpointing,
            order=args.order,
            top=1,
            shown_infeasible=1,
            progress=_Progress(),
            **kw,
        )
        best = ests[0] if ests and ests[0].feasible else None
    if best is None or not best.feasible:
        why = best.reason if best is not None else "no grid of these GPUs fits"
        raise UsageError(f"no feasible grid for {args.model} on {args.gpus} GPUs with batch {args.batch}: {why}")
    tokens_per_step = args.batch * model.seq_len
    steps = math.ceil(args.tokens / tokens_per_step)
    seconds = steps * best.step_time_s
    out = {
        "grid": best.grid.spec(),
        "tokens": args.tokens,
        "tokens_per_step": tokens_per_step,
        "steps": steps,
        "step_time_s": best.step_time_s,
        "seconds": seconds,
        "days": seconds / 86400,
        "tflops_per_gpu": best.tflops_per_gpu,
        "model_tflops_per_gpu": best.model_tflops_per_gpu,
        "mfu": best.mfu,
        "hfu": best.hfu,
        "checkpointing": best.checkpointing,
        "z_split": best.z_split,
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(_header(args, machine, args.gpus))
        print(
            f"grid {out['grid']} (checkpointing {'on' if best.checkpointing else 'off'}, z splits the {best.z_split}): "
            f"{steps} steps x {best.step_time_s:.3f} s = {seconds / 3600:.1f} h = {out['days']:.2f} days "
            f"for {args.tokens:.3g} tokens ({tokens_per_step} tokens/step, "
            f"{best.model_tflops_per_gpu:.1f} model TFLOP/s per GPU, "
            f"MFU {100 * best.mfu:.1f}%, HFU {100 * best.hfu:.1f}%)"
        )
    return 0


def cmd_profile(argv: list[str]) -> int:
    """Run ``perfmodel.profile`` (imported lazily: it needs torch.distributed)."""
    try:
        mod = importlib.import_module("perfmodel.profile")
    except ModuleNotFoundError as e:
        if e.name != "perfmodel.profile":
            raise
        raise UsageError("the profile subcommand is not available (perfmodel/profile.py is missing)") from None
    try:
        return int(mod.main(argv) or 0)
    except SystemExit as e:  # its own argparse (--help, bad option)
        return int(e.code or 0)


COMMANDS = {"rank": cmd_rank, "explain": cmd_explain, "tts": cmd_tts}


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a usage or input error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["profile"]:
            return cmd_profile(argv[1:])
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed its message
        return int(e.code or 0)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.cmd](args)
    except (UsageError, ConfigError, GridError, MachineError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

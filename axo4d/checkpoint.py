"""Checkpoints from the command line (single process).

    python -m axo4d.checkpoint list RUN_OR_CKPT
    python -m axo4d.checkpoint export CKPT out.safetensors
    python -m axo4d.checkpoint import in.safetensors RUN --config tiny [--set k=v ...] [--step N]

``import`` writes ``RUN/checkpoints/step_N`` (weights only: the optimizer starts fresh);
``--resume RUN`` then trains from it on any grid. The library is :mod:`axo4d.training.checkpoint`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from axo4d.config import load_config
from axo4d.errors import CheckpointError, ConfigError
from axo4d.training.checkpoint import (complete_checkpoints, export_safetensors, import_safetensors,
                                       is_complete, read_info)


def main(argv: list[str] | None = None) -> int:
    """``python -m axo4d.checkpoint {list,export,import} ...``"""
    ap = argparse.ArgumentParser(prog="python -m axo4d.checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_list = sub.add_parser("list", help="complete checkpoints of a run (or one checkpoint)")
    p_list.add_argument("path")
    p_exp = sub.add_parser("export", help="checkpoint -> single safetensors file of full tensors")
    p_exp.add_argument("ckpt")
    p_exp.add_argument("out")
    p_imp = sub.add_parser("import", help="safetensors file -> OUT/checkpoints/step_N (weights only)")
    p_imp.add_argument("file")
    p_imp.add_argument("out", help="run folder to create the checkpoint in")
    p_imp.add_argument("--config", default="tiny")
    p_imp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p_imp.add_argument("--step", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            p = Path(args.path)
            found = [p] if is_complete(p) else complete_checkpoints(p / "checkpoints") or complete_checkpoints(p)
            if not found:
                raise CheckpointError(f"no complete checkpoint in {args.path!r}")
            for c in found:
                info = read_info(c)
                print(f"{c}  step {info['step']}  grid {info['grid']}  model {info['config'].name}")
        elif args.cmd == "export":
            shapes = export_safetensors(args.ckpt, args.out)
            print(f"wrote {args.out}: {len(shapes)} tensors")
        else:
            path = import_safetensors(args.file, args.out, load_config(args.config, args.set), args.step)
            print(f"wrote {path}")
    except (CheckpointError, ConfigError, OSError) as e:
        print(f"axo4d.checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

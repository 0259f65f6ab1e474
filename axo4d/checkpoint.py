"""Checkpoints from the command line (single process).

    python -m axo4d.checkpoint list RUN_OR_CKPT [--sizes-only]   # and whether each one verifies
    python -m axo4d.checkpoint verify RUN_OR_CKPT       # every file against its checksum
    python -m axo4d.checkpoint export CKPT out.safetensors
    python -m axo4d.checkpoint export-hf CKPT OUTDIR [--dtype bfloat16] [--shard-gb 2]
    python -m axo4d.checkpoint import in.safetensors RUN --config tiny [--set k=v ...] [--step N]

``import`` writes ``RUN/checkpoints/step_N`` (weights only: the optimizer starts fresh); it never
replaces an existing checkpoint and never prunes. ``--resume RUN`` then trains from the newest
checkpoint of RUN (or ``--resume RUN/checkpoints/step_N`` from that one) on any grid. ``list``,
``verify``, ``export`` and ``export-hf`` check every file's checksum first (``list --sizes-only``:
sizes only), as ``--resume``, ``--init-from`` and ``axo4d.generate`` do; a corrupt checkpoint is
named with its first bad file, and the command ends with status 2. Errors: one line and the exit status of
:mod:`axo4d.exits` (2: bad input, an unreadable or unwritable file). The library is
:mod:`axo4d.training.checkpointing.checkpointer`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from axo4d.config import load_config
from axo4d.config.errors import CheckpointError
from axo4d.exits import ArgParser, run_and_exit
from axo4d.training.checkpointing import integrity
from axo4d.training.checkpointing.checkpointer import complete_checkpoints, is_complete, read_info, read_manifest
from axo4d.training.checkpointing.single_file import export_safetensors, import_safetensors


def _checkpoints(path: str) -> list[Path]:
    p = Path(path)
    found = [p] if is_complete(p) else complete_checkpoints(p / "checkpoints") or complete_checkpoints(p)
    if not found:
        raise CheckpointError(f"no complete checkpoint in {path!r}")
    return found


def _verify(path: str) -> None:
    """Check every file of each checkpoint against its checksum; prints the rate (the cost of a check)."""
    for c in _checkpoints(path):
        manifest = read_manifest(c)
        bad, nbytes, secs = integrity.verify(c, manifest)
        if bad:
            raise CheckpointError(f"checkpoint {str(c)!r} is corrupt: {bad}")
        what = "crc32 verified" if integrity.has_checksums(manifest) else "sizes only (saved without checksums)"
        print(
            f"{c}: ok, {len(manifest)} files, {integrity.mib(nbytes)}, {what} in {secs:.3f} s "
            f"({nbytes / max(secs, 1e-9) / 1e6:,.0f} MB/s, {integrity.THREADS} threads)"
        )


def _list(path: str, verify: bool) -> None:
    """Each complete checkpoint with its step, grid and model, and whether its files verify."""
    bad = []
    for c in _checkpoints(path):
        try:
            info = read_info(c, verify=verify)
        except CheckpointError as e:
            bad.append(str(e))
            print(f"{c}  CORRUPT: {str(e).split(' is corrupt: ', 1)[-1]}")
            continue
        files = info["files"]
        if not verify:
            state = "sizes checked (not verified)"
        elif integrity.has_checksums(files):
            state = f"verified (crc32 of {len(files)} files, {integrity.mib(integrity.total_bytes(files))})"
        else:
            state = "sizes checked (saved without checksums)"
        print(f"{c}  step {info['step']}  grid {info['grid']}  model {info['config'].name}  {state}")
    if bad:
        raise CheckpointError(f"{len(bad)} corrupt checkpoint(s); the first: {bad[0]}")


def _import(args: argparse.Namespace) -> None:
    path = import_safetensors(args.file, args.out, load_config(args.config, args.set), args.step)
    print(f"wrote {path}")
    newer = [c for c in complete_checkpoints(path.parent) if c.name > path.name]
    if newer:
        print(
            f"note: {path.parent} also holds newer checkpoints ({', '.join(c.name for c in newer)}): "
            f"--resume {args.out} would continue from {newer[-1].name}; resume from this one with "
            f"--resume {path}"
        )


def run(argv: list[str] | None = None) -> int:
    """``python -m axo4d.checkpoint {list,verify,export,export-hf,import} ...``"""
    ap = ArgParser(
        prog="python -m axo4d.checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_list = sub.add_parser("list", help="complete checkpoints of a run (or one checkpoint), each verified")
    p_list.add_argument("path")
    p_list.add_argument("--sizes-only", action="store_true", help="check the files' sizes, not their checksums")
    p_ver = sub.add_parser("verify", help="check every file of a checkpoint (or of a run's) against its checksum")
    p_ver.add_argument("path")
    p_exp = sub.add_parser("export", help="checkpoint -> single safetensors file of full tensors")
    p_exp.add_argument("ckpt")
    p_exp.add_argument("out")
    p_imp = sub.add_parser("import", help="safetensors file -> OUT/checkpoints/step_N (weights only)")
    p_imp.add_argument("file")
    p_imp.add_argument("out", help="run folder to create the checkpoint in")
    p_imp.add_argument("--config", default="tiny")
    p_imp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p_imp.add_argument(
        "--step", type=int, default=0, help="the step it is saved as (default 0); an existing step_N is an error"
    )
    p_hf = sub.add_parser(
        "export-hf",
        help="checkpoint -> Hugging Face folder (config, sharded safetensors, "
        "index, tokenizer), streamed one tensor at a time",
    )
    p_hf.add_argument("ckpt")
    p_hf.add_argument("out")
    p_hf.add_argument(
        "--dtype", default="auto", help="float32, bfloat16, float16 or auto (the source folder's, else bfloat16)"
    )
    p_hf.add_argument("--shard-gb", type=float, default=2.0, help="largest safetensors file (GB)")
    args = ap.parse_args(argv)
    try:
        _command(args)
    except OSError as e:  # a file that cannot be read or written: bad input (axo4d.exits)
        where = f" ({e.filename})" if e.filename else ""
        raise CheckpointError(f"{e.strerror or e}{where}") from None
    return 0


def _command(args: argparse.Namespace) -> None:
    if args.cmd == "list":
        _list(args.path, not args.sizes_only)
    elif args.cmd == "verify":
        _verify(args.path)
    elif args.cmd == "export-hf":
        from axo4d.training.hf.weights import export_hf

        r = export_hf(args.ckpt, args.out, dtype=args.dtype, shard_gb=args.shard_gb)
        print(
            f"wrote {r['folder']}: {r['tensors']} tensors in {r['files']} safetensors file(s), {r['dtype']}, "
            f"tokenizer files {r['tokenizer'] or 'none'}"
        )
    elif args.cmd == "export":
        shapes = export_safetensors(args.ckpt, args.out)
        print(f"wrote {args.out}: {len(shapes)} tensors")
    else:
        _import(args)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: one error line and the status of :mod:`axo4d.exits` (2: bad input)."""
    return run_and_exit(run, argv, "axo4d.checkpoint")


if __name__ == "__main__":
    raise SystemExit(main())

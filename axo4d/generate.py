"""Generate text from a Hugging Face folder or an axo4d checkpoint, on any grid.

    python -m axo4d.generate --init-from PATH|CHECKPOINT [--grid SPEC] --prompt TEXT
                             [--prompts-file FILE] [--max-new-tokens N]
                             [--greedy | --temperature T --top-p P] [--seed S] [--set key=value ...]

Launch it like training (``python -m launch.local -n 8 -- axo4d.generate ...``, ``mpiexec``,
``srun``). Prompts: ``--prompt`` (repeatable) and ``--prompts-file`` (one prompt per line, or a
.jsonl file with a ``text`` field). All prompts run as one batch, split over ``data`` and ``z``
(fewer prompts than ``G_data * G_z`` is fine); rank 0 prints each prompt and its continuation.
Prompts are encoded as the tokenizer frames them (a Llama tokenizer adds its begin-of-text token).
Decoding: greedy by default; ``--temperature``/``--top-p`` sample with per-prompt generators
seeded from ``--seed``; a prompt stops at the end-of-text token. Bad input is one line (from rank 0)
and exit status 2; exit statuses: :mod:`axo4d.exits`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from axo4d.config import check_values, load_config
from axo4d.config.errors import ConfigError, agreed
from axo4d.exits import ArgParser, run_and_exit
from axo4d.facts.run import derive
from axo4d.models.generation import Sampling, generate
from axo4d.training.datasets.tokenizer import load_tokenizer
from axo4d.training.init_from import config_with_init, load_init_weights
from axo4d.training.startup import build_model_on, make_tuner, start, with_grid


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgParser(
        prog="python -m axo4d.generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--init-from", required=True, metavar="PATH", help="Hugging Face folder or axo4d checkpoint")
    ap.add_argument("--grid", default=None, help="grid spec, e.g. data=2,x=2 (default: data=<ranks>)")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    ap.add_argument("--prompts-file", default=None, help="one prompt per line, or .jsonl with a 'text' field")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--greedy", action="store_true", help="most likely token each step (the default)")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--launcher", default="auto")
    return ap.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        path = Path(args.prompts_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--prompts-file {str(path)!r}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"--prompts-file {str(path)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                f"{e.start}); give a UTF-8 text file (one prompt a line) or .jsonl with a 'text' field a line"
            ) from None
        if path.suffix == ".jsonl":
            for n, line in enumerate(filter(str.strip, text.splitlines()), 1):
                try:
                    prompts.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError):
                    raise ConfigError(
                        f"--prompts-file {str(path)!r} line {n}: expected JSON with a 'text' field"
                    ) from None
        else:
            prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT or --prompts-file FILE")
    return prompts


def sampling_of(args: argparse.Namespace) -> Sampling:
    if args.greedy or args.temperature is None:
        if args.temperature is not None:
            raise ConfigError("--greedy and --temperature exclude each other")
        return Sampling(seed=args.seed)
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise ConfigError(f"--temperature {args.temperature} must be > 0 and --top-p {args.top_p} in (0, 1]")
    return Sampling(greedy=False, temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sampling, prompts = sampling_of(args), read_prompts(args)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    cfg = config_with_init(load_config("tiny", args.set), args.init_from, args.set)
    check_values(cfg)
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = [tok.encode(p, add_special_tokens=True) for p in prompts]
    world = start(cfg, args.launcher, lambda c, info: with_grid(c, args.grid or f"data={info.world_size}"))
    comm, device = world.comm, world.device
    facts = derive(world.cfg, comm.grid, batch=False)  # the model on this grid, checked as training checks it
    model = build_model_on(world.cfg, comm, device, seed=None, tuner=make_tuner(world.cfg, comm), facts=facts)
    load_init_weights(model, args.init_from, comm)
    cuda = device.type == "cuda"
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            out = generate(
                model, ids, args.max_new_tokens, sampling, eos_id=tok.eos_id, dtype=torch.bfloat16 if cuda else None
            )
    except ValueError as e:  # a prompt longer than the context: every rank alike
        raise agreed(ConfigError(str(e))) from None
    if world.rank == 0:
        print(
            f"axo4d.generate: {len(prompts)} prompt(s), {args.max_new_tokens} new tokens max, "
            f"{sampling.describe()}, grid {comm.grid.spec()}",
            flush=True,
        )
        for p, o in zip(prompts, out):
            print(f"--- prompt: {p}\n{tok.decode(o)}", flush=True)
    comm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry: one clear error line and a documented exit status (axo4d.exits), never a hang."""
    return run_and_exit(run, argv, "axo4d.generate")


if __name__ == "__main__":
    sys.exit(main())

"""Run the memorization study and write its report folder.

    python -m axo4d.memorization [--config NAME_OR_YAML] [--init-from HF_FOLDER | --sizes A,B,...]
                                 [--grid SPEC] [--set study.epochs=12 --set train.lr=1e-3 ...] --out DIR
    python -m axo4d.memorization render DIR

Launch it like training (``python -m launch.local -n 8 -- axo4d.memorization --out runs/mem``,
``mpiexec``, ``srun``); the grid is ``--grid``, else ``parallel.grid`` of the config, else
``data=<ranks>``. ``--config`` defaults to the named config ``memorize`` (a small GPT on the
stdlib corpus); ``study.*`` keys are documented in :mod:`axo4d.memorization.study_config`. ``--sizes``
runs the whole protocol once per model: each entry a config (its model section, then your
``--set model.*``) or a Hugging Face folder. ``DIR`` gets ``per_document.jsonl`` and ``meta.json``
(everything the report prints), ``config.yaml`` (rerun it with ``--config DIR/config.yaml``), and,
made from the first two, ``report.md``, ``exact_match.png`` (and ``sizes.png`` for a sweep);
``render DIR`` makes those again from the stored files, byte for byte (one process, no ranks).
Bad input (a study value, too few documents, a model whose context is shorter than prefix +
suffix, a rest too short to pre-train on) is one line and exit status 2, before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from axo4d.config import RunConfig, check_values, config_to_dict, load_config
from axo4d.config.errors import ConfigError, GridError
from axo4d.exits import ArgParser, run_and_exit
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from axo4d.facts.run import derive
from axo4d.memorization.documents import bucket_names, read_corpus
from axo4d.memorization.protocol import Size, Study, pretrain_data
from axo4d.memorization.results import decoding_text, records, render, write_run
from axo4d.memorization.study_config import StudyConfig, check_study, load_study
from axo4d.training.checkpointing.outdir import claim_output, probe_writable
from axo4d.training.datasets.tokenizer import load_tokenizer
from axo4d.training.init_from import (
    check_init_source,
    check_tokenizer,
    config_with_init,
)
from axo4d.training.startup import start, with_grid
from axo4d.training.trainer import compute_dtype


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgParser(
        prog="python -m axo4d.memorization", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="memorize", help="named config, YAML run config, or a report's config.yaml")
    ap.add_argument("--init-from", default=None, metavar="PATH", help="start from a Hugging Face folder")
    ap.add_argument("--sizes", default=None, help="comma-separated configs or Hugging Face folders: one study each")
    ap.add_argument("--grid", default=None, help="grid spec, e.g. data=2,x=2,z=2")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a study.* or run config key (repeatable)",
    )
    ap.add_argument("--out", required=True, help="report folder")
    ap.add_argument("--launcher", default="auto", help="auto, env, mpi, slurm or single")
    return ap.parse_args(argv)


def resolve_sizes(
    cfg: RunConfig, study: StudyConfig, names: list[str], init_from: str | None, sets: list[str]
) -> list[Size]:
    """The study's models, each checked on its own (values, context length, tokenizer)."""
    model_sets = [s for s in sets if s.strip().startswith("model.")]
    if init_from and names:
        raise ConfigError("give either --init-from or --sizes (a size may itself be a Hugging Face folder)")
    if not names:
        sizes = [Size(init_from or cfg.name, config_with_init(cfg, init_from, sets) if init_from else cfg, init_from)]
    else:
        sizes = []
        for n in names:
            if Path(n).is_dir():
                sizes.append(Size(n, config_with_init(cfg, n, sets), n))
            else:
                sizes.append(Size(n, dataclasses.replace(cfg, model=load_config(n, model_sets).model, name=n)))
    for s in sizes:
        check_values(s.cfg)
        own = model_spec(s.cfg.model, Grid()).checks
        if own:
            raise ConfigError(f"model of {s.name}: " + "; ".join(f"model.{r}" for r in own))
        if s.cfg.model.seq_len < study.length:
            raise ConfigError(
                f"the model of {s.name} has a context of model.seq_len={s.cfg.model.seq_len} tokens, shorter "
                f"than study.prefix + study.suffix = {study.length}: use a longer context "
                f"(--set model.seq_len={study.length}) or a shorter study.prefix"
            )
        if s.cfg.data.tokenizer != "byte" or s.init_from:
            check_tokenizer(s.cfg)
    return sizes


class Job:
    """One rank of the study: set-up, the protocol per size, the report (rank 0)."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.command = "python -m axo4d.memorization " + shlex.join(argv)
        self.study, self.cfg, file_sizes = load_study(args.config, args.set, args.grid)
        check_study(self.study)
        names = [n for n in (args.sizes or "").split(",") if n.strip()] or file_sizes
        self.sizes = resolve_sizes(self.cfg, self.study, names, args.init_from, args.set)
        default = self.cfg.parallel.grid if self.cfg.parallel.grid.strip() not in ("", "data=1") else None
        world = start(
            self.cfg, args.launcher, lambda c, info: with_grid(c, args.grid or default or f"data={info.world_size}")
        )
        self.info, self.comm, self.rank = world.info, world.comm, world.rank
        grid = self.comm.grid
        self.sizes = [dataclasses.replace(s, cfg=with_grid(s.cfg, grid.spec())) for s in self.sizes]

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def check_grid(self) -> None:
        n_treated = self.study.buckets * self.study.bucket_size
        for s in self.sizes:
            try:  # the model and batch on this grid, derived and checked as training derives them
                derive(s.cfg, self.comm.grid)
            except (ConfigError, GridError) as e:
                raise type(e)(f"size {s.name}: {e}") from None
            if n_treated % s.cfg.train.global_batch:
                raise ConfigError(
                    f"{n_treated} treated documents (study.buckets x study.bucket_size) do not divide into "
                    f"batches of train.global_batch={s.cfg.train.global_batch}: choose a divisor"
                )
            if s.init_from:
                self.comm.on_rank0(lambda s=s: check_init_source(s.cfg, s.init_from))

    def main(self) -> None:
        self.check_grid()
        corpora = {}
        for s in self.sizes:  # every check that can reject the study comes before --out is touched
            tok = s.cfg.data.tokenizer
            if tok not in corpora:
                corpora[tok] = self.comm.on_rank0(
                    lambda s=s, tok=tok: read_corpus(
                        s.cfg.data, load_tokenizer(tok), self.study, keep_rest=self.study.pretrain_steps > 0
                    )
                )
        if self.study.pretrain_steps:
            for s in self.sizes:
                pretrain_data(s.cfg, corpora[s.cfg.data.tokenizer], self.study.pretrain_steps)
        out = Path(self.args.out)
        if self.rank == 0:
            probe_writable(out)
            self._lock = claim_output(out)
        self.comm.barrier()
        study = Study(self.study, self.comm, self.info.device, self.info.local_world_size, self.log)
        self.log(
            f"axo4d.memorization: {self.info.world_size} ranks, grid {self.comm.grid.spec()}; arms "
            f"{', '.join(a for a, _ in self.study.arms)}; seeds {self.study.seeds}; {self.study.epochs} epochs"
        )
        recs, per_size = [], {}
        for s in self.sizes:
            corpus = corpora[s.cfg.data.tokenizer]
            res = study.run(s, corpus)
            recs += records(res, corpus.sources)
            per_size[s.name] = {
                "start": res.start,
                "pretrain": res.pretrain,
                "params": res.params,
                "seconds_per_run": sum(r.seconds for r in res.runs) / len(res.runs),
                "dropped": {
                    a: sum(r.dropped for r in res.runs if r.arm == a) / max(1, sum(r.arm == a for r in res.runs))
                    for a, _ in self.study.arms
                },
            }
        if self.rank == 0:
            path = write_run(out, self.meta(corpora[self.sizes[0].cfg.data.tokenizer], per_size), recs)
            print(f"done: {path} ({(time.perf_counter() - self.t0) / 60:.1f} min)", flush=True)

    def meta(self, corpus, per_size: dict) -> dict:
        s, c = self.study, self.sizes[0].cfg
        arm = Study(s, self.comm, self.info.device).arm_config(c, 0, 1)
        return {
            "command": self.command,
            "study": dataclasses.asdict(s),
            "run": config_to_dict(c),
            "sizes": [z.name for z in self.sizes],
            "arms": [a for a, _ in s.arms],
            "buckets": bucket_names(s)[:-1] + ["control"],
            "grid": self.comm.grid.spec(),
            "world_size": self.info.world_size,
            "launcher": self.info.launcher,
            "device": self.info.device.type,
            "seconds": time.perf_counter() - self.t0,
            "counts": corpus.counts,
            "source": c.data.source,
            "tokenizer": c.data.tokenizer,
            "split": s.split == "yes" or (s.split == "auto" and c.data.source == "stdlib"),
            "decoding": decoding_text(
                s.prefix, s.suffix, str(compute_dtype(c.train, self.info.device)).replace("torch.", "")
            ),
            "batch": c.train.global_batch,
            "steps_per_epoch": s.buckets * s.bucket_size // c.train.global_batch,
            "lr": arm.train.lr,
            "warmup": c.train.warmup_steps,
            "weight_decay": c.train.weight_decay,
            "grad_clip": c.train.grad_clip,
            "per_size": per_size,
        }


def render_command(argv: list[str]) -> int:
    """``render DIR``: report.md and the plots again from DIR's meta.json and per_document.jsonl."""
    ap = argparse.ArgumentParser(prog="python -m axo4d.memorization render", description=render.__doc__)
    ap.add_argument("dir", help="a report folder written by python -m axo4d.memorization")
    path = render(Path(ap.parse_args(argv).dir))
    print(f"rendered {path}", flush=True)
    return 0


def run(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["render"]:
        return render_command(argv[1:])
    job = Job(parse_args(argv), argv)
    job.main()
    job.comm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry: one clear error line and a documented exit status (axo4d.exits), never a hang."""
    return run_and_exit(run, argv, "axo4d.memorization")


if __name__ == "__main__":
    sys.exit(main())

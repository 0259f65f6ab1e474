"""Train a GPT on the 4D grid.

    python -m axo4d.train --config NAME_OR_YAML [--grid data=2,x=2,y=1,z=2]
                          [--set train.steps=100 --set train.lr=1e-3 ...] --out DIR

Launch under ``mpiexec``/``mpirun``/``srun``/``torchrun`` or ``python -m launch.local -n N --``.
Rank 0 prints a line per step and writes ``DIR/metrics.jsonl``, ``DIR/config.yaml``
and, at the end, ``DIR/loss.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from axo4d.comm import Comm, CommError
from axo4d.config import ConfigError, RunConfig, dump_config, load_config
from axo4d.data import DataError, open_dataset, prepare_tokens
from axo4d.grid import Grid, GridError
from axo4d.model import flops_per_step
from axo4d.perf import memory_gib, peak_tflops
from axo4d.trainer import StepStats, Trainer, TrainError
from launch.bootstrap import LaunchError, detect_launcher, init_distributed, shutdown

#: errors that every rank meets identically (reported once, by rank 0)
USER_ERRORS = (ConfigError, GridError, DataError, LaunchError)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m axo4d.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", help="named config (axo4d/configs) or YAML path")
    ap.add_argument("--grid", default=None, help="grid spec, e.g. data=2,x=2,y=1,z=2 (overrides parallel.grid)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. train.steps=100 (repeatable)")
    ap.add_argument("--out", default="runs/latest", help="output folder")
    ap.add_argument("--resume", default=None, help="checkpoint folder to resume from ('auto': newest in --out)")
    ap.add_argument("--launcher", default="auto", help="auto, env, mpi, slurm or single")
    return ap.parse_args(argv)


class Run:
    """One training run of this rank: set-up, loop, outputs."""

    def __init__(self, args: argparse.Namespace, cfg: RunConfig) -> None:
        self.args, self.cfg, self.out = args, cfg, Path(args.out)
        grid = Grid.parse(cfg.parallel.grid, cfg.parallel.order)
        self.info = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s, args.launcher)
        grid.check_world(self.info.world_size)
        self.rank = self.info.rank
        self.comm = Comm(grid, self.rank, timeout_s=cfg.parallel.timeout_s)
        self.metrics = None

    # ---- set-up ------------------------------------------------------------------
    def on_rank0(self, fn):
        """Run ``fn`` on rank 0 and share its outcome, so an error there stops every rank."""
        err = None
        if self.rank == 0:
            try:
                fn()
            except USER_ERRORS + (OSError,) as e:
                err = f"{type(e).__name__}: {e}"
        err = self.comm.broadcast_object(err)
        if err is not None:
            kind, msg = err.split(": ", 1)
            raise (DataError if kind == "DataError" else ConfigError)(msg)

    def prepare_output(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        probe = self.out / ".write-test"
        try:
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"output folder {str(self.out)!r} is not writable: {e.strerror}") from None
        dump_config(self.cfg, self.out / "config.yaml")
        (self.out / "metrics.jsonl").write_text("")

    def setup(self) -> None:
        self.on_rank0(self.prepare_output)
        self.on_rank0(lambda: prepare_tokens(self.cfg.data))
        c = self.cfg
        self.data = open_dataset(c.data, c.model.seq_len, c.train.seed, c.model.vocab_size)
        self.trainer = Trainer(c, self.comm, self.data, self.info.device)
        self.flops = flops_per_step(c.model, c.train.global_batch, c.train.activation_checkpointing)
        self.peak = peak_tflops(self.info.device, self.trainer.dtype, c.train)
        if self.rank == 0:
            self.banner()

    def banner(self) -> None:
        c, m = self.cfg, self.trainer.model
        ck = c.train.activation_checkpointing
        print(f"axo4d: {self.info.world_size} ranks ({self.info.launcher}, {self.info.backend}, "
              f"{self.info.device.type}) grid {self.comm.grid.spec()} order {','.join(self.comm.grid.order)}")
        print(f"model {c.name}: {m.num_params() / 1e6:.2f}M params, {c.model.n_layer} layers, hidden "
              f"{c.model.n_embd}, {c.model.n_head} heads, seq {c.model.seq_len}, vocab {c.model.vocab_size} "
              f"(padded {m.vocab}), dtype {self.trainer.dtype}")
        print(f"data: {self.data.name}: {self.data.n_train:,} train / {self.data.n_val:,} val tokens; "
              f"global batch {c.train.global_batch} x {c.model.seq_len} tokens, grad_accum {c.train.grad_accum}")
        print(f"FLOPs/step = {'96' if ck else '72'}*B*s*l*h^2*(1 + s/(6h) + V/({'16' if ck else '12'}*l*h)) "
              f"= {self.flops:.4g} (DESIGN.md s5); peak {self.peak['tflops']:.4g} TFLOP/s per device "
              f"({self.peak['source']})", flush=True)

    # ---- loop --------------------------------------------------------------------------
    def log_step(self, s: StepStats) -> dict:
        n = self.info.world_size
        tflops = self.flops / s.step_time_s / n / 1e12
        rec = {"step": s.step, "loss": s.loss, "lr": s.lr, "grad_norm": s.grad_norm,
               "tokens_per_s": self.trainer.tokens_per_step / s.step_time_s, "tflops_per_device": tflops,
               "mfu": tflops / self.peak["tflops"] if self.peak["tflops"] else 0.0,
               "step_time_s": s.step_time_s, "memory_gib": memory_gib(self.info.device),
               "peak_tflops": self.peak["tflops"], "world_size": n, "grid": self.comm.grid.spec(),
               "skipped": s.skipped}
        if self.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            t = self.cfg.train
            if s.step % t.log_interval == 0 or s.step == t.steps - 1:
                print(f"step {s.step:5d}/{t.steps} | loss {s.loss:.4f} | lr {s.lr:.2e} | gnorm "
                      f"{s.grad_norm:.3f} | {rec['tokens_per_s']:,.0f} tok/s | {tflops:.3g} TFLOP/s/dev | "
                      f"MFU {100 * rec['mfu']:.2f}% | mem {rec['memory_gib']:.2f} GiB | "
                      f"{1000 * s.step_time_s:.0f} ms" + (" | SKIPPED (non-finite)" if s.skipped else ""),
                      flush=True)
        return rec

    def log_eval(self, step: int, val: float) -> None:
        if self.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "val_loss": val}) + "\n")
            print(f"step {step:5d} | val loss {val:.4f}", flush=True)

    def loop(self, start: int = 0) -> list[dict]:
        t = self.cfg.train
        history = []
        for i in range(start, t.steps):
            try:
                s = self.trainer.step(i)
            except TrainError as e:
                raise TrainError(f"{e}; last checkpoint: {self.last_checkpoint() or 'none'}") from None
            history.append(self.log_step(s))
            last = i == t.steps - 1
            if (t.eval_interval and (i + 1) % t.eval_interval == 0) or last:
                self.log_eval(i, self.trainer.evaluate())
            self.after_step(i, last)
        return history

    # ---- hooks for checkpointing (axo4d.checkpoint) ----------------------------------------
    def after_step(self, step: int, last: bool) -> None:
        pass

    def last_checkpoint(self) -> str | None:
        return None

    def finish(self) -> None:
        if self.rank == 0:
            from axo4d.plot import plot_loss
            png = plot_loss(self.out / "metrics.jsonl", self.out / "loss.png", title=self.cfg.name)
            print(f"done: metrics {self.out / 'metrics.jsonl'}, plot {png}, config {self.out / 'config.yaml'}",
                  flush=True)


def _rank_hint() -> int:
    """This process's rank before any process group exists (for error printing)."""
    for k in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if k in os.environ:
            try:
                return int(os.environ[k])
            except ValueError:
                pass
    return 0


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set, args.grid)
    r = Run(args, cfg)
    r.setup()
    r.loop(0)
    r.finish()
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry: one clear error line and a non-zero exit instead of a traceback or a hang."""
    code = 0
    try:
        code = run(argv)
    except USER_ERRORS as e:
        if _rank_hint() == 0:
            print(f"axo4d.train: error: {e}", file=sys.stderr, flush=True)
        code = 2
    except (CommError, TrainError) as e:
        print(f"axo4d.train: error: [rank {_rank_hint()}] {e}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except Exception:
        print(f"axo4d.train: internal error on rank {_rank_hint()}:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        code = 1
    if code == 0:
        shutdown()
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait on peers that may be stuck in a collective


if __name__ == "__main__":
    sys.exit(main())

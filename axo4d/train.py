"""Train a GPT on the 4D grid.

    python -m axo4d.train --config NAME_OR_YAML [--grid data=2,x=2,y=1,z=2]
                          [--set train.steps=100 --set train.lr=1e-3 ...] --out DIR

Launch under ``mpiexec``/``mpirun``/``srun``/``torchrun`` or ``python -m launch.local -n N --``.
Rank 0 prints a line per step and writes ``DIR/metrics.jsonl``, ``DIR/config.yaml``
and, at the end, ``DIR/loss.png``. Checkpoints go to ``DIR/checkpoints/step_N``
(``checkpoint.interval``, ``checkpoint.at_end``; see :mod:`axo4d.checkpoint`).

Resuming: ``--resume PATH`` continues from a checkpoint folder, or from the newest
complete checkpoint of a run folder; ``--resume auto`` continues from the newest
complete checkpoint in ``--out`` if there is one (else starts fresh). The run goes on
at the checkpoint's step, bit-exactly as if it had not stopped (same grid), and
``metrics.jsonl`` keeps the records of the steps before it. Without ``--resume`` a
fresh run moves an earlier run's ``DIR/checkpoints`` to ``DIR/checkpoints.prev``.

Errors: bad input is one line on stderr and exit status 2, found before ``--out`` is
touched; a failed or timed-out collective (a rank died or hangs) or a non-finite loss
is exit status 1 with the rank, axis and operation (or step and last checkpoint) named.
Every fault and what a user sees: docs/faults.md; exit statuses: :mod:`axo4d.exits`.

Test hooks (environment, every rank): ``AXO4D_FAULT_NAN_AT_STEP=K`` (or ``K-M``) makes the
loss of step K (K to M) non-finite, to exercise ``train.nonfinite`` (stop / skip);
``AXO4D_FAULT`` kills, stops or fills the disk of one rank at a named point
(:mod:`axo4d.dist.faults`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from axo4d.archs import model_spec
from axo4d.config import RunConfig, check_values, dump_config, load_config
from axo4d.dist.bootstrap import init_distributed
from axo4d.dist.comm import Comm
from axo4d.dist.grid import Grid
from axo4d.errors import USER_ERRORS, ConfigError, GridError, TrainError, agreed
from axo4d.exits import run_and_exit
from axo4d.spec import cached_blocks
from axo4d.training.checkpoint.checkpointer import Checkpointer, complete_checkpoints
from axo4d.training.checkpoint.outdir import claim_output, probe_writable
from axo4d.training.checkpoint.resume import choose_resume
from axo4d.training.data.dataset import open_dataset, prepare_tokens
from axo4d.training.init_from import (
    check_init_source,
    check_tokenizer,
    config_with_init,
    load_init_weights,
    record_source,
)
from axo4d.training.metrics_log import MetricsLog, check_tensorboard
from axo4d.training.perf import device_peaks, memory_gib
from axo4d.training.trainer import StepStats, Trainer, check_batch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m axo4d.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="tiny", help="named config (axo4d/configs) or YAML path")
    ap.add_argument("--grid", default=None, help="grid spec, e.g. data=2,x=2,y=1,z=2 (overrides parallel.grid)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. train.steps=100 (repeatable)",
    )
    ap.add_argument("--out", default="runs/latest", help="output folder")
    ap.add_argument(
        "--resume",
        default=None,
        metavar="PATH|auto",
        help="resume from a checkpoint folder, or the newest complete checkpoint of a run folder; "
        "'auto': the newest in --out if any, else start fresh",
    )
    ap.add_argument(
        "--init-from",
        default=None,
        metavar="PATH",
        help="start from a Hugging Face model folder (config.json, *.safetensors, tokenizer.json) or "
        "an axo4d checkpoint: its model and weights, a fresh optimizer",
    )
    ap.add_argument("--launcher", default="auto", help="auto, env, mpi, slurm or single")
    return ap.parse_args(argv)


class Run:
    """One training run of this rank: set-up, loop, outputs."""

    def __init__(self, args: argparse.Namespace, cfg: RunConfig) -> None:
        self.args, self.cfg, self.out = args, cfg, Path(args.out)
        auto = cfg.parallel.grid.strip().lower() == "auto"  # --grid auto: chosen once the world is known
        grid = Grid() if auto else Grid.parse(cfg.parallel.grid, cfg.parallel.order)
        check_run_config(cfg, grid)
        # start-up timeout until the first step is done (then parallel.timeout_s: loop)
        self.info = init_distributed(cfg.parallel.backend, cfg.parallel.init_timeout_s, args.launcher)
        self.plan = None  # perfmodel's plan (--grid auto, cache_weights=auto, parallel.machine)
        if auto or cfg.parallel.cache_weights.strip().lower() == "auto" or cfg.parallel.machine:
            from axo4d.grid_auto import plan_run

            cfg, self.plan = plan_run(cfg, self.info)
            self.cfg = cfg
            grid = Grid.parse(cfg.parallel.grid, cfg.parallel.order)
            check_run_config(cfg, grid)
        grid.check_world(self.info.world_size)
        self.rank = self.info.rank
        self.comm = Comm(grid, self.rank, timeout_s=cfg.parallel.init_timeout_s)
        self.ckpt: Checkpointer | None = None
        self.resume: dict | None = None
        self.start = 0

    # ---- set-up ------------------------------------------------------------------
    def on_every_rank(self, fn):
        """Run ``fn`` on every rank; a user error on any rank stops every rank alike (the lowest's)."""
        res, err = None, None
        try:
            res = fn()
        except USER_ERRORS as e:
            err = e
        err = self.comm.agree(err)
        if err is not None:
            raise agreed(err)
        return res

    def prepare_output(self) -> None:
        """Create the output folder (the first write to it: every input is checked by now); on resume
        keep the metrics of the steps before the checkpoint."""
        probe_writable(self.out)
        self.out_lock = claim_output(self.out)
        dump_config(self.cfg, self.out / "config.yaml")
        metrics = self.out / "metrics.jsonl"
        if self.resume is None:
            old = self.out / "checkpoints"
            if old.is_dir():
                prev = self.out / "checkpoints.prev"
                shutil.rmtree(prev, ignore_errors=True)
                os.rename(old, prev)
                print(
                    f"note: {old} of an earlier run moved to {prev} (use --resume auto to continue a run)", flush=True
                )
            metrics.write_text("")
            return
        self.set_aside_later_checkpoints(self.resume["step"])
        keep = []
        if metrics.is_file():
            for line in metrics.read_text().splitlines():
                try:
                    if json.loads(line)["step"] < self.resume["step"]:
                        keep.append(line + "\n")
                except (ValueError, KeyError, TypeError):
                    pass
        tmp = metrics.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, metrics)

    def set_aside_later_checkpoints(self, step: int) -> None:
        """Checkpoints in ``--out`` newer than the resumed step belong to an abandoned future: move
        them to ``checkpoints.prev`` so that ``--resume auto`` never picks them."""
        later = [p for p in complete_checkpoints(self.out / "checkpoints") if int(p.name[5:]) > step]
        if later:
            prev = self.out / "checkpoints.prev"
            prev.mkdir(exist_ok=True)
            for p in later:
                shutil.rmtree(prev / p.name, ignore_errors=True)
                os.rename(p, prev / p.name)
            print(f"note: {len(later)} checkpoint(s) after step {step} moved to {prev}", flush=True)

    def setup(self) -> None:
        self.resume = choose_resume(self.args.resume, self.out, self.cfg, self.comm)  # files verified
        init = self.args.init_from if self.resume is None else None
        if self.cfg.data.tokenizer != "byte":
            self.comm.on_rank0(lambda: check_tokenizer(self.cfg))
        if init is not None:
            self.comm.on_rank0(lambda: check_init_source(self.cfg, init))
        self.comm.on_rank0(lambda: prepare_tokens(self.cfg.data))
        c = self.cfg  # everything that can reject the run comes before --out is touched
        self.data = self.on_every_rank(lambda: open_dataset(c.data, c.model.seq_len, c.train.seed, c.model.vocab_size))
        self.trainer = Trainer(
            c, self.comm, self.data, self.info.device, init_weights=init is None, local_ranks=self.info.local_world_size
        )  # stops here if it cannot fit
        self.ckpt = Checkpointer(self.out, c, self.comm, self.trainer.model, self.trainer.opt)
        if self.resume is not None:
            self.start = self.ckpt.load(Path(self.resume["path"]), self.resume["grid"])
        elif init is not None:
            load_init_weights(self.trainer.model, init, self.comm)
            self.trainer.weights_loaded()
        self.comm.on_rank0(lambda: self.ckpt.check_space_at_start(self.start))
        self.comm.on_rank0(self.prepare_output)
        if init is not None:
            self.comm.on_rank0(lambda: record_source(self.out, init))
            if self.rank == 0:
                print(f"initialised from {init}", flush=True)
        self.flops = self.trainer.model.spec.flops_per_step(c.train.global_batch, c.train.activation_checkpointing)
        self.peaks = device_peaks(self.info.device, self.trainer.dtype, c.train)
        if self.rank == 0:
            self.banner()
            if self.resume is not None:
                self.resume_note()

    def resume_note(self) -> None:
        r, t, v = self.resume, self.cfg.train, self.resume["verified"]
        for w in r["warnings"]:
            print(f"warning: {w}", flush=True)
        print(
            f"resumed from {r['path']} (saved on grid {r['grid']}; "
            + (
                f"{v['bytes'] / 2**20:,.1f} MiB checked against crc32 in {v['seconds']:.2f} s on {v['ranks']} rank(s)"
                if v["checked"]
                else "sizes checked, saved without checksums"
            )
            + f"): continuing at step {self.start}",
            flush=True,
        )
        if self.start >= t.steps:
            print(
                f"note: the checkpoint is at step {self.start} >= train.steps={t.steps}: nothing to train", flush=True
            )
        old = r["config"].train
        diff = [
            k
            for k in (
                "steps",
                "lr",
                "min_lr",
                "warmup_steps",
                "decay_steps",
                "global_batch",
                "seed",
                "goldfish_k",
                "goldfish_h",
            )
            if getattr(old, k) != getattr(t, k)
        ]
        if diff:
            print(
                "note: train settings differ from the checkpoint's run (the loss will not follow it exactly): "
                + ", ".join(f"train.{k} {getattr(old, k)} -> {getattr(t, k)}" for k in diff),
                flush=True,
            )

    def banner(self) -> None:
        c, m = self.cfg, self.trainer.model
        ck = c.train.activation_checkpointing
        print(
            f"axo4d: {self.info.world_size} ranks ({self.info.launcher}, {self.info.backend}, "
            f"{self.info.device.type}) grid {self.comm.grid.spec()} order {','.join(self.comm.grid.order)}"
        )
        print(
            f"model {c.name}: {m.num_params() / 1e6:.2f}M params, {c.model.n_layer} layers, hidden "
            f"{c.model.n_embd}, {c.model.n_head} heads, seq {c.model.seq_len}, vocab {c.model.vocab_size} "
            f"(padded {m.vocab}), dtype {self.trainer.dtype}"
        )
        print(
            f"data: {self.data.name}: {self.data.n_train:,} train / {self.data.n_val:,} val tokens; "
            f"global batch {c.train.global_batch} x {c.model.seq_len} tokens, grad_accum {c.train.grad_accum}"
        )
        print(
            f"FLOPs/step = {m.spec.flops_formula(ck)} = {self.flops:.4g} (docs/design.md section 5); "
            f"{self.peaks.describe()}",
            flush=True,
        )
        print(self.trainer.memory.summary(), flush=True)

    # ---- loop --------------------------------------------------------------------------
    def log_step(self, s: StepStats) -> dict:
        n = self.info.world_size
        tflops = self.flops / s.step_time_s / n / 1e12
        rec = {
            "step": s.step,
            "loss": s.loss,
            "lr": s.lr,
            "grad_norm": s.grad_norm,
            "tokens_per_s": self.trainer.tokens_per_step / s.step_time_s,
            "tflops_per_device": tflops,
            "mfu": self.peaks.mfu(tflops),
            "gemm_ceiling_frac": self.peaks.ceiling_frac(tflops),
            "step_time_s": s.step_time_s,
            "memory_gib": memory_gib(self.info.device),
            "peak_tflops": self.peaks.vendor or None,
            "gemm_ceiling_tflops": self.peaks.ceiling,
            "world_size": n,
            "grid": self.comm.grid.spec(),
            "skipped": s.skipped,
            "goldfish_dropped": s.dropped,
        }
        if self.rank == 0:
            self.metrics_log().write(rec)
            t = self.cfg.train
            if s.step % t.log_interval == 0 or s.step == t.steps - 1:
                print(
                    f"step {s.step:5d}/{t.steps} | loss {s.loss:.4f} | lr {s.lr:.2e} | gnorm "
                    f"{s.grad_norm:.3f} | {rec['tokens_per_s']:,.0f} tok/s | {tflops:.3g} TFLOP/s/dev | "
                    f"{_efficiency(rec)} | mem {rec['memory_gib']:.2f} GiB | "
                    f"{1000 * s.step_time_s:.0f} ms"
                    + (f" | goldfish dropped {100 * s.dropped:.1f}%" if t.goldfish_k else "")
                    + (" | SKIPPED (non-finite)" if s.skipped else ""),
                    flush=True,
                )
        return rec

    def log_eval(self, step: int, val: float) -> None:
        if self.rank == 0:
            self.metrics_log().write({"step": step, "val_loss": val})
            print(f"step {step:5d} | val loss {val:.4f}", flush=True)

    def metrics_log(self) -> MetricsLog:
        """Rank 0's writer of metrics.jsonl (and TensorBoard with ``train.tensorboard``)."""
        if getattr(self, "_metrics", None) is None:
            self._metrics = MetricsLog(self.out, self.cfg.train.tensorboard)
        return self._metrics

    def loop(self, start: int = 0) -> list[dict]:
        t = self.cfg.train
        history = []
        fault = _fault_step()
        for i in range(start, t.steps):
            try:
                hook = self.trainer.model.register_forward_hook(_poison) if i in fault else None
                try:
                    s = self.trainer.step(i)
                finally:
                    if hook is not None:
                        hook.remove()
            except TrainError as e:
                raise agreed(TrainError(f"{e}; last checkpoint: {self.last_checkpoint() or 'none'}")) from None
            if i == start:  # compiled, tuned, warmed up: a hung rank now stops the others quickly
                self.comm.set_timeout(self.cfg.parallel.timeout_s)
            history.append(self.log_step(s))
            if i == start and self.rank == 0:
                print(self.trainer.memory.measured(self.info.device), flush=True)
            if i == start and self.plan is not None and self.rank == 0:
                from axo4d.grid_auto import first_step_line

                print(first_step_line(self.plan, s.step_time_s), flush=True)
            last = i == t.steps - 1
            if (t.eval_interval and (i + 1) % t.eval_interval == 0) or last:
                val = self.trainer.evaluate()
                self.log_eval(i, val)
                if not math.isfinite(val):
                    raise agreed(
                        TrainError(
                            f"validation loss {val} at step {i}: the model diverged; not saving it; "
                            f"last checkpoint: {self.last_checkpoint() or 'none'}"
                        )
                    )
            self.after_step(i, last)
        skipped = sum(bool(h["skipped"]) for h in history)
        if skipped and self.rank == 0:
            print(
                f"warning: {skipped} of {len(history)} steps were skipped (non-finite loss or gradients; "
                f"\"skipped\": true in metrics.jsonl)",
                flush=True,
            )
        return history

    # ---- hooks for checkpointing (axo4d.checkpoint) ----------------------------------------
    def after_step(self, step: int, last: bool) -> None:
        """Save after every ``checkpoint.interval`` completed steps and at the end."""
        done, c = step + 1, self.cfg.checkpoint
        if (c.interval > 0 and done % c.interval == 0) or (last and c.at_end):
            t0 = time.perf_counter()
            path = self.ckpt.save(done)
            if self.rank == 0:
                print(f"checkpoint {path} ({time.perf_counter() - t0:.2f} s)", flush=True)

    def last_checkpoint(self) -> str | None:
        """The newest complete checkpoint of this run (saved or resumed from)."""
        return str(self.ckpt.last) if self.ckpt is not None and self.ckpt.last is not None else None

    def finish(self) -> None:
        if self.rank == 0:
            self.metrics_log().close()
            from axo4d.training.plot import plot_loss

            png = plot_loss(self.out / "metrics.jsonl", self.out / "loss.png", title=self.cfg.name)
            print(
                f"done: metrics {self.out / 'metrics.jsonl'}, plot {png}, config {self.out / 'config.yaml'}", flush=True
            )


def check_run_config(cfg: RunConfig, grid: Grid) -> None:
    """Values the dataclass types cannot rule out, and the model and batch against the grid:
    checked before any process group exists or anything is written."""
    check_values(cfg)
    if cfg.train.tensorboard:
        check_tensorboard()
    if cfg.parallel.cache_weights.strip().lower() != "auto":
        try:
            cached_blocks(cfg.parallel.cache_weights, cfg.model.n_layer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    own = model_spec(cfg.model, Grid()).checks  # the model's own numbers, whatever the grid
    if own:
        raise ConfigError("model config: " + "; ".join(f"model.{r}" for r in own))
    arith = Comm(grid, 0, init_groups=False)
    bad = model_spec(cfg.model, grid).divisibility_reasons()
    if bad:
        raise GridError(f"model does not fit grid {grid.spec()}: {'; '.join(bad)}")
    check_batch(cfg, arith)


def _efficiency(rec: dict) -> str:
    """'MFU x% | y% of GEMM ceiling' of a step record (MFU n/a without a vendor peak)."""
    mfu = f"MFU {100 * rec['mfu']:.1f}%" if rec["mfu"] is not None else "MFU n/a"
    frac = rec["gemm_ceiling_frac"]
    return mfu + (f" | {100 * frac:.1f}% of GEMM ceiling" if frac is not None else "")


def _fault_step() -> range:
    """``AXO4D_FAULT_NAN_AT_STEP`` (test hook, ``K`` or ``K-M``): the steps whose loss is made non-finite."""
    raw = os.environ.get("AXO4D_FAULT_NAN_AT_STEP", "")
    try:
        lo, _, hi = raw.partition("-")
        return range(int(lo), int(hi or lo) + 1) if raw else range(0)
    except ValueError:
        raise ConfigError(f"AXO4D_FAULT_NAN_AT_STEP={raw!r} must be a step number K or a range K-M") from None


def _poison(module: torch.nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    return output * float("nan")


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set, args.grid)
    if args.init_from:
        cfg = config_with_init(cfg, args.init_from, args.set)
    r = Run(args, cfg)
    r.setup()
    r.loop(r.start)
    r.finish()
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry: one clear error line and a documented exit status (axo4d.exits), never a hang."""
    return run_and_exit(run, argv, "axo4d.train")


if __name__ == "__main__":
    sys.exit(main())

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

Errors: bad input is one line on stderr and exit status 2; a failed or timed-out
collective (a rank died or hangs) or a non-finite loss is exit status 1 with the
rank, axis and operation (or step and last checkpoint) named.

Test hook: ``AXO4D_FAULT_NAN_AT_STEP=K`` (environment, every rank) makes the loss
of step K non-finite, to exercise ``train.nonfinite`` (stop / skip).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

from axo4d.config import RunConfig, dump_config, load_config
from axo4d.dist.bootstrap import init_distributed, shutdown
from axo4d.dist.comm import Comm
from axo4d.dist.grid import Grid
from axo4d.errors import USER_ERRORS, CommError, ConfigError, GridError, TrainError
from axo4d.spec import model_spec
from axo4d.training.checkpoint import Checkpointer, complete_checkpoints, resolve_resume
from axo4d.training.data import open_dataset, prepare_tokens
from axo4d.training.perf import memory_gib, peak_tflops
from axo4d.training.trainer import StepStats, Trainer, check_batch

#: seconds the other ranks wait, on a user error, so that rank 0 prints it before the launcher stops the job
USER_ERROR_GRACE_S = 2.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m axo4d.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", help="named config (axo4d/configs) or YAML path")
    ap.add_argument("--grid", default=None, help="grid spec, e.g. data=2,x=2,y=1,z=2 (overrides parallel.grid)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. train.steps=100 (repeatable)")
    ap.add_argument("--out", default="runs/latest", help="output folder")
    ap.add_argument("--resume", default=None, metavar="PATH|auto",
                    help="resume from a checkpoint folder, or the newest complete checkpoint of a run folder; "
                         "'auto': the newest in --out if any, else start fresh")
    ap.add_argument("--launcher", default="auto", help="auto, env, mpi, slurm or single")
    return ap.parse_args(argv)


class Run:
    """One training run of this rank: set-up, loop, outputs."""

    def __init__(self, args: argparse.Namespace, cfg: RunConfig) -> None:
        self.args, self.cfg, self.out = args, cfg, Path(args.out)
        grid = Grid.parse(cfg.parallel.grid, cfg.parallel.order)
        check_run_config(cfg, grid)
        self.info = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s, args.launcher)
        grid.check_world(self.info.world_size)
        self.rank = self.info.rank
        self.comm = Comm(grid, self.rank, timeout_s=cfg.parallel.timeout_s)
        self.ckpt: Checkpointer | None = None
        self.resume: dict | None = None
        self.start = 0

    # ---- set-up ------------------------------------------------------------------
    def on_rank0(self, fn):
        """Run ``fn`` on rank 0 and share its result, so an error there stops every rank alike."""
        res, err = None, None
        if self.rank == 0:
            try:
                res = fn()
            except USER_ERRORS as e:
                err = e
            except OSError as e:
                err = ConfigError(f"{e.strerror or e}: {e.filename!r}" if e.filename else str(e))
        res, err = self.comm.broadcast_object((res, err))
        if err is not None:
            raise err
        return res

    def prepare_output(self) -> None:
        """Create the output folder; on resume keep the metrics of the steps before the checkpoint."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            probe = self.out / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"output folder {str(self.out)!r} is not usable: {e.strerror} "
                              f"({e.filename})") from None
        dump_config(self.cfg, self.out / "config.yaml")
        metrics = self.out / "metrics.jsonl"
        if self.resume is None:
            old = self.out / "checkpoints"
            if old.is_dir():
                prev = self.out / "checkpoints.prev"
                shutil.rmtree(prev, ignore_errors=True)
                os.rename(old, prev)
                print(f"note: {old} of an earlier run moved to {prev} (use --resume auto to continue a run)",
                      flush=True)
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
        self.resume = self.on_rank0(lambda: resolve_resume(self.args.resume, self.out, self.cfg))
        self.on_rank0(lambda: prepare_tokens(self.cfg.data))   # bad data fails before --out is touched
        self.on_rank0(self.prepare_output)
        c = self.cfg
        self.data = open_dataset(c.data, c.model.seq_len, c.train.seed, c.model.vocab_size)
        self.trainer = Trainer(c, self.comm, self.data, self.info.device)
        self.ckpt = Checkpointer(self.out, c, self.comm, self.trainer.model, self.trainer.opt)
        if self.resume is not None:
            self.start = self.ckpt.load(Path(self.resume["path"]), self.resume["grid"])
        self.flops = self.trainer.model.spec.flops_per_step(c.train.global_batch, c.train.activation_checkpointing)
        self.peak = peak_tflops(self.info.device, self.trainer.dtype, c.train)
        if self.rank == 0:
            self.banner()
            if self.resume is not None:
                self.resume_note()

    def resume_note(self) -> None:
        r, t = self.resume, self.cfg.train
        print(f"resumed from {r['path']} (saved on grid {r['grid']}): continuing at step {self.start}", flush=True)
        if self.start >= t.steps:
            print(f"note: the checkpoint is at step {self.start} >= train.steps={t.steps}: nothing to train",
                  flush=True)
        old = r["config"].train
        diff = [k for k in ("steps", "lr", "min_lr", "warmup_steps", "decay_steps", "global_batch", "seed")
                if getattr(old, k) != getattr(t, k)]
        if diff:
            print("note: train settings differ from the checkpoint's run (the loss will not follow it exactly): "
                  + ", ".join(f"train.{k} {getattr(old, k)} -> {getattr(t, k)}" for k in diff), flush=True)

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
        print(f"FLOPs/step = {m.spec.flops_formula(ck)} = {self.flops:.4g} (docs/design.md); peak "
              f"{self.peak['tflops']:.4g} TFLOP/s per device ({self.peak['source']})", flush=True)

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
        fault = _fault_step()
        for i in range(start, t.steps):
            try:
                hook = self.trainer.model.register_forward_hook(_poison) if i == fault else None
                try:
                    s = self.trainer.step(i)
                finally:
                    if hook is not None:
                        hook.remove()
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
            from axo4d.training.plot import plot_loss
            png = plot_loss(self.out / "metrics.jsonl", self.out / "loss.png", title=self.cfg.name)
            print(f"done: metrics {self.out / 'metrics.jsonl'}, plot {png}, config {self.out / 'config.yaml'}",
                  flush=True)


def check_run_config(cfg: RunConfig, grid: Grid) -> None:
    """Values the dataclass types cannot rule out, and the model and batch against the grid:
    checked before any process group exists or anything is written."""
    t, c = cfg.train, cfg.checkpoint
    checks = [(t.steps >= 1, f"train.steps={t.steps} must be >= 1"),
              (t.nonfinite in ("stop", "skip"), f"train.nonfinite={t.nonfinite!r}; valid: stop, skip"),
              (c.interval >= 0, f"checkpoint.interval={c.interval} must be >= 0 (0 = only at the end)"),
              (c.keep >= 0, f"checkpoint.keep={c.keep} must be >= 0 (0 = keep all)"),
              (cfg.parallel.timeout_s > 0, f"parallel.timeout_s={cfg.parallel.timeout_s} must be > 0")]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    arith = Comm(grid, 0, init_groups=False)
    bad = model_spec(cfg.model, grid).divisibility_reasons()
    if bad:
        raise GridError(f"model does not fit grid {grid.spec()}: {'; '.join(bad)}")
    check_batch(cfg, arith)


def _fault_step() -> int:
    """``AXO4D_FAULT_NAN_AT_STEP`` (test hook): the step whose loss is made non-finite, or -1."""
    raw = os.environ.get("AXO4D_FAULT_NAN_AT_STEP", "")
    try:
        return int(raw) if raw else -1
    except ValueError:
        raise ConfigError(f"AXO4D_FAULT_NAN_AT_STEP={raw!r} must be a step number") from None


def _poison(module: torch.nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    return output * float("nan")


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
    r.loop(r.start)
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
        else:  # rank 0 reports it: give it time before a launcher kills the job on our exit
            time.sleep(USER_ERROR_GRACE_S)
        code = 2
    except (CommError, TrainError) as e:
        r, msg = _rank_hint(), str(e)
        msg = msg[len(f"rank {r}: "):] if msg.startswith(f"rank {r}: ") else msg
        print(f"axo4d.train: error: [rank {r}] {msg}", file=sys.stderr, flush=True)
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

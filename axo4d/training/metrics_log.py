"""Where rank 0 writes a run's metrics: ``OUT/metrics.jsonl`` (one JSON object per step or
evaluation) and, with ``train.tensorboard``, TensorBoard event files beside it
(``tensorboard --logdir OUT``): loss, validation loss, learning rate, gradient norm, tokens/s,
TFLOP/s per device, MFU (model FLOPs, no recomputation, against the vendor's dense peak), HFU
(hardware FLOPs, recomputation counted, against the same peak), the fraction of the measured
GEMM ceiling (hardware FLOPs against the measured bf16 GEMM rate) and memory, each under
``train/`` or ``val/``; lm-evaluation-harness scores (``eval.tasks``: ``{"step", "eval":
{"task/metric": value}}``) under ``eval/``; with ``train.fp8`` also the step's FP8 scale counts (``fp8_scales``,
``fp8_nonfinite_scales``, ``fp8_saturated_scales``: rank 0's casts, :class:`axo4d.nn.fp8.Fp8Stats`).

Step numbers: the printed lines count completed steps, as checkpoints do (``step 1/20`` is the
first step, after which ``checkpoints/step_000001`` would be saved; ``step 20/20`` the last);
a record's ``step`` field is the step's index from 0 (``step + 1`` steps completed), the index
the learning-rate schedule and the data order use."""

from __future__ import annotations

import json
from pathlib import Path

from axo4d.config.errors import ConfigError
from axo4d.training.perf import Peaks, memory_gib

#: metrics.jsonl fields shown in TensorBoard, and their tags
SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "hfu": "perf/hfu",
    "gemm_ceiling_frac": "perf/gemm_ceiling_frac",
    "memory_gib": "perf/memory_gib",
    "step_time_s": "perf/step_time_s",
    "val_loss": "val/loss",
    "epoch_fraction": "data/epoch_fraction",
    "samples_seen": "data/samples_seen",
    "fp8_nonfinite_scales": "fp8/nonfinite_scales",
    "fp8_saturated_scales": "fp8/saturated_scales",
}


def check_tensorboard() -> None:
    """``train.tensorboard`` needs the tensorboard package: say so before anything is written."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ConfigError(
            "train.tensorboard=true needs the 'tensorboard' package: pip install tensorboard "
            "(or pip install 'axo4d[tensorboard]'), or set train.tensorboard=false"
        ) from None


class MetricsLog:
    """Appends records to ``out/metrics.jsonl`` and, if asked, to TensorBoard (rank 0 only)."""

    def __init__(self, out: Path, tensorboard: bool) -> None:
        self.path = Path(out) / "metrics.jsonl"
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out))

    def write(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for key, tag in SCALARS.items():
                if key in rec and rec[key] is not None:
                    self.tb.add_scalar(tag, float(rec[key]), int(rec["step"]))
            for name, v in (rec.get("eval") or {}).items():  # lm-evaluation-harness scores: eval/task/metric
                self.tb.add_scalar(f"eval/{name}", float(v), int(rec["step"]))
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def efficiency(rec: dict) -> str:
    """'MFU x% | HFU y% | z% of GEMM ceiling' of a step record (MFU and HFU n/a without a vendor peak)."""
    out = " | ".join(
        f"{k.upper()} {100 * rec[k]:.1f}%" if rec.get(k) is not None else f"{k.upper()} n/a" for k in ("mfu", "hfu")
    )
    frac = rec["gemm_ceiling_frac"]
    return out + (f" | {100 * frac:.1f}% of GEMM ceiling" if frac is not None else "")


def _fp8_note(counts: dict | None) -> str:
    """' | fp8 scales: N non-finite, M saturated' when a step had any (nothing otherwise)."""
    if not counts or not (counts["fp8_nonfinite_scales"] or counts["fp8_saturated_scales"]):
        return ""
    return f" | fp8 scales: {counts['fp8_nonfinite_scales']} non-finite, {counts['fp8_saturated_scales']} saturated"


class StepLog:
    """A run's record of each step and evaluation: every rank builds it, rank 0 writes
    ``metrics.jsonl`` (and TensorBoard) and prints a line every ``train.log_interval`` steps."""

    def __init__(
        self,
        out: Path,
        cfg,
        rank: int,
        world_size: int,
        grid: str,
        flops: tuple[float, float],
        peaks: Peaks,
        tokens_per_step: int,
        device,
    ) -> None:
        self.out, self.cfg, self.rank, self.world_size, self.grid = out, cfg, rank, world_size, grid
        # (model FLOPs, hardware FLOPs) of a step: MFU's and HFU's numerators (docs/design.md section 5)
        (self.model_flops, self.hw_flops), self.peaks = flops, peaks
        self.tokens_per_step, self.device = tokens_per_step, device
        self._log: MetricsLog | None = None

    def metrics(self) -> MetricsLog:
        if self._log is None:
            self._log = MetricsLog(self.out, self.cfg.train.tensorboard)
        return self._log

    def step(self, s) -> dict:
        """The record of :class:`~axo4d.training.trainer.StepStats` ``s`` (written and printed on rank 0)."""
        tflops = self.model_flops / s.step_time_s / self.world_size / 1e12
        hw = self.hw_flops / s.step_time_s / self.world_size / 1e12
        done = s.step + 1  # printed: steps completed, as checkpoints count them (step_000001 after the first)
        rec = {
            "step": s.step,
            "loss": s.loss,
            "lr": s.lr,
            "grad_norm": s.grad_norm,
            "tokens_per_s": self.tokens_per_step / s.step_time_s,
            "tflops_per_device": tflops,
            "hw_tflops_per_device": hw,
            "mfu": self.peaks.mfu(tflops),
            "hfu": self.peaks.mfu(hw),
            "gemm_ceiling_frac": self.peaks.ceiling_frac(hw),
            "step_time_s": s.step_time_s,
            "memory_gib": memory_gib(self.device),
            "peak_tflops": self.peaks.vendor or None,
            "gemm_ceiling_tflops": self.peaks.ceiling,
            "world_size": self.world_size,
            "grid": self.grid,
            "skipped": s.skipped,
            "goldfish_dropped": s.dropped,
            "epoch": s.epoch,
            "epoch_fraction": s.epoch_fraction,
            "samples_seen": s.samples_seen,
            **(s.fp8 or {}),  # FP8 scale counts (rank 0's casts): scales, non-finite, saturated
            **(s.moe or {}),  # MoE: aux_loss, tokens per expert (min/mean/max over the step)
        }
        if s.samples is not None:
            rec["samples"] = s.samples
        if self.rank == 0:
            self.metrics().write(rec)
            t = self.cfg.train
            if done == 1 or done % t.log_interval == 0 or done == t.steps:
                print(
                    f"step {done:5d}/{t.steps} | epoch {s.epoch + s.epoch_fraction:.3f} | loss {s.loss:.4f} | "
                    f"lr {s.lr:.2e} | gnorm "
                    f"{s.grad_norm:.3f} | {rec['tokens_per_s']:,.0f} tok/s | {tflops:.3g} TFLOP/s/dev | "
                    f"{efficiency(rec)} | mem {rec['memory_gib']:.2f} GiB | "
                    f"{1000 * s.step_time_s:.0f} ms"
                    + (f" | goldfish dropped {100 * s.dropped:.1f}%" if t.goldfish_k else "")
                    + (" | SKIPPED (non-finite)" if s.skipped else "")
                    + _fp8_note(s.fp8),
                    flush=True,
                )
        return rec

    def evaluation(self, step: int, val: float) -> None:
        """The validation loss after step ``step`` (its index from 0; printed as steps completed)."""
        if self.rank == 0:
            self.metrics().write({"step": step, "val_loss": val})
            print(f"step {step + 1:5d} | val loss {val:.4f}", flush=True)

    def harness(self, step: int, scores: dict[str, float]) -> None:
        """lm-evaluation-harness scores ``{"task/metric": value}`` after step ``step`` (its index from 0;
        printed as steps completed; ``eval.tasks``)."""
        if self.rank == 0:
            self.metrics().write({"step": step, "eval": scores})
            print(f"step {step + 1:5d} | eval " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()), flush=True)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

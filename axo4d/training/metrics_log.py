"""Where rank 0 writes a run's metrics: ``OUT/metrics.jsonl`` (one JSON object per step or
evaluation) and, with ``train.tensorboard``, TensorBoard event files beside it
(``tensorboard --logdir OUT``): loss, validation loss, learning rate, gradient norm, tokens/s,
TFLOP/s per device, MFU (against the vendor's peak), the fraction of the measured GEMM
ceiling and memory, each under ``train/`` or ``val/``."""

from __future__ import annotations

import json
from pathlib import Path

from axo4d.errors import ConfigError

#: metrics.jsonl fields shown in TensorBoard, and their tags
SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "gemm_ceiling_frac": "perf/gemm_ceiling_frac",
    "memory_gib": "perf/memory_gib",
    "step_time_s": "perf/step_time_s",
    "val_loss": "val/loss",
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
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None

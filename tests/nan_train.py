"""``python -m axo4d.train`` with a test hook: ``AXO4D_FAULT_NAN_AT_STEP=K`` (or ``K-M``, every
rank's environment) makes the loss of optimizer step K (K to M) non-finite, by multiplying the
model's output by NaN during that step, to exercise ``train.nonfinite`` (stop / skip).

    python -m tests.nan_train ARGS...          (or under a launcher: ... -- tests.nan_train ARGS...)

The hook lives here, not in the library: it wraps :meth:`axo4d.training.trainer.Trainer.step`.
"""

from __future__ import annotations

import os
import sys

from axo4d.training.trainer import Trainer


def nan_steps(raw: str) -> range:
    lo, _, hi = raw.partition("-")
    return range(int(lo), int(hi or lo) + 1) if raw else range(0)


def _poison(module, inputs, output):
    return output * float("nan")


def install(steps: range) -> None:
    """Every Trainer's step ``i`` in ``steps`` runs with the model's output made NaN."""
    step = Trainer.step

    def poisoned(self: Trainer, i: int):
        if i not in steps:
            return step(self, i)
        hook = self.model.register_forward_hook(_poison)
        try:
            return step(self, i)
        finally:
            hook.remove()

    Trainer.step = poisoned


if __name__ == "__main__":
    install(nan_steps(os.environ.get("AXO4D_FAULT_NAN_AT_STEP", "")))
    from axo4d.train import main

    sys.exit(main(sys.argv[1:]))

"""What every parallel layer is built with: the grid's communicator, the schedule, the tuner and the FP8 plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from axo4d.dist.comm import Comm
from axo4d.nn.schedule import Schedule

if TYPE_CHECKING:
    from axo4d.nn.blas_tuner import GemmTuner
    from axo4d.nn.fp8_plan import Fp8Plan


@dataclass(frozen=True)
class LayerContext:
    """Handed to every layer at construction (nothing is written into layers afterwards)."""

    comm: Comm
    """Process groups and collectives of the grid."""
    schedule: Schedule
    """When collectives are issued: :class:`~axo4d.nn.schedule.Schedule` (eager) or
    :class:`~axo4d.nn.overlap_schedule.OverlapSchedule`."""
    tuner: GemmTuner | None = None
    """Per-GEMM layout choice (:mod:`axo4d.nn.blas_tuner`), or plain ``a @ b``."""
    fp8: Fp8Plan | None = None
    """Which linear layers run their GEMMs in FP8, and the recipe (:mod:`axo4d.nn.fp8`, ``train.fp8``);
    ``None``: every layer in the compute dtype."""
    z_split: str = "batch"
    """What z splits in training and evaluation (``parallel.z_split``, resolved): 'batch' (whole
    samples) or 'sequence' (every sample's sequence, :mod:`axo4d.nn.seqsplit`)."""

    @property
    def grid(self):
        return self.comm.grid


def as_context(ctx: LayerContext | Comm) -> LayerContext:
    """A :class:`LayerContext`; a bare :class:`Comm` gets an eager schedule of its own (a layer
    used on its own, as in tests: its gradients are summed over data by that schedule's ``finish``)."""
    return ctx if isinstance(ctx, LayerContext) else LayerContext(ctx, Schedule(ctx))

"""Peak rates and memory readings for the throughput figures the trainer and benchmarks print.

Two figures, never mixed up (docs/design.md section 5):

* **MFU**: model FLOPs (no recomputation) per second against the vendor's *dense bf16 peak* of the
  device, as the field reports it; **HFU**: hardware FLOPs (activation checkpointing's
  recomputation counted) against the same peak. None on a CPU or an unknown GPU (then only
  ``train.peak_tflops`` gives one).
* **fraction of the GEMM ceiling**: hardware FLOPs against the bf16 GEMM rate *measured* on that
  kind of device (an unknown device is measured at start-up), printed separately and labelled as
  such. It says how close a run comes to what the GEMMs alone can do.

Both tables live in :mod:`axo4d.facts.devices` (torch-free: the performance model and
``launch.job`` read them too).

Device names are matched as whole words, most specific first: ``GH200`` is not an ``H200``,
``H100 PCIe`` not an ``H100`` SXM.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import torch

from axo4d.config import TrainConfig
from axo4d.facts.devices import GEMM_CEILINGS_BF16, VENDOR_PEAKS_BF16, gemm_ceiling, vendor_peak  # noqa: F401


def measure_gemm_tflops(device: torch.device, dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """Measured dense GEMM rate of ``n^3`` matrices on ``device`` (TFLOP/s; best of ``reps``)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


@dataclass(frozen=True)
class Peaks:
    """The two rates a throughput is compared with (TFLOP/s per device; 0 = none)."""

    vendor: float
    vendor_source: str
    ceiling: float
    ceiling_source: str

    def mfu(self, tflops: float) -> float | None:
        """Utilisation against the vendor's dense peak (None without one): MFU of model FLOP/s,
        HFU of hardware FLOP/s."""
        return tflops / self.vendor if self.vendor else None

    def ceiling_frac(self, tflops: float) -> float | None:
        """Fraction of the measured GEMM ceiling (None without one)."""
        return tflops / self.ceiling if self.ceiling else None

    def describe(self) -> str:
        v = f"{self.vendor:.4g} TFLOP/s ({self.vendor_source})" if self.vendor else f"none ({self.vendor_source})"
        return (
            f"MFU (model FLOPs) and HFU (with recomputation) against the vendor's dense bf16 peak {v}; "
            f"separately, the fraction of the measured GEMM "
            f"ceiling {self.ceiling:.4g} TFLOP/s ({self.ceiling_source})"
        )


def device_peaks(device: torch.device, dtype: torch.dtype, t: TrainConfig | None = None) -> Peaks:
    """The vendor peak (``train.peak_tflops`` if set) and the GEMM ceiling of ``device``; a ceiling
    not in the table is measured now (4096^3 GEMMs in ``dtype`` on a GPU, 512^3 on a CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        vendor, label = vendor_peak(name)
        vsrc = f"{label} data sheet" if vendor else f"{name}: not in axo4d.facts.devices' table"
        ceiling, csrc = gemm_ceiling(name)
        if not ceiling:
            ceiling = measure_gemm_tflops(device, dtype, 4096, 5)
            csrc = f"measured now on {name}, 4096^3 {str(dtype).replace('torch.', '')}"
    else:
        vendor, vsrc = 0.0, "a CPU has no vendor bf16 peak here"
        ceiling = measure_gemm_tflops(device, dtype, 512)
        csrc = f"measured now, {str(dtype).replace('torch.', '')} 512^3 GEMM, {torch.get_num_threads()} threads"
    if t is not None and t.peak_tflops > 0:
        vendor, vsrc = t.peak_tflops, "train.peak_tflops"
    return Peaks(vendor, vsrc, ceiling, csrc)


def memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or this process's peak resident memory on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

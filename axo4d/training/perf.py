"""Peak rates and memory readings for the throughput figures the trainer and benchmarks print.

Two figures, never mixed up (docs/design.md section 5):

* **MFU**: model FLOPs per second against the vendor's *dense bf16 peak* of the device, as the
  field reports it (:data:`VENDOR_PEAKS_BF16`); none on a CPU or an unknown GPU (then only
  ``train.peak_tflops`` gives one).
* **fraction of the GEMM ceiling**: against the bf16 GEMM rate *measured* on that kind of device
  (:data:`GEMM_CEILINGS_BF16`; an unknown device is measured at start-up), printed separately and
  labelled as such. It says how close a run comes to what the GEMMs alone can do.

Device names are matched as whole words, most specific first: ``GH200`` is not an ``H200``,
``H100 PCIe`` not an ``H100`` SXM.
"""

from __future__ import annotations

import re
import resource
import time
from dataclasses import dataclass

import torch

from axo4d.config import TrainConfig

#: (name pattern, label, dense bf16 TFLOP/s per device) from the vendors' data sheets; AMD MI250(X):
#: per GCD (one GCD is one torch device), half the card's figure. First match wins.
VENDOR_PEAKS_BF16: tuple[tuple[str, str, float], ...] = (
    (r"\bGH200\b", "GH200", 989.0),
    (r"\bH200\b.*\bNVL\b", "H200 NVL", 835.0),
    (r"\bH200\b", "H200 SXM", 989.0),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", 756.0),
    (r"\bH100\b.*\bNVL\b", "H100 NVL", 835.0),
    (r"\bH100\b", "H100 SXM", 989.0),
    (r"\bA100\b", "A100", 312.0),
    (r"\bMI250X\b", "MI250X (per GCD)", 191.5),
    (r"\bMI250\b", "MI250 (per GCD)", 181.0),
    (r"\bMI300X\b", "MI300X", 1307.4),
)

#: (name pattern, label, measured bf16 GEMM TFLOP/s, where it was measured)
GEMM_CEILINGS_BF16: tuple[tuple[str, str, float, str], ...] = (
    (r"\bGH200\b", "GH200", 813.0, "AxoNN's empirical peak on Alps"),
    (r"\bH200\b.*\bNVL\b", "H200 NVL", 0.0, ""),
    (r"\bH200\b", "H200 SXM", 813.0, "one H200, 8192^3 NN bf16 GEMM (NT/TN/TT 745-759)"),
    (r"\bA100\b", "A100", 280.0, "AxoNN's empirical peak on Perlmutter"),
    (r"\bMI250X\b", "MI250X (per GCD)", 125.0, "AxoNN's empirical peak on Frontier"),
)


def _match(table, name: str):
    for row in table:
        if re.search(row[0], name):
            return row
    return None


def vendor_peak(name: str) -> tuple[float, str]:
    """``(dense bf16 TFLOP/s, label)`` of the device called ``name`` (0 and '' if unknown)."""
    row = _match(VENDOR_PEAKS_BF16, name)
    return (row[2], row[1]) if row else (0.0, "")


def gemm_ceiling(name: str) -> tuple[float, str]:
    """``(measured bf16 GEMM TFLOP/s, where)`` of the device called ``name`` (0 and '' if not in the table)."""
    row = _match(GEMM_CEILINGS_BF16, name)
    return (row[2], f"{row[1]}: {row[3]}") if row and row[2] else (0.0, "")


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
        """Model FLOPs utilisation against the vendor's dense peak (None without one)."""
        return tflops / self.vendor if self.vendor else None

    def ceiling_frac(self, tflops: float) -> float | None:
        """Fraction of the measured GEMM ceiling (None without one)."""
        return tflops / self.ceiling if self.ceiling else None

    def describe(self) -> str:
        v = f"{self.vendor:.4g} TFLOP/s ({self.vendor_source})" if self.vendor else f"none ({self.vendor_source})"
        return (
            f"MFU against the vendor's dense bf16 peak {v}; separately, the fraction of the measured GEMM "
            f"ceiling {self.ceiling:.4g} TFLOP/s ({self.ceiling_source})"
        )


def device_peaks(device: torch.device, dtype: torch.dtype, t: TrainConfig | None = None) -> Peaks:
    """The vendor peak (``train.peak_tflops`` if set) and the GEMM ceiling of ``device``; a ceiling
    not in the table is measured now (4096^3 GEMMs in ``dtype`` on a GPU, 512^3 on a CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        vendor, label = vendor_peak(name)
        vsrc = f"{label} data sheet" if vendor else f"{name}: not in axo4d.training.perf's table"
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

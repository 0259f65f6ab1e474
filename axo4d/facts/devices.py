"""Device facts, in one torch-free table: the vendor's dense bf16 peak and the measured bf16 GEMM
ceiling of each accelerator the project knows. The trainer's MFU/HFU figures
(:mod:`axo4d.training.perf`), the performance model's machines (``perfmodel/machines/*.yaml`` name
their ``device``; their ``gemm_tflops`` comes from here) and the job scripts' headers
(``launch.job``) all read it, so a new machine's accelerator is one row here.

Two figures, never mixed up (docs/design.md section 5): MFU and HFU are against the **vendor
peak** (data sheets; AMD MI250(X) per GCD -- one GCD is one torch device -- half the card's
figure); the **GEMM ceiling** is what a large bf16 GEMM measurably reaches on that device.

Device names are matched as whole words, most specific first: ``GH200`` is not an ``H200``,
``H100 PCIe`` not an ``H100`` SXM.
"""

from __future__ import annotations

import re

#: (name pattern, label, dense bf16 TFLOP/s per device) from the vendors' data sheets. First match wins.
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

#: (name pattern, label, measured bf16 GEMM TFLOP/s, where it was measured); 0 = not measured
GEMM_CEILINGS_BF16: tuple[tuple[str, str, float, str], ...] = (
    (r"\bGH200\b", "GH200", 813.0, "AxoNN's empirical peak on Alps"),
    (r"\bH200\b.*\bNVL\b", "H200 NVL", 0.0, ""),
    (r"\bH200\b", "H200 SXM", 813.0, "one H200, 8192^3 NN bf16 GEMM (NT/TN/TT 745-759)"),
    (r"\bA100\b", "A100", 280.0, "AxoNN's empirical peak on Perlmutter"),
    (r"\bMI250X\b", "MI250X (per GCD)", 125.0, "AxoNN's empirical peak on Frontier"),
)


def _match(table: tuple, name: str) -> tuple | None:
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


def peak_line(name: str) -> str:
    """One line for a job script's header: the vendor peak with the measured ceiling beside it."""
    v, label = vendor_peak(name)
    c, where = gemm_ceiling(name)
    vendor = f"vendor dense bf16 peak {v:g} TFLOP/s ({label} data sheet)" if v else f"no vendor peak for {name!r}"
    return vendor + (f"; measured GEMM ceiling {c:g} TFLOP/s ({where})" if c else "; no measured GEMM ceiling")


__all__ = ["VENDOR_PEAKS_BF16", "GEMM_CEILINGS_BF16", "vendor_peak", "gemm_ceiling", "peak_line"]

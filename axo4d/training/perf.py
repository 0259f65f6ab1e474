"""Peak rates and memory readings for the throughput figures the trainer prints."""
from __future__ import annotations

import resource
import time

import torch

from axo4d.config import TrainConfig

#: bf16 dense GEMM ceilings (TFLOP/s) from docs/design.md section 5, matched on the device name
GPU_PEAKS_BF16 = (("H200", 813.0), ("GH200", 813.0), ("H100", 813.0), ("A100", 280.0), ("MI250", 125.0))


def measure_gemm_tflops(device: torch.device, dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """Measured dense GEMM rate of ``n^3`` matrices on ``device`` (TFLOP/s)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def peak_tflops(device: torch.device, dtype: torch.dtype, t: TrainConfig) -> dict:
    """The peak per device used for MFU: ``train.peak_tflops`` if set, a known GPU's bf16
    ceiling, else a GEMM rate measured now (CPU)."""
    if t.peak_tflops > 0:
        return {"tflops": t.peak_tflops, "source": "train.peak_tflops"}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, val in GPU_PEAKS_BF16:
            if key in name:
                return {"tflops": val, "source": f"{name} bf16 GEMM ceiling, docs/design.md s5"}
        return {"tflops": measure_gemm_tflops(device, dtype, 4096), "source": f"measured {name} GEMM"}
    rate = measure_gemm_tflops(device, dtype, 512)
    return {"tflops": rate, "source": f"measured fp32 512^3 GEMM on this CPU, {torch.get_num_threads()} threads"}


def memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or this process's peak resident memory on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

"""Where the GPU-path tests run, and at what size (``AXO4D_GPU_TESTS_ON_CPU``):

* CUDA present: on the GPU, full size;
* ``AXO4D_GPU_TESTS_ON_CPU=1``: on CPU ranks, full size (``bench/gpu_check.sh --cpu``);
* no CUDA and the switch unset (CI's ``pytest -q``): on CPU ranks at a **reduced size** -- the same
  code paths (every dtype, schedule, optimizer mode and the checkpoint moved between grids), fewer
  steps and grids -- so the GPU path's logic is exercised on every change;
* ``AXO4D_GPU_TESTS_ON_CPU=0`` without CUDA: skipped.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
SWITCH = os.environ.get("AXO4D_GPU_TESTS_ON_CPU", "")
ON_CPU = SWITCH == "1" or (not CUDA and SWITCH != "0")
"""The ranks run on the CPU."""
REDUCED = ON_CPU and SWITCH != "1"
"""Fewer steps and grids (CI without a GPU)."""
SKIP = not CUDA and not ON_CPU
SKIP_REASON = "no CUDA and AXO4D_GPU_TESTS_ON_CPU=0 (unset or 1: run on CPU ranks)"

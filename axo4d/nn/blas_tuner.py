"""BLAS layout tuner: the fastest of a few mathematically identical ways to run each GEMM.

For ``C = A @ B`` (a Linear3D's forward ``X Wᵀ``, dX ``dY W`` and dW ``dYᵀ X``) the
variants are ``{A·B, (Bᵀ·Aᵀ)ᵀ} x {operands as they are (transposed views), operands copied
to contiguous}``:

====  ================  ========================================================================
 0    ``a@b``           the product as given (the default; BLAS reads transposed views itself)
 1    ``a@b:copy``      non-contiguous operands first copied contiguous
 2    ``(bT@aT)T``      the transposed product, then transposed back into a contiguous result
 3    ``(bT@aT)T:copy`` both: copied operands of the transposed product
====  ================  ========================================================================

A variant whose copies would change nothing (operands already contiguous) is skipped. On the
first use of a key (GEMM kind, shapes, operand layouts, bias, dtype, device name) every rank
times the variants (best of a few runs, variants taking turns; a variant must beat ``a@b`` by
:data:`MARGIN` to be chosen); the timing vector is summed over the world (an all-reduce on the default
group, not counted in :class:`~axo4d.dist.comm.Comm`'s byte counters) so every rank keeps the same
variant. Deadlock-free because every rank of a grid has the same local shapes and meets the
same keys in the same order, and the decision table starts identical on all ranks (rank 0
reads the cache file and broadcasts it). Decisions are written (rank 0) to a JSON file keyed by
the same key; the next run reuses them without timing. Variants are not guaranteed bit-identical
(BLAS kernels may accumulate in another order); results agree to rounding.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

from axo4d.dist.comm import Comm

VARIANTS = ("a@b", "a@b:copy", "(bT@aT)T", "(bT@aT)T:copy")
CACHE_VERSION = 2
#: a variant must beat ``a@b`` by this fraction to be chosen (timings on a busy machine are noisy)
MARGIN = 0.05


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def run_variant(v: int, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` computed as variant ``v`` of :data:`VARIANTS`; the result is contiguous."""
    swap, copy = v >= 2, v % 2 == 1
    x, y = (b.t(), a.t()) if swap else (a, b)
    if copy:
        x, y = _contig(x), _contig(y)
    if not swap:
        return x @ y if bias is None else torch.addmm(bias, x, y)
    c = (x @ y).t().contiguous()
    return c if bias is None else c.add_(bias)


def _layout(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "n"
    return "t" if t.t().is_contiguous() else "s"


def device_name(device: torch.device) -> str:
    """Name of the device the timings hold for (GPU model, or CPU and its thread count)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.machine()}:{torch.get_num_threads()}t"


def gemm_key(kind: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, dev: str | None = None) -> str:
    """Cache key: kind, shapes, operand layouts, bias, dtype, device name."""
    return (
        f"{kind}|{a.shape[0]}x{a.shape[1]}@{b.shape[0]}x{b.shape[1]}|{_layout(a)}{_layout(b)}"
        f"{'+bias' if bias is not None else ''}|{str(a.dtype).replace('torch.', '')}|"
        f"{dev or device_name(a.device)}"
    )


def default_cache_path() -> Path:
    from axo4d.config import default_cache_dir

    return default_cache_dir() / "blas_tuner.json"


class GemmTuner:
    """Per-key GEMM layout decisions, agreed over the world of ``comm`` and cached in ``path``."""

    def __init__(
        self,
        comm: Comm | None = None,
        path: str | os.PathLike | None = None,
        *,
        reps: int | None = None,
        verbose: bool = True,
    ) -> None:
        self.comm = comm
        self.path = Path(path) if path else default_cache_path()
        self.reps, self.verbose = reps, verbose
        self.table: dict[str, dict] = {}
        self.uses: dict[tuple[str, str], str] = {}  # (layer tag, kind) -> key
        self.timed = 0  # keys timed by this instance
        self._dirty = False
        self._printed = False
        self._dev: dict[torch.device, str] = {}
        self._fast: dict[tuple, int] = {}  # operand signature -> variant (no string keys)
        loaded = self._load() if self._rank() == 0 else None
        if self._world() > 1:
            loaded = comm.broadcast_object(loaded, src=0)
        self.table = loaded or {}
        self.loaded = len(self.table)

    # ---- ranks ------------------------------------------------------------------------------
    def _world(self) -> int:
        return self.comm.grid.world_size if self.comm is not None else 1

    def _rank(self) -> int:
        return self.comm.rank if self.comm is not None else 0

    # ---- the GEMM -----------------------------------------------------------------------------
    def matmul(
        self, kind: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, tag: str = ""
    ) -> torch.Tensor:
        """``a @ b (+ bias)`` with the decided variant (tuned now if the key is new)."""
        fast = (kind, tag, a.shape, a.stride(), b.shape, b.stride(), bias is None, a.dtype, a.device)
        v = self._fast.get(fast)
        if v is None:  # first call with these operands: look up or tune
            dev = self._dev.get(a.device)
            if dev is None:
                dev = self._dev[a.device] = device_name(a.device)
            key = gemm_key(kind, a, b, bias, dev)
            if tag:
                self.uses.setdefault((tag, kind), key)
            entry = self.table.get(key) or self._tune(key, a, b, bias)
            v = self._fast[fast] = VARIANTS.index(entry["variant"])
        return run_variant(v, a, b, bias)

    def chose_default(self, tag: str, kinds: tuple[str, ...] = ("fwd", "dx", "dw")) -> bool | None:
        """Whether layer ``tag``'s GEMMs of every kind in ``kinds`` run as ``a@b`` (the layout an
        ``nn.Linear`` uses); ``None`` while one of them is not decided yet (first use pending)."""
        variants = []
        for kind in kinds:
            key = self.uses.get((tag, kind))
            entry = self.table.get(key) if key is not None else None
            if entry is None:
                return None
            variants.append(entry["variant"])
        return all(v == VARIANTS[0] for v in variants)

    def candidates(self, a: torch.Tensor, b: torch.Tensor) -> list[int]:
        """Variants that differ from each other for these operand layouts."""
        out = [0]
        if not (a.is_contiguous() and b.is_contiguous()):
            out.append(1)
        out.append(2)
        if not (a.t().is_contiguous() and b.t().is_contiguous()):
            out.append(3)
        return out

    def _time(self, v: int, a, b, bias) -> float:
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        t0 = time.perf_counter()
        run_variant(v, a, b, bias)
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        return time.perf_counter() - t0

    def _tune(self, key: str, a, b, bias) -> dict:
        """Best of ``reps`` timings per variant, variants taking turns (load hits all alike);
        summed over the world; a variant replaces ``a@b`` only if >= ``MARGIN`` faster."""
        times = torch.full((len(VARIANTS),), float("inf"), dtype=torch.float64)
        cand = self.candidates(a, b)
        with torch.no_grad():
            for v in cand:
                run_variant(v, a, b, bias)  # warm-up
            for _ in range(self.reps or (10 if a.is_cuda else 5)):
                for v in cand:
                    times[v] = min(float(times[v]), self._time(v, a, b, bias))
        if self._world() > 1 and dist.is_initialized() and dist.get_world_size() == self._world():
            t = times.to(a.device) if dist.get_backend() == "nccl" else times
            dist.all_reduce(t, op=dist.ReduceOp.SUM)  # the same vector, hence decision, on every rank
            times = t.cpu() / self._world()
        best = int(torch.argmin(times))
        if times[best] > (1 - MARGIN) * times[0]:  # within noise of the default: keep the default
            best = 0
        entry = {
            "variant": VARIANTS[best],
            "ms": [round(float(x) * 1e3, 6) if x != float("inf") else None for x in times],
        }
        self.table[key] = entry
        self.timed += 1
        self._dirty = True
        return entry

    # ---- cache ----------------------------------------------------------------------------------
    def _load(self) -> dict:
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if raw.get("version") != CACHE_VERSION:
            return {}
        return {k: v for k, v in raw.get("entries", {}).items() if v.get("variant") in VARIANTS}

    def save(self) -> None:
        """Write new decisions (rank 0; merged with the file's, atomically). No-op if none."""
        if not self._dirty:
            return
        self._dirty = False
        if self._rank() != 0:
            return
        entries = self._load()
        entries.update(self.table)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    # ---- report -----------------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """One row per (layer tag, GEMM kind) used: key, chosen variant, speed-up over ``a@b``."""
        out = []
        for (tag, kind), key in sorted(self.uses.items()):
            e = self.table.get(key)
            if e is None:
                continue
            ms = e["ms"]
            chosen = ms[VARIANTS.index(e["variant"])]
            speedup = ms[0] / chosen if ms[0] and chosen else float("nan")
            out.append({"layer": tag, "gemm": kind, "key": key, "variant": e["variant"], "ms": ms, "speedup": speedup})
        return out

    def table_text(self) -> str:
        lines = [
            f"BLAS tuner ({self.timed} keys timed, {self.loaded} from {self.path}):",
            f"  {'layer':10s} {'gemm':4s} {'shape':26s} {'variant':14s} {'speed-up vs a@b':>15s}",
        ]
        for r in self.rows():
            shape = r["key"].split("|")[1] + " " + r["key"].split("|")[2]
            lines.append(f"  {r['layer']:10s} {r['gemm']:4s} {shape:26s} {r['variant']:14s} {r['speedup']:15.2f}")
        return "\n".join(lines)

    def print_once(self) -> None:
        """Print the decisions table on rank 0, the first time there is one."""
        if self._printed or not self.uses:
            return
        self._printed = True
        if self._rank() == 0 and self.verbose:
            print(self.table_text(), flush=True)

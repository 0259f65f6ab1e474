"""Host offload of optimizer state (``train.offload``, docs/design.md section 9).

:class:`HostState` holds the offloaded :class:`~axo4d.training.optim.sharded.Segment` s of a
:class:`~axo4d.training.optim.sharded.ShardedAdamW`: their fp32 master weights, Adam moments and a
gradient copy in host memory (pinned when CUDA is there, so transfers are asynchronous DMA), and a
CPU AdamW over them. Per step:

* during backward, as each gradient bucket is final and reduced (the schedule's
  :meth:`~axo4d.nn.schedule.Schedule.on_bucket_reduced` hook), its offloaded gradients are copied
  to the host on a side stream (:meth:`HostState.fetch`): the transfers overlap the rest of
  backward;
* at the step (the global norm is needed first: clipping and the non-finite check come before
  any update), bucket by bucket: wait for its copy, clip, AdamW on the CPU, and send the new
  weights back in the parameters' dtype (the compute dtype) asynchronously, so the transfer of one
  bucket overlaps the CPU update of the next (:meth:`HostState.update`).

On a CPU device "host" and device are the same memory; the code path is the same (copies are
plain copies) and the arithmetic is AdamW's own, so results are bit-identical to no offload.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from axo4d.config import TrainConfig
from axo4d.config.errors import TrainError
from axo4d.nn.buckets import Bucket
from axo4d.training.optim.owned import Segment, adamw, flat_views, init_state

GIB = 2**30


def host_empty(n: int, dtype: torch.dtype, pin: bool, rank: int, pinned_so_far: int) -> torch.Tensor:
    """An empty host tensor, page-locked when ``pin``; a pinning failure is one line naming the size."""
    try:
        return torch.empty(n, dtype=dtype, pin_memory=pin)
    except RuntimeError as e:
        nbytes = n * torch.tensor([], dtype=dtype).element_size()
        raise TrainError(
            f"rank {rank}: pinning {nbytes / GIB:.3f} GiB of host memory for offloaded optimizer state failed "
            f"after {pinned_so_far / GIB:.2f} GiB ({str(e).splitlines()[0]}); lower train.host_memory_gb, use "
            f"train.offload=auto, or spread the model over more ranks"
        ) from None


def available_host_bytes() -> int:
    """``MemAvailable`` of this node (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


class HostState:
    """The offloaded segments: host masters, moments and gradient copies, and their CPU AdamW."""

    def __init__(
        self,
        segs: list[Segment],
        t: TrainConfig,
        device: torch.device,
        rank: int,
        decay: Callable[[Segment], bool],
        weights_dtype: torch.dtype,
    ) -> None:
        """Masters from the parameters' current (fp32) values; ``weights_dtype``: the dtype the
        parameters are kept in on the device from now on (gradients arrive in it)."""
        self.segs, self.device = segs, device
        self.cuda = device.type == "cuda"
        self.by_bucket: dict[int, list[Segment]] = {}
        for s in segs:
            self.by_bucket.setdefault(id(s.bucket), []).append(s)
        pinned = 0
        for group in self.by_bucket.values():  # one allocation per bucket and kind, runs for its segments
            n = sum(s.numel for s in group)
            masters = host_empty(n, torch.float32, self.cuda, rank, pinned)
            pinned += masters.nbytes
            # the gradient's copy, and once it is used, the new weights in the weights' dtype on their way back
            grads = host_empty(n, weights_dtype, self.cuda, rank, pinned)
            pinned += grads.nbytes
            for s, m, g in zip(
                group,
                flat_views([s.weights() for s in group], masters),
                flat_views([s.weights() for s in group], grads),
            ):
                s.master, s.grad_buf = m, g
                s.master.copy_(s.weights())
        self.staged = self.cuda and weights_dtype != torch.float32
        # the fused kernel, as on the device (a CPU device runs the very same kernel: bit-identical)
        self.opt = adamw([s.master for s in segs], [decay(s) for s in segs], t)
        init_state(self.opt)
        self._events: dict[int, object] = {}  # bucket -> its gradients' copy to the host
        self._d2h = torch.cuda.Stream(device) if self.cuda else None
        self._h2d = torch.cuda.Stream(device) if self.cuda else None

    # ---- device -> host, as buckets become final ------------------------------------------------------
    def fetch(self, b: Bucket | None) -> None:
        """Start copying bucket ``b``'s offloaded gradients to the host (``None``: parameters in no bucket)."""
        segs = self.by_bucket.get(id(b), [])
        if not segs or id(b) in self._events:
            return
        if not self.cuda:
            for s in segs:
                s.grad_buf.copy_(s.grad())
            self._events[id(b)] = None
            return
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self._d2h):
            self._d2h.wait_event(ready)
            for s in segs:
                s.grad_buf.copy_(s.grad(), non_blocking=True)
            self._events[id(b)] = self._d2h.record_event()

    def _fetched(self, key: int, segs: list[Segment]) -> None:
        if key not in self._events:  # no hook ran for it (eager path, or no bucket)
            self.fetch(segs[0].bucket)
        ev = self._events.pop(key)
        if ev is not None:
            ev.synchronize()

    # ---- the update, bucket by bucket, and host -> device ------------------------------------------------
    def update(self, lr: float, coef: float, order: list[Bucket | None]) -> None:
        """Clip by ``coef``, AdamW on the CPU and the new weights sent back, one bucket after
        the other in ``order``; returns once every weight is on the device."""
        if self.opt is None:
            return
        for g in self.opt.param_groups:
            g["lr"] = lr
        done = []
        for b in order:
            segs = self.by_bucket.get(id(b))
            if not segs:
                continue
            self._fetched(id(b), segs)
            for s in segs:
                g = s.grad_buf if s.grad_buf.dtype == torch.float32 else s.grad_buf.float()
                if coef != 1.0:
                    g.mul_(coef)  # as clipping does on the device
                s.master.grad = g
            self.opt.step()
            for s in segs:
                s.master.grad = None
            done.append(self._send(segs))
        if self.cuda:
            for ev in done:
                torch.cuda.current_stream(self.device).wait_event(ev)

    def _send(self, segs: list[Segment]):
        """Copy the new weights of ``segs`` into their parameters (in the parameters' dtype)."""
        if not self.cuda:
            for s in segs:
                s.weights().copy_(s.master)
            return None
        if self.staged:
            for s in segs:
                s.grad_buf.copy_(s.master)  # fp32 -> compute dtype on the CPU: half the bytes to send
        with torch.cuda.stream(self._h2d):
            for s in segs:
                s.weights().copy_(s.grad_buf if self.staged else s.master, non_blocking=True)
            return self._h2d.record_event()

    def drop_pending(self) -> None:
        """Forget copies of a step that is not taken (skipped: non-finite gradients)."""
        for ev in self._events.values():
            if ev is not None:
                ev.synchronize()
        self._events.clear()

    def nbytes(self) -> int:
        """Host bytes held: masters, gradient copies and moments."""
        n = sum(s.master.nbytes + s.grad_buf.nbytes for s in self.segs)  # views: their runs
        if self.opt is not None:
            n += sum(v.nbytes for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v))
        return n

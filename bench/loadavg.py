"""The host's 1-minute load average while a measurement runs (figures are evidence only on a quiet
machine: every benchmark of issue 26 records it before and during each run)."""

from __future__ import annotations

import os
import threading


class LoadSampler:
    """The 1-minute load average at the start, every ``period`` seconds and at the end of a
    ``with`` block."""

    def __init__(self, period: float = 5.0) -> None:
        self.period, self.samples, self._stop = period, [], threading.Event()

    def __enter__(self) -> LoadSampler:
        self.samples.append(os.getloadavg()[0])
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(os.getloadavg()[0])

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        """``before`` (the first sample), ``max`` and ``mean`` over the block."""
        s = self.samples
        return {"before": round(s[0], 2), "max": round(max(s), 2), "mean": round(sum(s) / len(s), 2)}


__all__ = ["LoadSampler"]

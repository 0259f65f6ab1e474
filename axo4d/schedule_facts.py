"""How the implementation schedules its collectives, as the numbers that the schedule
(:mod:`axo4d.nn.schedule`), the sharded optimizer (:mod:`axo4d.training.optim.sharded`), the
memory model (:mod:`axo4d.memory_model`) and the performance model (:mod:`perfmodel.schedule`)
share. Defined here once; each of them imports them from here.
"""

from __future__ import annotations

#: z all-gathers of weight blocks in flight at once (the overlapped schedule's prefetch depth)
MAX_INFLIGHT_GATHERS = 2
#: z reduce-scatters of weight gradients left in flight while newer layers run backward
RS_LAG = 2
#: data-parallel buckets in flight before the oldest is waited for (with bucket hooks or sharding)
DP_LAG = 2
#: all-gathers of updated weights in flight at once after a sharded optimizer step
OPTIM_INFLIGHT_GATHERS = 2

__all__ = ["MAX_INFLIGHT_GATHERS", "RS_LAG", "DP_LAG", "OPTIM_INFLIGHT_GATHERS"]

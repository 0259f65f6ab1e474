"""Mixture-of-experts models (Qwen3-MoE, Mixtral) on grids of 4 ranks that split the hidden
features over x, the experts' widths and heads over y, the weights over z and the batch over
data and z, with expert parallelism (``ep=N``: 2 and 4, with x, y and z) or without, against
``transformers`` (fp32): logits, load-balancing loss, training loss and every
gradient (assembled) within 1e-5 relative, greedy generation identical. One spawned rank group."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests import moe_models as M  # noqa: E402
from tests.dist.harness import run_on_ranks  # noqa: E402

TOL = 1e-5
PLAN = {  # ' ep=N': expert parallelism over N consecutive data ranks
    "qwen3_moe": ["x=2,y=2", "data=2,z=2", "data=4 ep=4", "data=2,x=2 ep=2"],
    "mixtral": ["data=2,x=2", "y=2,z=2", "data=4 ep=2", "data=2,y=2 ep=2", "data=2,z=2 ep=2"],
}
PROMPTS = [[5, 17, 42, 8, 99, 3, 250], [7, 7, 120, 33, 64]]


@pytest.mark.dist
def test_moe_models_on_grids(tmp_path):
    idx = torch.randint(0, M.VOCAB, (4, 24), generator=torch.Generator().manual_seed(3))
    for i, name in enumerate(PLAN):
        hf = M.build_moe(name, tmp_path / name, seed=20 + i)
        ref = M.moe_reference(hf, idx, PROMPTS, 16)
        torch.save({**ref, "idx": idx, "prompts": PROMPTS, "new_tokens": 16}, tmp_path / f"{name}.ref.pt")
    results = run_on_ranks(4, "tests.dist.cases_moe:run", 600, str(tmp_path), PLAN)
    bad = []
    for rank, res in enumerate(results):
        for case, e in res.items():
            if rank == 0:
                print(
                    f"{case:22s} "
                    + " ".join(f"{k} {e[k]:.1e}" for k in ("logits", "aux", "loss", "grad"))
                    + f" ({e['grad_worst']})"
                )
            bad += [
                f"rank {rank} {case}: {k} {e[k]:.2e} > {TOL}"
                for k in ("logits", "aux", "loss", "grad")
                if not e[k] <= TOL
            ]
            if e["generation_differs"]:
                bad.append(f"rank {rank} {case}: greedy generation differs from transformers")
    assert not bad, "\n".join(bad[:20])

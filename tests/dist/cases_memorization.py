"""Rank side of test_memorization.py's grid parity: the study's arms (training on the treated
documents, Goldfish and standard, and the greedy measurement after each epoch) on several grids
against one process."""

from __future__ import annotations

import numpy as np
import torch

from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.memorization.documents import Corpus
from axo4d.memorization.protocol import Size, Study
from axo4d.memorization.study_config import load_study


def _study(study, cfg, comm: Comm, corpus: Corpus) -> dict:
    res = Study(study, comm, torch.device("cpu"), log=lambda msg: None).run(Size("tiny", cfg), corpus)
    return {
        "losses": [r.losses for r in res.runs],
        "token": [r.token.tolist() for r in res.runs],
        "exact": [r.exact.tolist() for r in res.runs],
        "dropped": [r.dropped for r in res.runs],
    }


def run(info, specs: list[str], sets: list[str]) -> list[dict]:
    torch.set_num_threads(1)  # 4 ranks on 2 cores: spinning intra-op threads would crawl (and round alike)
    study, cfg, _ = load_study("tiny", sets)
    rng = np.random.default_rng(5)
    n = (study.buckets + 1) * study.bucket_size
    corpus = Corpus(
        tokens=rng.integers(97, 123, (n, study.length)),
        sources=[f"d{i}" for i in range(n)],
        rest=np.zeros(0, np.uint16),
    )
    # every rank computes the one-process reference itself (a rank waiting for rank 0's would time out)
    ref = _study(study, cfg, Comm(Grid(), 0, init_groups=False), corpus)
    out = []
    for spec in specs:
        got = _study(study, cfg, Comm(Grid.parse(spec), info.rank, timeout_s=60), corpus)
        rel = max(abs(a - b) / abs(b) for la, lb in zip(got["losses"], ref["losses"]) for a, b in zip(la, lb))
        same = np.mean([np.array_equal(a, b) for a, b in zip(got["token"], ref["token"])])
        out.append(
            {
                "grid": spec,
                "max_rel_loss": rel,
                "token_runs_equal": float(same),
                "exact_equal": got["exact"] == ref["exact"],
                "dropped": got["dropped"],
                "ref_dropped": ref["dropped"],
                "ref_final_exact": [e[-1] for e in ref["exact"]],
            }
        )
    return out

"""The sequence split over z (``parallel.z_split=sequence``) against one process, one spawned group
per rank count: logits, per-token losses, the loss and every gradient within 1e-5 (fp32) for GPT
and Llama at sequence 256, Goldfish loss off and on, on z=2, z=4, x=2·z=2, y=2·z=2, data=2·z=2,
z=8 and data=2·x=2·z=2 (document masks on each group's first grid); 20 training steps on z=4
within 1e-4 of one process; a checkpoint saved with one split resumes with the other; generation
with the prefill split over z equals one process's."""

import pytest

from tests.dist.harness import run_on_ranks

TOL = 1e-5
GROUPS = {
    2: (["z=2"], None, "z=2"),
    4: (["z=4", "x=2,z=2", "y=2,z=2", "data=2,z=2"], "z=4", None),
    8: (["z=8", "data=2,x=2,z=2"], None, None),
}


def _check_parity(rows: list[dict]) -> None:
    bad = []
    for r in rows:
        lg = "  (plain)" if r["logits"] is None else f"{r['logits']:.1e}"  # Goldfish: the plain case's logits
        print(
            f"{r['case']:16s} {r['grid']:16s} logits {lg} losses {r['losses']:.1e} "
            f"loss {r['loss']:.1e} grads {r['grad']:.1e} ({r['worst_grad']}) {r['seconds']:.1f} s"
        )
        if not max(r["logits"] or 0, r["losses"], r["loss"], r["grad"]) <= TOL:
            bad.append(f"{r['case']} on {r['grid']}: differs from one process by more than {TOL}: {r}")
    assert not bad, "\n".join(bad)


@pytest.mark.dist
@pytest.mark.parametrize("ranks", sorted(GROUPS))
def test_sequence_split(ranks, tmp_path):
    specs, train_spec, resume_spec = GROUPS[ranks]
    res = run_on_ranks(ranks, "tests.dist.cases_seqsplit:group", 600, str(tmp_path), specs, train_spec, resume_spec)
    for r in res:  # every rank checks its own blocks and the gathered gradients
        _check_parity(r["parity"])
    top = res[0]
    if "train" in top:
        t = top["train"]
        print(f"train {t['grid']}: max rel loss diff {t['max_rel_loss']:.2e} weights {t['max_rel_weight']:.2e}")
        assert t["first_bad_step"] is None and t["steps"] == 20, t
        assert t["max_rel_weight"] <= 1e-4 and t["val_rel"] <= 1e-4, t
    for way, r in top.get("resume", {}).items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["resumed"], r["ref"]))
        print(f"resume {way}: from step {r['start']}, max rel loss diff {diff:.1e}, weights equal {r['weights_equal']}")
        assert r["start"] == 3 and r["weights_equal"] and len(r["resumed"]) == 3 and diff <= 1e-5, r
    for r in top.get("generation", []):
        print(f"generation {r['case']} on {r['grid']}: {'equal' if r['equal'] else 'DIFFERENT'} to one process")
        assert r["equal"], r

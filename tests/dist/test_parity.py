"""Loss parity: 20 steps (12 in the 8-rank group) on a grid equal the one-process run (fp32).

Every step's loss and the validation loss within 1e-4 relative; every final weight tensor within
1e-4 in relative L2 norm (||w - w_ref|| / ||w_ref||) of the one-process run.
"""

import pytest

from tests.dist.harness import run_on_ranks

TOL = 1e-4
STEPS = 20
EIGHT_STEPS = 12  # the 8-rank group: ten grids and six one-process references (CI's time)


def _check(results: list[dict], steps: int = STEPS) -> None:
    msgs = []
    for r in results:
        print(
            f"grid {r['grid']:22s} steps {r['steps']} max rel loss diff {r['max_rel_loss']:.2e}  "
            f"val {r['val_rel']:.2e}  weights: rel L2 diff {r['max_rel_weight']:.2e} ({r['worst_weight']}), "
            f"max elementwise {r['max_elem_weight']:.2e}"
        )
        if r["first_bad_step"] is not None:
            msgs.append(
                f"grid {r['grid']}: loss diverged from the 1-process run first at step "
                f"{r['first_bad_step']} (max rel diff {r['max_rel_loss']:.2e} > {TOL})"
            )
        if not r["max_rel_weight"] <= TOL:
            msgs.append(
                f"grid {r['grid']}: final weight {r['worst_weight']} differs by {r['max_rel_weight']:.2e} > {TOL}"
            )
        if not r["val_rel"] <= TOL:
            msgs.append(f"grid {r['grid']}: validation loss differs by {r['val_rel']:.2e}")
        assert r["steps"] >= steps
        assert r["ref_first_last"][1] < r["ref_first_last"][0], "reference loss did not fall"
    assert not msgs, "\n".join(msgs)


@pytest.mark.dist
def test_parity_two_ranks_each_axis():
    res = run_on_ranks(2, "tests.dist.cases_train:run", 400, ["x=2", "y=2", "z=2", "data=2"], [f"train.steps={STEPS}"])
    _check(res[0])


#: the 8-rank cases, run in one spawned group (one start-up of 8 ranks instead of three)
EIGHT = {
    # data=2,x=2,z=2 and data=2,x=4: x alone, the layer pairs turned (docs/design.md 2.2)
    "8 ranks": [["x=2,y=2,z=2", "data=2,x=2,z=2", "data=2,x=4"], [f"train.steps={EIGHT_STEPS}"], "tiny"],
    "accumulation + recompute": [
        ["data=2,x=2,y=2", "data=2,y=2,z=2"],
        [
            f"train.steps={EIGHT_STEPS}",
            "train.grad_accum=2",
            "train.global_batch=16",
            "train.activation_checkpointing=true",
        ],
        "tiny",
    ],
    # Llama (GQA, RoPE, SwiGLU, tied embeddings read vocabulary-parallel from the LM head: a weight used
    # twice per step) with overlap, recomputation and accumulation; on x alone the head and its table
    # are turned (docs/design.md 2.2: split by vocabulary over x)
    "llama tied, accumulation + recompute": [
        ["data=2,y=2,z=2", "data=2,x=2,z=2"],
        [
            "train.steps=10",
            "train.grad_accum=2",
            "train.global_batch=16",
            "parallel.tuner=false",
            "train.activation_checkpointing=true",
            "model.tie_embeddings=true",
        ],
        "llama-tiny",
    ],
    # the tensor axes split everything between the GEMMs (docs/design.md section 2.1): Llama on x*y in a
    # non-default rank order, Qwen2 (QKV biases) on x*y*z, and Llama with fewer kv groups (2) than x*y
    # ranks (4): the fallback that attends on the y slice's heads on every x rank
    "llama x*y, order data,z,y,x": [
        ["data=2,x=2,y=2", "data=2,x=4"],  # and x alone (pairs turned; x=2 alone: the GPT case and 2 ranks)
        [f"train.steps={EIGHT_STEPS}", "parallel.order=data,z,y,x"],
        "llama-tiny",
    ],
    "qwen2 x*y*z": [["x=2,y=2,z=2"], [f"train.steps={EIGHT_STEPS}", "model.arch=qwen2"], "llama-tiny"],
    "llama kv groups < x*y": [["data=2,x=2,y=2"], [f"train.steps={EIGHT_STEPS}", "model.n_kv_head=2"], "llama-tiny"],
    # x=4 across nodes of one rank each: the start-up exchanges x and y (x=2,y=4 in order y,x,z,data:
    # the same ranks, every layer pair turned and the residual stream's order with them; design.md 2.2)
    "llama x=4,y=2 across nodes: x and y exchanged": [["x=4,y=2"], [f"train.steps={EIGHT_STEPS}"], "llama-tiny", 1],
}
#: the grid each case's start-up runs on, where it is not the one asked for
RAN_ON = {"llama x=4,y=2 across nodes: x and y exchanged": ["data=1,x=2,y=4,z=1 y,x,z,data"]}


@pytest.mark.dist
def test_parity_eight_ranks():
    """Every 8-rank case against its one-process run: GPT on x*y*z, data*x*z and data*x (x=4 alone);
    with accumulation and recomputation on data*x*y and data*y*z; tied Llama with both on data*y*z;
    Llama on data*x*y and on x alone (x=4) in a non-default rank order and with fewer kv groups
    than x*y ranks; Qwen2 on x*y*z; Llama on x=4,y=2 across nodes, run with x and y exchanged."""
    res = run_on_ranks(8, "tests.dist.cases_train:run_cases", 1500, list(EIGHT.values()))
    for name, case in zip(EIGHT, res[0]):
        print(f"-- {name}")
        _check(case, steps=10 if name.startswith("llama tied") else EIGHT_STEPS)
        if name in RAN_ON:
            assert [r["ran_on"] for r in case] == RAN_ON[name]

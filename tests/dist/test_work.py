"""No non-GEMM work done twice (docs/design.md section 15): summed over the ranks of a grid, one step's
attention FLOPs, activation (GELU/SwiGLU) elements and norm elements equal one process's within 5%;
and each rank's bytes saved for backward agree with the memory model (:mod:`axo4d.facts.memory`,
which divides the in-between activations by the tensor axes) within 15%.

All grids of 8 ranks, one spawned group: x and y alone (with data making up the 8 ranks: the data
ranks split the batch, so they add no work), data*x*y, x*y*z (batch split), data*x*z (sequence split);
GPT (``tiny``) and Llama (``llama-tiny``: GQA, 4 kv heads,
so every rank of x*y holds a whole kv group).
"""

import pytest

from tests.dist.harness import run_on_ranks

TOL = 0.05
MEM_TOL = 0.15
CASES = [
    ["tiny", "data=4,x=2", "batch", []],
    ["tiny", "data=4,y=2", "batch", []],
    ["tiny", "data=2,x=2,y=2", "batch", []],
    ["tiny", "x=2,y=2,z=2", "batch", []],
    ["tiny", "data=2,x=2,z=2", "sequence", []],
    ["llama-tiny", "data=2,x=2,y=2", "batch", []],
    ["llama-tiny", "x=2,y=2,z=2", "sequence", []],
]


@pytest.mark.dist
def test_no_work_done_twice():
    res = run_on_ranks(8, "tests.dist.cases_work:run", 600, CASES)
    msgs = []
    for i, case in enumerate(res[0]):
        ref = case["ref"]
        for what in ("attention", "activation", "norm"):
            total = sum(r[i]["got"][what] for r in res)
            ratio = total / ref[what]
            print(f"{case['case']:42s} {what:10s} ranks' sum / one process = {ratio:.3f}")
            if abs(ratio - 1) > TOL:
                msgs.append(f"{case['case']}: {what} summed over the ranks is {ratio:.3f} x one process's")
        # activation memory (item 5): what each rank keeps for backward, against the memory model
        for rank, r in enumerate(res):
            got, want = r[i]["got"]["saved_bytes"], r[i]["got"]["predicted_bytes"]
            if rank == 0:
                print(
                    f"{case['case']:42s} saved for backward: rank 0 {got} bytes, one process {ref['saved_bytes']}"
                    f" ({ref['saved_bytes'] / got:.2f}x), memory model {want:.0f} ({got / want:.3f})"
                )
            if abs(got / want - 1) > MEM_TOL:
                msgs.append(f"{case['case']} rank {rank}: {got} bytes saved for backward, memory model {want:.0f}")
    assert not msgs, "\n".join(msgs)

"""Which layer of each pair is transposed on a grid (axo4d.facts.orientation, docs/design.md 2.2)."""

import dataclasses

import pytest

from axo4d.config import ModelConfig
from axo4d.facts.archs import get_arch, model_spec
from axo4d.facts.colls import Dtypes
from axo4d.facts.grid import Grid
from axo4d.facts.orientation import flipped, head_turns, layer_bytes, narrow, orient, pair_bytes
from axo4d.facts.parts import LinearSpec, layer_pairs

GPT = ModelConfig(n_layer=2, n_embd=64, n_head=8, vocab_size=256, seq_len=16)
LLAMA = ModelConfig(
    arch="llama", n_layer=2, n_embd=64, n_head=8, n_kv_head=4, ffn_hidden=96, vocab_size=256, seq_len=16
)
QWEN2 = ModelConfig(
    arch="qwen2", n_layer=2, n_embd=64, n_head=8, n_kv_head=4, ffn_hidden=96, vocab_size=256, seq_len=16
)
UNIT = Dtypes(act=1, weight=1, grad=1, stat=1, param_state=1)
TODAY = {"attn.qkv": False, "attn.proj": True, "mlp.up": False, "mlp.gate_up": False, "mlp.down": True}


def _orientation(cfg: ModelConfig, grid: Grid) -> dict[str, bool]:
    return {x.name: x.transposed for x in model_spec(cfg, grid).linears()}


@pytest.mark.parametrize("cfg", [GPT, LLAMA, QWEN2], ids=["gpt", "llama", "qwen2"])
def test_x_alone_turns_every_pair(cfg):
    for grid in (Grid(x=2), Grid(x=4), Grid(data=2, x=4, z=2)):
        got = _orientation(cfg, grid)
        assert got == {k: not TODAY[k] for k in got}, grid
        # the LM head (not a pair) turns too: its vocabulary (256) is wider than C (64)
        assert model_spec(cfg, grid).head_linear().transposed is True


@pytest.mark.parametrize("cfg", [GPT, LLAMA, QWEN2], ids=["gpt", "llama", "qwen2"])
def test_the_head_turns_only_on_one_axis_and_where_it_sends_fewer_bytes(cfg):
    """On x alone the head as built reduce-scatters its V-wide logits and gathers their gradient
    (2V(G-1)/G a row); turned it gathers its C-wide input and reduce-scatters that input's gradient
    (2C(G-1)/G). y alone: as built is the C-wide one; x*y: the stream's order stays (x, y); a head
    tied to the embedding table turns with the table, counted with it."""
    c, v = cfg.n_embd, cfg.vocab_size
    for g in (2, 4):
        spec = model_spec(cfg, Grid(x=g))
        head = spec.head_linear()
        assert layer_bytes(head, Grid(x=g)) == pytest.approx(2 * c * (g - 1) / g)
        assert layer_bytes(dataclasses.replace(head, transposed=False), Grid(x=g)) == pytest.approx(2 * v * (g - 1) / g)
        assert head_turns(get_arch(cfg.arch).spec(cfg, Grid(x=g)))
    for grid in (Grid(), Grid(y=2), Grid(x=2, y=2), Grid(x=4, y=2), Grid(z=4)):
        assert model_spec(cfg, grid).head_linear().transposed is False, grid
    wide = dataclasses.replace(cfg, n_embd=2 * v)  # C wider than the (padded) vocabulary: as built
    assert model_spec(wide, Grid(x=2)).head_linear().transposed is False
    if cfg.arch == "llama":  # tied: the table, split like the head, moves 2C(G-1)/G more when turned
        tied = dataclasses.replace(cfg, tie_embeddings=True)
        for g in (2, 4):
            spec = model_spec(tied, Grid(x=g))
            head, (table,) = spec.head_linear(), spec.embeddings
            assert head.transposed is True and table.head is head  # the table reads the turned head
            colls = [k for k in table.collectives(Grid(x=g), 1.0, UNIT, False, False) if k.axes == ("x",)]
            assert sorted(k.kind for k in colls) == ["all_gather", "reduce_scatter"]
            assert sum(k.nbytes for k in colls) == pytest.approx(2 * c)
        # V = C: 2V against 4C, so the tied head stays as built (an untied one would turn: 2V = 2C is a tie)
        assert model_spec(dataclasses.replace(tied, n_embd=v), Grid(x=2)).head_linear().transposed is False


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_other_grids_keep_todays(cfg):
    # y alone: today's is the narrow one; x*y: the residual stream's order stays (x, y); no tensor axis: a tie
    for grid in (Grid(), Grid(y=2), Grid(y=4, z=2), Grid(x=2, y=2), Grid(x=4, y=2), Grid(x=2, y=4), Grid(z=4)):
        got = _orientation(cfg, grid)
        assert got == {k: TODAY[k] for k in got}, grid


def test_pair_bytes_formula():
    """docs/design.md 2.2: with F the mean of the inner widths, one row through a pair sends
    4F(G-1)/G today and 4C(G-1)/G turned on x alone, the reverse on y alone, and on x*y
    4[C(G_y-1) + F(G_x-1)]/(G_x G_y) today."""
    c = 64
    for f1, f2 in ((3 * c, c), (4 * c, 4 * c), (192, 96)):
        a, b = LinearSpec("a", c, f1), LinearSpec("b", f2, c, transposed=True)
        f = (f1 + f2) / 2
        for g in (2, 4):
            assert pair_bytes(a, b, Grid(x=g)) == pytest.approx(4 * f * (g - 1) / g)
            assert pair_bytes(*flipped(a, b), Grid(x=g)) == pytest.approx(4 * c * (g - 1) / g)
            assert pair_bytes(a, b, Grid(y=g)) == pytest.approx(4 * c * (g - 1) / g)
            assert pair_bytes(*flipped(a, b), Grid(y=g)) == pytest.approx(4 * f * (g - 1) / g)
            assert narrow(a, b, Grid(x=g)) and not narrow(a, b, Grid(y=g))
        for gx, gy in ((2, 2), (4, 2), (2, 4)):
            grid = Grid(x=gx, y=gy)
            today = 4 * (c * (gy - 1) + f * (gx - 1)) / (gx * gy)
            turned = 4 * (c * (gx - 1) + f * (gy - 1)) / (gx * gy)
            assert pair_bytes(a, b, grid) == pytest.approx(today)
            assert pair_bytes(*flipped(a, b), grid) == pytest.approx(turned)
            assert not narrow(a, b, grid)  # x*y: not turned (the residual stream's order)
        assert pair_bytes(a, b, Grid(z=4)) == 0 and not narrow(a, b, Grid(z=4))


def test_turned_spec_sends_the_narrow_bytes():
    """On x alone the block's tensor-axis collectives move C-wide activations only: 8 C (G-1)/G
    elements per row for the GPT's two pairs (24 C (G-1)/G before)."""
    c, g = GPT.n_embd, Grid(x=4)
    raw = get_arch("gpt").spec(GPT, g)
    turned = orient(raw)
    assert sum(pair_bytes(a, b, g) for a, b in layer_pairs(raw.block)) == pytest.approx(24 * c * 3 / 4)
    assert sum(pair_bytes(a, b, g) for a, b in layer_pairs(turned.block)) == pytest.approx(8 * c * 3 / 4)
    assert turned.ffn_width() == raw.ffn_width() == 4 * c  # the MLP's width, whichever way it is turned
    assert orient(get_arch("gpt").spec(GPT, Grid(y=4))) == get_arch("gpt").spec(GPT, Grid(y=4))


def test_experts_keep_todays():
    cfg = ModelConfig(
        arch="mixtral",
        n_layer=1,
        n_embd=32,
        n_head=4,
        n_kv_head=2,
        ffn_hidden=32,
        vocab_size=64,
        seq_len=8,
        n_experts=2,
    )
    got = _orientation(cfg, Grid(x=2))
    assert got["attn.qkv"] and not got["attn.proj"]
    assert {k: v for k, v in got.items() if ".experts." in k} == {
        f"mlp.experts.{e}.{n}": n == "down" for e in range(2) for n in ("gate_up", "down")
    }

"""axo4d's GPT on the 1x1x1x1 grid is an ordinary GPT: same losses and gradients as plain PyTorch."""

import pytest
import torch

from axo4d.config import ModelConfig
from axo4d.dist.comm import Comm
from axo4d.facts.archs.gpt_family import gpt_spec
from axo4d.facts.grid import Grid, GridError
from axo4d.facts.spec import padded_vocab
from axo4d.models.gpt import GPT
from axo4d.models.plain import PlainGPT
from tests.helpers import assert_grads_match_plain, full_state_dict


def _pair(cfg: ModelConfig, seed: int = 0):
    comm = Comm(Grid(), 0, init_groups=False)
    gpt = GPT(cfg, comm, seed=seed)
    plain = PlainGPT(cfg, gpt.vocab)
    plain.load_state_dict(full_state_dict(gpt, comm))
    return gpt, plain


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("vocab", [256, 250])  # 250: padded to 256, padding masked
def test_gpt_matches_plain_pytorch(bias, vocab):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, seq_len=16, bias=bias)
    gpt, plain = _pair(cfg)
    idx = torch.randint(0, vocab, (3, 16))
    tgt = torch.randint(0, vocab, (3, 16))
    la, lb = gpt(idx, tgt), plain(idx, tgt)
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    la.mean().backward()
    lb.mean().backward()
    assert_grads_match_plain(gpt, plain, cfg.n_head)


def test_logits_mask_padding():
    cfg = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=250, seq_len=8, vocab_multiple=64)
    gpt, plain = _pair(cfg)
    assert gpt.vocab == 256
    idx = torch.randint(0, 250, (2, 8))
    torch.testing.assert_close(gpt(idx)[..., :250], plain(idx), rtol=1e-5, atol=1e-6)


def test_init_does_not_depend_on_grid_order_of_draws():
    cfg = ModelConfig(n_layer=1, n_embd=16, n_head=2, seq_len=8)
    a, _ = _pair(cfg, seed=5)
    b, _ = _pair(cfg, seed=5)
    c, _ = _pair(cfg, seed=6)
    comm = Comm(Grid(), 0, init_groups=False)
    sa, sb, sc = (full_state_dict(m, comm) for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])


def test_padded_vocab_and_flops():
    assert padded_vocab(50257, 64, 1) == 50304 and padded_vocab(50257, 64, 4) % 256 == 0
    c = ModelConfig(n_layer=24, n_embd=2048, n_head=16, vocab_size=50257, seq_len=2048)
    s = gpt_spec(c, Grid())
    f = s.flops_per_step(8)
    assert f == pytest.approx(72 * 8 * 2048 * 24 * 2048**2 * (1 + 2048 / (6 * 2048) + 50257 / (12 * 24 * 2048)))
    assert s.flops_per_step(8, True) == pytest.approx(
        96 * 8 * 2048 * 24 * 2048**2 * (1 + 2048 / (6 * 2048) + 50257 / (16 * 24 * 2048))
    )
    assert gpt_spec(c, Grid(y=4)).flops_per_step(8) == f  # FLOPs do not depend on the grid (padding)


@pytest.mark.parametrize(
    "grid,msg", [("y=3", "n_head=4 not divisible by G_y=3"), ("x=3", "n_embd=64 not divisible by G_x\\*G_y=3")]
)
def test_model_grid_divisibility_errors(grid, msg):
    cfg = ModelConfig(n_layer=1, n_embd=64, n_head=4)
    with pytest.raises(GridError, match=msg):
        GPT(cfg, Comm(Grid.parse(grid), 0, init_groups=False))


# ---- Llama -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_llama_matches_plain_pytorch(tied):
    import dataclasses

    from axo4d.config import load_config
    from axo4d.models.llama import Llama
    from axo4d.models.plain import PlainLlama

    cfg = dataclasses.replace(load_config("llama-tiny").model, tie_embeddings=tied)
    comm = Comm(Grid(), 0, init_groups=False)
    m = Llama(cfg, comm, seed=4)
    p = PlainLlama(cfg, m.vocab)
    p.load_state_dict(full_state_dict(m, comm))
    idx = torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    la, lb = m(idx, idx.roll(-1, 1)), p(idx, idx.roll(-1, 1))
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    la.mean().backward()
    lb.mean().backward()
    ref = dict(p.named_parameters())
    for name, q in m.named_parameters():
        g = ref[name].grad
        torch.testing.assert_close(q.grad.view_as(g), g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "name,billions",
    [
        ("llama3.2-1b", 1.236),
        ("llama3.2-3b", 3.213),
        ("llama3.1-8b", 8.030),
        ("llama3.1-70b", 70.554),
        ("llama3.1-405b", 405.853),
    ],
)
def test_published_llama_shapes(name, billions):
    from axo4d.config import load_config
    from axo4d.facts.archs import model_spec

    s = model_spec(load_config(name).model, Grid(x=8, y=8))
    assert s.param_count() / 1e9 == pytest.approx(billions, abs=1e-3)
    assert s.divisibility_reasons(64) == []
    assert (
        "n_kv_head=8 not divisible by G_y=16" in model_spec(load_config(name).model, Grid(y=16)).divisibility_reasons()
    )

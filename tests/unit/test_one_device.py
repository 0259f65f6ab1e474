"""The 1x1x1x1 grid (one GPU): what makes axo4d as fast and as lean as plain PyTorch there.

* a Linear3D with x, y and z of one rank runs as ``F.linear`` once the tuner chose the default
  layout for its forward, dX and dW GEMMs (and keeps the tuner's layout otherwise);
* ``apply_compile`` on this grid compiles each block, and the head with its loss, without a
  graph break;
* the vocabulary-parallel loss keeps the logits in their dtype and one log-sum-exp per row, not
  an fp32 softmax, and equals ``F.cross_entropy`` (padding, several row blocks, masks, bf16);
* the gradient norm and clipping on the device equal the host path bit for bit;
* efficiency figures: vendor peaks and measured ceilings matched by whole device names.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from axo4d.config import ModelConfig
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.models import apply_activation_checkpointing, apply_compile, build_model
from axo4d.nn import loss as loss_mod
from axo4d.nn.blas_tuner import VARIANTS, GemmTuner
from axo4d.nn.context import LayerContext
from axo4d.nn.grads import clip_gradients, clip_gradients_, global_grad_norm, grad_norm_tensor
from axo4d.nn.linear import Linear3D
from axo4d.nn.overlap_schedule import OverlapSchedule
from axo4d.training.perf import Peaks, gemm_ceiling, vendor_peak

CFG = ModelConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=200, seq_len=16, vocab_multiple=64)


def _model(tmp_path, cfg=CFG, tuner=True):
    comm = Comm(Grid(), 0, init_groups=False)
    t = GemmTuner(comm, tmp_path / "tuner.json", reps=1, verbose=False) if tuner else None
    return build_model(cfg, LayerContext(comm, OverlapSchedule(comm), t), seed=1)


def _batch(cfg=CFG, b=3):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g) for _ in "xy")


def _step(model, x, y) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x, y).mean()
    loss.backward()
    model.finish_gradients()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", [0, 2])
def test_activation_checkpointing_recomputes_the_path_its_forward_took(tmp_path, variant):
    """The tuner decides a layer's GEMMs during step 1's backward (block 1's before block 0's
    recompute, and blocks share layer names): the recompute must not switch to ``F.linear``."""
    model = apply_activation_checkpointing(_model(tmp_path))
    ref = _model(tmp_path / "none", tuner=False)
    t = next(m.tuner for m in model.modules() if isinstance(m, Linear3D))
    t._tune = lambda key, a, b, bias: t.table.setdefault(key, {"variant": VARIANTS[variant], "ms": []})
    x, y = _batch()
    for _ in range(3):
        loss, grads = _step(model, x, y)
        loss_ref, grads_ref = _step(ref, x, y)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
        for k in grads_ref:
            torch.testing.assert_close(grads[k], grads_ref[k], rtol=1e-5, atol=1e-7)


def test_trivial_layers_become_f_linear_once_the_tuner_chose_the_default(tmp_path, monkeypatch):
    model, ref = _model(tmp_path), _model(tmp_path / "none", tuner=False)
    x, y = _batch()
    layers = [m for m in model.modules() if isinstance(m, Linear3D)]
    calls = []
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", loss_mod.CHUNK_ELEMENTS)
    import axo4d.nn.linear as lin_mod

    real = lin_mod._linear3d
    monkeypatch.setattr(lin_mod, "_linear3d", lambda *a: calls.append(a[-1].name) or real(*a))
    assert not any(m.plain() for m in layers)  # nothing decided yet: the tuner's path
    for m in layers:  # the tuner picks a@b everywhere
        m.tuner._tune = lambda key, a, b, bias, t=m.tuner: t.table.setdefault(key, {"variant": VARIANTS[0], "ms": []})
    _step(model, x, y)
    assert len(calls) == len(layers) and not any(m.plain() for m in layers)  # asked in a forward only
    with model.schedule.forward_pass(False):
        assert all(m.plain() for m in layers)
    calls.clear()
    loss, grads = _step(model, x, y)
    assert calls == []  # every layer ran as F.linear
    loss_ref, grads_ref = _step(ref, x, y)
    assert torch.equal(loss, loss_ref)
    for n, g in grads.items():
        torch.testing.assert_close(g, grads_ref[n], rtol=1e-6, atol=1e-7, msg=n)


def test_a_layer_keeps_a_tuned_layout_that_is_not_the_default(tmp_path):
    model = _model(tmp_path)
    x, y = _batch()
    _step(model, x, y)  # decisions for every key
    t = model.lm_head.tuner
    key = t.uses[("lm_head", "dw")]
    t.table[key] = {"variant": VARIANTS[2], "ms": []}
    t._fast.clear()
    for m in model.modules():
        if isinstance(m, Linear3D):
            m._tuned_plain = None
    assert not model.lm_head.plain()
    assert t.chose_default("lm_head") is False and t.chose_default("no such layer") is None


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_compile_on_one_rank_makes_whole_graphs(tmp_path, arch):
    """aot_eager (no C++ compiler needed): no graph break in the blocks or the head with its loss,
    and the same losses and gradients as eager."""
    import dataclasses

    from torch._dynamo.utils import counters

    cfg = CFG if arch == "gpt" else dataclasses.replace(CFG, arch="llama", n_kv_head=2, tie_embeddings=True, bias=False)
    # compiled on one rank the model is built without a tuner (axo4d.training.startup.make_tuner)
    eager, comp = _model(tmp_path, cfg), apply_compile(_model(tmp_path, cfg, tuner=False), backend="aot_eager")
    x, y = _batch(cfg)
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):
        le, ge = _step(eager, x, y)
        lc, gc = _step(comp, x, y)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(lc, le, rtol=1e-6, atol=0)
    for n, g in ge.items():
        torch.testing.assert_close(gc[n], g, rtol=1e-5, atol=1e-6, msg=n)
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [50, 64])
def test_vocab_parallel_loss_equals_cross_entropy(monkeypatch, dtype, vocab):
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 100)  # several row blocks, a short last one
    comm = Comm(Grid(), 0, init_groups=False)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 7, 64, generator=g) * 3).to(dtype).requires_grad_()
    tgt = torch.randint(0, vocab, (3, 7), generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.3
    w = torch.randn(3, 7, generator=g)
    out = loss_mod.vocab_parallel_cross_entropy(logits, tgt, comm, vocab, mask)
    (out * w).sum().backward()
    ref_in = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_in[..., :vocab].flatten(0, 1), tgt.flatten(), reduction="none").view(3, 7) * mask
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
    assert logits.grad.dtype == dtype and (logits.grad[..., vocab:] == 0).all() and (logits.grad[~mask] == 0).all()
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(logits.grad.float(), ref_in.grad, rtol=tol, atol=tol)


def test_loss_keeps_the_logits_not_an_fp32_softmax(tmp_path):
    """Under bf16 autocast, no tensor over the vocabulary is saved in fp32 (the old function kept
    a (N, V) fp32 softmax: twice the bf16 logits)."""
    model = _model(tmp_path)
    x, y = _batch()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.shape, t.dtype)) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y).float().mean()
    loss.backward()
    over_vocab = [(s, d) for s, d in saved if len(s) and s[-1] == model.vocab and s[0] != model.vocab]
    assert over_vocab and all(d == torch.bfloat16 for _, d in over_vocab), over_vocab


def test_device_norm_and_clipping_equal_the_host_path(tmp_path):
    model = _model(tmp_path, tuner=False)
    _step(model, *_batch())
    comm, params = model.comm, list(model.parameters())
    norm = grad_norm_tensor(params, comm)
    assert norm.dtype == torch.float64 and norm.dim() == 0
    assert float(norm) == global_grad_norm(params, comm)
    host = {n: p.grad.clone() for n, p in model.named_parameters()}
    for max_norm in (float(norm) / 3, float(norm) * 2):  # clipped, and left alone
        for p in params:
            p.grad = host[next(n for n, q in model.named_parameters() if q is p)].clone()
        clip_gradients_(params, max_norm, norm)
        dev = [p.grad.clone() for p in params]
        for p, n in zip(params, host):
            p.grad = host[n].clone()
        clip_gradients(params, max_norm, float(norm))
        assert all(torch.equal(a, p.grad) for a, p in zip(dev, params))


def test_vendor_peaks_and_ceilings_by_whole_names():
    assert vendor_peak("NVIDIA H200") == (989.0, "H200 SXM")
    assert vendor_peak("NVIDIA GH200 480GB")[1] == "GH200"
    assert vendor_peak("NVIDIA H100 80GB HBM3") == (989.0, "H100 SXM")
    assert vendor_peak("NVIDIA H100 PCIe")[0] == 756.0
    assert vendor_peak("NVIDIA A100-SXM4-80GB")[0] == 312.0
    assert vendor_peak("AMD Instinct MI250X")[0] == 191.5
    assert vendor_peak("Tesla T4") == (0.0, "")
    assert gemm_ceiling("NVIDIA H200")[0] == 813.0 and gemm_ceiling("NVIDIA H100 80GB HBM3")[0] == 0.0
    p = Peaks(989.0, "x", 813.0, "y")
    assert p.mfu(494.5) == 0.5 and abs(p.ceiling_frac(406.5) - 0.5) < 1e-12
    assert Peaks(0.0, "cpu", 1.0, "m").mfu(1.0) is None


#: tensor methods that make the host wait for the device when called on a GPU tensor
_HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "any", "all", "nonzero")


def _trainer(sets: list[str]):
    import numpy as np

    from axo4d.config import load_config
    from axo4d.training.datasets.dataset import TokenDataset
    from axo4d.training.trainer import Trainer

    cfg = load_config("tiny", ["parallel.tuner=false", "train.eval_interval=0", "train.grad_clip=0.05"] + sets)
    ds = TokenDataset(
        np.random.default_rng(0).integers(0, 256, 20000).astype(np.uint16), cfg.model.seq_len, 0.1, cfg.train.seed
    )
    return Trainer(cfg, Comm(Grid(), 0, init_groups=False), ds, torch.device("cpu"))


@pytest.mark.parametrize("sets", [[], ["train.grad_accum=2"]])
def test_a_step_reads_the_device_once_after_the_update_is_queued(monkeypatch, sets):
    """Trainer.step (defaults: nonfinite=stop, no sharded optimizer): the loss, norm, clipping and
    AdamW are queued without axo4d reading a device value; the loss and the norm are read after
    the optimizer step (on a GPU: one wait per step, for the step's own work)."""
    import sys

    tr = _trainer(sets)
    tr.step(0)
    events: list[str] = []

    def spy(name, real):
        def f(self, *a, **k):
            if "/axo4d/" in sys._getframe(1).f_code.co_filename.replace("\\", "/"):
                events.append(name)
            return real(self, *a, **k)

        return f

    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    real_step = tr.opt.step
    monkeypatch.setattr(tr.opt, "step", lambda *a, **k: events.append("optimizer step") or real_step(*a, **k))
    s = tr.step(1)
    assert events == ["optimizer step", "__float__", "__float__"], events
    assert 0 < s.grad_norm and s.loss > 0


def test_a_released_model_frees_its_weights(tmp_path):
    """After a training step and ``del``, nothing keeps the model's weights and gradients alive
    (the overlapped schedule's gradient hooks once held the schedule, a cycle through torch's C++
    hooks that garbage collection cannot break: a benchmark's next contender then measured the
    previous one's weights and gradients as its own peak memory)."""
    import gc
    import weakref

    model = _model(tmp_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, *_batch())
    opt.step()
    refs = [weakref.ref(p) for p in model.parameters()]
    del model, opt
    gc.collect()
    assert not [r for r in refs if r() is not None]

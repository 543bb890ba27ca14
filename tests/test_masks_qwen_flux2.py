"""Qwen-Image 2.1 and Flux.2's KV mode: the stand-in processors against diffusers' own, and the refusals.

In one process (no process group) the stand-ins run with an ``attend`` that is plain attention (a mask spec through
``masked.local_attention``, a key mask through SDPA math): the whole model with the stand-ins equals the model with
its stock processors, outputs and parameter gradients, in fp64 to 1e-12. The CP parity of both models is
tests/test_library.py's rows ``qwenimage21`` and ``flux2-kv``. Refusals are raised with no process group at all, so
before any collective by construction.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_lightning import routing
from cp_lightning.masked import local_attention
from cp_lightning.masks import MaskSpec, qwen_image_segments
from cp_lightning.models import CASES
from cp_lightning.parity import build, make_inputs

TOL = 1e-12


def _attend(q, k, v, mask=None):
    """A stand-in's CP attention, in one process: (B, S, H, D) in and out."""
    if isinstance(mask, MaskSpec):
        return local_attention(q, k, v, mask)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def _run(model, inputs):
    """Output and parameter gradients of a weighted sum of the output."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, return_dict=False)[0]
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _stand_in_parity(name, factory_of, monkeypatch, edit=None):
    """The case's model in fp64 with its stock processors, then with the stand-ins in every attention module."""
    case = CASES[name]
    model = build(case)[0].double()
    inputs = make_inputs(case, [model], 21, dtype=torch.float64)[0]
    if edit is not None:
        edit(inputs)
    ref_out, ref_grads = _run(model, inputs)
    # one process: this rank holds the whole sequence, from offset 0
    monkeypatch.setattr(routing, "shard_span", lambda x, dim: (0, x.shape[dim]))
    monkeypatch.setattr(routing, "shard_lengths", lambda x, dim: [x.shape[dim]])
    for _, sub in routing.attention_modules(model):
        sub.processor = factory_of(sub.processor)(sub.processor, _attend, lambda: True)
    out, grads = _run(model, inputs)
    assert (out - ref_out).abs().max().item() <= TOL * ref_out.abs().max().item()
    assert grads.keys() == ref_grads.keys() and grads
    for n, g in grads.items():
        assert (g - ref_grads[n]).abs().max().item() <= TOL * max(ref_grads[n].abs().max().item(), 1e-3), n
    return model, inputs


# ----- Qwen-Image 2.1 --------------------------------------------------------------------------------------------


def _no_text_mask(inputs):
    del inputs["encoder_hidden_states_mask"]


@pytest.mark.parametrize("edit", [None, _no_text_mask], ids=["text-padded-per-sample", "no-text-mask"])
def test_qwenimage21_stand_in_equals_the_stock_processor(monkeypatch, edit):
    from cp_lightning.models.qwenimage21 import QwenImage21SegmentAttention

    _stand_in_parity("qwenimage21", lambda _: QwenImage21SegmentAttention, monkeypatch, edit)


def test_qwenimage21_dropping_the_mask_would_be_caught(monkeypatch):
    """The parity above fails for a stand-in that attends without the segments' mask (the check can fail)."""
    from cp_lightning.models import qwenimage21 as Q

    monkeypatch.setattr(Q, "batch_specs", lambda segments, length, key_valid: [(None, None)])
    with pytest.raises(AssertionError):
        _stand_in_parity("qwenimage21", lambda _: Q.QwenImage21SegmentAttention, monkeypatch)


def test_qwenimage21_padded_keys_leave_the_spec_equal_to_the_stock_mask():
    """Padded text keys cut out of the segments' spec: dense, it is diffusers' (q >= k or same image) & key_valid."""
    from cp_lightning.models.qwenimage21 import batch_specs

    segments, length = [(0, 4, True), (4, 8, False), (8, 13, True)], 19
    image = torch.tensor([-1] * 4 + [0] * 4 + [-1] * 5 + [1] * 6)
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    causal = (q >= k) | ((image[:, None] == image[None, :]) & (image[:, None] >= 0))
    valid = torch.ones(3, length, dtype=torch.bool)
    valid[1, 11:13] = False  # right-padded prompt
    valid[2, 2:4] = False  # padding inside the first text segment, the causal triangle cut
    valid[2, 12] = False
    specs = batch_specs(segments, length, valid)
    assert len(specs) == 3
    for rows, spec in specs:
        (row,) = rows.tolist()
        assert torch.equal(spec.to_dense(), causal & valid[row][None, :]), row
    assert batch_specs(segments, length, valid) is specs  # once per forward, not per layer
    (only,) = batch_specs(segments, length, torch.ones(2, length, dtype=torch.bool))
    assert only[0] is None and only[1] == qwen_image_segments(segments, length)


def test_qwenimage21_refusals_come_before_any_collective():
    """No process group exists here: every refusal is raised before any communication could start."""
    from diffusers.models.transformers.transformer_qwenimage21 import (
        QwenImage21FlexAttnProcessor,
        QwenImage21KVCache,
    )

    from cp_lightning.models import plan_for
    from cp_lightning.models.qwenimage21 import QWENIMAGE21, QwenImage21SegmentAttention

    case = CASES["qwenimage21"]
    model = build(case)[0]
    inputs = make_inputs(case, [model], 21)[0]
    for mode in ("extract", "cached"):
        handles = QWENIMAGE21.install(model)
        try:
            with pytest.raises(ValueError, match="prefix KV caching"):
                model(**inputs, kv_cache=QwenImage21KVCache(len(model.transformer_blocks)), kv_cache_mode=mode)
        finally:
            for handle in handles:
                handle.remove()

    def no_attention(*args):
        raise AssertionError("attention ran")

    attn = model.transformer_blocks[0].attn
    stand_in = QwenImage21SegmentAttention(attn.processor, no_attention, lambda: True)
    with pytest.raises(ValueError, match="prefix KV caching"):
        stand_in(attn, torch.randn(2, 5, model.inner_dim), kv_cache_mode="cached")
    model.transformer_blocks[1].attn.set_processor(QwenImage21FlexAttnProcessor())
    with pytest.raises(ValueError, match="QwenImage21FlexAttnProcessor.*set_attn_processor"):
        plan_for(model)


# ----- Flux.2 KV mode --------------------------------------------------------------------------------------------


def _flux2_stand_in(processor):
    from cp_lightning.models.flux2_kv import Flux2KVJointAttention, Flux2KVParallelAttention

    return Flux2KVJointAttention if type(processor).__name__ == "Flux2KVAttnProcessor" else Flux2KVParallelAttention


def _plain_mode(inputs):
    del inputs["kv_cache_mode"], inputs["num_ref_tokens"]


@pytest.mark.parametrize("edit", [None, _plain_mode], ids=["extract", "no-kv-mode"])
def test_flux2_kv_stand_ins_equal_the_stock_kv_processors(monkeypatch, edit):
    _stand_in_parity("flux2-kv", _flux2_stand_in, monkeypatch, edit)


def test_flux2_kv_reference_tokens_see_only_themselves():
    """The case exercises the mask: perturbing an image token leaves the references' final hidden states unchanged."""
    case = CASES["flux2-kv"]
    model = build(case)[0].double()
    inputs = make_inputs(case, [model], 21, dtype=torch.float64)[0]
    seen = []
    handle = model.single_transformer_blocks[-1].register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(**inputs)
        inputs["hidden_states"] = inputs["hidden_states"].clone()
        inputs["hidden_states"][:, -1] += 1.0
        model(**inputs)
    handle.remove()
    text, refs = case.text_tokens, inputs["num_ref_tokens"]
    assert torch.equal(seen[0][:, text : text + refs], seen[1][:, text : text + refs])
    assert not torch.equal(seen[0][:, :text], seen[1][:, :text])


def test_flux2_double_blocks_spec_is_prefix_only_in_the_ranks_order():
    """The double blocks' spec, over each rank's [text_r, image_r] end to end (padded to M), is prefix_only over the
    tokens' original [text, reference, image] positions; pads and real tokens never see each other."""
    from cp_lightning.masks import prefix_only
    from cp_lightning.models.flux2_kv import double_spec

    for texts, images, refs in [((3, 2, 2), (5, 5, 4), 7), ((2, 2), (4, 3), 1), ((1, 1, 1, 1), (3, 3, 2, 2), 9)]:
        spec, m = double_spec(texts, images, refs)
        text, image = sum(texts), sum(images)
        where = []  # the original position of each position of the ranks' order, -1 for a pad
        for r, (t, i) in enumerate(zip(texts, images, strict=True)):
            t_at, i_at = sum(texts[:r]), text + sum(images[:r])
            where += [*range(t_at, t_at + t), *range(i_at, i_at + i), *[-1] * (m - t - i)]
        where = torch.tensor(where)
        real = where >= 0
        dense, expected = spec.to_dense(), prefix_only(text, refs, image - refs).to_dense()
        assert spec.length == len(texts) * m and m == max(t + i for t, i in zip(texts, images, strict=True))
        assert torch.equal(dense[real][:, real], expected[where[real]][:, where[real]])
        assert not dense[real][:, ~real].any() and not dense[~real][:, real].any()


def test_flux2_plans_follow_the_processors():
    from diffusers import Flux2Transformer2DModel

    from cp_lightning.models import plan_for

    model = build(CASES["flux2"])[0]
    assert plan_for(model) is Flux2Transformer2DModel._cp_plan
    kv = build(CASES["flux2-kv"])[0]
    plan = plan_for(kv)
    assert "transformer_blocks.0" in plan and "single_transformer_blocks.1" in plan and "" not in plan


def test_flux2_kv_refusals_come_before_any_collective():
    """No process group exists here: every refusal is raised before any communication could start."""
    from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor

    from cp_lightning.models import plan_for
    from cp_lightning.models.flux2_kv import FLUX2, Flux2KVParallelAttention

    case = CASES["flux2-kv"]
    kv = build(case)[0]
    inputs = make_inputs(case, [kv], 21)[0]
    handles = FLUX2.install(kv)
    try:
        with pytest.raises(ValueError, match='kv_cache_mode="cached".*inference'):
            kv(**{**inputs, "kv_cache_mode": "cached"})
    finally:
        for handle in handles:
            handle.remove()

    stock = build(CASES["flux2"])[0]
    handles = FLUX2.install(stock)
    try:
        with pytest.raises(ValueError, match="needs the KV processors"):
            stock(**make_inputs(case, [stock], 21)[0])
    finally:
        for handle in handles:
            handle.remove()

    def no_attention(*args):
        raise AssertionError("attention ran")

    attn = kv.single_transformer_blocks[0].attn
    stand_in = Flux2KVParallelAttention(attn.processor, no_attention, lambda: True)
    with pytest.raises(ValueError, match="inference"):
        stand_in(attn, torch.randn(2, 5, kv.inner_dim), kv_cache_mode="cached")

    kv.transformer_blocks[0].attn.set_processor(Flux2AttnProcessor())
    with pytest.raises(ValueError, match="KV processor but transformer_blocks.0.attn does not"):
        plan_for(kv)

"""Qwen-Image 2.1: one joint [text | condition images | text ... | target image] sequence, block-causal, as a mask spec.

``QwenImage21Transformer2DModel.forward`` builds the joint sequence itself (condition-image latents scattered into
the text stream at the vision-language encoder's image slots, the target image appended), its RoPE table (S, D/2),
the per-token ``target_token_mask`` that picks each token's modulation row, the (B, S) key validity of the text, and
the prefix ``segments``: ``(start, end, is_text)`` runs. Attention is ``(q >= k) or same_image_block`` with padded
text keys dropped; the stock ``QwenImage21AttnProcessor`` runs it as one SDPA call per segment plus one for the
target (each segment's queries against the keys ``[0, end)``), which needs every earlier key in one place.
:class:`QwenImage21SegmentAttention` stands in for it inside the split region (routing.py's ``STAND_INS``): the
same projections, norms and RoPE (diffusers' own ``_qwenimage21_prepare_qkv``), then one CP attention call over the
joint sequence with ``masks.qwen_image_segments(segments, S)`` as a mask spec, rectangles and no S x S tensor
(docs/masks.md). Padded text keys are cut out of the spec's key ranges; a spec is one mask for the whole batch, so
samples with different padding run one call per distinct padding (a batch with one prompt length: one call).

Refused, before any collective: the flex processor (``QwenImage21FlexAttnProcessor``: its BlockMask prefill has no
CP form, and the stand-in computes the same mask exactly), and prefix KV caching (``kv_cache``, "extract" or
"cached"): decoding against a cache is inference over a prefix that no rank holds whole.
"""

from __future__ import annotations

import inspect

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from diffusers.models.transformers.transformer_qwenimage21 import _qwenimage21_prepare_qkv
from torch.utils.hooks import RemovableHandle

from cp_lightning import routing
from cp_lightning.masks import CAUSAL, FULL, MaskSpec, Slice, qwen_image_segments
from cp_lightning.models import PlanEntry, TinyCase, register

_CACHE_REFUSAL = (
    "prefix KV caching (kv_cache / kv_cache_mode) decodes the target against a cache of the prefix's keys and values, "
    "which no CP rank holds whole; it is inference: run the denoising loop without parallelize() (or remove() the "
    "model first), and train without kv_cache (the prefix is recomputed, exactly, every step)"
)


def _valid_runs(valid: list[bool]) -> tuple[tuple[int, int], ...]:
    runs, start = [], None
    for index, ok in enumerate([*valid, False]):
        if ok and start is None:
            start = index
        elif not ok and start is not None:
            runs.append((start, index))
            start = None
    return tuple(runs)


def without_keys(spec: MaskSpec, runs: tuple[tuple[int, int], ...]) -> MaskSpec:
    """``spec`` with its keys cut to ``runs`` (the valid keys): padded text keys dropped, as the stock processor's
    key mask drops them. A causal slice cut at key ``lo`` starts at the first query that reaches ``lo``."""
    slices = []
    for s in spec.slices:
        for a, b in runs:
            lo, hi = max(a, s.k_lo), min(b, s.k_hi)
            if lo >= hi:
                continue
            if s.kind is FULL:
                slices.append(Slice(s.q_lo, s.q_hi, lo, hi))
            elif s.q_lo + lo - s.k_lo < s.q_hi:  # query q_lo + i sees keys up to k_lo + i
                slices.append(Slice(s.q_lo + lo - s.k_lo, s.q_hi, lo, hi, CAUSAL))
    try:
        return MaskSpec(spec.length, tuple(slices))
    except ValueError as err:
        raise ValueError(
            f"Qwen-Image 2.1's text padding (encoder_hidden_states_mask) leaves a query with no valid key: {err} "
            "(one process would give it a NaN row). Pad prompts on the right, after at least one valid token."
        ) from None


# The spec(s) of the last forward pass: every layer gets the same segments and key validity, and reading the (B, S)
# validity is a host sync, once per forward rather than once per layer
_LAST: dict = {}


def batch_specs(segments, length: int, key_valid: torch.Tensor | None) -> list[tuple[torch.Tensor | None, MaskSpec]]:
    """``[(batch rows, spec), ...]``: one spec per distinct key validity among the samples (rows None: all of them)."""
    key = (tuple(segments), length, None if key_valid is None else key_valid._version)
    if _LAST.get("tensor") is key_valid and _LAST.get("key") == key:
        return _LAST["specs"]
    spec = qwen_image_segments(segments, length)
    if key_valid is None:
        specs = [(None, spec)]
    else:
        groups: dict[tuple, list[int]] = {}
        for row, valid in enumerate(key_valid.bool().tolist()):
            groups.setdefault(_valid_runs(valid), []).append(row)
        full = ((0, length),)
        specs = [
            (None if len(groups) == 1 else torch.tensor(rows, device=key_valid.device),
             spec if runs == full else without_keys(spec, runs))
            for runs, rows in groups.items()
        ]  # fmt: skip
    _LAST.update(tensor=key_valid, key=key, specs=specs)
    return specs


class QwenImage21SegmentAttention(routing.StandIn):
    """``QwenImage21AttnProcessor``'s stand-in: its projections, then one CP attention with the segments' mask spec
    (per distinct text padding of the batch)."""

    def __call__(
        self,
        attn,
        hidden_states,
        attention_mask=None,
        rotary_emb=None,
        layer_cache=None,
        kv_cache_mode=None,
        cache_write_slice=None,
        segments=None,
        key_valid=None,
    ):
        args = (attn, hidden_states, attention_mask, rotary_emb, layer_cache, kv_cache_mode, cache_write_slice)
        if not self.runs_cp():
            return self.original(*args, segments=segments, key_valid=key_valid)
        if layer_cache is not None or kv_cache_mode is not None or segments is None:
            raise ValueError(f"Qwen-Image 2.1 under context parallelism: {_CACHE_REFUSAL}.")
        # B, S_local, H, D; RoPE from this rank's rows of the table (split with the tokens)
        q, k, v, _ = _qwenimage21_prepare_qkv(attn, hidden_states, rotary_emb, None, None, None)
        # the whole length: from the (B, S) validity every rank holds, else the ranks' shard lengths
        length = key_valid.shape[1] if key_valid is not None else routing.shard_span(hidden_states, 1)[1]
        specs = batch_specs(segments, length, key_valid)
        if len(specs) == 1:
            out = self.attend(q, k, v, specs[0][1])
        else:  # samples padded differently: one call per padding, rows put back in batch order
            outs = [self.attend(q[rows], k[rows], v[rows], spec) for rows, spec in specs]
            order = torch.cat([rows for rows, _ in specs]).argsort()
            out = torch.cat(outs)[order]
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))

    def __repr__(self) -> str:
        return f"QwenImage21SegmentAttention({type(self.original).__name__})"


routing.STAND_INS["QwenImage21AttnProcessor"] = QwenImage21SegmentAttention


def _refuse(model) -> str | None:
    flex = [
        name
        for name, sub in model.named_modules()
        if type(getattr(sub, "processor", None)).__name__ == "QwenImage21FlexAttnProcessor"
    ]
    if flex:
        return (
            f"{flex[0]} runs QwenImage21FlexAttnProcessor, whose prefill is one flex_attention call over a BlockMask "
            "of the whole sequence, which context parallelism cannot split. Set the SDPA processor before "
            "parallelize(): model.set_attn_processor(QwenImage21AttnProcessor()); cp_lightning runs its segments "
            "as one masked CP attention (the same mask, exactly)"
        )
    return None


def _install(model) -> list[RemovableHandle]:
    """Refuse prefix KV caching at the forward's start, before any split or collective."""

    params = list(inspect.signature(model.forward).parameters)

    def before_forward(_module, args, kwargs):
        named = {**dict(zip(params, args, strict=False)), **kwargs}
        if named.get("kv_cache") is not None or named.get("kv_cache_mode") is not None:
            raise ValueError(f"QwenImage21Transformer2DModel under context parallelism: {_CACHE_REFUSAL}.")

    return [model.register_forward_pre_hook(before_forward, with_kwargs=True, prepend=True)]


QWENIMAGE21 = PlanEntry(
    "QwenImage21Transformer2DModel",
    {
        # forward builds the joint sequence whole (the condition latents scattered into the text at their slots) and
        # passes it to the first block, where it is split: every rank a contiguous run of the joint sequence, which
        # is the layout the spec's rectangles are cut by (Layout.contiguous)
        "transformer_blocks.0": {"hidden_states": In(split_dim=1, expected_dims=3)},
        # per token, handed whole to every block: the RoPE table (S, D/2, complex) and the target mask that picks a
        # token's modulation row (t or t = 0). Not split: `segments` (Python runs over the whole sequence) and
        # `key_valid` (B, S): the stand-in builds the spec from them, the same on every rank
        "transformer_blocks.*": {
            "rotary_emb": In(split_dim=0, expected_dims=2),
            "target_token_mask": In(split_dim=0, expected_dims=1),
        },
        # the final norm modulates per token by the same mask (forward passes it whole)
        "norm_out": {"target_token_mask": In(split_dim=0, expected_dims=1)},
        "proj_out": Out(gather_dim=1, expected_dims=3),  # the joint sequence's predictions, in order
    },
    refuse=_refuse,
    needs="a stand-in processor (the segments as one mask spec)",
    install=_install,
)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    """[text | condition image | text | target image]: ``text_tokens`` text positions around one 2 x 2 condition
    image (one encoder slot), a target image of the remaining whole slots (4 tokens each); the second sample's last
    two text tokens are padding (a second spec)."""
    cfg = model.config
    target = (tokens // 4 - 1) * 4
    slot = text_tokens // 2  # the condition image's slot among the encoder's tokens
    encoder = text_tokens + 1
    img_mask = torch.zeros(batch, encoder + target // 4, dtype=torch.bool)
    img_mask[:, slot] = True
    img_mask[:, encoder:] = True
    text_mask = torch.ones(batch, encoder, dtype=torch.bool)
    text_mask[1:, -2:] = False
    side = 2 ** ((target.bit_length() - 1) // 2)
    shapes = [(1, 2, 2), (1, side, target // side)]
    return {
        "hidden_states": torch.randn(batch, 4 + target, cfg.in_channels, generator=g, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, encoder, cfg.context_in_dim, generator=g, dtype=dtype),
        "timestep": torch.rand(batch, generator=g, dtype=dtype),
        "img_shapes": [shapes] * batch,
        "img_mask": img_mask,
        "encoder_hidden_states_mask": text_mask,
    }


register(
    QWENIMAGE21,
    TinyCase(
        "qwenimage21",
        "QwenImage21Transformer2DModel",
        dict(
            in_channels=8,
            out_channels=8,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            context_in_dim=16,
            mlp_ratio=2,
            axes_dims_rope=(4, 6, 6),
        ),
        _inputs,
        note="causal text and image segments as a mask spec (stand-in processor), text padded per sample",
    ),
)

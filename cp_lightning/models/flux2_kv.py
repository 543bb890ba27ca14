"""Flux.2 and its KV mode (Flux.2 Klein KV): [text, reference, image] where the reference tokens see only themselves.

With its stock processors Flux.2 keeps diffusers' own plan (both streams and their (B, S, 4) ids split at the
root, the image gathered after ``proj_out``), right for training as it is. The Klein KV pipeline sets
``Flux2KVAttnProcessor`` (double-stream blocks) and ``Flux2KVParallelSelfAttnProcessor`` (single-stream blocks);
called with ``kv_cache_mode="extract"`` and ``num_ref_tokens=R`` the model prepends R reference tokens to the image
stream, modulates them from a fixed timestep, and its processors let them attend only to themselves while text and
image tokens attend to everything (``_flux2_kv_causal_attention``: two SDPA calls). That is trainable; its forward
reads whole lengths at three places that a root split would cut to one rank's share: the double blocks'
modulation, blended per token over [reference, image] from ``hidden_states.shape[1]``; the single blocks' one,
blended over [text, reference, image] from the *concatenated* stream's length; and the final cut
``hidden_states[:, text + R:]``. So with the KV processors the plan is :func:`kv_plan`: both streams split at
the double blocks (after the first blend), gathered after the last double block (forward concatenates and blends
them whole), the joint stream split again at the first single block and gathered after the last (forward cuts the
text and references off whole), the final norm's output split and ``proj_out`` gathered (loss_parallel keeps a
shard of the image).

The stand-ins (routing.py's ``STAND_INS``) do the processors' projections, norms and RoPE on this rank's tokens;
they cut the RoPE tables forward hands every block whole (text rows and image rows apart in the double blocks,
whose tokens are [text_r, image_r]; a contiguous run in the single blocks). Attention:

* single blocks, joint stream contiguous: one CP attention with ``masks.prefix_only(text, R, image)`` as its mask
  spec, rectangles and no S x S tensor (docs/masks.md);
* double blocks, whose rank holds a text run and an image run: the same mask written in the order CP attention
  sees the tokens (every rank's [text_r, image_r] end to end, each padded to the longest rank's length with at most
  two zero tokens that see only themselves: :func:`double_spec`), one CP attention too. Every rank's lengths come
  from ``routing.shard_lengths`` (one small all-gather per stream in eager code).

Refused, before any collective: ``kv_cache_mode="cached"`` (decoding against a cache of the references' K/V:
inference, run it without ``parallelize``), the KV mode with the stock processors (diffusers then drops the
reference-only attention and keeps only the blended modulation, which the root split cannot cut), and a model with
some blocks' processors KV and others stock. Under CP the extract pass leaves its returned cache empty (no rank holds
a reference's whole K/V; a later "cached" pass outside CP raises diffusers' "KV cache has not been populated").
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections, apply_rotary_emb
from torch.utils.hooks import RemovableHandle

from cp_lightning import routing
from cp_lightning.masks import MaskSpec, prefix_only
from cp_lightning.models import DIFFUSERS, PlanEntry, TinyCase, register
from cp_lightning.models.flux import _flux2_inputs
from cp_lightning.plan import PerTokenInput

KV_PROCESSORS = ("Flux2KVAttnProcessor", "Flux2KVParallelSelfAttnProcessor")

_CACHED = (
    'kv_cache_mode="cached" decodes the image against a cache of the reference tokens\' keys and values, which no CP '
    "rank holds whole; it is inference: run it without parallelize() (or remove() the model first). Training uses "
    'kv_cache_mode="extract" (the references attend only to themselves, exactly, under CP)'
)


def _rope(table, rows: int, text: int = 0):
    """This rank's rows of a whole (cos, sin) table, cut as the tokens were split: [text_r, image_r] for ``text`` (the
    whole text length) > 0, else one contiguous run; a table already cut to ``rows`` rows passes as it is."""
    if table is None or table[0].shape[0] == rows:
        return table
    if not text:
        return tuple(routing.local_shard(t, 0) for t in table)
    return tuple(torch.cat([routing.local_shard(t[:text], 0), routing.local_shard(t[text:], 0)]) for t in table)


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Touching runs joined: fewer slices, fewer kernel calls."""
    out: list[tuple[int, int]] = []
    for lo, hi in runs:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


@functools.lru_cache(maxsize=64)
def double_spec(text: tuple[int, ...], image: tuple[int, ...], references: int) -> tuple[MaskSpec, int]:
    """The KV mask in the order CP attention sees the double blocks' tokens, and the padded length M per rank.

    CP attention takes a spec in the coordinates of its ranks' local sequences laid end to end, one contiguous run
    per rank of the tokens that rank holds (``Layout.contiguous``). A double block's rank r holds [text_r, image_r]
    (``text[r]``, ``image[r]``: every rank's lengths; the first ``references`` image tokens are the references),
    so rank r's run is padded to the longest rank's M (under 3 tokens: the hooks split each stream as evenly as
    can be) and the layout is ``Layout.contiguous(P x M, P)``. Text and image queries see every real key, the
    references every reference key, a pad only the pads of its own rank (no real query sees a pad).
    """
    m = max(t + i for t, i in zip(text, image, strict=True))
    real, refs, others, pads = [], [], [], []
    seen = 0  # image tokens of the ranks before
    for r, (t, i) in enumerate(zip(text, image, strict=True)):
        base, ref = r * m, max(0, min(i, references - seen))
        real.append((base, base + t + i))
        others += [(base, base + t), (base + t + ref, base + t + i)]
        refs.append((base + t, base + t + ref))
        pads.append((base + t + i, base + m))
        seen += i
    real, refs, others, pads = (_merge([run for run in runs if run[0] < run[1]]) for runs in (real, refs, others, pads))
    slices = [(q_lo, q_hi, k_lo, k_hi) for q_lo, q_hi in others for k_lo, k_hi in real]
    slices += [(q_lo, q_hi, k_lo, k_hi) for q_lo, q_hi in refs for k_lo, k_hi in refs]
    slices += [(lo, hi, lo, hi) for lo, hi in pads]  # (touching pads merge only when a rank holds no real token)
    return MaskSpec(len(text) * m, tuple(slices)), m


class Flux2KVJointAttention(routing.StandIn):
    """``Flux2KVAttnProcessor``'s stand-in (double-stream blocks): the KV mask as a spec over [text_r, image_r]."""

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        image_rotary_emb=None,
        kv_cache=None,
        kv_cache_mode=None,
        num_ref_tokens: int = 0,
    ):
        if not self.runs_cp():
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, kv_cache, kv_cache_mode,
                num_ref_tokens,
            )  # fmt: skip
        if kv_cache_mode == "cached":
            raise ValueError(f"Flux.2 under context parallelism: {_CACHED}.")
        q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))  # B, S_local, H, D
        q, k = attn.norm_q(q), attn.norm_k(k)
        text = None
        if attn.added_kv_proj_dim is not None and encoder_hidden_states is not None:
            eq, ek, ev = (t.unflatten(-1, (-1, attn.head_dim)) for t in (eq, ek, ev))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            text = eq
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
        # every rank's image (and text) lengths: where the references and the RoPE rows of this rank are
        image = routing.shard_lengths(hidden_states, 1)
        texts = routing.shard_lengths(text, 1) if text is not None else [0] * len(image)
        rope = _rope(image_rotary_emb, q.shape[1], sum(texts))
        if rope is not None:
            q, k = apply_rotary_emb(q, rope, sequence_dim=1), apply_rotary_emb(k, rope, sequence_dim=1)
        local = q.shape[1]
        if kv_cache_mode == "extract" and num_ref_tokens > 0:  # the cache stays empty under CP (module doc)
            spec, m = double_spec(tuple(texts), tuple(image), num_ref_tokens)
            if m > local:  # B, S_local, H, D -> B, M, H, D: zero pads that only see themselves
                q, k, v = (torch.cat([t, t.new_zeros(t.shape[0], m - local, *t.shape[2:])], dim=1) for t in (q, k, v))
            out = self.attend(q, k, v, spec)[:, :local]
        else:
            out = self.attend(q, k, v, attention_mask)
        out = out.flatten(2, 3).to(q.dtype)
        if text is not None:
            encoder_out, out = out.split_with_sizes([text.shape[1], local - text.shape[1]], dim=1)
            encoder_out = attn.to_add_out(encoder_out)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, encoder_out) if text is not None else out

    def __repr__(self) -> str:
        return f"Flux2KVJointAttention({type(self.original).__name__})"


@functools.lru_cache(maxsize=64)
def _prefix_spec(text: int, references: int, length: int) -> MaskSpec:
    return prefix_only(text, references, length - text - references)


class Flux2KVParallelAttention(routing.StandIn):
    """``Flux2KVParallelSelfAttnProcessor``'s stand-in (single-stream blocks): the fused QKV + MLP projection, and
    attention with the ``prefix_only`` mask spec over the contiguous joint stream."""

    def __call__(
        self,
        attn,
        hidden_states,
        attention_mask=None,
        image_rotary_emb=None,
        kv_cache=None,
        kv_cache_mode=None,
        num_txt_tokens: int = 0,
        num_ref_tokens: int = 0,
    ):
        if not self.runs_cp():
            return self.original(
                attn, hidden_states, attention_mask, image_rotary_emb, kv_cache, kv_cache_mode, num_txt_tokens,
                num_ref_tokens,
            )  # fmt: skip
        if kv_cache_mode == "cached":
            raise ValueError(f"Flux.2 under context parallelism: {_CACHED}.")
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim, mlp_dim = 3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = projected.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)  # as the stock processor splits it
        qkv, mlp = torch.split(projected, [local_qkv, projected.shape[-1] - local_qkv], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))  # B, S_local, H, D
        q, k = attn.norm_q(q), attn.norm_k(k)
        rope = _rope(image_rotary_emb, q.shape[1])
        if rope is not None:
            q, k = apply_rotary_emb(q, rope, sequence_dim=1), apply_rotary_emb(k, rope, sequence_dim=1)
        if kv_cache_mode == "extract" and num_ref_tokens > 0:  # the cache stays empty under CP (module doc)
            length = image_rotary_emb[0].shape[0] if image_rotary_emb is not None else None
            if length is None or length == q.shape[1]:  # no whole table to read it from: the ranks' lengths
                length = routing.shard_span(hidden_states, 1)[1]
            out = self.attend(q, k, v, _prefix_spec(num_txt_tokens, num_ref_tokens, length))
        else:
            out = self.attend(q, k, v, attention_mask)
        out = out.flatten(2, 3).to(q.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))

    def __repr__(self) -> str:
        return f"Flux2KVParallelAttention({type(self.original).__name__})"


routing.STAND_INS["Flux2KVAttnProcessor"] = Flux2KVJointAttention
routing.STAND_INS["Flux2KVParallelSelfAttnProcessor"] = Flux2KVParallelAttention


def _processors(model) -> list[tuple[str, str]]:
    """(path, stock processor class name) of every attention module; a stand-in answers for its original."""
    found = []
    for name, sub in model.named_modules():
        if hasattr(sub, "processor"):
            processor = sub.processor.original if getattr(sub.processor, "stand_in", False) else sub.processor
            found.append((name, type(processor).__name__))
    return found


def uses_kv(model) -> bool:
    return any(kind in KV_PROCESSORS for _, kind in _processors(model))


def _refuse(model) -> str | None:
    kinds = _processors(model)
    kv = [name for name, kind in kinds if kind in KV_PROCESSORS]
    if kv and len(kv) != len(kinds):
        stock = next(name for name, kind in kinds if kind not in KV_PROCESSORS)
        return (
            f"{kv[0]} runs a KV processor but {stock} does not; the KV mode's plan needs every block's (set "
            "Flux2KVAttnProcessor on the double-stream blocks and Flux2KVParallelSelfAttnProcessor on the "
            "single-stream ones, as Flux2KleinKVPipeline does), the stock plan none"
        )
    return None


def _blocks(prefix: str, count: int, first: dict, every: dict, last) -> dict:
    """Entries splitting ``first`` at block 0, ``every`` at each block, gathering ``last`` after the last one."""
    if count == 0:
        return {}
    if count == 1:  # one block: its splits under '*', so that '.0' can name its gather
        return {f"{prefix}.*": {**first, **every}, f"{prefix}.0": last}
    return {f"{prefix}.0": first, f"{prefix}.*": every, f"{prefix}.{count - 1}": last}


def kv_plan(config) -> dict:
    """The plan with the KV processors (module doc): no RoPE split (the stand-ins cut forward's whole tables)."""
    tokens = In(split_dim=1, expected_dims=3)
    return {
        # after forward blended the image stream's modulation over the whole [reference, image] stream: both
        # streams split, the modulation with the image tokens when it is per token (extract mode), and gathered
        # after the last double block, where forward concatenates them and blends the single blocks' modulation
        **_blocks(
            "transformer_blocks",
            config.num_layers,
            {"hidden_states": tokens, "encoder_hidden_states": tokens},
            {"temb_mod_img": PerTokenInput(split_dim=1, expected_dims=3)},
            [Out(gather_dim=1, expected_dims=3), Out(gather_dim=1, expected_dims=3)],
        ),
        # the joint [text, reference, image] stream: one contiguous run per rank (the spec's layout), its per-token
        # modulation alike; gathered before forward cuts the text and references off at their whole lengths
        **_blocks(
            "single_transformer_blocks",
            config.num_single_layers,
            {"hidden_states": tokens},
            {"temb_mod": PerTokenInput(split_dim=1, expected_dims=3)},
            Out(gather_dim=1, expected_dims=3),
        ),
        # the image tokens, split again after the (per-token) final norm: proj_out runs on a shard, gathered last
        "norm_out": {0: In(split_dim=1, expected_dims=3, split_output=True)},
        "proj_out": Out(gather_dim=1, expected_dims=3),
    }


@dataclasses.dataclass(frozen=True)
class _Flux2Entry(PlanEntry):
    """Flux.2's entry: diffusers' plan with the stock processors, :func:`kv_plan` with the KV processors."""

    def resolve(self, model):
        plan = super().resolve(model)  # the refusals first
        return kv_plan(model.config) if uses_kv(model) else plan


def _install(model) -> list[RemovableHandle]:
    """Refuse, at the forward's start (before any split or collective), the modes the plan cannot run exactly."""
    params = list(inspect.signature(model.forward).parameters)
    kv = uses_kv(model)

    def before_forward(_module, args, kwargs):
        named = {**dict(zip(params, args, strict=False)), **kwargs}
        mode, references = named.get("kv_cache_mode"), named.get("num_ref_tokens") or 0
        if mode == "cached":
            raise ValueError(f"Flux2Transformer2DModel under context parallelism: {_CACHED}.")
        if mode == "extract" and references > 0 and not kv:
            raise ValueError(
                'Flux2Transformer2DModel under context parallelism: kv_cache_mode="extract" with reference tokens '
                "needs the KV processors (their attention keeps the references to themselves; the stock ones drop "
                "it, and the reference modulation forward blends at whole lengths cannot follow diffusers' root "
                "split). Set them before parallelize(), as Flux2KleinKVPipeline does: Flux2KVAttnProcessor on "
                "transformer_blocks.*.attn, Flux2KVParallelSelfAttnProcessor on single_transformer_blocks.*.attn."
            )

    return [model.register_forward_pre_hook(before_forward, with_kwargs=True, prepend=True)]


# Flux.2's own plan (both streams and their (B, S, 4) ids split at the root) with the stock processors
FLUX2 = _Flux2Entry(
    "Flux2Transformer2DModel",
    DIFFUSERS,
    refuse=_refuse,
    install=_install,
    needs="with the KV processors: stand-ins (a prefix_only mask spec) and gathers with splits after them",
)


def set_kv_processors(model) -> None:
    """What Flux2KleinKVPipeline does to its transformer: the KV processors on every block."""
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())


def _kv_inputs(model, g, batch, tokens, text_tokens, dtype):
    """Flux.2's inputs with the first third of the image tokens as references (their ids a frame apart), in the KV
    extract mode."""
    inputs = _flux2_inputs(model, g, batch, tokens, text_tokens, dtype)
    references = max(1, tokens // 3)
    inputs["img_ids"] = inputs["img_ids"].clone()
    inputs["img_ids"][:, :references, 0] = 10
    return {**inputs, "kv_cache_mode": "extract", "num_ref_tokens": references, "ref_fixed_timestep": 0.0}


register(
    FLUX2,
    TinyCase(
        "flux2-kv",
        "Flux2Transformer2DModel",
        dict(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            timestep_guidance_channels=16,
            axes_dims_rope=(4, 4, 4, 4),
        ),
        _kv_inputs,
        setup=set_kv_processors,
        note="the KV processors in extract mode: reference tokens attend only to themselves (stand-ins)",
    ),
)

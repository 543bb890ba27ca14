"""Cosmos-Predict2 (``CosmosTransformer3DModel``): Wan-like video blocks with AdaLN-LoRA and 3D RoPE.

The patchified tokens are flattened in ``forward``, so they are split where they enter the first block, and
gathered after ``proj_out``, before the unpatchify reshapes. The RoPE tables (cos, sin of (S, D)) are split
at ``rope``'s output. Each block also takes the timestep embeddings: per sample (B, C) for a (B,) timestep,
passed whole, or per token (B, S, C) for a per-frame (B, 1, T, 1, 1) one, split with the tokens
(``PerTokenInput``; also at ``norm_out``), and Cosmos 1.0's learnable positional embedding (B, S, C),
split likewise. The text stays whole (cross-attention). The stock processor calls ``dispatch_attention_fn`` without a
``parallel_config``: routing.py gives it the CP config by the module it runs in (``BARE_DISPATCH``).
The tiny case leaves ``concat_padding_mask`` off (Predict2 turns it on: one more input channel before the
split, resized with torchvision, which the test environment lacks).

Cosmos3 (``Cosmos3OmniTransformer``, further down): a packed [causal text | generated video, sound, actions]
sequence through dual-pathway layers, split per stream, its processor stood in for (:class:`Cosmos3Attention`).
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out
from diffusers.models.transformers.transformer_cosmos3 import _rotate_half

from cp_lightning import routing
from cp_lightning.masks import CAUSAL, MaskSpec
from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video
from cp_lightning.plan import PerTokenInput
from cp_lightning.tiny import _factor

_TABLE = In(split_dim=0, expected_dims=2, split_output=True)
_PER_TOKEN = PerTokenInput(split_dim=1, expected_dims=3)

COSMOS = PlanEntry(
    "CosmosTransformer3DModel",
    {
        "rope": {0: _TABLE, 1: _TABLE},
        "transformer_blocks.0": {"hidden_states": In(split_dim=1, expected_dims=3)},
        "transformer_blocks.*": {
            "embedded_timestep": _PER_TOKEN,
            "temb": _PER_TOKEN,
            "extra_pos_emb": In(split_dim=1, expected_dims=3),
        },
        "norm_out": {"embedded_timestep": _PER_TOKEN, "temb": _PER_TOKEN},  # it modulates the split tokens too
        "proj_out": Out(gather_dim=1, expected_dims=3),
    },
    needs="dispatch processors without a parallel_config (BARE_DISPATCH)",
)


def _inputs(model, g, batch, tokens, text_tokens, dtype, per_frame=False):
    frames, h, w = _video(tokens)
    cfg = model.config
    pt, ph, pw = cfg.patch_size
    shape = (batch, cfg.in_channels, pt * frames, ph * h, pw * w)
    t = torch.rand(batch, 1, frames, 1, 1, generator=g, dtype=dtype) if per_frame else torch.rand(batch, generator=g)
    return {
        "hidden_states": torch.randn(shape, generator=g, dtype=dtype),
        "timestep": t.to(dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_embed_dim, generator=g, dtype=dtype),
    }


def _per_frame_inputs(model, g, batch, tokens, text_tokens, dtype):
    return _inputs(model, g, batch, tokens, text_tokens, dtype, per_frame=True)


_CONFIG = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=4,
    attention_head_dim=12,
    num_layers=1,
    mlp_ratio=2.0,
    text_embed_dim=16,
    adaln_lora_dim=8,
    max_size=(8, 16, 16),
    patch_size=(1, 2, 2),
    rope_scale=(1.0, 4.0, 4.0),
    concat_padding_mask=False,
    extra_pos_embed_type=None,
)

register(
    COSMOS,
    TinyCase("cosmos-predict2", "CosmosTransformer3DModel", _CONFIG, _inputs),
    TinyCase(
        "cosmos-predict2-frames",
        "CosmosTransformer3DModel",
        _CONFIG,
        _per_frame_inputs,
        note="one timestep per latent frame: per-token block modulation",
    ),
)


# Cosmos3 (``Cosmos3OmniTransformer``): one packed sequence with no batch dim, (S, C), built in ``forward`` from the
# text ids and the patchified vision (and sound, action) latents at their sequence indexes, then cut into the causal
# text prefix (``und_seq``, ``und_len`` tokens) and the generated tokens after it (``gen_seq``). Every decoder layer
# takes both streams and the RoPE tables (cos, sin of each stream, (S, D)) positionally. diffusers 0.42.1 gives the
# class no ``_cp_plan`` (its ``_cp_shard_fn`` seam expects an outside helper), so the plan is ours:
def _cosmos3_plan(config) -> dict:
    stream = In(split_dim=0, expected_dims=2)
    return {
        # both streams are split once, at the first layer, each along its own length; they then flow sharded
        "layers.0": {"und_seq": stream, "gen_seq": stream},
        # forward hands every layer the same whole tables: each layer cuts (cos_und, sin_und, cos_gen, sin_gen) to
        # its rank's text and generated tokens
        "layers.*": {"rotary_emb": In(split_dim=0, expected_dims=2)},
        # the final norms are per token; their outputs are gathered before forward concatenates the streams and
        # reads the predictions at their global sequence indexes (so loss_parallel is refused)
        "norm": Out(gather_dim=0, expected_dims=2),
        "norm_moe_gen": Out(gather_dim=0, expected_dims=2),
    }


class Cosmos3Attention(routing.StandIn):
    """``Cosmos3AttnProcessor``'s stand-in: the same projections, norms and RoPE, and each pathway through CP attention.

    The text pathway is causal (``is_causal=True``), which CP attention takes as a mask spec over the whole text (a
    causal slice of ``und_len`` tokens, run as rectangles between the ranks' shards); the generated tokens attend to
    every text key (normed for them) and their own, unmasked: keys concatenated per rank form a permutation of the
    whole key set, which unmasked softmax attention does not see. Both keep their 8 (tiny: 2) K/V heads (GQA).
    """

    def __call__(self, attn, und_seq, gen_seq, rotary_emb):
        if not self.runs_cp():
            return self.original(attn, und_seq, gen_seq, rotary_emb)
        heads, kv_heads, dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim

        def project(x, to, norm, heads, cos=None, sin=None):  # S, C -> S, H, D (RoPE'd when given a table)
            t = to(x).view(-1, heads, dim)
            t = t if norm is None else norm(t)
            return t if cos is None else t * cos + _rotate_half(t) * sin

        cos_und, sin_und, cos_gen, sin_gen = (t.unsqueeze(1) for t in rotary_emb)  # S, D -> S, 1, D
        q_und = project(und_seq, attn.to_q, attn.norm_q, heads, cos_und, sin_und)
        k_und_raw = project(und_seq, attn.to_k, attn.norm_k, kv_heads)
        k_und = k_und_raw * cos_und + _rotate_half(k_und_raw) * sin_und
        k_for_gen = k_und if attn.k_norm_und_for_gen is None else attn.k_norm_und_for_gen(k_und_raw)
        if attn.k_norm_und_for_gen is not None:
            k_for_gen = k_for_gen * cos_und + _rotate_half(k_for_gen) * sin_und
        v_und = project(und_seq, attn.to_v, None, kv_heads)
        q_gen = project(gen_seq, attn.add_q_proj, attn.norm_added_q, heads, cos_gen, sin_gen)
        k_gen = project(gen_seq, attn.add_k_proj, attn.norm_added_k, kv_heads, cos_gen, sin_gen)
        v_gen = project(gen_seq, attn.add_v_proj, None, kv_heads)

        _, text = routing.shard_span(und_seq, 0)  # the whole text length, for the causal spec
        causal = MaskSpec(text, ((0, text, 0, text, CAUSAL),))
        # S, H, D -> 1, S, H, D for CP attention and back, then S, H*D
        und_out = self.attend(q_und[None], k_und[None], v_und[None], causal)[0].flatten(-2)
        keys, values = torch.cat([k_for_gen, k_gen]), torch.cat([v_und, v_gen])  # this rank's text, then generated
        gen_out = self.attend(q_gen[None], keys[None], values[None])[0].flatten(-2)
        return attn.to_out(und_out), attn.to_add_out(gen_out)

    def __repr__(self) -> str:
        return f"Cosmos3Attention({type(self.original).__name__})"


routing.STAND_INS["Cosmos3AttnProcessor"] = Cosmos3Attention

COSMOS3 = PlanEntry(
    "Cosmos3OmniTransformer",
    _cosmos3_plan,
    needs="a stand-in for its dual-pathway processor (causal text as a mask spec, GQA)",
    loss_parallel="its forward reads the predictions at global sequence indexes of the concatenated streams",
)


def _cosmos3_inputs(model, g, batch, tokens, text_tokens, dtype):
    """One packed sample (the class has no batch dim): text, a video whose first latent frame is a clean condition
    (of odd latent width: patchify pads it), sound, and actions whose first step is a condition."""
    cfg, p = model.config, model.config.latent_patch_size
    frames = 3 if tokens % 3 == 0 else 1
    h = _factor(tokens // frames)
    w = tokens // frames // h
    sound, actions = 4, 3
    noisy = torch.arange(1 if frames > 1 else 0, frames)  # latent frames the model predicts
    vision_at = text_tokens
    sound_at = vision_at + tokens
    action_at = sound_at + sound
    length = action_at + actions
    grid_t, grid_h, grid_w = torch.meshgrid(torch.arange(frames), torch.arange(h), torch.arange(w), indexing="ij")
    text_ids = torch.arange(text_tokens).expand(3, -1)
    vision_ids = torch.stack([grid_t.flatten() + text_tokens, grid_h.flatten(), grid_w.flatten()])
    stream_ids = torch.arange(sound + actions) + text_tokens
    position_ids = torch.cat([text_ids, vision_ids, torch.stack([stream_ids, 0 * stream_ids, 0 * stream_ids])], 1)
    per_frame = h * w
    vision_loss = torch.cat([torch.arange(per_frame) + vision_at + f * per_frame for f in noisy.tolist()])
    action_noisy = torch.arange(1, actions)
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (text_tokens,), generator=g),
        "text_indexes": torch.arange(text_tokens),
        "position_ids": position_ids,
        "und_len": text_tokens,
        "sequence_length": length,
        "vision_tokens": [torch.randn(1, cfg.latent_channel, frames, p * h, p * w - 1, generator=g, dtype=dtype)],
        "vision_token_shapes": [(frames, h, w)],
        "vision_sequence_indexes": torch.arange(vision_at, sound_at),
        "vision_mse_loss_indexes": vision_loss,
        "vision_timesteps": 1000 * torch.rand(len(vision_loss), generator=g, dtype=dtype),
        "vision_noisy_frame_indexes": [noisy],
        "sound_tokens": [torch.randn(cfg.sound_dim, sound, generator=g, dtype=dtype)],
        "sound_token_shapes": [(sound, 1, 1)],
        "sound_sequence_indexes": torch.arange(sound_at, action_at),
        "sound_mse_loss_indexes": torch.arange(sound_at, action_at),
        "sound_timesteps": 1000 * torch.rand(sound, generator=g, dtype=dtype),
        "sound_noisy_frame_indexes": [torch.arange(sound)],
        "action_tokens": [torch.randn(actions, cfg.action_dim, generator=g, dtype=dtype)],
        "action_token_shapes": [(actions, 1, 1)],
        "action_sequence_indexes": torch.arange(action_at, length),
        "action_mse_loss_indexes": action_noisy + action_at,
        "action_timesteps": 1000 * torch.rand(len(action_noisy), generator=g, dtype=dtype),
        "action_noisy_frame_indexes": [action_noisy],
        "action_domain_ids": [torch.tensor(1)],
    }


register(
    COSMOS3,
    TinyCase(
        "cosmos3-omni",
        "Cosmos3OmniTransformer",
        dict(
            head_dim=8,
            hidden_size=32,
            intermediate_size=48,
            latent_channel=4,
            latent_patch_size=2,
            patch_latent_dim=16,  # latent_patch_size ** 2 * latent_channel
            num_attention_heads=4,
            num_key_value_heads=2,  # GQA (released: 32 / 8); at cp 4 the Ulysses degree exceeds the K/V heads
            num_hidden_layers=2,
            vocab_size=32,
            rope_axes_dim=(2, 1, 1),  # interleaved mRoPE sections (t, h, w) of head_dim / 2 frequencies
            sound_gen=True,
            sound_dim=4,
            action_gen=True,
            action_dim=3,
            num_embodiment_domains=2,
        ),
        _cosmos3_inputs,
        # the text head, and the last layer's text outputs with the final text norm: forward predicts vision, sound
        # and actions only, read at the generated positions
        unused=(
            "lm_head",
            "norm.",
            *(
                f"layers.1.{m}"
                for m in ("mlp.", "post_attention_layernorm", "self_attn.to_q", "self_attn.norm_q", "self_attn.to_out")
            ),
        ),
        note="packed omni sequence (text, video with a condition frame, sound, actions); causal text; GQA",
    ),
)

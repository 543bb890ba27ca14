"""AnyFlow (Wan-architecture flow-map video model) and AnyFlow-FAR (its frame-autoregressive variant).

AnyFlow is Wan's layout with per-frame timesteps: ``condition_embedder`` turns the (B, F) timesteps (and the
flow-map's second time) into per-token embeddings, repeated over each frame's tokens, so every block's
modulation ``temb`` is (B, S, 6, C) and is split with the tokens at every block (each block gets the root's
whole tensor). The RoPE is a dict {"query": t, "key": t} of complex (1, 1, S, D/2) tables, split along S at
every block. The text stays whole on every rank; its cross-attention (``AnyFlowCrossAttnProcessor``, which
hands the dispatcher its parallel config) runs locally on each rank's queries. ``forward`` modulates the
final norm with the (B, S, C) per-token time embedding it computed from the whole sequence, so the tokens
are gathered at the last block's output and ``norm_out`` / ``proj_out`` run on whole tokens.

AnyFlow-FAR trains with a frame-causal FlexAttention ``BlockMask`` (each chunk of frames attends to earlier
chunks; with teacher forcing a clean copy of the frames joins the sequence and noisy frames see only clean
earlier ones): a per-query mask, refused until masks under CP land (another engineer's work in progress).
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput as In
from diffusers.models._modeling_parallel import ContextParallelOutput as Out

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.wan import _video

_TOKENS = {"hidden_states": In(split_dim=1, expected_dims=3)}
_PER_BLOCK = {
    "temb": In(split_dim=1, expected_dims=4),  # (B, S, 6, C): per-frame timesteps repeated over the frame's tokens
    "rotary_emb": In(split_dim=2, expected_dims=4),  # each value of the {"query", "key"} dict, (1, 1, S, D/2)
}


def _plan(config) -> dict:
    last = config.num_layers - 1
    # a last block that is also the first takes its split through '*' (one key cannot both split and gather)
    blocks = {"blocks.*": {**_TOKENS, **_PER_BLOCK}} if last == 0 else {"blocks.0": _TOKENS, "blocks.*": _PER_BLOCK}
    return {**blocks, f"blocks.{last}": Out(gather_dim=1, expected_dims=3)}


ANYFLOW = PlanEntry(
    "AnyFlowTransformer3DModel",
    _plan,
    needs="dict-valued inputs split per value; gathers with parameters after them",
    loss_parallel="its forward modulates norm_out with the whole sequence's per-token time embedding",
)

FAR_REASON = (
    "AnyFlow-FAR attends through a frame-causal FlexAttention BlockMask (each chunk of frames sees earlier chunks; "
    "under teacher forcing noisy frames see only earlier clean ones), a mask with one row per query that context "
    "parallelism cannot split yet (masks under CP are being built). Train it without CP for now; "
    "AnyFlowTransformer3DModel, the bidirectional model, is supported."
)
ANYFLOW_FAR = PlanEntry("AnyFlowFARTransformer3DModel", None, refuse=lambda _model: FAR_REASON)


def _inputs(model, g, batch, tokens, text_tokens, dtype):
    frames, h, w = _video(tokens)
    cfg = model.config
    _, ph, pw = cfg.patch_size
    t = torch.rand(batch, frames, generator=g)
    return {
        "hidden_states": torch.randn(batch, frames, cfg.in_channels, ph * h, pw * w, generator=g, dtype=dtype),
        "timestep": 1000 * t,  # one time per latent frame
        "r_timestep": 1000 * t * torch.rand(batch, frames, generator=g),  # the flow map's target time, r <= t
        "encoder_hidden_states": torch.randn(batch, text_tokens, cfg.text_dim, generator=g, dtype=dtype),
    }


register(
    ANYFLOW,
    ANYFLOW_FAR,
    TinyCase(
        "anyflow",
        "AnyFlowTransformer3DModel",
        dict(
            num_attention_heads=4,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=64,
        ),
        _inputs,
        note="per-frame timesteps (per-token modulation), dict RoPE",
    ),
)

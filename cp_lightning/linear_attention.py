"""Linear attention (Sana, Sana-Video) over the CP group: one all-reduce of the key state per attention.

Sana's self-attention is ReLU linear attention (DESIGN.md section 8.5)::

    out_q = ReLU(q) (sum_k ReLU(k)^T v) / (ReLU(q) . sum_k ReLU(k))

Both sums run over the keys and are additive over any partition of them. So each CP rank computes
them over its own tokens, one all-reduce (:func:`collectives.all_reduce_sum`) gives every rank the
sums over the whole sequence, and each rank finishes its own queries with them: exact, no all-to-all,
and what is sent is the state (B, H, D, D+1), independent of the sequence length. Shards of different
lengths are not padded (collectives.shard), so no padding token ever enters a sum. The stock
processors take no attention mask over the keys (Sana's blocks pass none; they ignore one).

:class:`LinearAttentionCP` stands in for the stock processor while a model is parallelized (routing.py
installs it and puts the original back): inside the split region it runs the CP form below, elsewhere
the original processor itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_lightning.collectives import all_reduce_sum

# stock linear-attention processors by class name -> the CP form of their arithmetic
LINEAR_PROCESSORS = ("SanaLinearAttnProcessor2_0", "SanaLinearAttnProcessor3_0")


def _projections(attn, hidden_states):
    query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    return query, key, value


def _output(attn, hidden_states, dtype):
    hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.to(dtype)))
    return hidden_states.clip(-65504, 65504) if dtype == torch.float16 else hidden_states


def sana_attention(attn, hidden_states: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``SanaLinearAttnProcessor2_0`` on this rank's (B, S_local, C) tokens, its key sums over the CP group."""
    dtype = hidden_states.dtype
    query, key, value = _projections(attn, hidden_states)
    # B, S_local, H*D -> B, H, D, S_local (keys: B, H, S_local, D)
    query = F.relu(query.transpose(1, 2).unflatten(1, (attn.heads, -1))).float()
    key = F.relu(key.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3)).float()
    value = value.transpose(1, 2).unflatten(1, (attn.heads, -1)).float()
    # a row of ones under the values: the state's last row is then sum_k ReLU(k), the normaliser's sum
    value = F.pad(value, (0, 0, 0, 1), mode="constant", value=1.0)
    state = all_reduce_sum(torch.matmul(value, key), group)  # B, H, D+1, D: summed over every rank's keys
    out = torch.matmul(state, query)  # B, H, D+1, S_local
    out = out[:, :, :-1] / (out[:, :, -1:] + 1e-15)
    # B, H, D, S_local -> B, S_local, H*D
    return _output(attn, out.flatten(1, 2).transpose(1, 2), dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # interleaved pairs (x1, x2) of the last dim, as Sana-Video's processor rotates them
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


def sana_video_attention(attn, hidden_states: torch.Tensor, rotary_emb, group: dist.ProcessGroup) -> torch.Tensor:
    """``SanaLinearAttnProcessor3_0`` (rotated numerator, unrotated normaliser) with its sums over the CP group.

    ``rotary_emb``: the (cos, sin) tables of this rank's tokens, (1, S_local, 1, D) each (split by the plan).
    """
    if rotary_emb is None:
        raise ValueError("Sana-Video's linear attention needs rotary_emb (the block passes the model's RoPE tables).")
    dtype = hidden_states.dtype
    query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in _projections(attn, hidden_states))
    query, key = F.relu(query), F.relu(key)  # B, S_local, H, D
    query_rot, key_rot = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
    # B, S_local, H, D -> B, H, D, S_local
    query, key, query_rot, key_rot, value = (t.permute(0, 2, 3, 1) for t in (query, key, query_rot, key_rot, value))
    query_rot, key_rot, value = query_rot.float(), key_rot.float(), value.float()
    kv = torch.matmul(value, key_rot.transpose(-1, -2))  # B, H, D, D
    key_sum = key.sum(dim=-1, keepdim=True)  # B, H, D, 1
    # one all-reduce for both sums: B, H, D, D+1
    state = all_reduce_sum(torch.cat([kv, key_sum.to(kv.dtype)], dim=-1), group)
    kv, key_sum = state[..., :-1], state[..., -1:].to(key.dtype)
    z = 1 / (key_sum.transpose(-2, -1) @ query + 1e-15)  # B, H, 1, S_local
    out = torch.matmul(kv, query_rot) * z  # B, H, D, S_local
    # B, H, D, S_local -> B, S_local, H*D
    return _output(attn, out.flatten(1, 2).transpose(1, 2), dtype)


class LinearAttentionCP:
    """A stock linear-attention processor's stand-in: CP linear attention where ``runs_cp()`` says so.

    ``runs_cp()`` (routing.py) is True inside the split region (between a split and a gather); elsewhere,
    and for cross-attention, the original processor runs on whatever tokens it is given.
    """

    def __init__(self, original, group: dist.ProcessGroup, runs_cp: Callable[[], bool]) -> None:
        self.original, self.group, self.runs_cp = original, group, runs_cp

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or not self.runs_cp():
            extra = {} if rotary_emb is None else {"rotary_emb": rotary_emb}
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, **extra)
        if type(self.original).__name__ == "SanaLinearAttnProcessor3_0":
            return sana_video_attention(attn, hidden_states, rotary_emb, self.group)
        return sana_attention(attn, hidden_states, self.group)

    def __repr__(self) -> str:
        return f"LinearAttentionCP({type(self.original).__name__})"

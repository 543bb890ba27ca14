"""A small DiT outside cp_lightning's plan library: the example of docs/models.md, "Checking your own model".

docs/models.md shows this file's code below this docstring verbatim (tests/test_library.py checks it), and
the tests run ``python -m cp_lightning.check tests.custom_dit:TinyDiT --config tests/custom_dit.json
--inputs tests.custom_dit:inputs`` with PLAN (exit 0) and with the wrong plans below (exit 1).
"""

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention_processor import Attention
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.modulation = nn.Linear(dim, 4 * dim)
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = Attention(dim, heads=heads, dim_head=dim // heads, bias=True)  # diffusers' SDPA processor
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, hidden_states, temb):
        shift1, scale1, shift2, scale2 = self.modulation(temb)[:, None].chunk(4, dim=-1)
        x = hidden_states + self.attn(self.norm1(hidden_states) * (1 + scale1) + shift1)
        return x + self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class TinyDiT(nn.Module):
    def __init__(self, in_channels=4, dim=32, heads=4, num_layers=2, max_tokens=64):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, max_tokens, dim))  # learned, by position
        self.time_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(num_layers)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, timestep):  # (B, S, C) tokens, (B,) timesteps
        x = self.proj_in(hidden_states) + self.pos_embed[:, : hidden_states.shape[1]]
        temb = self.time_embed(timestep[:, None])
        for block in self.blocks:
            x = block(x, temb)
        return self.proj_out(self.norm_out(x))


def inputs(model, generator, batch, tokens, text_tokens, dtype):
    """Full inputs for `tokens` tokens (the same on every rank); this model has no text."""
    channels = model.proj_in.in_features
    return {
        "hidden_states": torch.randn(batch, tokens, channels, generator=generator, dtype=dtype),
        "timestep": torch.rand(batch, generator=generator, dtype=dtype),
    }


# The tokens are split where they enter the first block: after the positional embedding, which is added by
# position over the whole sequence. Everything from there to proj_out is per token except attention (which
# cp_lightning runs over the CP group); the output is gathered after proj_out. temb is per sample: whole.
PLAN = {
    "blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}

# Wrong plans the checker fails (exit 1):
# splits the batch dim, not the sequence: attention then mixes one rank's sample with another's
WRONG_DIM = {
    "blocks.0": {"hidden_states": ContextParallelInput(split_dim=0, expected_dims=3)},
    "proj_out": ContextParallelOutput(gather_dim=0, expected_dims=3),
}
# gathers the attention's output inside the block, whose residual still holds this rank's tokens only
WRONG_GATHER = {
    "blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
    "blocks.0.attn": ContextParallelOutput(gather_dim=1, expected_dims=3),
}
# splits at the model's input: each rank adds the first positions' embeddings to its own tokens
EARLY_SPLIT = {
    "": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}

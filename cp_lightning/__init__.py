"""cp_lightning: exact context parallelism for training diffusion transformers.

Public entry points: :func:`build_mesh` (the (dp, cp) device mesh) and :func:`parallelize`
(split/gather hooks plus context-parallel attention on a diffusers model); :func:`to_fp8_base` stores a
LoRA run's frozen base in float8 (:mod:`cp_lightning.fp8`); :class:`MaskSpec` and its constructors
(:mod:`cp_lightning.masks`) describe block-causal, segment and reference-only masks that context-parallel
attention runs exactly, with a :class:`Layout` of the tokens per rank (:mod:`cp_lightning.mask_layout`);
:func:`rollout_attention` with one :class:`KVCache` per layer runs a chunked KV-cache roll-out under Ulysses
(:mod:`cp_lightning.rollout`).
"""

from cp_lightning.checks import CPMismatchError
from cp_lightning.compilation import compile_blocks
from cp_lightning.fabric import FabricContextParallelStrategy
from cp_lightning.fp8 import FP8Linear, fp8_weight_error, quantize_fp8, to_fp8_base
from cp_lightning.mask_layout import Layout
from cp_lightning.masks import (
    CAUSAL,
    FULL,
    MaskSpec,
    Slice,
    block_causal,
    documents,
    prefix_only,
    qwen_image_segments,
    teacher_forcing,
)
from cp_lightning.mesh import build_mesh
from cp_lightning.parallelize import loss_shard, parallelize, remove
from cp_lightning.plan import Unsplit
from cp_lightning.rollout import KVCache, rollout_attention
from cp_lightning.strategy import ContextParallelStrategy

__all__ = [
    "CAUSAL",
    "FULL",
    "Layout",
    "MaskSpec",
    "Slice",
    "block_causal",
    "documents",
    "prefix_only",
    "qwen_image_segments",
    "teacher_forcing",
    "CPMismatchError",
    "ContextParallelStrategy",
    "FP8Linear",
    "FabricContextParallelStrategy",
    "Unsplit",
    "build_mesh",
    "KVCache",
    "rollout_attention",
    "compile_blocks",
    "fp8_weight_error",
    "loss_shard",
    "parallelize",
    "quantize_fp8",
    "remove",
    "to_fp8_base",
]
__version__ = "0.1.0"

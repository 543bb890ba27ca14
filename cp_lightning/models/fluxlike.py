"""Flux.1-layout image transformers from other labs: LongCat-Image and Ovis-Image.

Both are Flux.1 without pooled text or guidance (Ovis adds an RMSNorm before ``context_embedder``): dual-stream
blocks that concatenate [text, image] inside attention, then single-stream blocks over the concatenation, every
layer outside attention per token, and a RoPE table built in ``forward`` from (S, 3) ids over [text, image]. So
Bria's plan (flux.py) fits as it is: text and image split together at the root with their ids, each rank's table
built from its own [text_r, image_r] ids, and the image stream gathered after ``proj_out``. Neither has a
diffusers plan.
"""

from __future__ import annotations

from cp_lightning.models import PlanEntry, TinyCase, register
from cp_lightning.models.flux import BRIA, BRIA_TINY, _bria_inputs

LONGCAT = PlanEntry("LongCatImageTransformer2DModel", BRIA.plan)
OVIS = PlanEntry("OvisImageTransformer2DModel", BRIA.plan)

register(
    LONGCAT,
    OVIS,
    TinyCase(
        "longcat-image", "LongCatImageTransformer2DModel", dict(BRIA_TINY, pooled_projection_dim=32), _bria_inputs
    ),
    TinyCase("ovis-image", "OvisImageTransformer2DModel", dict(BRIA_TINY, out_channels=16), _bria_inputs),
)

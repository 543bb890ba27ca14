"""OmniGen: refused. Its attention is causal over the multimodal condition sequence (text, input-image and time
tokens, as in the Phi-3 it starts from), bidirectional only inside each input image and within the output image
(``OmniGenProcessor.create_mask``, handed to the model as a (B, S, S) mask). A rank cannot apply its block of such a
per-query mask without the rows and columns the other ranks hold, so no split of the sequence is exact (the same
reason as SkyReels-V2's block-causal refusal in wan.py).
"""

from __future__ import annotations

from cp_lightning.models import PlanEntry, register

OMNIGEN = PlanEntry(
    "OmniGenTransformer2DModel",
    None,
    refuse=lambda model: (
        "its attention mask is causal over the condition tokens and bidirectional inside images (one row per "
        "query, built by OmniGenProcessor), which context parallelism cannot split exactly; train it without CP "
        "(cp=1) until block-causal masks are supported"
    ),
)

register(OMNIGEN)

"""Models that context parallelism cannot make exact, refused with the reason before any collective.

A refusal is a plan entry without a plan: ``parallelize(model, cp=...)`` raises a ValueError saying why,
rather than training on silently different gradients.
"""

from __future__ import annotations

from cp_lightning.models import PlanEntry, register


def _always(reason: str):
    return lambda _model: reason


# HiDream's MoE feed-forward adds a load-balancing loss in training, (mean gate score per expert) x (mean
# routed fraction per expert) over all tokens of the batch: a product of two sequence means, which is not a
# sum of per-shard terms, so no split of the tokens reproduces its gradient.
HIDREAM = PlanEntry(
    "HiDreamImageTransformer2DModel",
    None,
    refuse=_always(
        "its MoE load-balancing loss multiplies two means over the whole sequence (gate scores and routed "
        "fractions), which no sequence split reproduces exactly. Train without CP (cp=1)."
    ),
)

# Mochi: its processor drops each sample's padded text tokens and runs SDPA once per sample over [image,
# valid text]. Under CP each rank's count of valid text tokens comes from the mask, not from a split the
# plan records, so the peers' key lengths cannot be known (the ring and Ulysses exchanges need them).
# Exact in principle (as [image, text] attention with the padded text keys masked out), not routed yet.
MOCHI = PlanEntry(
    "MochiTransformer3DModel",
    None,
    refuse=_always(
        "its attention processor (MochiAttnProcessor2_0) removes each sample's padded text tokens and calls SDPA "
        "once per sample on [image, valid text], so the CP ranks' key lengths depend on the text mask and are "
        "not known to cp_lightning; train without CP (cp=1) until its processor is routed."
    ),
)

register(HIDREAM, MOCHI)

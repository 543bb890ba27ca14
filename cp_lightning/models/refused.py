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

register(HIDREAM)

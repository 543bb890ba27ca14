"""The layout planner: per-GPU memory, traffic and relative step time of CP training layouts, and a search.

``python -m cp_lightning.plan --model NAME --gpus N --gpu-memory GIB --tokens T ...`` (``cli.py``);
:func:`plan` is the same search from Python (the strategy's ``cp="auto"`` and the recipes' dry run use it).
"""

from cp_lightning.planner.architectures import CONFIGS, ModelSpec, resolve_model
from cp_lightning.planner.memory import Estimate, Hardware, Layout, Training, estimate
from cp_lightning.planner.search import check_layout, nothing_fits, search, smallest_cp

__all__ = [
    "CONFIGS",
    "Estimate",
    "Hardware",
    "Layout",
    "ModelSpec",
    "Training",
    "check_layout",
    "estimate",
    "nothing_fits",
    "resolve_model",
    "search",
    "smallest_cp",
]

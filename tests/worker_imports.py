"""What every test worker imports, once per pytest run (tests/distributed.py preloads it in its fork server).

Workers fork from a server process that has imported these already, so a group of 4 ranks starts in a fraction
of a second instead of four interpreters importing torch, diffusers and Lightning side by side (about 10 s of a
2-core machine per group). Nothing here runs code beyond imports: each worker still starts from a clean state.
"""

from __future__ import annotations

import torch  # noqa: F401
import torch.distributed  # noqa: F401

import cp_lightning  # noqa: F401  (Lightning, Fabric and the engine)
import cp_lightning.accelerate  # noqa: F401
import cp_lightning.check  # noqa: F401
from cp_lightning.models import CASES


def _import_model_classes() -> None:
    """diffusers imports lazily: resolve every class the plan library builds."""
    import diffusers

    for case in CASES.values():
        if ":" not in case.cls:
            getattr(diffusers, case.cls)


_import_model_classes()

try:  # the recipes (tiny pipelines, transformers' text encoders, peft); absent from a bare library checkout
    import recipes.flux  # noqa: F401
    import recipes.flux_kontext  # noqa: F401
    import recipes.hunyuan  # noqa: F401
    import recipes.qwenimage  # noqa: F401
    import recipes.wan  # noqa: F401
    import recipes.wan_i2v  # noqa: F401
except ImportError:
    pass

import torch._dynamo  # noqa: E402,F401  (torch.compile's front end, imported on first use otherwise)

"""cp_lightning: exact context parallelism for training diffusion transformers.

Public entry points: :func:`build_mesh` (the (dp, cp) device mesh) and :func:`parallelize`
(split/gather hooks plus context-parallel attention on a diffusers model); :func:`to_fp8_base` stores a
LoRA run's frozen base in float8 (:mod:`cp_lightning.fp8`).
"""

import importlib

# Public names are imported on first use (PEP 562), so that ``import cp_lightning`` does not import
# cp_lightning.plan: ``python -m cp_lightning.plan`` (the planner) would otherwise run a second copy of a module
# already imported, which runpy warns about.
_EXPORTS = {
    "CPMismatchError": "cp_lightning.checks",
    "ContextParallelStrategy": "cp_lightning.strategy",
    "FP8Linear": "cp_lightning.fp8",
    "FabricContextParallelStrategy": "cp_lightning.strategy",
    "Unsplit": "cp_lightning.plan",
    "build_mesh": "cp_lightning.mesh",
    "compile_blocks": "cp_lightning.compilation",
    "fp8_weight_error": "cp_lightning.fp8",
    "loss_shard": "cp_lightning.parallelize",
    "parallelize": "cp_lightning.parallelize",
    "quantize_fp8": "cp_lightning.fp8",
    "remove": "cp_lightning.parallelize",
    "to_fp8_base": "cp_lightning.fp8",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")  # a submodule, as ``cp_lightning.ring``
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "CPMismatchError",
    "ContextParallelStrategy",
    "FP8Linear",
    "FabricContextParallelStrategy",
    "Unsplit",
    "build_mesh",
    "compile_blocks",
    "fp8_weight_error",
    "loss_shard",
    "parallelize",
    "quantize_fp8",
    "remove",
    "to_fp8_base",
]
__version__ = "0.1.0"

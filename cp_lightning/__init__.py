"""cp_lightning: exact context parallelism for training diffusion transformers.

Public entry points: :func:`build_mesh` (the (dp, cp) device mesh) and :func:`parallelize`
(split/gather hooks plus context-parallel attention on a diffusers model).
"""

from cp_lightning.checks import CPMismatchError
from cp_lightning.compilation import compile_blocks
from cp_lightning.mesh import build_mesh
from cp_lightning.parallelize import loss_shard, parallelize, remove
from cp_lightning.plan import Unsplit
from cp_lightning.strategy import ContextParallelStrategy, FabricContextParallelStrategy

__all__ = [
    "CPMismatchError",
    "ContextParallelStrategy",
    "FabricContextParallelStrategy",
    "Unsplit",
    "build_mesh",
    "compile_blocks",
    "loss_shard",
    "parallelize",
    "remove",
]
__version__ = "0.1.0"

"""``ContextParallelStrategy(cp="auto")``: the planner picks cp (and ring) at set-up, in every process alike.

It runs in ``setup_environment``, before the mesh exists, from what every rank already has: the LightningModule
(its ``planner_model()``, a built-in name, a config path or a :class:`ModelSpec`, and its hyperparameters
``lora_rank``, ``gradient_checkpointing``, ``weights_dtype``, ``ema_decay``), the strategy's FSDP options, and
the sample sizes: the ``tokens=`` hint, else the data module's bucket table (``plan()`` and ``tokens(bucket)``
as the recipes' data modules have). The GPU memory is the ``gpu_memory=`` hint or the device's own. The choice
is the smallest cp that fits (the fastest ring among those); nothing fitting is a ValueError saying what the
leanest layout would need. The computation is deterministic, so every rank picks the same layout.

With ``dynamic_cp=True`` and no ``min_tokens_per_rank`` it supplies that threshold the same way
(:func:`dynamic_min_tokens`) when it can tell the memory budget.
"""

from __future__ import annotations

import logging

import torch

from cp_lightning.planner.architectures import ModelSpec, resolve_model
from cp_lightning.planner.memory import GIB, Estimate, Hardware, Layout, Training, estimate
from cp_lightning.planner.search import nothing_fits, search, smallest_cp

log = logging.getLogger(__name__)


def _model(module) -> ModelSpec:
    ask = getattr(module, "planner_model", None)
    if ask is None:
        raise ValueError(
            f"cp='auto' needs the model's full-size config: give {type(module).__name__} a planner_model() method "
            "returning a built-in name (python -m cp_lightning.plan --help lists them) or a config.json path, or "
            "set cp to a number."
        )
    spec = ask()
    return spec if isinstance(spec, ModelSpec) else resolve_model(str(spec))


def _tokens(datamodule) -> tuple[list[int], int | None]:
    """(split tokens per bucket, text tokens split with them or None) from the data module's bucket table."""
    if datamodule is None or not hasattr(datamodule, "plan") or not hasattr(datamodule, "tokens"):
        raise ValueError(
            "cp='auto' needs the sample sizes: pass tokens=[...] (tokens per sample, one per bucket) to "
            "ContextParallelStrategy, or use a data module with plan() and tokens(bucket) (the recipes' do)."
        )
    datamodule.plan(cp=1)
    pairs = [datamodule.tokens(_Bucket(row)) for row in datamodule.table]
    texts = {t for _, t in pairs}
    return [s for s, _ in pairs], (max(texts) or None)


def _gpu_memory(strategy, hint: float | None) -> float:
    if hint is not None:
        return float(hint)
    device = strategy.root_device
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    raise ValueError(f"cp='auto' on {device.type}: give gpu_memory=GIB (the memory budget per process).")


def choose(strategy, *, tokens: list[int] | None, gpu_memory: float | None) -> Estimate:
    """The layout for ``strategy`` (a ContextParallelStrategy whose module and data are attached)."""
    module = strategy.lightning_module
    trainer = getattr(module, "_trainer", None)
    spec = _model(module)
    text = None
    if tokens is None:
        tokens, text = _tokens(getattr(trainer, "datamodule", None))
    training, base, checkpointing = _training(module)
    world = strategy.num_processes * strategy.num_nodes
    hw = Hardware(gpus=world, gpu_memory_gib=_gpu_memory(strategy, gpu_memory), nodes=strategy.num_nodes)
    fsdp = strategy.fsdp_options
    estimates = search(
        spec,
        hw,
        training,
        list(tokens),
        batch=int(getattr(getattr(trainer, "datamodule", None), "hparams", {}).get("batch_size", 1)),
        text_tokens=text,
        fsdp="on" if fsdp is not None else "off",
        checkpointing="on" if checkpointing else "off",
        base_dtype=base,
    )
    # the strategy runs what it was given: its own HSDP choice, no activation offload
    sharding = ("hsdp" if fsdp.hsdp else "full") if fsdp is not None else "off"
    own = [e for e in estimates if not e.layout.offload and (e.layout.fsdp == sharding or e.layout.dp == 1)]
    chosen = smallest_cp(own)
    if chosen is None:
        raise ValueError(f"cp='auto': {nothing_fits(own or estimates, hw)}")
    return chosen


def _training(module) -> tuple[Training, str, bool]:
    """(what trains, the frozen base's dtype, gradient checkpointing) from the module's hyperparameters."""
    h = dict(getattr(module, "hparams", {}))
    lora = int(h.get("lora_rank", 0))
    base = str(h.get("weights_dtype", "bfloat16")) if lora else "bfloat16"
    return Training(lora_rank=lora, ema=bool(h.get("ema_decay", 0.0))), base, bool(h.get("gradient_checkpointing"))


def most_tokens_per_rank(spec: ModelSpec, layout: Layout, hw: Hardware, training: Training) -> int:
    """The most tokens per sample that ``layout`` fits at batch 1 (0: not even one token)."""

    def fits(tokens: int) -> bool:
        return estimate(spec, layout, hw, training, tokens).fits

    if not fits(1):
        return 0
    low, high = 1, 1024
    while fits(high) and high < 1 << 24:
        low, high = high, high * 2
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def dynamic_min_tokens(strategy, *, gpu_memory: float | None) -> int | None:
    """``min_tokens_per_rank`` for ``dynamic_cp`` from the planner: one more than half the most tokens a rank fits
    at degree 1, so each step runs at the smallest degree at which the planner predicts its samples fit (the
    planner's time model puts the same compute per sample at every degree and CP traffic on top, so the smallest
    fitting degree is the fastest). None where the planner cannot tell: no ``planner_model()``, no memory budget
    (CPU without ``gpu_memory=``), or a model whose states alone do not fit."""
    module = getattr(strategy, "lightning_module", None)
    if getattr(module, "planner_model", None) is None:
        return None
    try:
        budget = _gpu_memory(strategy, gpu_memory)
    except ValueError:
        return None
    training, base, checkpointing = _training(module)
    world = strategy.num_processes * strategy.num_nodes
    hw = Hardware(gpus=world, gpu_memory_gib=budget, nodes=strategy.num_nodes)
    sharding = "full" if strategy.fsdp_options is not None else "off"
    # a step at degree c holds the states of the whole run's layout and 1/c of each sample's activations
    layout = Layout(world, 1, fsdp=sharding, checkpointing=checkpointing, base_dtype=base)
    most = most_tokens_per_rank(_model(module), layout, hw, training)
    return most // 2 + 1 if most else None


def describe(e: Estimate, budget: float) -> str:
    gib = e.as_dict()["gib"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in gib.items())
    return f"cp='auto' chose {e.layout.describe()}: predicted {e.gib_per_gpu:.2f} of {budget:g} GiB per GPU ({parts})"


class _Bucket:
    def __init__(self, row: dict) -> None:
        self.frames, self.height, self.width = row["frames"], row["height"], row["width"]

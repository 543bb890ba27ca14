"""The plan library: where each diffusers transformer class is split and gathered, keyed by class name.

One module per model family holds its :class:`PlanEntry` (the plan, with a comment on every split point
saying why it is there, or the reason the model is refused) beside its :class:`TinyCase` rows (a
scaled-down config and matching inputs that ``python -m cp_lightning.check`` and tests/test_library.py
build). :func:`plan_for` is what ``parallelize(model, cp=...)`` calls when no ``plan=`` is given: our
entry when the library has one, else diffusers' ``_cp_plan``, else a ValueError naming the checker.
Adding a model touches one family module and one test row, nothing in the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["DIFFUSERS", "PlanEntry", "TinyCase", "PLANS", "CASES", "plan_for", "has_plan", "lookup"]

# Sentinel plan: the class's own diffusers ``_cp_plan``, checked by our tests and kept as it is.
DIFFUSERS = "diffusers"

PLAN_FORMAT = (
    "A plan is a dict {module_path: {forward_arg: ContextParallelInput(split_dim=..., expected_dims=...)} | "
    "ContextParallelOutput(gather_dim=..., expected_dims=...)} ('' is the model itself, '*' every item of a "
    'ModuleList), e.g. {"": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)}, '
    '"proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}'
)


@dataclass(frozen=True)
class PlanEntry:
    """How one diffusers class is made context parallel.

    ``plan``: a plan dict, :data:`DIFFUSERS` (the class's own ``_cp_plan``), or a function of the model's
    config returning a plan (for plans that name the last block, whose index depends on the config).
    ``refuse``: a function of the model returning why it cannot be exact (a ValueError is raised with
    it), or None when it can; a plan of None with a refusal refuses every instance. ``loss_parallel``:
    why the plan's outputs cannot stay sharded, when a rule of the engine cannot see it (refused then).
    ``install``: hooks the model needs beyond splits, gathers and routing (SkyReels-V2 diffusion forcing
    hands its blocks a mask spec), a function of the model returning their ``RemovableHandle``s;
    ``parallelize`` calls it last, when it uses this entry, and ``remove`` removes them. ``head_tail``: the
    install hooks call ``parallelize.set_layout`` before every forward's first split, so the entry supports
    ``parallelize(..., layout="head_tail")``.
    """

    cls: str
    plan: Mapping | str | Callable | None
    refuse: Callable[[nn.Module], str | None] | None = None
    needs: str = ""  # engine feature the plan relies on, for docs/models.md
    loss_parallel: str = ""  # why ``loss_parallel=True`` cannot work with this plan ("": it can)
    install: Callable[[nn.Module], list[RemovableHandle]] | None = None
    head_tail: bool = False

    def resolve(self, model: nn.Module) -> Mapping:
        reason = self.refuse(model) if self.refuse is not None else None
        if reason is not None:
            raise ValueError(f"{type(model).__name__} cannot be made exactly context parallel: {reason}")
        if self.plan == DIFFUSERS:
            return type(model)._cp_plan
        if callable(self.plan):
            return self.plan(model.config)
        assert self.plan is not None, f"{self.cls}: an entry without a plan must refuse"
        return self.plan


@dataclass(frozen=True)
class TinyCase:
    """A scaled-down instance of ``cls`` and its inputs: one row of the parity tests and of the checker.

    ``inputs(model, generator, batch, tokens, text_tokens, dtype)`` returns the forward kwargs for
    ``tokens`` image/video tokens after patching. ``experts`` > 1 builds that many instances (Wan2.2
    A14B's high- and low-noise experts) trained together. ``unused``: parameter name prefixes that
    get no gradient from these inputs (and why, in the entry's comment). ``tokens``: the token count this
    case always runs at, for a model that takes only some counts (blocks of frames); None: the caller's.
    ``setup``: called on each built instance, what a pipeline does to the model before running it (Flux.2
    Klein KV's pipeline sets the KV processors); None: nothing.
    """

    name: str
    cls: str
    config: Mapping
    inputs: Callable
    experts: int = 1
    unused: tuple[str, ...] = ()
    text_tokens: int = 7
    note: str = ""
    tokens: int | None = None
    setup: Callable[[nn.Module], None] | None = None


PLANS: dict[str, PlanEntry] = {}
CASES: dict[str, TinyCase] = {}


def register(*items: PlanEntry | TinyCase) -> None:
    for item in items:
        table = PLANS if isinstance(item, PlanEntry) else CASES
        key = item.cls if isinstance(item, PlanEntry) else item.name
        assert key not in table, f"duplicate library entry {key}"
        table[key] = item


def lookup(module: nn.Module) -> PlanEntry | None:
    """The library entry for ``module``'s class (or the nearest base class with one)."""
    for klass in type(module).__mro__:
        if klass.__name__ in PLANS:
            return PLANS[klass.__name__]
    return None


def has_plan(module: nn.Module) -> bool:
    """Whether :func:`plan_for` would find a plan (or a refusal) for ``module``."""
    return lookup(module) is not None or bool(getattr(module, "_cp_plan", None))


def plan_for(module: nn.Module) -> Mapping:
    """The plan ``parallelize`` uses when none is passed: ours, else diffusers' ``_cp_plan``, else an error."""
    entry = lookup(module)
    if entry is not None:
        return entry.resolve(module)
    plan = getattr(module, "_cp_plan", None)
    if plan:
        return plan
    raise ValueError(
        f"{type(module).__name__} has no diffusers `_cp_plan` and no entry in cp_lightning's plan library, so "
        f"cp_lightning does not know where to split its sequence. Pass plan=... . {PLAN_FORMAT}. Check a plan "
        "before training with `python -m cp_lightning.check CLASS_OR_CONFIG --plan module:attr` "
        "(see docs/models.md)."
    )


# one module per model family; each registers its entries when imported
FAMILIES = (
    *("wan", "flux", "chroma", "qwenimage", "zimage", "minimax"),
    *("hunyuan", "sd3", "kandinsky", "ltx", "helios", "sana", "cogview", "lumina", "cosmos", "mochi", "hidream"),
    *("cogvideo", "easyanimate", "allegro", "framepack", "anyflow", "wan_animate", "latte", "motif"),
    *("kandinsky6", "sana_wm"),
    *("auraflow", "bria_fibo", "fluxlike", "flux3", "dit", "ernie", "hunyuan_image", "ideogram", "joyimage"),
    *("omnigen", "prx", "krea", "nucleus"),
    *("qwenimage21", "flux2_kv"),
)


def _load() -> None:
    import importlib

    for family in FAMILIES:
        importlib.import_module(f"cp_lightning.models.{family}")


_load()

"""Plan resolution: a plan's entries bound to the modules they name and checked against them, without touching
any process group; the plan-only input specs (:class:`JointInput`, :class:`PerTokenInput`, :class:`Unsplit`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from torch import nn

_EXAMPLE = (
    'plan={"": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)}, '
    '"proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}'
)


@dataclass(frozen=True)
class ResolvedEntry:
    """One plan entry bound to the concrete modules it names (several for a ``*`` path)."""

    path: str
    modules: tuple[tuple[str, nn.Module], ...]
    spec: object
    # gathers: no split is expected after this one (module order; checked while running). Loss-parallel
    # mode leaves exactly these sharded.
    terminal: bool = True


@dataclass(frozen=True, repr=False)
class JointInput(ContextParallelInput):
    """A tensor laid out along ``split_dim`` as the concatenation of sequences the plan splits apart.

    E.g. HunyuanVideo's key mask over [image, text], built in ``forward`` from the full lengths, while
    the plan splits image and text tokens separately: rank r's joint sequence is [image_r, text_r], so
    its mask must be [mask_image_r, mask_text_r], not the r-th chunk of the whole mask. ``segments``
    names the split arguments (in order) whose full lengths give the segments' sizes; each must be split
    by the plan before this tensor is (earlier in the forward, or earlier in the same entry). Each
    segment is then split like its argument and this rank's pieces are concatenated.
    """

    segments: tuple[str, ...] = field(default=())

    def __repr__(self) -> str:
        return f"JointInput(split_dim={self.split_dim}, expected_dims={self.expected_dims}, segments={self.segments})"


@dataclass(frozen=True, repr=False)
class PerTokenInput(ContextParallelInput):
    """A tensor that is per token when it has ``expected_dims`` dims and per sample when it has fewer.

    E.g. SkyReels-V2's block modulation: (B, 6, S, C) under diffusion forcing, (B, 6, C) otherwise. The
    per-token form is split along ``split_dim``; a per-sample form passes whole (there is no sequence
    to split), where a plain ContextParallelInput would refuse the unexpected number of dims.
    """

    def __repr__(self) -> str:
        return f"PerTokenInput(split_dim={self.split_dim}, expected_dims={self.expected_dims})"


@dataclass(frozen=True)
class Unsplit:
    """Plan marker ``{path: Unsplit()}``: the module runs on full, replicated tokens (e.g. a text refiner
    before the split). Its attention modules keep their own processors, whatever they are, and attend
    locally with no CP communication. Attention that runs before the first split or after a gather is
    found without it (routing.py); declare modules whose processor cp_lightning cannot route."""


def unsplit_paths(entries: Sequence[ResolvedEntry]) -> tuple[str, ...]:
    """The module paths a resolved plan declares :class:`Unsplit`."""
    return tuple(name for entry in entries if isinstance(entry.spec, Unsplit) for name, _ in entry.modules)


def default_plan(module: nn.Module) -> Mapping:
    """The plan library's entry for ``module``'s class, else its diffusers ``_cp_plan`` (see cp_lightning.models)."""
    from cp_lightning.models import plan_for

    return plan_for(module)


def _find_modules(root: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    if path == "":
        return [("", root)]
    if path.count("*") > 1:
        raise ValueError(f"plan path {path!r}: '*' may appear only once.")
    head, star, tail = path.partition("*")
    head = head.rstrip(".")
    tail = tail.lstrip(".")
    try:
        base = root.get_submodule(head) if head else root
    except AttributeError:
        raise ValueError(
            f"plan path {path!r} names no submodule of {type(root).__name__}: {head!r} is missing. "
            "Check the path against model.named_modules()."
        ) from None
    if not star:
        return [(head, base)]
    if not isinstance(base, nn.ModuleList):
        raise ValueError(f"plan path {path!r}: '*' must follow a ModuleList, but {head!r} is a {type(base).__name__}.")
    found = []
    for index, item in enumerate(base):
        name = f"{head}.{index}" if head else str(index)
        try:
            found.append((f"{name}.{tail}" if tail else name, item.get_submodule(tail) if tail else item))
        except AttributeError:
            raise ValueError(f"plan path {path!r} names no submodule: {name}.{tail} is missing.") from None
    return found


def _check_inputs(path: str, module: nn.Module, spec: Mapping) -> None:
    params = inspect.signature(module.forward).parameters
    for key, value in spec.items():
        # a list of specs is per item of a sequence argument; None leaves that item whole
        items = [item for item in value if item is not None] if isinstance(value, (list, tuple)) else [value]
        if not items or not all(isinstance(item, ContextParallelInput) for item in items):
            raise TypeError(
                f"plan entry {path!r}[{key!r}] must be a ContextParallelInput or a list of them, got {value!r}."
            )
        if any(isinstance(item, PerTokenInput) and item.expected_dims is None for item in items):
            raise ValueError(f"plan entry {path!r}[{key!r}]: a PerTokenInput needs expected_dims (its per-token form).")
        if isinstance(key, int):
            if not all(item.split_output for item in items):
                raise ValueError(
                    f"plan entry {path!r}[{key}]: an integer key names an output, so it needs split_output=True."
                )
        elif isinstance(key, str):
            if any(item.split_output for item in items):
                raise ValueError(
                    f"plan entry {path!r}[{key!r}]: split_output=True needs an integer key (the output's index), "
                    "not an argument name."
                )
            if key not in params:
                raise ValueError(
                    f"plan entry {path!r} splits argument {key!r}, but {type(module).__name__}.forward takes "
                    f"{list(params)}. Fix the argument name in the plan."
                )
        else:
            raise TypeError(
                f"plan entry {path!r}: keys must be argument names (str) or output indices (int), got {key!r}."
            )


def resolve_plan(module: nn.Module, plan: Mapping | None) -> list[ResolvedEntry]:
    """Validate ``plan`` (default: ``module._cp_plan``) against ``module``; no communication."""
    plan = default_plan(module) if plan is None else plan
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"plan must be a non-empty dict of module path -> spec, e.g. {_EXAMPLE}; got {plan!r}.")
    entries, has_gather = [], False
    for path, spec in plan.items():
        if not isinstance(path, str):
            raise TypeError(f"plan keys are submodule paths (str), got {path!r}.")
        found = _find_modules(module, path)
        if isinstance(spec, Unsplit):
            pass
        elif isinstance(spec, Mapping):
            for name, sub in found:
                _check_inputs(name or "<root>", sub, spec)
        else:
            outs = spec if isinstance(spec, (list, tuple)) else [spec]
            if not all(out is None or isinstance(out, ContextParallelOutput) for out in outs):
                raise TypeError(
                    f"plan entry {path!r} must be a dict of inputs, a ContextParallelOutput or a list of them, or "
                    f"Unsplit(); got {spec!r}."
                )
            has_gather = True
        entries.append(ResolvedEntry(path, tuple(found), spec))
    if not has_gather:
        raise ValueError(
            "the plan gathers nothing back (no ContextParallelOutput), so outputs would stay split; add one at "
            'the last sharded module, e.g. "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3).'
        )
    return _mark_terminal(module, entries)


def _mark_terminal(root: nn.Module, entries: list[ResolvedEntry]) -> list[ResolvedEntry]:
    """Predict which gathers no split follows, from the modules' registration order.

    A module's pre-hook runs at its start and its output hooks at its end, after its children; the
    root's split comes first and its gather last. diffusers registers a model's modules in the order
    its forward runs them (the prediction is checked at run time, see ``SplitState.split``).
    """
    order = {id(sub): i for i, (_, sub) in enumerate(root.named_modules(remove_duplicate=False))}
    end = {id(sub): max(order[id(m)] for m in sub.modules()) for sub in root.modules()}
    splits = []
    for entry in entries:
        if isinstance(entry.spec, Mapping):
            for _, sub in entry.modules:
                if any(isinstance(key, str) for key in entry.spec):
                    splits.append(order[id(sub)])
                if any(isinstance(key, int) for key in entry.spec):
                    splits.append(end[id(sub)] + 0.5)
    last_split = max(splits, default=-1)
    marked = []
    for entry in entries:
        if not isinstance(entry.spec, (Mapping, Unsplit)):
            gathered_at = min(end[id(sub)] + 0.5 for _, sub in entry.modules)
            entry = ResolvedEntry(entry.path, entry.modules, entry.spec, terminal=gathered_at > last_split)
        marked.append(entry)
    return marked


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)  # their parent's code runs what follows them


def check_loss_parallel(root: nn.Module, entries: Sequence[ResolvedEntry]) -> None:
    """Refuse loss-parallel for plans whose last gather hands its output back to a block's own code.

    Loss-parallel leaves the terminal gathers' outputs sharded, which is exact when what follows them
    runs per token up to the loss (Flux: ``norm_out``/``proj_out``; SkyReels: the last block of the
    list). A terminal gather inside a block that also splits (Helios's plan splits and gathers around
    each part of every block) returns a shard to that block, which adds it to the whole, replicated
    tokens: a shape error deep in the model's code. ``root``'s own gather is always fine.
    """
    modules = dict(root.named_modules(remove_duplicate=False))
    splits = [
        name
        for entry in entries
        if isinstance(entry.spec, Mapping) and any(isinstance(key, str) for key in entry.spec)
        for name, _ in entry.modules
    ]
    for entry in entries:
        if isinstance(entry.spec, (Mapping, Unsplit)) or not entry.terminal:
            continue
        for name, _ in entry.modules:
            block = name.rpartition(".")[0] if name else ""
            while block and isinstance(modules[block], _CONTAINERS):
                block = block.rpartition(".")[0]
            inside = [path for path in splits if block and path.startswith(block + ".")]
            if inside:
                raise ValueError(
                    f"loss_parallel leaves the last gather, at {name!r}, sharded, but {block!r} also splits "
                    f"({', '.join(repr(path) for path in inside[:3])}): its own code would combine the shard "
                    "with whole, replicated tokens. Train this plan without loss_parallel (the outputs are "
                    "gathered, and exact), or gather once, in the model's last per-token module."
                )

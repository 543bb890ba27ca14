"""CP plans: data that says where a model's sequence is split and where it is gathered back.

A plan uses diffusers' ``_cp_plan`` vocabulary::

    {module_path: {arg_name_or_output_index: ContextParallelInput | [ContextParallelInput, ...]}
                  | ContextParallelOutput | [ContextParallelOutput | None, ...]}

``""`` names the root module and ``*`` matches every item of a ModuleList. A string key names a
``forward`` argument (passed by keyword or by position) split before the call; an integer key names
an item of the module's output split after the call (``split_output=True``, e.g. RoPE tables).
:func:`resolve_plan` validates a plan against a module without touching any process group;
:func:`apply_plan` installs the hooks and :func:`remove_plan` takes them off again.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from torch import nn
from torch.utils.hooks import RemovableHandle

from cp_lightning import collectives
from cp_lightning.gradients import ScaleGrad, finish_forward
from cp_lightning.split_table import SplitState

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
        items = value if isinstance(value, (list, tuple)) else [value]
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
    its forward runs them (the prediction is checked at run time, see ``_note_split``).
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


def _split(x: torch.Tensor, spec: ContextParallelInput, group, where: str, check=None, state=None) -> torch.Tensor:
    if x.dim() <= spec.split_dim:
        # The entry does not apply to this form of the input, e.g. Wan's plan splits a per-token
        # timestep (B, S) and is handed a per-sample one (B,): there is no sequence to split.
        return x
    if spec.expected_dims is not None and x.dim() != spec.expected_dims:
        raise ValueError(
            f"{where}: expected a {spec.expected_dims}-d tensor to split along dim {spec.split_dim}, got shape "
            f"{tuple(x.shape)}. Pass inputs in the layout the model documents, or fix expected_dims in the plan."
        )
    if state is not None:
        state._note_split(where)
        group = state.group  # the current CP group (dynamic CP rebinds it between steps: cp_lightning.dynamic)
    try:
        local = collectives.shard(x, spec.split_dim, group)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if check is not None:  # after the local validation above: a user mistake never reaches a collective
        check(where, x)
    if state is not None:
        state.record_split(where, x.shape[spec.split_dim])
    return local


def _split_value(value, spec, group, where: str, check=None, state=None):
    if isinstance(value, torch.Tensor):
        if isinstance(spec, (list, tuple)):
            raise TypeError(f"{where}: the plan has a list of {len(spec)} specs but the value is a single tensor.")
        return _split(value, spec, group, where, check, state)
    if isinstance(value, (list, tuple)):
        specs = spec if isinstance(spec, (list, tuple)) else [spec] * len(value)
        if len(specs) != len(value):
            raise ValueError(f"{where}: the plan has {len(specs)} specs for a sequence of {len(value)} values.")
        out = [
            _split(v, s, group, f"{where}[{i}]", check, state) if isinstance(v, torch.Tensor) else v
            for i, (v, s) in enumerate(zip(value, specs, strict=True))
        ]
        return type(value)(out)
    raise TypeError(f"{where}: cannot split a {type(value).__name__}; the plan expects tensors here.")


def _split_inputs_hook(name: str, spec: Mapping, group, module: nn.Module, check=None, state=None) -> Callable:
    params = list(inspect.signature(module.forward).parameters)
    by_name = {key: value for key, value in spec.items() if isinstance(key, str)}

    # joint tensors last: their segments' lengths are recorded while the other arguments are split
    order = sorted(by_name, key=lambda arg: isinstance(by_name[arg], JointInput))

    def split(value, arg):
        arg_spec, where = by_name[arg], f"{name or '<root>'}({arg})"
        if isinstance(arg_spec, JointInput):
            return _split_joint(value, arg_spec, group, where, check, state)
        if isinstance(arg_spec, PerTokenInput) and isinstance(value, torch.Tensor):
            if value.dim() < arg_spec.expected_dims:
                return value  # the per-sample form: nothing to split
        joint = state is not None and state.joint  # only JointInput plans read the full lengths
        if joint and isinstance(value, torch.Tensor) and value.dim() > arg_spec.split_dim:
            state.record_length(arg, value.shape[arg_spec.split_dim])
        return _split_value(value, arg_spec, group, where, check, state)

    def record_whole(args, kwargs):
        # (B, S, ...) tensors the hook leaves whole: see SplitState.record_whole
        named = {**dict(zip(params, args, strict=False)), **kwargs}
        for arg, value in named.items():
            if arg not in by_name and isinstance(value, torch.Tensor) and value.dim() >= 3:
                state.record_whole(f"{name or '<root>'}({arg})", value.shape[1])

    def hook(_module, args, kwargs):
        if state is not None:
            record_whole(args, kwargs)
        args = list(args)
        for arg in order:
            if arg in kwargs:
                if kwargs[arg] is not None:
                    kwargs[arg] = split(kwargs[arg], arg)
            else:
                index = params.index(arg)
                if index < len(args) and args[index] is not None:
                    args[index] = split(args[index], arg)
        return tuple(args), kwargs

    return hook


def _split_joint(x, spec: JointInput, group, where: str, check=None, state=None) -> torch.Tensor:
    """Split each segment of a :class:`JointInput` like its argument; concatenate this rank's pieces."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: a JointInput splits one tensor, got a {type(x).__name__}.")
    if spec.expected_dims is not None and x.dim() != spec.expected_dims:
        raise ValueError(f"{where}: expected a {spec.expected_dims}-d tensor, got shape {tuple(x.shape)}.")
    lengths = {} if state is None else {seg: state.full_length(seg) for seg in spec.segments}
    missing = [seg for seg in spec.segments if lengths.get(seg) is None]
    if missing:
        raise ValueError(
            f"{where}: JointInput segments {missing} were not split before it; split those arguments earlier in "
            "the plan (an earlier module, or the same entry)."
        )
    sizes = [lengths[seg] for seg in spec.segments]
    if sum(sizes) != x.shape[spec.split_dim]:
        raise ValueError(
            f"{where}: dim {spec.split_dim} has {x.shape[spec.split_dim]} elements, but its segments "
            f"{dict(zip(spec.segments, sizes, strict=True))} add up to {sum(sizes)}."
        )
    if state is not None:
        state._note_split(where)
        group = state.group
    if check is not None:
        check(where, x)
    world = dist.get_world_size(group)
    if state is not None:  # each rank holds its share of every segment
        per_segment = [collectives.chunk_sizes(size, world) for size in sizes]
        state.record_sizes(where, [sum(column) for column in zip(*per_segment, strict=True)])
    return torch.cat(
        [collectives.shard(part, spec.split_dim, group) for part in x.split(sizes, spec.split_dim)], spec.split_dim
    )


def _split_outputs_hook(name: str, spec: Mapping, group, state=None) -> Callable:
    by_index = {key: value for key, value in spec.items() if isinstance(key, int)}

    def hook(module, _args, output):
        single = isinstance(output, torch.Tensor)
        items = [output] if single else list(output)
        sharded = None if state is None else state.sharded
        for index, item_spec in by_index.items():
            if index >= len(items):
                raise ValueError(
                    f"{name}: the plan splits output {index}, but the module returned {len(items)} outputs."
                )
            items[index] = _split_value(items[index], item_spec, group, f"{name}->output[{index}]", state=state)
        if state is not None and next(module.parameters(), None) is None:
            # a parameter-free module's outputs are position tables (RoPE), not tokens: attention that runs
            # next (HunyuanVideo's text refiner, after its rope) is still outside the split region
            state.set_sharded(sharded)
        return items[0] if single else type(output)(items)

    return hook


def _gather_hook(name: str, spec, group, state: SplitState, gather: bool) -> Callable:
    """Gather the outputs the plan names; with ``gather=False`` (loss-parallel) keep them sharded.

    The gathers' backward follows the current forward's rule (gradients.py).

    Loss-parallel and uneven shards: each rank's loss is a mean over its own S_r of the S tokens, and
    DDP averages the ranks' gradients. The full-sequence mean weighs rank r by S_r / S, not 1 / cp,
    so the root outputs' gradients are scaled by cp * S_r / S (1 when the shards are even; at the
    root, not here, since replicated tensors such as the time embedding reach the loss around the
    gather too).
    """
    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]

    def hook(_module, _args, output):
        single = isinstance(output, torch.Tensor)
        items = [output] if single else list(output)
        if len(items) != len(specs):
            raise ValueError(f"{name}: the plan gathers {len(specs)} outputs, but the module returned {len(items)}.")
        for i, out_spec in enumerate(specs):
            if out_spec is None:
                continue
            x = items[i]
            if out_spec.expected_dims is not None and x.dim() != out_spec.expected_dims:
                raise ValueError(
                    f"{name}->output[{i}]: expected a {out_spec.expected_dims}-d tensor to gather along dim "
                    f"{out_spec.gather_dim}, got shape {tuple(x.shape)}."
                )
            lengths = None if state.even else state.lengths_of(x, out_spec.gather_dim, f"{name}->output[{i}]")
            if gather:
                items[i] = collectives.gather(x, out_spec.gather_dim, state.group, record=state.record, lengths=lengths)
                continue
            weight = 1.0
            if lengths is not None:
                weight = len(lengths) * x.shape[out_spec.gather_dim] / sum(lengths)
            record = state.record
            if record is None:
                items[i] = ScaleGrad.apply(x, weight) if weight != 1.0 else x
            elif not record.closed:
                record.note_skipped(name, weight)
        if gather:
            state.set_sharded(False)
        return items[0] if single else type(output)(items)

    return hook


def apply_plan(
    entries: Sequence[ResolvedEntry],
    group: dist.ProcessGroup,
    *,
    check: Callable | None = None,
    gather: bool = True,
    state: SplitState | None = None,
    root: nn.Module | None = None,
) -> list[RemovableHandle]:
    """Install the split and gather hooks of a resolved plan; returns the handles to remove them.

    ``check(where, tensor)`` is called on each full input before it is split (see checks.py);
    ``gather=False`` leaves the terminal gathers' outputs sharded (loss-parallel training); ``state``
    records whether every split so far was even (see :class:`SplitState`; a fresh one when omitted).
    ``root``: the module the plan was resolved against; its forward hooks pick each pass's gradient
    rule (gradients.py). Without it the gathers hand back their slice, exact only for terminal gathers.
    """
    state = SplitState(group) if state is None else state
    state.joint = any(
        isinstance(value, JointInput)
        for entry in entries
        if isinstance(entry.spec, Mapping)
        for value in entry.spec.values()
    )
    handles = []
    for entry in entries:
        if isinstance(entry.spec, Unsplit):
            continue  # routing.py leaves its attention alone
        for name, sub in entry.modules:
            if isinstance(entry.spec, Mapping):
                if any(isinstance(key, str) for key in entry.spec):
                    hook = _split_inputs_hook(name, entry.spec, group, sub, check, state)
                    handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
                if any(isinstance(key, int) for key in entry.spec):
                    handles.append(sub.register_forward_hook(_split_outputs_hook(name, entry.spec, group, state)))
            else:
                hook = _gather_hook(name, entry.spec, group, state, gather or not entry.terminal)
                handles.append(sub.register_forward_hook(hook))
    if root is not None:
        handles.append(root.register_forward_pre_hook(lambda *_: state.begin_forward(not gather), prepend=True))
        handles.append(root.register_forward_hook(lambda _m, _a, out: finish_forward(out, state.record, state.world)))
    return handles


def remove_plan(handles: Sequence[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()

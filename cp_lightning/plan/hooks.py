"""The hooks a resolved plan installs: split before a module (inputs) or after it (outputs), gather after it; each
hook is one function here. A hook tells the split state (cp_lightning.split_table.SplitState) of its event in one
call (``start_pass``, ``split``, ``gather``, ``end_pass``), then moves the tensors (cp_lightning.collectives)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from diffusers.models._modeling_parallel import ContextParallelInput
from torch import nn
from torch.utils.hooks import RemovableHandle

from cp_lightning import collectives
from cp_lightning.gradients import ScaleGrad
from cp_lightning.plan.resolve import JointInput, PerTokenInput, ResolvedEntry, Unsplit
from cp_lightning.split_table import SplitState


def _split(
    x: torch.Tensor, spec: ContextParallelInput, group, where: str, check=None, state=None, arg=None, opens=True
) -> torch.Tensor:
    if x.dim() <= spec.split_dim:
        # The entry does not apply to this form of the input, e.g. Wan's plan splits a per-token
        # timestep (B, S) and is handed a per-sample one (B,): there is no sequence to split.
        return x
    if spec.expected_dims is not None and x.dim() != spec.expected_dims:
        raise ValueError(
            f"{where}: expected a {spec.expected_dims}-d tensor to split along dim {spec.split_dim}, got shape "
            f"{tuple(x.shape)}. Pass inputs in the layout the model documents, or fix expected_dims in the plan."
        )
    layout = None
    if state is not None:
        state.split(where, x.shape[spec.split_dim], arg=arg, opens=opens)
        group = state.group  # the current CP group (dynamic CP rebinds it between steps: cp_lightning.dynamic)
        layout = state.layout  # head_tail: tokens, RoPE rows and per-token inputs of its length follow its runs
    try:
        local = collectives.shard(x, spec.split_dim, group, layout)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if check is not None:  # after the local validation above: a user mistake never reaches a collective
        check(where, x)
    return local


def _split_value(value, spec, group, where: str, check=None, state=None, arg=None, opens=True):
    if spec is None:  # an item the plan leaves whole (Allegro's RoPE frequency tables beside its split positions)
        return value
    if isinstance(value, torch.Tensor):
        if isinstance(spec, (list, tuple)):
            raise TypeError(f"{where}: the plan has a list of {len(spec)} specs but the value is a single tensor.")
        return _split(value, spec, group, where, check, state, arg, opens)
    if isinstance(value, Mapping):  # a dict of tensors (AnyFlow's {"query": ..., "key": ...} RoPE): each value
        return type(value)(
            {k: _split_value(v, spec, group, f"{where}[{k!r}]", check, state, opens=opens) for k, v in value.items()}
        )
    if isinstance(value, (list, tuple)):
        specs = spec if isinstance(spec, (list, tuple)) else [spec] * len(value)
        if len(specs) != len(value):
            raise ValueError(f"{where}: the plan has {len(specs)} specs for a sequence of {len(value)} values.")
        # nested sequences are split item by item with their spec (JoyImage's rope: ((cos, sin), (cos, sin) | None))
        out = [
            _split_value(v, s, group, f"{where}[{i}]", check, state, opens=opens)
            if isinstance(v, (torch.Tensor, list, tuple))
            else v
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
        return _split_value(value, arg_spec, group, where, check, state, arg)

    def pass_whole(args, kwargs):
        # (B, S, ...) tensors the hook leaves whole: see SplitState.record_whole
        named = {**dict(zip(params, args, strict=False)), **kwargs}
        for arg, value in named.items():
            if arg not in by_name and isinstance(value, torch.Tensor) and value.dim() >= 3:
                state.split(f"{name or '<root>'}({arg})", value.shape[1], whole=True)

    def hook(_module, args, kwargs):
        if state is not None:
            pass_whole(args, kwargs)
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
    lengths = {} if state is None else {seg: state.full_length(seg) for seg in spec.segments}  # recorded by split
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
        state.split(where, sizes)
        group = state.group
    if check is not None:
        check(where, x)
    return torch.cat(
        [collectives.shard(part, spec.split_dim, group) for part in x.split(sizes, spec.split_dim)], spec.split_dim
    )


def _split_outputs_hook(name: str, spec: Mapping, group, state=None) -> Callable:
    by_index = {key: value for key, value in spec.items() if isinstance(key, int)}

    def hook(module, _args, output):
        single = isinstance(output, torch.Tensor)
        items = [output] if single else list(output)
        # a parameter-free module's outputs are position tables (RoPE), not tokens: attention that runs next
        # (HunyuanVideo's text refiner, after its rope) is still outside the split region
        opens = next(module.parameters(), None) is not None
        for index, item_spec in by_index.items():
            if index >= len(items):
                raise ValueError(
                    f"{name}: the plan splits output {index}, but the module returned {len(items)} outputs."
                )
            where = f"{name}->output[{index}]"
            items[index] = _split_value(items[index], item_spec, group, where, state=state, opens=opens)
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
            lengths = state.gather(f"{name}->output[{i}]", x, out_spec.gather_dim, closes=gather)
            if gather:
                items[i] = collectives.gather(
                    x, out_spec.gather_dim, state.group, record=state.record, lengths=lengths, layout=state.layout
                )
                continue
            weight = 1.0
            if lengths is not None:
                weight = len(lengths) * x.shape[out_spec.gather_dim] / sum(lengths)
            record = state.record
            if record is None:
                items[i] = ScaleGrad.apply(x, weight) if weight != 1.0 else x
            elif not record.closed:
                record.note_skipped(name, weight)
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
        handles.append(root.register_forward_pre_hook(lambda *_: state.start_pass(not gather), prepend=True))
        handles.append(root.register_forward_hook(lambda _m, _a, out: state.end_pass(out)))
    return handles


def remove_plan(handles: Sequence[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()

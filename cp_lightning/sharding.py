"""FSDP2 over the dp x cp mesh, and what a sharded model is exported and checked with.

:func:`apply_fsdp` shards each parallelized module of a model (``fully_shard`` per repeated block plus the
module itself) over the flattened dp x cp mesh, or HSDP (shard over cp, replicate over dp), with the
gradient divided by dp (dp x cp in loss-parallel mode) and sum-only reductions on gloo: the gradient math
of :mod:`cp_lightning.data_parallel`, where the adapters call it from. :func:`full_state_dict`,
:func:`export_pretrained` and :func:`export_lora` consolidate a sharded model for export;
:func:`check_checkpoint_layout` reads a sharded checkpoint's metadata before any collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cp_lightning.data_parallel import plan_targets
from cp_lightning.mesh import CP, DP, warm_groups

__all__ = [
    "FSDPOptions",
    "fsdp_options",
    "fsdp_blocks",
    "block_units",
    "check_fsdp_compile",
    "check_fsdp_model",
    "is_sharded",
    "apply_fsdp",
    "full_state_dict",
    "export_pretrained",
    "write_pretrained",
    "lora_state_dict",
    "export_lora",
    "check_checkpoint_layout",
]


UNITS = ("blocks", "children")


@dataclass(frozen=True)
class FSDPOptions:
    """How :func:`apply_fsdp` shards a model (the adapters build it from their own arguments).

    Args:
        reshard_after_forward: free each block's gathered parameters after its forward and gather them
            again in backward (less memory, one more all-gather per block).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory (the optimizer
            step runs on the CPU).
        hsdp: shard inside each CP group and replicate across dp (gathers stay inside a node when CP
            groups do) instead of sharding over the whole dp x cp world.
        blocks: class names of the repeated blocks, one FSDP unit each; by default the model's diffusers
            ``_repeated_blocks`` (or ``_no_split_modules``).
        units: ``"blocks"``: one FSDP unit per block (a block's parameters are gathered together);
            ``"children"``: one unit per direct submodule of each block that holds parameters (attention,
            feed-forward, norms; the elements of a ModuleList child), plus the block for its own parameters.
            Smaller gathers (a Flux double block's largest child is 2/9 of it) for more, smaller
            collectives: the lever when a gathered block is what does not fit (docs/memory.md). Each child
            must be called through its ``forward`` (FSDP gathers in its hooks); not with ``compile=``, which
            compiles whole blocks with ``fullgraph=True``.
        param_dtype: dtype parameters are gathered in for compute (bf16 mixed precision); gradients are
            reduced in float32 whenever it is set.
    """

    reshard_after_forward: bool = True
    cpu_offload: bool = False
    hsdp: bool = False
    blocks: tuple[str, ...] | None = None
    param_dtype: torch.dtype | None = None
    units: str = "blocks"

    def __post_init__(self) -> None:
        for name in ("reshard_after_forward", "cpu_offload", "hsdp"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.blocks is not None:
            if isinstance(self.blocks, str) or not all(isinstance(b, str) for b in self.blocks):
                raise TypeError(f"fsdp_blocks must be a list of block class names, got {self.blocks!r}.")
            object.__setattr__(self, "blocks", tuple(self.blocks))
            if not self.blocks:
                raise ValueError("fsdp_blocks is empty; name the block classes to shard, or leave it unset.")
        if self.units not in UNITS:
            raise ValueError(f"fsdp_units must be one of {list(UNITS)}, got {self.units!r}.")


def fsdp_options(
    fsdp: bool,
    *,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    hsdp: bool = False,
    blocks: Sequence[str] | None = None,
    units: str = "blocks",
) -> FSDPOptions | None:
    """The adapters' keyword arguments -> :class:`FSDPOptions` (or None for DDP); refuses FSDP-only options
    without ``fsdp=True`` rather than ignoring them."""
    if not isinstance(fsdp, bool):
        raise TypeError(f"fsdp must be True or False, got {fsdp!r}.")
    if not fsdp:
        given = {"hsdp": hsdp, "cpu_offload": cpu_offload, "fsdp_blocks": blocks}
        given["reshard_after_forward=False"] = not reshard_after_forward
        given[f"fsdp_units={units!r}"] = units != "blocks"
        used = [k for k, v in given.items() if v]
        if used:
            raise ValueError(f"{', '.join(used)} only apply with fsdp=True; pass fsdp=True or drop them.")
        return None
    return FSDPOptions(reshard_after_forward, cpu_offload, hsdp, blocks, units=units)


def check_fsdp_compile(options: FSDPOptions | None, compile_options: dict | None) -> None:
    """``fsdp_units="children"`` puts FSDP's gather hooks inside each block, which ``compile=`` traces whole
    with ``fullgraph=True``: refused at construction."""
    if options is not None and options.units == "children" and compile_options is not None:
        raise ValueError(
            "fsdp_units='children' shards inside each block, and compile= compiles whole blocks with "
            "fullgraph=True (FSDP's gathers would break the graph); use fsdp_units='blocks' with compile=, or "
            "drop compile= to shard blocks' children."
        )


def block_units(block: nn.Module) -> list[nn.Module]:
    """The FSDP units inside ``block`` under ``fsdp_units="children"``: each direct submodule that holds
    parameters, the elements of a ModuleList or ModuleDict child in its place (containers have no forward
    to hook)."""
    units = []
    for child in block.children():
        if next(child.parameters(), None) is None:
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += block_units(child)
        else:
            units.append(child)
    return units


def fsdp_blocks(target: nn.Module, names: Sequence[str] | None) -> list[nn.Module]:
    """The repeated blocks of ``target`` that become one FSDP unit each (no collectives)."""
    default = getattr(target, "_repeated_blocks", None) or getattr(target, "_no_split_modules", None)
    names = tuple(names or default or ())
    blocks = [m for m in target.modules() if type(m).__name__ in names and m is not target]
    if not blocks:
        lists = [n for n, m in target.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
        looked = f"looked for {list(names)}" if names else "it has no diffusers `_repeated_blocks`"
        raise ValueError(
            f"fsdp=True found no repeated blocks to shard in {type(target).__name__} ({looked}); name the block "
            "classes with fsdp_blocks=['MyBlock', ...] (one FSDP unit each)"
            + (f"; its module lists are {lists}." if lists else ".")
        )
    return blocks


def check_fsdp_model(root: nn.Module, plan: Mapping | None, options: FSDPOptions) -> None:
    """Everything :func:`apply_fsdp` needs, checked without collectives (a ValueError on every rank alike)."""
    targets = plan_targets(root, plan)
    covered = set()
    for _, module, _ in targets:
        fsdp_blocks(module, options.blocks)
        covered |= {id(p) for p in module.parameters()}
    outside = [n for n, p in root.named_parameters() if p.requires_grad and id(p) not in covered]
    if outside:
        raise ValueError(
            f"fsdp=True shards the parallelized modules ({', '.join(n or '<root>' for n, _, _ in targets)}), but "
            f"trainable parameters lie outside them: {outside[:4]}{' ...' if len(outside) > 4 else ''}. Freeze them, "
            "move them into the transformer, or train with DDP (fsdp=False)."
        )


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` or one of its submodules was sharded by ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def apply_fsdp(
    root: nn.Module,
    *,
    mesh: DeviceMesh,
    plan: Mapping | None,
    options: FSDPOptions,
    loss_parallel: bool,
    dynamic_cp: bool = False,
) -> nn.Module:
    """Shard every parallelized module of ``root`` with FSDP2, in place (after :func:`parallelize_targets`
    and activation checkpointing). Returns ``root``.

    Gradient math: FSDP's reduce-scatter sums over its mesh and divides by a factor. Each CP rank's
    gradient is its shard's part, so the exact factor is dp (SUM over cp, MEAN over dp); FSDP's default
    (the mesh size, dp x cp) is cp times too small. In loss-parallel mode each rank's loss covers its
    own shard and dp x cp is exact. Under dynamic CP each rank's loss is already its share of the step's
    sum_i l_i / W (:mod:`cp_lightning.dynamic`) and the factor is 1. The factor is set on every FSDP unit
    (``set_gradient_divide_factor`` is not recursive). gloo has no PREMUL_SUM (and its AVG is unreliable),
    so there the reductions are forced to plain sums with a separate division.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    check_fsdp_model(root, plan, options)
    dp, cp = mesh[DP].size(), mesh[CP].size()
    shard_mesh = mesh if options.hsdp else _flat_mesh(mesh)
    mp = MixedPrecisionPolicy()
    if options.param_dtype is not None:
        # inputs keep their dtype (ids, timesteps, rotary tables stay fp32); compute runs under the
        # framework's autocast, reductions in fp32
        mp = MixedPrecisionPolicy(options.param_dtype, torch.float32, cast_forward_inputs=False)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if options.cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=shard_mesh, mp_policy=mp, offload_policy=offload)
    for _, target, _ in plan_targets(root, plan):
        if is_sharded(target):
            continue
        for block in fsdp_blocks(target, options.blocks):
            for unit in block_units(block) if options.units == "children" else ():
                fully_shard(unit, reshard_after_forward=options.reshard_after_forward, **kwargs)
            fully_shard(block, reshard_after_forward=options.reshard_after_forward, **kwargs)
        # the root's parameters are needed first in backward: keep them gathered after forward
        fully_shard(target, reshard_after_forward=False, **kwargs)
    factor = 1.0 if dynamic_cp else float(dp * cp if loss_parallel else dp)
    force_sum = dist.get_backend(shard_mesh.get_group(0)) == "gloo"
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(factor)
            if force_sum:
                module.set_force_sum_reduction_for_comms(True)
    return root


_FLAT: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}


def _flat_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dp x cp mesh flattened to one axis (created once per mesh: flattening is collective-free but
    registers a name). Its group is warmed here, in set-up, so NCCL does not connect it at FSDP's first
    all-gather (every rank shards the same modules, so every rank gets here)."""
    if id(mesh) not in _FLAT:
        flat = mesh[(DP, CP)]._flatten(f"{DP}_{CP}")
        warm_groups([flat.get_group()], mesh.device_type)
        _FLAT[id(mesh)] = (mesh, flat)
    return _FLAT[id(mesh)][1]


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated (unsharded) state dict of ``module`` on CPU: every rank calls it (collective for a
    sharded model), rank 0 gets the tensors (other ranks an empty dict). A plain module's own state dict."""
    if not is_sharded(module):
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_pretrained(module: nn.Module, directory, max_shard_size: str = "10GB") -> None:
    """Write a (possibly sharded) diffusers model as a diffusers folder (``config.json`` and
    ``diffusion_pytorch_model*.safetensors``) that ``from_pretrained`` reads, without cp_lightning.
    Every rank calls it (the state is gathered collectively); rank 0 writes."""
    state = full_state_dict(module)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    write_pretrained(module, state, directory, max_shard_size)


def write_pretrained(module: nn.Module, state: dict, directory, max_shard_size: str = "10GB") -> None:
    """The local half of :func:`export_pretrained`: ``module``'s config and the consolidated ``state``."""
    import json
    from pathlib import Path

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    module.save_config(directory)
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="diffusion_pytorch_model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n].contiguous() for n in names}, directory / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def lora_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The peft LoRA weights of a (possibly sharded) diffusers model, consolidated, keys without the adapter
    name (what ``save_lora_weights`` takes). Every rank calls it; rank 0 gets the tensors, others ``{}``."""
    from peft.utils import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    # only the trainable tensors are consolidated (sharded LoRA tensors are DTensors save_lora_weights cannot
    # write): gathering the frozen base too would cost its full size on rank 0, and gloo cannot gather float8
    sharded = is_sharded(module)
    state = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            state[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
    if sharded and dist.get_rank() != 0:
        return {}
    return get_peft_model_state_dict(module, state_dict=state)


def export_lora(module: nn.Module, directory, pipeline_class=None) -> None:
    """Write the LoRA weights as ``pytorch_lora_weights.safetensors`` (keys ``transformer.*``), as
    ``pipeline_class.save_lora_weights`` does (used when given). Every rank calls it; rank 0 writes."""
    from pathlib import Path

    state = lora_state_dict(module)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    directory = Path(directory)
    if pipeline_class is not None:
        pipeline_class.save_lora_weights(directory, transformer_lora_layers=state, safe_serialization=True)
        return
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {f"transformer.{k}": v.contiguous() for k, v in state.items()}
    save_file(state, directory / "pytorch_lora_weights.safetensors", metadata={"format": "pt"})


def check_checkpoint_layout(
    path, module: nn.Module, dp_size: int, prefix: str = "state_dict.", *, strict: bool = True
) -> None:
    """Check, before any collective, that the sharded checkpoint at ``path`` can be resharded into ``module``
    at a data-parallel degree of ``dp_size``: every tensor present with its global shape (``strict=False``, a
    light checkpoint: every trainable parameter; frozen ones may be left out, they come from the pretrained
    weights), and an RNG state for every dp rank. A full (single-file) checkpoint passes: it is broadcast from
    rank 0 whatever the layout."""
    from pathlib import Path

    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if path.is_file():
        return
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a torch.distributed.checkpoint directory (it has no .metadata file).")
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    problems = []
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    for name, tensor in module.state_dict().items():
        key = prefix + name
        if key not in saved:
            if strict or name in trainable:
                problems.append(f"{name} is missing" + ("" if strict else " (a trainable parameter)"))
        elif hasattr(saved[key], "size") and tuple(saved[key].size) != tuple(tensor.shape):
            problems.append(f"{name} has shape {tuple(saved[key].size)}, the model {tuple(tensor.shape)}")
    if problems:
        raise ValueError(
            f"the checkpoint {path} cannot be resharded into this model ({len(problems)} tensors differ: "
            f"{'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}). Resume with the model configuration "
            "it was saved from (any dp x cp layout, FSDP or HSDP, works)."
        )
    meta = path / "meta.pt"
    if meta.is_file():
        states = torch.load(meta, weights_only=False, map_location="cpu").get("cp_lightning", {}).get("rng_states")
        if states and any(r not in states for r in range(dp_size)):
            raise ValueError(
                f"the checkpoint {path} holds RNG states for dp ranks {sorted(states)}, but this run has dp ranks "
                f"0..{dp_size - 1}; resume with a dp degree of at most {len(states)} (the weights and optimizer "
                "reshard to any layout; the per-dp-rank noise streams cannot be invented)."
            )

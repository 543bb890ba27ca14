"""Loading a diffusers transformer without any rank holding more of it than it keeps.

A 12-14B transformer is 28 GB in bf16 and 56 GB in the fp32 files the official Wan weights ship as; eight
ranks of a node each calling ``from_pretrained`` and converting dtypes need 400-670 GB of host memory at
start-up. The sequence here never materialises more than one tensor (one slice of one, under FSDP) at a time:

1. :func:`empty_model`: the model built from its ``config.json`` on the meta device (buffers such as rotary
   tables stay real), per-parameter dtypes as ``from_pretrained`` gives them (its ``_keep_in_fp32_modules``
   included), and the folder it comes from recorded on it. LoRA layers, fp8 conversion and
   :func:`cp_lightning.parallelize` all work on it there.
2. The adapters (Lightning, Fabric, Accelerate) shard it with FSDP2 and then call :func:`materialize`: the
   meta tensors are allocated on the rank's device (``to_empty``, real buffers kept) and each rank reads only
   its own slices from the safetensors files (``safe_open(...).get_slice``; a file in the parameter's own
   dtype is memory-mapped, not copied), casting on the way in (fp8 weights quantized row by row). Under DDP
   the same call fills whole tensors, one at a time, straight onto the rank's device.
3. LoRA weights are not in the files: :func:`init_lora` draws each adapter from a generator seeded by
   (seed, module name), so every layout (one process, DDP, FSDP, HSDP) starts from the same values.

:func:`check_pretrained` validates the folder against the model (index, shard files, keys, shapes) from the
files' headers alone, with no collective: the adapters call it before the first one.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "SafetensorsFolder",
    "check_pretrained",
    "empty_model",
    "init_lora",
    "materialize",
    "move_unpending",
    "pending",
]

_SOURCE = "_cp_lightning_pretrained"
# peft's adapter tensors (LoRA, DoRA, LoKr): initialised after loading, never read from the base's files
_LORA = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_LORA += ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


@dataclass(frozen=True)
class PretrainedSource:
    """Where a meta-built model's weights come from, and the seed of its LoRA initialisation."""

    folder: str
    lora_seed: int | None = None


# -- the folder -------------------------------------------------------------------------------------
class SafetensorsFolder:
    """The tensors of a diffusers model folder: ``*.safetensors`` with an ``*.safetensors.index.json``
    (sharded) or one file. Reads headers only; ``where[key]`` is the file holding ``key``."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"{folder} is not a folder of safetensors weights (a diffusers model folder).")
        indexes = sorted(folder.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise ValueError(f"{folder} holds {len(indexes)} index files ({[i.name for i in indexes]}); keep one.")
        if indexes:
            weight_map = json.loads(indexes[0].read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{indexes[0]} has no 'weight_map' of tensor name -> shard file.")
            missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
            if missing:
                raise ValueError(
                    f"{indexes[0].name} names shard files that {folder} does not have: {missing[:3]}"
                    f"{' ...' if len(missing) > 3 else ''}. The download is incomplete: fetch the missing files."
                )
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if len(files) != 1:
                raise ValueError(
                    f"{folder} has {len(files)} safetensors files and no *.safetensors.index.json"
                    + (f" ({files[:3]})" if files else "")
                    + "; a diffusers model folder has one file, or an index naming its shards."
                )
        self.folder = folder
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            with safe_open(str(folder / name), "pt") as f:
                for key in f.keys():
                    self.where[key] = name
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())
        if indexes:
            stray = sorted(k for k, f in weight_map.items() if self.where.get(k) != f)
            if stray:
                raise ValueError(
                    f"{indexes[0].name} maps {stray[0]!r} to {weight_map[stray[0]]}, which does not hold it "
                    f"({len(stray)} such keys); the index and the shard files are from different downloads."
                )


def _source_key(name: str) -> str:
    """The checkpoint key of a parameter: peft's LoRA wrapper moves the base weight to ``*.base_layer.*``."""
    return name.replace(".base_layer.", ".")


def _is_lora(name: str) -> bool:
    return any(f".{part}." in f".{name}." for part in _LORA)


def _fp8_scale_name(module: nn.Module, name: str) -> bool:
    """Whether ``name`` is the per-channel scale of an fp8 frozen weight (computed while loading, not read)."""
    owner, _, leaf = name.rpartition(".")
    return leaf == "weight_scale" and hasattr(module.get_submodule(owner) if owner else module, "weight_scale")


def _expected(module: nn.Module) -> dict[str, torch.Tensor]:
    """name -> tensor for every parameter and persistent buffer the files must provide."""
    tensors = dict(module.named_parameters())
    skip = set()
    for mod_name, mod in module.named_modules():
        skip |= {f"{mod_name}.{b}" if mod_name else b for b in mod._non_persistent_buffers_set}
    tensors.update({n: b for n, b in module.named_buffers() if n not in skip})
    return {n: t for n, t in tensors.items() if not _is_lora(n) and not _fp8_scale_name(module, n)}


def check_pretrained(module: nn.Module, folder: str | Path | None = None) -> SafetensorsFolder:
    """Check, from the files' headers and without collectives, that ``folder`` (by default the one
    :func:`empty_model` recorded) holds every weight of ``module`` with its shape. Returns the folder's index."""
    folder = folder or getattr(module, _SOURCE).folder
    files = SafetensorsFolder(folder)
    problems = []
    for name, tensor in _expected(module).items():
        key = _source_key(name)
        if key not in files.where:
            problems.append(f"{key!r} is missing")
        elif files.shapes[key] != tuple(tensor.shape):
            problems.append(
                f"{key!r} in {files.where[key]} has shape {files.shapes[key]}, the model {tuple(tensor.shape)}"
            )
    if problems:
        raise ValueError(
            f"the weights in {folder} do not match {type(module).__name__}'s config ({len(problems)} tensors: "
            f"{'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}). Load the folder with the config "
            "saved beside it (config.json), or pass the matching config."
        )
    return files


# -- building on meta -------------------------------------------------------------------------------
def empty_model(
    model_class, folder: str | Path, *, dtype: torch.dtype | None = None, subfolder: str | None = None, **config
):
    """``model_class`` (a diffusers model) built from ``folder``'s config on the meta device, its parameters
    in ``dtype`` as ``from_pretrained(..., torch_dtype=dtype)`` would give them (modules the class keeps in
    fp32 stay fp32), and the folder recorded for :func:`materialize`. ``config`` overrides config values."""
    from accelerate import init_empty_weights

    folder = Path(folder) / subfolder if subfolder else Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json: point at a diffusers model folder (or its parent + subfolder).")
    cfg = {**model_class.load_config(str(folder)), **config}
    with init_empty_weights(include_buffers=False):
        model = model_class.from_config(cfg)
    if dtype is not None:
        keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
        for name, param in model.named_parameters():
            if param.is_floating_point() and not any(k in name.split(".") for k in keep):
                param.data = param.data.to(dtype)
    setattr(model, _SOURCE, PretrainedSource(str(folder)))
    return model.train()


def pending(root: nn.Module) -> list[nn.Module]:
    """The modules of ``root`` built by :func:`empty_model` whose weights are still to be loaded."""
    return [m for m in root.modules() if getattr(m, _SOURCE, None) is not None]


def move_unpending(root: nn.Module, device: torch.device | str) -> None:
    """``root.to(device)`` for everything but the modules still to be loaded (``.to`` cannot copy a meta
    tensor; :func:`materialize` allocates those on their device itself)."""
    skip = {id(m) for m in pending(root)}

    def visit(module: nn.Module) -> None:
        if id(module) in skip:
            return
        module._apply(lambda t: t.to(device), recurse=False)
        for child in module.children():
            visit(child)

    visit(root)


# -- filling the tensors ----------------------------------------------------------------------------
def _local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of this rank's part of ``tensor``: all of a plain tensor, the local shard of a DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tuple(tensor.shape), (0,) * tensor.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _read(handle, key: str, shape, offset) -> torch.Tensor:
    """This rank's region of ``key`` (a memory-mapped view where the file's layout allows)."""
    if any(n == 0 for n in shape):
        return torch.empty(shape)
    full = handle.get_slice(key)
    if tuple(shape) == tuple(full.get_shape()):
        return handle.get_tensor(key)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def _allocate(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s meta tensors on ``device`` (``to_empty``: FSDP re-registers its shards), keeping
    the values of every tensor that was already real (rotary tables and other computed buffers)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    real = {n: _local(t).detach().clone() for n, t in tensors.items() if not t.is_meta}
    module.to_empty(device=device)
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    with torch.no_grad():
        for name, value in real.items():
            if name in tensors:
                _local(tensors[name]).copy_(value)


@torch.no_grad()
def load_weights(module: nn.Module, files: SafetensorsFolder, device: torch.device) -> None:
    """Fill every expected tensor of ``module`` (allocated; plain or FSDP-sharded) from ``files``: each rank
    reads its own region of each tensor, one at a time, cast to the tensor's dtype (fp8 weights quantized
    per output channel, their ``weight_scale`` written beside them)."""
    from safetensors import safe_open

    expected = _expected(module)
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(files.where[_source_key(name)], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(files.folder / file), "pt") as handle:
            for name in names:
                target = expected[name]
                shape, offset = _local_region(target)
                value = _read(handle, _source_key(name), shape, offset)
                local = _local(target)
                if local.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    _load_fp8(module, name, local, value)
                elif local.device.type == "cpu" and value.dtype == local.dtype and not _is_dtensor(target):
                    target.data = value  # memory-mapped, copy-on-write: no anonymous copy on the host
                else:
                    local.copy_(_on_device(value, local.device))  # copy_ casts where both tensors are


def _on_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` on ``device`` in its file dtype: casting (and fp8 quantization) then runs on the accelerator.
    ``value.to(device=cuda, dtype=...)`` would cast on the host first, one slow pass over every weight there."""
    return value.to(device)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _load_fp8(module: nn.Module, name: str, local: torch.Tensor, value: torch.Tensor) -> None:
    """Quantize this rank's rows of a high-precision weight into the fp8 parameter and its row scales (FSDP
    shards rows, so the scale of a row is computed from data the rank holds)."""
    from cp_lightning.fp8 import quantize_fp8

    owner = module.get_submodule(name.rpartition(".")[0])
    q, scale = quantize_fp8(_on_device(value, local.device).to(torch.float32), local.dtype)
    local.copy_(q)
    scale_local = _local(owner.weight_scale)
    if scale_local.shape == scale.shape:
        scale_local.copy_(scale.to(scale_local))
    else:  # a full scale buffer beside a row-sharded weight: this rank's rows of it
        _, offset = _local_region(getattr(owner, name.rpartition(".")[2]))
        scale_local[offset[0] : offset[0] + scale.shape[0]].copy_(scale.to(scale_local))


def materialize(root: nn.Module, device: torch.device | str | None = None) -> list[nn.Module]:
    """Load every module of ``root`` that :func:`empty_model` built: allocate it on ``device`` (after FSDP
    sharding: only the local shards), read its weights from the recorded folder, initialise its LoRA layers.
    No collectives; returns the modules loaded."""
    loaded = []
    for module in pending(root):
        source: PretrainedSource = getattr(module, _SOURCE)
        files = check_pretrained(module, source.folder)
        target_device = torch.device(device) if device is not None else torch.device("cpu")
        _allocate(module, target_device)
        load_weights(module, files, target_device)
        setattr(module, _SOURCE, None)
        if source.lora_seed is not None:
            init_lora(module, source.lora_seed)
        loaded.append(module)
    return loaded


# -- LoRA -------------------------------------------------------------------------------------------
@torch.no_grad()
def init_lora(module: nn.Module, seed: int) -> None:
    """Initialise every peft LoRA adapter of ``module`` as peft's ``init_lora_weights="gaussian"`` does
    (A ~ N(0, 1/r), B = 0; a DoRA magnitude from the base weight's row norms; LoKr as :func:`_init_lokr`), each
    from a generator seeded by (``seed``, the layer's name): the values do not depend on the order layers are
    visited, the device, or how FSDP shards them (each rank writes its own slice of the same full tensor). On a
    module :func:`empty_model` built and not yet loaded, the seed is recorded and :func:`materialize` initialises
    the adapters after loading the weights."""
    from peft.tuners.lokr import LoKrLayer
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor import DTensor, distribute_tensor

    source = getattr(module, _SOURCE, None)
    if source is not None:
        setattr(module, _SOURCE, PretrainedSource(source.folder, seed))
        return
    for name, layer in module.named_modules():
        if isinstance(layer, LoKrLayer):
            _init_lokr(layer, name, seed)
            continue
        if not isinstance(layer, LoraLayer):
            continue
        for adapter, lora_a in layer.lora_A.items():
            generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            weight = lora_a.weight
            full = torch.empty(weight.shape, dtype=torch.float32)
            full.normal_(0.0, 1.0 / layer.r[adapter], generator=generator)
            if isinstance(weight, DTensor):
                full = distribute_tensor(full, weight.device_mesh, weight.placements, src_data_rank=None)
            _local(weight).copy_(_local(full).to(weight.dtype))
            _local(layer.lora_B[adapter].weight).zero_()
            for bias in (lora_a.bias, layer.lora_B[adapter].bias):
                if bias is not None:
                    _local(bias).zero_()
            if layer.use_dora.get(adapter):
                _init_dora_magnitude(layer, adapter)


def _init_dora_magnitude(layer, adapter: str) -> None:
    """DoRA's magnitude: the row norms of the base weight (B = 0, so the adapted weight is the base one), as peft
    computes it. FSDP2 shards the weight and the magnitude alike on dim 0, so each rank's rows give its shard."""
    from torch.distributed.tensor import DTensor

    weight = layer.get_base_layer().weight
    magnitude = layer.lora_magnitude_vector[adapter].weight
    if isinstance(weight, DTensor) and not (
        isinstance(magnitude, DTensor) and weight.placements == magnitude.placements
    ):
        weight = weight.full_tensor()  # (a collective: every rank visits the layers in the same order)
    norms = torch.linalg.norm(_local(weight).float(), dim=1)  # out, in -> out
    if isinstance(magnitude, DTensor) and not isinstance(weight, DTensor):
        from torch.distributed.tensor import distribute_tensor

        norms = distribute_tensor(norms, magnitude.device_mesh, magnitude.placements, src_data_rank=None)
    _local(magnitude).copy_(_local(norms).to(magnitude.dtype))


def _init_lokr(layer, name: str, seed: int) -> None:
    """peft's LoKr init (the first Kronecker factor zero, so the update starts at 0; the others kaiming-uniform
    with a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in))), each tensor drawn from a generator seeded by
    (``seed``, layer name, tensor name) like :func:`init_lora`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for attr in layer.adapter_layer_names:
        for adapter, param in getattr(layer, attr).items():
            key = f"{name}.{attr}.{adapter}".encode()
            generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key)) % 2**63)
            full = torch.zeros(param.shape, dtype=torch.float32)
            if attr not in ("lokr_w1", "lokr_w1_a"):
                fan_in = param.shape[1] * int(torch.tensor(param.shape[2:]).prod()) if param.ndim > 1 else 1
                bound = 1.0 / fan_in**0.5
                full.uniform_(-bound, bound, generator=generator)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            _local(param).copy_(_local(full).to(param.dtype))

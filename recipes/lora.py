"""LoRA files: the diffusers format (``pipeline.load_lora_weights``) and ComfyUI's, with training metadata.

diffusers names a LoRA by the diffusers module it adapts (``transformer.transformer_blocks.0.attn.to_q
.lora_A.weight``). ComfyUI loads the names of the original checkpoints:

- Flux: the kohya / sd-scripts format, ``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``,
  ``.lora_up.weight`` and ``.alpha``. The original model fuses q, k, v (and, in single blocks, the MLP
  input) into one linear layer, so their LoRAs are fused too: the down matrices stacked (rank n x r) and
  the up matrix block-diagonal. That is exact, and it splits back exactly; a member without a LoRA gets a
  zero block (delta 0) so that every fused layer has whole blocks.
- Wan: ``diffusion_model.blocks.0.self_attn.q.lora_A.weight`` / ``lora_B`` / ``.alpha`` (ComfyUI's own).

Both carry ``.alpha`` = rank (scale 1, as trained). Training metadata (base model, rank, steps, ...) goes
into the safetensors header of either format, with kohya's ``ss_`` keys that ComfyUI-side tools show.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' file name
COMFYUI_NAME = "lora_comfyui.safetensors"
PEFT_NAME = "adapter_model.safetensors"  # peft's own layout, with adapter_config.json beside it
FORMATS = ("diffusers", "comfyui", "peft")
CONVERTIBLE = ("diffusers", "comfyui")  # what recipes.convert_lora converts between
# The formats each model.lora_type exports to. diffusers' load_lora_weights reads LoRA and DoRA (its
# lora_magnitude_vector keys) but no LoKr; the ComfyUI layouts here are kohya's / ComfyUI's LoRA names, and
# Flux's fused qkv / linear1 layers can take a stacked LoRA exactly but neither a DoRA (one norm per fused row
# over all members' updates) nor a Kronecker product. peft's format (load_peft) holds every variant.
VARIANT_FORMATS = {"lora": ("diffusers", "comfyui", "peft"), "dora": ("diffusers", "peft"), "lokr": ("peft",)}
COMFYUI_FAMILIES = ("flux", "wan", "wan_i2v", "skyreels_df", "hunyuan")  # families with a ComfyUI layout below
BASE_MODEL_VERSIONS = {
    "flux": "flux1",
    "wan": "wan",
    "wan_i2v": "wan",
    "skyreels_df": "wan",  # SkyReels-V2 is Wan's architecture
    "hunyuan": "hunyuan_video",
    "qwenimage": "qwen_image",
    "qwenimage21": "qwen_image_2_1",
}  # kohya's ss_base_model_version

# Flux: diffusers module (under a block) -> (original layer, member index, members of the fused layer)
_FLUX_DOUBLE = {
    "attn.to_q": ("img_attn_qkv", 0, 3),
    "attn.to_k": ("img_attn_qkv", 1, 3),
    "attn.to_v": ("img_attn_qkv", 2, 3),
    "attn.to_out.0": ("img_attn_proj", 0, 1),
    "attn.add_q_proj": ("txt_attn_qkv", 0, 3),
    "attn.add_k_proj": ("txt_attn_qkv", 1, 3),
    "attn.add_v_proj": ("txt_attn_qkv", 2, 3),
    "attn.to_add_out": ("txt_attn_proj", 0, 1),
    "ff.net.0.proj": ("img_mlp_0", 0, 1),
    "ff.net.2": ("img_mlp_2", 0, 1),
    "ff_context.net.0.proj": ("txt_mlp_0", 0, 1),
    "ff_context.net.2": ("txt_mlp_2", 0, 1),
    "norm1.linear": ("img_mod_lin", 0, 1),
    "norm1_context.linear": ("txt_mod_lin", 0, 1),
}
_FLUX_SINGLE = {
    "attn.to_q": ("linear1", 0, 4),
    "attn.to_k": ("linear1", 1, 4),
    "attn.to_v": ("linear1", 2, 4),
    "proj_mlp": ("linear1", 3, 4),
    "proj_out": ("linear2", 0, 1),
    "norm.linear": ("modulation_lin", 0, 1),
}
_FLUX_BLOCKS = {
    "transformer_blocks": ("double_blocks", _FLUX_DOUBLE),
    "single_transformer_blocks": ("single_blocks", _FLUX_SINGLE),
}
# Flux modules outside the blocks -> kohya layer names
_FLUX_TOP = {"proj_out": "final_layer_linear", "x_embedder": "img_in", "context_embedder": "txt_in"}
# HunyuanVideo: the original checkpoint's layer names as musubi-tuner writes them (kohya's lora_unet_ keys,
# which ComfyUI reads): Flux's double/single layout, its MLPs named fc1/fc2, and the text token refiner
_HUNYUAN_DOUBLE = {
    **{k: v for k, v in _FLUX_DOUBLE.items() if "mlp" not in v[0] and "mod" not in v[0]},
    "ff.net.0.proj": ("img_mlp_fc1", 0, 1),
    "ff.net.2": ("img_mlp_fc2", 0, 1),
    "ff_context.net.0.proj": ("txt_mlp_fc1", 0, 1),
    "ff_context.net.2": ("txt_mlp_fc2", 0, 1),
    "norm1.linear": ("img_mod_linear", 0, 1),
    "norm1_context.linear": ("txt_mod_linear", 0, 1),
}
_HUNYUAN_SINGLE = {**_FLUX_SINGLE, "norm.linear": ("modulation_linear", 0, 1)}
_HUNYUAN_REFINER = {
    "attn.to_q": ("self_attn_qkv", 0, 3),
    "attn.to_k": ("self_attn_qkv", 1, 3),
    "attn.to_v": ("self_attn_qkv", 2, 3),
    "attn.to_out.0": ("self_attn_proj", 0, 1),
    "ff.net.0.proj": ("mlp_fc1", 0, 1),
    "ff.net.2": ("mlp_fc2", 0, 1),
    "norm_out.linear": ("adaLN_modulation_1", 0, 1),
}
_HUNYUAN_BLOCKS = {
    "transformer_blocks": ("double_blocks", _HUNYUAN_DOUBLE),
    "single_transformer_blocks": ("single_blocks", _HUNYUAN_SINGLE),
    "context_embedder.token_refiner.refiner_blocks": ("txt_in_individual_token_refiner_blocks", _HUNYUAN_REFINER),
}
_HUNYUAN_TOP = {"proj_out": "final_layer_linear", "context_embedder.proj_in": "txt_in_input_embedder"}
# families in kohya's layout (lora_unet_<layer>, fused layers stacked): their block lists and top-level modules
_KOHYA = {"flux": (_FLUX_BLOCKS, _FLUX_TOP), "hunyuan": (_HUNYUAN_BLOCKS, _HUNYUAN_TOP)}
# Wan: diffusers module -> original module
_WAN = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
_KEY = re.compile(r"^transformer\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def _modules(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """diffusers LoRA state -> {module path: {"A": down, "B": up}}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{key!r} is not a diffusers transformer LoRA key (transformer.<module>.lora_A/B.weight).")
        out.setdefault(match["module"], {})[match["ab"]] = value
    return out


def _unsupported(family: str, module: str) -> ValueError:
    return ValueError(
        f"the {family} LoRA adapts {module!r}, which has no ComfyUI name in recipes/lora.py; train LoRA on the "
        "attention and feed-forward layers (the defaults), or export in the diffusers format."
    )


def to_comfyui(state: dict[str, torch.Tensor], family: str, fused_dims: dict[str, list[int]] | None = None):
    """diffusers LoRA -> ComfyUI's names for ``family``. ``fused_dims`` gives the output sizes of the members
    of the fused layers of Flux and HunyuanVideo ({"qkv": [d, d, d], "linear1": [d, d, d, mlp]}); needed only
    for members without a LoRA."""
    modules = _modules(state)
    out: dict[str, torch.Tensor] = {}
    if family in ("wan", "wan_i2v", "skyreels_df"):  # I2V: the same blocks, with k_img/v_img; SkyReels-V2 is Wan
        for module, ab in modules.items():
            block, _, rest = module.partition(".")
            index, _, name = rest.partition(".")
            if block != "blocks" or name not in _WAN:
                raise _unsupported(family, module)
            base = f"diffusion_model.blocks.{index}.{_WAN[name]}"
            out[f"{base}.lora_A.weight"], out[f"{base}.lora_B.weight"] = ab["A"], ab["B"]
            out[f"{base}.alpha"] = torch.tensor(float(ab["A"].shape[0]))
        return out
    if family not in _KOHYA:
        raise ValueError(f"no ComfyUI format for family {family!r}; use the diffusers format.")
    blocks, top = _KOHYA[family]
    fused: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    sizes: dict[str, int] = {}
    for module, ab in modules.items():
        if module in top:
            target = f"lora_unet_{top[module]}"
            out[f"{target}.lora_down.weight"], out[f"{target}.lora_up.weight"] = ab["A"], ab["B"]
            out[f"{target}.alpha"] = torch.tensor(float(ab["A"].shape[0]))
            continue
        block = next((b for b in blocks if module.startswith(b + ".")), None)
        index, _, name = module.removeprefix(f"{block}.").partition(".")
        if block is None or not index.isdigit() or name not in blocks[block][1]:
            raise _unsupported(family, module)
        prefix, table = blocks[block]
        layer, member, n = table[name]
        target = f"lora_unet_{prefix}_{index}_{layer}"
        fused.setdefault(target, {})[member] = ab
        sizes[target] = n
    for target, members in fused.items():
        n = sizes[target]
        ranks = {ab["A"].shape[0] for ab in members.values()}
        if len(ranks) != 1:
            raise ValueError(f"the members of {target} have LoRAs of different ranks {sorted(ranks)}.")
        r = ranks.pop()
        any_ab = next(iter(members.values()))
        dims = fused_dims.get("linear1" if target.endswith("linear1") else "qkv") if fused_dims else None
        downs, ups = [], []
        for m in range(n):
            if m in members:
                downs.append(members[m]["A"])
                ups.append(members[m]["B"])
            else:
                if dims is None:
                    raise ValueError(f"{target} has members without LoRA; pass their sizes (fused_dims).")
                downs.append(torch.zeros_like(any_ab["A"]))
                ups.append(torch.zeros(dims[m], r, dtype=any_ab["B"].dtype))
        out[f"{target}.lora_down.weight"] = torch.cat(downs)  # n r, in
        out[f"{target}.lora_up.weight"] = torch.block_diag(*ups)  # sum(out), n r
        out[f"{target}.alpha"] = torch.tensor(float(n * r))
    return out


def to_diffusers(state: dict[str, torch.Tensor], family: str, dims: dict[str, list[int]] | None = None):
    """ComfyUI LoRA -> diffusers names. Flux's fused layers split back by output rows (``dims``: the members'
    sizes, by default from the up matrix with Flux's MLP ratio 4); a stacked, block-diagonal LoRA splits
    into its members exactly, any other fused LoRA gives each member the whole down matrix (still exact,
    larger rank). Zero padding members (all-zero down block) are dropped."""
    out: dict[str, torch.Tensor] = {}
    if family in ("wan", "wan_i2v", "skyreels_df"):  # I2V: the same blocks, with k_img/v_img; SkyReels-V2 is Wan
        reverse = {v: k for k, v in _WAN.items()}
        for key, value in state.items():
            match = re.match(r"^diffusion_model\.blocks\.(\d+)\.(.+)\.(lora_[AB]\.weight|alpha)$", key)
            if match is None or match[2] not in reverse:
                raise ValueError(f"{key!r} is not a ComfyUI Wan LoRA key this converter knows.")
            if match[3] == "alpha":
                continue
            rank = state[key.replace(match[3], "lora_A.weight")].shape[0]
            scale = float(state.get(key.replace(match[3], "alpha"), rank)) / rank
            weight = value * scale if match[3] == "lora_B.weight" else value  # alpha / rank folded into B
            out[f"transformer.blocks.{match[1]}.{reverse[match[2]]}.{match[3]}"] = weight.contiguous()
        return out
    if family not in _KOHYA:
        raise ValueError(f"no ComfyUI format for family {family!r}.")
    blocks, top_modules = _KOHYA[family]
    reverse: dict[tuple[str, str], dict[int, tuple[str, str]]] = {}
    for block, (prefix, table) in blocks.items():
        for name, (layer, member, _) in table.items():
            reverse.setdefault((prefix, layer), {})[member] = (block, name)
    top = {f"lora_unet_{v}": k for k, v in top_modules.items()}
    prefixes = "|".join(re.escape(prefix) for prefix, _ in blocks.values())
    for key in state:
        base = key.rsplit(".", 2)[0] if key.endswith(".weight") else key.rsplit(".", 1)[0]
        if base in top:
            if key.endswith(".lora_down.weight"):
                down, up = state[key], state[f"{base}.lora_up.weight"]
                up = up * (float(state.get(f"{base}.alpha", down.shape[0])) / down.shape[0])
                out[f"transformer.{top[base]}.lora_A.weight"] = down.contiguous()
                out[f"transformer.{top[base]}.lora_B.weight"] = up.contiguous()
            continue
        match = re.match(rf"^lora_unet_({prefixes})_(\d+)_(.+)\.lora_down\.weight$", key)
        if match is None:
            if not key.endswith((".lora_up.weight", ".alpha")):
                raise ValueError(f"{key!r} is not a ComfyUI (kohya) {family} LoRA key this converter knows.")
            continue
        prefix, index, layer = match[1], match[2], match[3]
        if (prefix, layer) not in reverse:
            raise ValueError(f"{key!r} names a layer this converter does not map to diffusers.")
        base = key[: -len(".lora_down.weight")]
        down, up = state[key], state[f"{base}.lora_up.weight"]
        rank = down.shape[0]
        up = up * (float(state.get(f"{base}.alpha", rank)) / rank)  # alpha / rank folded into B
        members = reverse[(prefix, layer)]
        n = len(members)
        if layer == "linear1":
            d = (dims or {}).get("linear1") or [up.shape[0] * 2 // 14] * 3 + [up.shape[0] * 8 // 14]
        elif n == 3:
            d = (dims or {}).get("qkv") or [up.shape[0] // 3] * 3
        else:
            d = [up.shape[0]]
        if sum(d) != up.shape[0]:
            raise ValueError(f"{base}: the member sizes {d} do not add up to the layer's {up.shape[0]} outputs.")
        rows = torch.split(up, d)
        r = rank // n
        stacked = rank % n == 0 and all(
            not rows[m][:, : m * r].any() and not rows[m][:, (m + 1) * r :].any() for m in range(n)
        )
        for m, (block, name) in members.items():
            a, b = (down[m * r : (m + 1) * r], rows[m][:, m * r : (m + 1) * r]) if stacked else (down, rows[m])
            if stacked and not a.any():
                continue  # a zero padding block: that layer had no LoRA
            out[f"transformer.{block}.{index}.{name}.lora_A.weight"] = a.contiguous()
            out[f"transformer.{block}.{index}.{name}.lora_B.weight"] = b.contiguous()
    return out


def check_format(lora_type: str, fmt: str, where: str = "export.format") -> None:
    """Refuse an export format the adapter variant has no faithful layout in, naming the ones it has."""
    formats = VARIANT_FORMATS.get(lora_type)
    if formats is None:
        raise ValueError(f"model.lora_type must be one of {tuple(VARIANT_FORMATS)}, got {lora_type!r}.")
    if fmt not in formats:
        raise ValueError(
            f"{where}={fmt!r}: a {lora_type} adapter has no {fmt} layout (see recipes/lora.py); it exports as "
            f"{' or '.join(formats)}: set {where}: {formats[0]}, or train model.lora_type: lora."
        )


def load_peft(transformer, directory: str | Path, adapter_name: str = "default"):
    """Add the adapter of a peft-format export (any lora_type) to ``transformer`` (a diffusers model); returns it."""
    from peft import PeftConfig, set_peft_model_state_dict
    from safetensors.torch import load_file

    directory = Path(directory)
    config = PeftConfig.from_pretrained(str(directory))
    transformer.add_adapter(config, adapter_name=adapter_name)
    result = set_peft_model_state_dict(transformer, load_file(str(directory / PEFT_NAME)), adapter_name=adapter_name)
    if result.unexpected_keys:
        raise ValueError(f"{directory} holds tensors this model has no adapter for: {result.unexpected_keys[:3]}")
    return transformer


def metadata(pl_module, *, step: int, epoch: int, ema: bool, fmt: str) -> dict[str, str]:
    """Training metadata for the safetensors header (strings only)."""
    h = pl_module.hparams
    meta = {
        "cp_lightning.family": pl_module.family,
        "cp_lightning.base_model": str(h.pretrained),
        "cp_lightning.format": fmt,
        "cp_lightning.lora_type": h.get("lora_type", "lora"),
        "cp_lightning.step": str(step),
        "cp_lightning.epoch": str(epoch),
        "cp_lightning.ema_decay": str(h.ema_decay if ema else 0.0),
        "cp_lightning.hparams": json.dumps(dict(h), default=str, sort_keys=True),
        "cp_lightning.transformer_config": json.dumps(dict(pl_module.transformer.config), default=str),
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(h.lora_rank),
        "ss_network_alpha": str(h.lora_rank),
        "ss_base_model_version": BASE_MODEL_VERSIONS.get(pl_module.family, pl_module.family),
        "ss_steps": str(step),
        "ss_epoch": str(epoch),
        "ss_learning_rate": str(h.learning_rate),
    }
    return meta


def fused_dims(config: dict) -> dict[str, list[int]]:
    """Output sizes of the members of the fused layers (Flux, HunyuanVideo), from the transformer's config."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    return {"qkv": [inner] * 3, "linear1": [inner] * 3 + [int(inner * config.get("mlp_ratio", 4.0))]}


def save(
    state: dict[str, torch.Tensor], directory: str | Path, *, family: str, fmt: str, meta: dict, peft_config=None
) -> Path:
    """Write a diffusers-format state (``transformer.`` keys) as ``fmt`` into ``directory``; returns the file.
    The peft format needs the adapter's ``peft_config`` (written as adapter_config.json)."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"export format must be one of {FORMATS}, got {fmt!r}.")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "comfyui":
        config = json.loads(meta.get("cp_lightning.transformer_config", "{}"))
        state = to_comfyui(state, family, fused_dims(config) if family in _KOHYA and config else None)
    if fmt == "peft":
        if peft_config is None:
            raise ValueError("the peft format needs the adapter's peft config (peft_config=...).")
        peft_config.save_pretrained(str(directory))
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
    path = directory / {"comfyui": COMFYUI_NAME, "peft": PEFT_NAME}.get(fmt, WEIGHT_NAME)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(path), metadata={"format": "pt", **meta})
    return path


def export(pl_module, directory: str | Path, *, fmt: str = "diffusers", step: int = 0, epoch: int = 0) -> list[Path]:
    """The trained LoRA of ``pl_module`` in ``directory``, and its EMA in ``<directory>_ema`` when kept.

    Every rank calls it: the weights are consolidated first (a collective when FSDP shards them); rank 0
    writes and returns the files, the other ranks return ``[]``.
    """
    import torch.distributed as dist

    from cp_lightning.sharding import lora_state_dict

    check_format(pl_module.hparams.get("lora_type", "lora"), fmt)
    state = lora_state_dict(pl_module.transformer)
    shadow = pl_module.ema.full_state_dict() if pl_module.ema is not None else None
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    raw = {f"transformer.{k}": v for k, v in state.items()}
    family = pl_module.family
    meta = metadata(pl_module, step=step, epoch=epoch, ema=False, fmt=fmt)
    peft_config = getattr(pl_module.transformer, "peft_config", {}).get("default")
    files = [save(raw, directory, family=family, fmt=fmt, meta=meta, peft_config=peft_config)]
    if shadow is not None:
        from peft.utils import get_peft_model_state_dict

        # the EMA is named like the module's parameters (transformer.<...>.lora_A.default.weight): peft names it
        # as it names the weights
        params = {k.removeprefix("transformer."): v for k, v in shadow.items()}
        ema = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(pl_module.transformer, params).items()}
        directory = Path(directory)
        meta = metadata(pl_module, step=step, epoch=epoch, ema=True, fmt=fmt)
        ema_dir = directory.with_name(directory.name + "_ema")
        files.append(save(ema, ema_dir, family=family, fmt=fmt, meta=meta, peft_config=peft_config))
    return files


def read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return load_file(str(path)), meta

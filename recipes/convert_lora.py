"""Convert a LoRA file between the diffusers format and ComfyUI's.

    python -m recipes.convert_lora IN OUT --to comfyui|diffusers [--family flux|wan|hunyuan]

IN is a ``.safetensors`` file (or a folder holding one, as the recipes write them); OUT is a folder (the
file gets the format's usual name) or a ``.safetensors`` path. The family comes from the file's training
metadata (``cp_lightning.family``), else from ``--family``; the metadata is carried over.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recipes import lora


def _input_file(path: Path) -> Path:
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise ValueError(f"{path} holds {len(files)} .safetensors files; pass the file itself.")
        return files[0]
    if not path.exists():
        raise ValueError(f"{path} does not exist.")
    return path


def detect(state: dict) -> str:
    """The format a LoRA state dict is in."""
    if all(k.startswith("transformer.") for k in state):
        return "diffusers"
    if all(k.startswith(("lora_unet_", "diffusion_model.")) for k in state):
        return "comfyui"
    raise ValueError(f"unknown LoRA key layout (first key {next(iter(state))!r}).")


def convert(source: str | Path, out: str | Path, to: str, family: str | None = None) -> Path:
    """Convert ``source`` to format ``to``; returns the written file."""
    if to not in lora.CONVERTIBLE:
        raise ValueError(f"--to must be one of {lora.CONVERTIBLE}, got {to!r}.")
    state, meta = lora.read(_input_file(Path(source)))
    family = meta.get("cp_lightning.family") or family
    if family is None:
        raise ValueError("the file has no cp_lightning.family metadata: pass --family flux, wan or hunyuan.")
    config = json.loads(meta.get("cp_lightning.transformer_config", "{}"))
    dims = lora.fused_dims(config) if family in ("flux", "hunyuan") and config else None
    current = detect(state)
    if current == "comfyui":
        state = lora.to_diffusers(state, family, dims)  # everything goes through the diffusers names
    meta = {**meta, "cp_lightning.format": to, "cp_lightning.family": family}
    out = Path(out)
    if out.suffix == ".safetensors":
        written = lora.save(state, out.parent, family=family, fmt=to, meta=meta)
        return written.rename(out)
    return lora.save(state, out, family=family, fmt=to, meta=meta)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="LoRA file (or the folder holding it)")
    p.add_argument("out", help="output folder or .safetensors file")
    p.add_argument("--to", required=True, choices=lora.CONVERTIBLE)
    p.add_argument("--family", choices=lora.COMFYUI_FAMILIES, help="model family, if the file carries no metadata")
    args = p.parse_args(argv)
    try:
        written = convert(args.source, args.out, args.to, args.family)
    except ValueError as err:
        p.error(str(err))
    print(f"wrote {written} ({args.to} format)")


if __name__ == "__main__":
    main()

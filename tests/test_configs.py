"""Every shipped config parses with the recipe's CLI, and real-checkpoint configs fit their model.

Real checkpoints cannot be downloaded here, so the architecture is built from a shipped config on the
meta device (no weights) and checked against the config's CP layout: plan, head counts and token
counts divisible by the degrees, before any GPU is ever involved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
REAL = {"flux1_dev_lora_cp4.yaml": "flux1-dev-transformer.json"}


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_config_parses_and_instantiates(config, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    from cp_lightning import ContextParallelStrategy
    from recipes.data import FluxData
    from recipes.flux import FluxFineTune

    raw = yaml.safe_load(config.read_text())
    devices = raw["trainer"]["devices"]
    # build the Trainer on CPU with the config's device count: the strategy checks its layout there
    args = ["--config", str(config), "--trainer.accelerator=cpu", f"--trainer.devices={devices}"]
    cli = LightningCLI(FluxFineTune, FluxData, run=False, args=args, save_config_callback=None)
    assert isinstance(cli.trainer.strategy, ContextParallelStrategy)
    assert cli.trainer.strategy.cp == raw["trainer"]["strategy"]["init_args"]["cp"]


@pytest.mark.parametrize("config", sorted(REAL), ids=sorted(REAL))
def test_real_config_fits_its_architecture(config):
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    from cp_lightning.attention import check_processors
    from cp_lightning.plan import resolve_plan

    raw = yaml.safe_load((ROOT / "configs" / config).read_text())
    arch = json.loads((ROOT / "configs" / "architectures" / REAL[config]).read_text())
    with init_empty_weights():
        model = FluxTransformer2DModel.from_config(arch)
    cp_args = raw["trainer"]["strategy"]["init_args"]
    cp, ring = cp_args["cp"], cp_args.get("ring", 1)
    resolve_plan(model, None)
    check_processors(model, cp // ring)  # heads divisible by the Ulysses degree
    latent_side = raw["data"]["resolution"] // 8  # FLUX VAE: 8x down
    image_tokens = (latent_side // 2) ** 2  # 2x2 packing
    assert image_tokens % cp == 0 and raw["data"]["max_sequence_length"] % cp == 0
    params = sum(p.numel() for p in model.parameters())
    assert 11.5e9 < params < 12.5e9, params  # the memory estimate in the config rests on this count

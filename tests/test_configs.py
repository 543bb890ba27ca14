"""Every shipped config parses with the recipe's CLI, and real-checkpoint configs fit their model.

Real checkpoints cannot be downloaded here, so the architecture is built from a shipped config on the
meta device (no weights) and checked against the config's CP layout: plan, a head for every Ulysses
rank, and token counts the configs keep divisible by cp (any length works, but equal shares balance
the GPUs and match the per-GPU figures the configs state), before any GPU is ever involved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "consumer").glob("*.yaml"))
REAL = {
    "flux1_dev_lora_cp4.yaml": "flux1-dev-transformer.json",
    "flux1_dev_lora_1024_buckets_cp4.yaml": "flux1-dev-transformer.json",
    "wan2.1_t2v_1.3b_lora_cp4.yaml": "wan2.1-t2v-1.3b-transformer.json",
    "wan2.1_t2v_1.3b_lora_cp8_ring2.yaml": "wan2.1-t2v-1.3b-transformer.json",
    "flux1_dev_full_fsdp_cp4.yaml": "flux1-dev-transformer.json",
    "wan2.1_t2v_14b_lora_fsdp_cp8.yaml": "wan2.1-t2v-14b-transformer.json",
    "wan2.2_ti2v_5b_lora_cp4.yaml": "wan2.2-ti2v-5b-transformer.json",
    "wan2.2_t2v_a14b_lora_cp8.yaml": "wan2.2-t2v-a14b-transformer.json",
    "hunyuanvideo_lora_720p_cp8.yaml": "hunyuanvideo-transformer.json",
    "wan2.1_i2v_14b_lora_480p_cp4.yaml": "wan2.1-i2v-14b-transformer.json",
    "wan2.1_i2v_14b_lora_720p_cp8.yaml": "wan2.1-i2v-14b-transformer.json",
    "wan2.2_i2v_a14b_lora_cp8.yaml": "wan2.2-i2v-a14b-transformer.json",
    "qwen_image_lora_1328_cp4.yaml": "qwen-image-transformer.json",
    "skyreels_v2_df_1.3b_540p_lora_cp4.yaml": "skyreels-v2-df-1.3b-540p-transformer.json",
    "skyreels_v2_df_1.3b_540p_lora_dp2_cp4.yaml": "skyreels-v2-df-1.3b-540p-transformer.json",
}
PARAMS = {
    "flux1-dev-transformer.json": (11.5e9, 12.5e9),
    "wan2.1-t2v-1.3b-transformer.json": (1.3e9, 1.5e9),
    "wan2.1-t2v-14b-transformer.json": (14.0e9, 14.5e9),
    "wan2.2-ti2v-5b-transformer.json": (4.8e9, 5.2e9),
    "wan2.2-t2v-a14b-transformer.json": (13.5e9, 14.5e9),  # one of its two experts
    "hunyuanvideo-transformer.json": (12.5e9, 13.2e9),
    "wan2.1-i2v-14b-transformer.json": (16.0e9, 16.8e9),  # with the image cross-attention's key/value projections
    "wan2.2-i2v-a14b-transformer.json": (13.5e9, 14.5e9),  # one of its two experts
    "qwen-image-transformer.json": (20.0e9, 20.8e9),
    "skyreels-v2-df-1.3b-540p-transformer.json": (1.3e9, 1.5e9),  # Wan2.1-1.3B's DiT
}
VAE_SPATIAL = {"wan2.2-ti2v-5b-transformer.json": 16}  # Wan2.2's VAE; the others downsample 8x
# the presets of the training issue state a memory figure that the shared estimate must reproduce
PRESETS = {
    "flux1_dev_lora_1024_buckets_cp4.yaml",
    "wan2.2_ti2v_5b_lora_cp4.yaml",
    "wan2.2_t2v_a14b_lora_cp8.yaml",
    "hunyuanvideo_lora_720p_cp8.yaml",
    "wan2.1_i2v_14b_lora_480p_cp4.yaml",
    "wan2.1_i2v_14b_lora_720p_cp8.yaml",
    "wan2.2_i2v_a14b_lora_cp8.yaml",
    "qwen_image_lora_1328_cp4.yaml",
    "skyreels_v2_df_1.3b_540p_lora_cp4.yaml",
    "skyreels_v2_df_1.3b_540p_lora_dp2_cp4.yaml",
}


def family(config: Path) -> str:
    name = config.name.replace("i2v", "wan_i2v").replace("qwen_image", "qwenimage")
    families = (
        "wan_i2v",
        "wan",
        "hunyuan",
        "kontext",
        "qwenimage_edit",
        "qwenimage21",
        "qwenimage",
        "skyreels",
        "flux3",
    )
    return next((f for f in families if f in name), "flux")


def recipe(config: Path):
    """The (module, data) classes of a config's recipe."""
    from recipes.data import FluxData, HunyuanData, QwenImageData, WanData
    from recipes.flux import FluxFineTune
    from recipes.flux3 import Flux3Data, Flux3FineTune
    from recipes.flux_kontext import FluxKontextData, FluxKontextFineTune
    from recipes.hunyuan import HunyuanFineTune
    from recipes.qwenimage import QwenImageFineTune
    from recipes.qwenimage21 import QwenImage21Data, QwenImage21FineTune
    from recipes.qwenimage_edit import QwenImageEditData, QwenImageEditFineTune
    from recipes.skyreels_df import SkyReelsDFData, SkyReelsDFFineTune
    from recipes.wan import WanFineTune
    from recipes.wan_i2v import WanI2VData, WanI2VFineTune

    return {
        "flux": (FluxFineTune, FluxData),
        "kontext": (FluxKontextFineTune, FluxKontextData),
        "wan": (WanFineTune, WanData),
        "wan_i2v": (WanI2VFineTune, WanI2VData),
        "hunyuan": (HunyuanFineTune, HunyuanData),
        "qwenimage": (QwenImageFineTune, QwenImageData),
        "qwenimage_edit": (QwenImageEditFineTune, QwenImageEditData),
        "qwenimage21": (QwenImage21FineTune, QwenImage21Data),
        "skyreels": (SkyReelsDFFineTune, SkyReelsDFData),
        "flux3": (Flux3FineTune, Flux3Data),
    }[family(config)]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_config_parses_and_instantiates(config, monkeypatch):
    from cp_lightning import ContextParallelStrategy
    from recipes.finetune import cli as recipe_cli

    module, data = recipe(config)
    raw = yaml.safe_load(config.read_text())
    devices = raw["trainer"]["devices"]
    # build the Trainer on CPU with the config's device count: the strategy checks its layout there
    args = ["--config", str(config), "--trainer.accelerator=cpu", f"--trainer.devices={devices}"]
    cli = recipe_cli(module, data, args=args, run=False, save_config_callback=None)  # the recipes' own sections too
    assert isinstance(cli.trainer.strategy, ContextParallelStrategy)
    assert cli.trainer.strategy.cp == raw["trainer"]["strategy"]["init_args"]["cp"]


@pytest.mark.parametrize("config", sorted(REAL), ids=sorted(REAL))
def test_real_config_fits_its_architecture(config):
    import diffusers
    from accelerate import init_empty_weights

    from cp_lightning.plan import resolve_plan
    from cp_lightning.routing import check_processors

    raw = yaml.safe_load((ROOT / "configs" / config).read_text())
    arch = json.loads((ROOT / "configs" / "architectures" / REAL[config]).read_text())
    with init_empty_weights():
        model = getattr(diffusers, arch["_class_name"]).from_config(arch)
    cp_args = raw["trainer"]["strategy"]["init_args"]
    cp, ring = cp_args["cp"], cp_args.get("ring", 1)
    resolve_plan(model, None)
    check_processors(model, cp // ring)  # a head for every Ulysses rank
    data = raw["data"]
    factor = VAE_SPATIAL.get(REAL[config], 8)
    if data.get("aspect_ratios"):  # buckets: the largest bucket by tokens
        from recipes.buckets import resolutions

        sides = resolutions(data["resolution"] ** 2, data["aspect_ratios"], factor * 2)
        height, width = max(sides, key=lambda hw: hw[0] * hw[1])
        height, width = height // factor, width // factor
    else:
        height, width = data["resolution"] // factor, data.get("width", data["resolution"]) // factor
    tokens = (height // 2) * (width // 2)  # 2x2 patches
    kind = family(ROOT / "configs" / config)
    if kind not in ("flux", "qwenimage"):
        tokens *= (data["num_frames"] - 1) // 4 + 1  # Wan's and HunyuanVideo's VAEs: 4x temporal, first frame kept
    # Flux, QwenImage and HunyuanVideo split the text too
    split_text = data["max_sequence_length"] if not kind.startswith(("wan", "skyreels")) else 0
    assert split_text % cp == 0
    text = (ROOT / "configs" / config).read_text()
    if not data.get("aspect_ratios"):
        assert tokens % cp == 0, (tokens, cp)
        assert f"{tokens // cp} per GPU" in text or kind == "flux"
    low, high = PARAMS[REAL[config]]
    params = sum(p.numel() for p in model.parameters())
    assert low < params < high, params  # the memory estimate in the config rests on this count
    if config in PRESETS:
        _check_memory_estimate(model, raw, text, tokens + split_text, recipe(ROOT / "configs" / config)[0])


FSDP = sorted(c for c in REAL if "fsdp" in c)


@pytest.mark.parametrize("config", FSDP, ids=FSDP)
def test_fsdp_config_shards_its_architecture_and_states_the_sharded_bytes(config):
    """The FSDP configs: the blocks to shard are found on the meta model, and the stated "sharded state: X GiB
    per GPU" is (frozen weights x their bytes + trained weights x 16 bytes: fp32 weight, gradient and AdamW's
    two moments) / the ranks they are sharded over."""
    import re

    import diffusers
    from accelerate import init_empty_weights
    from peft import LoraConfig

    from cp_lightning.sharding import FSDPOptions, check_fsdp_model

    text = (ROOT / "configs" / config).read_text()
    raw = yaml.safe_load(text)
    cp_args = raw["trainer"]["strategy"]["init_args"]
    assert cp_args["fsdp"] is True and raw["trainer"]["precision"] == "bf16-mixed"
    arch = json.loads((ROOT / "configs" / "architectures" / REAL[config]).read_text())
    with init_empty_weights():
        model = getattr(diffusers, arch["_class_name"]).from_config(arch)
    rank, module = raw["model"]["lora_rank"], recipe(ROOT / "configs" / config)[0]
    if rank:
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=module.lora_targets))
    options = FSDPOptions(hsdp=cp_args.get("hsdp", False), blocks=cp_args.get("fsdp_blocks"))
    check_fsdp_model(model, None, options)  # repeated blocks found, nothing trainable left outside them
    frozen_bytes = 2 if raw["model"]["weights_dtype"] == "bfloat16" else 4
    total = sum(p.numel() * (16 if p.requires_grad else frozen_bytes) for p in model.parameters())
    ranks = cp_args["cp"] if options.hsdp else raw["trainer"]["devices"] * raw["trainer"].get("num_nodes", 1)
    stated = float(re.search(r"sharded state: ([0-9.]+) GiB per GPU", text).group(1))
    assert abs(total / ranks / 2**30 - stated) <= 0.05 * stated, (total / ranks / 2**30, stated)


def _check_memory_estimate(model, raw, text, tokens, module):
    """The config's "about N GiB" is the shared estimate (recipes.buckets) for its model, LoRA and layout."""
    import re

    import torch

    from recipes.buckets import memory_estimate_gib

    m = raw["model"]
    targets = m.get("lora_targets") or module.lora_targets
    rank = m["lora_rank"]
    trainable = sum(
        rank * (mod.in_features + mod.out_features)
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    )
    blocks = [mod for mod in model.modules() if isinstance(mod, torch.nn.ModuleList)]
    estimate = memory_estimate_gib(
        params=sum(p.numel() for p in model.parameters()),
        trainable=trainable,
        weight_bytes=2,
        hidden=model.config.num_attention_heads * model.config.attention_head_dim,
        layers=sum(len(b) for b in blocks if len(b) > 1 and "Block" in type(b[0]).__name__),
        tokens=-(-tokens // raw["trainer"]["strategy"]["init_args"]["cp"]),
        batch=raw["data"]["batch_size"],
        checkpointing=m["gradient_checkpointing"],
    )
    stated = float(re.search(r"about (\d+(?:\.\d+)?) GiB", text).group(1))
    assert abs(stated - estimate) / estimate < 0.1, (stated, estimate)


# ---------------------------------------------------------------- planner presets (issue 46)
# Presets for families the recipes do not train yet (Flux3, Krea 2, Qwen-Image 2.1, Kandinsky 6, LTX-2.5): a layout
# (trainer + strategy), LoRA and data settings in the recipes' YAML shape plus a `preset` section naming the diffusers
# class, its architecture JSON and the token geometry (pixels per latent token side after the VAE and the patches,
# frames per latent frame, whether the plan splits the text with the image). Checked here as the recipe presets are:
# the architecture built on the meta device, the library's plan and the heads for every Ulysses rank, the token count
# per GPU the comment states, the parameter count, and the stated memory figure against the shared estimate.
PLANNER_PRESETS = sorted((ROOT / "configs" / "presets").glob("*.yaml"))


def preset_tokens(raw: dict) -> int:
    """Tokens one sample puts through the split: latent frames x the latent grid, plus the text when it is split."""
    geometry, data = raw["preset"], raw["data"]
    per_token = geometry["pixels_per_token"]
    assert data["resolution"] % per_token == 0 and data["width"] % per_token == 0, (data, per_token)
    latent_frames = (data.get("num_frames", 1) - 1) // geometry.get("frames_per_token", 1) + 1
    tokens = latent_frames * (data["resolution"] // per_token) * (data["width"] // per_token)
    return tokens + (data["max_sequence_length"] if geometry["text_split"] else 0)


def preset_estimate_gib(model, raw: dict) -> float:
    """recipes.buckets' shared estimate for a preset's model, LoRA and layout (hidden width: heads x head dim, or
    Kandinsky 6's model_dim)."""
    import torch

    from recipes.buckets import memory_estimate_gib

    m, config = raw["model"], model.config
    trainable = sum(
        m["lora_rank"] * (mod.in_features + mod.out_features)
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in m["lora_targets"])
    )
    blocks = [mod for mod in model.modules() if isinstance(mod, torch.nn.ModuleList)]
    hidden = config.get("model_dim") or config["num_attention_heads"] * config["attention_head_dim"]
    return memory_estimate_gib(
        params=sum(p.numel() for p in model.parameters()),
        trainable=trainable,
        weight_bytes=2,
        hidden=hidden,
        layers=sum(len(b) for b in blocks if len(b) > 1 and "Block" in type(b[0]).__name__),
        tokens=-(-preset_tokens(raw) // raw["trainer"]["strategy"]["init_args"]["cp"]),
        batch=raw["data"]["batch_size"],
        checkpointing=m["gradient_checkpointing"],
    )


def build_preset(raw: dict):
    import diffusers
    from accelerate import init_empty_weights

    arch = json.loads((ROOT / "configs" / "architectures" / raw["preset"]["architecture"]).read_text())
    assert arch["_class_name"] == raw["preset"]["class"], arch["_class_name"]
    with init_empty_weights():
        return getattr(diffusers, arch["_class_name"]).from_config(arch)


def test_every_new_family_has_a_planner_preset():
    classes = {yaml.safe_load(p.read_text())["preset"]["class"] for p in PLANNER_PRESETS}
    assert classes >= {
        "Flux3Transformer2DModel",
        "Krea2Transformer2DModel",
        "QwenImage21Transformer2DModel",
        "Kandinsky6Transformer3DModel",
        "LTX2VideoTransformer3DModel",
    }, classes


@pytest.mark.parametrize("preset", PLANNER_PRESETS, ids=[p.name for p in PLANNER_PRESETS])
def test_planner_preset_fits_its_architecture(preset):
    import re

    from cp_lightning.plan import resolve_plan
    from cp_lightning.routing import check_processors

    text = preset.read_text()
    raw = yaml.safe_load(text)
    model = build_preset(raw)
    cp_args = raw["trainer"]["strategy"]["init_args"]
    cp, ring = cp_args["cp"], cp_args.get("ring", 1)
    assert raw["trainer"]["devices"] % cp == 0 and cp % ring == 0
    resolve_plan(model, None)  # the library's plan (or diffusers') for the class
    check_processors(model, cp // ring)  # a head for every Ulysses rank
    tokens = preset_tokens(raw)
    assert tokens % cp == 0 and f"{tokens // cp} per GPU" in text, (tokens, cp)
    low, high = raw["preset"]["params_billions"]
    params = sum(p.numel() for p in model.parameters())
    assert low * 1e9 < params < high * 1e9, params  # the memory figure rests on this count
    stated = float(re.search(r"about (\d+(?:\.\d+)?) GiB", text).group(1))
    estimate = preset_estimate_gib(model, raw)
    assert abs(stated - estimate) / estimate < 0.1, (stated, estimate)


# ---------------------------------------------------------------- consumer presets (configs/consumer/, issue 47)
# Presets for 2 x 24 GB, 4 x 24 GB and 2 x 32 GB cards in one PCIe node, each layout the planner's choice over
# --interconnect pcie (benchmarks/consumer_presets.py writes them): the file is what the script writes from the
# planner's choice, the choice fits the card with the planner's margin, the architecture and plan pass on the meta
# device (with the preset's fp8 base and LoRA), and the dry run plans on the CPU without a process.
CONSUMER = sorted((ROOT / "configs" / "consumer").glob("*.yaml"))
CONSUMER_ARCH = {
    "wan2.1-t2v-14b": "wan2.1-t2v-14b-transformer.json",
    "wan2.2-t2v-a14b": "wan2.2-t2v-a14b-transformer.json",
    "flux.1-dev": "flux1-dev-transformer.json",
    "qwen-image": "qwen-image-transformer.json",
}


def consumer_setup(config: Path):
    """(the script's Setup, the cards key, usable GiB per card) of a consumer preset."""
    from benchmarks.consumer_presets import CARDS, SETUPS

    stem, cards = config.stem.rsplit("_", 1)
    return next(s for s in SETUPS if s.stem == stem), cards, CARDS[cards][1]


def test_every_consumer_combination_has_a_preset_or_does_not_fit():
    """One preset per (model and size, cards) the planner fits; none where nothing fits (the docs' table says so,
    and is the script's table)."""
    from benchmarks.consumer_presets import CARDS, SETUPS, plan, table

    names = {c.name for c in CONSUMER}
    for setup in SETUPS:
        for cards in CARDS:
            fits = plan(setup, cards)[0].fits
            assert (f"{setup.stem}_{cards}.yaml" in names) == fits, (setup.stem, cards, fits)
    assert "wan2.1_t2v_14b_lora_720p_2x24gb.yaml" not in names  # 75600 tokens: the leanest layout needs ~26 GiB
    for doc in ("planning.md", "consumer-gpus.md"):  # the docs show the planner's table as it is now
        assert table() in (ROOT / "docs" / doc).read_text(), doc


@pytest.mark.parametrize("config", CONSUMER, ids=[c.name for c in CONSUMER])
def test_consumer_preset_is_the_planners_choice_within_the_card(config):
    from benchmarks.consumer_presets import plan, render
    from cp_lightning.planner.cli import run

    setup, cards, memory = consumer_setup(config)
    chosen = plan(setup, cards)[0]
    assert chosen.fits and chosen.gib_per_gpu <= memory  # fixed costs and the 10% allocator margin included
    assert config.read_text() == render(setup, cards, chosen)  # layout, figures and comment: the planner's
    text = config.read_text()
    assert f"Planner estimate: {chosen.gib_per_gpu:.1f} GiB per GPU of {memory:g} usable" in text
    # what a user runs on the file: its own layout over PCIe (the one bucket the YAML names without data)
    result, _ = run(["--config", str(config), "--gpu-memory", f"{memory:g}", "--interconnect", "pcie",
                     "--tflops", "66", "--json"])  # fmt: skip
    assert result["fits"] and result["layout"] == dict(chosen.as_dict()["layout"])
    assert result["gib_per_gpu"] <= chosen.gib_per_gpu + 1e-3  # a bucket no larger than the largest planned


@pytest.mark.parametrize("config", CONSUMER, ids=[c.name for c in CONSUMER])
def test_consumer_preset_fits_its_architecture_on_meta(config):
    """The architecture built on the meta device with the preset's LoRA, fp8 base, checkpointing and offload: the
    library's plan, a head for every Ulysses rank, FSDP's blocks, and the planner's parameter counts."""
    import diffusers
    from accelerate import init_empty_weights

    from cp_lightning.offload import apply_activation_offload
    from cp_lightning.plan import resolve_plan
    from cp_lightning.planner import resolve_model
    from cp_lightning.planner.memory import counts
    from cp_lightning.routing import check_processors
    from cp_lightning.sharding import FSDPOptions, check_fsdp_model
    from recipes.finetune import prepare_for_training

    setup, _, _ = consumer_setup(config)
    raw = yaml.safe_load(config.read_text())
    arch = json.loads((ROOT / "configs" / "architectures" / CONSUMER_ARCH[setup.model]).read_text())
    with init_empty_weights():
        model = getattr(diffusers, arch["_class_name"]).from_config(arch)
    total = sum(p.numel() for p in model.parameters())
    planned = counts(resolve_model(setup.model), raw["model"]["lora_rank"])
    assert total == planned.total - planned.trainable  # the planner's model is this architecture (+ LoRA)
    cp_args, m = raw["trainer"]["strategy"]["init_args"], raw["model"]
    cp, ring = cp_args["cp"], cp_args.get("ring", 1)
    assert raw["trainer"]["devices"] % cp == 0 and cp % ring == 0
    resolve_plan(model, None)
    check_processors(model, cp // ring)
    module = recipe(config)[0]
    model = prepare_for_training(model, m["lora_rank"], module.lora_targets, 0, m["gradient_checkpointing"],
                                 m.get("base_dtype"))  # fmt: skip
    if m.get("activation_offload"):
        assert apply_activation_offload(model) > 0
    if cp_args.get("fsdp"):
        check_fsdp_model(model, None, FSDPOptions(hsdp=cp_args.get("hsdp", False)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == planned.trainable, (trainable, planned.trainable)
    if m.get("base_dtype"):
        fp8 = sum(p.numel() for p in model.parameters() if p.dtype.itemsize == 1)
        assert fp8 > 0.95 * total, fp8 / total  # the planner's fp8 base: (almost) every frozen weight in 1 byte


@pytest.fixture(scope="module")
def consumer_data(tmp_path_factory):
    """One synthetic folder per (family, size), made on first use."""
    made = {}

    def folder(setup) -> Path:
        from recipes.synthetic import make_shapes

        key = (setup.family == "wan", setup.resolution, setup.frames)
        if key not in made:
            made[key] = make_shapes(tmp_path_factory.mktemp("consumer") / "data", 1, size=setup.resolution,
                                    frames=setup.frames)  # fmt: skip
        return made[key]

    return folder


@pytest.mark.parametrize("config", CONSUMER, ids=[c.name for c in CONSUMER])
def test_consumer_preset_dry_run_on_cpu(config, consumer_data, tmp_path, capsys, monkeypatch):
    """`--data.dry_run=true` on the preset as shipped (CUDA, 2-4 devices) on this CPU machine: no Trainer, no
    process; each bucket's est_gib_per_gpu is the planner's for the preset's layout, within the card."""
    import csv
    import multiprocessing
    import sys

    import torch.distributed as dist

    from benchmarks.consumer_presets import plan
    from cp_lightning.planner import Hardware, Training, estimate, resolve_model
    from recipes.finetune import cli as recipe_cli

    setup, cards, memory = consumer_setup(config)
    module, data = recipe(config)
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["recipe"])  # LightningCLI reads args=, not pytest's command line
    args = ["--config", str(config), "--data.dry_run=true", f"--data.data_dir={consumer_data(setup)}",
            f"--data.cache_dir={tmp_path / 'cache'}", f"--trainer.default_root_dir={run_dir}"]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        recipe_cli(module, data, args=args, run=False, save_config_callback=None)
    assert stop.value.code == 0
    assert "est_gib_per_gpu" in capsys.readouterr().out
    assert not multiprocessing.active_children() and not (dist.is_available() and dist.is_initialized())
    with (run_dir / "buckets.csv").open() as f:
        rows = list(csv.DictReader(f))
    layout = plan(setup, cards)[0].layout
    hw = Hardware(gpus=layout.dp * layout.cp, gpu_memory_gib=memory)
    for row in rows:  # 8x VAE and 2x2 patches; Wan's VAE 4x in time, first frame kept; Wan's text not split
        frames, height, width = int(row["frames"]), int(row["height"]), int(row["width"])
        split = ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)
        text = setup.text if setup.family != "wan" else None
        e = estimate(resolve_model(setup.model), layout, hw, Training(lora_rank=setup.rank), split, text)
        assert float(row["est_gib_per_gpu"]) == pytest.approx(e.gib_per_gpu, rel=1e-3), row
        assert float(row["est_gib_per_gpu"]) <= memory


def test_samples_enabled_false_loads_and_renders_nothing():
    """The consumer presets' `samples.enabled: false`: no pipeline is loaded at the start, none rendered after a
    step or at the end (a trainer or module touched would raise here: both are None)."""
    from recipes.sampling import SampleWan

    samples = SampleWan(enabled=False, every_n_steps=1)
    samples.on_train_start(None, None)
    samples.on_train_batch_end(None, None, None, None, 0)
    samples.on_train_end(None, None)
    assert samples.pipeline is None and not samples.sampled
    with pytest.raises(AttributeError):  # enabled (the default): the same calls reach the trainer
        SampleWan(every_n_steps=1).on_train_start(None, None)

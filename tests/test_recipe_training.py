"""Recipe training features at cp=2: samples rendered with CP, light checkpoints and exact resume, EMA,
ComfyUI export and conversion, and the errors for checkpoints that cannot resume a run.

One module-scoped set of tiny runs serves several tests: a straight 6-step Flux run and the same run
stopped after 3 steps and resumed from ``last``. The Wan recipe's samples and ComfyUI export are checked
in tests/test_recipes.py, on its one run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from tests.distributed import spawn
from tests.test_recipes import ROOT, losses, run_recipe

FAMILIES = ("flux", "wan", "hunyuan", "qwenimage")  # the recipes whose CP-rendered samples are compared
COMMON = (
    "--trainer.max_steps=6",
    "--samples.every_n_steps=2",
    "--samples.num_inference_steps=2",
    "--checkpoint.every_n_steps=3",
    "--model.lr_scheduler=cosine",
    "--model.warmup_steps=2",
    "--model.ema_decay=0.9",
)


class StopAt(L.Callback):
    """Stops training after ``step`` optimizer steps, as an interrupted job would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("training")
    straight = run_recipe(tmp, "straight", *COMMON)
    stop = json.dumps({"class_path": f"{__name__}.StopAt", "init_args": {"step": 3}})
    first = losses(run_recipe(tmp, "resumed", *COMMON, f"--trainer.callbacks+={stop}"))
    resumed = run_recipe(tmp, "resumed", *COMMON, "--ckpt_path=last", "--export.format=comfyui")
    return {"tmp": tmp, "straight": straight, "resumed": resumed, "first": first}


@pytest.fixture(scope="module")
def fsdp_runs(runs):
    """The same three runs with the model sharded by FSDP2 (configs/tiny_flux_fsdp_cp2.yaml: dp1 x cp2), and the
    straight run's step-3 checkpoint resumed in one process."""
    tmp = runs["tmp"] / "fsdp"
    tmp.mkdir()
    sharded = {"cache": runs["tmp"], "variant": "fsdp_"}
    straight = run_recipe(tmp, "straight", *COMMON, **sharded)
    stop = json.dumps({"class_path": f"{__name__}.StopAt", "init_args": {"step": 3}})
    first = losses(run_recipe(tmp, "resumed", *COMMON, f"--trainer.callbacks+={stop}", **sharded))
    resumed = run_recipe(tmp, "resumed", *COMMON, "--ckpt_path=last", **sharded)
    # the straight run's step-3 checkpoint resharded into one process (cp=1): another layout, same dp
    step3 = f"--ckpt_path={straight}/checkpoints/step_3.ckpt"
    one = ("--trainer.devices=1", "--trainer.strategy.init_args.cp=1")
    resharded = run_recipe(tmp, "resharded", *COMMON, step3, *one, **sharded)
    return {"straight": straight, "resumed": resumed, "first": first, "resharded": resharded}


def _pipeline(tmp: Path, family: str = "flux"):
    from recipes.components import load_pipeline

    pipe = load_pipeline(family, "tiny", tmp / "cache")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _render(pipe, family: str = "flux", prompt_index: int = 0, steps: int = 2, cfg: bool = True) -> np.ndarray:
    from recipes.sampling import SAMPLERS

    # Flux: the tiny config's guidance 1.0; Wan: the default classifier-free guidance 5.0; HunyuanVideo: its
    # default embedded guidance 6.0 and classifier-free guidance 3.0 against a negative prompt, the text padded
    # (the joint [video, text] key mask is split)
    hunyuan_cfg = {"true_cfg_scale": 3.0, "negative_prompt": "a blurry frame"} if cfg else {}
    extra = {
        "flux": {"guidance_scale": 1.0},
        "wan": {"num_frames": 4, "prompts": ["a red circle moving right"]},
        # 23 of 48 tokens text
        "hunyuan": {"num_frames": 5, "prompts": ["a red circle"], "max_sequence_length": 48, **hunyuan_cfg},
        # QwenImage: classifier-free guidance 4.0 against a negative prompt of another text length (46 and 48
        # text tokens, split with the 64 image tokens)
        "qwenimage": {"true_cfg_scale": 4.0, "negative_prompt": "a blurry image", "max_sequence_length": 64},
    }[family]
    sampler = SAMPLERS[family](num_inference_steps=steps, **extra)
    with torch.no_grad():
        return sampler.render(pipe, sampler.encode(pipe, sampler.prompts[prompt_index]), sampler.seed + prompt_index)


def test_samples_at_steps_0_2_4_exist_and_are_logged(runs):
    run = runs["straight"]
    for step in (0, 2, 4, 6):
        assert (run / "samples" / f"step_{step}.png").stat().st_size > 0
        assert (run / "logs" / "version_0" / "samples" / f"step_{step}.png").exists()  # the CSV logger's folder
    assert (run / "samples.png").exists()  # every sampled step side by side


def test_the_step0_sample_rendered_with_cp_is_the_one_process_sample(runs):
    from PIL import Image

    grid = np.asarray(Image.open(runs["straight"] / "samples" / "step_0.png").convert("RGB")).astype(int)
    pipe = _pipeline(runs["tmp"])  # the LoRA starts as a zero update: step 0 is the base model
    for i in range(4):
        one = (np.clip(_render(pipe, prompt_index=i)[0], 0, 1) * 255).round().astype(int)  # H, W, 3
        row = grid[i * (32 * 4 + 14) : i * (32 * 4 + 14) + 32 * 4 : 4, : 32 * 4 : 4]
        assert np.abs(row - one).max() <= 1, i  # 8-bit PNG: at most one level of rounding


def _perturb(transformer, seed: int = 0) -> None:
    with torch.no_grad():  # every layer matters (zero-initialised gates and outputs get values)
        for p in transformer.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))


def _two_experts(cache: Path) -> str:
    """A tiny Wan2.2 A14B-style pipeline: two different experts and the timestep boundary 0.875 (at 3 steps of
    the tiny scheduler, t = 1000 is the high-noise expert's, 667 and 333 the low-noise expert's)."""
    from diffusers import WanPipeline

    from recipes.components import load_pipeline, load_transformer

    path = cache / "tiny_wan_two_experts"
    pipe = load_pipeline("wan", "tiny", cache)
    second = load_transformer("wan", "tiny", cache)
    _perturb(pipe.transformer)
    _perturb(second, seed=1)
    parts = {k: getattr(pipe, k) for k in ("tokenizer", "text_encoder", "vae", "transformer", "scheduler")}
    WanPipeline(**parts, transformer_2=second, boundary_ratio=0.875).save_pretrained(path)
    return str(path)


def _sample_two_experts(rank, world, cache, path):
    """recipes.sampling's own set-up and rendering while the high-noise expert trains at cp=world: the frozen
    low-noise expert is loaded, parallelized and parked on the CPU by the sampler."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from cp_lightning import build_mesh, parallelize
    from cp_lightning.parallelize import parallel_state
    from recipes.components import load_transformer
    from recipes.sampling import SampleWan

    mesh = build_mesh(cp=world)
    trained = parallelize(load_transformer("wan", path, cache, subfolder="transformer"), mesh=mesh)
    strategy = SimpleNamespace(cp=world, ring=1, dp_size=1, dp_rank=0, world_size=world, device_mesh=mesh)
    trainer = SimpleNamespace(
        strategy=strategy,
        precision_plugin=SimpleNamespace(forward_context=nullcontext),
        is_global_zero=rank == 0,
        global_step=0,
    )
    hparams = SimpleNamespace(pretrained=path, cache_dir=str(cache), weights_dtype="float32")
    module = SimpleNamespace(hparams=hparams, transformer_subfolder="transformer", transformer=trained)
    module.device = torch.device("cpu")
    sampler = SampleWan(prompts=["a red circle moving right"], num_frames=4, num_inference_steps=3)
    sampler.prepare(trainer, module)
    samples = sampler.render_all(trainer, module)
    (other,) = sampler.others
    assert sampler.pipeline.transformer is trained and sampler.pipeline.transformer_2 is other
    assert parallel_state(other) is not None and not any(p.requires_grad for p in other.parameters())
    return samples[0] if samples else None


def _cp_render(rank, world, cache, two_experts=None):
    """Flux, Wan, HunyuanVideo and QwenImage samples of a perturbed tiny base (all layers matter), at cp=world; the
    two-expert Wan2.2 sample through recipes.sampling when its pipeline's path is given."""
    from cp_lightning import build_mesh, parallelize
    from recipes.components import load_pipeline

    out, pipes = {}, {}
    for family in FAMILIES:
        pipe = pipes[family] = load_pipeline(family, "tiny", cache)
        pipe.set_progress_bar_config(disable=True)
        _perturb(pipe.transformer)
        if world > 1:
            parallelize(pipe.transformer, mesh=build_mesh(cp=world))
        out[family] = _render(pipe, family, steps=3)
    if world == 1:  # HunyuanVideo's classifier-free guidance changes the sample
        out["hunyuan without cfg"] = _render(pipes["hunyuan"], "hunyuan", steps=3, cfg=False)
    if two_experts:
        out["wan2.2"] = _sample_two_experts(rank, world, cache, two_experts)
    return out


def test_a_cp_rendered_sample_equals_the_one_process_sample(runs):
    from diffusers import WanPipeline

    from recipes.components import resolve_pretrained

    cache = runs["tmp"] / "cache"
    for family in FAMILIES:
        resolve_pretrained(family, "tiny", cache)
    two_experts = _two_experts(cache)
    results = spawn(_cp_render, 2, cache, two_experts)
    single = _cp_render(0, 1, cache)
    # Wan: classifier-free guidance 5.0, two transformer passes per step; HunyuanVideo: video and text split,
    # classifier-free guidance against a negative prompt (its text padded otherwise than the prompt's)
    for family in FAMILIES:
        for sample in results:
            np.testing.assert_allclose(sample[family], single[family], atol=1e-5)
    assert np.abs(single["hunyuan"] - single["hunyuan without cfg"]).max() > 1e-3
    # Wan2.2 A14B: the pipeline's own two-expert loop in one process; the CP run trained one expert and
    # sampled with the other one frozen and parallelized
    pipe = WanPipeline.from_pretrained(two_experts)
    pipe.set_progress_bar_config(disable=True)
    reference = _render(pipe, "wan", steps=3)
    np.testing.assert_allclose(results[0]["wan2.2"], reference, atol=1e-5)
    assert results[1]["wan2.2"] is None  # rank 0 gathers the samples
    pipe.transformer_2 = pipe.transformer  # both experts matter: one expert alone samples otherwise
    assert np.abs(_render(pipe, "wan", steps=3) - reference).max() > 1e-3


def test_resume_from_last_is_exact_and_checkpoints_are_light(runs):
    straight, resumed = losses(runs["straight"]), losses(runs["resumed"])
    assert runs["first"] == straight[:3]
    assert len(resumed) == 3  # steps 4-6, after the checkpoint of step 3
    assert resumed == pytest.approx(straight[3:], abs=1e-6)
    from recipes import lora

    a, _ = lora.read(runs["straight"] / "lora_ema" / lora.WEIGHT_NAME)
    b, meta = lora.read(runs["resumed"] / "lora_ema" / lora.COMFYUI_NAME)  # the resumed part exports for ComfyUI
    b = lora.to_diffusers(b, "flux")
    assert sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)  # the EMA resumed too
    raw, _ = lora.read(runs["straight"] / "lora" / lora.WEIGHT_NAME)
    assert any(not torch.equal(raw[k], b[k]) for k in raw) and meta["cp_lightning.ema_decay"] == "0.9"
    trainable_bytes = sum(v.numel() for v in raw.values()) * 4
    checkpoint = runs["straight"] / "checkpoints" / "step_6.ckpt"
    assert checkpoint.stat().st_size <= 2 * 3 * trainable_bytes  # parameters + AdamW's two moments
    assert (runs["straight"] / "checkpoints" / "step_6_lora" / lora.WEIGHT_NAME).exists()
    assert (runs["straight"] / "checkpoints" / "last.ckpt").resolve().name == "step_6.ckpt"
    resumed = runs["resumed"] / "checkpoints"  # relinked, no last-v1.ckpt beside it
    assert [p.name for p in resumed.glob("last*")] == ["last.ckpt"]
    assert (resumed / "last.ckpt").resolve().name == "step_6.ckpt"


def test_fsdp_resume_is_exact_and_its_sharded_checkpoints_hold_the_trainable_state_only(runs, fsdp_runs):
    from torch.distributed.checkpoint import FileSystemReader

    from recipes import lora

    straight, resumed = losses(fsdp_runs["straight"]), losses(fsdp_runs["resumed"])
    assert fsdp_runs["first"] == straight[:3] and len(resumed) == 3
    assert resumed == pytest.approx(straight[3:], abs=1e-6)  # steps 4-6, after the checkpoint of step 3
    assert straight == pytest.approx(losses(runs["straight"]), abs=1e-4)  # FSDP2 instead of DDP: the same steps
    assert losses(fsdp_runs["resharded"]) == pytest.approx(straight[3:], abs=1e-5)  # cp=2 -> cp=1

    def read(run, folder):
        return lora.read(run / folder / lora.WEIGHT_NAME)[0]  # gathered from the shards

    ema = read(fsdp_runs["straight"], "lora_ema")
    assert sorted(ema) == sorted(read(fsdp_runs["resumed"], "lora_ema"))
    assert all(torch.allclose(ema[k], read(fsdp_runs["resumed"], "lora_ema")[k], atol=1e-6) for k in ema)
    assert all(torch.allclose(ema[k], read(fsdp_runs["resharded"], "lora_ema")[k], atol=1e-5) for k in ema)
    # the EMA follows the sharded parameters (not the unsharded ones FSDP replaced): DDP's EMA, not the init
    ddp_ema, raw = read(runs["straight"], "lora_ema"), read(fsdp_runs["straight"], "lora")
    assert all(torch.allclose(ema[k], ddp_ema[k], atol=1e-5) for k in ema)
    assert max((ema[k] - raw[k]).abs().max().item() for k in ema) > 1e-4
    assert raw and all(k.startswith("transformer.") and "lora" in k for k in raw), list(raw)[:4]
    assert (fsdp_runs["straight"] / "samples.png").stat().st_size > 0

    checkpoints = fsdp_runs["straight"] / "checkpoints"
    directory = checkpoints / "step_6.ckpt"  # a torch.distributed.checkpoint directory, one file per rank
    saved = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    model = {k.removeprefix("state_dict.") for k in saved if k.startswith("state_dict.")}
    trainable = torch.load(directory / "meta.pt", weights_only=False)["recipe"]["trainable"]
    assert model == set(trainable)  # the LoRA only: the frozen base is reloaded from `pretrained`
    assert {k.removeprefix("ema.") for k in saved if k.startswith("ema.")} == model  # the EMA, sharded
    params = sum(4 * np.prod(shape) for shape in trainable.values())
    optimizer = sum(
        m.properties.dtype.itemsize * np.prod(m.size)
        for k, m in saved.items()
        if k.startswith("optimizer_0.state.") and hasattr(m, "size")
    )
    size = sum(f.stat().st_size for f in directory.iterdir())
    # parameters, AdamW's moments and the EMA; DCP adds about 1.7 kB per tensor shard (the tiny LoRA's
    # tensors are 4-16 kB), so here the EMA is counted with the state it must hold
    assert size <= 2 * (params + optimizer + params), (size, params, optimizer)
    assert (checkpoints / "last.ckpt").resolve().name == "step_6.ckpt"
    assert sorted(p.name for p in (fsdp_runs["resumed"] / "checkpoints").glob("last*")) == ["last.ckpt"]
    # the recipe refuses another LoRA rank with its own message, before the sharded load
    cmd = ["--trainer.max_steps=6", "--model.lora_rank=8", f"--ckpt_path={directory}"]
    with pytest.raises(ValueError, match="LoRA of rank 16.*--model.lora_rank 16"):
        run_recipe(checkpoints.parent.parent, "rank8", *cmd, cache=runs["tmp"], variant="fsdp_")


def test_checkpoints_that_cannot_resume_the_run_are_clear_errors(runs):
    from recipes.checkpoints import check_identity

    saved = torch.load(runs["straight"] / "checkpoints" / "step_6.ckpt", weights_only=False)
    identity = saved["recipe"]
    for change, message in (
        ({"pretrained": "black-forest-labs/FLUX.1-dev"}, "trained on base model 'tiny'.*--model.pretrained tiny"),
        ({"family": "wan"}, "model family 'flux'"),
        ({"lora_rank": 8}, "LoRA of rank 16.*--model.lora_rank 16"),
        ({"dp": 2}, r"dp=1, cp=2.*this run has dp=2.*resume with devices x num_nodes = 1 x cp"),
    ):
        with pytest.raises(ValueError, match=message):
            check_identity(identity, {**identity, **change}, saved["state_dict"])
    with pytest.raises(ValueError, match="not written by a cp_lightning recipe"):
        check_identity(None, identity, saved["state_dict"])
    # wired into the run: resuming with another LoRA rank stops before any weight is loaded
    cmd = ["--trainer.max_steps=6", "--model.lora_rank=8", "--ckpt_path=last"]
    with pytest.raises(ValueError, match="LoRA of rank 16"):
        run_recipe(runs["tmp"], "resumed", *cmd)


def test_the_comfyui_export_converts_back_and_loads_with_the_same_output(runs, tmp_path):
    from recipes import lora

    run = runs["resumed"]  # exported in ComfyUI's format after step 6
    comfy = run / "lora" / lora.COMFYUI_NAME
    state, meta = lora.read(comfy)
    assert meta["cp_lightning.format"] == "comfyui" and meta["cp_lightning.step"] == "6"
    assert any(k.startswith("lora_unet_double_blocks_0_img_attn_qkv") for k in state)
    back = tmp_path / "back"
    cmd = [sys.executable, "-m", "recipes.convert_lora", str(comfy), str(back), "--to", "diffusers"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    pipe = _pipeline(runs["tmp"])
    base = _render(pipe)
    pipe.load_lora_weights(str(run / "checkpoints" / "step_6_lora"))  # the diffusers export of the same step
    direct = _render(pipe)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(str(back))
    np.testing.assert_allclose(_render(pipe), direct, atol=1e-6)
    assert np.abs(direct - base).max() > 1e-3  # the LoRA matters


def test_flux_comfyui_layout_is_what_diffusers_reads_as_kohya():
    """At FLUX.1's real sizes (diffusers' kohya converter hard-codes them), fused qkv and linear1 split back."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    from recipes import lora

    g = torch.Generator().manual_seed(0)
    d, mlp = 3072, 12288
    shapes = {  # module: (in, out)
        **{f"transformer_blocks.0.attn.{n}": (d, d) for n in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj")},
        "transformer_blocks.0.ff.net.0.proj": (d, mlp),
        "transformer_blocks.0.ff_context.net.2": (mlp, d),
        **{f"single_transformer_blocks.0.attn.{n}": (d, d) for n in ("to_q", "to_k", "to_v")},
        "single_transformer_blocks.0.proj_mlp": (d, mlp),
        "single_transformer_blocks.1.attn.to_q": (d, d),  # linear1 with three zero members
        "single_transformer_blocks.1.proj_out": (d + mlp, d),
    }
    names = list(shapes)
    state = {}
    for name, (fan_in, fan_out) in shapes.items():
        state[f"transformer.{name}.lora_A.weight"] = torch.randn(2, fan_in, generator=g)
        state[f"transformer.{name}.lora_B.weight"] = torch.randn(fan_out, 2, generator=g)
    dims = lora.fused_dims({"num_attention_heads": 24, "attention_head_dim": 128})
    comfy = lora.to_comfyui(state, "flux", dims)
    theirs = _convert_kohya_flux_lora_to_diffusers(dict(comfy))
    ours = lora.to_diffusers(comfy, "flux", dims)
    assert sorted(ours) == sorted(state)
    for name in names:
        a, b = f"transformer.{name}.lora_A.weight", f"transformer.{name}.lora_B.weight"
        assert torch.equal(ours[a], state[a]) and torch.equal(ours[b], state[b])
        assert torch.allclose(theirs[b] @ theirs[a], state[b] @ state[a], atol=1e-5)

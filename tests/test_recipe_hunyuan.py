"""The HunyuanVideo recipe (tiny model, cp=2): it trains, renders samples with CP at steps 0, 2 and 4, resumes
exactly from a light checkpoint, trains like one process, and its LoRA export is what it sampled with (in the
diffusers format and in ComfyUI's); bad input.

Its CP-rendered sample is compared with the one-process sample (1e-5) in tests/test_recipe_training.py, in
that file's spawned group.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_recipes import losses, run_recipe

ARGS = ("--trainer.max_steps=4", "--samples.every_n_steps=2", "--samples.num_inference_steps=2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hunyuan")
    straight = run_recipe(tmp, "straight", *ARGS, "--checkpoint.every_n_steps=2", recipe="hunyuan")
    # a new run started from the straight run's step-2 checkpoint: trains steps 3 and 4 again
    step2 = straight / "checkpoints" / "step_2.ckpt"
    resumed = run_recipe(tmp, "resumed", *ARGS, f"--ckpt_path={step2}", recipe="hunyuan")
    return {"tmp": tmp, "straight": straight, "resumed": resumed}


def _sampler():
    from recipes.sampling import SampleHunyuan

    # as the tiny config samples (embedded guidance 6.0), two steps
    return SampleHunyuan(
        num_frames=5, num_inference_steps=2, max_sequence_length=48, prompts=["a red circle moving right"]
    )


def _render(pipe) -> np.ndarray:
    sampler = _sampler()
    with torch.no_grad():
        return sampler.render(pipe, sampler.encode(pipe, sampler.prompts[0]), sampler.seed)  # F, H, W, 3


def test_the_tiny_hunyuan_recipe_trains_and_samples_with_cp(runs):
    run = runs["straight"]
    curve = losses(run)
    assert len(curve) == 4 and all(np.isfinite(curve)), curve
    for step in (0, 2, 4):  # rendered by both ranks of the CP group, logged to the CSV logger's folder
        assert (run / "samples" / f"step_{step}.png").stat().st_size > 0
        assert (run / "samples" / f"step_{step}.mp4").stat().st_size > 0
        assert (run / "logs" / "version_0" / "samples" / f"step_{step}.mp4").exists()
    assert (run / "samples.png").exists()


def test_the_exported_lora_loads_and_renders_the_step4_sample(runs):
    """The diffusers export loads into HunyuanVideoPipeline, changes its output, and renders in one process
    what the CP group rendered at step 4 (the 8-bit PNG: at most one level of rounding)."""
    from diffusers import HunyuanVideoPipeline
    from PIL import Image

    pipe = HunyuanVideoPipeline.from_pretrained(str(runs["tmp"] / "cache" / "tiny_hunyuan_pipeline"))
    pipe.set_progress_bar_config(disable=True)
    base = _render(pipe)
    pipe.load_lora_weights(str(runs["straight"] / "lora"))
    trained = _render(pipe)
    assert np.abs(trained - base).max() > 1e-3  # the LoRA matters
    grid = np.asarray(Image.open(runs["straight"] / "samples" / "step_4.png").convert("RGB")).astype(int)
    row = grid[: 32 * 4 : 4]  # the first prompt's row: its 5 frames side by side, 4x enlarged
    for f, frame in enumerate(trained):
        cell = row[:, f * 32 * 4 : (f + 1) * 32 * 4 : 4]
        assert np.abs(cell - (np.clip(frame, 0, 1) * 255).round().astype(int)).max() <= 1, f


def test_the_comfyui_layout_holds_the_same_lora_under_the_original_layer_names(runs, tmp_path):
    """The trained LoRA converted to ComfyUI's layout (musubi-tuner's keys: kohya's lora_unet_ with HunyuanVideo's
    original layer names, q/k/v stacked into the fused qkv and linear1 layers) and back renders what the diffusers
    export renders."""
    from diffusers import HunyuanVideoPipeline

    from recipes import lora
    from recipes.convert_lora import convert

    comfy = convert(runs["straight"] / "lora", tmp_path / "comfy", "comfyui")
    state, meta = lora.read(comfy)
    assert meta["cp_lightning.family"] == "hunyuan" and meta["ss_base_model_version"] == "hunyuan_video"
    layers = {key.split(".")[0] for key in state}
    for layer in ("double_blocks_0_img_attn_qkv", "double_blocks_0_txt_attn_proj", "single_blocks_0_linear1"):
        assert f"lora_unet_{layer}" in layers, sorted(layers)
    assert "lora_unet_txt_in_individual_token_refiner_blocks_0_self_attn_qkv" in layers  # the text token refiner
    back = convert(comfy, tmp_path / "back", "diffusers")
    pipe = HunyuanVideoPipeline.from_pretrained(str(runs["tmp"] / "cache" / "tiny_hunyuan_pipeline"))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(runs["straight"] / "lora"), adapter_name="exported")
    exported = _render(pipe)
    pipe.delete_adapters("exported")
    pipe.load_lora_weights(str(back.parent), adapter_name="round_trip")
    np.testing.assert_allclose(_render(pipe), exported, atol=1e-5)


def test_the_tiny_vae_reconstructs_moving_shapes_it_never_saw(runs):
    """The tiny pipeline's VAE is fitted to clips of moving shapes (recipes/tiny_vae.py), so its samples show
    what the transformer learned; its latents are scaled to unit variance, as the real VAE's scaling factor does."""
    from diffusers import AutoencoderKLHunyuanVideo

    from recipes.tiny_vae import _shapes

    clips = _shapes(frames=5, seed=7)[:16]  # other shapes than the fit's (seed 1)
    fitted = AutoencoderKLHunyuanVideo.from_pretrained(str(runs["tmp"] / "cache" / "tiny_hunyuan_pipeline" / "vae"))
    torch.manual_seed(0)
    untrained = AutoencoderKLHunyuanVideo.from_config(fitted.config)

    def error(vae):
        with torch.no_grad():
            z = vae.encode(clips).latent_dist.mode()
            return torch.nn.functional.mse_loss(vae.decode(z).sample, clips).item(), (
                z * vae.config.scaling_factor
            ).std()

    fit_error, scaled_std = error(fitted)
    assert fit_error < 0.1 * error(untrained)[0], (fit_error, error(untrained)[0])
    assert 0.8 < scaled_std < 1.25


def test_resume_from_a_light_checkpoint_is_exact(runs):
    from recipes import lora

    straight, resumed = losses(runs["straight"]), losses(runs["resumed"])
    assert resumed == pytest.approx(straight[2:], abs=1e-6)  # steps 3 and 4
    raw, meta = lora.read(runs["straight"] / "lora" / lora.WEIGHT_NAME)
    assert meta["cp_lightning.family"] == "hunyuan" and meta["ss_base_model_version"] == "hunyuan_video"
    trainable_bytes = sum(v.numel() for v in raw.values()) * 4
    checkpoint = runs["straight"] / "checkpoints" / "step_4.ckpt"
    assert checkpoint.stat().st_size <= 2 * 3 * trainable_bytes  # parameters + AdamW's two moments


def test_one_process_trains_like_the_cp2_group(runs, tmp_path):
    layout = ("--trainer.strategy=auto", "--trainer.devices=1", "--trainer.max_steps=2", "--samples.every_n_steps=0")
    layout += ("--samples.vae_tiling=true",)  # the preset's sampling option (no tiles at 32 px)
    single = run_recipe(tmp_path, "cp1", *layout, cache=runs["tmp"], recipe="hunyuan")
    # the same t draws (the fixed shift 7.0, per-sample generators), the same losses
    assert losses(single, "t") == losses(runs["straight"], "t")[:2]
    assert losses(single) == pytest.approx(losses(runs["straight"])[:2], abs=1e-5)


def test_the_prompt_template_keeps_the_caption(runs):
    """The tiny byte tokenizer's crop of HunyuanVideo's template leaves the caption's tokens first."""
    from transformers import ByT5Tokenizer

    from recipes.components import hunyuan_prompt_template

    tokenizer = ByT5Tokenizer.from_pretrained(str(runs["tmp"] / "cache" / "tiny_hunyuan_pipeline" / "tokenizer"))
    template = hunyuan_prompt_template(tokenizer)
    ids = tokenizer(template["template"].format("a red circle")).input_ids[template["crop_start"] :]
    assert tokenizer.decode(ids).startswith("a red circle<|eot_id|>")


def test_bad_input_is_a_clear_error(runs):
    from recipes.data import HunyuanData
    from recipes.hunyuan import HunyuanFineTune
    from recipes.sampling import SampleFlux, SampleHunyuan

    tmp = runs["tmp"]
    data = {"data_dir": str(tmp / "data" / "moving_shapes_5f"), "cache_dir": str(tmp / "cache")}
    with pytest.raises(ValueError, match=r"compresses 4 frames into one after the first: use 4k\+1 frames, e.g. 5"):
        HunyuanData(**data, num_frames=6).plan()
    with pytest.raises(ValueError, match="resolution 30 does not fit the model: it must be a multiple of 4"):
        HunyuanData(**data, resolution=30).plan()
    with pytest.raises(ValueError, match="guidance_scale must be > 0"):
        HunyuanFineTune(guidance_scale=0.0)
    with pytest.raises(ValueError, match=r"true_cfg_scale must be >= 1.0 \(1.0: no classifier-free guidance\)"):
        SampleHunyuan(true_cfg_scale=0.5)
    only = "true_cfg_scale is HunyuanVideo's and QwenImage's; the flux samples take guidance_scale"
    with pytest.raises(ValueError, match=only):
        SampleFlux(true_cfg_scale=2.0)

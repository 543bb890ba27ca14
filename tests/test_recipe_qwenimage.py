"""The QwenImage recipe (tiny model, cp=2) on images of two aspect ratios written here: it trains, renders samples
with CP at steps 0, 2 and 4, resumes exactly from a light checkpoint, splits the text tokens with the image's,
trains like one process, and its LoRA export is what it sampled with; the last block's unused text stream gets no
adapter; bad input.

Its CP-rendered sample (classifier-free guidance, text of two lengths) is compared with the one-process sample
(1e-5) in tests/test_recipe_training.py, in that file's spawned group.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from tests.test_recipes import ROOT, losses, run_recipe

ARGS = ("--trainer.max_steps=4", "--samples.every_n_steps=2", "--samples.num_inference_steps=2")
COLOURS = {"red": (220, 40, 40), "blue": (40, 60, 220), "green": (40, 180, 60), "yellow": (230, 210, 40)}


def _images(folder, square: int = 8, wide: int = 8):
    """Captioned shapes of 32 x 32 and 64 x 32 (width x height) pixels, on the captions of metadata.jsonl."""
    folder.mkdir(parents=True)
    rows = []
    for i in range(square + wide):
        name, colour = list(COLOURS.items())[i % len(COLOURS)]
        size = (32, 32) if i < square else (64, 32)
        image = Image.new("RGB", size, (250, 250, 250))
        x = 4 + 3 * (i % 5)
        ImageDraw.Draw(image).ellipse((x, 6, x + 18, 24), fill=colour)
        image.save(folder / f"{i:02d}.png")
        rows.append({"file_name": f"{i:02d}.png", "text": f"a {name} circle"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwenimage")
    data = _images(tmp / "circles")
    common = (*ARGS, f"--data.data_dir={data}", "--data.batch_size=2", "--checkpoint.every_n_steps=2")
    straight = run_recipe(tmp, "straight", *common, recipe="qwenimage")
    # a new run started from the straight run's step-2 checkpoint: trains steps 3 and 4 again
    step2 = straight / "checkpoints" / "step_2.ckpt"
    resumed = run_recipe(tmp, "resumed", *common, f"--ckpt_path={step2}", recipe="qwenimage")
    return {"tmp": tmp, "data": data, "common": common, "straight": straight, "resumed": resumed}


def _pipeline(runs):
    from diffusers import QwenImagePipeline

    from recipes.components import fit_prompt_template

    pipe = QwenImagePipeline.from_pretrained(str(runs["tmp"] / "cache" / "tiny_qwenimage_pipeline"))
    pipe.set_progress_bar_config(disable=True)
    return fit_prompt_template(pipe)


def _render(pipe) -> np.ndarray:
    from recipes.sampling import SampleQwenImage

    # as the tiny config samples (no classifier-free guidance: tests/test_recipe_training.py renders with it), two
    # steps
    sampler = SampleQwenImage(num_inference_steps=2, max_sequence_length=64)
    with torch.no_grad():
        return sampler.render(pipe, sampler.encode(pipe, sampler.prompts[0]), sampler.seed)[0]  # H, W, 3


def test_the_tiny_qwenimage_recipe_trains_and_samples_with_cp_on_two_aspect_ratios(runs):
    run = runs["straight"]
    curve = losses(run)
    assert len(curve) == 4 and all(np.isfinite(curve)), curve
    for step in (0, 2, 4):  # rendered by both ranks of the CP group, logged to the CSV logger's folder
        assert (run / "samples" / f"step_{step}.png").stat().st_size > 0
        assert (run / "logs" / "version_0" / "samples" / f"step_{step}.png").exists()
    assert (run / "samples.png").exists()
    with (run / "buckets.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and sum(int(r["samples"]) for r in rows) == 16, rows
    for row in rows:  # the image's 2x2 patches of the 2x VAE latents and the 64 text tokens, split by cp=2
        image = (int(row["height"]) // 4) * (int(row["width"]) // 4)
        assert int(row["tokens_per_sample"]) == image + 64
        assert int(row["tokens_per_cp_rank"]) == (image + 64) // 2


def test_resume_from_a_light_checkpoint_is_exact(runs):
    from recipes import lora

    straight, resumed = losses(runs["straight"]), losses(runs["resumed"])
    assert resumed == pytest.approx(straight[2:], abs=1e-6)  # steps 3 and 4
    raw, meta = lora.read(runs["straight"] / "lora" / lora.WEIGHT_NAME)
    assert meta["cp_lightning.family"] == "qwenimage" and meta["ss_base_model_version"] == "qwen_image"
    trainable_bytes = sum(v.numel() for v in raw.values()) * 4
    checkpoint = runs["straight"] / "checkpoints" / "step_4.ckpt"
    assert checkpoint.stat().st_size <= 2 * 3 * trainable_bytes  # parameters + AdamW's two moments


def test_the_exported_lora_loads_and_renders_the_step4_sample(runs):
    """The diffusers export loads into QwenImagePipeline, changes its output, and renders in one process what the
    CP group rendered at step 4 (the 8-bit PNG: at most one level of rounding)."""
    pipe = _pipeline(runs)
    base = _render(pipe)
    pipe.load_lora_weights(str(runs["straight"] / "lora"))
    trained = _render(pipe)
    assert np.abs(trained - base).max() > 1e-3  # the LoRA matters
    grid = np.asarray(Image.open(runs["straight"] / "samples" / "step_4.png").convert("RGB")).astype(int)
    cell = grid[: 32 * 4 : 4, : 32 * 4 : 4]  # the first prompt's image, 4x enlarged
    assert np.abs(cell - (np.clip(trained, 0, 1) * 255).round().astype(int)).max() <= 1


def test_the_last_blocks_text_stream_gets_no_adapter(runs):
    """Only the image stream of the last block reaches proj_out: its text queries, text output and text MLP get
    no LoRA (DDP refuses parameters without a gradient), and every adapter that is trained gets a gradient."""
    from recipes import lora
    from recipes.components import load_transformer
    from recipes.finetune import prepare_for_training
    from recipes.qwenimage import QwenImageFineTune

    raw, _ = lora.read(runs["straight"] / "lora" / lora.WEIGHT_NAME)
    last = "transformer.transformer_blocks.1"
    assert any(k.startswith("transformer.transformer_blocks.0.txt_mlp") for k in raw)  # the config targets it
    assert not any(k.startswith((f"{last}.txt_mlp", f"{last}.attn.to_add_out", f"{last}.attn.add_q_proj")) for k in raw)
    assert any(k.startswith(f"{last}.attn.add_k_proj") for k in raw)  # its text keys and values reach the image
    module = QwenImageFineTune()
    targets = [*module.lora_targets, "txt_mlp.net.0.proj", "txt_mlp.net.2"]
    for rank in (4, 0):  # LoRA, and a full fine-tune (the unused modules stay frozen)
        transformer = load_transformer("qwenimage", "tiny", runs["tmp"] / "cache")
        unused = module.unused_modules(transformer)
        transformer = prepare_for_training(transformer, rank, targets, 0, False, unused=unused)
        g = torch.Generator().manual_seed(0)
        out = transformer(
            hidden_states=torch.randn(1, 16, 16, generator=g),
            timestep=torch.rand(1, generator=g),
            encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
            encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long),
            img_shapes=[[(1, 4, 4)]],
            return_dict=False,
        )[0]
        out.square().mean().backward()
        trainable = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]
        assert trainable and all(p.grad is not None for _, p in trainable), [n for n, p in trainable if p.grad is None]


def test_one_process_trains_like_the_cp2_group(runs, tmp_path):
    layout = ("--trainer.strategy=auto", "--trainer.devices=1", "--trainer.max_steps=2", "--samples.every_n_steps=0")
    single = run_recipe(tmp_path, "cp1", *runs["common"], *layout, cache=runs["tmp"], recipe="qwenimage")
    # the same t draws (QwenImage's shift from each bucket's image tokens, per-sample generators), the same losses
    assert losses(single, "t") == losses(runs["straight"], "t")[:2]
    assert losses(single) == pytest.approx(losses(runs["straight"])[:2], abs=1e-5)


def test_training_times_are_shifted_as_the_pipelines_scheduler_samples(runs):
    """resolution_shift (QwenImage's default) is the scheduler's exp(mu) for the image token count, with the
    scheduler's own ends: 1328 px (6889 tokens) gives s = 2.30, where Flux's ends would give 5.07."""
    import math

    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from recipes import training
    from recipes.qwenimage import QwenImageFineTune

    config = _pipeline(runs).scheduler.config
    ends = [config[k] for k in ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")]
    for tokens in (64, 4096, 6889):
        expected = math.exp(calculate_shift(tokens, *ends))
        assert training.flux_shift(tokens, QwenImageFineTune.shift_range) == pytest.approx(expected, rel=1e-12)
    assert training.flux_shift(6889, QwenImageFineTune.shift_range) == pytest.approx(2.303, abs=1e-3)
    assert training.flux_shift(6889) == pytest.approx(5.067, abs=1e-3)  # Flux's ends
    assert QwenImageFineTune().hparams.resolution_shift


def test_the_tiny_vae_reconstructs_shapes_it_never_saw(runs):
    """The tiny pipeline's VAE is fitted to the synthetic shapes (recipes/tiny_vae.py), so its samples show what
    the transformer learned; its per-channel latents_mean and latents_std standardise the latents."""
    from diffusers import AutoencoderKLQwenImage

    from recipes.tiny_vae import _shapes

    images = _shapes(seed=7)[:16].unsqueeze(2)  # other shapes than the fit's (seed 1), as 1-frame clips
    fitted = AutoencoderKLQwenImage.from_pretrained(str(runs["tmp"] / "cache" / "tiny_qwenimage_pipeline" / "vae"))
    torch.manual_seed(0)
    untrained = AutoencoderKLQwenImage.from_config(fitted.config)

    def error(vae):
        with torch.no_grad():
            return torch.nn.functional.mse_loss(vae.decode(vae.encode(images).latent_dist.mode()).sample, images)

    assert error(fitted) < 0.1 * error(untrained), (error(fitted), error(untrained))
    with torch.no_grad():
        z = fitted.encode(images).latent_dist.mode()[:, :, 0]
    mean = torch.tensor(fitted.config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(fitted.config.latents_std).view(1, -1, 1, 1)
    scaled = (z - mean) / std
    assert scaled.mean().abs() < 0.2 and 0.8 < scaled.std() < 1.25


def test_the_prompt_template_keeps_the_caption(runs):
    """The byte tokenizer's count of QwenImage's system prompt leaves the caption's tokens first, and the cached
    text is padded to max_sequence_length with its mask."""
    from recipes.cache import qwenimage_encoder

    pipe = _pipeline(runs)
    template = pipe.prompt_template_encode
    ids = pipe.tokenizer(template.format("a red circle")).input_ids[pipe.prompt_template_encode_start_idx :]
    assert pipe.tokenizer.decode(ids).startswith("a red circle<|im_end|>")
    _, text = qwenimage_encoder(pipe, 64)
    with torch.no_grad():
        out = text(["a red circle", "a blue square on green", "a much longer caption of a blue square"])
    assert out["prompt_embeds"].shape == (3, 64, 32)
    # the caption and the template's end (34 bytes), up to max_sequence_length
    assert out["prompt_embeds_mask"].sum(1).tolist() == [12 + 34, 22 + 34, 64]
    padding = out["prompt_embeds_mask"] == 0
    assert (out["prompt_embeds"][padding] == 0).all()


def test_bad_input_is_a_clear_error(runs):
    from recipes.data import QwenImageData
    from recipes.sampling import SampleQwenImage

    tmp = runs["tmp"]
    data = {"data_dir": str(runs["data"]), "cache_dir": str(tmp / "cache")}
    with pytest.raises(ValueError, match=r"max_sequence_length must be in \[1, 1024\]"):
        QwenImageData(**data, max_sequence_length=2048)
    with pytest.raises(ValueError, match="resolution 30 does not fit the model: it must be a multiple of 4"):
        QwenImageData(**data, resolution=30).plan()
    with pytest.raises(ValueError, match="QwenImage has no distilled guidance; .* is samples.true_cfg_scale"):
        SampleQwenImage(guidance_scale=3.5)
    # no ComfyUI layout for QwenImage LoRAs: refused before training starts
    cmd = [sys.executable, "-m", "recipes.qwenimage", "fit", "--config", str(tmp / "straight.yaml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*cmd, "--export.format=comfyui"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0 and not (tmp / "straight" / "lora" / "comfyui").exists()
    assert "there is no ComfyUI LoRA layout for the qwenimage recipe" in result.stderr, result.stderr[-2000:]

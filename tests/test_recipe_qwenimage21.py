"""The Qwen-Image 2.1 recipe (tiny model, cp=2) on images of two aspect ratios written here: it trains on the
block-causal joint sequence, renders samples with CP at steps 0, 2 and 4, resumes exactly from a light checkpoint,
trains like one process, its CP-rendered sample equals the one-process sample, its LoRA export loads into
QwenImage21Pipeline and renders what the CP group rendered; the tiny processor gives the pipeline what
Qwen3VLProcessor would; bad input is refused before training.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from tests.distributed import spawn
from tests.test_recipes import losses, run_recipe

ARGS = ("--trainer.max_steps=4", "--samples.every_n_steps=2", "--samples.num_inference_steps=2")
PROMPTS = "--samples.prompts=[a red circle, a blue circle]"
COLOURS = {"red": (220, 40, 40), "blue": (40, 60, 220), "green": (40, 180, 60), "yellow": (230, 210, 40)}


def _images(folder, square: int = 4, wide: int = 4):
    """Captioned circles of 64 x 64 and 128 x 64 (width x height) pixels, captions of two lengths: buckets of 64 x 64
    and 96 x 32 at the 64 px budget."""
    folder.mkdir(parents=True)
    rows = []
    for i in range(square + wide):
        name, colour = list(COLOURS.items())[i % len(COLOURS)]
        size = (64, 64) if i < square else (128, 64)
        image = Image.new("RGB", size, (250, 250, 250))
        x = 8 + 6 * (i % 5)
        ImageDraw.Draw(image).ellipse((x, 12, x + 36, 48), fill=colour)
        image.save(folder / f"{i:02d}.png")
        text = f"a {name} circle" + (" on a white ground" if i % 2 else "")
        rows.append({"file_name": f"{i:02d}.png", "text": text})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The written images and the tiny pipeline, built in the cache the runs use (a second once its VAE's fit is
    cached on the machine)."""
    from recipes.components import resolve_pretrained

    tmp = tmp_path_factory.mktemp("qwenimage21")
    data = _images(tmp / "circles")
    resolve_pretrained("qwenimage21", "tiny", tmp / "cache")
    common = (*ARGS, PROMPTS, f"--data.data_dir={data}", "--data.batch_size=2", "--checkpoint.every_n_steps=2")
    return {"tmp": tmp, "data": data, "common": common}


@pytest.fixture(scope="module")
def runs(tiny):
    tmp, data, common = tiny["tmp"], tiny["data"], tiny["common"]
    straight = run_recipe(tmp, "straight", *common, recipe="qwenimage21")
    # a new run started from the straight run's step-2 checkpoint: trains steps 3 and 4 again
    step2 = straight / "checkpoints" / "step_2.ckpt"
    resumed = run_recipe(tmp, "resumed", *common, f"--ckpt_path={step2}", recipe="qwenimage21")
    return {"tmp": tmp, "data": data, "common": common, "straight": straight, "resumed": resumed}


def _pipeline(cache):
    from diffusers import QwenImage21Pipeline

    import recipes.qwenimage21_parts  # noqa: F401  (the tiny processor's module: diffusers loads it imported)

    pipe = QwenImage21Pipeline.from_pretrained(str(cache / "tiny_qwenimage21_pipeline"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _render(pipe, cfg: bool = False, width: int = 64) -> np.ndarray:
    from recipes.qwenimage21 import SampleQwenImage21

    sampler = SampleQwenImage21(
        num_inference_steps=2, resolution=64, width=width, true_cfg_scale=3.0 if cfg else 1.0, negative_prompt="blurry"
    )
    with torch.no_grad():
        return sampler.render(pipe, sampler.encode(pipe, sampler.prompts[0]), sampler.seed)[0]  # H, W, 3


def _levels(image: np.ndarray) -> np.ndarray:
    return (np.clip(image, 0, 1) * 255).round().astype(int)


def _cell(run, step: int) -> np.ndarray:
    """The first prompt's 64 x 64 image in the CP group's sample grid of ``step`` (4x enlarged there)."""
    grid = np.asarray(Image.open(run / "samples" / f"step_{step}.png").convert("RGB")).astype(int)
    return grid[: 64 * 4 : 4, : 64 * 4 : 4]


def test_the_tiny_qwenimage21_recipe_trains_and_samples_with_cp_on_two_aspect_ratios(runs):
    run = runs["straight"]
    curve = losses(run)
    assert len(curve) == 4 and all(np.isfinite(curve)), curve
    for step in (0, 2, 4):  # rendered by both ranks of the CP group, logged to the CSV logger's folder
        assert (run / "samples" / f"step_{step}.png").stat().st_size > 0
        assert (run / "logs" / "version_0" / "samples" / f"step_{step}.png").exists()
    with (run / "buckets.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and sum(int(r["samples"]) for r in rows) == 8, rows
    for row in rows:  # one token per 16 x 16 pixels and up to 64 text tokens, split by cp=2
        image = (int(row["height"]) // 16) * (int(row["width"]) // 16)
        assert int(row["tokens_per_sample"]) == image + 64
        assert int(row["tokens_per_cp_rank"]) == (image + 64) // 2
    # the step-0 sample (the base model) rendered by the CP group is the one-process render, to the 8-bit level
    assert np.abs(_cell(run, 0) - _levels(_render(_pipeline(runs["tmp"] / "cache")))).max() <= 1


def test_resume_from_a_light_checkpoint_is_exact(runs):
    from recipes import lora

    straight, resumed = losses(runs["straight"]), losses(runs["resumed"])
    assert resumed == pytest.approx(straight[2:], abs=1e-6)  # steps 3 and 4
    _, meta = lora.read(runs["straight"] / "lora" / lora.WEIGHT_NAME)
    assert meta["cp_lightning.family"] == "qwenimage21" and meta["ss_base_model_version"] == "qwen_image_2_1"


def test_one_process_trains_like_the_cp2_group(runs, tmp_path):
    layout = ("--trainer.strategy=auto", "--trainer.devices=1", "--trainer.max_steps=2", "--samples.every_n_steps=0")
    single = run_recipe(tmp_path, "cp1", *runs["common"], *layout, cache=runs["tmp"], recipe="qwenimage21")
    # the same t draws (the scheduler's shift from each bucket's image tokens, per-sample generators), the same losses
    assert losses(single, "t") == losses(runs["straight"], "t")[:2]
    assert losses(single) == pytest.approx(losses(runs["straight"])[:2], abs=1e-5)


def _perturb(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _cp_render(rank, world, cache):
    """A perturbed tiny base (every layer matters) renders a wide sample with and without classifier-free
    guidance (the negative prompt: another text length) at cp=world."""
    from cp_lightning import build_mesh, parallelize
    from recipes.components import load_pipeline

    pipe = load_pipeline("qwenimage21", "tiny", cache)
    pipe.set_progress_bar_config(disable=True)
    _perturb(pipe.transformer)
    if world > 1:
        parallelize(pipe.transformer, mesh=build_mesh(cp=world))
        # the block-causal segments run as one masked CP attention (the plan library's stand-in)
        assert type(pipe.transformer.transformer_blocks[0].attn.processor).__name__ == "QwenImage21SegmentAttention"
    return _render(pipe, width=128), _render(pipe, cfg=True, width=128)


def test_a_cp_rendered_sample_equals_the_one_process_sample(tiny):
    cache = tiny["tmp"] / "cache"
    results = spawn(_cp_render, 2, cache)
    single = _cp_render(0, 1, cache)
    assert single[0].shape == (64, 128, 3) and np.abs(single[0] - single[1]).max() > 1e-3  # guidance matters
    for sample in results:
        for cp, one in zip(sample, single, strict=True):
            np.testing.assert_allclose(cp, one, atol=1e-5)


def test_the_exported_lora_loads_and_renders_the_step4_sample(runs):
    """The diffusers export loads into QwenImage21Pipeline, changes its output, and renders in one process what the
    CP group rendered at step 4 (the 8-bit PNG: at most one level of rounding)."""
    pipe = _pipeline(runs["tmp"] / "cache")
    base = _render(pipe)
    pipe.load_lora_weights(str(runs["straight"] / "lora"))
    trained = _render(pipe)
    assert np.abs(trained - base).max() > 1e-3  # the LoRA matters
    assert np.abs(_cell(runs["straight"], 4) - _levels(trained)).max() <= 1


def test_the_tiny_processor_gives_the_pipeline_the_captions_tokens(tiny):
    """The tiny pipeline loads with its byte-tokenizer processor: the system message it counts is the template's,
    so the embeddings start at the user turn and hold the caption; cached text is padded with its mask."""
    from recipes.qwenimage21_parts import SPECIAL_TOKENS, encode_text

    pipe = _pipeline(tiny["tmp"] / "cache")
    template = pipe.prompt_template_t2i.format("a red circle")
    ids = pipe.processor(text=[template]).input_ids[0].tolist()
    kept = pipe.processor.tokenizer.decode(ids[pipe._drop_idx :])
    assert kept == "<|im_start|>user\na red circle<|im_end|>\n<|im_start|>assistant\n"
    assert pipe._img_token_id == pipe.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(set(pipe.processor.tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS))) == len(SPECIAL_TOKENS)
    with torch.no_grad():
        out = encode_text(pipe, ["a red circle", "a blue circle on a white ground"], 64)
    assert out["prompt_embeds"].shape == (2, 64, 32)
    assert out["prompt_embeds_mask"].sum(1).tolist() == [12 + 19, 31 + 19]  # the caption and the template's turn
    assert (out["prompt_embeds"][out["prompt_embeds_mask"] == 0] == 0).all()


def test_the_tiny_vae_compresses_16x_and_reconstructs_shapes_it_never_saw(tiny):
    from diffusers import AutoencoderKLQwenImage21

    from recipes.tiny_vae import _shapes

    images = _shapes(seed=7)[:16].unsqueeze(2)  # other shapes than the fit's, as 1-frame clips
    fitted = AutoencoderKLQwenImage21.from_pretrained(str(tiny["tmp"] / "cache" / "tiny_qwenimage21_pipeline" / "vae"))
    torch.manual_seed(0)
    untrained = AutoencoderKLQwenImage21.from_config(fitted.config)

    def error(vae):
        with torch.no_grad():
            return torch.nn.functional.mse_loss(vae.decode(vae.encode(images).latent_dist.mode()).sample, images)

    with torch.no_grad():
        assert fitted.encode(images).latent_dist.mode().shape[-2:] == (2, 2)  # 32 px -> 2 x 2 latents
    assert error(fitted) < 0.3 * error(untrained), (error(fitted), error(untrained))


def test_bad_input_is_refused_before_training(tiny, monkeypatch):
    import importlib.util
    from types import SimpleNamespace

    from recipes.qwenimage21 import QwenImage21Data, QwenImage21FineTune, SampleQwenImage21
    from recipes.qwenimage21_parts import check_processor, encode_text

    tmp = tiny["tmp"]
    data = {"data_dir": str(tiny["data"]), "cache_dir": str(tmp / "cache")}
    with pytest.raises(ValueError, match="resolution 48 does not fit the model: it must be a multiple of 32"):
        QwenImage21Data(**data, resolution=48).plan()
    with pytest.raises(ValueError, match=r"samples.width=80 does not fit Qwen-Image 2.1: it must be a multiple of 32"):
        SampleQwenImage21(resolution=64, width=80)
    with pytest.raises(ValueError, match="Qwen-Image 2.1 has no distilled guidance"):
        SampleQwenImage21(guidance_scale=3.5)
    with pytest.raises(ValueError, match=r"takes 31 text tokens .* more than max_sequence_length=16"):
        encode_text(_pipeline(tmp / "cache"), ["a red circle"], 16)
    # a real checkpoint's processor (Qwen3VLProcessor) needs torchvision: said before anything loads
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else real(name, *a))
    with pytest.raises(ValueError, match="needs torchvision, which is not installed: pip install torchvision"):
        QwenImage21Data(**data, pretrained="Qwen/Qwen-Image-2.1")
    check_processor("tiny")  # the tiny one needs nothing
    monkeypatch.undo()
    # loss-parallel mode would leave each rank a shard of the joint [text | image] output
    module = QwenImage21FineTune(cache_dir=str(tmp / "cache"))
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(loss_parallel=True))
    with pytest.raises(ValueError, match="loss_parallel=True keeps each rank's shard"):
        module.configure_model()


def test_a_comfyui_export_is_refused_before_training(tiny):
    tmp = tiny["tmp"]
    with pytest.raises(ValueError, match="there is no ComfyUI LoRA layout for the qwenimage21 recipe"):
        run_recipe(tmp, "comfyui", *tiny["common"], "--export.format=comfyui", recipe="qwenimage21")
    assert not (tmp / "comfyui" / "loss.csv").exists() and not (tmp / "comfyui" / "buckets.csv").exists()

"""The FLUX.3 recipe (tiny model, cp=2) on files written here in two aspect buckets (32x32 and 64x32): reference-
image editing on Kontext-layout pairs trains, samples with CP at steps 0, 2 and 4, resumes exactly from a light
checkpoint and trains like one process; text to image trains and samples; the exported LoRAs load into diffusers'
Flux3ModularPipeline and render in one process the CP group's last samples; the step-0 samples are the base
model's; a sample rendered at cp=2 (text to image, and an edit whose reference tokens are split) equals the
one-process sample; bad input is refused before training.
"""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from tests.distributed import spawn
from tests.test_recipes import losses, run_recipe

ARGS = ("--trainer.max_steps=4", "--samples.every_n_steps=2", "--samples.num_inference_steps=2")
COLOURS = {"red": (220, 40, 40), "blue": (40, 60, 220), "green": (40, 180, 60), "yellow": (230, 210, 40)}
EDITS = ["make the circle blue", "make the circle red"]


def _circle(size, colour, i):
    image = Image.new("RGB", size, (250, 250, 250))
    x = 4 + 3 * (i % 5)
    ImageDraw.Draw(image).ellipse((x, 6, x + 18, 24), fill=colour)
    return image


def _write(folder, pairs: bool, square: int = 4, wide: int = 4):
    """Captioned circles of 32 x 32 and 64 x 32 (width x height) pixels; with ``pairs`` each target has its
    reference in control/ (the circle in another colour) and the edit instruction as its caption."""
    (folder / "control").mkdir(parents=True)
    names = list(COLOURS)
    rows = []
    for i in range(square + wide):
        size = (32, 32) if i < square else (64, 32)
        after, before = names[i % 4], names[(i + 1) % 4]
        _circle(size, COLOURS[after], i).save(folder / f"{i:02d}.png")
        if pairs:
            _circle(size, COLOURS[before], i).save(folder / "control" / f"{i:02d}.png")
        rows.append({"file_name": f"{i:02d}.png", "text": f"make the circle {after}" if pairs else f"a {after} circle"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux3")
    pairs, images = _write(tmp / "pairs", pairs=True), _write(tmp / "circles", pairs=False)
    # the edit samples take the references of the data's first two pairs (no samples.images)
    edit = (*ARGS, f"--data.data_dir={pairs}", "--data.edit=true", f"--samples.prompts={json.dumps(EDITS)}")
    common = (*edit, "--data.batch_size=2", "--checkpoint.every_n_steps=2")
    straight = run_recipe(tmp, "edit", *common, recipe="flux3")
    step2 = straight / "checkpoints" / "step_2.ckpt"
    resumed = run_recipe(tmp, "resumed", *common, f"--ckpt_path={step2}", recipe="flux3")
    t2i = run_recipe(tmp, "t2i", *ARGS, f"--data.data_dir={images}", "--data.batch_size=2", recipe="flux3")
    return {"tmp": tmp, "pairs": pairs, "common": common, "edit": straight, "resumed": resumed, "t2i": t2i}


def _pipeline(runs):
    from recipes.components import load_pipeline

    pipe = load_pipeline("flux3", "tiny", runs["tmp"] / "cache")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sampler(runs=None, prompts=None, steps: int = 2, references=()):
    """The recipe's sampler as the runs configure it, with the references of ``references`` (paths)."""
    from recipes.flux3 import SampleFlux3
    from recipes.media import Source

    sampler = SampleFlux3(prompts=prompts, num_inference_steps=steps, guidance_scale=1.0)
    if references:
        sampler.references = sampler.encode_references(_pipeline(runs), [Source(str(p), "", False) for p in references])
    return sampler


def _grid_cell(path, row: int) -> np.ndarray:
    grid = np.asarray(Image.open(path).convert("RGB")).astype(int)
    top = row * (32 * 4 + 14)
    return grid[top : top + 32 * 4 : 4, : 32 * 4 : 4]  # the row's first image, 4x enlarged


def _as_png(sample: np.ndarray) -> np.ndarray:
    return (np.clip(sample, 0, 1) * 255).round().astype(int)


def test_edit_pairs_of_two_aspect_ratios_train_and_sample_with_cp(runs):
    run = runs["edit"]
    curve = losses(run)
    assert len(curve) == 4 and all(np.isfinite(curve)), curve
    for step in (0, 2, 4):  # rendered by both ranks of the CP group, logged to the CSV logger's folder
        assert (run / "samples" / f"step_{step}.png").stat().st_size > 0
        assert (run / "logs" / "version_0" / "samples" / f"step_{step}.png").exists()
    with (run / "buckets.csv").open() as f:
        rows = {r["bucket"]: r for r in csv.DictReader(f)}
    # the reference's tokens (a mode of their own) join the target's: 2 x 64 image tokens (2 x 66 for the 2:1
    # bucket of the 32 x 32 pixel budget, 44 x 24) + 32 text, halved at cp=2
    assert {b: (int(r["tokens_per_sample"]), int(r["tokens_per_cp_rank"])) for b, r in rows.items()} == {
        "32x32": (160, 80),
        "44x24": (164, 82),
    }
    t2i = losses(runs["t2i"])  # text to image on captioned circles: one mode less
    assert len(t2i) == 4 and all(np.isfinite(t2i))
    for step in (0, 2, 4):
        assert (runs["t2i"] / "samples" / f"step_{step}.png").stat().st_size > 0


def test_resume_from_a_light_checkpoint_is_exact(runs):
    from recipes import lora

    straight, resumed = losses(runs["edit"]), losses(runs["resumed"])
    assert resumed == pytest.approx(straight[2:], abs=1e-6)  # steps 3 and 4
    raw, meta = lora.read(runs["edit"] / "lora" / lora.WEIGHT_NAME)
    assert meta["cp_lightning.family"] == "flux3"
    assert any(".mode_blocks.image_cond." in k for k in raw)  # editing trains the reference mode's blocks too
    t2i, _ = lora.read(runs["t2i"] / "lora" / lora.WEIGHT_NAME)
    assert t2i and not any("image_cond" in k for k in t2i)  # text to image: that mode gets no input, no adapter
    checkpoint = runs["edit"] / "checkpoints" / "step_4.ckpt"
    assert checkpoint.stat().st_size <= 2 * 3 * sum(v.numel() for v in raw.values()) * 4  # + AdamW's two moments


def test_the_exported_loras_load_into_the_pipeline_and_render_the_last_samples(runs):
    """Each run's diffusers export loads into diffusers' Flux3ModularPipeline (its own LoRA loader), changes its
    output, and renders in one process what the CP group rendered at step 4 (8-bit PNG: one level of rounding);
    the step-0 samples are the base model's (the LoRA starts as a zero update)."""
    references = [runs["pairs"] / "control" / f"{i:02d}.png" for i in range(2)]  # the data's first pairs
    for name, sampler in (("t2i", _sampler()), ("edit", _sampler(runs, EDITS, references=references))):
        pipe = _pipeline(runs)
        with torch.no_grad():
            embeds = [sampler.encode(pipe, p) for p in sampler.prompts]
            base = [sampler.render(pipe, e, sampler.seed + i)[0] for i, e in enumerate(embeds)]
            pipe.denoiser(sampler.guidance).load_lora_weights(str(runs[name] / "lora"))
            trained = [sampler.render(pipe, e, sampler.seed + i)[0] for i, e in enumerate(embeds)]
        assert np.abs(trained[0] - base[0]).max() > 1e-3, name  # the LoRA matters
        for i in range(len(sampler.prompts)):
            step0 = _grid_cell(runs[name] / "samples" / "step_0.png", i)
            assert np.abs(step0 - _as_png(base[i])).max() <= 1, (name, i)
            step4 = _grid_cell(runs[name] / "samples" / "step_4.png", i)
            assert np.abs(step4 - _as_png(trained[i])).max() <= 1, (name, i)


def test_one_process_trains_like_the_cp2_group(runs, tmp_path):
    layout = ("--trainer.strategy=auto", "--trainer.devices=1", "--trainer.max_steps=2", "--samples.every_n_steps=0")
    single = run_recipe(tmp_path, "cp1", *runs["common"], *layout, cache=runs["tmp"], recipe="flux3")
    assert losses(single, "t") == losses(runs["edit"], "t")[:2]
    assert losses(single) == pytest.approx(losses(runs["edit"])[:2], abs=1e-5)


def _render(rank, world, cache, reference):
    """A text-to-image sample and an edit of ``reference`` by the recipe's sampler, with a perturbed tiny base
    (every layer matters), at cp=world; and the token counts each mode's first block sees on this rank."""
    from cp_lightning import build_mesh, parallelize
    from recipes.components import load_pipeline
    from recipes.media import Source
    from tests.test_recipe_training import _perturb

    pipe = load_pipeline("flux3", "tiny", cache)
    _perturb(pipe.transformer)
    seen = {}
    for name, block in (("image", pipe.transformer.mode_blocks["image"][0]),
                        ("reference", pipe.transformer.mode_blocks["image_cond"][0]),
                        ("text", pipe.transformer.txt_mode_blocks[0])):  # fmt: skip
        block.register_forward_pre_hook(lambda m, a, name=name: seen.setdefault(name, a[0].shape[1]) and None)
    if world > 1:
        parallelize(pipe.transformer, mesh=build_mesh(cp=world))
    out = {}
    for mode, guidance in (("t2i", 3.0), ("edit", 1.0)):  # t2i with classifier-free guidance (two passes a step)
        sampler = _sampler(prompts=["a red circle"], steps=3)
        sampler.guidance = guidance
        if mode == "edit":
            sampler.references = sampler.encode_references(pipe, [Source(reference, "", False)])
        with torch.no_grad():
            out[mode] = sampler.render(pipe, sampler.encode(pipe, sampler.prompts[0]), sampler.seed)
    return out, seen


def test_a_cp_rendered_sample_equals_the_one_process_sample(runs):
    cache = runs["tmp"] / "cache"
    reference = str(runs["pairs"] / "control" / "05.png")  # a 2:1 one, 64 x 32 pixels, cropped to 32 x 32
    single, seen = _render(0, 1, cache, reference)
    assert seen == {"text": 32, "image": 64, "reference": 64}
    assert np.abs(single["edit"] - _render_without_reference(cache)).max() > 1e-3  # the reference matters
    for sample, split in spawn(_render, 2, cache, reference, timeout_s=600):
        assert split == {"text": 16, "image": 32, "reference": 32}  # every mode split in half
        for mode in ("t2i", "edit"):
            np.testing.assert_allclose(sample[mode], single[mode], atol=1e-5)


def _render_without_reference(cache):
    from recipes.components import load_pipeline
    from tests.test_recipe_training import _perturb

    pipe = load_pipeline("flux3", "tiny", cache)
    _perturb(pipe.transformer)
    sampler = _sampler(prompts=["a red circle"], steps=3)
    with torch.no_grad():
        return sampler.render(pipe, sampler.encode(pipe, sampler.prompts[0]), sampler.seed)


def test_the_tiny_pipelines_vae_and_text_window(runs):
    """The Flux.2 VAE is fitted to the shapes and its batch-norm statistics standardise the patchified latents
    (recipes/tiny_vae.py); captions of any length are encoded in a window of exactly max_sequence_length."""
    from diffusers import AutoencoderKLFlux2

    from recipes.flux3_pipeline import encode_latents, encode_prompts
    from recipes.tiny_vae import _shapes

    pipe = _pipeline(runs)
    images = _shapes(seed=7)[:16]  # other shapes than the fit's (seed 1)
    torch.manual_seed(0)
    untrained = AutoencoderKLFlux2.from_config(pipe.vae.config)

    def error(vae):
        with torch.no_grad():
            return torch.nn.functional.mse_loss(vae.decode(vae.encode(images).latent_dist.mode()).sample, images)

    assert error(pipe.vae) < 0.1 * error(untrained), (error(pipe.vae), error(untrained))
    with torch.no_grad():
        z = encode_latents(pipe.vae, images)
    assert z.shape == (16, 16, 8, 8) and z.mean().abs() < 0.2 and 0.8 < z.std() < 1.25
    with torch.no_grad():
        text = encode_prompts(pipe, ["a red circle", "a much longer caption than the window of 32 bytes"], 32)
    assert text.shape == (2, 32, pipe.transformer.config.joint_attention_dim)


def test_bad_input_is_refused_before_training(runs, tmp_path):
    from types import SimpleNamespace

    from recipes.flux3 import Flux3Data, Flux3FineTune, SampleFlux3

    cache = str(runs["tmp"] / "cache")
    data = _write(tmp_path / "pairs", pairs=True, square=2, wide=2)

    def plan(**kwargs):
        return Flux3Data(data_dir=str(data), cache_dir=cache, batch_size=2, edit=True, **kwargs).plan()

    assert len(plan()) == 4
    with pytest.raises(ValueError, match="resolution 30 does not fit the model: it must be a multiple of 4"):
        plan(resolution=30)
    (data / "control" / "01.png").unlink()
    with pytest.raises(ValueError, match=r"01.png has no reference image: put it at .*control/01.png"):
        plan()
    with pytest.raises(ValueError, match="samples.images: .*nope.png does not exist"):
        SampleFlux3(images=[str(tmp_path / "nope.png")], prompts=["make it red"]).check_images()
    sampler = SampleFlux3(images=[str(data / "00.png")], prompts=["make it red"])
    with pytest.raises(ValueError, match="this run trains text to image: set data.edit=true"):
        sampler.prepare(SimpleNamespace(), SimpleNamespace(hparams=SimpleNamespace(edit=False)))
    distilled = tmp_path / "distilled"  # a step-distilled (flow-map) checkpoint
    shutil.copytree(runs["tmp"] / "cache" / "tiny_flux3_pipeline", distilled)
    config = json.loads((distilled / "transformer" / "config.json").read_text())
    (distilled / "transformer" / "config.json").write_text(json.dumps({**config, "flow_map": True}))
    with pytest.raises(ValueError, match=r"step-distilled \(flow-map\) FLUX.3 transformer"):
        Flux3FineTune(str(distilled), cache_dir=cache).configure_model()
    # no ComfyUI layout for FLUX.3 LoRAs: refused before training starts
    with pytest.raises(ValueError, match="there is no ComfyUI LoRA layout for the flux3 recipe"):
        run_recipe(tmp_path, "comfyui", *runs["common"], "--export.format=comfyui", cache=runs["tmp"], recipe="flux3")
    assert not (tmp_path / "comfyui" / "checkpoints").exists()

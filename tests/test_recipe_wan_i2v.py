"""The Wan image-to-video recipe (tiny Wan2.1 I2V: first-frame condition channels and CLIP image tokens) at cp=2
on mp4 clips of two aspect ratios: it trains and samples from first frames, conditions each clip on its own first
frame, resumes exactly from a mid-run checkpoint, renders under CP what one process renders, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.distributed import spawn
from tests.test_recipe_data import write_video
from tests.test_recipes import losses, run_recipe


def _clips(folder, n: int = 8):
    """``n`` 5-frame mp4 clips, half 32 x 32 and half 64 x 32 pixels (width x height), captioned."""
    folder.mkdir(parents=True)
    rows = []
    for i in range(n):
        width = 32 if i < n // 2 else 64
        write_video(folder / f"{i:02d}.mp4", 5, width, 32)
        rows.append({"file_name": f"{i:02d}.mp4", "text": "a white bar moving right"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wan_i2v")
    data = _clips(tmp / "clips")
    common = (
        "--trainer.max_steps=4",
        "--samples.every_n_steps=2",
        "--samples.num_inference_steps=2",
        "--checkpoint.every_n_steps=2",
        f"--data.data_dir={data}",
    )
    straight = run_recipe(tmp, "cp2", *common, recipe="wan_i2v")
    step2 = straight / "checkpoints" / "step_2.ckpt"
    resumed = run_recipe(tmp, "resumed", *common, f"--ckpt_path={step2}", recipe="wan_i2v")
    return {"tmp": tmp, "data": data, "straight": straight, "resumed": resumed}


def test_clips_of_two_aspect_ratios_train_and_sample_from_first_frames_at_cp2(run):
    import csv

    out = run["straight"]
    assert len(losses(out)) == 4 and all(np.isfinite(losses(out)))
    with (out / "buckets.csv").open() as f:
        rows = {r["bucket"]: (int(r["tokens_per_sample"]), int(r["tokens_per_cp_rank"])) for r in csv.DictReader(f)}
    assert rows == {"32x32x5f": (320, 160), "44x24x5f": (330, 165)}  # 5 latent frames x 2 x 2 patches, halved at cp=2
    for step in (0, 2, 4):
        assert (out / "samples" / f"step_{step}.png").stat().st_size > 0
        assert (out / "samples" / f"step_{step}.mp4").stat().st_size > 0
    assert (out / "lora" / "pytorch_lora_weights.safetensors").exists()


def test_resume_from_a_mid_run_checkpoint_draws_the_straight_runs_losses(run):
    assert losses(run["resumed"]) == pytest.approx(losses(run["straight"])[2:], abs=1e-6)  # steps 3 and 4


def test_each_clip_is_conditioned_on_its_own_first_frame(run):
    """The cached condition is the VAE's encoding of [first frame, black frames]: its first latent frame is the
    clip's own (the tiny causal VAE compresses no frames), the others are not; CLIP tokens come with it."""
    from recipes.wan_i2v import WanI2VData

    data = WanI2VData(data_dir=str(run["data"]), cache_dir=str(run["tmp"] / "cache"))
    data.setup("fit")
    for item in (data.dataset[0], data.dataset[len(data.dataset) - 1]):
        latents, condition = item["latents"], item["condition_latents"]
        assert condition.shape == latents.shape
        torch.testing.assert_close(condition[:, 0], latents[:, 0], atol=1e-5, rtol=0)
        assert (condition[:, 1:] - latents[:, 1:]).abs().max() > 1e-2
        assert item["image_embeds"].shape == (17, 16)  # (32 / 8)^2 patches + the class token, CLIP width 16


def _sample(rank, world, cache, image):
    """An image-to-video sample of a perturbed tiny base (every layer matters) by the recipe's sampler at
    cp=world: video tokens split, CLIP image and text tokens whole, classifier-free guidance 5.0."""
    from PIL import Image

    from cp_lightning import build_mesh, parallelize
    from recipes.components import load_pipeline
    from recipes.wan_i2v import SampleWanI2V
    from tests.test_recipe_training import _perturb

    sampler = SampleWanI2V(prompts=["a white bar moving right"], images=[image], num_frames=5, num_inference_steps=3)
    pipe = load_pipeline("wan_i2v", "tiny", cache)
    pipe.set_progress_bar_config(disable=True)
    _perturb(pipe.transformer)
    if world > 1:
        parallelize(pipe.transformer, mesh=build_mesh(cp=world))
    sampler.references = [Image.open(image).convert("RGB").resize((32, 32))]
    with torch.no_grad():
        return sampler.render(pipe, sampler.encode(pipe, sampler.prompts[0]), sampler.seed)


def test_a_cp_rendered_sample_equals_the_one_process_sample(run, tmp_path):
    from PIL import Image

    image = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(image)
    single = _sample(0, 1, run["tmp"] / "cache", str(image))
    assert single.shape == (5, 32, 32, 3)
    for sample in spawn(_sample, 2, run["tmp"] / "cache", str(image), timeout_s=600):
        np.testing.assert_allclose(sample, single, atol=1e-5)


def test_bad_input_is_a_clear_error(run):
    from types import SimpleNamespace

    from recipes.wan_i2v import SampleWanI2V, WanI2VData

    with pytest.raises(
        ValueError,
        match=r"clips of 4 frames do not fit the VAE, which encodes chunks of 4 after the first: use 4k\+1 frames",
    ):
        WanI2VData(data_dir=str(run["data"]), cache_dir=str(run["tmp"] / "cache"), num_frames=4).plan()
    with pytest.raises(ValueError, match="set data.max_sequence_length: 512"):
        WanI2VData(data_dir=str(run["data"]), cache_dir=str(run["tmp"] / "cache"), max_sequence_length=32).setup("fit")
    with pytest.raises(ValueError, match=r"samples.images must give one image per prompt \(2 prompts, 1 images\)"):
        SampleWanI2V(prompts=["a", "b"], images=["one.png"])
    with pytest.raises(ValueError, match=r"samples.images: nowhere.png does not exist \(the first frame of the prompt"):
        SampleWanI2V(prompts=["a"], images=["nowhere.png"]).prepare(SimpleNamespace(), None)
    with pytest.raises(ValueError, match="samples need one first frame per prompt .* give samples.images"):
        SampleWanI2V(prompts=["a"]).prepare(SimpleNamespace(), None)

"""The SkyReels-V2 diffusion-forcing recipe (tiny model, causal blocks of 2 latent frames, cp=2) on clips of two
lengths written here: it trains with a time per block (a ring of 2 in the head_tail layout), renders samples with CP
at steps 0, 2 and 4, resumes exactly from a light checkpoint, its CP-rendered sample equals the one-process sample,
its LoRA export loads into diffusers' pipeline and renders what the CP group rendered; clip lengths that do not fill
whole blocks are refused.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.distributed import spawn
from tests.test_recipe_data import write_video
from tests.test_recipes import losses, run_recipe

ARGS = ("--trainer.max_steps=4", "--samples.every_n_steps=2", "--samples.num_inference_steps=2")


def _clips(folder):
    """Four clips of 13 frames (4 latent frames: 2 causal blocks) and four of 21 (6 latent frames: 3 blocks)."""
    folder.mkdir(parents=True)
    rows = []
    for i in range(8):
        frames = 13 if i < 4 else 21
        write_video(folder / f"{i:02d}.mp4", frames, 32, 32)
        rows.append({"file_name": f"{i:02d}.mp4", "text": f"a white bar moving right {i}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("skyreels_df")
    data = _clips(tmp / "clips")
    common = (
        *ARGS,
        f"--data.data_dir={data}",
        "--data.frame_buckets=[13, 21]",
        "--data.num_frames=21",
        "--data.batch_size=2",
        "--checkpoint.every_n_steps=2",
        "--samples.prompts=[a white bar moving right]",
        # a ring of 2 whose ranks hold a head and a tail run of whole frames: balanced under the causal blocks
        "--trainer.strategy.init_args.ring=2",
        "--trainer.strategy.init_args.layout=head_tail",
    )
    straight = run_recipe(tmp, "straight", *common, recipe="skyreels_df")
    step2 = straight / "checkpoints" / "step_2.ckpt"
    resumed = run_recipe(tmp, "resumed", *common, f"--ckpt_path={step2}", recipe="skyreels_df")
    return {"tmp": tmp, "data": data, "common": common, "straight": straight, "resumed": resumed}


def test_the_tiny_skyreels_df_recipe_trains_and_samples_with_cp_on_clips_of_two_lengths(runs):
    run = runs["straight"]
    curve = losses(run)
    assert len(curve) == 4 and all(np.isfinite(curve)), curve
    for step in (0, 2, 4):
        assert (run / "samples" / f"step_{step}.png").stat().st_size > 0
    with (run / "buckets.csv").open() as f:
        rows = {int(r["frames"]): r for r in csv.DictReader(f)}
    assert set(rows) == {13, 21}
    for frames, row in rows.items():  # (frames - 1) / 4 + 1 latent frames of 4 x 4 tokens, split by cp=2
        tokens = ((frames - 1) // 4 + 1) * 16
        assert int(row["tokens_per_sample"]) == tokens and int(row["tokens_per_cp_rank"]) == tokens // 2


def test_resume_from_a_light_checkpoint_is_exact(runs):
    from recipes import lora

    straight, resumed = losses(runs["straight"]), losses(runs["resumed"])
    assert resumed == pytest.approx(straight[2:], abs=1e-6)  # steps 3 and 4
    _, meta = lora.read(runs["straight"] / "lora" / lora.WEIGHT_NAME)
    assert meta["cp_lightning.family"] == "skyreels_df"


def test_block_times_are_drawn_per_block_and_layout_independent():
    """One time per causal block (a shorter last block included), the same for a sample wherever it is batched."""
    from types import SimpleNamespace

    from recipes.skyreels_df import SkyReelsDFFineTune

    module = SkyReelsDFFineTune()
    module.transformer = SimpleNamespace(config=SimpleNamespace(num_frame_per_block=2))
    t = module.block_times(torch.tensor([3, 5]), 5)
    assert t.shape == (2, 5) and bool(((t >= 0) & (t <= 1)).all())
    assert torch.equal(t[:, 0], t[:, 1]) and torch.equal(t[:, 2], t[:, 3]) and not torch.equal(t[:, 1], t[:, 2])
    assert not torch.equal(t[:, 3], t[:, 4])  # the last block, one frame
    assert torch.equal(module.block_times(torch.tensor([5]), 5)[0], t[1])
    with pytest.raises(ValueError, match="a time per block, so use loss_weighting: none"):
        SkyReelsDFFineTune(loss_weighting="cosmap")
    with pytest.raises(ValueError, match="one transformer"):
        SkyReelsDFFineTune(expert="high_noise")


def _perturb(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _render(pipe, cfg: bool = True) -> np.ndarray:
    from recipes.skyreels_df import SampleSkyReelsDF

    sampler = SampleSkyReelsDF(num_frames=21, num_inference_steps=2, guidance_scale=5.0 if cfg else 1.0)
    with torch.no_grad():
        return sampler.render(pipe, sampler.encode(pipe, sampler.prompts[0]), sampler.seed)


def _cp_render(rank, world, cache):
    """A perturbed tiny base (every layer matters) samples 6 latent frames (3 causal blocks) at cp=world."""
    from cp_lightning import build_mesh, parallelize
    from recipes.components import load_pipeline

    pipe = load_pipeline("skyreels_df", "tiny", cache)
    pipe.set_progress_bar_config(disable=True)
    _perturb(pipe.transformer)
    if world > 1:
        parallelize(pipe.transformer, mesh=build_mesh(cp=world))
    return _render(pipe)


def test_a_cp_rendered_sample_equals_the_one_process_sample(runs):
    cache = runs["tmp"] / "cache"
    results = spawn(_cp_render, 2, cache)
    single = _cp_render(0, 1, cache)
    assert single.shape == (21, 32, 32, 3)
    for sample in results:
        np.testing.assert_allclose(sample, single, atol=1e-5)


def test_the_exported_lora_loads_and_renders_the_step4_sample(runs):
    from recipes.components import load_pipeline
    from recipes.skyreels_df import SampleSkyReelsDF

    pipe = load_pipeline("skyreels_df", "tiny", runs["tmp"] / "cache")
    pipe.set_progress_bar_config(disable=True)
    sampler = SampleSkyReelsDF(num_frames=13, num_inference_steps=2, prompts=["a white bar moving right"])
    with torch.no_grad():
        base = sampler.render(pipe, sampler.encode(pipe, sampler.prompts[0]), sampler.seed)
        pipe.load_lora_weights(str(runs["straight"] / "lora"))
        trained = sampler.render(pipe, sampler.encode(pipe, sampler.prompts[0]), sampler.seed)
    assert np.abs(trained - base).max() > 1e-3  # the LoRA matters
    grid = np.asarray(Image.open(runs["straight"] / "samples" / "step_4.png").convert("RGB")).astype(int)
    cell = grid[: 32 * 4 : 4, : 32 * 4 : 4]  # the first frame of the prompt's clip, 4x enlarged
    assert np.abs(cell - (np.clip(trained[0], 0, 1) * 255).round().astype(int)).max() <= 1


def test_clips_that_do_not_fill_whole_blocks_are_refused_before_training(runs):
    with pytest.raises(ValueError, match=r"clips of 9 frames give 3 latent frames.*causal blocks of 2"):
        run_recipe(runs["tmp"], "partial", f"--data.data_dir={runs['data']}", "--data.num_frames=9",
                   "--data.dry_run=true", recipe="skyreels_df")  # fmt: skip

"""The Flux Kontext editing recipe: paired data of two aspect ratios trained and sampled at cp=2, resumed exactly
from a mid-run checkpoint, the reference's tokens split with the target's, the gradient and a CP-rendered edit
against one process, and the pairing errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.distributed import spawn
from tests.test_recipes import losses, run_recipe


def _pairs(folder, square: int = 8, wide: int = 8):
    """Targets and references (control/) of 32 x 32 and 64 x 32 (width x height) pixels, captioned."""
    (folder / "control").mkdir(parents=True)
    rows = []
    g = np.random.default_rng(0)
    for i in range(square + wide):
        size = (32, 32) if i < square else (64, 32)
        colour = tuple(int(c) for c in g.integers(0, 255, 3))
        Image.new("RGB", size, colour).save(folder / "control" / f"{i:02d}.png")
        Image.new("RGB", size, colour[::-1]).save(folder / f"{i:02d}.png")
        rows.append({"file_name": f"{i:02d}.png", "text": "swap the colour channels"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kontext")
    data = _pairs(tmp / "pairs")
    images = json.dumps([str(data / "control" / "00.png"), str(data / "control" / "08.png")])
    common = (
        "--trainer.max_steps=4",
        "--samples.every_n_steps=2",
        "--samples.num_inference_steps=2",
        "--checkpoint.every_n_steps=2",
        f"--data.data_dir={data}",
        f"--samples.images={images}",
        '--samples.prompts=["swap the colour channels", "swap the colour channels"]',
    )
    out = run_recipe(tmp, "cp2", *common, recipe="flux_kontext")
    return tmp, out, common


@pytest.fixture(scope="module")
def resumed(run):
    """The straight run resumed from its step-2 checkpoint, in a folder of its own."""
    tmp, out, common = run
    return run_recipe(
        tmp, "resumed", *common, f"--ckpt_path={out / 'checkpoints' / 'step_2.ckpt'}", recipe="flux_kontext"
    )


def test_resume_from_a_mid_run_checkpoint_draws_the_straight_runs_losses(run, resumed):
    _, out, _ = run
    straight = losses(out)
    assert losses(resumed) == pytest.approx(straight[2:], abs=1e-6)  # steps 3 and 4


def test_paired_data_of_two_aspect_ratios_trains_and_samples_at_cp2(run):
    import csv

    _, out, _ = run
    assert len(losses(out)) == 4 and all(np.isfinite(losses(out)))
    with (out / "buckets.csv").open() as f:
        rows = {r["bucket"]: r for r in csv.DictReader(f)}
    # the reference's tokens join the target's: 2 x 64 image tokens (2 x 66 for the 2:1 bucket of the 32 x 32 pixel
    # budget, 44 x 24) + 32 text, halved at cp=2
    assert {b: (int(r["tokens_per_sample"]), int(r["tokens_per_cp_rank"])) for b, r in rows.items()} == {
        "32x32": (160, 80),
        "44x24": (164, 82),
    }
    for step in (0, 2, 4):
        assert (out / "samples" / f"step_{step}.png").stat().st_size > 0
    assert (out / "lora" / "pytorch_lora_weights.safetensors").exists()


def _grads(rank, world, cache):
    """Step 2's LoRA gradients of the Kontext module (SGD) and the joint sequence length block 0 sees."""
    import lightning as L
    from torch.distributed.tensor import DTensor

    from recipes.flux_kontext import FluxKontextFineTune

    seen, grads = [], {}

    class Module(FluxKontextFineTune):
        def configure_optimizers(self):
            return torch.optim.SGD([p for _, p in self.trainable_parameters()], lr=0.5)

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            block = pl_module.transformer.transformer_blocks[0]
            block.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"].shape[1]), with_kwargs=True)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                for name, p in pl_module.trainable_parameters():
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    grads[name] = g.detach().double().numpy().copy()

    config = json.loads((cache / "tiny_flux_pipeline" / "transformer" / "config.json").read_text())
    c = config["in_channels"] // 4
    batches = [
        {
            "latents": torch.randn(c, 8, 8, generator=torch.Generator().manual_seed(i)),
            "control_latents": torch.randn(c, 8, 8, generator=torch.Generator().manual_seed(50 + i)),
            "prompt_embeds": torch.randn(8, config["joint_attention_dim"], generator=torch.Generator().manual_seed(i)),
            "pooled_prompt_embeds": torch.randn(
                config["pooled_projection_dim"], generator=torch.Generator().manual_seed(i)
            ),
            "index": torch.tensor(i),
        }
        for i in range(4)
    ]
    strategy = "auto"
    if world > 1:
        from cp_lightning import ContextParallelStrategy

        strategy = ContextParallelStrategy(cp=world)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Record()],
    )
    torch.manual_seed(0)
    trainer.fit(Module(cache_dir=str(cache), lora_rank=4), torch.utils.data.DataLoader(batches, batch_size=2))
    return grads, seen[0]


def test_the_reference_tokens_are_split_and_the_gradient_equals_one_process(run):
    tmp, _, _ = run
    cache = tmp / "cache"
    results = spawn(_grads, 2, cache, timeout_s=900)
    single, tokens = _grads(0, 1, cache)
    assert tokens == 2 * 16  # 16 target + 16 reference tokens (8 x 8 latents, 2 x 2 patches)
    for grads, split in results:
        assert split == tokens // 2  # each CP rank holds half of the joint sequence
        for name, g in single.items():
            assert np.abs(grads[name] - g).max() / np.abs(g).max() < 1e-4, name


def _edit(rank, world, cache, reference):
    """An edit of ``reference`` by the recipe's sampler, with a perturbed tiny base (every layer matters), at
    cp=world: the reference image's tokens are split with the target's inside the pipeline's transformer."""
    from cp_lightning import build_mesh, parallelize
    from recipes.components import load_pipeline
    from recipes.flux_kontext import SampleFluxKontext
    from tests.test_recipe_training import _perturb

    sampler = SampleFluxKontext(images=[reference], prompts=["swap the colour channels"], num_inference_steps=3)
    sampler.pipeline = __import__("diffusers").FluxKontextPipeline.from_pipe(load_pipeline("flux", "tiny", cache))
    sampler.pipeline.set_progress_bar_config(disable=True)
    sampler.references = [Image.open(reference).convert("RGB")]
    _perturb(sampler.pipeline.transformer)
    if world > 1:
        parallelize(sampler.pipeline.transformer, mesh=build_mesh(cp=world))
    with torch.no_grad():
        return sampler.render(sampler.pipeline, sampler.encode(sampler.pipeline, sampler.prompts[0]), sampler.seed)


def test_an_edit_rendered_with_cp_equals_the_one_process_edit(run):
    tmp, _, _ = run
    reference = str(tmp / "pairs" / "control" / "08.png")  # the 2:1 one: 64 x 32 pixels
    single = _edit(0, 1, tmp / "cache", reference)
    assert single.shape == (1, 32, 32, 3)
    for edit in spawn(_edit, 2, tmp / "cache", reference, timeout_s=600):
        np.testing.assert_allclose(edit, single, atol=1e-5)


def test_a_missing_or_misshapen_reference_is_an_error_naming_the_file(run, tmp_path):
    from recipes.flux_kontext import FluxKontextData

    tmp, _, _ = run
    data = _pairs(tmp_path / "pairs", square=4, wide=4)

    def plan():
        return FluxKontextData(data_dir=str(data), cache_dir=str(tmp / "cache"), batch_size=2).plan()

    assert len(plan()) == 8
    (data / "control" / "03.png").unlink()
    with pytest.raises(ValueError, match=r"03.png has no reference image: put it at .*control/03.png"):
        plan()
    Image.new("RGB", (64, 32)).save(data / "control" / "03.png")  # a wide reference for a square target
    with pytest.raises(ValueError, match="reference .*03.png \\(64x32\\) is of another aspect class"):
        plan()
    (data / "control" / "03.png").unlink()  # a reference under another name, given in the metadata
    rows = [json.loads(line) for line in (data / "metadata.jsonl").read_text().splitlines()]
    rows[3]["control_file_name"] = "control/reference_of_03.png"
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Image.new("RGB", (32, 32)).save(data / "control" / "reference_of_03.png")
    assert len(plan()) == 8

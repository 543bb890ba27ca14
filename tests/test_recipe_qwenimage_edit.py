"""The Qwen-Image-Edit recipe (tiny model, cp=2) on pairs with two references each, of two aspect ratios written
here: it trains, renders samples with CP at steps 0, 2 and 4, resumes exactly from a light checkpoint, trains like
one process, splits the references' tokens with the target's, renders an edit with CP as one process does, and its
LoRA export renders the step-4 sample in one process; the tiny processor; bad input."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from tests.distributed import spawn
from tests.test_recipes import losses, run_recipe

RECIPE = "qwenimage_edit"
COLOURS = {"red": (220, 40, 40), "blue": (40, 60, 220), "green": (40, 180, 60), "yellow": (230, 210, 40)}
PROMPTS = ["make the circle blue", "make the circle green"]


def _pairs(folder, square: int = 4, wide: int = 4):
    """Targets of 32 x 32 and 64 x 32 (width x height) pixels, each with two references (``control/`` the circle
    before the edit, ``control_2/`` a swatch of the colour it takes), captioned with the instruction."""
    for name in ("control", "control_2"):
        (folder / name).mkdir(parents=True)
    rows = []
    names = list(COLOURS)
    for i in range(square + wide):
        size = (32, 32) if i < square else (64, 32)
        before, after = names[i % 4], names[(i + 1) % 4]
        x = 4 + 3 * (i % 5)
        for colour, path in ((before, folder / "control" / f"{i:02d}.png"), (after, folder / f"{i:02d}.png")):
            image = Image.new("RGB", size, (250, 250, 250))
            ImageDraw.Draw(image).ellipse((x, 6, x + 18, 24), fill=COLOURS[colour])
            image.save(path)
        Image.new("RGB", size, COLOURS[after]).save(folder / "control_2" / f"{i:02d}.png")
        rows.append({"file_name": f"{i:02d}.png", "text": f"make the circle {after}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The folder whose ``cache/`` holds the tiny pipeline (the runs' cache too)."""
    from recipes.components import resolve_pretrained

    root = tmp_path_factory.mktemp("qwenimage_edit_tiny")
    resolve_pretrained(RECIPE, "tiny", root / "cache")
    return root


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwenimage_edit")
    data = _pairs(tmp / "pairs")
    common = (
        "--trainer.max_steps=4",
        "--samples.every_n_steps=2",
        "--samples.num_inference_steps=2",
        "--checkpoint.every_n_steps=2",
        "--data.batch_size=2",
        f"--data.data_dir={data}",
        f"--samples.prompts={json.dumps(PROMPTS)}",  # the references of the data's first two pairs
    )
    straight = run_recipe(tmp, "straight", *common, cache=tiny, recipe=RECIPE)
    step2 = straight / "checkpoints" / "step_2.ckpt"
    resumed = run_recipe(tmp, "resumed", *common, f"--ckpt_path={step2}", cache=tiny, recipe=RECIPE)
    return {"cache": tiny / "cache", "data": data, "common": common, "straight": straight, "resumed": resumed}


def _pipeline(cache):
    from recipes.components import load_pipeline
    from recipes.qwenimage_edit_parts import attach_processor

    pipe = load_pipeline(RECIPE, "tiny", cache)
    pipe.set_progress_bar_config(disable=True)
    return attach_processor(pipe, "tiny", None)


def _sampler(steps: int = 2):
    from recipes.qwenimage_edit import SampleQwenImageEdit

    # as the tiny config samples (its areas, its text length), two steps
    return SampleQwenImageEdit(
        prompts=PROMPTS, num_inference_steps=steps, max_sequence_length=96, reference_area=1024, condition_area=1024
    )


def _render(pipe, data) -> np.ndarray:
    """The first prompt's edit of the first pair's references, in one process."""
    sampler = _sampler()
    sampler.references = [[Image.open(data / name / "00.png").convert("RGB") for name in ("control", "control_2")]]
    with torch.no_grad():
        embeds = sampler.encode(pipe, sampler.prompts[0], sampler.references[0])
        return sampler.render(pipe, embeds, sampler.seed)[0]  # H, W, 3


def _cell(run, step: int) -> np.ndarray:
    grid = np.asarray(Image.open(run / "samples" / f"step_{step}.png").convert("RGB")).astype(int)
    return grid[: 32 * 4 : 4, : 32 * 4 : 4]  # the first prompt's image, 4x enlarged


def test_pairs_with_two_references_of_two_aspect_ratios_train_and_sample_at_cp2(runs):
    run = runs["straight"]
    curve = losses(run)
    assert len(curve) == 4 and all(np.isfinite(curve)), curve
    for step in (0, 2, 4):  # rendered by both ranks of the CP group
        assert (run / "samples" / f"step_{step}.png").stat().st_size > 0
    assert (run / "samples.png").exists()
    with (run / "buckets.csv").open() as f:
        rows = {r["bucket"]: r for r in csv.DictReader(f)}
    # the target's 2x2 patches of the 2x VAE latents (16 x 16 or 22 x 12), two references of 32 x 32 pixels (the
    # pipeline's 1024-pixel area, sides rounded to 32) of 64 tokens each, and 96 text tokens; halved at cp=2
    assert {b: (int(r["tokens_per_sample"]), int(r["tokens_per_cp_rank"])) for b, r in rows.items()} == {
        "32x32": (64 + 128 + 96, 144),
        "44x24": (66 + 128 + 96, 145),
    }
    # the instruction's cached text holds both references' image tokens after its template prefix
    from safetensors.torch import load_file

    from recipes.qwenimage_edit import references_key

    index = next((runs["cache"] / "encoded" / RECIPE).glob("index-*.json"))
    row = json.loads(index.read_text())["samples"][0]
    entry = load_file(str(index.parent / f"{references_key(row['key'])}.safetensors"))
    lines = (runs["data"] / "metadata.jsonl").read_text().splitlines()
    caption = json.loads(lines[int(Path(row["name"]).stem)])["text"]
    assert entry["prompt_embeds_mask"].sum() == 2 * (len("Picture 1: ") + 6) + len(caption) + 34
    assert entry["control_latents_0"].shape == entry["control_latents_1"].shape == (4, 16, 16)


def test_resume_from_a_light_checkpoint_is_exact(runs):
    from recipes import lora

    assert losses(runs["resumed"]) == pytest.approx(losses(runs["straight"])[2:], abs=1e-6)  # steps 3 and 4
    _, meta = lora.read(runs["straight"] / "lora" / lora.WEIGHT_NAME)
    assert meta["cp_lightning.family"] == RECIPE


def test_one_process_trains_like_the_cp2_group(runs, tmp_path):
    layout = ("--trainer.strategy=auto", "--trainer.devices=1", "--trainer.max_steps=2", "--samples.every_n_steps=0")
    single = run_recipe(tmp_path, "cp1", *runs["common"], *layout, cache=runs["cache"].parent, recipe=RECIPE)
    assert losses(single, "t") == losses(runs["straight"], "t")[:2]
    assert losses(single) == pytest.approx(losses(runs["straight"])[:2], abs=1e-5)


def test_the_exported_lora_loads_and_renders_the_step4_sample(runs):
    """The step-0 sample is the base pipeline's edit and the step-4 one the pipeline's with the exported LoRA,
    rendered here in one process (the 8-bit PNG: at most one level of rounding)."""
    pipe = _pipeline(runs["cache"])
    base = _render(pipe, runs["data"])
    assert np.abs(_cell(runs["straight"], 0) - (np.clip(base, 0, 1) * 255).round().astype(int)).max() <= 1
    pipe.load_lora_weights(str(runs["straight"] / "lora"))
    trained = _render(pipe, runs["data"])
    assert np.abs(trained - base).max() > 1e-3  # the LoRA matters
    assert np.abs(_cell(runs["straight"], 4) - (np.clip(trained, 0, 1) * 255).round().astype(int)).max() <= 1


def _edit(rank, world, cache, data):
    """An edit of the first pair's two references by the recipe's sampler with a perturbed tiny base (every layer
    matters), at cp=world, and the sequence length block 0 sees."""
    from cp_lightning import build_mesh, parallelize
    from tests.test_recipe_training import _perturb

    pipe = _pipeline(cache)
    _perturb(pipe.transformer)
    if world > 1:
        parallelize(pipe.transformer, mesh=build_mesh(cp=world))
    seen = []  # (a hook after the plan's own: the tokens the block computes on)
    block = pipe.transformer.transformer_blocks[0]
    block.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"].shape[1]), with_kwargs=True)
    return _render(pipe, data), seen[0]


def test_an_edit_rendered_with_cp_splits_the_references_and_equals_one_process(runs):
    single, tokens = _edit(0, 1, runs["cache"], runs["data"])
    assert tokens == 3 * 64  # the 16 x 16 latent target's 64 tokens and its two references' 64 each
    for edit, split in spawn(_edit, 2, runs["cache"], runs["data"], timeout_s=600):
        assert split == tokens // 2
        np.testing.assert_allclose(edit, single, atol=1e-5)


def test_the_tiny_processor_writes_the_image_tokens_the_encoder_reads(tiny):
    """Each reference's placeholder becomes vision-start, one image token per 2x2 merged 8 px patch, vision-end;
    the references change the encoding."""
    from recipes.qwenimage_edit_parts import IMAGE_ID, PLACEHOLDER, VISION_END_ID, VISION_START_ID

    pipe = _pipeline(tiny / "cache")
    red, wide = Image.new("RGB", (32, 32), (220, 40, 40)), Image.new("RGB", (64, 32), (40, 60, 220))
    out = pipe.processor(text=[f"a{PLACEHOLDER}b{PLACEHOLDER}"], images=[red, wide])
    assert out["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    assert out["pixel_values"].shape == (16 + 32, 3 * 2 * 8 * 8)
    ids = out["input_ids"][0].tolist()
    assert ids == [*pipe.tokenizer("a").input_ids[:-1], VISION_START_ID, *[IMAGE_ID] * 4, VISION_END_ID,
                   *pipe.tokenizer("b").input_ids[:-1], VISION_START_ID, *[IMAGE_ID] * 8, VISION_END_ID,
                   pipe.tokenizer.eos_token_id]  # fmt: skip
    with pytest.raises(ValueError, match="more image placeholders than the 1 images"):
        pipe.processor(text=[f"{PLACEHOLDER}{PLACEHOLDER}"], images=[red])
    with torch.no_grad():
        one, _ = pipe.encode_prompt("make it blue", image=[red])
        other, _ = pipe.encode_prompt("make it blue", image=[Image.new("RGB", (32, 32), (40, 180, 60))])
    assert one.shape == (1, len("Picture 1: ") + 6 + len("make it blue") + 34, 32)
    assert (one - other).abs().max() > 1e-4  # the text encoder sees the reference


def test_bad_input_is_refused_before_training(tiny, tmp_path, monkeypatch):
    import importlib.util

    from recipes.qwenimage_edit import QwenImageEditData, SampleQwenImageEdit
    from recipes.qwenimage_edit_parts import TORCHVISION

    cache = str(tiny / "cache")
    data = _pairs(tmp_path / "pairs", square=2, wide=2)

    def plan(**kwargs):
        options = {"data_dir": str(data), "cache_dir": cache, "batch_size": 2, "processor": "tiny", **kwargs}
        return QwenImageEditData(max_sequence_length=96, reference_area=1024, condition_area=1024, **options).plan()

    assert len(plan()) == 4
    with pytest.raises(ValueError, match="resolution 30 does not fit the model: it must be a multiple of 4"):
        plan(resolution=30)
    with pytest.raises(ValueError, match="data.reference_area must be at least 1024 pixels"):
        QwenImageEditData(data_dir=str(data), cache_dir=cache, processor="tiny", reference_area=512)
    # the checkpoint's own processor (a Qwen2VLProcessor) without torchvision: what to install, before anything loads
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else real(name, *a))
    with pytest.raises(ValueError, match="pip install torchvision") as error:
        QwenImageEditData(data_dir=str(data), cache_dir=cache, pretrained=f"{cache}/tiny_{RECIPE}_pipeline")
    assert str(error.value) == TORCHVISION
    with pytest.raises(ValueError, match="pip install torchvision"):
        QwenImageEditData(data_dir=str(data), cache_dir=cache, processor="Qwen/Qwen-Image-Edit-2509")
    monkeypatch.undo()
    # a checkpoint of the single-reference Qwen-Image-Edit pipeline
    other = tmp_path / "edit"
    shutil.copytree(f"{cache}/tiny_{RECIPE}_pipeline", other)
    index = json.loads((other / "model_index.json").read_text()) | {"_class_name": "QwenImageEditPipeline"}
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="is a QwenImageEditPipeline checkpoint; this recipe trains the"):
        QwenImageEditData(data_dir=str(data), cache_dir=cache, pretrained=str(other), processor="tiny").prepare_data()
    # references: a missing one, one of another aspect class, pairs with different counts
    (data / "control_2" / "03.png").unlink()
    with pytest.raises(ValueError, match=r"03.png has no reference image .*control_2/03.png: put it there"):
        plan()
    Image.new("RGB", (32, 32)).save(data / "control_2" / "03.png")  # a square reference for a wide target
    with pytest.raises(ValueError, match=r"reference .*control_2/03.png \(32x32\) is of another aspect class"):
        plan()
    rows = [json.loads(line) for line in (data / "metadata.jsonl").read_text().splitlines()]
    rows[3]["control_file_name"] = ["control/03.png"]  # one reference named, where the others have two
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="every pair needs the same number of references .* has 1, .* has 2"):
        plan()
    # the samples' references
    with pytest.raises(ValueError, match="must give each prompt its reference image"):
        SampleQwenImageEdit(prompts=["a", "b"], images=["x.png"])
    sampler = SampleQwenImageEdit(prompts=["a", "b"], images=[str(data / "00.png"), [str(data / "00.png"), "no.png"]])
    with pytest.raises(
        ValueError, match="samples.images: no.png does not exist \\(a reference image of the prompt 'b'"
    ):
        sampler.check_images()


def test_the_dry_run_plans_the_pairs_and_names_each_prompts_references(tiny, tmp_path, capsys):
    """On the CPU from the YAML alone, no process started: the bucket table with the references' tokens, and the
    references each sample prompt edits (the data's first pairs, both of each)."""
    from recipes.qwenimage_edit import main
    from tests.test_recipes import ROOT

    data = _pairs(tmp_path / "pairs", square=2, wide=2)
    text = (ROOT / "configs" / f"tiny_{RECIPE}_cp2.yaml").read_text()
    config = tmp_path / "dry.yaml"
    config.write_text(text.replace(f"outputs/tiny_{RECIPE}_cp2", str(tmp_path / "run")).replace("outputs/", f"{tiny}/"))
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(config), f"--data.data_dir={data}", "--data.batch_size=1", "--data.dry_run=true"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert " 32x32 " in out and " 288 " in out  # 64 target + 2 x 64 reference + 96 text tokens
    assert f"'make the circle red' <- {data / 'control' / '00.png'}, {data / 'control_2' / '00.png'}" in out

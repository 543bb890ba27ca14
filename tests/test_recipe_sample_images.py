"""The image-conditioned samples follow the user's data: the tiny Kontext and Wan I2V configs with only
``--data.data_dir`` changed take their sample references / first frames from that folder's first samples, set
``samples.images`` are kept, and a missing one stops the CLI naming the key and the file. Nothing trains: the configs
are parsed and instantiated by the recipes' own CLI (``run=False``), and one dry run prints what the samples use."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from tests.test_recipe_data import write_video

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _argv(monkeypatch):
    """The CLI gets its arguments from the tests alone (not pytest's command line)."""
    monkeypatch.setattr("sys.argv", ["recipe"])


def _pairs(folder: Path) -> Path:
    """Three edit pairs in the Kontext layout: targets ``<name>.png`` captioned in metadata.jsonl, references in
    ``control/`` (the first under another name, given by ``control_file_name``); each reference one flat colour."""
    (folder / "control").mkdir(parents=True)
    rows = []
    for i, (name, colour) in enumerate([("apple", (200, 10, 10)), ("boat", (10, 200, 10)), ("cup", (10, 10, 200))]):
        control = f"control/ref_{name}.png" if i == 0 else f"control/{name}.png"
        Image.new("RGB", (32, 32), colour).save(folder / control)
        Image.new("RGB", (32, 32), colour[::-1]).save(folder / f"{name}.png")
        rows.append({"file_name": f"{name}.png", "text": "swap the colour channels"})
        if i == 0:
            rows[-1]["control_file_name"] = control
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _cli(recipe: str, tmp: Path, *overrides: str):
    """The recipe's CLI on its tiny config with ``overrides``, its classes instantiated and nothing run (no process,
    no pipeline); every path it might write under ``tmp``."""
    import importlib

    from recipes.finetune import RecipeCLI

    module = importlib.import_module(f"recipes.{recipe}")
    classes = {"flux_kontext": ("FluxKontextFineTune", "FluxKontextData"), "wan_i2v": ("WanI2VFineTune", "WanI2VData")}
    model, data = (getattr(module, name) for name in classes[recipe])
    args = ["--config", str(ROOT / "configs" / f"tiny_{recipe}_cp2.yaml"), *_outputs(tmp), *overrides]
    return RecipeCLI(model, data, args=args, run=False, save_config_callback=None)


def _outputs(tmp: Path) -> list[str]:
    run, cache = tmp / "run", tmp / "cache"
    return [f"--out_dir={run}", f"--trainer.default_root_dir={run}", "--trainer.logger=false"] + [
        f"--data.cache_dir={cache}",
        f"--model.cache_dir={cache}",
    ]


def _sampler(cli):
    from recipes.sampling import Samples

    return next(c for c in cli.trainer.callbacks if isinstance(c, Samples))


def test_the_kontext_config_with_a_data_dir_edits_the_references_of_the_users_first_pairs(tmp_path):
    data = _pairs(tmp_path / "my_pairs")
    cli = _cli("flux_kontext", tmp_path, f"--data.data_dir={data}")
    sampler = _sampler(cli)
    assert sampler.images == [] and len(sampler.prompts) == 2  # the config's two prompts, no images
    sources = sampler.sample_images(cli.datamodule)
    assert [s.path for s in sources] == [str(data / "control" / "ref_apple.png"), str(data / "control" / "boat.png")]
    images = sampler.load_images(SimpleNamespace(datamodule=cli.datamodule))  # what prepare renders from
    assert [np.asarray(im)[0, 0].tolist() for im in images] == [[200, 10, 10], [10, 200, 10]]

    # samples.images set explicitly: kept, whatever the data
    chosen = [str(data / "control" / "cup.png"), str(data / "control" / "boat.png")]
    cli = _cli("flux_kontext", tmp_path, f"--data.data_dir={data}", f"--samples.images={json.dumps(chosen)}")
    assert [s.path for s in _sampler(cli).sample_images(cli.datamodule)] == chosen

    # more prompts than pairs: the key, the counts and the fix
    four = json.dumps(["a", "b", "c", "d"])
    cli = _cli("flux_kontext", tmp_path, f"--data.data_dir={data}", f"--samples.prompts={four}")
    with pytest.raises(
        ValueError,
        match=r"samples.images: .*one reference image per prompt \(4 prompts\) and the data in .*my_pairs has 3",
    ):
        _sampler(cli).sample_images(cli.datamodule)


def test_a_missing_samples_image_stops_the_cli_before_any_process_naming_the_key_and_the_file(tmp_path):
    from recipes.flux_kontext import main

    data = _pairs(tmp_path / "my_pairs")
    images = json.dumps([str(data / "control" / "boat.png"), str(tmp_path / "nowhere.png")])
    args = ["fit", "--config", str(ROOT / "configs" / "tiny_flux_kontext_cp2.yaml"), *_outputs(tmp_path)]
    args += ["--trainer.max_steps=1", f"--data.data_dir={data}", f"--samples.images={images}"]
    message = (
        r"samples.images: .*nowhere.png does not exist \(the reference image of the prompt 'make the square green'\)"
    )
    with pytest.raises(ValueError, match=message):
        main(args)
    assert not (tmp_path / "cache").exists()  # stopped before the data or the model was touched


def test_the_dry_run_prints_what_each_prompt_edits(tmp_path, capsys):
    from recipes.flux_kontext import main

    data = _pairs(tmp_path / "my_pairs")
    args = ["fit", "--config", str(ROOT / "configs" / "tiny_flux_kontext_cp2.yaml"), *_outputs(tmp_path)]
    with pytest.raises(SystemExit) as exit:
        main([*args, f"--data.data_dir={data}", "--data.batch_size=1", "--data.dry_run=true"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert f"'make the circle green' <- {data / 'control' / 'ref_apple.png'}" in out
    assert f"'make the square green' <- {data / 'control' / 'boat.png'}" in out

    # a missing samples.images file: the plan is still printed, and what training would refuse
    images = json.dumps([str(data / "control" / "cup.png"), str(tmp_path / "nowhere.png")])
    with pytest.raises(SystemExit):
        main(
            [
                *args,
                f"--data.data_dir={data}",
                "--data.batch_size=1",
                "--data.dry_run=true",
                f"--samples.images={images}",
            ]
        )
    out = capsys.readouterr().out
    assert "buckets (3 samples" in out and f"samples.images: {tmp_path / 'nowhere.png'} does not exist" in out


def test_the_wan_i2v_config_with_a_data_dir_starts_from_the_first_frames_of_the_users_first_clips(tmp_path):
    folder = tmp_path / "my_clips"
    folder.mkdir()
    for name in ("b_second", "a_first", "c_third"):  # the data's order is the sorted paths
        write_video(folder / f"{name}.mp4", 5, 32, 32)
        (folder / f"{name}.txt").write_text("a white bar moving right")
    cli = _cli("wan_i2v", tmp_path, f"--data.data_dir={folder}")
    sampler = _sampler(cli)
    sources = sampler.sample_images(cli.datamodule)
    assert [Path(s.path).name for s in sources] == ["a_first.mp4", "b_second.mp4"]
    frame = np.asarray(sampler.load_images(SimpleNamespace(datamodule=cli.datamodule))[0]).astype(int)
    assert frame.shape == (32, 32, 3) and frame[:, 1].mean() > 200 > 80 > frame[:, 20].mean()  # frame 0: bar at 0-3

    image = tmp_path / "first.png"
    Image.new("RGB", (32, 32), "red").save(image)
    cli = _cli("wan_i2v", tmp_path, f"--data.data_dir={folder}", f"--samples.images=[{image}, {image}]")
    assert [s.path for s in _sampler(cli).sample_images(cli.datamodule)] == [str(image)] * 2


def test_sampler_image_errors_name_the_key():
    from recipes.flux_kontext import SampleFluxKontext
    from recipes.wan_i2v import SampleWanI2V

    with pytest.raises(ValueError, match=r"samples.images must give one reference image per prompt \(2 prompts, 1"):
        SampleFluxKontext(prompts=["a", "b"], images=["one.png"])
    with pytest.raises(
        ValueError, match=r"samples.images: nowhere.png does not exist \(the first frame of the prompt 'a'"
    ):
        SampleWanI2V(prompts=["a"], images=["nowhere.png"]).prepare(SimpleNamespace(), None)
    with pytest.raises(ValueError, match="samples need one first frame per prompt .* give samples.images"):
        SampleWanI2V(prompts=["a"]).prepare(SimpleNamespace(), None)

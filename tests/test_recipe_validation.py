"""The held-out validation loss and the TensorBoard and W&B loggers, on tiny Wan runs (videos: images and clips).

One module-scoped set of runs serves every test: 4 steps at cp=2 with CSV, TensorBoard and W&B (offline) loggers,
the same 4 steps in one process, and one step in one process on a copy of the data whose training files (those
outside the held-out split) were edited, removed and added to.
"""

from __future__ import annotations

import csv
import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.test_recipes import losses, run_recipe

FRACTION = 0.2
COMMON = (
    "--trainer.max_steps=4",
    f"--validation.samples={FRACTION}",
    "--validation.every_n_steps=2",
    "--samples.every_n_steps=2",
    "--samples.num_inference_steps=2",
)
ONE_PROCESS = ("--trainer.strategy=auto", "--trainer.devices=1")


def _loggers(out: Path) -> str:
    loggers = [
        ("CSVLogger", {"name": "logs"}),
        ("TensorBoardLogger", {"name": "tb"}),
        ("WandbLogger", {"offline": True, "project": "tiny", "name": "wan"}),
    ]
    specs = [
        {"class_path": f"lightning.pytorch.loggers.{name}", "init_args": {"save_dir": str(out), **args}}
        for name, args in loggers
    ]
    return "--trainer.logger=" + json.dumps(specs)


def _held_out(data: Path) -> set[str]:
    from recipes.validation import name_key

    return {p.name for p in data.glob("*.gif") if name_key(p.name, 0) < FRACTION}


def _edit_training_files(source: Path, target: Path, tmp: Path) -> None:
    """A copy of ``source`` with files outside the held-out split edited (redrawn), removed and added."""
    from recipes.synthetic import make_shapes

    shutil.copytree(source, target)
    held = _held_out(target)
    training = sorted(p.name for p in target.glob("*.gif") if p.name not in held)
    rows = [json.loads(line) for line in (target / "metadata.jsonl").read_text().splitlines()]
    extra = make_shapes(tmp / "extra", 6, seed=7, frames=5)
    shutil.copyfile(extra / "00000.gif", target / training[0])  # edited in place
    (target / training[1]).unlink()  # removed
    rows = [r for r in rows if r["file_name"] != training[1]]
    for i in range(1, 6):  # added, those whose names would be held out left aside
        name = f"new_{i}.gif"
        if name not in _held_out_names([name]):
            shutil.copyfile(extra / f"{i:05d}.gif", target / name)
            rows.append({"file_name": name, "text": "a new shape moving right"})
    (target / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _held_out_names(names: list[str]) -> set[str]:
    from recipes.validation import name_key

    return {n for n in names if name_key(n, 0) < FRACTION}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp / "cp2")}
    cp2 = run_recipe(tmp, "cp2", *COMMON, _loggers(tmp / "cp2"), recipe="wan", env=env)
    cp1 = run_recipe(tmp, "cp1", *COMMON, *ONE_PROCESS, recipe="wan")
    data = tmp / "data" / "moving_shapes"
    _edit_training_files(data, tmp / "edited_data", tmp)
    edited = run_recipe(
        tmp,
        "edited",
        *COMMON,
        *ONE_PROCESS,
        "--trainer.max_steps=1",
        f"--data.data_dir={tmp / 'edited_data'}",
        recipe="wan",
    )
    return {"tmp": tmp, "cp2": cp2, "cp1": cp1, "edited": edited, "data": data}


def _val_loss(run: Path) -> dict[int, float]:
    with (run / "val_loss.csv").open() as f:
        return {int(row["step"]): float(row["val_loss"]) for row in csv.DictReader(f)}


def test_val_loss_is_the_same_at_cp1_and_cp2_and_is_logged(runs):
    cp2, cp1 = _val_loss(runs["cp2"]), _val_loss(runs["cp1"])
    assert sorted(cp2) == [0, 2, 4]  # step 0, every 2 steps, the end
    for step, value in cp2.items():
        assert value == pytest.approx(cp1[step], rel=1e-6, abs=1e-6), step
    assert cp2[4] < cp2[0]  # the held-out clips are shapes like the training ones: the loss falls
    with (runs["cp2"] / "logs" / "version_0" / "metrics.csv").open() as f:
        logged = {int(r["step"]): float(r["val_loss"]) for r in csv.DictReader(f) if r.get("val_loss")}
    assert logged == pytest.approx(cp2, rel=1e-6)
    assert (runs["cp2"] / "loss.png").stat().st_size > 0


def test_held_out_files_are_not_trained_on_and_edits_to_the_others_keep_val_loss(runs):
    held = _held_out(runs["data"])
    assert 0 < len(held) < 32
    with (runs["cp1"] / "buckets.csv").open() as f:
        assert sum(int(r["samples"]) for r in csv.DictReader(f)) == 32 - len(held)  # one clip per training video
    index = next((runs["tmp"] / "cache" / "encoded" / "wan").glob("val-index-*.json"))
    assert {row["name"] for row in json.loads(index.read_text())["samples"]} == held
    # the edited copy keeps the same held-out files, so the same step-0 loss, while training changed
    assert _held_out(runs["tmp"] / "edited_data") == held
    assert _val_loss(runs["edited"])[0] == pytest.approx(_val_loss(runs["cp1"])[0], rel=1e-12)
    assert losses(runs["edited"])[0] != pytest.approx(losses(runs["cp1"])[0], rel=1e-6)


def test_the_split_depends_only_on_each_files_name():
    from recipes.validation import Validation

    def files(names):
        return [SimpleNamespace(path=f"/d/{n}", row=None) for n in names]

    names = [f"{i:05d}.png" for i in range(200)]
    fraction = Validation(samples=0.1)
    _, held = fraction.split(files(names), "/d")
    assert 5 < len(held) < 40
    kept = [n for n in names if f"/d/{n}" not in {s.path for s in held}]
    # removing and adding training files: the same held-out set
    changed = kept[10:] + [f"extra_{i}.png" for i in range(50)]
    _, again = fraction.split(files(changed) + held, "/d")
    new = {s.path for s in again} - {s.path for s in held}
    assert {s.path for s in held} <= {s.path for s in again}
    assert all(p.startswith("/d/extra_") for p in new)  # only new files can join, by their own key
    count = Validation(samples=8)
    _, first = count.split(files(names), "/d")
    chosen = [s.path.removeprefix("/d/") for s in first]
    _, second = count.split(files([n for n in names if n not in chosen][50:] + chosen), "/d")  # 50 others removed
    assert len(first) == 8 and {s.path for s in first} == {s.path for s in second}


def test_validation_options_and_missing_logger_packages_are_clear_errors(monkeypatch):
    import importlib.util

    from recipes import loggers
    from recipes.validation import Validation

    for kwargs, message in (
        ({"samples": 1.5}, "fraction in \\(0, 1\\) or a count"),
        ({"samples": -1}, "fraction in \\(0, 1\\) or a count"),
        ({"samples": 0.1, "timesteps": [0.0, 0.5]}, "times in \\(0, 1\\)"),
        ({"every_n_steps": -1}, "every_n_steps must be >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            Validation(**kwargs)
    one = [SimpleNamespace(path="/d/a.png", row=None)]
    with pytest.raises(ValueError, match="holds out all 1 files.*leaving nothing to train on"):
        Validation(samples=5).split(one, "/d")
    with pytest.raises(ValueError, match="holds out none of the 1 files"):
        Validation(samples=1e-9).split(one, "/d")

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    config = [{"class_path": "lightning.pytorch.loggers.CSVLogger"}, {"class_path": "WandbLogger"}]
    with pytest.raises(ModuleNotFoundError, match=r"WandbLogger needs the wandb package.*cp-lightning\[loggers\]"):
        loggers.check_logger_packages(config)
    loggers.check_logger_packages({"class_path": "lightning.pytorch.loggers.TensorBoardLogger"})  # installed


def test_the_loss_curve_is_smoothed_like_tensorboard():
    from recipes.callbacks import smooth

    assert smooth([2.0] * 5, 0.9) == pytest.approx([2.0] * 5)  # bias-corrected: no ramp from 0
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, (0.5 * 0.5 + 0.5 * 3.0) / (1 - 0.5**2)])


def test_tensorboard_holds_the_scalars_sample_images_videos_and_hyperparameters(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(runs["cp2"] / "tb" / "version_0"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    val = {e.step: e.value for e in events.Scalars("val_loss")}
    assert val == pytest.approx(_val_loss(runs["cp2"]), rel=1e-6)  # stored as float32
    assert [e.value for e in events.Scalars("train_loss")] == pytest.approx(losses(runs["cp2"]), rel=1e-6)
    prompt = "a red circle moving right"
    frames = events.Images(f"samples/{prompt}")
    assert [e.step for e in frames] == [0, 2, 4] and (frames[0].width, frames[0].height) == (5 * 32, 32)
    videos = events.Images(f"videos/{prompt}")
    assert [e.step for e in videos] == [0, 2, 4] and videos[0].encoded_image_string.startswith(b"GIF89a")

    import io

    from PIL import Image

    gif = Image.open(io.BytesIO(videos[-1].encoded_image_string))
    assert gif.n_frames == 5 and gif.size == (32, 32)  # 4 frames asked: Wan renders 4k + 1
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["lora_rank"].number_value == 4 and hparams["num_frames"].number_value == 5  # model and data


def _wandb_records(path: Path):
    """The records of a W&B run file: wandb's LevelDB-style log (32 KiB blocks of [crc32, length, type] chunks)
    after a 7-byte header, each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = payload if kind in (1, 2) else parts + payload  # FULL / FIRST start a record, MIDDLE / LAST go on
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def test_the_wandb_offline_run_holds_the_scalars_sample_images_videos_and_hyperparameters(runs):
    (run,) = (runs["cp2"] / "wandb").glob("offline-run-*")
    history, config = [], {}
    for record in _wandb_records(next(run.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        elif kind == "config":
            config |= {item.key: json.loads(item.value_json) for item in record.config.update}
    val = {row["trainer/global_step"]: row["val_loss"] for row in history if "val_loss" in row}
    assert val == pytest.approx(_val_loss(runs["cp2"]), rel=1e-9)
    assert [row["train_loss"] for row in history if "train_loss" in row] == pytest.approx(losses(runs["cp2"]), rel=1e-6)
    images = [row["samples/filenames"][0] for row in history if "samples/filenames" in row]
    videos = [row["samples_video/videos"][0]["path"] for row in history if "samples_video/videos" in row]
    assert len(images) == len(videos) == 3  # steps 0, 2, 4
    assert all((run / "files" / name).stat().st_size > 0 for name in images + videos)
    assert all(name.endswith(".mp4") for name in videos)
    assert config["lora_rank"] == 4 and config["num_frames"] == 5 and config["learning_rate"] == 0.003
    assert torch.isfinite(torch.tensor(list(val.values()))).all()

"""The Flux recipe: the embedded default end to end, layout invariance, and bad data."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import spawn

ROOT = Path(__file__).resolve().parents[1]


def run_recipe(
    tmp_path: Path,
    name: str,
    *overrides: str,
    cache: Path | None = None,
    recipe: str = "flux",
    variant: str = "",
    env: dict | None = None,
) -> Path:
    """Run a tiny config (``tiny_{recipe}_{variant}cp2.yaml``) with every output under tmp_path; returns the run
    folder. ``env`` adds environment variables. What the ranks print is in :func:`log_of` the run.

    The run's ranks are workers of the shared pool (tests/distributed.py) with the environment torchrun gives,
    so Lightning starts its process group as under any external launcher; `python -m recipes.X` with
    Lightning's own launcher is tested by the embedded default's run below. A failing run raises its rank's
    exception (the CLI's exit status)."""
    out = tmp_path / name
    default = ROOT / "configs" / f"tiny_{recipe}_{variant}cp2.yaml"
    text = default.read_text().replace(f"outputs/tiny_{recipe}_{variant}cp2", str(out))
    config = tmp_path / f"{name}.yaml"
    config.write_text(text.replace("outputs/", f"{cache or tmp_path}/"))
    args = ["fit", "--config", str(config), *overrides]
    world = _devices(config, overrides)
    log = log_of(out)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    env = {**(env or {}), "LOCAL_WORLD_SIZE": str(world)}
    spawn(_fit, world, recipe, args, str(log), timeout_s=900, env=env, group=False)
    return out


def log_of(run: Path) -> Path:
    """Where :func:`run_recipe` keeps what the run's ranks printed (stdout and stderr, both ranks)."""
    return run.with_name(run.name + ".log")


def _devices(config: Path, overrides) -> int:
    """The run's process count: the last ``--trainer.devices`` override, else the config's; a dry run is one
    process (it plans before any Trainer exists)."""
    import yaml

    if "--data.dry_run=true" in overrides:
        return 1

    devices = yaml.safe_load(config.read_text())["trainer"].get("devices", 1)
    for i, arg in enumerate(overrides):
        if arg.startswith("--trainer.devices="):
            devices = arg.split("=", 1)[1]
        elif arg == "--trainer.devices":
            devices = overrides[i + 1]
    return int(devices)


def _finish_loggers() -> None:
    """What a recipe process's exit does for W&B (its atexit hook writes the run's last records); a pool worker
    ends without running atexit hooks."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def _fit(rank, world, recipe, args, log):
    import importlib

    os.chdir(ROOT)  # relative paths in the configs resolve as under `python -m recipes.X` from the repository
    with open(log, "a") as sink:  # the rank's own stdout and stderr (appends from both ranks stay whole lines)
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            importlib.import_module(f"recipes.{recipe}").main(args)
        except SystemExit as stop:  # the CLI's own exit (a dry run's is 0)
            if stop.code not in (0, None):
                raise
        finally:
            _finish_loggers()
            sys.stdout.flush()
            sys.stderr.flush()


def launch_recipe(tmp_path: Path, name: str, *overrides: str, recipe: str = "flux") -> Path:
    """Like :func:`run_recipe`, as the README runs it: `python -m recipes.X fit` in a subprocess, with
    Lightning's own launcher starting the second rank."""
    out = tmp_path / name
    default = ROOT / "configs" / f"tiny_{recipe}_cp2.yaml"
    config = tmp_path / f"{name}.yaml"
    text = default.read_text().replace(f"outputs/tiny_{recipe}_cp2", str(out))
    config.write_text(text.replace("outputs/", f"{tmp_path}/"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", f"recipes.{recipe}", "fit", "--config", str(config), *overrides]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def losses(run: Path, column: str = "loss") -> list[float]:
    with (run / "loss.csv").open() as f:
        return [float(row[column]) for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipe")
    # the default trains 4000 steps (about 2 minutes of an idle machine); 30 show the same code working
    return launch_recipe(tmp, "cp2", "--trainer.max_steps=30"), tmp


def test_the_embedded_default_learns_and_writes_its_outputs(default_run):
    run, tmp = default_run
    curve = losses(run)
    assert len(curve) == 30 and all(torch.isfinite(torch.tensor(curve)))
    assert sum(curve[-10:]) / 10 < sum(curve[:10]) / 10, curve
    assert (run / "loss.png").stat().st_size > 0 and (run / "samples.png").stat().st_size > 0

    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(tmp / "cache" / "tiny_flux_pipeline"))

    def render():
        g = torch.Generator().manual_seed(0)
        return pipe(
            "a red circle",
            height=32,
            width=32,
            num_inference_steps=2,
            max_sequence_length=32,
            generator=g,
            output_type="pt",
        ).images

    before = render()
    pipe.load_lora_weights(str(run / "lora"))  # the diffusers LoRA format
    after = render()
    assert (after - before).abs().max() > 1e-4  # the trained adapter changes the output


def test_cp1_and_cp2_give_the_same_first_losses(default_run, tmp_path):
    run, tmp = default_run
    stop = '--trainer.callbacks+={"class_path": "tests.test_recipe_training.StopAt", "init_args": {"step": 3}}'
    # the same 30-step cosine schedule, stopped after 3 steps
    layout = ("--trainer.strategy=auto", "--trainer.devices=1", "--trainer.max_steps=30", stop)
    single = run_recipe(tmp_path, "cp1", *layout, cache=tmp)
    assert losses(single) == pytest.approx(losses(run)[:3], abs=1e-4)
    # the default uses Flux's resolution-dependent shift: the full token count at both layouts, same t draws
    assert losses(single, "t") == losses(run, "t")[:3]


def test_the_tiny_wan_recipe_learns_samples_with_cp_and_its_lora_loads(tmp_path):
    run = run_recipe(tmp_path, "wan", "--samples.every_n_steps=2", "--samples.num_inference_steps=2", recipe="wan")
    curve = losses(run)
    assert len(curve) == 30 and sum(curve[-10:]) / 10 < sum(curve[:10]) / 10, curve
    assert (run / "samples.png").stat().st_size > 0
    for step in (0, 2, 4, 30):  # rendered at cp=2 with classifier-free guidance, logged to the CSV logger's folder
        assert (run / "samples" / f"step_{step}.png").exists() and (run / "samples" / f"step_{step}.mp4").exists()
        assert (run / "logs" / "version_0" / "samples" / f"step_{step}.mp4").exists()

    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(tmp_path / "cache" / "tiny_wan_pipeline"))

    def render():
        g = torch.Generator().manual_seed(0)
        return pipe(
            "a red circle moving right",
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=2,
            max_sequence_length=32,
            guidance_scale=1.0,
            generator=g,
            output_type="pt",
        ).frames

    before = render()
    pipe.load_lora_weights(str(run / "lora"))
    after = render()
    assert (after - before).abs().max() > 1e-4

    # the ComfyUI export (diffusion_model.blocks... names) loads with diffusers' own reader of them
    from recipes.convert_lora import convert

    comfy = convert(run / "lora", tmp_path / "comfy", "comfyui")
    pipe.unload_lora_weights()
    pipe.load_lora_weights(str(comfy))
    assert torch.allclose(render(), after, atol=1e-6)


def test_full_fine_tuning_saves_a_loadable_transformer(default_run, tmp_path):
    _, tmp = default_run
    run = run_recipe(tmp_path, "full", "--model.lora_rank=0", "--trainer.max_steps=2", cache=tmp)
    from diffusers import FluxTransformer2DModel

    trained = FluxTransformer2DModel.from_pretrained(str(run / "transformer"))
    base = FluxTransformer2DModel.from_pretrained(str(tmp / "cache" / "tiny_flux_pipeline"), subfolder="transformer")
    moved = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), base.parameters(), strict=True))
    assert moved > 0 and (run / "samples.png").exists()

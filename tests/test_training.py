"""Training options of the recipes: learning-rate schedules, timestep sampling and shifts, EMA, bad input."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from recipes import training


def _lrs(kind: str, warmup: int, total: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = training.lr_schedule(optimizer, kind, warmup, total)
    values = []
    for _ in range(total):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
def test_warmup_then_schedule_matches_the_formula(kind):
    warmup, total, peak = 4, 20, 2.0

    def formula(step):
        if step < warmup:
            return peak * step / warmup
        progress = (step - warmup) / (total - warmup)
        decay = {"constant": 1.0, "cosine": 0.5 * (1 + math.cos(math.pi * progress)), "linear": 1 - progress}
        return peak * decay[kind]

    assert _lrs(kind, warmup, total) == pytest.approx([formula(s) for s in range(total)], abs=1e-12)


def test_schedule_errors_name_the_fix():
    with pytest.raises(ValueError, match="lr_scheduler must be one of"):
        training.check_schedule("exponential", 0, 10)
    with pytest.raises(ValueError, match="warmup_steps=10 is not shorter than the training run .*max_steps=10"):
        training.check_schedule("constant", 10, 10)
    with pytest.raises(ValueError, match="needs trainer.max_steps > 0"):
        training.check_schedule("cosine", 0, -1)
    from recipes.flux import FluxFineTune

    with pytest.raises(ValueError, match="lr_scheduler must be one of"):
        FluxFineTune(lr_scheduler="step")
    with pytest.raises(ValueError, match="loss_weighting must be one of"):
        FluxFineTune(loss_weighting="snr")
    with pytest.raises(ValueError, match="min_timestep < max_timestep"):
        FluxFineTune(min_timestep=0.9, max_timestep=0.5)


def test_warmup_longer_than_training_fails_before_any_process_starts(monkeypatch):
    from recipes.flux import main

    monkeypatch.setattr(sys, "argv", ["recipes.flux"])
    args = ["fit", "--config", "configs/tiny_flux_cp2.yaml", "--model.warmup_steps=30", "--trainer.max_steps=30"]
    with pytest.raises(ValueError, match="warmup_steps=30 is not shorter"):
        main(args)  # raised in the CLI's before_fit: the Trainer has launched nothing yet


def test_bf16_weights_without_autocast_fail_before_any_process_starts(monkeypatch):
    """bf16 frozen weights under 32-true would meet fp32 activations inside F.linear ("expected m1 and m2 to
    have the same dtype"): a ValueError naming both options and the fix, from the CLI's before_fit."""
    from recipes.flux import main

    monkeypatch.setattr(sys, "argv", ["recipes.flux"])
    args = ["fit", "--config", "configs/tiny_flux_cp2.yaml", "--model.weights_dtype=bfloat16"]
    with pytest.raises(ValueError, match=r"weights_dtype='bfloat16' with trainer.precision='32-true'.*bf16-mixed"):
        main([*args, "--trainer.precision=32-true"])


def test_timestep_shifts_follow_their_formulas():
    latents, index = torch.zeros(64, 4, 2, 2), torch.arange(64)
    _, plain = training.sample_noise_and_t(latents, index, seed=3, epoch=1)
    _, shifted = training.sample_noise_and_t(latents, index, seed=3, epoch=1, shift=3.0)
    assert torch.allclose(shifted, 3 * plain / (1 + 2 * plain), atol=1e-6) and (shifted >= plain).all()
    _, ranged = training.sample_noise_and_t(latents, index, seed=3, epoch=1, min_t=0.875, max_t=1.0)
    assert torch.allclose(ranged, 0.875 + 0.125 * plain, atol=1e-6)
    _, wide = training.sample_noise_and_t(latents, index, seed=3, epoch=1, sigmoid_scale=2.0)
    logit = torch.logit(plain.double())
    assert torch.allclose(wide.double(), torch.sigmoid(2 * logit), atol=1e-5)
    # Flux: mu linear in the image token count, 0.5 at 256 tokens and 1.15 at 4096 (FLUX.1's scheduler)
    assert training.flux_shift(256) == pytest.approx(math.exp(0.5))
    assert training.flux_shift(4096) == pytest.approx(math.exp(1.15))
    assert training.flux_shift(64) == pytest.approx(math.exp(0.5 - 0.65 * 192 / 3840))


def test_flux_shift_uses_the_full_token_count():
    from recipes.flux import FluxFineTune

    module = FluxFineTune(resolution_shift=True)
    x0 = torch.zeros(2, 16, 64, 32)  # 32 x 16 packed tokens = 512
    assert module.image_tokens(x0) == 512
    _, t = module.noise_and_t(x0, torch.tensor([5, 9]))
    _, plain = training.sample_noise_and_t(x0, torch.tensor([5, 9]), seed=0, epoch=0)
    assert torch.allclose(t, training.shift_t(plain, training.flux_shift(512)))


def test_loss_weighting_schemes():
    t = torch.tensor([0.25, 0.5])
    assert training.loss_weights("none", t) is None
    assert torch.allclose(training.loss_weights("sigma_sqrt", t), t**-2)
    assert torch.allclose(training.loss_weights("cosmap", t), 2 / (math.pi * (1 - 2 * t + 2 * t**2)))


def test_ema_tracks_trainable_parameters_only():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model[0].requires_grad_(False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ema = training.TrainableEMA(named, decay=0.5)
    assert sorted(ema.state_dict()) == ["1.bias", "1.weight"]  # nothing of the frozen layer
    start = model[1].weight.detach().clone()
    with torch.no_grad():
        model[1].weight.add_(2.0)
    ema.update()
    assert torch.allclose(ema.state_dict()["1.weight"], start + 1.0)
    with pytest.raises(ValueError, match="ema_decay must be in"):
        training.TrainableEMA(named, decay=1.0)
    # parameters replaced by new objects (FSDP2 shards them): the EMA keeps its values and tracks the new ones
    model[1].weight = torch.nn.Parameter(model[1].weight.detach() + 2.0)
    before = ema.state_dict()["1.weight"].clone()
    ema.follow([(n, p) for n, p in model.named_parameters() if p.requires_grad])
    ema.update()
    assert torch.allclose(ema.state_dict()["1.weight"], (before + model[1].weight.detach()) / 2)
    with pytest.raises(ValueError, match="the same names"):
        ema.follow(list(model.named_parameters()))


def test_the_progress_bar_total_of_a_run_resumed_inside_an_epoch():
    from types import SimpleNamespace

    from recipes.console import StepProgressBar

    def trainer(step: int, batches_done: int, max_steps: int = 6):
        progress = SimpleNamespace(current=SimpleNamespace(processed=batches_done))
        loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress))
        limits = {"max_epochs": -1, "max_steps": max_steps, "accumulate_grad_batches": 1}
        return SimpleNamespace(num_training_batches=64, global_step=step, fit_loop=loop, **limits)

    bar = StepProgressBar()
    bar._trainer = trainer(0, 0)  # a fresh 6-step run: the bar starts with the epoch
    assert bar.total_train_batches == 6
    bar._trainer = trainer(4, 4)  # resumed after step 3: the bar appears after the 4th batch (Lightning: 2)
    assert bar.total_train_batches == 6
    bar._trainer = trainer(64, 0, max_steps=100)  # the second epoch of a 100-step run
    assert bar.total_train_batches == 36


def test_a_run_without_a_terminal_prints_a_plain_progress_line_every_n_steps(tmp_path, capsys):
    import re

    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from recipes.console import StepProgressBar

    class Logged(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("train_loss", out["loss"], prog_bar=True)
            return out

    def fit(bar):
        trainer = L.Trainer(
            max_steps=7,
            callbacks=[bar],
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            limit_val_batches=0,
        )
        trainer.fit(Logged())
        return capsys.readouterr().out

    out = fit(StepProgressBar(every_n_steps=3))  # pytest's stdout is no terminal: plain lines
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["3/7", "6/7", "7/7"], out
    pattern = r"^step \d+/7  train_loss -?\d+\.\d{4}  \d+\.\d{2} it/s  ETA \d+:\d{2}:\d{2}$"
    assert all(re.match(pattern, line) for line in lines), lines
    assert lines[-1].endswith("ETA 0:00:00")
    assert not [
        line for line in fit(StepProgressBar(every_n_steps=3, plain=False)).splitlines() if line.startswith("step ")
    ]
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        StepProgressBar(every_n_steps=0)


def test_resuming_with_another_max_steps_warns_when_the_schedule_changes_shape():
    from types import SimpleNamespace

    from recipes.checkpoints import schedule_change
    from recipes.flux import FluxFineTune

    cosine = {"lr_scheduler": "cosine", "warmup_steps": 0, "max_steps": 30}
    assert schedule_change(cosine, cosine) is None
    assert schedule_change(None, cosine) is None  # a checkpoint from before the schedule was recorded
    constant = {**cosine, "lr_scheduler": "constant"}
    assert schedule_change(constant, {**constant, "max_steps": 60}) is None  # no end to move
    message = schedule_change(cosine, {**cosine, "max_steps": 60})
    assert "cosine schedule written for max_steps=30 with max_steps=60" in message
    assert "--trainer.max_steps 30" in message
    assert "warmup_steps=0 under lr_scheduler='cosine', warmup_steps=5" in schedule_change(
        cosine, {**cosine, "warmup_steps": 5}
    )
    # wired into the module's checkpoint loading (what Lightning calls on --ckpt_path)
    module = FluxFineTune(lr_scheduler="linear")
    module._trainer = SimpleNamespace(max_steps=60, strategy=SimpleNamespace(dp_size=1, cp=2))
    saved = {**module.checkpoint_identity(), "schedule": {"lr_scheduler": "linear", "warmup_steps": 0, "max_steps": 30}}
    with pytest.warns(UserWarning, match="linear schedule written for max_steps=30 with max_steps=60"):
        module.on_load_checkpoint({"recipe": saved, "state_dict": {}})


def test_wan22_a14b_experts_train_on_their_side_of_the_boundary():
    from recipes.wan import WanFineTune

    high, low = WanFineTune(expert="high_noise"), WanFineTune(expert="low_noise", boundary_ratio=0.9)
    assert (high.hparams.min_timestep, high.hparams.max_timestep, high.transformer_subfolder) == (
        0.875,
        1.0,
        "transformer",
    )
    assert (low.hparams.min_timestep, low.hparams.max_timestep, low.transformer_subfolder) == (
        0.0,
        0.9,
        "transformer_2",
    )
    _, t = low.noise_and_t(torch.zeros(32, 4, 1, 2, 2), torch.arange(32))
    assert float(t.max()) <= 0.9
    with pytest.raises(ValueError, match="expert must be one of"):
        WanFineTune(expert="both")
    with pytest.raises(ValueError, match=r"trains on t in \[0.875, 1.0\]"):
        WanFineTune(expert="high_noise", max_timestep=0.5)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_checkpoints_keep_the_trainable_parameters_and_a_full_fine_tune_keeps_them_all(lora_rank, monkeypatch):
    from types import SimpleNamespace

    from cp_lightning.tiny import _flux
    from recipes.flux import FluxFineTune

    monkeypatch.setattr("recipes.finetune.load_transformer", lambda *args, **kwargs: _flux(heads=2))
    module = FluxFineTune(lora_rank=lora_rank)
    module.configure_model()
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(dp_size=1, cp=2))
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    names = {n for n, _ in module.named_parameters()}
    kept = set(checkpoint["state_dict"])
    if lora_rank:
        assert kept and all("lora" in n for n in kept) and len(kept) < len(names)  # the frozen base is left out
    else:
        assert kept == names  # every parameter trains, so every one is saved
    assert sorted(kept) == sorted(checkpoint["recipe"]["trainable"])

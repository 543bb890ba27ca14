"""What a training step draws and how it is weighted: timesteps, loss weights, learning-rate schedules, EMA.

Timesteps t in (0, 1) are flow-matching times (t = 1 is pure noise), drawn per sample from a generator
seeded by (seed, epoch, sample index), then shifted and mapped into [min_t, max_t]:

    t ~ sigmoid(sigmoid_scale * N(0, 1))   (logit_normal)   or   t ~ U(0, 1)   (uniform)
    t <- s t / (1 + (s - 1) t)                              fixed shift s (SD3, Wan) or, for Flux and
                                                            QwenImage, s = exp(mu(tokens)), mu linear in
                                                            the image token count (diffusers'
                                                            calculate_shift, each with its own ends)
    t <- min_t + (max_t - min_t) t

The token count is that of the full sample (the recipe sees the full latents; CP splits them only inside
the transformer), so every dp x cp layout draws the same t.
"""

from __future__ import annotations

import math

import torch

SCHEDULERS = ("constant", "cosine", "linear")
WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")
SAMPLINGS = ("logit_normal", "uniform")


def check_timestep_options(
    sampling: str, shift: float, sigmoid_scale: float, min_t: float, max_t: float, weighting: str
) -> None:
    if sampling not in SAMPLINGS:
        raise ValueError(f"timestep_sampling must be one of {SAMPLINGS}, got {sampling!r}.")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"loss_weighting must be one of {WEIGHTINGS}, got {weighting!r}.")
    if not shift > 0:
        raise ValueError(f"shift must be > 0 (1.0: no shift; Wan uses 3-5), got {shift}.")
    if not sigmoid_scale > 0:
        raise ValueError(f"sigmoid_scale must be > 0, got {sigmoid_scale}.")
    if not 0.0 <= min_t < max_t <= 1.0:
        raise ValueError(f"need 0 <= min_timestep < max_timestep <= 1, got {min_t} and {max_t}.")


FLUX_SHIFT_RANGE = (256, 4096, 0.5, 1.15)  # mu from 0.5 at 256 image tokens to 1.15 at 4096 (Flux's scheduler)


def flux_shift(tokens: int, shift_range: tuple = FLUX_SHIFT_RANGE) -> float:
    """Flux's resolution-dependent shift exp(mu) for ``tokens`` image tokens (the full count, not a CP shard's);
    ``shift_range`` = (base tokens, max tokens, base mu, max mu), QwenImage's scheduler has its own."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return math.exp(calculate_shift(tokens, *shift_range))


def shift_t(t: torch.Tensor, shift: float) -> torch.Tensor:
    """The SD3 / Flux time shift: s t / (1 + (s - 1) t); s > 1 moves samples towards noise."""
    return shift * t / (1 + (shift - 1) * t)


def sample_noise_and_t(
    latents: torch.Tensor,
    index: torch.Tensor,
    *,
    seed: int,
    epoch: int,
    sampling: str = "logit_normal",
    sigmoid_scale: float = 1.0,
    shift: float = 1.0,
    min_t: float = 0.0,
    max_t: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise like ``latents`` and t per sample, from a generator seeded by (seed, epoch, sample index):
    the same draws whatever the dp x cp layout or batch composition."""
    noise, t = torch.empty_like(latents), torch.empty(latents.shape[0], dtype=torch.float64)
    for i, item in enumerate(index.tolist()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 100_003 + item)
        noise[i] = torch.randn(latents.shape[1:], generator=g, dtype=latents.dtype)
        if sampling == "logit_normal":
            t[i] = torch.sigmoid(sigmoid_scale * torch.randn((), generator=g).double())
        else:
            t[i] = torch.rand((), generator=g).double()
    t = min_t + (max_t - min_t) * shift_t(t, shift)
    return noise, t.to(latents.dtype).to(latents.device)


def loss_weights(weighting: str, t: torch.Tensor) -> torch.Tensor | None:
    """Per-sample loss weights (SD3 paper's schemes, diffusers' implementation); None for ``"none"``."""
    if weighting == "none":
        return None
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    return compute_loss_weighting_for_sd3(weighting, t.float().clamp_min(1e-3))


def lr_schedule(optimizer, kind: str, warmup_steps: int, total_steps: int):
    """diffusers' schedules: linear warmup from 0 over ``warmup_steps``, then constant, cosine to 0 or
    linear to 0 at ``total_steps``."""
    from diffusers.optimization import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    check_schedule(kind, warmup_steps, total_steps)
    if kind == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup_steps)
    make = get_cosine_schedule_with_warmup if kind == "cosine" else get_linear_schedule_with_warmup
    return make(optimizer, warmup_steps, total_steps)


def check_schedule(kind: str, warmup_steps: int, total_steps: int | None) -> None:
    """Validate the schedule options; ``total_steps`` None skips the length check (not known yet)."""
    if kind not in SCHEDULERS:
        raise ValueError(f"lr_scheduler must be one of {SCHEDULERS}, got {kind!r}.")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
    if total_steps is None:
        return
    if total_steps <= 0 and kind != "constant":
        raise ValueError(f"lr_scheduler={kind!r} decays over the run, so it needs trainer.max_steps > 0.")
    if total_steps > 0 and warmup_steps >= total_steps:
        raise ValueError(
            f"warmup_steps={warmup_steps} is not shorter than the training run (max_steps={total_steps}): "
            "lower model.warmup_steps or raise trainer.max_steps."
        )


class TrainableEMA:
    """Exponential moving average of the trainable parameters only (never a copy of a frozen base).

    ``update`` after every optimizer step: ema <- decay * ema + (1 - decay) * param, in fp32.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1) (e.g. 0.999), or 0 to disable EMA; got {decay}.")
        self.decay = decay
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shadow = [p.detach().float().clone() for p in self.params]

    def follow(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Track ``named_params`` (the same names) from now on: FSDP2 replaces each parameter by a sharded
        one, and an EMA of the old objects would average stale weights. Each shadow is split like its new
        parameter (locally, no collectives); the values are kept."""
        if [name for name, _ in named_params] != self.names:
            raise ValueError("TrainableEMA.follow needs the parameters it was created with (the same names).")
        self.params = [p for _, p in named_params]
        self.shadow = [_placed_like(s, p) for s, p in zip(self.shadow, self.params, strict=True)]

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow, strict=True))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA with FSDP-sharded tensors gathered (a collective then: every rank calls it), on CPU."""
        from torch.distributed.tensor import DTensor

        return {n: (t.full_tensor() if isinstance(t, DTensor) else t).cpu() for n, t in self.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if sorted(state) != sorted(self.names):
            raise ValueError("the checkpoint's EMA holds other parameters than this model trains (another LoRA?).")
        self.shadow = [
            _placed_like(state[name].float().clone(), p) for name, p in zip(self.names, self.params, strict=True)
        ]


def _placed_like(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a full tensor, or a DTensor) on ``param``'s device and, for an FSDP-sharded (DTensor)
    parameter, with its sharding. A full tensor is split locally (every rank holds it; no collectives)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).to(param.device)
    if isinstance(tensor, DTensor) and tensor.placements == param.placements:
        local = tensor.to_local()
    else:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    # (with CPU offload the parameter's shard lives on the CPU, not on the mesh's device)
    return DTensor.from_local(
        local.to(param.to_local().device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )

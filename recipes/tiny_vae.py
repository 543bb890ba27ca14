"""Fit the tiny pipelines' VAEs to the synthetic shapes, so that samples show what the transformer learned
(a random-init VAE decodes anything to noise): Flux's and QwenImage's on still shapes, HunyuanVideo's on 5-frame
clips of a shape moving right (its 4x causal temporal compression: the first frame alone, then four frames per
latent).

Adam on MSE reconstruction plus a small KL term, on random 16 px crops of 256 generated 32 px shapes (the
VAEs are convolutional; crops cost a quarter of full images): ~15 s of one CPU core for Flux's, about a
minute for HunyuanVideo's. The latents are then standardised the way the real VAEs are (Flux:
``shift_factor`` and ``scaling_factor``; HunyuanVideo: ``scaling_factor``; QwenImage: ``latents_mean`` and
``latents_std`` per channel; Flux.2's, which FLUX.3 uses: its batch norm's running statistics). Deterministic
for a given torch build; the fitted weights are cached per machine in ``$CP_LIGHTNING_CACHE`` (default
``~/.cache/cp_lightning``), so every tiny pipeline built on them (tests build many) pays the fit once.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

STEPS, BATCH, CROP, LR, SAMPLES = 400, 16, 16, 4e-3, 256


def _cache_file(vae, frames: int) -> Path:
    # diffusers' private config keys (`_use_default_values`: a list in no fixed order) would make the key differ
    config = {k: v for k, v in vae.config.items() if not k.startswith("_")}
    settings = [config, STEPS, BATCH, CROP, LR, SAMPLES, torch.__version__]
    key = json.dumps(settings + ([frames] if frames > 1 else []), sort_keys=True, default=str)
    root = Path(os.environ.get("CP_LIGHTNING_CACHE", Path.home() / ".cache" / "cp_lightning"))
    kind = "qwenimage" if _per_channel(vae) else "flux" if frames == 1 else "video"
    return root / f"tiny_{kind}_vae-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def _per_channel(vae) -> bool:
    """QwenImage's VAE standardises each latent channel (``latents_mean``, ``latents_std``); AutoencoderKL's
    fields of those names are unset (None) and HunyuanVideo's VAE has none."""
    return vae.config.get("latents_mean") is not None


def _pixels(image) -> torch.Tensor:
    return torch.frombuffer(bytearray(image.convert("RGB").tobytes()), dtype=torch.uint8).view(32, 32, 3)


def _shapes(frames: int = 1, seed: int = 1) -> torch.Tensor:
    """N, 3, 32, 32 (still shapes) or N, 3, frames, 32, 32 (clips of a shape moving right) in [-1, 1]: the
    recipes' synthetic shapes (by default another seed than the training data's)."""
    from PIL import Image, ImageSequence

    from recipes.synthetic import make_shapes

    with tempfile.TemporaryDirectory() as folder:
        make_shapes(folder, SAMPLES, size=32, seed=seed, frames=frames)
        if frames == 1:
            pixels = [_pixels(Image.open(p)) for p in sorted(Path(folder).glob("*.png"))]
            return torch.stack(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # N, H, W, C -> N, C, H, W
        clips = []
        for path in sorted(Path(folder).glob("*.gif")):
            clip = [_pixels(frame) for frame in ImageSequence.Iterator(Image.open(path))]
            clip += clip[-1:] * (frames - len(clip))  # the GIF writer merges a shape that stopped at the edge
            clips.append(torch.stack(clip[:frames]))
    return torch.stack(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0  # N, F, H, W, C -> N, C, F, H, W


def _fit(vae, pixels: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(vae.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=STEPS, pct_start=0.1)
    vae.train()
    for _ in range(STEPS):
        batch = pixels[torch.randint(0, len(pixels), (BATCH,), generator=g)]
        i, j = torch.randint(0, 32 - CROP + 1, (2,), generator=g).tolist()
        batch = batch[..., i : i + CROP, j : j + CROP]
        posterior = vae.encode(batch).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=g)
        loss = torch.nn.functional.mse_loss(vae.decode(z).sample, batch) + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    vae.eval()


def fit_tiny_vae(vae, frames: int = 1) -> None:
    """Fit ``vae`` in place (the tiny Flux AutoencoderKL or QwenImage VAE; with ``frames`` > 1 the tiny
    HunyuanVideo VAE, on clips of that many frames), or load the cached fit; set its latent scaling."""
    from safetensors.torch import load_file, save_file

    per_channel = _per_channel(vae)  # QwenImage's VAE: images as 1-frame clips, statistics per channel
    pixels = _shapes(frames).unsqueeze(2) if per_channel else _shapes(frames)  # N, C, (1,) H, W
    path = _cache_file(vae, frames)
    if path.exists():
        vae.load_state_dict(load_file(str(path)))
    else:
        threads = torch.get_num_threads()
        with torch.random.fork_rng():
            torch.set_num_threads(1)  # one thread: the same fit on every machine of this torch build
            try:
                _fit(vae, pixels)
            finally:
                torch.set_num_threads(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(tmp))
        tmp.replace(path)  # atomic: concurrent builds never read half a file
    vae.eval()
    with torch.no_grad():
        z = vae.encode(pixels).latent_dist.mode()
    if per_channel:  # N, C, 1, h, w: each channel standardised, as QwenImage's VAE config does
        dims = [0, *range(2, z.ndim)]
        vae.register_to_config(latents_mean=z.mean(dims).tolist(), latents_std=z.std(dims).tolist())
        return
    if getattr(vae, "bn", None) is not None:  # Flux.2's VAE (FLUX.3's too): a batch norm's running statistics
        # standardise each channel of the 2x2-patchified latents, as its pipelines read them
        n, c, h, w = z.shape
        patches = z.view(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(n, 4 * c, h // 2, w // 2)
        var = patches.var(dim=(0, 2, 3)) - vae.config.batch_norm_eps  # the pipelines add eps back
        vae.bn.running_mean.copy_(patches.mean(dim=(0, 2, 3)))
        vae.bn.running_var.copy_(var.clamp_min(0.0))
        return
    if frames > 1:  # HunyuanVideo's VAE scales its latents, with no shift
        vae.register_to_config(scaling_factor=float(1.0 / z.std()))
        return
    # standardised latents, as Flux's VAE config does with its shift and scaling factors
    vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1.0 / z.std()))

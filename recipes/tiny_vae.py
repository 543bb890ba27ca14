"""Fit the tiny Flux pipeline's VAE to the synthetic shapes, so that the embedded default's samples show
what the transformer learned (a random-init VAE decodes anything to noise).

Adam on MSE reconstruction plus a small KL term, on random 16 px crops of 256 generated 32 px shapes
(the VAE is convolutional; crops cost a quarter of full images): ~15 s of one CPU core. The latents are
then standardised the way real Flux VAEs are (``shift_factor``, ``scaling_factor``). Deterministic for a
given torch build; the fitted weights are cached per machine in ``$CP_LIGHTNING_CACHE`` (default
``~/.cache/cp_lightning``), so every tiny pipeline built on it (tests build many) pays the fit once.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

STEPS, BATCH, CROP, LR, SAMPLES = 400, 16, 16, 4e-3, 256


def _cache_file(vae) -> Path:
    settings = [dict(vae.config), STEPS, BATCH, CROP, LR, SAMPLES, torch.__version__]
    key = json.dumps(settings, sort_keys=True, default=str)
    root = Path(os.environ.get("CP_LIGHTNING_CACHE", Path.home() / ".cache" / "cp_lightning"))
    return root / f"tiny_flux_vae-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def _shapes() -> torch.Tensor:
    """N, 3, 32, 32 in [-1, 1]: the recipes' synthetic shapes (another seed than the training data's)."""
    from PIL import Image

    from recipes.synthetic import make_shapes

    with tempfile.TemporaryDirectory() as folder:
        make_shapes(folder, SAMPLES, size=32, seed=1)
        images = [Image.open(p).convert("RGB") for p in sorted(Path(folder).glob("*.png"))]
        pixels = [torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(32, 32, 3) for im in images]
    return torch.stack(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # N, H, W, C -> N, C, H, W


def _fit(vae, pixels: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(vae.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=STEPS, pct_start=0.1)
    vae.train()
    for _ in range(STEPS):
        batch = pixels[torch.randint(0, len(pixels), (BATCH,), generator=g)]
        i, j = torch.randint(0, 32 - CROP + 1, (2,), generator=g).tolist()
        batch = batch[:, :, i : i + CROP, j : j + CROP]
        posterior = vae.encode(batch).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=g)
        loss = torch.nn.functional.mse_loss(vae.decode(z).sample, batch) + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    vae.eval()


def fit_tiny_vae(vae) -> None:
    """Fit ``vae`` (the tiny Flux AutoencoderKL) in place, or load the cached fit; set its latent scaling."""
    from safetensors.torch import load_file, save_file

    path = _cache_file(vae)
    if path.exists():
        vae.load_state_dict(load_file(str(path)))
    else:
        threads = torch.get_num_threads()
        with torch.random.fork_rng():
            torch.set_num_threads(1)  # one thread: the same fit on every machine of this torch build
            try:
                _fit(vae, _shapes())
            finally:
                torch.set_num_threads(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(tmp))
        tmp.replace(path)  # atomic: concurrent builds never read half a file
    vae.eval()
    with torch.no_grad():
        z = vae.encode(_shapes()).latent_dist.mode()
    # standardised latents, as Flux's VAE config does with its shift and scaling factors
    vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1.0 / z.std()))

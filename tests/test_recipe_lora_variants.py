"""DoRA and LoKr (``model.lora_type``) through peft: CP gradients under DDP and FSDP against one process, exports
that round-trip or refuse, and the option's errors.

The gradients are the Flux recipe's own module (recipes/flux.py) trained by Lightning with ContextParallelStrategy
at dp1 x cp2, DDP and FSDP2 (the transformer built on the meta device and loaded by the strategy after sharding,
so the adapters are initialised on the shards), two SGD steps on fixed batches; step 2's gradients are compared
with one process (the first step moves every adapter tensor off its zero-update init).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.distributed import spawn

CASES = [("dora", False), ("dora", True), ("lokr", False), ("lokr", True)]  # (lora_type, fsdp)


class Batches(torch.utils.data.Dataset):
    """Fixed Flux batches for the tiny model: latents of 8 x 8 (16 packed tokens, 8 per CP rank) and text."""

    def __init__(self, config: dict):
        self.config = config

    def __len__(self):
        return 4

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(100 + i)
        c = self.config
        return {
            "latents": torch.randn(c["in_channels"] // 4, 8, 8, generator=g),
            "prompt_embeds": torch.randn(8, c["joint_attention_dim"], generator=g),
            "pooled_prompt_embeds": torch.randn(c["pooled_projection_dim"], generator=g),
            "index": torch.tensor(i),
        }


def _module(cache, lora_type: str):
    from recipes.flux import FluxFineTune

    class SGDFineTune(FluxFineTune):
        def configure_optimizers(self):  # SGD: Adam's normalisation would hide a wrong gradient scale
            return torch.optim.SGD([p for _, p in self.trainable_parameters()], lr=0.5)

    return SGDFineTune(cache_dir=str(cache), lora_rank=4, lora_type=lora_type, learning_rate=0.5)


def _config(cache) -> dict:
    return json.loads((cache / "tiny_flux_pipeline" / "transformer" / "config.json").read_text())


def fit_grads(cache, lora_type: str, strategy, devices: int) -> dict[str, np.ndarray]:
    """Step 2's full gradients of every trainable tensor (rank 0 returns them)."""
    import lightning as L
    from torch.distributed.tensor import DTensor

    grads = {}

    class Record(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                for name, p in pl_module.trainable_parameters():
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    grads[name] = g.detach().double().numpy().copy()

    module = _module(cache, lora_type)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # dp = 1: every rank takes the same batches
        callbacks=[Record()],
    )
    trainer.fit(module, torch.utils.data.DataLoader(Batches(_config(cache)), batch_size=2))
    return grads


def _cp_cases(rank, world, cache):
    from cp_lightning import ContextParallelStrategy

    return {case: fit_grads(cache, case[0], ContextParallelStrategy(cp=world, fsdp=case[1]), world) for case in CASES}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from recipes.components import resolve_pretrained

    cache = tmp_path_factory.mktemp("variants")
    resolve_pretrained("flux", "tiny", cache)  # builds the tiny pipeline once, before the workers read it
    return cache


def test_dora_and_lokr_cp_gradients_under_ddp_and_fsdp_equal_one_process(cache):
    results = spawn(_cp_cases, 2, cache, timeout_s=900)
    for lora_type in ("dora", "lokr"):
        single = fit_grads(cache, lora_type, "auto", 1)
        kinds = {"dora": ("lora_A", "lora_B", "lora_magnitude_vector"), "lokr": ("lokr_w1", "lokr_w2")}[lora_type]
        assert all(any(kind in name for name in single) for kind in kinds), sorted(single)[:6]
        for fsdp in (False, True):
            for rank in (0, 1):
                grads = results[rank][(lora_type, fsdp)]
                assert sorted(grads) == sorted(single)
                for name, g in single.items():
                    assert np.abs(g).max() > 0, name  # every tensor moves after the first step
                    err = np.abs(grads[name] - g).max() / np.abs(g).max()
                    assert err < 1e-4, (lora_type, fsdp, rank, name, err)


def _trained(cache, lora_type: str):
    """The recipe's module with every adapter tensor perturbed (a zero update would hide a bad export)."""
    module = _module(cache, lora_type)
    module.configure_model()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in module.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return module


def _output(module) -> torch.Tensor:
    batch = torch.utils.data.default_collate([Batches(_config_of(module))[i] for i in range(2)])
    with torch.no_grad():
        return module.predict(batch)[0]


def _config_of(module) -> dict:
    return dict(module.transformer.config)


def test_exports_round_trip_in_each_variants_formats_and_refuse_the_others(cache, tmp_path):
    from diffusers import FluxPipeline

    from recipes import lora
    from recipes.components import load_transformer

    for lora_type, formats in lora.VARIANT_FORMATS.items():
        module = _trained(cache, lora_type)
        expected = _output(module)
        for fmt in formats:
            folder = tmp_path / f"{lora_type}_{fmt}"
            (path,) = lora.export(module, folder, fmt=fmt)
            assert lora.read(path)[1]["cp_lightning.lora_type"] == lora_type
            if fmt == "diffusers":  # the pipeline's own loader
                pipe = FluxPipeline.from_pretrained(str(cache / "tiny_flux_pipeline"))
                pipe.load_lora_weights(str(folder))
                loaded = pipe.transformer
            elif fmt == "comfyui":  # back through the converter, then the pipeline's loader
                from recipes.convert_lora import convert

                back = convert(folder, tmp_path / f"{lora_type}_back", "diffusers")
                pipe = FluxPipeline.from_pretrained(str(cache / "tiny_flux_pipeline"))
                pipe.load_lora_weights(str(back))
                loaded = pipe.transformer
            else:
                loaded = lora.load_peft(load_transformer("flux", "tiny", cache), folder)
            original, module.transformer = module.transformer, loaded
            try:
                np.testing.assert_allclose(_output(module), expected, atol=1e-6, err_msg=f"{lora_type} {fmt}")
            finally:
                module.transformer = original
        for fmt in set(lora.FORMATS) - set(formats):
            with pytest.raises(ValueError, match=f"a {lora_type} adapter has no {fmt} layout.*exports as"):
                lora.export(module, tmp_path / "refused", fmt=fmt)
    assert not (tmp_path / "refused").exists()


def test_bad_lora_type_options_are_clear_errors(cache):
    from recipes.flux import FluxFineTune

    with pytest.raises(ValueError, match=r"lora_type must be one of \('lora', 'dora', 'lokr'\), got 'loha'"):
        FluxFineTune(lora_type="loha")
    with pytest.raises(ValueError, match="lora_type=dora .* float8 base"):
        FluxFineTune(lora_type="dora", base_dtype="float8_e4m3fn")

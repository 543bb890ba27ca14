"""SkyReels-V2 diffusion-forcing LoRA (or full) fine-tuning; a LightningModule and its CLI.

    python -m recipes.skyreels_df fit --config configs/tiny_skyreels_df_cp2.yaml

Diffusion forcing trains a video model to denoise frames that carry different noise levels: every causal block
of ``num_frame_per_block`` latent frames (the transformer's config) draws its own time t, and a frame attends to
the frames of its own and earlier blocks only. The recipe carries no CP code: the plan library's SkyReels-V2
entry keeps diffusers from building its dense (S, S) block-causal mask and hands the attention a
``cp_lightning.masks.block_causal`` spec instead (docs/masks.md), so every layout trains on the same attention.
Noise and times are drawn per sample from a generator seeded by (seed, epoch, sample index), so any dp x cp
layout trains on the same draws. Clips must fill whole blocks: latent frames a multiple of the block (with the
real and the tiny VAE, which compress 4 frames into one: 4k+1 frames give k+1 latent frames).
"""

from __future__ import annotations

import torch

from recipes import training
from recipes.data import WanData
from recipes.finetune import cli
from recipes.sampling import SampleWan
from recipes.wan import WanFineTune

# added to the per-sample seed for the block times, so they are not the draws the per-sample t was made of
BLOCK_SEED = 7_919


class SkyReelsDFData(WanData):
    """Video clips for SkyReels-V2 DF; the arguments of :class:`~recipes.data.WanData`. Every clip length must
    fill whole causal blocks (checked with the bucket table, before any clip is encoded)."""

    family = "skyreels_df"

    def __init__(self, data_dir: str | None = None, *, num_frames: int = 13, **kwargs):
        # (kwargs pass through untouched: LightningCLI reads WanData's arguments from this call)
        super().__init__(data_dir, num_frames=num_frames, **kwargs)

    def frames_per_block(self) -> int:
        from diffusers import SkyReelsV2Transformer3DModel

        config = SkyReelsV2Transformer3DModel.load_config(self._pipeline_path(), subfolder="transformer")
        return int(config.get("num_frame_per_block", 1))

    def plan(self, cp: int = 1) -> list[dict]:
        samples = super().plan(cp)
        _, temporal, patch_t = self.geometry()
        block = self.frames_per_block()
        for row in self.table:
            latent = ((row["frames"] - 1) // temporal + 1) // patch_t
            if latent % block:
                good = [f for f in range(row["frames"], row["frames"] + 8 * temporal * block) if f % (4 * block) == 1]
                raise ValueError(
                    f"clips of {row['frames']} frames give {latent} latent frames, which do not fill whole causal "
                    f"blocks of {block} latent frames (the transformer's num_frame_per_block; diffusers' SkyReels-V2 "
                    f"cannot render a partial block): use clip lengths such as {good[:2]} (data.num_frames / "
                    "data.frame_buckets)."
                )
        return samples


class SampleSkyReelsDF(SampleWan):
    __doc__ = SampleWan.__doc__
    family = "skyreels_df"

    def render(self, pipeline, embeds, seed):
        # the diffusion-forcing pipeline takes ``prompt`` positionally, even when the embeddings are given
        return super().render(pipeline, {"prompt": None, **embeds}, seed)


class SkyReelsDFFineTune(WanFineTune):
    """Diffusion-forcing fine-tuning of a ``SkyReelsV2Transformer3DModel`` (see FlowMatchingFineTune for the shared
    arguments): one time t per causal block of latent frames, drawn like the other recipes' per-sample t (the
    same sampling, shift and range), and the flow-matching loss over every frame."""

    family = "skyreels_df"
    sampler = SampleSkyReelsDF

    def __init__(self, pretrained: str = "tiny", **kwargs):
        # (kwargs pass through untouched: LightningCLI reads the shared arguments from this call)
        super().__init__(pretrained, **kwargs)
        if self.hparams.expert is not None:
            raise ValueError("model.expert is Wan2.2 A14B's; SkyReels-V2 DF is one transformer: drop it.")
        if self.hparams.loss_weighting != "none":
            raise ValueError(
                f"model.loss_weighting={self.hparams.loss_weighting!r} weights a sample by its one time t; diffusion "
                "forcing draws a time per block, so use loss_weighting: none."
            )

    def block_times(self, index: torch.Tensor, frames: int) -> torch.Tensor:
        """(B, frames) times in [min_timestep, max_timestep]: one per causal block (a shorter last block too), from
        a generator seeded by (seed, epoch, sample index)."""
        h = self.hparams
        block = self.transformer.config.num_frame_per_block
        blocks = -(-frames // block)
        t = torch.empty(len(index), blocks, dtype=torch.float64)
        for i, item in enumerate(index.tolist()):
            g = torch.Generator().manual_seed(h.seed * 1_000_003 + self.current_epoch * 100_003 + item + BLOCK_SEED)
            if h.timestep_sampling == "logit_normal":
                t[i] = torch.sigmoid(h.sigmoid_scale * torch.randn(blocks, generator=g).double())
            else:
                t[i] = torch.rand(blocks, generator=g).double()
        t = h.min_timestep + (h.max_timestep - h.min_timestep) * training.shift_t(t, h.shift)
        return t.repeat_interleave(block, dim=1)[:, :frames]

    def predict(self, batch):
        x0 = batch["latents"]  # B, C, f, h, w
        frames = x0.shape[2]
        if "noise" in batch:  # the validation loss's fixed draws: its per-sample t for every block
            noise, t = batch["noise"], batch["t"].view(-1, 1).expand(-1, frames)
        else:
            noise, _ = self.draws(x0, batch)
            t = self.block_times(batch["index"], frames).to(x0.device)
        t = t.to(x0.dtype)
        tb = t[:, None, :, None, None]
        xt = (1 - tb) * x0 + tb * noise
        pred = self.transformer(
            hidden_states=xt,
            timestep=t * 1000,  # (B, f): one timestep per latent frame, SkyReels-V2's diffusion forcing
            encoder_hidden_states=batch["prompt_embeds"],
            enable_diffusion_forcing=True,
            return_dict=False,
        )[0]
        return pred, noise - x0, t.mean(dim=1)


def main(args=None):
    return cli(SkyReelsDFFineTune, SkyReelsDFData, args)


if __name__ == "__main__":
    main()

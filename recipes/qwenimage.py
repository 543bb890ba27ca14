"""QwenImage text-to-image LoRA (or full) fine-tuning with flow matching; a LightningModule and its CLI.

    python -m recipes.qwenimage fit --config configs/tiny_qwenimage_cp2.yaml

Like recipes/flux.py it carries no CP code. QwenImage's CP plan (cp_lightning/models/qwenimage.py, the model's
own) splits the image and the Qwen2.5-VL text tokens (they meet in every block's joint attention) with the text
padding mask, and gathers the image after ``proj_out``. Times are shifted by the image token count as QwenImage's
scheduler samples (``resolution_shift`` with its ends); noise and timesteps are drawn per sample from a
generator seeded by (seed, epoch, sample index), so any dp x cp layout trains on the same draws.
"""

from __future__ import annotations

from recipes.components import QWENIMAGE_SCHEDULER
from recipes.data import QwenImageData
from recipes.finetune import FlowMatchingFineTune, cli

_S = QWENIMAGE_SCHEDULER


class QwenImageFineTune(FlowMatchingFineTune):
    """Flow-matching fine-tuning of a ``QwenImageTransformer2DModel`` (see FlowMatchingFineTune for the shared
    arguments; ``resolution_shift`` is on by default: QwenImage's shift from the image token count, mu from 0.5
    at 256 tokens to 0.9 at 8192, as its scheduler samples; 1328 px: 6889 tokens, s = 2.30)."""

    family = "qwenimage"
    # the attention projections of the image and text streams of every dual-stream block
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    shift_range = (_S["base_image_seq_len"], _S["max_image_seq_len"], _S["base_shift"], _S["max_shift"])

    def __init__(self, pretrained: str = "tiny", *, resolution_shift: bool = True, **kwargs):
        # (kwargs pass through untouched: LightningCLI reads the shared arguments from this call)
        super().__init__(pretrained, resolution_shift=resolution_shift, **kwargs)

    def unused_modules(self, transformer):
        # the last block's text output is dropped (only the image stream reaches proj_out): its text queries, text
        # attention output and text MLP never reach the loss
        last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
        names = ("attn.add_q_proj", "attn.norm_added_q", "attn.to_add_out", "txt_mlp")
        modules = dict(transformer.named_modules())
        return [f"{last}.{name}" for name in names if modules.get(f"{last}.{name}") is not None]

    def image_tokens(self, x0):
        p = self.transformer.config.patch_size
        return (x0.shape[-2] // p) * (x0.shape[-1] // p)  # 2x2 packed latent patches

    def predict(self, batch):
        from diffusers import QwenImagePipeline

        x0 = batch["latents"]  # B, C, h, w
        b, c, h, w = x0.shape
        noise, t = self.draws(x0, batch)  # t from the full token count, never a CP shard's
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        # B, C, h, w -> B, (h/2)(w/2), 4C: QwenImage's 2x2 packed latent tokens
        packed = QwenImagePipeline._pack_latents(xt, b, c, h, w)
        target = QwenImagePipeline._pack_latents(noise - x0, b, c, h, w)
        pred = self.transformer(
            hidden_states=packed,
            timestep=t,  # as the pipeline calls it: timesteps / 1000, in [0, 1]
            encoder_hidden_states=batch["prompt_embeds"],
            encoder_hidden_states_mask=batch["prompt_embeds_mask"],
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return pred, target, t


def main(args=None):
    return cli(QwenImageFineTune, QwenImageData, args)


if __name__ == "__main__":
    main()

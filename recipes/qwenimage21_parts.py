"""Qwen-Image 2.1's pipeline pieces for the recipe: the tiny processor, the tiny pipeline, the encodings.

``QwenImage21Pipeline`` encodes a prompt with a Qwen3-VL model through transformers' ``Qwen3VLProcessor``: the raw
chat template tokenized with left padding, the system message's tokens counted once (its ``_drop_idx``, from the
processor's ``apply_chat_template``) and dropped from the hidden states, and ``<|image_pad|>`` found by id. That
processor cannot be built without torchvision (its video processor needs it), so a real checkpoint's processor
makes torchvision the user's dependency (:data:`TORCHVISION`). The tiny pipeline takes :class:`TinyQwen3VLProcessor`:
ByT5's byte tokenizer with Qwen's chat tokens as special tokens (no vocabulary download), text only (the recipe is
text-to-image), saved with the pipeline. diffusers loads a component of a module outside diffusers and transformers
only once that module is imported: ``import recipes.qwenimage21_parts`` before ``QwenImage21Pipeline.from_pretrained``
of a tiny pipeline folder (``recipes.components.load_pipeline`` does).

The tiny VAE compresses 16x as the real one does (the pipeline hard-codes ``vae_scale_factor = 16`` and rounds sides
down to multiples of 32): one latent token per 16 x 16 pixels, so a 64 px image is 4 x 4 tokens.
"""

from __future__ import annotations

import importlib.util

import torch
from diffusers import QwenImage21Pipeline  # noqa: F401  (recipes/components.py names the pipeline class through here)
from transformers import BatchFeature, ProcessorMixin  # (diffusers finds the processor's loader by this name here)

TINY = "tiny"
TORCHVISION = (
    "Qwen-Image 2.1's processor (transformers' Qwen3VLProcessor) needs torchvision, which is not installed: "
    "pip install torchvision (the build that matches your torch)."
)
# Qwen's chat and vision tokens, as special tokens of the tiny byte tokenizer (ids 259 on: ByT5 has no extra ids here)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen's chat template for text messages (the system message the pipeline counts is rendered exactly so)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the tiny pipeline's scheduler: Qwen-Image's resolution-dependent shift, exp(mu) with mu linear in the image token
# count between the ends QwenImage21Pipeline defaults to (256 -> 0.5, 4096 -> 1.15); training draws the same shift
SCHEDULER = dict(
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    time_shift_type="exponential",
)
PIPELINE_SHIFT_ENDS = (256, 4096, 0.5, 1.15)  # what QwenImage21Pipeline reads where the scheduler's config has none


class TinyQwen3VLProcessor(ProcessorMixin):
    """What ``Qwen3VLProcessor`` gives QwenImage21Pipeline for a text-to-image prompt, over a byte tokenizer: the
    template tokenized as written (Qwen's chat tokens are single special tokens; no end-of-sequence appended), padded
    on the side asked for, and the chat template for ``apply_chat_template``. Condition images are refused: the
    tiny text encoder has no vision tokens to give them."""

    attributes = ["tokenizer"]
    tokenizer_class = "ByT5Tokenizer"

    def __init__(self, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(tokenizer, chat_template=chat_template or CHAT_TEMPLATE)

    def __call__(self, text=None, images=None, padding=True, padding_side="left", return_tensors="pt", **kwargs):
        if images is not None:
            raise ValueError(
                "the tiny Qwen-Image 2.1 processor is text-only (the recipe is text-to-image): condition images need "
                "a real checkpoint's Qwen3VLProcessor."
            )
        text = [text] if isinstance(text, str) else list(text)
        ids = self.tokenizer(
            text, padding=padding, padding_side=padding_side, return_tensors=return_tensors, add_special_tokens=False
        )
        return BatchFeature(dict(ids), tensor_type=return_tensors)

    def apply_chat_template(self, conversation, tokenize=False, return_dict=False, add_generation_prompt=False, **_):
        import jinja2

        rendered = jinja2.Template(self.chat_template, keep_trailing_newline=True).render(
            messages=conversation, add_generation_prompt=add_generation_prompt
        )
        if not tokenize:
            return rendered
        ids = self.tokenizer(rendered, add_special_tokens=False).input_ids
        return {"input_ids": [ids]} if return_dict else [ids]


def check_processor(pretrained: str) -> None:
    """Refuse, before anything loads, a checkpoint whose processor cannot be built here (see :data:`TORCHVISION`)."""
    if pretrained != TINY and importlib.util.find_spec("torchvision") is None:
        raise ValueError(TORCHVISION)


def build_tiny_qwenimage21_pipeline(seed: int = 0):
    """Qwen-Image 2.1 at tiny size: a one-layer Qwen3-VL (its text tower is what the pipeline runs; a one-block
    vision tower completes the class), the byte-tokenizer processor, Qwen-Image 2.1's VAE at 16x compression with
    RGB in and out (the real one reads RGBA: :func:`latents_of` adds the opaque alpha) fitted to the synthetic
    shapes, a two-block transformer, and Qwen-Image's shifted flow-matching scheduler."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
    from transformers import ByT5Tokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from recipes.tiny_vae import fit_tiny_vae

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        tokenizer = ByT5Tokenizer(extra_ids=0, additional_special_tokens=SPECIAL_TOKENS, model_max_length=2048)
        ids = dict(zip(("vision_start", "vision_end", "image", "video"), tokenizer.convert_tokens_to_ids(
            SPECIAL_TOKENS[2:]), strict=True))  # fmt: skip
        rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}  # 16-dim heads
        text_encoder = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(
                text_config=dict(
                    vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                    rope_parameters=rope, pad_token_id=0,
                ),
                vision_config=dict(
                    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=8,
                    num_position_embeddings=16, deepstack_visual_indexes=[0],
                ),
                image_token_id=ids["image"], video_token_id=ids["video"],
                vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
            )
        )  # fmt: skip
        # five levels: four 2x downsamplings, the real VAE's 16x. Every argument given: diffusers lists the defaulted
        # ones in `_use_default_values` in set order, which differs between processes and would change the config's
        # hash that the fitted weights are cached under (recipes/tiny_vae.py)
        vae = AutoencoderKLQwenImage21(
            base_dim=16,
            decoder_base_dim=16,
            z_dim=16,
            dim_mult=[1, 1, 1, 1, 1],
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=[False] * 4,
            dropout=0.0,
            is_residual=True,
            patch_size=None,
            in_channels=3,
            out_channels=3,
            latents_mean=[0.0] * 16,
            latents_std=[1.0] * 16,
            scale_factor_spatial=16,
            scale_factor_temporal=1,
        )
        fit_tiny_vae(vae)  # reconstructs the synthetic shapes; sets the per-channel latents_mean and _std
        transformer = QwenImage21Transformer2DModel(
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            context_in_dim=32,
            mlp_ratio=2,
            axes_dims_rope=(4, 6, 6),
        )
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        processor=TinyQwen3VLProcessor(tokenizer),
        transformer=transformer,
    )


def shift_ends(scheduler_config: dict) -> tuple[float, float, float, float]:
    """(base tokens, max tokens, base mu, max mu) of the pipeline's resolution shift: its scheduler's, else the
    pipeline's defaults (what QwenImage21Pipeline computes mu with)."""
    keys = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
    return tuple(scheduler_config.get(k, d) for k, d in zip(keys, PIPELINE_SHIFT_ENDS, strict=True))


def latents_of(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels (B, 1, C, H, W) in [-1, 1] -> latents (B, z, h, w), standardised per channel as the pipeline's
    ``_encode_vae_image`` does; RGB gets an opaque alpha where the VAE reads RGBA (the real one)."""
    x = pixels.permute(0, 2, 1, 3, 4).to(vae.device, vae.dtype)  # B, 1, C, H, W -> B, C, 1, H, W
    if vae.config.in_channels == 4 and x.shape[1] == 3:
        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    z = vae.encode(x).latent_dist.mode()[:, :, 0].float().cpu()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1)
    return (z - mean) / std


def encode_text(pipeline, captions: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """Captions -> the pipeline's Qwen3-VL embeddings (its template, its system tokens dropped) right-padded to
    ``max_sequence_length`` with their mask, so that captions of any length batch together; a longer one is an
    error naming its length (the pipeline itself never truncates)."""
    embeds, mask, _ = pipeline.encode_prompt(list(captions))
    b, n, d = embeds.shape
    mask = torch.ones(b, n, dtype=torch.long) if mask is None else mask.long().cpu()
    if n > max_sequence_length:
        longest = captions[int(mask.sum(1).argmax())]
        raise ValueError(
            f"the caption {longest!r} takes {int(mask.sum(1).max())} text tokens after Qwen-Image 2.1's prompt "
            f"template, more than max_sequence_length={max_sequence_length}: raise data.max_sequence_length, or "
            "shorten the caption (the pipeline does not truncate)."
        )
    padded = embeds.new_zeros(b, max_sequence_length, d)
    padded[:, :n] = embeds
    full = torch.zeros(b, max_sequence_length, dtype=torch.long)
    full[:, :n] = mask
    return {"prompt_embeds": padded.float().cpu(), "prompt_embeds_mask": full}

"""FLUX.3's pipeline pieces for the recipe: a loadable set of components, the tiny one, and the encodings.

diffusers 0.42 runs FLUX.3 only as a modular pipeline (``Flux3ModularPipeline`` with ``Flux3AutoBlocks``); there is
no ``DiffusionPipeline`` class to load a checkpoint folder with. :class:`Flux3Components` is that class for the
recipes: it loads and saves the components in diffusers' folder layout (``transformer/``, ``vae/``,
``text_encoder/``, ``tokenizer/``, ``scheduler/`` and ``model_index.json``), so the data cache, the samples and the
tiny pipeline take the path every other family takes (``recipes/components.py``), and :meth:`Flux3Components.
denoiser` hands its modules to diffusers' own ``Flux3ModularPipeline`` to render.

Encodings, as the modular pipeline's blocks compute them: text through ``Flux3TextEncoderStep``'s Qwen3-VL
encoding (the chat template, hidden states of ``text_encoder_out_layers`` stacked), at a fixed window of
``max_sequence_length`` tokens; latents as ``Flux3VaeEncoderStep`` makes them (the VAE's mode, 2x2-patchified,
standardised by the VAE's batch-norm statistics).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from diffusers import DiffusionPipeline
from diffusers.loaders import Flux3LoraLoaderMixin

FLUX3_OUT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)  # Flux3TextEncoderStep's default: FLUX.3's Qwen3-VL layers


class Flux3Components(DiffusionPipeline, Flux3LoraLoaderMixin):
    """FLUX.3's transformer, VAE, Qwen3-VL text encoder, tokenizer (or processor) and scheduler, loadable with
    ``from_pretrained`` from a folder in diffusers' layout. ``text_encoder_out_layers``: the text encoder's hidden
    layers whose states are stacked into the text embeddings (FLUX.3's eight by default; kept in
    ``model_index.json``). ``load_lora_weights`` is FLUX.3's diffusers loader."""

    model_cpu_offload_seq = "text_encoder->transformer->vae"

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, text_encoder_out_layers=FLUX3_OUT_LAYERS):
        super().__init__()
        self.register_modules(
            transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler
        )
        self.register_to_config(text_encoder_out_layers=list(text_encoder_out_layers))
        self._denoiser = None

    @property
    def token_size(self) -> int:
        """Pixels per token side: the VAE's downsampling x the 2x2 patchification."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1) * 2

    def denoiser(self, guidance_scale: float = 1.0):
        """diffusers' ``Flux3ModularPipeline`` (``Flux3AutoBlocks`` without the prompt upsampler and the text encoder
        step: it takes ``prompt_embeds``) over these components; classifier-free guidance above 1.0 (then pass
        ``negative_prompt_embeds``). Rebuilt when the transformer or the guidance changes."""
        from diffusers import Flux3AutoBlocks
        from diffusers.guiders import ClassifierFreeGuidance
        from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

        key = (id(self.transformer), float(guidance_scale))
        if self._denoiser is None or self._denoiser[0] != key:
            blocks = Flux3AutoBlocks()
            for name in ("prompt_upsampler", "text_encoder"):
                blocks.sub_blocks.pop(name)
            pipeline = blocks.init_pipeline()
            channels = self.vae.config.latent_channels
            pipeline.update_components(
                transformer=self.transformer,
                vae=self.vae,
                scheduler=self.scheduler,
                guider=ClassifierFreeGuidance(guidance_scale=guidance_scale),
                image_processor=Flux3ImageProcessor(vae_scale_factor=self.token_size, vae_latent_channels=channels),
            )
            _quiet_loops(pipeline._blocks)  # (its public `blocks` is a deep copy)
            self._denoiser = (key, pipeline)
        return self._denoiser[1]


def _quiet_loops(block) -> None:
    """No progress bar in any denoising loop of the blocks (``ModularPipeline.set_progress_bar_config`` reaches only
    its top-level blocks; the loop sits inside the auto and sequential ones)."""
    if hasattr(block, "set_progress_bar_config"):
        block.set_progress_bar_config(disable=True)
    for child in getattr(block, "sub_blocks", {}).values():
        _quiet_loops(child)


def _processor(tokenizer):
    """What Flux3TextEncoderStep calls (``apply_chat_template`` and ``.tokenizer``): a processor as it is, a bare
    tokenizer (the tiny one; or a checkpoint's tokenizer without its image processor) wrapped."""
    if hasattr(tokenizer, "tokenizer"):
        return tokenizer
    return SimpleNamespace(apply_chat_template=tokenizer.apply_chat_template, tokenizer=tokenizer)


def encode_prompts(pipeline, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
    """B, L, stacked dims: each prompt encoded as ``Flux3TextEncoderStep`` encodes it, in a window of exactly
    ``max_sequence_length`` tokens (the step's ``pad_multiple`` set to it: captions of any length batch together,
    and samples see the window training saw; the transformer attends to the padding, as FLUX.3 does)."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    processor = _processor(pipeline.tokenizer)
    layers = tuple(pipeline.config.text_encoder_out_layers)
    return torch.cat(
        [
            Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
                pipeline.text_encoder,
                processor,
                prompt,
                device=pipeline.text_encoder.device,
                max_sequence_length=max_sequence_length,
                pad_multiple=max_sequence_length,
                hidden_states_layers=layers,
            )
            for prompt in prompts
        ]
    )


def encode_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """B, 3, H, W in [-1, 1] -> B, 4C, H / t, W / t (t: pixels per token): the VAE's mode, 2x2-patchified and
    standardised by the VAE's batch-norm statistics, as ``Flux3VaeEncoderStep`` encodes a reference."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep

    z = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
    patches = Flux3VaeEncoderStep._patchify_latents(z)  # B, C, h, w -> B, 4C, h/2, w/2
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patches)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(patches)
    return (patches - mean) / std


def flux3_encoder(pipeline, max_sequence_length: int):
    """For the data cache (recipes/cache.py): pixels (B, 1, C, H, W) -> latents (B, 4C, h, w); captions ->
    ``prompt_embeds`` (B, ``max_sequence_length``, stacked dims)."""

    def latents(pixels: torch.Tensor) -> torch.Tensor:
        return encode_latents(pipeline.vae, pixels[:, 0]).float().cpu()  # B, 1, C, H, W -> B, C, H, W

    def text(captions: list[str]) -> dict[str, torch.Tensor]:
        return {"prompt_embeds": encode_prompts(pipeline, list(captions), max_sequence_length).float().cpu()}

    return latents, text


def image_ids(height: int, width: int, reference: int = 0) -> torch.Tensor:
    """(height x width, 4) (t, h, w, l) position ids of a token grid as the modular pipeline makes them (H and W
    scaled by its image RoPE scale); ``reference`` i > 0 gives the i-th reference image's, l = -i."""
    from diffusers.modular_pipelines.flux3.before_denoise import _prepare_image_ids

    return _prepare_image_ids(height, width, _image_rope_scale(), l_coord=-reference)


@functools.cache
def _image_rope_scale() -> float:
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3PrepareLatentsStep

    return Flux3PrepareLatentsStep().image_rope_scale  # FLUX.3 trained with H and W position ids scaled by it


def text_ids(length: int) -> torch.Tensor:
    """(length, 4) position ids of the text tokens: along the l axis, as the modular pipeline makes them."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep

    return Flux3TextRoPEInputsStep._prepare_text_ids(torch.empty(1, length))


def build_tiny_flux3_pipeline(seed: int = 0) -> Flux3Components:
    """FLUX.3 at tiny size: a two-layer Qwen3-VL (its text tower is what runs; a one-block vision tower completes
    the class) whose two layers' states are stacked (32 dims), ByT5's byte tokenizer with a one-line chat template
    (the caption itself: no vocabulary download, and the window holds the caption's bytes), a 2-level Flux.2 VAE
    (2x space, 4 channels, 16 after patchification) fitted to the synthetic shapes, and a transformer of one block
    per mode and two joint blocks; the scheduler without FLUX.3's sampling shift (6.93 is for 1 Mpx)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux3Transformer2DModel
    from transformers import ByT5Tokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from recipes.components import TOKEN_LENGTH
    from recipes.tiny_vae import fit_tiny_vae

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        tokenizer = ByT5Tokenizer(model_max_length=4 * TOKEN_LENGTH)
        tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
        rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [1, 1, 2]}  # 8-dim heads
        text_encoder = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(
                text_config=dict(
                    vocab_size=384, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rope_parameters=rope,
                    pad_token_id=0, bos_token_id=None, eos_token_id=1,
                ),
                vision_config=dict(
                    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                    deepstack_visual_indexes=[],
                ),
            )
        )  # fmt: skip
        vae = AutoencoderKLFlux2(
            down_block_types=["DownEncoderBlock2D"] * 2,
            up_block_types=["UpDecoderBlock2D"] * 2,
            block_out_channels=[16, 32],
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=32,
        )
        fit_tiny_vae(vae)  # reconstructs the synthetic shapes; sets the batch-norm statistics
        transformer = Flux3Transformer2DModel(
            in_channels=16,
            cond_in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=2 * 16,  # two stacked Qwen3-VL layers of 16 dims
            timestep_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
        )
    return Flux3Components(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        text_encoder_out_layers=(1, 2),
    )

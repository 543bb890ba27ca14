"""Pipeline components: real ones from a checkpoint, or tiny random-init ones built from configs.

``load_pipeline(family, "tiny", cache_dir)`` builds a tiny pipeline of that family (Flux: transformer,
VAE, CLIP and T5 text encoders; Wan: transformer, Wan VAE, UMT5 encoder; HunyuanVideo: transformer,
HunyuanVideo VAE, Llama and CLIP encoders; QwenImage: transformer, QwenImage VAE, Qwen2.5-VL encoder; all with
ByT5's byte tokenizer, which needs no vocabulary download) once, with a fixed seed (the Flux, HunyuanVideo and
QwenImage VAEs fitted to the synthetic shapes, recipes/tiny_vae.py), saves it under ``cache_dir``
and loads it back with ``from_pretrained``: the recipes take one code path for tiny and real checkpoints
(FLUX.3, which diffusers runs only as a modular pipeline, with a pipeline class of recipes/flux3_pipeline.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY = "tiny"
TOKEN_LENGTH = 32  # text tokens of the tiny pipeline


def build_tiny_pipeline(seed: int = 0):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import ByT5Tokenizer, CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from recipes.tiny_vae import fit_tiny_vae

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        tokenizer = ByT5Tokenizer(model_max_length=TOKEN_LENGTH)
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=384,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                max_position_embeddings=TOKEN_LENGTH,
                projection_dim=32,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=0,
            )
        )
        t5 = T5EncoderModel(T5Config(vocab_size=384, d_model=32, d_ff=64, d_kv=8, num_layers=1, num_heads=4))
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 2,
            up_block_types=["UpDecoderBlock2D"] * 2,
            block_out_channels=[16, 32],
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=32,
            shift_factor=0.0,
            scaling_factor=1.0,
        )
        fit_tiny_vae(vae)  # reconstructs the synthetic shapes, so samples show what the transformer learns
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=(4, 6, 6),
            guidance_embeds=True,
        )
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        vae=vae,
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tokenizer,
        transformer=transformer,
    )


def build_tiny_wan_pipeline(seed: int = 0):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        tokenizer = ByT5Tokenizer(model_max_length=TOKEN_LENGTH)
        text_encoder = UMT5EncoderModel(
            UMT5Config(vocab_size=384, d_model=32, d_ff=64, d_kv=8, num_layers=1, num_heads=4)
        )
        # 2x spatial, no temporal downsampling: small clips stay long enough to split across ranks
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1],
            num_res_blocks=1,
            temperal_downsample=[False],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
            scale_factor_spatial=2,
            scale_factor_temporal=1,
        )
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=4,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            text_dim=32,
            freq_dim=16,
            ffn_dim=64,
            num_layers=2,
            rope_max_seq_len=64,
        )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
    )


def build_tiny_wan_i2v_pipeline(seed: int = 0):
    """Wan2.1 image-to-video at tiny size: the tiny Wan pipeline's text encoder and VAE, a transformer that takes
    the noisy latents, the first-frame mask and the condition latents as input channels (4 + 1 + 4: the tiny VAE
    compresses no frames, so the mask has one channel per latent frame) and CLIP image tokens beside the text."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    base = build_tiny_wan_pipeline(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        image_encoder = CLIPVisionModel(
            CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                             image_size=32, patch_size=8, projection_dim=16)
        )  # fmt: skip
        config = {k: v for k, v in base.transformer.config.items() if not k.startswith("_")}
        config.update(in_channels=9, image_dim=16, added_kv_proj_dim=48)  # added K/V: the inner dim, 4 x 12
        transformer = WanTransformer3DModel(**config)
    return WanImageToVideoPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        transformer=transformer,
        scheduler=base.scheduler,
        image_encoder=image_encoder,
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    )


def build_tiny_skyreels_df_pipeline(seed: int = 0, frames_per_block: int = 2):
    """SkyReels-V2 diffusion forcing at tiny size: the tiny Wan pipeline's text encoder, a Wan VAE that compresses
    4 frames into one as the real one does (clips of 4k+1 frames give k+1 latent frames, so two clip lengths can
    both fill whole causal blocks), and a SkyReels-V2 transformer attending in causal blocks of
    ``frames_per_block`` latent frames; UniPC in flow mode, the real pipeline's scheduler."""
    from diffusers import (
        AutoencoderKLWan,
        SkyReelsV2DiffusionForcingPipeline,
        SkyReelsV2Transformer3DModel,
        UniPCMultistepScheduler,
    )

    base = build_tiny_wan_pipeline(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[True, True],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
            scale_factor_spatial=4,
            scale_factor_temporal=4,
        )
        config = {k: v for k, v in base.transformer.config.items() if not k.startswith("_")}
        transformer = SkyReelsV2Transformer3DModel(**config, num_frame_per_block=frames_per_block)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=1.0)
    return SkyReelsV2DiffusionForcingPipeline(
        tokenizer=base.tokenizer, text_encoder=base.text_encoder, transformer=transformer, vae=vae, scheduler=scheduler
    )


def build_tiny_hunyuan_pipeline(seed: int = 0):
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import ByT5Tokenizer, CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    from recipes.tiny_vae import fit_tiny_vae

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        # the prompt template's system prompt is ~500 bytes before the caption: room for it and the caption
        tokenizer = ByT5Tokenizer(model_max_length=1024)
        # three layers: the pipeline takes the third hidden state from the end (skips the last two layers)
        llama = LlamaModel(
            LlamaConfig(
                vocab_size=384,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=1024,
                pad_token_id=0,
                bos_token_id=None,
                eos_token_id=1,
            )
        )
        clip = CLIPTextModel(  # the pipeline pads CLIP's prompt to 77 tokens
            CLIPTextConfig(
                vocab_size=384,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                max_position_embeddings=77,
                projection_dim=32,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=0,
            )
        )
        # 2x spatial and HunyuanVideo's 4x causal temporal compression (4k+1 frames -> k+1 latent frames)
        vae = AutoencoderKLHunyuanVideo(
            latent_channels=4,
            down_block_types=["HunyuanVideoDownBlock3D"] * 3,
            up_block_types=["HunyuanVideoUpBlock3D"] * 3,
            block_out_channels=[8, 8, 8],
            layers_per_block=1,
            norm_num_groups=4,
            scaling_factor=1.0,
            spatial_compression_ratio=2,
            temporal_compression_ratio=4,
        )
        fit_tiny_vae(vae, frames=5)  # reconstructs moving shapes, so samples show what the transformer learns
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=16,
            num_layers=2,
            num_single_layers=2,
            num_refiner_layers=1,
            text_embed_dim=32,
            pooled_projection_dim=32,
            rope_axes_dim=(4, 6, 6),
        )
    return HunyuanVideoPipeline(
        text_encoder=llama,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=HUNYUAN_SHIFT),
        text_encoder_2=clip,
        tokenizer_2=ByT5Tokenizer(model_max_length=77),
    )


HUNYUAN_SHIFT = 7.0  # HunyuanVideo's flow shift (its pipeline's scheduler; the original repo's --flow-shift 7.0)


def hunyuan_prompt_template(tokenizer) -> dict:
    """HunyuanVideo's prompt template for ``tokenizer``: diffusers' default, whose ``crop_start`` (95) counts the
    system prompt's tokens in HunyuanVideo's Llama-3 tokenizer; for the tiny pipeline's byte tokenizer the same
    template with that count in bytes, so that the crop keeps exactly the caption's tokens there too."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from transformers import ByT5Tokenizer

    if not isinstance(tokenizer, ByT5Tokenizer):
        return DEFAULT_PROMPT_TEMPLATE
    system = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    return {**DEFAULT_PROMPT_TEMPLATE, "crop_start": len(system.encode("utf-8"))}


def build_tiny_qwenimage_pipeline(seed: int = 0):
    """QwenImage at tiny size: a one-layer Qwen2.5-VL (its text tower is what the pipeline runs; a one-block
    vision tower completes the class), QwenImage's VAE with 2x spatial compression and no temporal one, and
    QwenImage's scheduler (the resolution-dependent shift of the real pipeline)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from recipes.tiny_vae import fit_tiny_vae

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        # the template's system prompt is 180 bytes before the caption: room for it and a 1024-token caption
        tokenizer = ByT5Tokenizer(model_max_length=1024 + 256)
        rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}  # 16-dim heads
        text_encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config=dict(
                    vocab_size=384,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    num_key_value_heads=2,
                    max_position_embeddings=2048,
                    rope_parameters=rope,
                    pad_token_id=0,
                    bos_token_id=None,
                    eos_token_id=1,
                ),
                vision_config=dict(
                    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                    fullatt_block_indexes=[0],
                ),
            )
        )  # fmt: skip
        vae = AutoencoderKLQwenImage(  # 32 channels: narrower ones lose the shapes' colours in the fit
            base_dim=32,
            z_dim=4,
            dim_mult=[1, 1],
            num_res_blocks=1,
            temperal_downsample=[False],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        )
        fit_tiny_vae(vae)  # reconstructs the synthetic shapes; sets the per-channel latents_mean and _std
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        )
    scheduler = FlowMatchEulerDiscreteScheduler(**QWENIMAGE_SCHEDULER)
    return QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


# Qwen-Image's scheduler: a shift exp(mu) from the image token count, mu linear from 0.5 at 256 tokens to 0.9 at
# 8192 (Flux's rule with its own ends); the recipe trains on the same shift (QwenImageFineTune)
QWENIMAGE_SCHEDULER = dict(
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


def fit_prompt_template(pipeline):
    """QwenImage drops the first ``prompt_template_encode_start_idx`` tokens of its encoded template: 34, its
    system prompt's length in Qwen's tokenizer. For the tiny pipeline's byte tokenizer the same count in bytes,
    so that what stays is exactly the caption's tokens there too. Other pipelines are returned as they are."""
    from transformers import ByT5Tokenizer

    template = getattr(pipeline, "prompt_template_encode", None)
    if template is not None and isinstance(pipeline.tokenizer, ByT5Tokenizer):
        pipeline.prompt_template_encode_start_idx = len(template.split("{}")[0].encode("utf-8"))
    return pipeline


# family -> (pipeline class: diffusers' name, or a dotted path to the recipes' own; transformer class; tiny builder,
# or the dotted path of one in a recipe's own module, which imports this one: named, not imported, here)
FAMILIES = {
    "flux": ("FluxPipeline", "FluxTransformer2DModel", build_tiny_pipeline),
    "wan": ("WanPipeline", "WanTransformer3DModel", build_tiny_wan_pipeline),
    "wan_i2v": ("WanImageToVideoPipeline", "WanTransformer3DModel", build_tiny_wan_i2v_pipeline),
    "skyreels_df": (
        "SkyReelsV2DiffusionForcingPipeline",
        "SkyReelsV2Transformer3DModel",
        build_tiny_skyreels_df_pipeline,
    ),
    "hunyuan": ("HunyuanVideoPipeline", "HunyuanVideoTransformer3DModel", build_tiny_hunyuan_pipeline),
    "qwenimage": ("QwenImagePipeline", "QwenImageTransformer2DModel", build_tiny_qwenimage_pipeline),
    "qwenimage_edit": (
        "QwenImageEditPlusPipeline",
        "QwenImageTransformer2DModel",
        "recipes.qwenimage_edit_parts.build_tiny_qwenimage_edit_pipeline",
    ),
    "flux3": (
        "recipes.flux3_pipeline.Flux3Components",
        "Flux3Transformer2DModel",
        "recipes.flux3_pipeline.build_tiny_flux3_pipeline",
    ),
    # diffusers' class, named through the module of the tiny pipeline's processor (diffusers loads that processor
    # only from a module already imported)
    "qwenimage21": (
        "recipes.qwenimage21_parts.QwenImage21Pipeline",
        "QwenImage21Transformer2DModel",
        "recipes.qwenimage21_parts.build_tiny_qwenimage21_pipeline",
    ),
}


def pipeline_class(family: str):
    """The family's pipeline class: diffusers', or the recipes' own (FLUX.3 has none in diffusers 0.42)."""
    import importlib

    import diffusers

    name = FAMILIES[family][0]
    if "." not in name:
        return getattr(diffusers, name)
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def tiny_builder(family: str):
    """The family's tiny-pipeline builder: a function here, or one named by its dotted path in a recipe's module."""
    import importlib

    builder = FAMILIES[family][2]
    if not isinstance(builder, str):
        return builder
    module, _, attr = builder.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def resolve_pretrained(family: str, pretrained: str, cache_dir: str | Path) -> str:
    """A path or hub id to load from; ``"tiny"`` is built once into ``cache_dir``."""
    if pretrained != TINY:
        return pretrained
    path = Path(cache_dir) / f"tiny_{family}_pipeline"
    if not (path / "model_index.json").exists():
        tmp = path.with_name(path.name + ".tmp")
        tiny_builder(family)().save_pretrained(tmp)
        tmp.rename(path)  # atomic: an interrupted build leaves no half pipeline behind
    return str(path)


def _saved_as_none(cls, path: str) -> dict:
    """The components a pipeline was saved without (``[null, null]`` in model_index.json: the tiny
    Qwen-Image-Edit pipeline's processor), which ``from_pretrained`` wants passed, as None."""
    return {
        k: None for k, v in cls.load_config(path).items() if isinstance(v, list | tuple) and list(v) == [None, None]
    }


def load_pipeline(family: str, pretrained: str, cache_dir: str | Path, **kwargs):
    cls = pipeline_class(family)
    path = resolve_pretrained(family, pretrained, cache_dir)
    return fit_prompt_template(cls.from_pretrained(path, **{**_saved_as_none(cls, path), **kwargs}))


def load_encoders(family: str, pretrained: str, cache_dir: str | Path, **kwargs):
    """The family's pipeline without its transformer(s), for caching latents and text: a 12-14B transformer never
    shares the GPU with the text encoders (HunyuanVideo's Llama-3 8B, Flux's and Wan's T5)."""
    cls = pipeline_class(family)
    path = resolve_pretrained(family, pretrained, cache_dir)
    slots = {name: None for name in ("transformer", "transformer_2") if name in cls.load_config(path)}
    return fit_prompt_template(cls.from_pretrained(path, **{**_saved_as_none(cls, path), **slots, **kwargs}))


def load_transformer(family: str, pretrained: str, cache_dir: str | Path, subfolder: str = "transformer", **kwargs):
    """The family's transformer from ``subfolder`` (Wan2.2 A14B keeps its low-noise expert in ``transformer_2``)."""
    import diffusers

    cls = getattr(diffusers, FAMILIES[family][1])
    return cls.from_pretrained(resolve_pretrained(family, pretrained, cache_dir), subfolder=subfolder, **kwargs)


def empty_transformer(family: str, pretrained: str, cache_dir: str | Path, subfolder: str = "transformer", dtype=None):
    """The family's transformer built on the meta device from a local folder's config (cp_lightning.loading):
    its weights are read later, by each rank for what it holds. None when ``pretrained`` is no local folder
    (a hub id: ``from_pretrained`` downloads it)."""
    import diffusers

    from cp_lightning import loading

    path = Path(resolve_pretrained(family, pretrained, cache_dir))
    if not (path / subfolder / "config.json").is_file():
        return None
    return loading.empty_model(getattr(diffusers, FAMILIES[family][1]), path, subfolder=subfolder, dtype=dtype)

"""Each family's data module: ``FluxData``, ``QwenImageData``, ``WanData`` and ``HunyuanData`` are
``EncodedData`` (``recipes/encoded.py``: folder -> buckets -> cached latents) with the family's VAE geometry,
token count per bucket and encoders.
"""

from __future__ import annotations

from recipes.cache import flux_encoder, hunyuan_encoder, qwenimage_encoder, wan_encoder
from recipes.encoded import EncodedData

__all__ = ["EncodedData", "FluxData", "HunyuanData", "QwenImageData", "WanData"]


class FluxData(EncodedData):
    __doc__ = EncodedData.__doc__
    family = "flux"

    def geometry(self):
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.load_config(self._pipeline_path(), subfolder="vae")
        return 2 ** (len(vae["block_out_channels"]) - 1) * 2, 1, 1  # VAE x Flux's 2x2 latent packing

    def tokens(self, bucket):
        multiple = self.geometry()[0]
        return (bucket.height // multiple) * (bucket.width // multiple), self.hparams.max_sequence_length

    def encoder(self, pipeline):
        return flux_encoder(pipeline, self.hparams.max_sequence_length)


class QwenImageData(EncodedData):
    """Captioned images for QwenImage; the arguments of :class:`EncodedData` (``max_sequence_length``: Qwen2.5-VL
    tokens per caption after the prompt template's system prompt, padded and masked; 512 covers long captions).
    The text tokens are split across the CP group with the image tokens (they meet in joint attention)."""

    family = "qwenimage"

    def __init__(self, data_dir: str | None = None, *, max_sequence_length: int = 64, **kwargs):
        # (kwargs pass through untouched: LightningCLI reads the other arguments from EncodedData's signature)
        if not 1 <= max_sequence_length <= 1024:
            raise ValueError(
                f"max_sequence_length must be in [1, 1024] (QwenImage's text limit), got {max_sequence_length}."
            )
        super().__init__(data_dir, max_sequence_length=max_sequence_length, **kwargs)

    def geometry(self):
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

        path = self._pipeline_path()
        vae = AutoencoderKLQwenImage.load_config(path, subfolder="vae")
        patch = QwenImageTransformer2DModel.load_config(path, subfolder="transformer")["patch_size"]
        return 2 ** len(vae["temperal_downsample"]) * patch, 1, 1  # the VAE's downsampling x 2x2 patches

    def tokens(self, bucket):
        multiple = self.geometry()[0]
        return (bucket.height // multiple) * (bucket.width // multiple), self.hparams.max_sequence_length

    def encoder(self, pipeline):
        return qwenimage_encoder(pipeline, self.hparams.max_sequence_length)


class WanData(EncodedData):
    """Video clips (mp4/webm/mov/gif; images count as 1-frame clips) for Wan; see :class:`EncodedData`.

    Args:
        num_frames: frames per clip: 4k+1 for Wan's VAE, which encodes the first frame and then chunks of 4
            (the tiny VAE too, though it compresses none: other counts would lose frames).
        frame_buckets: clip lengths to bucket by (each video takes the longest it can fill); default
            ``[num_frames]``.
        fps: resample videos to this frame rate first (default: keep the source's frames).
        clip_position: where a clip starts in a longer video: ``start``, ``center`` or ``random`` (seeded).
        clips_per_video: take up to this many non-overlapping clips from a long video.
        skip_short_clips: leave out (with a warning) videos shorter than the shortest clip instead of
            raising an error.
    """

    family = "wan"
    frame_chunk = 4  # Wan's VAE encodes the first frame, then chunks of 4 (whatever it compresses)
    default_dir = "outputs/data/moving_shapes"
    video = True

    def __init__(
        self,
        data_dir: str | None = None,
        image_dir: str | None = None,
        cache_dir: str = "outputs/cache",
        pretrained: str = "tiny",
        resolution: int = 32,
        width: int | None = None,
        aspect_ratios: list[float | str] | None = None,
        crop: str = "center",
        small_buckets: str = "merge",
        num_frames: int = 5,
        frame_buckets: list[int] | None = None,
        fps: float | None = None,
        clip_position: str = "start",
        clips_per_video: int = 1,
        skip_short_clips: bool = False,
        batch_size: int | str = 2,
        caption_dropout: float = 0.0,
        allow_empty_captions: bool = False,
        fingerprint: str = "mtime",
        synthetic_samples: int = 0,
        max_sequence_length: int = 32,
        encode_batch_size: int = 2,
        encode_dtype: str = "float32",
        vae_tiling: bool = False,
        dry_run: bool = False,
        seed: int = 0,
    ):
        if clip_position not in ("start", "center", "random"):
            raise ValueError(f"clip_position must be 'start', 'center' or 'random', got {clip_position!r}.")
        if num_frames < 1 or clips_per_video < 1 or (fps is not None and fps <= 0):
            raise ValueError(
                f"num_frames and clips_per_video must be >= 1 and fps > 0, got {num_frames}, {clips_per_video}, {fps}."
            )
        self.num_frames, self.frame_buckets, self.fps = num_frames, frame_buckets, fps
        self.clip_position, self.clips_per_video, self.skip_short_clips = (
            clip_position,
            clips_per_video,
            skip_short_clips,
        )
        super().__init__(
            data_dir=data_dir,
            image_dir=image_dir,
            cache_dir=cache_dir,
            pretrained=pretrained,
            resolution=resolution,
            width=width,
            aspect_ratios=aspect_ratios,
            crop=crop,
            small_buckets=small_buckets,
            batch_size=batch_size,
            caption_dropout=caption_dropout,
            allow_empty_captions=allow_empty_captions,
            fingerprint=fingerprint,
            synthetic_samples=synthetic_samples,
            max_sequence_length=max_sequence_length,
            encode_batch_size=encode_batch_size,
            encode_dtype=encode_dtype,
            vae_tiling=vae_tiling,
            dry_run=dry_run,
            seed=seed,
        )
        self.save_hyperparameters()

    def geometry(self):
        from diffusers import AutoencoderKLWan, WanTransformer3DModel

        path = self._pipeline_path()
        vae = AutoencoderKLWan.load_config(path, subfolder="vae")
        patch = WanTransformer3DModel.load_config(path, subfolder="transformer")["patch_size"]
        return vae["scale_factor_spatial"] * patch[1], vae["scale_factor_temporal"], patch[0]

    def tokens(self, bucket):
        multiple, temporal, patch_t = self.geometry()
        latent_frames = ((bucket.frames - 1) // temporal + 1) // patch_t
        return latent_frames * (bucket.height // multiple) * (bucket.width // multiple), 0  # text is not split

    def encoder(self, pipeline):
        return wan_encoder(pipeline, self.hparams.max_sequence_length)


class HunyuanData(WanData):
    """Video clips for HunyuanVideo; the arguments of :class:`WanData` (``num_frames``: 4k+1 for the
    HunyuanVideo VAE, which keeps the first frame and compresses every 4 after it). The Llama text tokens
    (``max_sequence_length``, 256 for HunyuanVideo) are split across the CP group with the video tokens."""

    family = "hunyuan"
    default_dir = "outputs/data/moving_shapes_5f"

    def __init__(self, data_dir: str | None = None, *, num_frames: int = 5, **kwargs):
        # (kwargs pass through untouched: LightningCLI reads the other arguments from WanData's signature)
        super().__init__(data_dir, num_frames=num_frames, **kwargs)

    def geometry(self):
        from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoTransformer3DModel

        path = self._pipeline_path()
        vae = AutoencoderKLHunyuanVideo.load_config(path, subfolder="vae")
        config = HunyuanVideoTransformer3DModel.load_config(path, subfolder="transformer")
        spatial, temporal = vae["spatial_compression_ratio"], vae["temporal_compression_ratio"]
        return spatial * config["patch_size"], temporal, config["patch_size_t"]

    def tokens(self, bucket):
        multiple, temporal, patch_t = self.geometry()
        latent_frames = ((bucket.frames - 1) // temporal + 1) // patch_t
        video = latent_frames * (bucket.height // multiple) * (bucket.width // multiple)
        return video, self.hparams.max_sequence_length  # the text is split with the video (joint attention)

    def encoder(self, pipeline):
        return hunyuan_encoder(pipeline, self.hparams.max_sequence_length)

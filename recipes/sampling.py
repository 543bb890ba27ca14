"""Validation samples during training, rendered by the real pipeline with the transformer still context parallel.

:class:`SampleFlux` / :class:`SampleQwenImage` / :class:`SampleWan` / :class:`SampleHunyuan` render fixed prompts
with fixed seeds (prompt i uses seed + i) at step 0 (the baseline), every ``every_n_steps`` and at the end of
training. Every rank takes part: the training transformer (LoRA and all, parallelized by the strategy) is the
pipeline's transformer, so each rank of a CP group runs the denoising loop on its sequence shard (a 720p video is
sampled by the whole group), and the data-parallel groups split the prompts. The pipeline's text encoders run once,
at the start, and are then dropped; only the VAE stays.

Results: ``<out_dir>/samples/step_<N>.png`` (one row per prompt; a video row shows its frames),
``step_<N>.mp4`` for videos, ``<out_dir>/samples.png`` (every sampled step side by side, the step-0
baseline first) and the Trainer's loggers (TensorBoard, W&B; loggers with a folder but no image API,
such as CSV, get the files in ``<log_dir>/samples``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist


class Samples(L.Callback):
    """Validation samples every ``every_n_steps`` optimizer steps, at step 0 and at the end.

    Args:
        out_dir: the run's folder; samples go to ``out_dir/samples``.
        every_n_steps: sampling period in optimizer steps; 0 samples only at step 0 and at the end.
        prompts: fixed prompts; prompt i is rendered with seed ``seed + i``.
        resolution: sample height in pixels (and width, unless ``width`` is given).
        width: sample width in pixels.
        num_frames: frames per video sample (Wan, HunyuanVideo).
        num_inference_steps: denoising steps.
        guidance_scale: classifier-free guidance for Wan (default 5.0); the distilled guidance value of Flux
            (3.5) and HunyuanVideo (6.0).
        negative_prompt: the negative prompt of classifier-free guidance (Wan; HunyuanVideo and QwenImage with
            ``true_cfg_scale``).
        true_cfg_scale: classifier-free guidance against ``negative_prompt`` (two transformer passes per step),
            on above 1.0: QwenImage's guidance (its pipeline's default is 4.0), and HunyuanVideo's on top of its
            distilled ``guidance_scale``.
        max_sequence_length: text tokens per prompt.
        seed: seed of the first prompt.
        fps: frame rate of the video files.
        vae_tiling: decode with the VAE's spatial tiling (720p videos: the untiled decoder's activations alone
            outgrow a GPU).
        enabled: False renders no samples (nothing is loaded): where the pipeline's text encoders, or Wan2.2
            A14B's other expert, do not fit next to the training states (configs/consumer/).
    """

    family = ""
    default_guidance = 1.0
    images: list[str] = []  # an image-conditioned sampler's ``samples.images``: one image per prompt (or none)
    image_role = "image"  # what that image is to its prompt's sample ("reference image", "first frame"), in messages

    def __init__(
        self,
        out_dir: str = "outputs/run",
        *,
        every_n_steps: int = 0,
        prompts: list[str] | None = None,
        resolution: int = 32,
        width: int | None = None,
        num_frames: int = 1,
        num_inference_steps: int = 8,
        guidance_scale: float | None = None,
        negative_prompt: str = "",
        true_cfg_scale: float = 1.0,
        max_sequence_length: int = 32,
        seed: int = 0,
        fps: int = 8,
        vae_tiling: bool = False,
        enabled: bool = True,
    ):
        self.enabled = enabled
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0 (0: only at step 0 and at the end), got {every_n_steps}.")
        if not true_cfg_scale >= 1.0:
            raise ValueError(
                f"samples.true_cfg_scale must be >= 1.0 (1.0: no classifier-free guidance), got {true_cfg_scale}."
            )
        if true_cfg_scale != 1.0 and self.family not in ("hunyuan", "qwenimage", "qwenimage_edit"):
            raise ValueError(
                f"samples.true_cfg_scale is HunyuanVideo's and QwenImage's; the {self.family} samples take "
                "guidance_scale (Wan: classifier-free guidance with negative_prompt; Flux: distilled guidance)."
            )
        if guidance_scale is not None and self.family in ("qwenimage", "qwenimage_edit"):
            raise ValueError(
                "samples.guidance_scale: QwenImage has no distilled guidance; its classifier-free guidance is "
                "samples.true_cfg_scale (e.g. 4.0) with samples.negative_prompt."
            )
        self.true_cfg = true_cfg_scale
        self.out_dir = Path(out_dir)
        self.every_n_steps = every_n_steps
        self.prompts = prompts or ["a red circle", "a blue square", "a green triangle", "a yellow circle"]
        self.height, self.width = resolution, width or resolution
        self.num_frames, self.steps, self.max_sequence_length = num_frames, num_inference_steps, max_sequence_length
        self.guidance = self.default_guidance if guidance_scale is None else guidance_scale
        self.negative_prompt, self.seed, self.fps = negative_prompt, seed, fps
        self.vae_tiling = vae_tiling
        self.pipeline = None
        self.others: list = []  # frozen experts besides the trained transformer (Wan2.2 A14B)
        self.embeds: list[dict] = []
        self.sampled: set[int] = set()  # steps sampled so far (every rank)
        self.history: dict[int, list[np.ndarray]] = {}  # step -> one (F, H, W, 3) array per prompt (rank 0)

    # -- each prompt's image, for the samplers that start from one (edits, image-to-video) ------------
    def check_images(self) -> None:
        """Refuse a ``samples.images`` file that does not exist, naming it (RecipeCLI calls this before any
        process starts, the sampler again where it loads them)."""
        for i, path in enumerate(self.images):  # (one per prompt: the sampler's constructor checks it)
            prompt = self.prompts[i]
            if not Path(path).is_file():
                raise ValueError(
                    f"samples.images: {path} does not exist (the {self.image_role} of the prompt {prompt!r}); give "
                    "an existing file, or leave samples.images out to take those of the data's first samples."
                )

    def sample_images(self, datamodule) -> list:
        """Each prompt's image as a ``recipes.media.Source``: the ``samples.images`` given, else those of the data's
        first ``len(prompts)`` samples (``datamodule.sample_references``: a pair's reference, a clip's first frame).
        So a config that leaves ``images`` out follows ``--data.data_dir`` to the user's own data."""
        from recipes.media import Source

        if self.images:
            self.check_images()
            return [Source(str(path), "", False) for path in self.images]
        found = datamodule.sample_references(len(self.prompts)) if hasattr(datamodule, "sample_references") else []
        if len(found) < len(self.prompts):
            where = f"the data in {datamodule.data_dir} has {len(found)}" if found else "no data module gives any"
            raise ValueError(
                f"samples.images: the samples need one {self.image_role} per prompt ({len(self.prompts)} prompts) "
                f"and {where}: give samples.images ({len(self.prompts)} paths), or fewer samples.prompts."
            )
        return found

    def load_images(self, trainer) -> list:
        """The RGB PIL images of :meth:`sample_images`, from the Trainer's data module."""
        from recipes.media import load_frames

        return [load_frames(source, [0])[0] for source in self.sample_images(getattr(trainer, "datamodule", None))]

    # -- what a family defines ------------------------------------------------------------------------
    def encode(self, pipeline, prompt: str) -> dict:
        """The pipeline's keyword arguments that stand for ``prompt`` (its text embeddings)."""
        raise NotImplementedError

    def render(self, pipeline, embeds: dict, seed: int) -> np.ndarray:
        """One sample as an (F, H, W, 3) float array in [0, 1]."""
        raise NotImplementedError

    # -- set-up: every rank loads the VAE and encodes the prompts once ----------------------------------
    def prepare(self, trainer, pl_module) -> None:
        from recipes.components import load_pipeline

        h = pl_module.hparams
        slot = getattr(pl_module, "transformer_subfolder", "transformer")  # the one being trained
        dtype = getattr(torch, h.weights_dtype)
        pipeline = load_pipeline(self.family, h.pretrained, h.cache_dir, dtype=dtype, **{slot: None})
        # Wan2.2 A14B: the other expert is frozen; it samples its half of the steps with CP too, and waits
        # on the CPU between samplings
        others = {n: getattr(pipeline, n) for n in ("transformer", "transformer_2") if getattr(pipeline, n, None)}
        pipeline.register_modules(**dict.fromkeys(others))
        pipeline.to(pl_module.device)
        pipeline.set_progress_bar_config(disable=True)
        if self.vae_tiling:
            pipeline.vae.enable_tiling()
        with torch.no_grad():
            self.embeds = [self.encode(pipeline, prompt) for prompt in self.prompts]
        # the text encoders are not needed again: free their memory before training goes on
        encoders = [name for name in ("text_encoder", "text_encoder_2") if hasattr(pipeline, name)]
        pipeline.register_modules(**dict.fromkeys(encoders))
        for module in others.values():
            module.requires_grad_(False).eval()
            if hasattr(trainer.strategy, "device_mesh") and getattr(trainer.strategy, "cp", 1) > 1:
                from cp_lightning import parallelize

                parallelize(module, mesh=trainer.strategy.device_mesh, ring=trainer.strategy.ring)
        pipeline.register_modules(**others, **{slot: pl_module.transformer})
        self.others = list(others.values())
        self.pipeline = pipeline

    def on_train_start(self, trainer, pl_module):
        if not getattr(self, "enabled", True):  # (subclasses with their own __init__ always sample)
            return
        self.prepare(trainer, pl_module)
        if trainer.global_step == 0:
            self.sample(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not getattr(self, "enabled", True):
            return
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0 and step not in self.sampled:
            self.sample(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        if not getattr(self, "enabled", True):
            return
        if trainer.global_step not in self.sampled:  # every rank decides alike: all render together
            self.sample(trainer, pl_module)
        if trainer.is_global_zero and self.history:
            steps = sorted(self.history)
            rows = [[self.history[s][i][0] for s in steps] for i in range(len(self.prompts))]
            save_grid(rows, self.prompts, self.out_dir / "samples.png", header=[f"step {s}" for s in steps])
        self.pipeline = None

    # -- rendering ------------------------------------------------------------------------------------
    def render_all(self, trainer, pl_module) -> list[np.ndarray] | None:
        """Every rank renders its data-parallel group's share of the prompts; rank 0 gets them all."""
        strategy = trainer.strategy
        dp_size = getattr(strategy, "dp_size", None) or strategy.world_size
        dp_rank = getattr(strategy, "dp_rank", None) if hasattr(strategy, "cp") else strategy.global_rank
        transformer = pl_module.transformer
        modes = {m: m.training for m in transformer.modules()}
        transformer.eval()
        for module in self.others:
            module.to(pl_module.device)
        mine = {}
        try:
            # every rank runs the same number of forward passes (FSDP all-gathers must pair up): the
            # groups with fewer prompts render their last one again
            per_group = -(-len(self.prompts) // dp_size)
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                for k in range(per_group):
                    i = min(dp_rank + k * dp_size, len(self.prompts) - 1)
                    mine[i] = self.render(self.pipeline, self.embeds[i], self.seed + i)
        finally:
            for m, mode in modes.items():
                m.train(mode)
            for module in self.others:
                module.to("cpu")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            mine = {i: sample for part in every for i, sample in part.items()}
        return [mine[i] for i in range(len(self.prompts))] if trainer.is_global_zero else None

    def sample(self, trainer, pl_module) -> None:
        self.sampled.add(trainer.global_step)
        samples = self.render_all(trainer, pl_module)
        if samples is None:
            return
        step = trainer.global_step
        self.history[step] = samples
        folder = self.out_dir / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        files = [folder / f"step_{step}.png"]
        save_grid([list(frames) for frames in samples], self.prompts, files[0])
        if self.num_frames > 1:
            files.append(folder / f"step_{step}.mp4")
            save_video(samples, files[1], self.fps)
        log_samples(trainer, samples, self.prompts, files, step, self.fps)


class SampleFlux(Samples):
    __doc__ = Samples.__doc__
    family = "flux"
    default_guidance = 3.5  # Flux-dev's distilled guidance at inference

    def encode(self, pipeline, prompt):
        embeds, pooled, _ = pipeline.encode_prompt(prompt, prompt_2=None, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def render(self, pipeline, embeds, seed):
        image = pipeline(
            **embeds,
            height=self.height,
            width=self.width,
            num_inference_steps=self.steps,
            guidance_scale=self.guidance,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        ).images
        return image[:1].astype(np.float32)  # 1, H, W, 3


class SampleQwenImage(Samples):
    __doc__ = Samples.__doc__
    family = "qwenimage"

    def encode(self, pipeline, prompt):
        from recipes.components import fit_prompt_template

        fit_prompt_template(pipeline)  # (a pipeline loaded here already is)

        def encode(text):  # the embeddings and their mask (the pipeline gives None for one unpadded prompt)
            embeds, mask = pipeline.encode_prompt(text, max_sequence_length=self.max_sequence_length)
            ones = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            return embeds, ones if mask is None else mask

        embeds, mask = encode(prompt)
        # (the pipeline's own default is 4.0: passed always, so that 1.0 means no guidance, without a warning)
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "true_cfg_scale": self.true_cfg}
        if self.true_cfg > 1.0:  # classifier-free guidance against the negative prompt ("" is unconditional)
            negative, negative_mask = encode(self.negative_prompt)
            out.update(negative_prompt_embeds=negative, negative_prompt_embeds_mask=negative_mask)
        return out

    def render(self, pipeline, embeds, seed):
        image = pipeline(
            **embeds,
            height=self.height,
            width=self.width,
            num_inference_steps=self.steps,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        ).images
        return image[:1].astype(np.float32)  # 1, H, W, 3


class VideoSamples(Samples):
    """What the video pipelines (Wan, HunyuanVideo) share: one call renders a clip of ``num_frames``."""

    def render(self, pipeline, embeds, seed):
        frames = pipeline(
            **embeds,
            height=self.height,
            width=self.width,
            num_frames=self.num_frames,
            num_inference_steps=self.steps,
            guidance_scale=self.guidance,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        ).frames
        return np.asarray(frames[0], dtype=np.float32)  # F, H, W, 3


class SampleWan(VideoSamples):
    __doc__ = Samples.__doc__
    family = "wan"
    default_guidance = 5.0  # Wan samples with classifier-free guidance

    def encode(self, pipeline, prompt):
        cfg = self.guidance > 1.0
        embeds, negative = pipeline.encode_prompt(
            prompt,
            self.negative_prompt if cfg else None,
            do_classifier_free_guidance=cfg,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "negative_prompt_embeds": negative}


class SampleHunyuan(VideoSamples):
    __doc__ = Samples.__doc__
    family = "hunyuan"
    default_guidance = 6.0  # HunyuanVideo's embedded (distilled) guidance at inference, the pipeline's default

    def encode(self, pipeline, prompt):
        from recipes.components import hunyuan_prompt_template

        template = hunyuan_prompt_template(pipeline.tokenizer)
        embeds, pooled, mask = pipeline.encode_prompt(
            prompt, prompt_template=template, max_sequence_length=self.max_sequence_length
        )
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "prompt_attention_mask": mask}
        if self.true_cfg > 1.0:  # classifier-free guidance against the negative prompt ("" is unconditional)
            negative = pipeline.encode_prompt(
                self.negative_prompt, prompt_template=template, max_sequence_length=self.max_sequence_length
            )
            names = ("negative_prompt_embeds", "negative_pooled_prompt_embeds", "negative_prompt_attention_mask")
            out.update(zip(names, negative, strict=True), true_cfg_scale=self.true_cfg)
        return out


SAMPLERS = {"flux": SampleFlux, "qwenimage": SampleQwenImage, "wan": SampleWan, "hunyuan": SampleHunyuan}


def render_grid(sampler: Samples, pipeline, path: Path) -> None:
    """Render ``sampler``'s prompts in one process with ``pipeline`` (e.g. after loading an exported LoRA)."""
    pipeline.set_progress_bar_config(disable=True)
    with torch.no_grad():
        rows = [
            list(sampler.render(pipeline, sampler.encode(pipeline, prompt), sampler.seed + i))
            for i, prompt in enumerate(sampler.prompts)
        ]
    save_grid(rows, sampler.prompts, path)


# -- files and loggers ----------------------------------------------------------------------------------
def _to_pil(frame: np.ndarray):
    from PIL import Image

    return Image.fromarray((np.clip(frame, 0, 1) * 255).round().astype(np.uint8))


def save_grid(rows, captions, path: Path, scale: int = 4, header: list[str] | None = None) -> None:
    """One row per caption: its images or frames (PIL images or float arrays) side by side, the caption
    underneath; ``header`` labels the columns."""
    from PIL import Image, ImageDraw

    rows = [[_to_pil(x) if isinstance(x, np.ndarray) else x for x in row] for row in rows]
    w, h = rows[0][0].size
    columns = max(len(row) for row in rows)
    top = 14 if header else 0
    cell_w, cell_h = w * scale, h * scale + 14
    grid = Image.new("RGB", (cell_w * columns, top + cell_h * len(rows)), "white")
    draw = ImageDraw.Draw(grid)
    for c, label in enumerate(header or []):
        draw.text((c * cell_w + 2, 1), label, fill="black")
    for r, (row, caption) in enumerate(zip(rows, captions, strict=True)):
        for c, image in enumerate(row):
            grid.paste(image.resize((w * scale, h * scale), Image.NEAREST), (c * cell_w, top + r * cell_h))
        draw.text((2, top + r * cell_h + h * scale + 1), caption, fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)


def save_video(samples: list[np.ndarray], path: Path, fps: int, scale: int = 4) -> None:
    """The videos side by side as one H.264 mp4 (PyAV)."""
    import av

    clip = np.concatenate([np.clip(s, 0, 1) for s in samples], axis=2)  # F, H, W * n, 3
    clip = (clip.repeat(scale, axis=1).repeat(scale, axis=2) * 255).round().astype(np.uint8)
    clip = clip[:, : clip.shape[1] // 2 * 2, : clip.shape[2] // 2 * 2]  # yuv420p wants even sides
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = clip.shape[2], clip.shape[1], "yuv420p"
        for frame in clip:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def gif_summary(tag: str, clip: np.ndarray, fps: int):
    """A TensorBoard video summary: an animated GIF in an image summary (what ``SummaryWriter.add_video``
    writes, encoded with PIL instead of moviepy). ``clip``: F, H, W, 3 floats in [0, 1]."""
    import io

    from tensorboard.compat.proto.summary_pb2 import Summary

    frames = [_to_pil(frame) for frame in clip]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=1000 // fps, loop=0)
    f, h, w, c = clip.shape
    image = Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=buffer.getvalue())
    return Summary(value=[Summary.Value(tag=tag, image=image)])


def log_samples(
    trainer, samples: list[np.ndarray], prompts: list[str], files: list[Path], step: int, fps: int = 8
) -> None:
    """Hand the samples to every logger of the Trainer in the form it takes."""
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_image"):  # TensorBoard: images (a video's frames side by side) and GIFs
            for prompt, sample in zip(prompts, samples, strict=True):
                experiment.add_image(f"samples/{prompt}", np.concatenate(list(sample), axis=1), step, dataformats="HWC")
                if len(sample) > 1:
                    experiment._get_file_writer().add_summary(gif_summary(f"videos/{prompt}", sample, fps), step)
        elif hasattr(logger, "log_image"):  # Weights & Biases
            logger.log_image(key="samples", images=[str(files[0])], step=step)
            if len(files) > 1 and hasattr(logger, "log_video"):
                logger.log_video(key="samples_video", videos=[str(files[1])], step=step)
        elif getattr(logger, "log_dir", None):  # CSV and other folder loggers: the files themselves
            folder = Path(logger.log_dir) / "samples"
            folder.mkdir(parents=True, exist_ok=True)
            for file in files:
                shutil.copyfile(file, folder / file.name)

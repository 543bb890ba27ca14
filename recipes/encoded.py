"""The recipes' data module: a folder of captioned images or videos -> bucketed, cached latents and text.

``EncodedData`` is the LightningDataModule every recipe's data derives from (``recipes/data.py`` holds the
families' geometry and encoders). ``setup`` (on every rank) finds the media and captions (``recipes/media.py``),
places each sample (one per image; one or more clips per video) in its nearest bucket (``recipes/buckets.py``),
prints the bucket table and saves it as ``buckets.csv`` in the run folder, then encodes what the cache lacks,
spread over all ranks (``recipes/cache.py``); rank 0 writes the index. Batches hold one bucket; CP peers get the
same batch. ``dry_run=true`` prints the table with a per-GPU memory estimate and exits before encoding anything.
"""

import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from recipes.buckets import (
    DEFAULT_ASPECT_RATIOS,
    BucketBatchSampler,
    add_degrees,
    auto_batch_sizes,
    bucket_table,
    format_table,
    make_buckets,
    parse_ratio,
    plan_samples,
    resolutions,
    settle_small_buckets,
    write_csv,
)
from recipes.cache import (
    EMPTY,
    CachedDataset,
    atomic_save,
    digest,
    encode_entries,
    model_fingerprint,
    todo,
    write_index,
)
from recipes.checkpoints import ResumableLoader
from recipes.media import ProbeCache, find_sources
from recipes.synthetic import make_shapes
from recipes.validation import source_name


def generating(data_dir, count: int) -> str:
    """What a run says before it fills a missing ``data_dir`` with generated shapes (a mistyped path would
    otherwise train on them unnoticed)."""
    return (
        f"data_dir {data_dir} does not exist: writing {count} generated samples there (data.synthetic_samples; "
        "set it to 0 to make a missing data_dir an error)."
    )


class EncodedData(L.LightningDataModule):
    """Captioned media -> bucketed, cached latents and embeddings -> batches of one bucket.

    Args:
        data_dir: folder of images / videos with captions (``.txt`` beside each file, or ``metadata.jsonl`` /
            ``metadata.csv`` with ``file_name`` and ``text``), a dataset saved with ``save_to_disk``, or a Hub
            dataset id in the local cache (``image`` and ``text`` columns).
        image_dir: deprecated alias of ``data_dir``.
        cache_dir: where encoded entries (and the tiny pipeline, for ``pretrained: tiny``) live.
        pretrained: the pipeline whose VAE and text encoders encode the data (``tiny`` or a path / hub id).
        resolution: training height in pixels; with ``width`` (or alone, squared) it sets the pixel budget.
        width: training width; with no ``aspect_ratios`` it makes one bucket of ``resolution`` x ``width``.
        aspect_ratios: width / height of the resolution buckets (floats or ``"16:9"``); default: 1:2 to 2:1.
        crop: ``center`` or ``random`` (a fixed random offset per sample): media are resized to cover the
            bucket and cropped, never stretched.
        small_buckets: ``merge`` (into the nearest bucket) or ``drop`` samples of buckets with fewer than
            ``batch_size`` samples; a warning says which.
        batch_size: samples per data-parallel rank and step, or ``auto``: per bucket, the batch that gives its
            CP ranks about the tokens of the largest bucket at batch 1, capped by the planner's memory
            estimate when the budget is known (a CUDA device, or the strategy's ``gpu_memory=``); the table
            and ``buckets.csv`` show each bucket's ``batch``.
        caption_dropout: probability of training a sample with the empty caption, per sample and epoch.
        allow_empty_captions: train files without a caption on the empty caption (default: an error).
        fingerprint: what identifies a file's content for the cache: ``mtime`` (path, size, modification
            time) or ``content`` (path, size, SHA-256; reads every file at start, survives copies).
        synthetic_samples: if > 0 and ``data_dir`` does not exist, generate this many captioned shapes there.
        max_sequence_length: text tokens per caption.
        encode_batch_size: samples per VAE / text-encoder call while caching.
        encode_dtype: dtype the VAE and text encoders run in while caching (``bfloat16`` halves their memory).
        vae_tiling: encode with the VAE's spatial tiling (long or high-resolution clips).
        dry_run: print the bucket table with a per-GPU memory estimate, save ``buckets.csv`` and exit.
        seed: shuffling, random crops and clips, caption dropout.
    """

    family = ""
    default_dir = "outputs/data/shapes"
    video = False
    validation = None  # a recipes.validation.Validation, found among the Trainer's callbacks when unset
    given_layout: tuple[int, Path | None] = (1, None)  # (cp, run folder) without a Trainer: set_layout
    dataset_class = CachedDataset
    frame_chunk = 1  # frames the VAE encodes at a time after the first (clips must have k x chunk + 1 frames)
    num_frames, frame_buckets, fps, clip_position, clips_per_video, skip_short_clips = 1, None, None, "start", 1, False

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
        batch_size: int | str = 4,
        caption_dropout: float = 0.0,
        allow_empty_captions: bool = False,
        fingerprint: str = "mtime",
        synthetic_samples: int = 0,
        max_sequence_length: int = 32,
        encode_batch_size: int = 4,
        encode_dtype: str = "float32",
        vae_tiling: bool = False,
        dry_run: bool = False,
        seed: int = 0,
    ):
        super().__init__()
        if image_dir is not None:
            warnings.warn("data.image_dir is deprecated: use data.data_dir.", FutureWarning, stacklevel=2)
            if data_dir is not None and data_dir != image_dir:
                raise ValueError(f"data_dir={data_dir!r} and its deprecated alias image_dir={image_dir!r} differ.")
        self.data_dir = data_dir or image_dir or self.default_dir
        if fingerprint not in ("mtime", "content"):
            raise ValueError(f"fingerprint must be 'mtime' or 'content', got {fingerprint!r}.")
        if crop not in ("center", "random"):
            raise ValueError(f"crop must be 'center' or 'random', got {crop!r}.")
        if small_buckets not in ("merge", "drop"):
            raise ValueError(f"small_buckets must be 'merge' or 'drop', got {small_buckets!r}.")
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout is a probability in [0, 1], got {caption_dropout}.")
        if not isinstance(getattr(torch, encode_dtype, None), torch.dtype):
            raise ValueError(f"encode_dtype must name a torch dtype such as 'bfloat16', got {encode_dtype!r}.")
        if batch_size != "auto" and (not isinstance(batch_size, int) or batch_size < 1) or resolution < 1:
            raise ValueError(
                f"batch_size (a positive int or 'auto') and resolution must be positive, got {batch_size!r} and "
                f"{resolution}."
            )
        self.aspect_ratios = [parse_ratio(r) for r in aspect_ratios] if aspect_ratios else None
        self.save_hyperparameters()
        self.dataset = self.val_dataset = None
        self.found: list | None = None  # data_dir's sources, once scanned (plan)
        self.val_samples: list[dict] = []  # the held-out samples (recipes/validation.py)
        self.table: list[dict] = []
        self.batch_sizes: dict[tuple, int] | None = None  # per bucket, with batch_size: auto

    @property
    def cache_folder(self) -> Path:
        return Path(self.hparams.cache_dir) / "encoded" / self.family

    # -- the model's geometry, read from its configs ---------------------------------------------
    def _pipeline_path(self) -> str:
        from recipes.components import resolve_pretrained

        return resolve_pretrained(self.family, self.hparams.pretrained, self.hparams.cache_dir)

    def geometry(self) -> tuple[int, int, int]:
        """(pixels per latent token side, frames per latent frame, latent frames per token)."""
        raise NotImplementedError

    def tokens(self, bucket) -> tuple[int, int]:
        """(tokens CP splits, text tokens it splits too) for a sample of ``bucket``."""
        raise NotImplementedError

    def encoder(self, pipeline):
        raise NotImplementedError

    # -- Lightning hooks --------------------------------------------------------------------------
    def prepare_data(self) -> None:
        h = self.hparams
        if h.synthetic_samples > 0 and not Path(self.data_dir).exists():
            print(generating(self.data_dir, h.synthetic_samples))
            make_shapes(self.data_dir, h.synthetic_samples, size=h.resolution, seed=h.seed, frames=self.num_frames)
        self._pipeline_path()  # builds the tiny pipeline once, before every rank reads it

    def _validation(self):
        """The run's Validation callback (its held-out files are left out of training), or None."""
        from recipes.validation import find

        if self.validation is None and self.trainer is not None:
            self.validation = find(self.trainer)
        return self.validation

    def _layout(self):
        """(rank, world, cp, barrier, run folder) from the Trainer, torch.distributed, or one process."""
        trainer = self.trainer
        if trainer is not None:
            return (
                trainer.global_rank,
                trainer.world_size,
                getattr(trainer.strategy, "cp", 1),
                trainer.strategy.barrier,
                Path(trainer.default_root_dir),
            )
        cp, run_dir = self.given_layout
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            d = torch.distributed
            return d.get_rank(), d.get_world_size(), cp, d.barrier, run_dir
        return 0, 1, cp, lambda *a: None, run_dir

    def set_layout(self, *, cp: int, run_dir: str | Path | None = None) -> None:
        """The CP degree and run folder where no Trainer gives them (a plain Accelerate or torchrun loop): the
        bucket table's ``cp`` and ``tokens_per_cp_rank``, and ``buckets.csv`` in ``run_dir``."""
        if not isinstance(cp, int) or cp < 1:
            raise ValueError(f"cp must be a positive int, got {cp!r}.")
        self.given_layout = (cp, Path(run_dir) if run_dir is not None else None)

    def sources(self, folder) -> list:
        """The captioned media of ``folder`` (recipes/media.py); an editing recipe pairs each with its reference."""
        h = self.hparams
        return find_sources(folder, allow_empty_captions=h.allow_empty_captions, fingerprint=h.fingerprint)

    def sample_references(self, count: int) -> list:
        """The media of the first ``count`` samples of ``data_dir`` (in its fixed order), that an image-conditioned
        sampler starts from when ``samples.images`` is not given (an image-to-video sample: a clip's first frame);
        an editing recipe's data returns its pairs' references."""
        found = self.found if self.found is not None else self.sources(self.data_dir)
        return found[:count]

    def plan(self, cp: int = 1) -> list[dict]:
        """Every sample with its bucket and cache key, and the bucket table in ``self.table``."""
        h = self.hparams
        multiple, temporal, _ = self.geometry()
        frame_counts = sorted(set(self.frame_buckets or [self.num_frames]))
        chunk = max(temporal, self.frame_chunk)
        for f in frame_counts:
            if f < 1 or (f - 1) % chunk:
                what = f"compresses {temporal} frames into one" if temporal == chunk else f"encodes chunks of {chunk}"
                raise ValueError(
                    f"clips of {f} frames do not fit the VAE, which {what} after the first: use {chunk}k+1 frames, "
                    f"e.g. {max(round((f - 1) / chunk), 0) * chunk + 1}."
                )
        for side in (h.resolution, h.width or h.resolution):
            if side % multiple:
                raise ValueError(
                    f"resolution {side} does not fit the model: it must be a multiple of {multiple} "
                    "(VAE downsampling x the transformer's 2x2 patches)."
                )
        pixels = h.resolution * (h.width or h.resolution)
        ratios = self.aspect_ratios or (
            [(h.width or h.resolution) / h.resolution] if h.width else DEFAULT_ASPECT_RATIOS
        )
        buckets = make_buckets(resolutions(pixels, ratios, multiple), frame_counts)
        sources = self.found = self.sources(self.data_dir)
        validation, held_out, root = self._validation(), [], self.data_dir
        if validation is not None and validation.data_dir is None:  # a part of data_dir, left out of training
            sources, held_out = validation.split(sources, self.data_dir)
        elif validation is not None:
            root = validation.data_dir
            found = self.sources(root)
            held_out = validation.split(found, root)[1]
        probes = ProbeCache(self.cache_folder / "probes.json")

        def place(files):
            return plan_samples(
                files,
                buckets,
                video=self.video,
                fps=self.fps,
                clip_position=self.clip_position,
                clips_per_video=self.clips_per_video,
                skip_short_clips=self.skip_short_clips,
                seed=h.seed,
                probe=probes,
            )

        samples = place(sources)
        self.val_samples = place(held_out)
        for s in self.val_samples:  # named relative to their folder: the noise is keyed by it
            s["name"] = source_name(s["source"], root)
        if self._layout()[0] == 0:
            probes.save()
        if not samples:
            raise ValueError(f"no sample of {self.data_dir} is long enough for a clip of {frame_counts[0]} frames.")
        batch = 1 if h.batch_size == "auto" else h.batch_size
        samples = settle_small_buckets(samples, batch, h.small_buckets)
        model = model_fingerprint(self._pipeline_path())
        options = {
            "family": self.family,
            "max_sequence_length": h.max_sequence_length,
            "crop": h.crop,
            "crop_seed": h.seed if h.crop == "random" else None,
            "vae_tiling": h.vae_tiling,
            "encode_dtype": h.encode_dtype,
        }
        for s in samples + self.val_samples:
            s["frames"] = s["frames"][: s["bucket"].frames]
            b = s["bucket"]
            s["key"] = digest(
                [s["source"].stamp, s["caption"], s["frames"], [b.frames, b.height, b.width], options, model]
            )
        dynamic = self._dynamic()
        self.table = bucket_table(samples, batch, 1 if dynamic else cp, self.tokens)
        if dynamic:  # each bucket's CP degree, and its tokens per rank at that degree
            add_degrees(self.table, lambda row: self.tokens(_Bucket(row)), cp, dynamic.min_tokens_per_rank)
        if h.batch_size == "auto":
            from recipes.planning import memory_check

            _, world, *_ = self._layout()
            split = lambda row: self.tokens(_Bucket(row))[0]  # noqa: E731
            if dynamic:  # tokens per rank equalised at each bucket's degree, the samples dealt to world / c
                dp = lambda row: world // row["cp_degree"]  # noqa: E731
                self.batch_sizes = auto_batch_sizes(self.table, lambda r: split(r) * cp // r["cp_degree"], dp=dp)
            else:
                fits = memory_check(self, world, cp)
                self.batch_sizes = auto_batch_sizes(self.table, split, dp=max(world // cp, 1), fits=fits)
        return samples

    def _dynamic(self):
        """The strategy when it runs dynamic CP (its min_tokens_per_rank and weighting), else None."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        return strategy if getattr(strategy, "dynamic_cp", False) else None

    def setup(self, stage: str) -> None:
        if self.dataset is not None:
            return
        h = self.hparams
        rank, world, cp, barrier, run_dir = self._layout()
        samples = self.plan(cp)
        if h.dry_run:
            self._add_memory_estimate()
        if rank == 0:
            print(f"buckets ({len(samples)} samples, batch_size {h.batch_size} per dp rank, cp={cp}):")
            print(format_table(self.table))
            if run_dir is not None:
                write_csv(self.table, run_dir / "buckets.csv")
        if h.dry_run:
            barrier()
            raise SystemExit(0)
        folder = self.cache_folder
        encoded = samples + self.val_samples
        if todo(encoded, folder, rank, world) or (rank == 0 and not (folder / f"{EMPTY}.safetensors").exists()):
            from recipes.components import load_encoders

            dtype = getattr(torch, h.encode_dtype)
            pipeline = load_encoders(self.family, h.pretrained, h.cache_dir, dtype=dtype)
            device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
            pipeline.to(device)  # each rank encodes its share on its own device
            if h.vae_tiling:
                pipeline.vae.enable_tiling()
            encode_entries(
                encoded,
                folder,
                self.encoder(pipeline),
                rank=rank,
                world=world,
                batch_size=h.encode_batch_size,
                crop=h.crop,
                seed=h.seed,
            )
            del pipeline
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the encoders leave before the transformer arrives
        barrier()
        indexes = []
        for part, prefix in ((samples, "index"), (self.val_samples, "val-index")):
            # its name is a digest of its rows: an existing one is current
            index = folder / f"{prefix}-{digest([[s['key'], s['name'], s['clip']] for s in part])[:20]}.json"
            if rank == 0 and part and not index.exists():
                write_index(part, index)
            indexes.append(index)
        barrier()
        self.encode_extra(samples + self.val_samples)
        self.dataset = self.dataset_class(indexes[0], caption_dropout=h.caption_dropout, seed=h.seed)
        self.val_dataset = self.dataset_class(indexes[1]) if self.val_samples else None

    def encode_extra(self, samples: list[dict]) -> None:
        """Cache what a recipe needs beyond each sample's latents and text (an editing recipe's reference)."""

    def encode_missing(self, samples: list[dict], key_of, encode) -> None:
        """For an ``encode_extra``: cache ``encode(pipeline, latents_of, sample)`` (a dict of tensors) as
        ``<key_of(sample key)>.safetensors`` for each sample that has none yet; every rank encodes a share with
        the family's encoders, then all wait."""
        h = self.hparams
        rank, world, _, barrier, _ = self._layout()
        folder = self.cache_folder
        mine = [s for s in samples[rank::world] if not (folder / f"{key_of(s['key'])}.safetensors").exists()]
        if mine:
            from recipes.components import load_encoders

            pipeline = load_encoders(self.family, h.pretrained, h.cache_dir, dtype=getattr(torch, h.encode_dtype))
            device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
            latents_of, _ = self.encoder(pipeline.to(device))
            with torch.no_grad():
                for s in mine:
                    atomic_save(encode(pipeline, latents_of, s), folder / f"{key_of(s['key'])}.safetensors")
        barrier()

    def train_dataloader(self) -> DataLoader:
        # Sized by the strategy (dp ranks under CP: CP peers get the same batches), one replica otherwise.
        trainer = self.trainer
        dynamic = self._dynamic()
        if dynamic:  # sized by the world: each micro-batch's sub-groups take different batches
            kwargs = {"num_replicas": trainer.world_size, "rank": trainer.global_rank, **self._dynamic_kwargs()}
        else:
            kwargs = (trainer.distributed_sampler_kwargs if trainer else None) or {"num_replicas": 1, "rank": 0}
        sizes = self.batch_sizes or self.hparams.batch_size
        sampler = BucketBatchSampler(self.dataset.buckets, sizes, seed=self.hparams.seed, **kwargs)
        if len(sampler) == 0:
            raise ValueError(
                f"{sum(r['batches'] for r in self.table)} full batches of {self.hparams.batch_size} per epoch cannot "
                f"give each of {kwargs['num_replicas']} data-parallel ranks one: add data or lower batch_size."
            )
        # resumable: a checkpoint records the position in the epoch (recipes/checkpoints.py)
        return ResumableLoader(self.dataset, batch_sampler=sampler, trainer=trainer)

    def _dynamic_kwargs(self) -> dict:
        rows = {(r["frames"], r["height"], r["width"]): r for r in self.table}
        return {
            "degrees": {b: r["cp_degree"] for b, r in rows.items()},
            "tokens": {b: self.tokens(_Bucket(r))[0] for b, r in rows.items()},
            "accumulate": self.trainer.accumulate_grad_batches,
            "weighting": self.trainer.strategy.dynamic_weighting,
        }

    def _add_memory_estimate(self) -> None:
        """Adds the layout planner's ``est_gib_per_gpu`` for the Trainer's layout to the table."""
        from recipes.planning import add_estimates, layout_options, model_spec

        module = self.trainer.lightning_module if self.trainer is not None else None
        hparams = dict(module.hparams) if module is not None else {}
        strategy = self.trainer.strategy if self.trainer is not None else None
        add_estimates(
            self.table,
            model_spec(self.hparams.pretrained, self._pipeline_path()),
            self.tokens,
            world=self.trainer.world_size if self.trainer is not None else 1,
            cp=getattr(strategy, "cp", 1),
            **layout_options(strategy, hparams),
            batch_size=self.hparams.batch_size,
        )


class _Bucket:
    """A table row as a bucket for ``tokens(bucket)``."""

    def __init__(self, row: dict) -> None:
        self.frames, self.height, self.width = row["frames"], row["height"], row["width"]

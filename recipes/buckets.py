"""Buckets: training shapes for a pixel budget, samples placed in the nearest one, batches of one bucket.

A bucket is (frames, height, width). Resolutions come from a pixel budget and a list of aspect ratios
(each side a multiple of what the model needs), frame counts from a list. A sample goes to the bucket
nearest its aspect ratio among those whose frame count it can fill (the longest such). Buckets too
small for one batch are merged into their nearest neighbour, or dropped, with a warning either way.
:func:`plan_samples` places every image and clip; :func:`bucket_table` reports the result (the dry run's
per-GPU estimate comes from the layout planner, recipes/planning.py; :func:`memory_estimate_gib` is the rough
formula the presets' comments quote).

:class:`BucketBatchSampler` gives every batch one bucket. It is sized by data-parallel ranks only: CP
peers (same dp rank) get the same batches, dp ranks different ones; which batches a rank gets depends
only on (seed, epoch, dp layout), and every rank takes the same number of steps. Under dynamic CP
(``degrees``) it is sized by the world instead: each micro-batch is one bucket's batches for the
world / c sub-groups of its degree c, the ranks of a sub-group sharing one.
"""

from __future__ import annotations

import csv
import math
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from recipes.media import clip_starts, probe

DEFAULT_ASPECT_RATIOS = (0.5, 0.5625, 0.6667, 0.75, 1.0, 1.3333, 1.5, 1.7778, 2.0)  # width / height


@dataclass(frozen=True, order=True)
class Bucket:
    frames: int
    height: int
    width: int

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.frames}f" if self.frames > 1 else "")


def parse_ratio(value) -> float:
    """1.5, "3:2" or "1.5" -> width / height."""
    if isinstance(value, str) and ":" in value:
        w, h = value.split(":")
        return float(w) / float(h)
    return float(value)


def resolutions(pixels: int, aspect_ratios, multiple: int) -> list[tuple[int, int]]:
    """(height, width) per aspect ratio, about ``pixels`` in area, sides multiples of ``multiple``."""
    out = []
    for ratio in aspect_ratios:
        ratio = parse_ratio(ratio)
        if ratio <= 0:
            raise ValueError(f"aspect ratios must be positive (width / height), got {ratio}.")
        h = max(multiple, round(math.sqrt(pixels / ratio) / multiple) * multiple)
        w = max(multiple, round(math.sqrt(pixels * ratio) / multiple) * multiple)
        if (h, w) not in out:
            out.append((h, w))
    return out


def make_buckets(sizes: list[tuple[int, int]], frame_counts: list[int]) -> list[Bucket]:
    return sorted(Bucket(f, h, w) for f in frame_counts for h, w in sizes)


def _distance(bucket: Bucket, aspect: float) -> float:
    return abs(math.log(bucket.width / bucket.height) - math.log(aspect))


def nearest(buckets: list[Bucket], width: int, height: int, available: int) -> Bucket | None:
    """The bucket nearest the aspect ratio among those with the most frames ``available`` allows."""
    fitting = [b for b in buckets if b.frames <= available]
    if not fitting:
        return None
    frames = max(b.frames for b in fitting)
    return min((b for b in fitting if b.frames == frames), key=lambda b: (_distance(b, width / height), b))


def settle_small_buckets(samples: list[dict], batch_size: int, policy: str, min_size: int | None = None) -> list[dict]:
    """Move (``merge``) or remove (``drop``) samples of buckets holding fewer than ``min_size`` samples
    (default ``batch_size``), warning with the numbers. Each sample has ``bucket``, ``aspect``, ``available``."""
    min_size = min_size or batch_size
    counts: dict[Bucket, int] = {}
    for s in samples:
        counts[s["bucket"]] = counts.get(s["bucket"], 0) + 1
    small = {b for b, n in counts.items() if n < min_size}
    if not small:
        return samples
    big = [b for b in counts if b not in small]
    kept, moved, dropped = [], 0, 0
    for s in samples:
        if s["bucket"] not in small:
            kept.append(s)
            continue
        target = nearest(big, s["aspect"], 1.0, s["available"]) if policy == "merge" and big else None
        if target is None:
            dropped += 1
            continue
        kept.append({**s, "bucket": target})
        moved += 1
    names = ", ".join(f"{b.name} ({counts[b]})" for b in sorted(small))
    warnings.warn(
        f"buckets with fewer than {min_size} samples: {names}; {moved} samples merged into the nearest larger "
        f"bucket, {dropped} dropped (small_buckets={policy!r}). Add data, lower batch_size or use fewer "
        "aspect_ratios / frame_buckets to keep them.",
        stacklevel=2,
    )
    if not kept:
        raise ValueError(
            f"every bucket holds fewer than {min_size} samples ({names}): nothing is left to train on; "
            "lower batch_size or use fewer aspect_ratios / frame_buckets."
        )
    return kept


class BucketBatchSampler:
    """Batches of one bucket each, shuffled per epoch, split over data-parallel ranks.

    ``buckets[i]`` is sample i's bucket. Each epoch: every bucket's samples are shuffled and cut into
    full batches (a remainder is left for that epoch), the batches shuffled together, and dp rank r
    takes batches r, r + dp, ... (all ranks the same count). Items are ``(index, epoch)`` so the dataset
    can draw per-sample randomness (caption dropout) from (seed, epoch, index).

    ``batch_size`` may map each bucket to its own batch size (``data.batch_size: auto``). Then the batches of
    one bucket are dealt out in groups of dp, one per rank, and the groups shuffled: at every step all dp
    ranks hold the same bucket and batch size, so DDP's mean of the ranks' mean losses is the mean over the
    step's samples, as with one batch size.

    Dynamic CP (``degrees``, bucket -> CP degree c; ``num_replicas`` and ``rank`` are then the world's): a
    bucket's batches are dealt out in groups of world / c, one per sub-group (ranks r with the same r // c share
    it), and the groups of every bucket shuffled together: each micro-batch is one bucket, so one degree, on
    every rank. Items are ``(index, epoch, tokens, W)``: the bucket's ``tokens[bucket]`` (what the strategy picks
    the degree from) and W, the optimizer step's sample count (or token count, ``weighting="tokens"``) over its
    ``accumulate`` micro-batches and every sub-group, which the loss is divided by (cp_lightning.dynamic).
    """

    def __init__(
        self,
        buckets: list,
        batch_size,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        degrees: Mapping | None = None,
        tokens: Mapping | None = None,
        accumulate: int = 1,
        weighting: str = "samples",
    ):
        self.buckets, self.batch_size = list(buckets), batch_size
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.degrees, self.tokens, self.accumulate, self.weighting = degrees, tokens, accumulate, weighting
        if degrees is not None and (tokens is None or any(num_replicas % degrees[b] for b in set(self.buckets))):
            raise ValueError("dynamic CP batches need every bucket's tokens and degrees that divide the world.")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _size(self, bucket) -> int:
        return self.batch_size[bucket] if isinstance(self.batch_size, Mapping) else self.batch_size

    def _dynamic_groups(self) -> list[tuple]:
        """Dynamic CP: (bucket, [one batch per sub-group]) per micro-batch, shuffled; the same list on every rank."""
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        members: dict = {}
        for i, b in enumerate(self.buckets):
            members.setdefault(b, []).append(i)
        groups = []
        for b in sorted(members):
            ids, size, n = members[b], self._size(b), self.num_replicas // self.degrees[b]
            rng.shuffle(ids)
            cut = [ids[k : k + size] for k in range(0, len(ids) - size + 1, size)]
            groups += [(b, cut[k : k + n]) for k in range(0, len(cut) - n + 1, n)]
        rng.shuffle(groups)
        return groups

    def _dynamic_batches(self) -> list[list[tuple]]:
        """This rank's micro-batches, each item (index, epoch, tokens, W); W summed over each step's micro-batches."""
        groups, out = self._dynamic_groups(), []
        for start in range(0, len(groups), self.accumulate):
            step = groups[start : start + self.accumulate]
            weight = lambda b: self.tokens[b] if self.weighting == "tokens" else 1  # noqa: E731
            total = float(sum(len(batch) * weight(b) for b, batches in step for batch in batches))
            for b, batches in step:
                batch = batches[self.rank // self.degrees[b]]
                out.append([(i, self.epoch, self.tokens[b], total) for i in batch])
        return out

    def _batches(self) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        groups: dict = {}
        for i, b in enumerate(self.buckets):
            groups.setdefault(b, []).append(i)
        batches, dealt = [], []
        for b in sorted(groups):
            members, size = groups[b], self._size(b)
            rng.shuffle(members)
            cut = [members[k : k + size] for k in range(0, len(members) - size + 1, size)]
            batches += cut
            n = self.num_replicas
            dealt += [cut[k : k + n] for k in range(0, len(cut) - n + 1, n)]
        if isinstance(self.batch_size, Mapping):
            rng.shuffle(dealt)
            return [batch for group in dealt for batch in group]
        rng.shuffle(batches)
        return batches[: len(batches) // self.num_replicas * self.num_replicas]

    def __iter__(self):
        if self.degrees is not None:
            yield from self._dynamic_batches()
            return
        for batch in self._batches()[self.rank :: self.num_replicas]:
            yield [(i, self.epoch) for i in batch]

    def __len__(self) -> int:
        if self.degrees is not None:
            return len(self._dynamic_groups())
        return len(self._batches()) // self.num_replicas


def auto_batch_sizes(rows: list[dict], split_tokens, *, dp: int, fits=None) -> dict[tuple, int]:
    """``data.batch_size: auto``: each bucket's batch gives its CP ranks about the tokens of the largest bucket
    at batch 1 (floor of the ratio, at least 1), no more than its samples can fill once per dp rank, and,
    with ``fits(row, batch)`` (the planner's memory check), the largest such batch that fits.
    ``split_tokens(row)`` is a row's split tokens per sample. Sets ``batch`` and ``batches`` in each row."""
    target = max(split_tokens(r) for r in rows)
    sizes = {}
    for row in rows:
        replicas = dp(row) if callable(dp) else dp  # (dynamic CP: world / the bucket's degree)
        batch = max(1, min(target // split_tokens(row), row["samples"] // replicas))
        while fits is not None and batch > 1 and not fits(row, batch):
            batch -= 1
        sizes[(row["frames"], row["height"], row["width"])] = batch
        row["batch"], row["batches"] = batch, row["samples"] // batch
    return sizes


def add_degrees(rows: list[dict], tokens, cp: int, min_tokens_per_rank: int) -> None:
    """Dynamic CP: each row's ``cp_degree`` (cp_lightning.dynamic.choose_degree of its split tokens) and its
    ``tokens_per_cp_rank`` at that degree. ``tokens(row)`` -> (split tokens, text tokens)."""
    from cp_lightning.dynamic import choose_degree

    for row in rows:
        split, text = tokens(row)
        degree = choose_degree(split, cp, min_tokens_per_rank)
        row["cp_degree"] = degree
        row["tokens_per_cp_rank"] = math.ceil(split / degree) + (math.ceil(text / degree) if text else 0)


def bucket_table(samples: list[dict], batch_size: int, cp: int, tokens) -> list[dict]:
    """One row per bucket: samples, full batches per epoch, tokens per sample and per CP rank.
    ``tokens(bucket)`` -> (split tokens, text tokens); the split sequence must have >= cp tokens."""
    counts: dict[Bucket, list[str]] = {}
    for s in samples:
        counts.setdefault(s["bucket"], []).append(s["name"])
    rows = []
    for b in sorted(counts):
        split, text = tokens(b)
        if split < cp:
            raise ValueError(
                f"bucket {b.name} ({counts[b][0]} and {len(counts[b]) - 1} more) has {split} tokens, fewer than "
                f"cp={cp}: raise the resolution (or num_frames) or lower cp."
            )
        rows.append(
            {
                "bucket": b.name,
                "frames": b.frames,
                "height": b.height,
                "width": b.width,
                "samples": len(counts[b]),
                "batches": len(counts[b]) // batch_size,
                "tokens_per_sample": split + text,
                "tokens_per_cp_rank": math.ceil(split / cp) + (math.ceil(text / cp) if text else 0),
            }
        )
    return rows


def format_table(rows: list[dict], extra: str | None = None) -> str:
    keys = list(rows[0]) + ([extra] if extra and extra not in rows[0] else [])
    cells = [keys] + [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def memory_estimate_gib(
    *,
    params: int,
    trainable: int,
    weight_bytes: int,
    hidden: int,
    layers: int,
    tokens: int,
    batch: int,
    checkpointing: bool,
) -> float:
    """A rough per-GPU peak: weights, trainable fp32 weights + grads + AdamW moments (16 B each), and
    activations of ``tokens`` (per CP rank) x ``batch``: ~34 bytes x hidden per token and layer in
    16-bit (Korthikanti et al. 2022, attention scores not kept by flash kernels), or only each block's
    input plus one block's worth with gradient checkpointing."""
    per_layer = 34 * hidden * tokens * batch * weight_bytes / 2
    acts = (layers * hidden * tokens * batch * weight_bytes + per_layer) if checkpointing else layers * per_layer
    return (params * weight_bytes + trainable * 16 + acts) / 2**30


def plan_samples(
    sources,
    buckets,
    *,
    video: bool,
    fps: float | None,
    clip_position: str,
    clips_per_video: int,
    skip_short_clips: bool,
    seed: int,
    probe=probe,
) -> list[dict]:
    """One sample per image and per clip: its source frames and nearest bucket (before small-bucket merges)."""
    smallest = min(b.frames for b in buckets)
    samples = []
    for src in sources:
        if src.is_video and not video:
            raise ValueError(f"{src.path} is a video; the Flux recipe trains on images (use the Wan recipe for video).")
        p = probe(src)
        available = p.frame_count(fps) if src.is_video else 1
        bucket = nearest(buckets, p.width, p.height, available)
        if bucket is None:
            message = (
                f"{src.path} has {available} frames{f' at {fps} fps' if fps else ''}, fewer than the shortest clip "
                f"({smallest} frames): lower num_frames / frame_buckets or fps"
            )
            if not skip_short_clips:
                raise ValueError(message + ", or set skip_short_clips=true to leave such files out.")
            warnings.warn(message + "; skipped (skip_short_clips=true).", stacklevel=2)
            continue
        starts = clip_starts(available, bucket.frames, clips_per_video, clip_position, seed, src.path)
        for k, start in enumerate(starts):
            samples.append(
                {
                    "source": src,
                    "name": src.path if src.row is None else f"{src.path}[{src.row}]",
                    "clip": k,
                    "caption": src.caption,
                    "frames": p.source_frames(start, bucket.frames, fps) if src.is_video else [0],
                    "times": p.times if src.is_video else None,
                    "bucket": bucket,
                    "aspect": p.width / p.height,
                    "available": bucket.frames,
                }
            )
    return samples

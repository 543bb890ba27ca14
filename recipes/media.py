"""Media for the recipes: find captioned images and videos in a folder, decode them, crop without stretching.

A data folder holds images (png/jpg/jpeg/webp) and videos (mp4/webm/mov/gif, decoded with PyAV), in
subfolders or not. A caption comes from ``metadata.jsonl`` / ``metadata.csv`` (``file_name``, ``text``;
names relative to the folder holding the metadata file) or else a ``.txt`` file with the media's stem. A
dataset saved with ``datasets.save_to_disk`` (or a Hub dataset in the local cache) with ``image`` and
``text`` columns works too. Every bad input is a ``ValueError`` naming the file and saying what to do.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".gif")
CAPTION_FILES = ("metadata.jsonl", "metadata.csv")
# Files a data folder may hold besides media: captions, metadata, and notes people keep beside them.
IGNORED_EXTENSIONS = (".txt", ".json", ".jsonl", ".csv", ".md")


@dataclass
class Source:
    """One image or video and its caption. ``stamp`` identifies the file's content for the cache
    (path, size, mtime) and ``row`` a dataset row (``path`` is then the dataset's folder)."""

    path: str
    caption: str
    is_video: bool
    stamp: tuple = ()
    row: int | None = None
    dataset: object = field(default=None, repr=False, compare=False)


def _metadata_captions(folder: Path) -> dict[Path, str | None]:
    """{media path: caption or None} from every metadata.jsonl / metadata.csv under ``folder``."""
    captions: dict[Path, str | None] = {}
    for meta in sorted(p for name in CAPTION_FILES for p in folder.rglob(name)):
        try:
            if meta.suffix == ".jsonl":
                rows = [json.loads(line) for line in meta.read_text().splitlines() if line.strip()]
            else:
                with meta.open(newline="") as f:
                    rows = list(csv.DictReader(f))
        except (json.JSONDecodeError, csv.Error, UnicodeDecodeError) as err:
            raise ValueError(f"cannot parse {meta}: {err}") from None
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or not row.get("file_name"):
                raise ValueError(f"{meta} row {i + 1} has no 'file_name'; every row needs 'file_name' and 'text'.")
            path = meta.parent / row["file_name"]
            if not path.is_file():
                raise ValueError(f"{meta} lists {row['file_name']!r}, but {path} does not exist.")
            text = row.get("text")
            captions[path] = text if isinstance(text, str) and text.strip() else None
    return captions


def find_sources(
    data_dir: str | Path, *, allow_empty_captions: bool = False, fingerprint: str = "mtime", exclude: tuple = ()
) -> list[Source]:
    """Every captioned image or video under ``data_dir`` (a folder, a saved dataset or a cached Hub
    dataset), in a fixed order, leaving out the top-level folders named in ``exclude`` (an editing recipe's
    ``control/``); raises ValueError naming the first bad file. A file's ``stamp`` is its
    relative path, size and mtime, or (``fingerprint="content"``) its size and SHA-256: copies and
    touched files then keep their cache entries."""
    folder = Path(data_dir)
    if (folder / "dataset_info.json").exists() or (folder / "state.json").exists():
        import datasets

        return _dataset_sources(datasets.load_from_disk(str(folder)), str(folder), allow_empty_captions)
    if not folder.exists():
        if str(data_dir).count("/") == 1 and not str(data_dir).startswith((".", "/")):
            import datasets

            try:
                ds = datasets.load_dataset(str(data_dir), split="train")
            except Exception as err:
                raise ValueError(f"data_dir {data_dir} is neither a folder nor a loadable Hub dataset: {err}") from None
            return _dataset_sources(ds, str(data_dir), allow_empty_captions)
        raise ValueError(f"data_dir {folder} does not exist: pass a folder of images or videos with captions.")
    if not folder.is_dir():
        raise ValueError(f"data_dir {folder} is a file; pass the folder that holds the images or videos.")
    listed = _metadata_captions(folder)
    sources = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or rel.parts[0] in exclude:
            continue  # hidden files and folders (.DS_Store, .cache), and folders the caller reads itself
        ext = path.suffix.lower()
        if ext in IGNORED_EXTENSIONS and path not in listed:
            continue
        if ext not in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS:
            raise ValueError(
                f"{path} has an unsupported extension {ext!r}: images may be {', '.join(IMAGE_EXTENSIONS)} and "
                f"videos {', '.join(VIDEO_EXTENSIONS)}; convert it or move it out of {folder}."
            )
        caption = listed.get(path)
        txt = path.with_suffix(".txt")
        if caption is None and txt.is_file():
            caption = txt.read_text().strip() or None
        if caption is None:
            if not allow_empty_captions:
                raise ValueError(
                    f"{path} has no caption: write it to {txt.name} beside it or to a metadata.jsonl line "
                    '{"file_name": ..., "text": ...}, or set allow_empty_captions=true to train it uncaptioned.'
                )
            caption = ""
        stat = path.stat()
        version = _sha256(path) if fingerprint == "content" else stat.st_mtime_ns
        sources.append(Source(str(path), caption, ext in VIDEO_EXTENSIONS, (str(rel), stat.st_size, version)))
    if not sources:
        raise ValueError(
            f"data_dir {folder} holds no images or videos ({', '.join(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)})."
        )
    return sources


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dataset_sources(ds, name: str, allow_empty_captions: bool) -> list[Source]:
    if len(ds) == 0:
        raise ValueError(f"the dataset {name} is empty.")
    if "image" not in ds.column_names:
        raise ValueError(f"the dataset {name} has columns {ds.column_names}; it needs 'image' and 'text'.")
    texts = ds["text"] if "text" in ds.column_names else [None] * len(ds)
    sources = []
    for i, text in enumerate(texts):
        if not (isinstance(text, str) and text.strip()):
            if not allow_empty_captions:
                raise ValueError(
                    f"item {i} of the dataset {name} has no caption in column 'text' "
                    "(or set allow_empty_captions=true)."
                )
            text = ""
        sources.append(Source(name, text, False, (name, ds._fingerprint, i), row=i, dataset=ds))
    return sources


# -- probing and decoding ---------------------------------------------------------------------------


@dataclass
class Probe:
    """A source's size in pixels and the start times (seconds) of its frames."""

    width: int
    height: int
    times: list[float]

    def frame_count(self, fps: float | None) -> int:
        """Frames available at ``fps`` (the source's own frames when None)."""
        if fps is None or len(self.times) < 2:
            return len(self.times)
        return int(math.floor((self.times[-1] - self.times[0]) * fps + 1e-6)) + 1

    def source_frames(self, start: int, count: int, fps: float | None) -> list[int]:
        """Source frame indices of resampled frames ``start .. start + count - 1`` (nearest earlier frame)."""
        if fps is None:
            return list(range(start, start + count))
        out, i = [], 0
        for k in range(start, start + count):
            t = self.times[0] + k / fps + 1e-6
            while i + 1 < len(self.times) and self.times[i + 1] <= t:
                i += 1
            out.append(i)
        return out


def probe(source: Source) -> Probe:
    """Size and frame times without decoding pixels (videos are demuxed, images read lazily)."""
    if source.row is not None:
        image = source.dataset[source.row]["image"]
        return Probe(image.width, image.height, [0.0])
    if not source.is_video:
        try:
            with Image.open(source.path) as image:
                image.verify()
            with Image.open(source.path) as image:
                return Probe(image.width, image.height, [0.0])
        except Exception as err:
            raise ValueError(f"cannot read image {source.path}: {err}; re-export it or remove it.") from None
    import av

    try:
        with av.open(source.path) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            pts = sorted(p.pts for p in container.demux(stream) if p.pts is not None and p.size > 0)
            width, height = stream.codec_context.width, stream.codec_context.height
            times = [float(p * stream.time_base) for p in pts]
    except Exception as err:
        raise ValueError(
            f"cannot read video {source.path}: {err}; re-encode it (e.g. with ffmpeg) or remove it."
        ) from None
    if not times or not width or not height:
        raise ValueError(f"cannot read video {source.path}: it holds no decodable frames; re-encode or remove it.")
    return Probe(width, height, times)


class ProbeCache:
    """Probes of files by (path, size, mtime), kept in a JSON file: a restart reads container headers once.
    Constant-frame-rate times are stored as (first, step, count)."""

    def __init__(self, path: Path | None):
        self.path, self.changed = path, False
        self.table = json.loads(path.read_text()) if path is not None and path.exists() else {}

    def __call__(self, source: Source) -> Probe:
        if source.row is not None or self.path is None:
            return probe(source)
        key = hashlib.sha256(json.dumps(source.stamp).encode()).hexdigest()[:32]
        if key in self.table:
            w, h, times = self.table[key]
            if isinstance(times, dict):
                times = [times["first"] + k * times["step"] for k in range(times["count"])]
            return Probe(w, h, times)
        p = probe(source)
        times: list | dict = p.times
        if len(p.times) > 2:
            step = (p.times[-1] - p.times[0]) / (len(p.times) - 1)
            if all(abs(t - (p.times[0] + k * step)) < 1e-7 for k, t in enumerate(p.times)):
                times = {"first": p.times[0], "step": step, "count": len(p.times)}
        self.table[key] = [p.width, p.height, times]
        self.changed = True
        return p

    def save(self) -> None:
        if self.changed and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.table))
            os.replace(tmp, self.path)
            self.changed = False


def clip_starts(available: int, num_frames: int, clips: int, position: str, seed: int, name: str) -> list[int]:
    """Start frames of up to ``clips`` non-overlapping clips of ``num_frames`` at ``position``."""
    count = max(1, min(clips, available // num_frames))
    span = count * num_frames
    if position == "start":
        offset = 0
    elif position == "center":
        offset = (available - span) // 2
    else:  # random, but the same for a file at every run and on every rank
        offset = _rng(seed, name).randint(0, available - span)
    return [offset + k * num_frames for k in range(count)]


def _rng(seed: int, name: str) -> random.Random:
    return random.Random(int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:16], 16))


def load_frames(source: Source, frames: list[int], times: list[float] | None = None) -> list[Image.Image]:
    """The RGB source frames with the given indices (sorted, repeats allowed). With the probe's frame
    ``times``, a clip deep into a long video is reached by seeking to the keyframe before it, and
    decoded frames are matched to indices by their timestamps."""
    if source.row is not None:
        return [source.dataset[source.row]["image"].convert("RGB")]
    if not source.is_video:
        try:
            with Image.open(source.path) as image:
                return [image.convert("RGB")]
        except Exception as err:
            raise ValueError(f"cannot read image {source.path}: {err}; re-export it or remove it.") from None
    import av

    wanted, out = set(frames), {}
    try:
        with av.open(source.path) as container:
            stream = container.streams.video[0]
            seek = times is not None and frames[0] > 0
            if seek:
                container.seek(int(round(times[frames[0]] / stream.time_base)), stream=stream, backward=True)
            for count, frame in enumerate(container.decode(stream)):
                i = count
                if seek:
                    if frame.pts is None:
                        raise ValueError("a decoded frame has no timestamp to seek by")
                    t = float(frame.pts * stream.time_base)
                    j = bisect.bisect_left(times, t - 1e-6)
                    i = min((k for k in (j - 1, j) if 0 <= k < len(times)), key=lambda k: abs(times[k] - t))
                if i in wanted:
                    out[i] = frame.to_image().convert("RGB")
                if i >= frames[-1]:
                    break
    except Exception as err:
        raise ValueError(f"cannot decode video {source.path}: {err}; re-encode it or remove it.") from None
    if len(out) < len(wanted):
        raise ValueError(f"cannot decode video {source.path}: frame {max(wanted - set(out))} is missing or corrupt.")
    return [out[i] for i in frames]


def cover_crop(image: Image.Image, height: int, width: int, crop: str = "center", rng=None) -> Image.Image:
    """Resize ``image`` to cover ``height`` x ``width`` (aspect kept) and crop the rest; never stretch."""
    scale = max(height / image.height, width / image.width)
    w, h = max(width, round(image.width * scale)), max(height, round(image.height * scale))
    if (w, h) != image.size:
        image = image.resize((w, h), Image.BICUBIC)
    if crop == "random":
        left, top = rng.randint(0, w - width), rng.randint(0, h - height)
    else:
        left, top = (w - width) // 2, (h - height) // 2
    return image.crop((left, top, left + width, top + height))


def to_pixels(
    images: list[Image.Image], height: int, width: int, crop: str = "center", seed: int = 0, name: str = ""
) -> torch.Tensor:
    """F, C, H, W in [-1, 1]: every frame cropped the same way (one random offset per clip)."""
    out = []
    for image in images:
        image = cover_crop(image, height, width, crop, _rng(seed, "crop:" + name))
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)
        out.append(pixels.permute(2, 0, 1).float() / 127.5 - 1.0)  # H, W, C -> C, H, W
    return torch.stack(out)

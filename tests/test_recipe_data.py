"""The recipes' data path: real media (PyAV videos, images of several aspect ratios), captions, crops,
buckets under CP, caption dropout, the fingerprinted cache, bad input; and both tiny recipes trained at
cp=2 on such files."""

from __future__ import annotations

import csv
import json
import os
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def write_video(path: Path, frames: int, width: int, height: int, fps: int = 8) -> Path:
    """A clip whose frame k has a white bar at column 4k (so decoded frames can be told apart)."""
    import av

    codec = {".mp4": "libx264", ".webm": "libvpx", ".mov": "mpeg4", ".gif": "gif"}[path.suffix]
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "rgb8" if codec == "gif" else "yuv420p"
        for k in range(frames):
            a = np.full((height, width, 3), 40, np.uint8)
            a[:, (4 * k) % width : (4 * k) % width + 4] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def write_image(path: Path, width: int, height: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def image_folder(folder: Path, squares: int = 8, wide: int = 8) -> Path:
    """png squares captioned by .txt files, 2:1 jpgs captioned in metadata.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(squares):
        write_image(folder / f"sq{i}.png", 32, 32, i)
        (folder / f"sq{i}.txt").write_text(f"square {i}")
    (folder / "wide").mkdir(exist_ok=True)
    for i in range(wide):
        write_image(folder / "wide" / f"w{i}.jpg", 64, 32, 100 + i)
        rows.append({"file_name": f"wide/w{i}.jpg", "text": f"wide {i}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


# -- media -------------------------------------------------------------------------------------------


def test_a_square_crop_of_a_wide_image_keeps_the_centre_and_never_stretches():
    from recipes.media import cover_crop, to_pixels

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 64, 3), dtype=np.uint8))
    crop = cover_crop(image, 32, 32)
    assert np.array_equal(np.asarray(crop), np.asarray(image)[:, 16:48])  # the centre, pixel for pixel
    pixels = to_pixels([image], 32, 32)  # F, C, H, W in [-1, 1]
    expected = torch.from_numpy(np.asarray(image)[:, 16:48].copy()).permute(2, 0, 1).float() / 127.5 - 1
    assert torch.equal(pixels[0], expected)
    # downscaled to cover: a 128x64 image into 32x32 is halved (aspect kept), then its centre cut
    big = image.resize((128, 64), Image.NEAREST)
    assert cover_crop(big, 32, 32).size == (32, 32)
    assert np.abs(np.asarray(cover_crop(big, 32, 32), np.int16) - np.asarray(crop, np.int16)).mean() < 40
    random_crop = cover_crop(image, 32, 32, "random", __import__("random").Random(1))
    assert random_crop.size == (32, 32)


def test_captions_come_from_txt_metadata_jsonl_and_csv(tmp_path):
    from recipes.media import find_sources

    folder = image_folder(tmp_path / "d", squares=2, wide=2)
    write_image(folder / "c.webp", 40, 32)
    (folder / "sub").mkdir()
    write_image(folder / "sub" / "d.png", 32, 32)
    (folder / "sub" / "metadata.csv").write_text("file_name,text\nd.png,from csv\n")
    (folder / "notes.md").write_text("kept beside the data")
    with pytest.raises(ValueError, match=r"c\.webp has no caption.*c\.txt"):
        find_sources(folder)
    by_name = {Path(s.path).name: s.caption for s in find_sources(folder, allow_empty_captions=True)}
    assert by_name == {"sq0.png": "square 0", "sq1.png": "square 1", "w0.jpg": "wide 0", "w1.jpg": "wide 1"} | {
        "c.webp": "",
        "d.png": "from csv",
    }


def test_bad_input_errors_name_the_file(tmp_path):
    from recipes.media import Source, find_sources, load_frames, probe

    folder = image_folder(tmp_path / "a", squares=1, wide=0)
    (folder / "x.bmp").write_bytes(b"BM")
    with pytest.raises(ValueError, match=r"x\.bmp has an unsupported extension '\.bmp'"):
        find_sources(folder)
    (folder / "x.bmp").unlink()
    (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "gone.png", "text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"lists 'gone\.png', but .*gone\.png does not exist"):
        find_sources(folder)
    (folder / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"cannot read image .*broken\.png"):
        probe(Source(str(folder / "broken.png"), "x", False))
    good = write_video(tmp_path / "good.mp4", 6, 32, 32)
    (tmp_path / "cut.mp4").write_bytes(good.read_bytes()[: len(good.read_bytes()) // 3])
    (tmp_path / "zero.webm").touch()
    for bad in ("cut.mp4", "zero.webm"):
        source = Source(str(tmp_path / bad), "x", True)
        with pytest.raises(ValueError, match=rf"cannot (read|decode) video .*{bad}"):
            probe(source)
            load_frames(source, list(range(6)))
    with pytest.raises(ValueError, match="does not exist"):
        find_sources(tmp_path / "missing")


def test_videos_resample_to_fps_and_clips_start_where_asked(tmp_path, monkeypatch):
    import recipes.media
    from recipes.media import ProbeCache, Source, clip_starts, load_frames, probe

    probes = ProbeCache(tmp_path / "probes.json")
    for ext in (".mp4", ".webm", ".mov", ".gif"):
        path = write_video(tmp_path / f"v{ext}", 12, 48, 32, fps=8)
        src = Source(str(path), "x", True, (path.name, path.stat().st_size, path.stat().st_mtime_ns))
        p = probes(src)
        assert p == probe(src)
        assert (p.width, p.height, len(p.times)) == (48, 32, 12), ext
        assert p.frame_count(None) == 12 and p.frame_count(4) == 6  # 1.375 s at 4 fps: frames at 0, 0.25, ...
        indices = p.source_frames(1, 3, 4)
        assert indices == [2, 4, 6], ext
        frames = load_frames(src, indices)
        bars = [int(np.asarray(f.convert("L"), np.float32).mean(0).argmax()) // 4 for f in frames]
        assert bars == [2, 4, 6], (ext, bars)  # the bar of source frame k sits at column 4k
        late = load_frames(src, [7, 9, 9], p.times)  # by seeking and matching timestamps
        assert [int(np.asarray(f.convert("L"), np.float32).mean(0).argmax()) // 4 for f in late] == [7, 9, 9], ext
    probes.save()
    with monkeypatch.context() as m:
        m.setattr(recipes.media, "probe", None)  # a restart reads the saved probes, not the files
        again = ProbeCache(tmp_path / "probes.json")
        for ext in (".mp4", ".gif"):
            path = tmp_path / f"v{ext}"
            src = Source(str(path), "x", True, (path.name, path.stat().st_size, path.stat().st_mtime_ns))
            cached, fresh = again(src), probes(src)
            assert (cached.width, cached.height) == (fresh.width, fresh.height) == (48, 32)
            assert cached.times == pytest.approx(fresh.times, abs=1e-9)
    assert clip_starts(12, 5, 1, "start", 0, "a") == [0]
    assert clip_starts(12, 5, 1, "center", 0, "a") == [3]
    assert clip_starts(12, 5, 2, "center", 0, "a") == [1, 6]
    assert clip_starts(12, 5, 5, "start", 0, "a") == [0, 5]  # only whole, non-overlapping clips
    starts = {clip_starts(12, 5, 1, "random", 0, name)[0] for name in "abcdefgh"}
    assert len(starts) > 1 and starts <= set(range(8))
    assert clip_starts(12, 5, 1, "random", 0, "a") == clip_starts(12, 5, 1, "random", 0, "a")  # seeded


# -- buckets -----------------------------------------------------------------------------------------


def test_buckets_nearest_merge_and_drop_and_the_token_check():
    from recipes.buckets import Bucket, bucket_table, make_buckets, nearest, resolutions, settle_small_buckets

    sizes = resolutions(32 * 32, [1.0, 2.0, "1:2"], 4)
    assert sizes == [(32, 32), (24, 44), (44, 24)]
    buckets = make_buckets(sizes, [5, 9])
    assert nearest(buckets, 64, 30, 12) == Bucket(9, 24, 44)  # most frames, nearest aspect ratio
    assert nearest(buckets, 64, 30, 7) == Bucket(5, 24, 44)
    assert nearest(buckets, 64, 30, 4) is None
    samples = [{"bucket": Bucket(1, 32, 32), "aspect": 1.0, "available": 1, "name": f"s{i}"} for i in range(4)]
    samples.append({"bucket": Bucket(1, 24, 44), "aspect": 1.9, "available": 1, "name": "odd"})
    with pytest.warns(UserWarning, match=r"44x24 \(1\); 1 samples merged into the nearest larger bucket, 0 dropped"):
        merged = settle_small_buckets(samples, 2, "merge")
    assert [s["bucket"] for s in merged] == [Bucket(1, 32, 32)] * 5
    with pytest.warns(UserWarning, match="0 samples merged .* 1 dropped"):
        assert len(settle_small_buckets(samples, 2, "drop")) == 4
    rows = bucket_table(merged, 2, 2, lambda b: (b.height * b.width // 16, 32))
    assert rows == [
        {
            "bucket": "32x32",
            "frames": 1,
            "height": 32,
            "width": 32,
            "samples": 5,
            "batches": 2,
            "tokens_per_sample": 96,
            "tokens_per_cp_rank": 48,
        }
    ]
    with pytest.raises(ValueError, match=r"bucket 32x32 \(s0 and 4 more\) has 1 tokens, fewer than cp=2"):
        bucket_table(merged, 2, 2, lambda b: (1, 0))


def test_the_memory_estimate_counts_weights_optimizer_state_and_activations():
    from recipes.buckets import memory_estimate_gib

    base = {"params": 2**30, "trainable": 0, "weight_bytes": 2, "hidden": 1024, "layers": 10, "batch": 1}
    assert memory_estimate_gib(**base, tokens=0, checkpointing=False) == 2.0  # 1 Gi bf16 weights
    assert memory_estimate_gib(**base | {"trainable": 2**26}, tokens=0, checkpointing=False) == 3.0  # + 16 B each
    full = memory_estimate_gib(**base, tokens=2**14, checkpointing=False) - 2.0
    assert full == pytest.approx(10 * 34 * 1024 * 2**14 / 2**30)  # 34 bytes x hidden per token and layer
    recomputed = memory_estimate_gib(**base, tokens=2**14, checkpointing=True) - 2.0
    assert recomputed == pytest.approx((10 * 2 * 1024 * 2**14 + 34 * 1024 * 2**14) / 2**30) and recomputed < full


def test_batches_hold_one_bucket_cp_peers_agree_and_dp_ranks_differ():
    from recipes.buckets import BucketBatchSampler

    buckets = [i % 3 for i in range(30)]
    for dp in (1, 2, 3):
        ranks = [list(BucketBatchSampler(buckets, 4, num_replicas=dp, rank=r, seed=5)) for r in range(dp)]
        peer = list(BucketBatchSampler(buckets, 4, num_replicas=dp, rank=0, seed=5))  # a CP peer of rank 0
        assert peer == ranks[0]
        assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) == 6 // dp  # 3 buckets x 2 full batches
        seen = [i for r in ranks for batch in r for i, _ in batch]
        assert len(seen) == len(set(seen))  # dp ranks get different samples
        for r in ranks:
            for batch in r:
                assert len(batch) == 4 and len({buckets[i] for i, _ in batch}) == 1
    sampler = BucketBatchSampler(buckets, 4, seed=5)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first and all(epoch == 1 for batch in sampler for _, epoch in batch)


# -- the cache and caption dropout ------------------------------------------------------------------


def _data(folder, cache, **kwargs):
    from recipes.data import FluxData

    data = FluxData(data_dir=str(folder), cache_dir=str(cache), batch_size=2, aspect_ratios=[1.0, 2.0], **kwargs)
    data.prepare_data()
    data.setup("fit")
    return data


def entries(cache: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (cache / "encoded" / "flux").iterdir()}


def test_editing_a_caption_reencodes_that_sample_and_an_interrupt_leaves_no_partial_cache(tmp_path, monkeypatch):
    import recipes.cache

    folder, cache = image_folder(tmp_path / "d", squares=4, wide=4), tmp_path / "cache"
    # an interrupted encode: the third entry's write dies half-way
    real, calls = recipes.cache.save_file, []

    def dying(tensors, path):
        calls.append(path)
        if len(calls) == 3:
            Path(path).write_bytes(b"half an entry")
            raise KeyboardInterrupt
        real(tensors, path)

    with monkeypatch.context() as m:
        m.setattr(recipes.cache, "save_file", dying)
        with pytest.raises(KeyboardInterrupt):
            _data(folder, cache)
    left = sorted(n for n in entries(cache) if n != "probes.json")  # probes: the files' sizes and frame times
    assert len(left) == 2 and all(n.endswith(".safetensors") and not n.startswith(".") for n in left), left
    data = _data(folder, cache)  # a rerun encodes the rest
    first = entries(cache)
    shares = [recipes.cache.todo(data.plan(), tmp_path / "nothing", r, 3) for r in range(3)]
    assert sorted(s["key"] for share in shares for s in share) == sorted(s["key"] for s in data.plan())
    assert len(data.dataset) == 8 and len([n for n in first if n.startswith("index-")]) == 1
    assert {tuple(b) for b in data.dataset.buckets} == {(1, 32, 32), (1, 24, 44)}
    assert [r["bucket"] for r in data.table] == ["44x24", "32x32"]  # sorted by (frames, height, width)

    (folder / "sq1.txt").write_text("an edited caption")
    data = _data(folder, cache)
    after = entries(cache)
    new = [n for n in after if n not in first]
    assert len(new) == 2 and sum(n.startswith("index-") for n in new) == 1  # one sample and its index
    assert all(after[n] == first[n] for n in first)  # nothing else rewritten
    _data(folder, cache)
    assert entries(cache) == after  # an unchanged rerun encodes nothing
    png, ns = folder / "sq0.png", (folder / "sq0.png").stat().st_mtime_ns
    os.utime(png, ns=(ns, ns + 10**9))  # touched, not changed: a new mtime is a new version by default
    _data(folder, cache)
    assert len([n for n in entries(cache) if n not in after and n != "probes.json"]) == 2
    _data(folder, cache, fingerprint="content")
    hashed = entries(cache)
    os.utime(png, ns=(ns, ns + 2 * 10**9))
    _data(folder, cache, fingerprint="content")
    assert entries(cache) == hashed  # by content, a touch re-encodes nothing

    data = _data(folder, cache)
    dropout = _data(folder, cache, caption_dropout=0.5, seed=3).dataset
    empty = dropout[(0, 0)] if dropout.dropped(0, 0) else None
    flags = [dropout.dropped(i, e) for i in range(8) for e in range(8)]
    assert 0.25 < sum(flags) / len(flags) < 0.75
    for i in range(8):
        item, plain = dropout[(i, 2)], data.dataset[i]
        same = torch.equal(item["prompt_embeds"], plain["prompt_embeds"])
        assert same != dropout.dropped(i, 2), i
        assert torch.equal(item["latents"], plain["latents"])
    if empty is not None:
        assert empty["prompt_embeds"].shape == data.dataset[0]["prompt_embeds"].shape


def test_image_dir_is_a_deprecated_alias_and_bad_options_are_errors(tmp_path):
    from recipes.data import FluxData, WanData

    with pytest.warns(FutureWarning, match="image_dir is deprecated: use data.data_dir"):
        assert FluxData(image_dir="x").data_dir == "x"
    with pytest.raises(ValueError, match="differ"):
        FluxData(data_dir="x", image_dir="y")
    with pytest.raises(ValueError, match="crop must be"):
        FluxData(crop="stretch")
    with pytest.raises(ValueError, match="clip_position must be"):
        WanData(clip_position="end")
    folder = tmp_path / "v"
    folder.mkdir()
    write_video(folder / "short.mp4", 3, 32, 32)
    (folder / "short.txt").write_text("too short")
    data = WanData(data_dir=str(folder), cache_dir=str(tmp_path / "cache"), num_frames=5)
    data.prepare_data()
    with pytest.raises(ValueError, match=r"short\.mp4 has 3 frames, fewer than the shortest clip \(5 frames\)"):
        data.plan()
    skip = WanData(data_dir=str(folder), cache_dir=str(tmp_path / "cache"), num_frames=5, skip_short_clips=True)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(ValueError, match="no sample"):
        warnings.simplefilter("always")
        skip.plan()
    assert any("skipped (skip_short_clips=true)" in str(w.message) for w in seen)
    tiny = WanData(data_dir=str(folder), cache_dir=str(tmp_path / "cache"), num_frames=1, resolution=4, batch_size=1)
    with pytest.raises(ValueError, match=r"bucket 4x4 .* has 1 tokens, fewer than cp=2"):
        tiny.plan(cp=2)


# -- both recipes at cp=2 on real files --------------------------------------------------------------


class RecordBatches(L.Callback):
    """Writes each rank's (dp rank, step, sample indices, latent shape) to ``batches-<rank>.json``."""

    def __init__(self, out_dir: str):
        self.out_dir, self.rows = Path(out_dir), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        dp = getattr(trainer.strategy, "dp_rank", 0)
        self.rows.append([dp, trainer.global_step, batch["index"].tolist(), list(batch["latents"].shape)])

    def on_train_end(self, trainer, pl_module):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"batches-{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def run(tmp_path: Path, recipe: str, *overrides: str) -> str:
    """The recipe's tiny config with its batches recorded (``RecordBatches``), on pool workers; returns what its
    ranks printed."""
    from tests.test_recipes import log_of, run_recipe

    out = tmp_path / f"run_{recipe}"
    record = json.dumps([{"class_path": "tests.test_recipe_data.RecordBatches", "init_args": {"out_dir": str(out)}}])
    extra = ["--trainer.callbacks+=" + record] if "--data.dry_run=true" not in overrides else []
    run_recipe(tmp_path, out.name, *overrides, *extra, recipe=recipe)
    return log_of(out).read_text()


def trained(out: Path) -> list[list]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("batches-*.json"))]


def table(out: Path) -> list[dict]:
    with (out / "buckets.csv").open() as f:
        return list(csv.DictReader(f))


def test_flux_trains_two_image_buckets_at_dp2_cp2(tmp_path):
    folder = image_folder(tmp_path / "images")
    result = run(
        tmp_path,
        "flux",
        f"--data.data_dir={folder}",
        "--data.aspect_ratios=[1.0, 2.0]",
        "--data.batch_size=2",
        "--data.caption_dropout=0.5",  # drawn per sample: CP peers must agree (the consistency check)
        "--trainer.devices=4",
        "--trainer.max_steps=4",
    )
    out = tmp_path / "run_flux"
    assert "encoding (rank 0 of 4)" in result  # every rank encodes a share; rank 0 shows the bar
    assert [(r["bucket"], r["samples"], r["batches"]) for r in table(out)] == [("44x24", "8", "4"), ("32x32", "8", "4")]
    ranks = trained(out)  # global ranks 0..3: (dp 0: 0, 1), (dp 1: 2, 3)
    assert len(ranks) == 4 and ranks[0] == ranks[1] and ranks[2] == ranks[3]  # CP peers: the same batches
    assert [r[0] for r in ranks[0]] == [0] * 4 and [r[0] for r in ranks[2]] == [1] * 4
    assert not {i for row in ranks[0] for i in row[2]} & {i for row in ranks[2] for i in row[2]}  # dp ranks differ
    shapes = {tuple(row[3][2:]) for r in ranks for row in r}
    assert shapes == {(16, 16), (12, 22)}  # both buckets trained (latents are 1/2 the pixels)


def test_wan_trains_two_video_buckets_from_mp4_and_webm_and_dry_runs(tmp_path):
    folder = tmp_path / "videos"
    folder.mkdir()
    for i in range(4):
        write_video(folder / f"long{i}.mp4", 11, 32, 32)
        (folder / f"long{i}.txt").write_text(f"a long square clip {i}")
        write_video(folder / f"wide{i}.webm", 6, 64, 32)
    (folder / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": f"wide{i}.webm", "text": "wide"}) + "\n" for i in range(4))
    )
    args = [f"--data.data_dir={folder}", "--data.aspect_ratios=[1.0, 2.0]", "--data.frame_buckets=[5, 9]"]
    args += ["--data.num_frames=9", "--data.batch_size=2", "--data.clip_position=center"]
    dry = run(tmp_path, "wan", *args, "--data.dry_run=true")
    out = tmp_path / "run_wan"
    assert "est_gib_per_gpu" in dry and "44x24x5f" in dry and "32x32x9f" in dry
    assert not (out / "loss.csv").exists() and not list((tmp_path / "cache").glob("encoded/wan/*.safetensors"))
    estimate = {r["bucket"]: float(r["est_gib_per_gpu"]) for r in table(out)}
    assert 0 < estimate["44x24x5f"] < estimate["32x32x9f"]  # 165 < 288 tokens per CP rank
    run(tmp_path, "wan", *args, "--trainer.max_steps=4")
    rows = {r["bucket"]: r for r in table(out)}
    assert set(rows) == {"32x32x9f", "44x24x5f"} and rows["32x32x9f"]["tokens_per_cp_rank"] == "288"
    ranks = trained(out)
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    assert {tuple(row[3][2:]) for row in ranks[0]} == {(9, 16, 16), (5, 12, 22)}


def test_a_saved_dataset_is_read_like_a_folder(tmp_path):
    import datasets

    from recipes.media import find_sources, load_frames, probe

    images = [Image.new("RGB", (16, 8), colour) for colour in ("red", "blue")]
    datasets.Dataset.from_dict({"image": images, "text": ["a red square", "a blue square"]}).save_to_disk(
        str(tmp_path / "saved")
    )
    sources = find_sources(tmp_path / "saved")
    assert [s.caption for s in sources] == ["a red square", "a blue square"]
    assert (probe(sources[1]).width, probe(sources[1]).height) == (16, 8)
    assert load_frames(sources[1], [0])[0].getpixel((0, 0)) == (0, 0, 255)
    datasets.Dataset.from_dict({"image": images, "text": ["a red square", ""]}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=r"item 1 of the dataset .* has no caption"):
        find_sources(tmp_path / "bad")
    assert [s.caption for s in find_sources(tmp_path / "bad", allow_empty_captions=True)] == ["a red square", ""]


def test_long_videos_give_several_clips_and_fps_resamples_them(tmp_path):
    from recipes.data import WanData

    folder = tmp_path / "v"
    folder.mkdir()
    write_video(folder / "long.mp4", 11, 32, 32, fps=8)
    (folder / "long.txt").write_text("a long clip")
    common = {"data_dir": str(folder), "cache_dir": str(tmp_path / "cache"), "num_frames": 5, "batch_size": 1}
    data = WanData(**common, clips_per_video=3, clip_position="center")
    data.prepare_data()
    clips = data.plan()
    assert [s["frames"] for s in clips] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # two whole clips fit in 11
    assert len({s["key"] for s in clips}) == 2 and data.table[0]["samples"] == 2
    resampled = WanData(**common, fps=4).plan()  # 1.25 s at 4 fps: 6 frames, every other source frame
    assert [s["frames"] for s in resampled] == [[0, 2, 4, 6, 8]]
    assert resampled[0]["key"] not in {s["key"] for s in clips}


def test_the_model_fingerprint_follows_the_encoders_not_the_transformer(tmp_path):
    from recipes.cache import model_fingerprint

    for name in ("vae", "text_encoder", "transformer"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"a": 1}')
        (tmp_path / name / "weights.safetensors").write_bytes(b"0000")
    before = model_fingerprint(str(tmp_path))
    (tmp_path / "transformer" / "config.json").write_text('{"a": 2}')  # a fine-tuned transformer: same latents
    assert model_fingerprint(str(tmp_path)) == before
    (tmp_path / "vae" / "config.json").write_text('{"a": 2}')
    changed = model_fingerprint(str(tmp_path))
    assert changed != before
    (tmp_path / "text_encoder" / "weights.safetensors").write_bytes(b"00000")
    assert model_fingerprint(str(tmp_path)) != changed
    assert model_fingerprint("owner/model") != model_fingerprint("owner/other")

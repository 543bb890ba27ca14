"""Dynamic CP against fixed cp on a mixed image/video workload: samples per second, world 4, cp=4.

    python benchmarks/dynamic_cp.py --image-tokens 256 --video-tokens 4096 --videos 2 --images-per-video 8

Each configuration trains the narrow Flux-architecture transformer of benchmarks/common.py (DDP over the
world with cp_lightning's gradient hook, SGD) on the same workload, all in one group of 4 CPU processes with
their rounds interleaved: ``--rounds`` timed rounds (after one warm-up round) of ``--videos`` videos and
``images-per-video`` times as many images (the same samples in every configuration), in a fixed interleaved
order. Rows:

- **fixed cp, fixed batch**: cp=4 (one CP group); every step one sample, images too;
- **fixed cp, per-bucket batch**: cp=4; an image step holds ``video tokens / image tokens`` images (capped by
  ``--max-batch``), the per-bucket batch of ``data.batch_size: auto`` (equal tokens per CP rank);
- **dynamic CP**: ``dynamic_cp`` with ``min_tokens_per_rank`` = the image tokens: images at degree 1 (each of
  the 4 ranks one image per step), videos at degree 4; the degree agreed and the loss weighted per step
  (cp_lightning.dynamic).
- **dynamic CP, per-bucket batch**: the same, with image batches that give each rank a video's tokens per rank.

Samples per second = samples trained / the summed wall time of the timed steps (each step starts after a
barrier; the slowest rank's time counts). "video step" is the median wall time of a video step: the figure
that shows what the per-step agreement (one small all-gather) and the rebinding cost where nothing else changes;
"degree agreement" times that part alone (:meth:`DynamicCP.begin`, the slowest rank's median per step), and a
last A/B alternates video steps with and without it, step by step, where the load drifts least between them.
CPU wall times on a shared machine are noisy: each configuration reports its medians over rounds, and the
rounds of the configurations alternate, in an order that rotates every round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

WORLD, CP = 4, 4
CONFIGS = ("fixed cp, fixed batch", "fixed cp, per-bucket batch", "dynamic CP", "dynamic CP, per-bucket batch")


def _schedule(args, config: str) -> list[tuple[str, int, int]]:
    """One round's steps: (kind, tokens, samples per data rank); images interleaved with the videos."""
    dynamic = config.startswith("dynamic")
    ranks = WORLD if dynamic else 1  # data ranks taking different images at once
    per_rank = args.video_tokens // (CP if dynamic else 1) // args.image_tokens
    batch = max(1, min(args.max_batch, per_rank)) if "per-bucket" in config else 1
    images = args.videos * args.images_per_video
    if images % (ranks * batch):
        raise ValueError(
            f"{images} images per round do not fill steps of {ranks} x {batch}: use --videos x --images-per-video "
            "a multiple of the world times the batch, so that every configuration trains the same samples."
        )
    image_steps = images // (ranks * batch)
    steps, video_steps = [], args.videos
    for k in range(max(image_steps, video_steps)):
        if k < video_steps:
            steps.append(("video", args.video_tokens, 1))
        if k < image_steps:
            steps.append(("image", args.image_tokens, batch))
    return steps


def _worker(rank: int, world: int, args) -> dict:
    """Every configuration in one group, their rounds interleaved (so a shared machine's load drifts over all of
    them alike): at cp=4 on 4 ranks dp is 1, so the fixed-cp DDP hook (divide by dp) is dynamic CP's (by 1) and
    one wrapped model serves both; fixed-cp rounds run at the full group (never switched)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from cp_lightning import build_mesh, data_parallel, parallelize
    from cp_lightning.dynamic import DynamicCP, DynamicStep

    dev = common.device()
    model = common.build_model(layers=args.layers, heads=args.heads, head_dim=args.head_dim).to(dev)
    mesh = build_mesh(CP)
    parallelize(model, mesh=mesh)
    controller = DynamicCP(mesh, [model], min_tokens_per_rank=args.image_tokens)
    ddp = DistributedDataParallel(model)
    data_parallel.register_ddp_hook(ddp, 1, False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    schedules = {config: _schedule(args, config) for config in CONFIGS}
    inputs = {}
    for _, tokens, batch in {step for steps in schedules.values() for step in steps}:
        base = common.make_inputs(model, tokens=tokens, text_tokens=args.text_tokens, device=dev)
        for key in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"):
            base[key] = base[key].expand(batch, *base[key].shape[1:]).contiguous()
        inputs[(tokens, batch)] = base
    rounds = {config: [] for config in CONFIGS}
    for r in range(args.rounds + 1):
        for k in range(len(CONFIGS)):  # the order rotates each round: no configuration always runs after another
            config = CONFIGS[(k + r) % len(CONFIGS)]
            dynamic, times = config.startswith("dynamic"), []
            controller.bind(CP)
            for _, tokens, batch in schedules[config]:
                dist.barrier()
                start = time.perf_counter()
                factor = controller.begin(DynamicStep(tokens, batch)) if dynamic else 1.0
                agreed = time.perf_counter()
                out = ddp(**inputs[(tokens, batch)], return_dict=False)[0]
                (out.float().square().mean() * factor).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                times.append((time.perf_counter() - start, agreed - start))
            if r:  # round 0 warms up
                rounds[config].append(times)
    # the video step alone, A/B: fixed cp and dynamic CP alternate, step by step (the same work but the agreement)
    video, ab = inputs[(args.video_tokens, 1)], {"fixed cp": [], "dynamic CP": []}
    for k in range(2 * args.ab_repeats):
        dynamic = k % 2 == 1
        controller.bind(CP)
        dist.barrier()
        start = time.perf_counter()
        if dynamic:
            controller.begin(DynamicStep(args.video_tokens, 1))
        ddp(**video, return_dict=False)[0].float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ab["dynamic CP" if dynamic else "fixed cp"].append(time.perf_counter() - start)
    return {"rounds": rounds, "schedules": schedules, "ab": ab}


def run(args) -> list[dict]:
    for config in CONFIGS:  # before any process starts
        _schedule(args, config)
    results = common.launch(_worker, WORLD, args, timeout=args.timeout)
    ab = {
        name: statistics.median(max(res["ab"][name][k] for res in results) for k in range(args.ab_repeats))
        for name in ("fixed cp", "dynamic CP")
    }
    rows = []
    for config in CONFIGS:
        steps = results[0]["schedules"][config]
        per_round, video, image, agree = [], [], [], []
        dynamic = config.startswith("dynamic")
        for r in range(args.rounds):
            # the slowest rank's time of each step (they start together after a barrier)
            walls = [max(res["rounds"][config][r][k][0] for res in results) for k in range(len(steps))]
            agree += [max(res["rounds"][config][r][k][1] for res in results) for k in range(len(steps))]
            per_round.append(sum(walls))
            for (kind, _, batch), wall in zip(steps, walls, strict=True):
                if kind == "video":
                    video.append(wall)
                else:  # seconds per image: the step's images are batch per data rank, on 4 data ranks if dynamic
                    image.append(wall / (batch * (WORLD if dynamic else 1)))
        samples = sum(b * (WORLD if dynamic and kind == "image" else 1) for kind, _, b in steps)
        rows.append(
            {
                "config": config,
                "samples": samples,
                "seconds": statistics.median(per_round),
                "samples_per_s": samples / statistics.median(per_round),
                "video_step": statistics.median(video),
                "image_s": statistics.median(image),
                "agree_ms": 1e3 * statistics.median(agree),
                "image_batch": next(b for kind, _, b in steps if kind == "image"),
            }
        )
    rows.append({"config": "video A/B", **ab})
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image-tokens", type=int, default=256)
    parser.add_argument("--video-tokens", type=int, default=4096)
    parser.add_argument("--videos", type=int, default=2, help="videos per round")
    parser.add_argument("--images-per-video", type=int, default=8, help="at least 1: half the samples short or more")
    parser.add_argument("--max-batch", type=int, default=16, help="cap of the per-bucket image batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ab-repeats", type=int, default=6, help="video steps of each kind in the A/B")
    common.add_model_args(parser, timing=False)
    parser.set_defaults(text_tokens=32)
    args = parser.parse_args(argv)
    if args.images_per_video < 1:
        raise ValueError("--images-per-video must be >= 1 (the workload is at least half short samples).")
    rows = run(args)
    ab = rows.pop()
    base = rows[0]["samples_per_s"]
    fixed_video = rows[0]["video_step"]
    print(
        f"world {WORLD}, cp={CP}; {args.videos} videos of {args.video_tokens} tokens and "
        f"{args.videos * args.images_per_video} images of {args.image_tokens} tokens per round, text "
        f"{args.text_tokens}; {args.layers} + {args.layers} blocks, {args.heads} heads x {args.head_dim}; "
        f"{common.machine_line(common.device())}; medians of {args.rounds} rounds\n"
    )
    print(
        common.table(
            [
                "configuration",
                "image batch",
                "samples/s",
                "vs fixed cp, fixed batch",
                "s per image",
                "video step (s)",
                "vs fixed cp",
                "degree agreement (ms)",
            ],
            [
                [
                    r["config"],
                    r["image_batch"],
                    f"{r['samples_per_s']:.2f}",
                    f"{r['samples_per_s'] / base:.2f}x",
                    f"{r['image_s']:.4f}",
                    f"{r['video_step']:.3f}",
                    f"{r['video_step'] / fixed_video:.3f}",
                    f"{r['agree_ms']:.2f}" if r["config"].startswith("dynamic") else "-",
                ]
                for r in rows
            ],
        )
    )
    print(
        f"\nvideo step A/B ({args.ab_repeats} of each, alternating): fixed cp {ab['fixed cp']:.3f} s, dynamic CP "
        f"{ab['dynamic CP']:.3f} s ({ab['dynamic CP'] / ab['fixed cp']:.3f}x)"
    )
    rows.append(ab)
    return rows


if __name__ == "__main__":
    main()

"""The layout planner's tables for docs/planning.md: what fits where, and its errors against published figures.

``PYTHONPATH=. python benchmarks/planner_tables.py`` prints, as Markdown, (1) the planner's predictions next
to the published per-GPU figures of DESIGN section 8.3 with the relative error, and (2) "what fits where":
for Wan2.1-14B, Wan2.2 A14B (one expert), HunyuanVideo and FLUX.1-dev, LoRA (rank 32) and full fine-tune, at
common resolutions and frame counts, on 8x H100 80 GB, 8x H200 141 GB (NVLink) and 4x 24 GB GPUs (PCIe), the layout the
planner chooses (fastest predicted per sample among those that fit) and its GiB per GPU. Everything is
predicted on the meta device: no GPU, no weights.
"""

from __future__ import annotations

import argparse

from cp_lightning.planner import Hardware, Layout, Training, estimate, resolve_model, search
from cp_lightning.planner.traffic import H100_TFLOPS, NVLINK_H100_GBPS, PCIE4_GBPS, RTX4090_TFLOPS

GIB = 2**30
# (GPUs, usable memory per GPU in GiB, link inside the node in GB/s, effective TFLOP/s): the devices report 79.2
# GiB for an H100 80 GB, 139.8 for an H200, ~23.6 for 24 GB; the 24 GB cards sit on PCIe 4.0 without NVLink
# (cp_lightning/planner/traffic.py; benchmarks/consumer_presets.py has the consumer presets' own table)
HARDWARE = {
    "8x H100 80 GB": (8, 79.0, NVLINK_H100_GBPS, H100_TFLOPS),
    "8x H200 141 GB": (8, 139.0, NVLINK_H100_GBPS, H100_TFLOPS),
    "4x 24 GB PCIe": (4, 23.5, PCIE4_GBPS, RTX4090_TFLOPS),
}


def _video_tokens(frames: int, height: int, width: int) -> int:
    """Wan's and HunyuanVideo's VAEs: 4x temporal (first frame kept), 8x spatial; 2x2 patches."""
    return ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)


SHAPES = {
    "wan2.1-t2v-14b": [(81, 480, 832), (81, 720, 1280), (121, 720, 1280)],
    "wan2.2-t2v-a14b": [(81, 480, 832), (81, 720, 1280)],
    "hunyuanvideo": [(129, 544, 960), (129, 720, 1280)],
    "flux.1-dev": [(1, 1024, 1024), (1, 2048, 2048)],
}


def _gib(e) -> str:
    return f"{e.gib_per_gpu:.1f}"


def published() -> str:
    """Predicted against published per-GPU figures (DESIGN 8.3), relative error = predicted / published - 1."""
    rows = []

    def est(name, layout, gpus, training, tokens, text=None):
        return estimate(resolve_model(name), layout, Hardware(gpus=gpus, gpu_memory_gib=1e3), training, tokens, text)

    full = Training(lora_rank=0)
    # NeMo's figure is its recipe's `mem`: torch.cuda.max_memory_allocated / 2**30, the allocator's peak
    nemo = [(Layout(8, 1, fsdp="full"), 54.9), (Layout(2, 4, fsdp="full"), 16.3)]
    for layout, figure in nemo:
        e = est("wan2.1-t2v-1.3b", layout, 8, full, 16384)
        what = "NeMo AutoModel Wan2.1-1.3B, 16,384 tokens, FSDP2, no ckpt (allocator peak)"
        rows.append((what, layout.describe(), figure, e.allocated / GIB))
    ema = Training(lora_rank=0, ema=True)
    fast = [
        (Layout(1, 4, fsdp="full", checkpointing=True), 4, 74.8),
        (Layout(2, 4, fsdp="full", checkpointing=True), 8, 47.1),
    ]
    for layout, gpus, figure in fast:  # memory in use on the device: the planner's total
        e = est("hunyuanvideo", layout, gpus, ema, 38000)
        what = "FastVideo HunyuanVideo full FT, ~38k tokens, sp=4, ckpt, EMA (device total)"
        rows.append((what, layout.describe(), figure, e.gib_per_gpu))
    lines = ["| figure | layout | published GB | predicted GiB | error |", "|---|---|---|---|---|"]
    for what, layout, figure, gib in rows:
        lines.append(f"| {what} | {layout} | {figure} | {gib:.1f} | {gib / figure - 1:+.0%} |")
    drop = (rows[2][3] - rows[3][3], 74.8 - 47.1)
    lines.append(f"| FastVideo 4 -> 8 GPU drop | | {drop[1]:.1f} | {drop[0]:.1f} | {drop[0] / drop[1] - 1:+.0%} |")
    ratio = (rows[0][3] / rows[1][3], 54.9 / 16.3)
    lines.append(f"| NeMo dp8xcp1 / dp2xcp4 | | {ratio[1]:.2f} | {ratio[0]:.2f} | {ratio[0] / ratio[1] - 1:+.0%} |")
    wan = resolve_model("wan2.1-t2v-14b")
    for memory in (80, 141):
        ests = search(wan, Hardware(gpus=8, gpu_memory_gib=memory), full, [_video_tokens(81, 512, 512)], fsdp="off")
        best = min(ests, key=lambda e: e.total)
        verdict = "fits (wrong)" if any(e.fits for e in ests) else "refused (right)"
        lines.append(
            f"| FastVideo Wan2.1-14B full FT replicated, 512x512x81, {memory} GB: OOM | {best.layout.describe()} "
            f"| OOM | {_gib(best)} | {verdict} |"
        )
    return "\n".join(lines)


def fits_where(model: str, lora_rank: int) -> str:
    spec = resolve_model(model)
    training = Training(lora_rank=lora_rank)
    head = "| sample | tokens | " + " | ".join(HARDWARE) + " |"
    lines = [head, "|---|---|" + "---|" * len(HARDWARE)]
    for frames, height, width in SHAPES[model]:
        tokens = _video_tokens(frames, height, width) if frames > 1 else (height // 16) * (width // 16)
        cells = []
        for gpus, memory, gbps, tflops in HARDWARE.values():
            hw = Hardware(gpus=gpus, gpu_memory_gib=memory, intra_node_gbps=gbps, tflops=tflops)
            ests = search(spec, hw, training, [tokens])
            e = ests[0]
            cells.append(
                f"{e.layout.describe()}: {_gib(e)} GiB"
                if e.fits
                else f"no (leanest {min(x.total for x in ests) / GIB:.0f} GiB)"
            )
        sample = f"{width}x{height}" + (f"x{frames}" if frames > 1 else "")
        lines.append(f"| {sample} | {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(SHAPES))
    a = p.parse_args(argv)
    print("### Against published figures\n")
    print(published())
    for model in a.models:
        for rank, what in ((32, "LoRA rank 32"), (0, "full fine-tune")):
            print(f"\n### {model}, {what}\n")
            print(fits_where(model, rank))


if __name__ == "__main__":
    main()

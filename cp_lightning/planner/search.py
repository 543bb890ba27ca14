"""Layouts the hardware can hold, checked and ranked: the planner's search.

:func:`check_layout` refuses what cannot run (dp x cp not the GPU count, cp not dividing the GPUs of a node,
ring not dividing cp, Ulysses degree not dividing the heads, a bucket with fewer tokens than cp) with a
ValueError saying how to fix it. :func:`search` evaluates every valid layout over cp, ring, DDP/FSDP/HSDP,
checkpointing, activation offload and an fp8 frozen base, at the largest bucket, and ranks the layouts that
fit by predicted time per sample.
"""

from __future__ import annotations

from dataclasses import replace

from cp_lightning.planner.architectures import ModelSpec
from cp_lightning.planner.memory import GIB, Estimate, Hardware, Layout, Training, estimate
from cp_lightning.planner.traffic import link_gbps

MODES = ("auto", "on", "off")


def check_hardware(hw: Hardware) -> None:
    if hw.gpus < 1 or hw.nodes < 1:
        raise ValueError(f"--gpus and --nodes must be positive, got {hw.gpus} and {hw.nodes}.")
    if hw.gpus % hw.nodes:
        raise ValueError(f"--gpus {hw.gpus} does not divide into --nodes {hw.nodes} equal nodes: give the total GPUs.")
    fixed = hw.cuda_context_gib + hw.comm_buffers_gib
    if hw.gpu_memory_gib <= fixed:
        raise ValueError(
            f"--gpu-memory {hw.gpu_memory_gib} GiB is not above the fixed overhead per GPU ({fixed} GiB: CUDA context "
            "+ communication buffers): give the GPU's memory in GiB, e.g. 80."
        )
    for what, gbps in (("--interconnect", hw.intra_node_gbps), ("the inter-node link", hw.inter_node_gbps)):
        link_gbps(gbps, what=what)  # a ValueError unless a positive number of GB/s
    if not hw.tflops > 0:
        raise ValueError(f"--tflops must be a positive TFLOP/s figure per GPU, got {hw.tflops}.")


def check_layout(spec: ModelSpec, layout: Layout, hw: Hardware, tokens: list[int]) -> None:
    """A ValueError naming the fix when ``layout`` cannot run on ``hw`` for ``spec``."""
    if min(layout.dp, layout.cp, layout.ring, layout.batch) < 1:
        raise ValueError(f"dp, cp, ring and batch must be positive, got {layout}.")
    if layout.dp * layout.cp != hw.gpus:
        raise ValueError(
            f"--dp {layout.dp} x --cp {layout.cp} = {layout.dp * layout.cp} does not match --gpus {hw.gpus}: "
            f"use dp = {hw.gpus} / cp."
        )
    if hw.per_node % layout.cp:
        raise ValueError(
            f"cp={layout.cp} does not divide the {hw.per_node} GPUs per node, so a CP group would span nodes: "
            f"use a cp dividing {hw.per_node}."
        )
    if layout.cp % layout.ring:
        raise ValueError(f"ring={layout.ring} must divide cp={layout.cp} (cp = ring x Ulysses degree).")
    if spec.heads % layout.ulysses:
        raise ValueError(
            f"{spec.name} has {spec.heads} heads, which the Ulysses degree cp/ring = {layout.ulysses} does not "
            f"divide: use a ring degree r with {spec.heads} % (cp / r) == 0."
        )
    if layout.fsdp == "hsdp" and layout.dp == 1:
        raise ValueError("HSDP shards inside each CP group and replicates across dp: it needs dp > 1; use FSDP.")
    for t in tokens:
        if t < layout.cp:
            raise ValueError(f"a sample of {t} tokens cannot be split over cp={layout.cp}: lower cp.")


def candidates(spec: ModelSpec, hw: Hardware, training: Training, *, fsdp: str, checkpointing: str, base_dtype):
    """Every layout the options allow (``base_dtype`` None: bf16 and fp8 for a LoRA base)."""
    for cp in [d for d in range(1, hw.per_node + 1) if hw.per_node % d == 0]:
        dp = hw.gpus // cp
        for ring in [r for r in range(1, cp + 1) if cp % r == 0 and spec.heads % (cp // r) == 0]:
            shardings = {"off": ["off"], "on": ["full", "hsdp"], "auto": ["off", "full", "hsdp"]}[fsdp]
            for sharding in shardings:
                if sharding == "hsdp" and (dp == 1 or cp == 1):
                    continue  # dp == 1: HSDP is FSDP; cp == 1: HSDP is DDP with extra steps
                for ckpt in {"off": [False], "on": [True], "auto": [False, True]}[checkpointing]:
                    for offload in [False, True] if ckpt else [False]:
                        dtypes = [base_dtype] if base_dtype else ["bfloat16"]
                        if training.lora_rank and base_dtype is None:
                            dtypes.append("float8_e4m3fn")
                        for dtype in dtypes:
                            yield Layout(dp, cp, ring, sharding, ckpt, offload, dtype)


def _cost(e: Estimate) -> tuple:
    # faster per sample first; among equals the simpler layout (no offload, no fp8, bf16 base) and less memory
    return (round(e.sample_seconds, 6), e.layout.offload, e.layout.base_dtype != "bfloat16", e.total)


def search(
    spec: ModelSpec,
    hw: Hardware,
    training: Training,
    tokens: list[int],
    *,
    batch: int = 1,
    text_tokens: int | None = None,
    fsdp: str = "auto",
    checkpointing: str = "auto",
    base_dtype: str | None = None,
    layout: Layout | None = None,
) -> list[Estimate]:
    """Estimates at the largest bucket, fitting layouts first (fastest per sample first), then the rest."""
    check_hardware(hw)
    if not tokens or min(tokens) <= 0:
        raise ValueError(f"--tokens must be positive token counts (one per bucket), got {tokens}.")
    if batch < 1:
        raise ValueError(f"--batch is the samples per dp rank, >= 1; got {batch}.")
    for name, mode in (("fsdp", fsdp), ("checkpointing", checkpointing)):
        if mode not in MODES:
            raise ValueError(f"--{name} must be one of {', '.join(MODES)}, got {mode!r}.")
    largest = max(tokens)
    if layout is not None:
        layout = replace(layout, batch=batch)
        check_layout(spec, layout, hw, tokens)
        layouts = [layout]
    else:
        layouts = [
            replace(lay, batch=batch)
            for lay in candidates(spec, hw, training, fsdp=fsdp, checkpointing=checkpointing, base_dtype=base_dtype)
            if largest >= lay.cp
        ]
    estimates = [estimate(spec, lay, hw, training, largest, text_tokens) for lay in layouts]
    fitting = sorted((e for e in estimates if e.fits), key=_cost)
    rest = sorted((e for e in estimates if not e.fits), key=lambda e: e.total)
    return fitting + rest


def smallest_cp(estimates: list[Estimate]) -> Estimate | None:
    """The fitting layout of the smallest cp (fastest among those), or None."""
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return None
    cp = min(e.layout.cp for e in fitting)
    return min((e for e in fitting if e.layout.cp == cp), key=_cost)


def nothing_fits(estimates: list[Estimate], hw: Hardware) -> str:
    best = min(estimates, key=lambda e: e.total)
    return (
        f"no layout fits {hw.gpu_memory_gib} GiB per GPU: the leanest, {best.layout.describe()}, needs "
        f"{best.total / GIB:.2f} GiB per GPU; use more or larger GPUs, LoRA, fewer tokens or a smaller batch."
    )

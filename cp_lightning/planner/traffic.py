"""The planner's traffic model: the links between GPUs, the bytes each collective sends and a relative step time.

Bandwidths are GB/s (1e9 bytes) per GPU and direction: what one GPU can send while it receives as much, the
figure a ring or pairwise all-to-all runs at. They are nominal link rates, not NCCL measurements; every layout on
the same link pays the same factor for NCCL's efficiency, so rankings on one link do not depend on it, but the
split between compute and communication does (docs/planning.md, "Interconnects").
"""

from __future__ import annotations

import math

# NVLink 4 (H100 SXM): 18 links x 25 GB/s per direction = 450 GB/s (NVIDIA's "900 GB/s" counts both directions).
NVLINK_H100_GBPS = 450.0
# PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s raw per direction; ~25 GB/s after TLP/DLLP overheads
# (what a host-to-device copy reaches). Consumer cards without peer-to-peer route GPU-to-GPU traffic through
# host memory, which can be slower still.
PCIE4_GBPS = 25.0
# PCIe 5.0 x16: twice PCIe 4.0 (63 GB/s raw per direction), ~50 GB/s effective.
PCIE5_GBPS = 50.0
# InfiniBand NDR: 400 Gb/s = 50 GB/s per direction per port, one port per GPU (DGX H100's layout).
IB_NDR_GBPS = 50.0
# Effective bf16 throughput per GPU, for relative times: the H100 SXM's 989 dense TFLOP/s at ~40%, and a 24 GB
# RTX 4090's 165 dense TFLOP/s (bf16 with fp32 accumulate, NVIDIA's Ada whitepaper) at the same ~40%. Faster
# compute makes the same bytes weigh more against it.
H100_TFLOPS = 400.0
RTX4090_TFLOPS = 66.0
INTERCONNECTS = {"nvlink": NVLINK_H100_GBPS, "pcie": PCIE4_GBPS, "pcie5": PCIE5_GBPS, "ib": IB_NDR_GBPS}


def link_gbps(value: str | float, *, what: str = "--interconnect") -> float:
    """GB/s per GPU and direction for a link name (``nvlink``, ``pcie``, ``pcie5``, ``ib``) or a positive number."""
    names = ", ".join(f"{k} ({v:g} GB/s)" for k, v in INTERCONNECTS.items())
    if isinstance(value, str) and value.strip().lower() in INTERCONNECTS:
        return INTERCONNECTS[value.strip().lower()]
    try:
        gbps = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {value!r}: give a link name, one of {names}, or GB/s per GPU, e.g. 25.") from None
    if not math.isfinite(gbps) or gbps <= 0:
        raise ValueError(f"{what} {value!r}: a bandwidth must be a positive number of GB/s per GPU, e.g. 25.")
    return gbps


def comm_bytes(layout, c, hidden_bytes: float) -> dict:
    """Bytes each GPU sends per optimizer step, per collective (``c``: the model's :class:`Counts`)."""
    out = {}
    passes = 3 if layout.checkpointing else 2  # forward, backward (+ the recomputed forward)
    u, r = layout.ulysses, layout.ring
    if u > 1:  # q, k, v, out: (u - 1) / u of each leaves the rank, once per pass
        out["all_to_all"] = c.attention_layers * 4 * 2 * hidden_bytes * (u - 1) / u * passes
    if r > 1:  # K/V blocks hop r - 1 times forward; backward K/V (bf16) + dK/dV (fp32) hop r times
        fwd = (r - 1) * 4 * hidden_bytes
        out["ring_p2p"] = c.attention_layers * (fwd * (passes - 1) + r * 12 * hidden_bytes)
    world = layout.dp * layout.cp
    frozen = c.total - c.trainable
    if layout.fsdp == "off":
        if world > 1:
            out["all_reduce"] = 2 * c.trainable * 4 * (world - 1) / world
    else:
        n = world if layout.fsdp == "full" else layout.cp
        gathered = (c.trainable * 2 + frozen * 2) * (n - 1) / n
        out["all_gather"] = 2 * gathered  # forward, and again in backward (reshard after forward)
        out["reduce_scatter"] = c.trainable * 4 * (n - 1) / n
        if layout.fsdp == "hsdp" and layout.dp > 1:
            out["all_reduce"] = 2 * c.trainable * 4 / n * (layout.dp - 1) / layout.dp
    return out


def step_time(spec, layout, hw, c, comm: dict, tokens: int, text: int, lora: int) -> dict:
    """Seconds per step, split: ``compute`` (matmuls and attention at ``hw.tflops``), ``cp`` (the all-to-alls and
    ring hops: on the critical path), ``dp`` (FSDP/DDP traffic, overlapped with the step), ``offload`` (block
    inputs to the host and back over the GPU's own host link, mostly hidden: 20% of compute), ``step`` and
    ``sample``. Only ratios between layouts
    mean anything."""
    seq = tokens + text if spec.family.joint else tokens
    passes = 3.0 if not lora else 2.0  # forward 1, backward 2 (weight and input grads) or 1 (input grads only)
    recompute = 1.0 if layout.checkpointing else 0.0
    matmul = 2 * c.linear_in_blocks * seq * (passes + recompute)
    attention = 4 * seq * seq * spec.hidden * c.attention_layers * (3.5 + recompute)  # flash backward ~2.5x
    compute = layout.batch * (matmul + attention) / layout.cp / (hw.tflops * 1e12)
    # a CP group never spans nodes (check_layout): its traffic crosses the link inside a node
    cp = (comm.get("all_to_all", 0) + comm.get("ring_p2p", 0)) / (hw.intra_node_gbps * 1e9)
    dp_group = layout.dp * layout.cp if layout.fsdp in ("full", "off") else layout.cp
    dp_gbps = hw.intra_node_gbps if dp_group <= hw.per_node else min(hw.inter_node_gbps, hw.intra_node_gbps)
    dp_bytes = sum(v for k, v in comm.items() if k in ("all_gather", "reduce_scatter", "all_reduce"))
    dp = dp_bytes / (dp_gbps * 1e9)
    offload = 0.2 * compute if layout.offload else 0.0
    step = max(compute + cp + offload, dp)
    return {"compute": compute, "cp": cp, "dp": dp, "offload": offload, "step": step,
            "sample": step / (layout.dp * layout.batch)}  # fmt: skip

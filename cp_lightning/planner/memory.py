"""The per-GPU memory model of one training layout (with its traffic and relative step time from ``traffic.py``).

M = states + FSDP in-flight + activations + CP buffers + fixed (``docs/planning.md`` derives each term):

- states: trainable weights in ``params_dtype`` with gradients in the same dtype and AdamW's two moments (16 B
  per weight in fp32), an optional EMA copy, the frozen base (LoRA) in ``base_dtype``; sharded over dp x cp
  (FSDP), over cp (HSDP) or replicated (DDP).
- FSDP in-flight: (2 + prefetch) gathered blocks in bf16 (the one in use, the prefetched one, the all-gather's
  flat output while it is copied out), the root unit's parameters and one block's unsharded fp32 gradients.
- activations: :mod:`cp_lightning.planner.trace` at tokens per CP rank; autocast's bf16 copies of fp32
  weights (DDP under bf16-mixed) are saved for backward too.
- CP buffers: Ulysses' all-to-all send/receive copies of q, k, v (transient, one layer); our P2P ring's two
  K/V blocks in flight, its fp32 output/LSE merge and the travelling fp32 dK/dV.
- fixed: CUDA context and communication buffers (stated parameters), and an allocator margin on what is
  allocated and freed every step (FSDP's gathers, activations, CP buffers): the states are allocated once and
  do not fragment the caching allocator's segments.

The bytes per collective and the relative step time over the GPUs' links are :mod:`cp_lightning.planner.traffic`.

``Estimate.allocated`` is the part ``torch.cuda.max_memory_allocated`` counts (no context, communication
buffers or margin); ``Estimate.total`` is what the device must hold.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import torch

from cp_lightning.planner.architectures import ModelSpec
from cp_lightning.planner.traffic import H100_TFLOPS, IB_NDR_GBPS, NVLINK_H100_GBPS, comm_bytes, step_time

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class Hardware:
    """The GPUs and the stated overheads (every number here is a parameter, not a measurement)."""

    gpus: int
    gpu_memory_gib: float
    nodes: int = 1
    device: str = "cuda"  # whose kernels the activations are traced with ("cpu": the CPU checks' processes)
    cuda_context_gib: float = 0.75  # CUDA context + cuBLAS/cuDNN workspaces
    comm_buffers_gib: float = 0.5  # NCCL's buffers (DDP's buckets are gradient views)
    allocator_margin: float = 0.10  # fragmentation: reserved over allocated, of the per-step allocations
    tflops: float = H100_TFLOPS  # effective bf16 throughput per GPU, for relative times only
    intra_node_gbps: float = NVLINK_H100_GBPS  # GB/s per GPU and direction inside a node (traffic.py: --interconnect)
    inter_node_gbps: float = IB_NDR_GBPS  # GB/s per GPU and direction across nodes

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes


@dataclass(frozen=True)
class Layout:
    dp: int
    cp: int
    ring: int = 1
    fsdp: str = "off"  # off | full | hsdp
    checkpointing: bool = False
    offload: bool = False  # activation offload of the checkpointed blocks' inputs to host memory
    base_dtype: str = "bfloat16"  # the frozen base under LoRA
    batch: int = 1

    @property
    def ulysses(self) -> int:
        return self.cp // self.ring

    def describe(self) -> str:
        parts = [f"dp{self.dp} x cp{self.cp}" + (f" (ring {self.ring})" if self.ring > 1 else "")]
        parts.append({"off": "DDP", "full": "FSDP", "hsdp": "HSDP"}[self.fsdp])
        if self.checkpointing:
            parts.append("ckpt" + ("+offload" if self.offload else ""))
        if self.base_dtype.startswith("float8"):
            parts.append("fp8 base")
        return ", ".join(parts)


@dataclass(frozen=True)
class Training:
    lora_rank: int = 0
    params_dtype: str = "float32"  # trainable weights (and their grads and AdamW moments)
    precision: str = "bf16-mixed"
    ema: bool = False
    prefetch: int = 1


@dataclass(frozen=True)
class Counts:
    total: int  # every parameter of the model (base + LoRA)
    trainable: int
    block_max: int  # the largest block's parameters
    block_trainable_max: int
    outside_blocks: int  # the root FSDP unit's parameters (embeddings, modulation, head)
    linear_in_blocks: int  # weights of the blocks' linear layers (the matmul FLOPs)
    attention_layers: int  # layers whose attention CP splits


@functools.lru_cache(maxsize=64)
def _counts(spec_key: str, spec: ModelSpec, lora_rank: int) -> Counts:
    from cp_lightning.planner.trace import build_meta

    model = build_meta(spec, {}, lora_rank=lora_rank, dtype=torch.bfloat16)
    if not lora_rank:
        model.requires_grad_(True)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = [b for name in spec.family.block_lists for b in getattr(model, name)]
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    block_train = [sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks]
    linear = sum(m.weight.numel() for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear))
    if lora_rank:  # the adapters' own linears are counted with their base layers' FLOPs
        linear = sum(
            m.weight.numel()
            for b in blocks
            for n, m in b.named_modules()
            if isinstance(m, torch.nn.Linear) and "lora_" not in n
        )
    return Counts(
        total=total,
        trainable=trainable,
        block_max=max(block_sizes),
        block_trainable_max=max(block_train),
        outside_blocks=total - sum(block_sizes),
        linear_in_blocks=linear,
        attention_layers=len(blocks),
    )


def counts(spec: ModelSpec, lora_rank: int) -> Counts:
    import json

    return _counts(json.dumps(spec.config, sort_keys=True), spec, lora_rank)


@functools.lru_cache(maxsize=64)
def _fit(spec_key: str, spec: ModelSpec, lora_rank: int, checkpointing: bool, text_tokens: int, dtype, device):
    from cp_lightning.planner.trace import fit_activations

    return fit_activations(spec, lora_rank=lora_rank, checkpointing=checkpointing, text_tokens=text_tokens, dtype=dtype,
                           device=device)  # fmt: skip


def activation_fit(
    spec: ModelSpec, lora_rank: int, checkpointing: bool, text_tokens: int, dtype=torch.bfloat16, device="cuda"
):
    import json

    return _fit(json.dumps(spec.config, sort_keys=True), spec, lora_rank, checkpointing, text_tokens, dtype, device)


def local_tokens(spec: ModelSpec, tokens: int, text_tokens: int, cp: int) -> int:
    """Tokens per CP rank through the blocks (joint models: image and text, each split)."""
    local = math.ceil(tokens / cp)
    return local + math.ceil(text_tokens / cp) if spec.family.joint else local


@dataclass(frozen=True)
class Estimate:
    """One layout's prediction; bytes per GPU, bytes sent per GPU and step, seconds per sample (relative)."""

    layout: Layout
    states: float
    fsdp_in_flight: float
    activations: float
    cp_buffers: float
    fixed: float
    margin: float
    comm: dict
    step_seconds: float
    sample_seconds: float
    fits: bool
    seconds: dict = field(default_factory=dict)  # step time split: compute, cp, dp, offload (traffic.step_time)

    @property
    def allocated(self) -> float:
        """The allocator's peak: what ``torch.cuda.max_memory_allocated`` reports for the step."""
        return self.states + self.fsdp_in_flight + self.activations + self.cp_buffers

    @property
    def total(self) -> float:
        return self.allocated + self.fixed + self.margin

    @property
    def gib_per_gpu(self) -> float:
        return self.total / GIB

    def as_dict(self) -> dict:
        return {
            "layout": asdict(self.layout),
            "gib_per_gpu": round(self.gib_per_gpu, 3),
            "gib_allocated": round(self.allocated / GIB, 3),
            "gib": {
                k: round(getattr(self, k) / GIB, 3)
                for k in ("states", "fsdp_in_flight", "activations", "cp_buffers", "fixed", "margin")
            },
            "bytes_per_step": {k: int(v) for k, v in self.comm.items()},
            "sample_seconds": self.sample_seconds,
            "seconds_per_step": {k: v for k, v in self.seconds.items() if k != "sample"},
            "fits": self.fits,
        }


def estimate(
    spec: ModelSpec,
    layout: Layout,
    hw: Hardware,
    training: Training,
    tokens: int,
    text_tokens: int | None = None,
) -> Estimate:
    """The prediction for ``layout`` at a sample of ``tokens`` (the split sequence) and ``text_tokens``."""
    text = spec.family.text_tokens if text_tokens is None else text_tokens
    lora = training.lora_rank
    c = counts(spec, lora)
    frozen = c.total - c.trainable
    p_bytes = BYTES[training.params_dtype]
    world = layout.dp * layout.cp
    shard = {"off": 1, "full": world, "hsdp": layout.cp}[layout.fsdp]
    # -- states
    per_trainable = p_bytes * 4 + (p_bytes if training.ema else 0)  # weight, grad, 2 AdamW moments, EMA
    states = (c.trainable * per_trainable + frozen * BYTES[layout.base_dtype]) / shard
    # -- FSDP in-flight: the gathered block in use, the prefetched one and the all-gather's flat output (FSDP2
    # copies it out into the block's parameters, so a block is held twice while it lands), in bf16; the root
    # unit's parameters, gathered through forward and backward (not resharded after forward); one block's
    # unsharded fp32 gradients before the reduce-scatter
    mixed = training.precision.startswith("bf16") or training.precision.startswith("16")
    in_flight = 0.0
    if layout.fsdp != "off":
        gathered = 2 if mixed else p_bytes  # MixedPrecisionPolicy gathers in bf16
        in_flight = (2 + training.prefetch) * c.block_max * gathered + c.outside_blocks * gathered
        in_flight += c.block_trainable_max * 4
    # -- activations (bytes per CP rank from the trace)
    # activations in the compute dtype: bf16 under bf16 precision, fp32 for 32-true
    compute = torch.float32 if training.precision.startswith("32") else torch.bfloat16
    fit = activation_fit(spec, lora, layout.checkpointing, text, compute, hw.device)
    t_local = local_tokens(spec, tokens, text, layout.cp)
    full = local_tokens(spec, tokens, text, 1) if layout.cp > 1 else None
    saved, peak = fit.bytes(spec.layers, t_local, layout.batch, full)
    acts = peak
    if layout.offload:
        # the checkpointed blocks' inputs live in host memory; one block's stay while it recomputes
        inputs = sum((n - 1) * (fit.saved[k][0] + fit.saved[k][1] * t_local) for k, n in spec.layers.items())
        acts = peak - layout.batch * inputs
    if mixed and layout.fsdp == "off":
        # autocast's bf16 copies of weights stored in fp32 are saved for backward (one block's if recomputed)
        fp32_linear = c.linear_in_blocks * (1 if not lora else 0)
        if lora and layout.base_dtype == "float32":
            fp32_linear = c.linear_in_blocks
        if p_bytes == 4 or layout.base_dtype == "float32":
            acts += 2 * fp32_linear * (1 / c.attention_layers if layout.checkpointing else 1)
    # -- CP buffers (one layer at a time)
    hidden_bytes = layout.batch * t_local * spec.hidden
    cp_buffers = 0.0
    half = 2 if compute == torch.float32 else 1  # the buffers are in the compute dtype (bf16: 2 B)
    if layout.ulysses > 1:
        cp_buffers = max(cp_buffers, 12 * half * hidden_bytes)  # q, k, v send + receive copies
    if layout.ring > 1:
        cp_buffers += (8 * half + 16) * hidden_bytes  # 2 K/V blocks + dK/dV fp32 in flight, fp32 out/LSE merge
    fixed = (hw.cuda_context_gib + hw.comm_buffers_gib) * GIB
    margin = hw.allocator_margin * (in_flight + acts + cp_buffers)
    comm = comm_bytes(layout, c, hidden_bytes)
    seconds = step_time(spec, layout, hw, c, comm, tokens, text, lora)
    total = states + in_flight + acts + cp_buffers + fixed + margin
    fits = total <= hw.gpu_memory_gib * GIB
    return Estimate(
        layout,
        states,
        in_flight,
        acts,
        cp_buffers,
        fixed,
        margin,
        comm,
        seconds["step"],
        seconds["sample"],
        fits,
        seconds,
    )

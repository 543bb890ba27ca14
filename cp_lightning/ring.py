"""Ring attention: K/V blocks travel rank to rank by P2P, each rank holding O(S/P) of them.

Forward, on the rank at ring position r of P: at step s it holds the K/V block of rank (r - s) mod P.
It starts sending that block to rank r+1 (and receiving the next from r-1) *before* computing
attention on it, so the transfer overlaps the compute (double buffering: the block being computed
and the block in flight). Partial outputs are merged in fp32 (fp64 for fp64 inputs) with their
log-sum-exp (LSE).

Backward: each block's gradient is recomputed with the final output and LSE, which is exact. dQ
stays local. The dK/dV accumulator of a block travels the ring with it, each rank adding its part,
and the last hop brings it home: after P hops rank r holds the full dK/dV of its own block.
No all-gather of K/V happens anywhere.

The P2P goes through a communicator (``world``, ``rank``, ``start``, ``finish``, ``incoming_length``):
:class:`RingComm` over a process group, or one registered under a name with :func:`register_comm`
(cp_lightning.ring_threads runs P virtual ranks as threads of one process on one device, which is how the
shipped loop is checked on one GPU, where NCCL refuses two ranks and gloo cannot send CUDA tensors).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from cp_lightning import masked
from cp_lightning.collectives import record_sent
from cp_lightning.kernels import Kernel, as_bshd, get_kernel, grouped

# message tags: K, V and the mask travel together; the dK/dV accumulators follow them
K_TAG, V_TAG, BIAS_TAG, DK_TAG, DV_TAG = range(5)


class RingComm:
    """Send to the next rank of a ring group and receive from the previous one, asynchronously."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (rank - 1) % self.world)

    def start(
        self, tensors: list[torch.Tensor], tags: list[int], shapes: list[torch.Size] | None = None
    ) -> tuple[list[torch.Tensor], list]:
        """Post sends of ``tensors`` and receives into fresh buffers; returns both.

        Buffers have the shapes of the tensors sent unless ``shapes`` says otherwise (blocks of
        different lengths when the sequence does not divide evenly).
        """
        tensors = [t.contiguous() for t in tensors]
        shapes = shapes or [t.shape for t in tensors]
        buffers = [t.new_empty(shape) for t, shape in zip(tensors, shapes, strict=True)]
        ops = []
        for tensor, buffer, tag in zip(tensors, buffers, tags, strict=True):
            record_sent(f"p2p:{tag}", tensor.numel() * tensor.element_size())
            ops.append(dist.P2POp(dist.isend, tensor, self.next, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, buffer, self.prev, self.group, tag))
        return buffers, dist.batch_isend_irecv(ops)

    def incoming_length(self, lengths: list[int] | None, step: int) -> int | None:
        """The sequence length of the block received at ``step``: it belongs to rank r - step - 1.

        Forward K/V and backward dK/dV alike: at step s rank r holds the block of rank r - s, and the
        previous rank sends the block it holds, that of r - s - 1 (the last hop brings r's own home).
        """
        return None if lengths is None else lengths[(self.rank - step - 1) % self.world]

    @staticmethod
    def finish(pending: tuple[list[torch.Tensor], list]) -> list[torch.Tensor]:
        buffers, works = pending
        for work in works:
            work.wait()
        return buffers


# Communicators that are not process groups, by the name the ring ops get as ``group_name``
_COMMS: dict[str, Callable[[], object]] = {}


def register_comm(name: str, factory: Callable[[], object] | None) -> None:
    """Make ring attention over ``group_name=name`` use ``factory()`` as its communicator (None: forget it).

    ``factory`` is called on the thread that runs the ring op and returns an object with RingComm's
    interface for that caller (cp_lightning.ring_threads: the calling thread's virtual rank)."""
    if factory is None:
        _COMMS.pop(name, None)
    else:
        _COMMS[name] = factory


def ring_comm(group_name: str):
    """The communicator of the ring ops' ``group_name``: a registered one, else P2P over that process group."""
    factory = _COMMS.get(group_name)
    return factory() if factory is not None else RingComm(_resolve_process_group(group_name))


def _masked_lse(lse: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Kernels report LSE 0 for a row whose keys are all masked; the merge needs -inf there."""
    if bias is None:
        return lse
    empty = torch.isneginf(bias).all(dim=-1)  # B, H|1, 1: every key of this block masked
    return lse.masked_fill(empty, float("-inf"))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What partial outputs and gradients are summed in: fp32, or fp64 for fp64 inputs (exact references)."""
    return torch.promote_types(dtype, torch.float32)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Combine two softmax-normalised partial outputs by their LSE, in fp32 (fp64 for fp64), updating ``out``.

    new_lse = log(e^lse + e^block_lse) (logaddexp: no overflow); each side is weighted by
    exp(its_lse - new_lse) <= 1. Both -inf (rows masked so far) gives nan, which means weight 0.
    """
    if out is None:
        return block_out.to(accumulation_dtype(block_out.dtype)), block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    old_weight = torch.exp(lse - new_lse).nan_to_num_(0.0).unsqueeze(-1)
    block_weight = torch.exp(block_lse - new_lse).nan_to_num_(0.0).unsqueeze(-1)
    out.mul_(old_weight).addcmul_(block_out, block_weight)  # no temporary of the block's size
    return out, new_lse


def _wire(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) view -> contiguous (B, S, H, D) for sending. The kernels read and write the
    (B, S, H, D) memory layout that diffusers' processors produce, so this is usually free."""
    return x.transpose(1, 2).contiguous()


def _with_length(tensor: torch.Tensor, dim: int, length: int | None) -> torch.Size:
    shape = list(tensor.shape)
    if length is not None:
        shape[dim] = length
    return torch.Size(shape)


def _start_blocks(comm: RingComm, k, v, bias, length: int | None):
    """Send this K/V block (and its mask) on and receive the previous rank's, of ``length`` keys
    (None: as long as this one), without copying it. K/V are (B, S, H, D), the mask (B, H|1, 1, S)."""
    tensors, tags = [k, v], [K_TAG, V_TAG]
    if bias is not None:
        tensors, tags = [k, v, bias], [K_TAG, V_TAG, BIAS_TAG]
    shapes = [_with_length(t, 1 if t is not bias else -1, length) for t in tensors]
    return comm.start(tensors, tags, shapes)


def _finish_blocks(comm: RingComm, pending):
    received = comm.finish(pending)
    return received[0], received[1], (received[2] if len(received) > 2 else None)


def _bshd_layout(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty (B, H, S, D) tensor laid out as contiguous (B, S, H, D), the layout of every ring output.

    One fixed layout, in the real implementations and the fake ones alike, keeps compiled graphs' strides
    equal to eager's; it is also what the kernels write and what diffusers' processors reshape for free.
    """
    b, h, s, d = like.shape
    return like.new_empty((b, s, h, d), dtype=dtype).transpose(1, 2)


def _ring_forward(q, k, v, bias, comm, kernel: Kernel, scale, block_lengths, plan=None):
    """q, k, v: (B, H, S_local, D); bias: None or (B, H|1, 1, S_k_local) additive, in q's dtype; comm: the
    ring's communicator (:func:`ring_comm`); block_lengths: every ring rank's key count, or None when they
    are all equal; plan: None, or a mask spec's rectangles per step (``masked.encode``): step s runs only
    those against the block it holds, and a step without any computes nothing. Returns (out, lse)."""
    bias = None if bias is None else bias.contiguous()
    # blocks travel as contiguous B, S, H, D; the kernels see B, H, S, D views of them
    block_k, block_v, block_bias = _wire(k), _wire(v), bias
    out = lse = None
    steps = None if plan is None else masked.decode(plan)
    if steps is not None:  # rows gather their pieces in place: start from out 0, lse -inf
        out, lse = masked.empty_output(q, accumulation_dtype(q.dtype))
    for step in range(comm.world):
        # post the transfer of the next block before computing on this one: they overlap
        pending = None
        if step + 1 < comm.world:
            pending = _start_blocks(comm, block_k, block_v, block_bias, comm.incoming_length(block_lengths, step))
        if steps is not None:
            masked.forward_pieces(
                q, block_k.transpose(1, 2), block_v.transpose(1, 2), steps[step], kernel, scale, out, lse
            )
        else:
            block_out, block_lse = kernel.forward(
                q, block_k.transpose(1, 2), block_v.transpose(1, 2), block_bias, scale
            )
            out, lse = merge(out, lse, block_out, _masked_lse(block_lse, block_bias))
            del block_out, block_lse
        if pending is not None:
            block_k, block_v, block_bias = _finish_blocks(comm, pending)
    return as_bshd(out).to(q.dtype), lse.contiguous()


# Key chunks of one block's backward on an accelerator: a boundary on a multiple of this many keys keeps a mask
# slice's address aligned (kernels._aligned_bias then copies nothing) and the kernels' key tiles full.
_CHUNK_KEYS = 128


def _spare_bytes(device: torch.device) -> int:
    """Memory the allocator can still hand out on ``device``: free on the device plus cached but unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _chunked(device: torch.device, accumulator_bytes: int) -> bool:
    """Whether the backward splits each block's keys in two (see :func:`_ring_backward`).

    On the CPU always: measured to lower the ring's peak (docs/benchmarks.md). On CUDA only when memory is
    short (less than four times ``accumulator_bytes``, the two fp32 accumulators, spare): a split gives each
    kernel call less work, which costs GPU throughput that the two tensors it saves rarely pay for.
    """
    if device.type == "cpu":
        return True
    return device.type == "cuda" and _spare_bytes(device) < 4 * accumulator_bytes


def _key_chunks(keys: int, chunked: bool = True, align: int = 1) -> list[tuple[int, int]]:
    """The key ranges one block's backward runs in: the first quarter (rounded down to a multiple of
    ``align`` keys when that leaves one), then the rest; or the whole block."""
    cut = keys // 4
    if align > 1 and cut >= align:
        cut -= cut % align
    return [(0, keys)] if not chunked or cut == 0 else [(0, cut), (cut, keys)]


def _accumulators(comm, pending, block_k, block_v, acc):
    """The held block's dK/dV accumulators: new (fp32, B, S, H, D like the blocks) or the previous rank's; and
    None for the pending transfer (its works held the accumulators sent on: waiting frees them)."""
    if pending is None:
        return block_k.new_zeros(block_k.shape, dtype=acc), block_v.new_zeros(block_v.shape, dtype=acc), None
    dk, dv = comm.finish(pending)
    return dk, dv, None


def _ring_backward(dout, q, k, v, out, lse, bias, comm, kernel: Kernel, scale, block_lengths, plan=None):
    """Gradients (dq, dk, dv) of :func:`_ring_forward`, from its final output and LSE.

    Each block's backward runs in two chunks of its keys, a quarter and the rest (the gradient of a key
    depends only on the final output and LSE, so chunks are as exact as whole blocks), and each chunk's
    gradients are added as soon as they exist. The first chunk overlaps the arrival of the block's dK/dV
    accumulator; once it is in, the accumulator sent on the step before is freed, so the larger chunk
    runs without two accumulators in flight. The ring's peak memory is in this loop; this lowers it by
    about two (B, S_local, H, D) fp32 tensors (benchmarks/scaling.py at cp=4: 0.270x -> 0.265x of
    cp=1 per rank, docs/benchmarks.md). The price: the accumulator's transfer overlaps a quarter of the
    block's compute, not all of it, and each kernel call does less work: on CUDA blocks run whole unless
    memory is short (:func:`_chunked`), and a split falls on a multiple of 128 keys.
    """
    # rows with no unmasked key at all: +inf makes every probability exp(s - inf) = 0
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    if q.device.type != "cpu":
        # dO in the layout the CUDA backward ops want, (B, S, H, D): at most one copy here, none per kernel
        # call (the CPU kernel reads any layout, and a copy there would add to the ring's peak)
        dout = as_bshd(dout)
    b, h, s_local, d = k.shape
    chunked = _chunked(q.device, 2 * b * h * s_local * d * 4)  # the two fp32 accumulators' bytes
    align = 1 if q.device.type == "cpu" else _CHUNK_KEYS
    acc = accumulation_dtype(q.dtype)
    dq = None  # in acc (fp32), laid out B, S, H, D; the first partial gradient becomes it (no copy in fp32)
    steps = None if plan is None else masked.decode(plan)
    if steps is not None:  # pieces add into their rows: start from zeros
        dq = masked.empty_output(q, acc)[0]
    block_k, block_v, block_bias = _wire(k), _wire(v), None if bias is None else bias.contiguous()
    grad_pending = None
    for step in range(comm.world):
        incoming = comm.incoming_length(block_lengths, step)
        kv_pending = None
        if step + 1 < comm.world:
            kv_pending = _start_blocks(comm, block_k, block_v, block_bias, incoming)
        if steps is not None:  # a mask spec: this step's rectangles only, added into the accumulators directly
            dk, dv, grad_pending = _accumulators(comm, grad_pending, block_k, block_v, acc)
            masked.backward_pieces(
                dout, q, block_k.transpose(1, 2), block_v.transpose(1, 2), out, lse, steps[step], kernel, scale,
                dq, dk.transpose(1, 2), dv.transpose(1, 2),
            )  # fmt: skip
        chunks = [] if steps is not None else _key_chunks(block_k.shape[1], chunked, align)
        for chunk, (lo, hi) in enumerate(chunks):
            chunk_bias = None if block_bias is None else block_bias[..., lo:hi]
            dq_part, dk_part, dv_part = kernel.backward(
                dout,
                q,
                block_k[:, lo:hi].transpose(1, 2),
                block_v[:, lo:hi].transpose(1, 2),
                out,
                lse,
                chunk_bias,
                scale,
            )
            dq = as_bshd(dq_part.to(acc)) if dq is None else dq.add_(dq_part)
            del dq_part
            if chunk == 0:
                dk, dv, grad_pending = _accumulators(comm, grad_pending, block_k, block_v, acc)
            dk[:, lo:hi] += dk_part.transpose(1, 2)
            dv[:, lo:hi] += dv_part.transpose(1, 2)
            del dk_part, dv_part
        if comm.world == 1:  # a ring of one: the accumulators are home already (and gloo cannot send to self)
            break
        # on to the next rank; the last hop goes home
        grad_pending = comm.start([dk, dv], [DK_TAG, DV_TAG], [_with_length(t, 1, incoming) for t in (dk, dv)])
        del dk, dv
        if kv_pending is not None:
            block_k, block_v, block_bias = _finish_blocks(comm, kv_pending)
    if grad_pending is not None:
        dk, dv = comm.finish(grad_pending)  # B, S, H, D fp32, received: fresh buffers
    return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


# The ring as two custom ops, so that torch.compile sees one opaque op per ring forward and backward
# instead of tracing into P2P calls it cannot capture (each one a graph break). Their fake
# implementations give the outputs' shapes and strides without communicating; groups and kernels
# travel by name, since an op's arguments must be tensors or plain values.
@torch.library.custom_op("cp_lightning::ring_attention_forward", mutates_args=())
def ring_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    kernel: str,
    scale: float | None,
    block_lengths: list[int] | None,
    plan: list[int] | None = None,
    kv_heads: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward: (out (B, H, S_local, D) laid out B, S, H, D; lse (B, H, S_local) fp32)."""
    kernel_ = grouped(get_kernel(kernel), kv_heads)
    return _ring_forward(q, k, v, bias, ring_comm(group_name), kernel_, scale, block_lengths, plan)


@ring_attention_forward.register_fake
def _(q, k, v, bias, group_name, kernel, scale, block_lengths, plan=None, kv_heads=None):
    b, h, s, _ = q.shape
    return _bshd_layout(q, q.dtype), q.new_empty((b, h, s), dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("cp_lightning::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    kernel: str,
    scale: float | None,
    block_lengths: list[int] | None,
    plan: list[int] | None = None,
    kv_heads: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention backward: (dq, dk, dv), each laid out B, S, H, D like the forward's output."""
    comm, kernel_ = ring_comm(group_name), grouped(get_kernel(kernel), kv_heads)
    return _ring_backward(dout, q, k, v, out, lse, bias, comm, kernel_, scale, block_lengths, plan)


@ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, bias, group_name, kernel, scale, block_lengths, plan=None, kv_heads=None):
    return _bshd_layout(q, q.dtype), _bshd_layout(k, k.dtype), _bshd_layout(v, v.dtype)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, ctx.group_name, ctx.kernel, ctx.scale, ctx.block_lengths, ctx.plan, ctx.kv_heads = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, bias)


def _backward(ctx, dout, _dlse):
    # the recomputation per block with the final output and LSE is exact (see the module docstring)
    q, k, v, out, lse, bias = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward(
        dout, q, k, v, out, lse, bias, ctx.group_name, ctx.kernel, ctx.scale, ctx.block_lengths, ctx.plan,
        ctx.kv_heads,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None


ring_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(
    q,
    k,
    v,
    *,
    group: dist.ProcessGroup,
    kernel: Kernel,
    bias=None,
    scale=None,
    block_lengths: list[int] | None = None,
    plan: list[int] | None = None,
    kv_heads: list[int] | None = None,
) -> torch.Tensor:
    """Exact attention of local queries over the K/V blocks of every rank in ``group`` (all (B, H, S, D)).

    ``group``: a process group, or anything with the ``group_name`` of a communicator registered with
    :func:`register_comm` (a ``ring_threads.ThreadRing``).
    ``block_lengths``: each ring rank's key count when they differ (None: all equal to this rank's).
    ``plan``: a mask spec's rectangles per step (``masked.encode``; cp_lightning.masked_cp builds it).
    ``kv_heads``: grouped-query attention, query head i over K/V head ``kv_heads[i]`` (``kernels.grouped``): the
    blocks travel with their H_kv heads and are expanded only inside each kernel call, and the dK/dV
    accumulators, folded back to H_kv heads there, travel at 1/g of the bytes of repeated heads.
    The output is laid out as contiguous (B, S, H, D).
    """
    if block_lengths is not None and len(set(block_lengths)) == 1:
        block_lengths = None
    out, _ = ring_attention_forward(q, k, v, bias, group.group_name, kernel.name, scale, block_lengths, plan, kv_heads)
    return out

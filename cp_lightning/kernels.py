"""Local attention kernels that return the log-sum-exp (LSE), behind one small interface.

Ring attention computes attention one K/V block at a time and merges the partial outputs with their
LSE; its backward re-runs each block with the *final* output and LSE, which makes every block's
gradient exact (the softmax normaliser is the global one). A kernel therefore provides::

    forward(q, k, v, bias, scale) -> (out, lse)                 # q, k, v: (B, H, S, D); lse: (B, H, S_q) fp32
    backward(dout, q, k, v, out, lse, bias, scale) -> (dq, dk, dv)

``bias`` is None or an additive key mask broadcastable to (B, H, 1, S_k) in the inputs' dtype.
Adding a kernel means adding one entry to ``KERNELS``; :func:`pick_kernel` chooses by device,
dtype, mask and head dim unless the user names one (then :meth:`Kernel.check` refuses what it
cannot take, naming the kernels that can); what no CUDA kernel takes (a 16-bit head dim that is not a
multiple of 8) runs on ``math``. ``cpu_flash`` and ``math`` also take fp64, for exact references.

The CUDA wrappers call torch's private SDPA ops, which skip the argument fixing that public SDPA
does; each rule they must follow is applied here, in code that does not branch on the device, so
the same calls can be checked on the meta device on any machine (tests/test_kernels.py). Only ROCm
differs (the efficient kernels' LSE length). ``flash_attn`` wraps the flash-attn package (>= 2.7)
when it is installed; it is never a dependency.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Kernel:
    """One local attention kernel and what it accepts.

    ``head_dim_multiple`` / ``max_head_dim``: head-dim limits of the kernel (0: none);
    ``half_head_dim_multiple``: the multiple in bf16 / fp16 when it differs (None: the same).
    ``available``: whether it can run in this process (an optional package may be missing).
    """

    name: str
    forward: Callable
    backward: Callable
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    supports_bias: bool
    head_dim_multiple: int = 1
    max_head_dim: int = 0
    available: Callable[[], bool] = lambda: True
    half_head_dim_multiple: int | None = None

    def multiple(self, dtype: torch.dtype) -> int:
        """The head dims this kernel takes in ``dtype`` are multiples of this."""
        if dtype in _HALF and self.half_head_dim_multiple is not None:
            return self.half_head_dim_multiple
        return self.head_dim_multiple

    def refusal(self, device: torch.device, dtype: torch.dtype, has_bias: bool, head_dim: int | None) -> str | None:
        """Why this kernel cannot take these inputs, or None when it can."""
        if not self.available():
            return f"is not available here ({_FLASH_ATTN_HINT})"
        if device.type not in self.devices:
            return f"runs on {self.devices}, not {device.type}"
        if dtype not in self.dtypes:
            return f"runs in {[str(d) for d in self.dtypes]}, not {dtype}"
        if has_bias and not self.supports_bias:
            return "takes no attention mask"
        multiple = self.multiple(dtype)
        if head_dim is not None and (head_dim % multiple or (self.max_head_dim and head_dim > self.max_head_dim)):
            limit = f" up to {self.max_head_dim}" if self.max_head_dim else ""
            return f"needs a head dim that is a multiple of {multiple}{limit} in {dtype}, not {head_dim}"
        return None

    def check(self, device: torch.device, dtype: torch.dtype, has_bias: bool, head_dim: int | None = None) -> None:
        why = self.refusal(device, dtype, has_bias, head_dim)
        if why is None:
            return
        can = [k.name for k in KERNELS.values() if k.refusal(device, dtype, has_bias, head_dim) is None]
        what = f"{device.type} {dtype}{' with a mask' if has_bias else ''}" + (
            "" if head_dim is None else f", head dim {head_dim}"
        )
        raise ValueError(
            f"attention kernel {self.name!r} {why}; got {what}. "
            + (
                f"Pick one that can with kernel=: {can}."
                if can
                else f"No kernel takes these inputs ({sorted(KERNELS)})."
            )
        )


def _expand_bias(bias, q, k):
    # B|1, H|1, 1, S_k -> B, H, S_q, S_k (a stride-0 view: no copy)
    return None if bias is None else bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


# The efficient kernels read the mask with 16-byte vector loads: its batch, head and query strides must be
# multiples of 8 elements for 16-bit and 4 for fp32 wherever that dim has more than one element (the
# "attn_bias is not correctly aligned" check), and so must its first element's address. ATen's host check
# looks at the strides and at 4-byte alignment only, so a mask slice that starts mid-vector (the ring's key
# chunks: bf16, 1032 keys, the second chunk 516 bytes in) passes it and faults on the device ("misaligned
# address", sticky: the process must restart, DESIGN.md section 9.4). Public SDPA pads the key dim to a
# multiple of 8 and slices it back (attention.cpp, preprocess_mask); the private op we call does not, so we
# copy into a fresh (allocator-aligned) padded buffer whenever strides or address are off.
_BIAS_ALIGNMENT = 8
_BIAS_ADDRESS_ALIGNMENT = 16  # bytes: one vector load


def _bias_address(bias: torch.Tensor) -> int:
    """The mask's first element's address (on the meta device: its byte offset, which is what matters)."""
    return bias.data_ptr() if not bias.is_meta else bias.storage_offset() * bias.element_size()


def _aligned_bias(bias, q, k):
    """The key mask as the efficient kernels need it: (B, H, S_q, S_k) with aligned strides and address."""
    if bias is None:
        return None
    keys = bias.shape[-1]
    aligned = (
        bias.stride(-1) == 1
        and all(stride % _BIAS_ALIGNMENT == 0 for stride in bias.stride()[:-1])
        and _bias_address(bias) % _BIAS_ADDRESS_ALIGNMENT == 0
    )
    if not aligned:
        padded = bias.new_zeros(*bias.shape[:-1], -(-keys // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT)
        padded[..., :keys] = bias
        bias = padded[..., :keys]
    return _expand_bias(bias, q, k)


def as_bshd(x: torch.Tensor) -> torch.Tensor:
    """A (B, H, S, D) tensor laid out in memory as contiguous (B, S, H, D): no copy when it already is.

    The layout every ring block, output and gradient has; the CUDA backward ops need it of ``out`` and
    ``grad_out`` (they copy, or misread, anything else: see the efficient and flash backward wrappers).
    """
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _efficient_lse_rows(queries: int) -> int:
    """Rows of LSE the efficient kernels read: the forward pads to a multiple of 32 on CUDA (the
    backward reads them with no bound check, kernel_backward.h) and returns exactly S_q on ROCm."""
    return queries if torch.version.hip else -(-queries // 32) * 32


def _cpu_flash_forward(q, k, v, bias, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_expand_bias(bias, q, k), scale=scale
    )
    return out, lse


def _cpu_flash_backward(dout, q, k, v, out, lse, bias, scale):
    # dout goes in with its own strides: the CPU kernel reads any layout (checked against contiguous
    # copies for B, S, H, D, transposed, expanded and strided last dims), and the ring calls this once
    # per block, so a copy here would be one more (B, S, H, D) tensor at the ring's memory peak.
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=_expand_bias(bias, q, k), scale=scale
    )


def _math_forward(q, k, v, bias, scale):
    """Reference kernel in fp32 (fp64 for fp64) on any device: O(S_q x S_k) memory for the block."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # B, H, S_q, S_k
    if bias is not None:
        scores = scores + bias.to(acc)
    lse = torch.logsumexp(scores, dim=-1)  # B, H, S_q
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(probs, v.to(acc)).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, bias, scale):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, dof = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(acc)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # with the global LSE: exact per block
    dv = torch.matmul(probs.transpose(-1, -2), dof)
    dprobs = torch.matmul(dof, vf.transpose(-1, -2))
    delta = (dof * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O) of the *final* output
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, kf)
    dk = torch.matmul(dscores.transpose(-1, -2), qf)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cuda_efficient_forward(q, k, v, bias, scale):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _aligned_bias(bias, q, k), True, 0.0, False, scale=scale
    )
    return out, lse[..., : q.shape[2]]  # the merge wants S_q rows; the kernel may pad them


def _cuda_efficient_backward(dout, q, k, v, out, lse, bias, scale):
    # The backward reads the LSE over the padded rows the forward wrote. Padding them with +inf makes
    # every probability of those (absent) queries exp(s - inf) = 0, as the forward's padding does.
    rows = _efficient_lse_rows(q.shape[2])
    lse = F.pad(lse.float(), (0, rows - lse.shape[-1]), value=float("inf")).contiguous()
    empty = torch.empty(0, dtype=torch.long, device=q.device)  # philox seed/offset: read only with dropout
    # out: the kernel takes its row stride as H * D (kernel_backward.h, o_strideM()), i.e. it assumes the
    # (B, S, H, D) layout; another one (contiguous (B, H, S, D)) is misread silently. grad_out: ATen copies
    # it to contiguous (B, S, H, D) unless it already is. as_bshd is free for the ring's tensors.
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        as_bshd(dout),
        q,
        k,
        v,
        _aligned_bias(bias, q, k),
        as_bshd(out),
        lse,
        empty,
        empty,
        0.0,
        [True, True, True, False],
        False,
        scale=scale,
    )
    return dq, dk, dv


def _cuda_flash_forward(q, k, v, bias, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return out, lse


def _cuda_flash_backward(dout, q, k, v, out, lse, bias, scale):
    empty = torch.empty(0, dtype=torch.long, device=q.device)  # philox seed/offset: read only with dropout
    # ATen makes grad_out and out contiguous as (B, S, H, D) (attention_backward.cu): free in that layout
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        as_bshd(dout),
        q,
        k,
        v,
        as_bshd(out),
        lse.contiguous(),
        # cum_seq_q / cum_seq_k: undefined selects the dense (batched) path; any defined tensor, even an
        # empty one, selects the variable-length path (attention_backward.cu), which wants int32 offsets.
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        False,
        empty,
        empty,
        scale=scale,
    )
    return dq, dk, dv


# ----- the flash-attn package (optional) --------------------------------------------------------------

_FLASH_ATTN_HINT = "pip install flash-attn>=2.7 on a CUDA machine"


@functools.cache
def _flash_attn_interface():
    """flash_attn's LSE-returning functions, or None when the package is missing or too old."""
    try:
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    import flash_attn

    # 2.7 split window_size into left/right and made the forward return (out, lse, S_dmask, rng_state)
    version = tuple(int(p) for p in re.findall(r"\d+", flash_attn.__version__)[:2])
    return flash_attn_interface if version >= (2, 7) else None


def _flash_attn_available() -> bool:
    return _flash_attn_interface() is not None


def _flash_attn_forward(q, k, v, bias, scale):
    # B, H, S, D -> B, S, H, D views: flash-attn's layout (it needs only the last dim contiguous)
    fa = _flash_attn_interface()
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out, lse, _, _ = fa._flash_attn_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, scale, False, -1, -1, 0.0, None, False
    )
    return out.transpose(1, 2), lse  # out: B, S, H, D -> B, H, S, D; lse: B, H, S_q fp32


def _flash_attn_backward(dout, q, k, v, out, lse, bias, scale):
    fa = _flash_attn_interface()
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    q_, k_, v_, out_, dout_ = (t.transpose(1, 2) for t in (q, k, v, out, dout))  # B, H, S, D -> B, S, H, D
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q_, k_, v_))
    fa._flash_attn_backward(
        dout_.contiguous(), q_, k_, v_, out_.contiguous(), lse.contiguous(), dq, dk, dv,
        0.0, scale, False, -1, -1, 0.0, None, False, None,
    )  # fmt: skip
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)  # B, S, H, D -> B, H, S, D


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)
_EXACT = (*_FLOATS, torch.float64)  # fp64: references exact to rounding (tests, benchmarks/gpu_check.py)
KERNELS: dict[str, Kernel] = {
    "cpu_flash": Kernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward, ("cpu",), _EXACT, True),
    "math": Kernel("math", _math_forward, _math_backward, ("cpu", "cuda"), _EXACT, True),
    # efficient kernels: on sm80+ only head dims that are multiples of 8 (16-bit) or 4 (fp32) have kernels
    # ("no kernel found to launch" otherwise; public SDPA's check_head_dim_size_mem_efficient)
    "cuda_efficient": Kernel(
        "cuda_efficient",
        _cuda_efficient_forward,
        _cuda_efficient_backward,
        ("cuda",),
        _FLOATS,
        True,
        head_dim_multiple=4,
        half_head_dim_multiple=8,
    ),
    # flash kernels: head dim a multiple of 8, at most 256 (flash_api.cpp); no additive mask
    "cuda_flash": Kernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward, ("cuda",), _HALF, False, 8, 256),
    "flash_attn": Kernel(
        "flash_attn", _flash_attn_forward, _flash_attn_backward, ("cuda",), _HALF, False, 8, 256, _flash_attn_available
    ),
}


def grouped(kernel: Kernel, kv_heads: list[int] | None) -> Kernel:
    """``kernel`` for grouped-query attention: query head i attends over K/V head ``kv_heads[i]`` (None: as is).

    The kernels take equal head counts, so K/V (B, H_kv, S, D) are expanded to the queries' heads for the call
    (a copy of the block's size with H_q heads, as a kernel without GQA needs anyway), and the expanded dK/dV
    are folded back: each K/V head's gradient is the sum of those of the query heads that read it (index_add_,
    the adjoint of index_select), in the accumulation dtype. So what leaves the kernel, and the ring's
    accumulators that travel, have H_kv heads.
    """
    if kv_heads is None:
        return kernel

    def expand(x, index):
        # B, H_kv, S, D view of B, S, H_kv, D -> B, S, H_q, D -> a B, H_q, S, D view (the ring's layout)
        return x.transpose(1, 2).index_select(2, index).transpose(1, 2)

    def fold(grad, like, index):
        b, h, s, d = like.shape
        acc = torch.promote_types(grad.dtype, torch.float32)
        # B, H_q, S, D -> B, S, H_q, D, summed into B, S, H_kv, D -> a B, H_kv, S, D view
        folded = grad.new_zeros((b, s, h, d), dtype=acc).index_add_(2, index, grad.transpose(1, 2).to(acc))
        return folded.transpose(1, 2)

    def forward(q, k, v, bias, scale):
        index = torch.tensor(kv_heads, device=k.device)
        return kernel.forward(q, expand(k, index), expand(v, index), bias, scale)

    def backward(dout, q, k, v, out, lse, bias, scale):
        index = torch.tensor(kv_heads, device=k.device)
        dq, dk, dv = kernel.backward(dout, q, expand(k, index), expand(v, index), out, lse, bias, scale)
        return dq, fold(dk, k, index), fold(dv, v, index)

    return replace(kernel, forward=forward, backward=backward)


def get_kernel(name: str) -> Kernel:
    if name not in KERNELS:
        raise ValueError(
            f"attention kernel {name!r} is unknown or cannot return the log-sum-exp that ring attention needs; "
            f"choose one of {sorted(KERNELS)}."
        )
    return KERNELS[name]


# Preference order on CUDA; the first that takes the inputs wins. Masked rings stay on cuda_efficient; what
# none of them takes (a 16-bit head dim that is not a multiple of 8) runs on "math": exact, fp32 inside,
# but O(S_q x S_k) memory per block.
_CUDA_ORDER = ("flash_attn", "cuda_flash", "cuda_efficient")


def pick_kernel(
    device: torch.device, dtype: torch.dtype, has_bias: bool, name: str | None = None, head_dim: int | None = None
) -> Kernel:
    """The named kernel (checked), or the best one for this device, dtype, mask and head dim."""
    if name is not None:
        kernel = get_kernel(name)
        kernel.check(device, dtype, has_bias, head_dim)
        return kernel
    if device.type == "cpu":
        return KERNELS["cpu_flash"]
    if device.type == "cuda":
        for candidate in _CUDA_ORDER:
            if KERNELS[candidate].refusal(device, dtype, has_bias, head_dim) is None:
                return KERNELS[candidate]
        warnings.warn(
            f"ring attention: no CUDA kernel takes {dtype} with head dim {head_dim}"
            f"{' and a mask' if has_bias else ''}; using the 'math' kernel (exact, but O(S_q x S_k) memory per "
            "block). The 16-bit efficient and flash kernels need head dims that are multiples of 8.",
            stacklevel=2,
        )
    return KERNELS["math"]

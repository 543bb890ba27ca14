"""Local attention kernels that return the log-sum-exp (LSE), behind one small interface.

Ring attention computes attention one K/V block at a time and merges the partial outputs with their
LSE; its backward re-runs each block with the *final* output and LSE, which makes every block's
gradient exact (the softmax normaliser is the global one). A kernel therefore provides::

    forward(q, k, v, bias, scale) -> (out, lse)                 # q, k, v: (B, H, S, D); lse: (B, H, S_q) fp32
    backward(dout, q, k, v, out, lse, bias, scale) -> (dq, dk, dv)

``bias`` is None or an additive key mask broadcastable to (B, H, 1, S_k) in the inputs' dtype.
Adding a kernel means adding one entry to ``KERNELS``; :func:`pick_kernel` chooses by device and
dtype unless the user names one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Kernel:
    name: str
    forward: Callable
    backward: Callable
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    supports_bias: bool

    def check(self, device: torch.device, dtype: torch.dtype, has_bias: bool) -> None:
        if device.type not in self.devices or dtype not in self.dtypes or (has_bias and not self.supports_bias):
            raise ValueError(
                f"attention kernel {self.name!r} runs on {self.devices} in {[str(d) for d in self.dtypes]}"
                f"{'' if self.supports_bias else ' without masks'}; got {device.type} {dtype}"
                f"{' with a mask' if has_bias else ''}. Pick another with kernel= (one of {sorted(KERNELS)})."
            )


def _expand_bias(bias, q, k):
    # B, H|1, 1, S_k -> B, H, S_q, S_k (a stride-0 view: no copy)
    return None if bias is None else bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _cpu_flash_forward(q, k, v, bias, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_expand_bias(bias, q, k), scale=scale
    )
    return out, lse


def _cpu_flash_backward(dout, q, k, v, out, lse, bias, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=_expand_bias(bias, q, k), scale=scale
    )


def _math_forward(q, k, v, bias, scale):
    """Reference kernel in fp32 on any device: O(S_q x S_k) memory for the block."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # B, H, S_q, S_k
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)  # B, H, S_q
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(probs, v.float()).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, bias, scale):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.float()
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # with the global LSE: exact per block
    dv = torch.matmul(probs.transpose(-1, -2), dof)
    dprobs = torch.matmul(dof, vf.transpose(-1, -2))
    delta = (dof * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O) of the *final* output
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, kf)
    dk = torch.matmul(dscores.transpose(-1, -2), qf)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cuda_efficient_forward(q, k, v, bias, scale):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _expand_bias(bias, q, k), True, 0.0, False, scale=scale
    )
    return out, lse[..., : q.shape[2]]  # the kernel pads the LSE's query dim


def _cuda_efficient_backward(dout, q, k, v, out, lse, bias, scale):
    empty = torch.empty(0, device=q.device)
    expanded = _expand_bias(bias, q, k)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        expanded,
        out,
        lse.contiguous(),
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
    empty = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        empty,
        empty,
        q.shape[2],
        k.shape[2],
        0.0,
        False,
        empty,
        empty,
        scale=scale,
    )
    return dq, dk, dv


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
KERNELS: dict[str, Kernel] = {
    "cpu_flash": Kernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward, ("cpu",), _FLOATS, True),
    "math": Kernel("math", _math_forward, _math_backward, ("cpu", "cuda"), _FLOATS, True),
    "cuda_efficient": Kernel(
        "cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward, ("cuda",), _FLOATS, True
    ),
    "cuda_flash": Kernel(
        "cuda_flash", _cuda_flash_forward, _cuda_flash_backward, ("cuda",), (torch.bfloat16, torch.float16), False
    ),
}


def get_kernel(name: str) -> Kernel:
    if name not in KERNELS:
        raise ValueError(
            f"attention kernel {name!r} is unknown or cannot return the log-sum-exp that ring attention needs; "
            f"choose one of {sorted(KERNELS)}."
        )
    return KERNELS[name]


def pick_kernel(device: torch.device, dtype: torch.dtype, has_bias: bool, name: str | None = None) -> Kernel:
    """The named kernel (checked), or the best one for this device, dtype and mask."""
    if name is not None:
        kernel = get_kernel(name)
        kernel.check(device, dtype, has_bias)
        return kernel
    if device.type == "cpu":
        return KERNELS["cpu_flash"]
    if device.type == "cuda":
        if dtype in (torch.bfloat16, torch.float16) and not has_bias:
            return KERNELS["cuda_flash"]
        return KERNELS["cuda_efficient"]
    return KERNELS["math"]

"""An fp8 frozen base: the frozen ``nn.Linear`` weights of a LoRA run stored in float8, computed in bf16/fp32.

A LoRA run keeps the whole frozen base on every GPU (DDP), or its 1/N shard (FSDP2); storing those weights in
float8 halves their bytes against bf16. :func:`to_fp8_base` replaces every frozen ``nn.Linear`` by an
:class:`FP8Linear`, a subclass of ``nn.Linear`` (so PEFT still wraps it as a LoRA base layer) whose ``weight``
is a frozen float8 parameter with one scale per output channel (``weight_scale``). Its forward is one
``autograd.Function`` that keeps only the float8 weight and the scale for backward and upcasts them again
there: no full-precision copy of a weight outlives the layer's own forward or backward (diffusers'
``enable_layerwise_casting`` keeps every upcast weight alive until backward and breaks fullgraph compile).

Scales. Unscaled e4m3 (smallest normal 2^-6) pushes typical weights (|w| ~ 1e-2) into its subnormals, so each
row is divided by a scale first (:func:`quantize_fp8`). The scale is the smallest power of two that brings the
row's largest magnitude within the format's range: dividing or multiplying by a power of two is exact in every
binary format, so the dequantized weight ``q * scale`` is the same number in bf16 and fp32 compute, and a scale
cast to bf16 (as FSDP2's bf16 mixed precision casts every parameter it gathers) loses nothing; a power-of-two
scale costs at most one binade at the top of the range against an exact amax scale (relative precision is the
same: float8 is floating point).

``weight_scale`` is a frozen parameter, not a buffer: FSDP2 shards it on dim 0 with the weight, so a rank holds
the scales of exactly the rows it holds, and a sharded loader fills both from :func:`quantize_fp8` of the rows
it reads. It is registered before ``weight`` and kept in the base's dtype (bf16 or fp32), so diffusers'
``ModelMixin.dtype`` (its first floating parameter's dtype), which the Wan and HunyuanVideo pipelines cast their
inputs to, still reports the base's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "FP8Linear",
    "FP8_DTYPES",
    "dequantize_fp8",
    "fp8_weight_error",
    "frozen_bytes",
    "quantize_fp8",
    "to_fp8_base",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# scales live in the base's dtype where every power of two a weight row can need is representable
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _check_fp8_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"the fp8 dtype must be a torch.dtype such as torch.float8_e4m3fn, got {dtype!r}.")
    if dtype not in FP8_DTYPES:
        raise ValueError(
            f"{dtype} is not a float8 storage dtype; use torch.float8_e4m3fn (the usual choice: more mantissa) or "
            "torch.float8_e5m2."
        )
    return dtype


def quantize_fp8(weight: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise scaled float8 of a 2-D weight: ``(q, scale)`` with ``weight ~= q.float() * scale[:, None]``.

    ``scale`` (float32, shape ``(rows,)``) is per row (output channel) the smallest power of two with
    ``amax(|row|) / scale <= finfo(dtype).max`` (1 for an all-zero row); ``q = weight / scale`` rounded to
    ``dtype`` (nearest even). Rows are independent, so quantizing a block of whole rows gives that block's rows of
    quantizing the whole tensor, bit for bit: a loader that reads rows ``[a, b)`` of a weight (FSDP2's dim-0
    shard) calls this on them and gets the local ``q`` and ``scale`` shards. Any floating input dtype; a meta
    tensor gives meta results. A non-finite weight is a ValueError.
    """
    dtype = _check_fp8_dtype(dtype)
    if weight.ndim != 2:
        raise ValueError(
            f"quantize_fp8 takes a 2-D (out_features, in_features) weight, got shape {tuple(weight.shape)}."
        )
    if not weight.is_floating_point() or weight.dtype in FP8_DTYPES:
        raise TypeError(f"quantize_fp8 takes a high-precision floating weight, got {weight.dtype}.")
    fmax = torch.finfo(dtype).max
    amax = weight.detach().abs().amax(dim=1).float()  # exact: abs and max do not round
    if weight.device.type != "meta" and not bool(torch.isfinite(amax).all()):
        raise ValueError("quantize_fp8: the weight holds inf or NaN values; float8 cannot represent them.")
    # 2^e with amax / 2^e in (fmax / 2, fmax]; frexp of the (rounded) quotient gives e to within one, and
    # comparing against fmax * 2^e, which is exact, settles it
    _, e = torch.frexp(amax / fmax)
    e = e + (amax > torch.ldexp(torch.full_like(amax, fmax), e)).int()
    e = e - (amax <= torch.ldexp(torch.full_like(amax, fmax / 2), e)).int()
    e = e.clamp(-126, 127)  # 1 / scale stays a normal float32 (rows below ~1e-36 lose precision, not values)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e), torch.ones_like(amax))
    # dividing by a power of two is exact in bf16 and fp32 (no fp32 copy of a bf16 weight needed); other dtypes
    # go through fp32
    work = weight.detach() if weight.dtype in _SCALE_DTYPES else weight.detach().float()
    q = (work * (1.0 / scale).to(work.dtype).unsqueeze(1)).to(dtype)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale[:, None]`` in ``dtype``: exact for a power-of-two scale (what :func:`quantize_fp8` gives)."""
    w = q.to(dtype)
    scale = scale.to(dtype).unsqueeze(1)
    # a fresh upcast may be scaled in place; an input already in ``dtype`` (FSDP2 gathers the weight upcast under
    # bf16 mixed precision) is FSDP's own tensor and must not be
    return w.mul_(scale) if q.dtype != dtype else w * scale


class _FP8Matmul(torch.autograd.Function):
    """``x @ (q * scale)^T + bias`` in ``dtype``, with no gradient for the (frozen) weight.

    Forward upcasts the float8 weight to ``dtype``, uses it and drops it; only ``q`` and ``scale`` are saved.
    Backward upcasts them again for ``grad_x = grad_out @ W`` (the linear map's transpose, exact as in
    ``F.linear``'s own backward) and, for a trainable bias, ``grad_bias = sum of grad_out over every dim but the
    last``. Autocast is off inside: the caller already chose ``dtype``.
    """

    @staticmethod
    def forward(ctx, x, q, scale, bias, dtype):
        with torch.autocast(x.device.type, enabled=False):
            w = dequantize_fp8(q, scale, dtype)
            out = torch.nn.functional.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(q, scale)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, scale = ctx.saved_tensors
        grad_x = grad_bias = None
        with torch.autocast(grad_out.device.type, enabled=False):
            grad_out = grad_out.to(ctx.dtype)
            if ctx.needs_input_grad[0]:
                grad_x = (grad_out @ dequantize_fp8(q, scale, ctx.dtype)).to(ctx.x_dtype)
            if ctx.needs_input_grad[3]:
                grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None


class FP8Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is stored in float8 with one scale per output channel.

    Parameters: ``weight_scale`` (frozen, shape ``(out_features,)``, the base's dtype: bf16/fp32, else float32),
    ``weight`` (frozen, ``(out_features, in_features)``, float8) and ``bias`` (unchanged: its dtype, its
    ``requires_grad``). The forward computes in ``compute_dtype`` when set, else in the autocast dtype under
    autocast, else in the input's dtype; the output is in the autocast dtype or the input's dtype, like a linear
    layer of the input's dtype. Loading a state dict whose ``weight`` is high precision (an ordinary diffusers
    checkpoint) quantizes it with :func:`quantize_fp8` and sets ``weight_scale``; a float8 ``weight`` loads with
    its ``weight_scale`` as is. Build one with :meth:`from_linear` or :func:`to_fp8_base`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: torch.dtype = torch.float8_e4m3fn,
        compute_dtype: torch.dtype | None = None,
        scale_dtype: torch.dtype = torch.float32,
        device=None,
    ) -> None:
        nn.Module.__init__(self)
        _check_compute_dtype(compute_dtype)
        self.in_features, self.out_features = in_features, out_features
        # compute_dtype is also what PEFT reads to give a LoRA adapter its dtype (None: PEFT leaves it in float32,
        # rather than casting it to the weight's float8)
        self.compute_dtype = compute_dtype
        # registered before weight: ModelMixin.dtype is the first floating parameter's dtype
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=scale_dtype, device=device), False)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=_check_fp8_dtype(dtype), device=device), False
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, dtype: torch.dtype = torch.float8_e4m3fn, compute_dtype: torch.dtype | None = None
    ) -> FP8Linear:
        """The float8 copy of ``linear`` (its bias object reused); on the meta device, the structure only."""
        weight = linear.weight
        scale_dtype = weight.dtype if weight.dtype in _SCALE_DTYPES else torch.float32
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=False,
            dtype=dtype,
            compute_dtype=compute_dtype,
            scale_dtype=scale_dtype,
            device=weight.device,
        )
        new.bias = linear.bias
        if weight.device.type != "meta":
            with torch.no_grad():
                q, scale = quantize_fp8(weight, dtype)
                new.weight.copy_(q)
                new.weight_scale.copy_(scale)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = self.compute_dtype or (torch.get_autocast_dtype(device) if autocast else x.dtype)
        out = _FP8Matmul.apply(x, self.weight, self.weight_scale, self.bias, dtype)
        return out if autocast or out.dtype == x.dtype else out.to(x.dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        # a high-precision weight (a diffusers checkpoint) is quantized here and its scale derived; nn.Module's
        # load_state_dict hands each module a copy of the caller's dict, so rewriting its entries is private
        key = prefix + "weight"
        incoming = state_dict.get(key)
        if isinstance(incoming, torch.Tensor) and incoming.is_floating_point() and incoming.dtype not in FP8_DTYPES:
            if tuple(incoming.shape) == tuple(self.weight.shape):  # (a wrong shape: nn.Module's own error)
                state_dict[key], state_dict[prefix + "weight_scale"] = quantize_fp8(incoming, self.weight.dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight_dtype={self.weight.dtype}, compute_dtype={self.compute_dtype}"


def _check_compute_dtype(compute_dtype) -> None:
    if compute_dtype is not None and compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(
            f"compute_dtype must be None (the input's or autocast's dtype) or one of {list(_COMPUTE_DTYPES)}, "
            f"got {compute_dtype!r}."
        )


def _excluded(name: str, exclude: Sequence[str]) -> bool:
    return any(name == e or name.endswith("." + e) for e in exclude)


def to_fp8_base(
    module: nn.Module,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    compute_dtype: torch.dtype | None = None,
    exclude: Sequence[str] = (),
) -> nn.Module:
    """Replace, in place, every frozen ``nn.Linear`` of ``module`` by an :class:`FP8Linear`; returns ``module``
    (the new layer if ``module`` is itself one such linear).

    Frozen means ``weight.requires_grad`` is False: freeze the base first (``module.requires_grad_(False)``),
    then call this, then add the LoRA adapter (PEFT wraps the float8 layers as it wraps ``nn.Linear``); called
    after PEFT, the frozen base layers inside the LoRA layers are converted and the adapters left alone. Only
    ``nn.Linear`` itself is converted (a subclass may have its own forward); ``exclude`` names modules to keep in
    high precision (a name matches a module path or its dotted suffix, as PEFT's ``target_modules`` do). On the
    meta device only the structure changes: the loader fills the values (:func:`quantize_fp8` or
    :meth:`FP8Linear.load_state_dict`). Call before DDP, FSDP2, compile or CP wrapping.
    """
    _check_fp8_dtype(dtype)
    _check_compute_dtype(compute_dtype)
    if isinstance(exclude, str):
        raise TypeError(f"exclude must be a list of module names, got the string {exclude!r}.")
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise ValueError("to_fp8_base: the module is already sharded (FSDP2); convert it before fully_shard.")

    def convertible(name: str, m: nn.Module) -> bool:
        if type(m) is not nn.Linear:
            return False
        w = m.weight
        return (
            not w.requires_grad and w.is_floating_point() and w.dtype not in FP8_DTYPES and not _excluded(name, exclude)
        )

    if convertible("", module):
        return FP8Linear.from_linear(module, dtype=dtype, compute_dtype=compute_dtype)
    targets = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear) and convertible(name, m)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, child, FP8Linear.from_linear(linear, dtype=dtype, compute_dtype=compute_dtype))
    if not any(isinstance(m, FP8Linear) for m in module.modules()):
        linears = sum(isinstance(m, nn.Linear) for m in module.modules())
        raise ValueError(
            f"to_fp8_base found no frozen nn.Linear in {type(module).__name__} ({linears} nn.Linear, all trainable or "
            "excluded): an fp8 base is for a frozen base (LoRA). Freeze it first (module.requires_grad_(False)) and "
            "add the adapter after."
        )
    return module


def _strip_peft(name: str) -> str:
    return name.replace(".base_layer", "")


def fp8_weight_error(module: nn.Module, reference_state: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Relative RMS error ``||q * scale - w|| / ||w||`` of every :class:`FP8Linear` weight of ``module`` against
    ``reference_state[name]`` (e.g. the bf16 state dict it was converted from; PEFT's ``.base_layer`` is ignored
    in names), computed in float64. Keys: the weights' names in ``module``. A local (unsharded) module."""
    errors = {}
    for name, m in module.named_modules():
        if not isinstance(m, FP8Linear):
            continue
        key = f"{name}.weight" if name else "weight"
        ref = reference_state.get(key, reference_state.get(_strip_peft(key)))
        if ref is None:
            raise KeyError(f"fp8_weight_error: the reference state has no {key!r} (nor {_strip_peft(key)!r}).")
        ref = ref.detach().double()
        err = dequantize_fp8(m.weight.detach(), m.weight_scale.detach(), torch.float64) - ref
        norm = ref.norm().item()
        errors[key] = err.norm().item() / norm if norm > 0 else err.norm().item()
    return errors


def frozen_bytes(module: nn.Module) -> int:
    """Bytes of the frozen parameters this rank holds (a DTensor counts its local shard): the base's footprint."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in module.parameters():
        if not p.requires_grad:
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total

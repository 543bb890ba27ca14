"""Activation bytes from a trace of the real model config on the meta device (nothing is allocated).

The model is built at its real widths with one or two blocks of each kind, given LoRA adapters (PEFT, as the
recipes add them) or trained in full, optionally with diffusers' gradient checkpointing, and run forward and
backward on meta tensors under a dispatch mode that counts the bytes of every live storage an op creates
(parameters and parameter gradients excluded: the state model counts those). Two numbers come out of each
run: the bytes still alive at the end of forward (what autograd saved, plus the output) and the peak during
forward + backward. Differences between the two- and three-block runs give each block kind's bytes; two token
counts give bytes per token; :class:`ActivationFit` scales both to any layer count, batch and tokens per rank.

The trace runs the kernels a CUDA device runs, not the CPU/meta decompositions (the planner plans for GPUs):
attention as a flash kernel saves it (q, k, v, output, fp32 log-sum-exp: no S x S scores), where the meta
device would take SDPA's math path; ``torch.nn.RMSNorm`` (Wan's and Flux's q/k norms) as CUDA's fused
``aten::_fused_rms_norm`` saves it (the input, one fp32 rstd per row and the weight), where CPU and meta
decompose it and keep two fp32 copies of the input (18 of the 91 bytes per token and hidden unit of a
Wan2.1-1.3B block in bf16). diffusers' own ``RMSNorm`` class (HunyuanVideo, QwenImage) is Python ops on every
device and is traced as it is. CP does not change the bytes per token of a block (Ulysses: S x H/u after the
all-to-all, the same bytes as S/u x H), so the fit is per CP rank.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cp_lightning.planner.architectures import ModelSpec


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages created by ops while they are alive, and their peak.

    A storage resized in place (FSDP2 frees and re-allocates its gathered parameters so, outside any op) is
    followed by :meth:`resized`, called by whoever resizes it."""

    def __init__(self, ignore: set) -> None:
        super().__init__()
        self.ignore = ignore
        self.live = self.peak = 0
        self._refs: dict = {}
        self._sizes: dict = {}

    def _free(self, key, _ref=None) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def resized(self, storage) -> None:
        key = StorageWeakRef(storage)
        if key in self._sizes:
            self.live += storage.nbytes() - self._sizes[key]
            self._sizes[key] = storage.nbytes()
            self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            t = getattr(t, "_local_tensor", t)  # a DTensor's bytes are its local shard's
            storage = t.untyped_storage()
            key = StorageWeakRef(storage)
            if key in self._refs or key in self.ignore:
                continue  # a view of a storage already counted, or a parameter
            self._sizes[key] = storage.nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
            self._refs[key] = weakref.ref(storage, functools.partial(self._free, key))
        return out


class _FlashAttention(torch.autograd.Function):
    """What a flash kernel keeps for backward: q, k, v, the output and an fp32 log-sum-exp per query and head."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)  # B, H, S, D
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # B, H, S
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if key.shape[-3] != query.shape[-3]:  # grouped heads: expand as the kernel would see them
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    return _FlashAttention.apply(query, key, value)


class _FusedRMSNorm(torch.autograd.Function):
    """What CUDA's fused RMSNorm keeps for backward: the input, an fp32 rstd per row and the weight.

    The values are exact (fp32 statistics, as the kernel computes them), so the stand-in also runs on real CPU
    tensors; its backward is the RMSNorm derivative: dx = rstd * (g*w - x_hat * mean(g*w * x_hat)).
    """

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        dims = tuple(range(-len(normalized_shape), 0))
        eps = torch.finfo(torch.float32).eps if eps is None else eps
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)  # rows x 1, fp32
        out = (x.float() * rstd).to(x.dtype)
        if weight is not None:
            out = out * weight
        ctx.dims = dims
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        x_hat = x.float() * rstd
        g = grad.float() if weight is None else grad.float() * weight.float()
        dx = rstd * (g - x_hat * (g * x_hat).mean(ctx.dims, keepdim=True))
        dw = None
        if weight is not None and ctx.needs_input_grad[2]:
            reduce = tuple(range(grad.dim() - weight.dim()))
            dw = (grad.float() * x_hat).sum(reduce).to(weight.dtype)
        return dx.to(x.dtype), None, dw, None


def _fused_rms_norm(input, normalized_shape, weight=None, eps=None):
    return _FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps)


@contextlib.contextmanager
def cuda_kernels(device: str = "cuda"):
    """Attention and ``F.rms_norm`` as ``device``'s kernels save them (module docstring), while open: a flash
    kernel on every device; the fused RMSNorm on CUDA only (a CPU process decomposes it, as the meta device)."""
    functional = torch.nn.functional
    originals = functional.scaled_dot_product_attention, functional.rms_norm
    functional.scaled_dot_product_attention = _flash_sdpa
    if device == "cuda":
        functional.rms_norm = _fused_rms_norm
    try:
        yield
    finally:
        functional.scaled_dot_product_attention, functional.rms_norm = originals


def build_meta(spec: ModelSpec, layers: dict[str, int], *, lora_rank: int, dtype: torch.dtype) -> torch.nn.Module:
    """The model at its real widths with ``layers`` blocks of each kind, on the meta device."""
    import diffusers
    from diffusers.utils import logging as diffusers_logging

    config = {k: v for k, v in spec.config.items() if not k.startswith("_")}
    config.update(layers)
    with torch.device("meta"):
        model = getattr(diffusers, spec.family.cls)(**config)
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # "modules to keep in float32": the trace runs in one dtype
    try:
        if lora_rank:
            from peft import LoraConfig

            model.requires_grad_(False)
            targets = list(spec.family.lora_targets)
            model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=targets))
        model.to(dtype)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    return model.train()


def _side(n: int) -> int:
    """The largest divisor of n not above sqrt(n): a near-square grid of n tokens."""
    best = 1
    for d in range(1, int(n**0.5) + 1):
        if n % d == 0:
            best = d
    return best


def make_inputs(spec: ModelSpec, model, *, batch: int, tokens: int, text_tokens: int, dtype: torch.dtype) -> dict:
    """Forward kwargs for ``tokens`` image/video tokens (after patching) and ``text_tokens``, on meta."""
    from cp_lightning.models import CASES

    cfg = model.config
    cls = spec.family.cls
    if cls == "FluxTransformer2DModel":
        h = _side(tokens)
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(tokens // h), indexing="ij")
        inputs = {
            "hidden_states": torch.zeros(batch, tokens, cfg.in_channels, dtype=dtype),
            "encoder_hidden_states": torch.zeros(batch, text_tokens, cfg.joint_attention_dim, dtype=dtype),
            "pooled_projections": torch.zeros(batch, cfg.pooled_projection_dim, dtype=dtype),
            "timestep": torch.full((batch,), 0.5, dtype=dtype),
            "img_ids": torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).to(dtype),
            "txt_ids": torch.zeros(text_tokens, 3, dtype=dtype),
        }
        if cfg.guidance_embeds:
            inputs["guidance"] = torch.full((batch,), 1.0, dtype=dtype)
    elif cls == "QwenImageTransformer2DModel":
        h = _side(tokens)
        inputs = {
            "hidden_states": torch.zeros(batch, tokens, cfg.in_channels, dtype=dtype),
            "encoder_hidden_states": torch.zeros(batch, text_tokens, cfg.joint_attention_dim, dtype=dtype),
            "encoder_hidden_states_mask": torch.ones(batch, text_tokens, dtype=torch.long),
            "timestep": torch.full((batch,), 0.5, dtype=dtype),
            # one list of image shapes per sample, as the pipelines pass them (Qwen-Image-Edit-2511's zero_cond_t
            # reads them so)
            "img_shapes": [[(1, h, tokens // h)]] * batch,
        }
    else:  # Wan and HunyuanVideo: the library's tiny-case inputs read every size from the model's config
        case = CASES[spec.family.case]
        inputs = case.inputs(model, torch.Generator().manual_seed(0), batch, tokens, text_tokens, dtype)
    return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@dataclass(frozen=True)
class Trace:
    saved: int  # bytes alive at the end of forward (autograd's saved tensors and the output)
    peak: int  # the most bytes alive at once during forward + backward


def trace(
    spec: ModelSpec,
    layers: dict[str, int],
    *,
    tokens: int,
    text_tokens: int,
    batch: int = 1,
    lora_rank: int = 0,
    checkpointing: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
) -> Trace:
    """One forward + backward (an fp32 MSE-like loss on the output) on the meta device, with ``device``'s kernels."""
    return _trace(spec.name, _key(spec.config), spec, tuple(sorted(layers.items())), tokens, text_tokens, batch,
                  lora_rank, checkpointing, dtype, device)  # fmt: skip


def _key(config: dict) -> str:
    import json

    return json.dumps(config, sort_keys=True)


@functools.lru_cache(maxsize=512)
def _trace(
    name, config_key, spec, layers, tokens, text_tokens, batch, lora_rank, checkpointing, dtype, device
) -> Trace:
    model = build_meta(spec, dict(layers), lora_rank=lora_rank, dtype=dtype)
    if not lora_rank:
        model.requires_grad_(True)
    if checkpointing:
        model.enable_gradient_checkpointing()
    params = list(model.parameters())
    ignore = {StorageWeakRef(p.untyped_storage()) for p in params}
    for p in params:
        if p.requires_grad:  # parameter gradients belong to the states: drop each as it lands
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    inputs = make_inputs(spec, model, batch=batch, tokens=tokens, text_tokens=text_tokens, dtype=dtype)
    counter = LiveBytes(ignore)
    with cuda_kernels(device), counter:
        out = model(**inputs, return_dict=False)[0]
        loss = out.float().square().mean()
        saved = counter.live
        loss.backward()
    return Trace(saved=saved, peak=counter.peak)


@dataclass(frozen=True)
class ActivationFit:
    """Activation bytes as ``batch x (base + sum_k layers_k x per_layer_k)``, each linear in tokens per rank.

    ``coef[part]`` = (bytes at 0 tokens, bytes per token) for ``part`` in ``base`` and the layer kinds, for
    ``saved`` (end of forward) and ``peak`` (forward + backward).
    """

    saved: dict
    peak: dict
    text_tokens: int
    checkpointing: bool = False

    def bytes(
        self, layers: dict[str, int], tokens: int, batch: int = 1, full: int | None = None
    ) -> tuple[float, float]:
        """(saved, peak) bytes for ``tokens`` per CP rank (joint models: image + text tokens per rank).

        ``full``: the sample's tokens when CP splits them. What the model saves outside its blocks (the patch
        embedding's input and output, of which the split keeps views; the gathered output and the loss) is
        full-sequence on every CP rank; the blocks' bytes and the backward's transients are per CP rank. With
        checkpointing the peak comes in the blocks' backward, after the loss and the gathered output are freed
        (measured on CPU: benchmarks/planner_check.py), so only the end-of-forward bytes get the full sequence.
        """

        def total(coef: dict) -> float:
            a, b = coef["base"]
            value = a + b * tokens
            for kind, n in layers.items():
                a, b = coef[kind]
                value += n * (a + b * tokens)
            return batch * value

        outside = batch * self.saved["base"][1] * (full - tokens) if full is not None else 0.0
        saved, peak = total(self.saved) + outside, total(self.peak) + (0.0 if self.checkpointing else outside)
        return saved, max(peak, saved)

    def per_layer_token(self, kind: str) -> float:
        return self.saved[kind][1]


def fit_activations(
    spec: ModelSpec,
    *,
    lora_rank: int,
    checkpointing: bool,
    text_tokens: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    points: tuple[int, int] = (1024, 2048),
) -> ActivationFit:
    """Traces 1 + kinds runs (two blocks of each kind, and three of one) at two token counts; fits the coefficients."""
    text = spec.family.text_tokens if text_tokens is None else text_tokens
    kinds = spec.family.layer_keys
    # two and three blocks of each kind: with one, the last block's backward overlaps the model's output
    # gradients and the first difference is not the per-block one (measured: 6 vs 2 B/token/hidden, Wan)
    two = {k: 2 for k in kinds}
    variants = [two] + [{**two, k: 3} for k in kinds]

    def x(tokens: int) -> int:  # the fit's variable: tokens per rank through the blocks
        return tokens + text if spec.family.joint else tokens

    runs = {
        t: [
            trace(
                spec,
                v,
                tokens=t,
                text_tokens=text,
                lora_rank=lora_rank,
                checkpointing=checkpointing,
                dtype=dtype,
                device=device,
            )
            for v in variants
        ]
        for t in points
    }
    out = {}
    for field_name in ("saved", "peak"):
        per: dict[str, list[float]] = {}
        for t in points:
            vals = [getattr(r, field_name) for r in runs[t]]
            layer = {k: vals[i + 1] - vals[0] for i, k in enumerate(kinds)}
            per.setdefault("base", []).append(vals[0] - 2 * sum(layer.values()))
            for k in kinds:
                per.setdefault(k, []).append(layer[k])
        x0, x1 = x(points[0]), x(points[1])
        coef = {}
        for part, (v0, v1) in per.items():
            slope = (v1 - v0) / (x1 - x0)
            coef[part] = (v0 - slope * x0, slope)
        out[field_name] = coef
    return ActivationFit(saved=out["saved"], peak=out["peak"], text_tokens=text, checkpointing=checkpointing)

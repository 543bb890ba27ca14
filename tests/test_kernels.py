"""The CUDA kernels' calls, checked on the meta device: every aten call against its schema and the
argument rules torch's CUDA sources impose but the private ops do not check for us.

The rules (torch 2.13, see ../shared/DESIGN.md section 7):
1. flash backward: ``cum_seq_q`` / ``cum_seq_k`` undefined (None); a defined tensor selects the
   variable-length path, which wants int32 offsets.
2. efficient backward: the LSE has the forward's padded length, ceil(S_q / 32) * 32 rows (CUDA), the
   pad rows +inf; the kernel reads them with no bound check.
3. efficient forward and backward: ``attn_bias`` strides of the batch, head and query dims are
   multiples of 8 (16-bit) or 4 (fp32) wherever that dim has more than one element; last dim dense;
   its address a multiple of 16 bytes (the kernels' vector loads; ATen checks only 4, section 9.4).
4. flash: 16-bit inputs, head dim a multiple of 8 and at most 256, no mask.
5. efficient backward: ``out`` laid out as (B, S, H, D) (the kernel takes its row stride as H * D).
6. both backward ops: ``grad_out`` and ``out`` passed laid out as (B, S, H, D), which ATen's copy to that
   layout leaves alone (any other layout is copied on every call).
Meta tensors keep storage offsets, so a slice's address is checked here as on the device.
The flash-attn wrapper is checked against a stand-in module with flash-attn's signatures and layout.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cp_lightning import kernels
from cp_lightning.kernels import KERNELS, pick_kernel

aten = torch.ops.aten
FLASH_FWD = aten._scaled_dot_product_flash_attention.default
FLASH_BWD = aten._scaled_dot_product_flash_attention_backward.default
EFF_FWD = aten._scaled_dot_product_efficient_attention.default
EFF_BWD = aten._scaled_dot_product_efficient_attention_backward.default
WATCHED = (FLASH_FWD, FLASH_BWD, EFF_FWD, EFF_BWD)

B, H, S_Q, S_K, D = 2, 2, 33, 17, 16


class Recorder(TorchDispatchMode):
    """Records the calls of the watched ops with their arguments bound to the schema's names, and the shapes
    of the tensors copied by ``clone`` (``.contiguous()``). With ``fake_outputs`` it runs the watched ops on
    meta copies and returns empty outputs on the inputs' device (for checking argument values on CPU, where
    the CUDA ops have no kernel)."""

    def __init__(self, fake_outputs: bool = False) -> None:
        super().__init__()
        self.calls: list[tuple] = []
        self.clones: list[tuple[int, ...]] = []
        self.fake_outputs = fake_outputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.clone.default:
            self.clones.append(tuple(args[0].shape))
        if func not in WATCHED:
            return func(*args, **kwargs)
        self.calls.append((func, bind(func, args, kwargs)))
        if not self.fake_outputs:
            return func(*args, **kwargs)

        def meta(x):
            return x.to("meta") if isinstance(x, torch.Tensor) else x

        outs = func(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return tuple(torch.empty_like(o, device=device) if isinstance(o, torch.Tensor) else o for o in outs)


def bind(func, args, kwargs) -> dict:
    """Argument name -> value, schema defaults filled in; raises when a value has the wrong kind."""
    schema = func._schema
    assert len(args) <= len(schema.arguments), f"{schema.name}: {len(args)} positional arguments"
    bound = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        else:
            assert arg.has_default_value(), f"{schema.name}: {arg.name} missing"
            value = arg.default_value
        kind = str(arg.type)
        optional = kind.startswith("Optional[")
        base = kind[len("Optional[") : -1] if optional else kind
        if base == "Tensor":  # a None Tensor is an undefined tensor, as autograd passes it
            ok = value is None or isinstance(value, torch.Tensor)
        elif value is None:
            ok = optional
        elif base == "float":
            ok = isinstance(value, (float, int)) and not isinstance(value, bool)
        elif base == "bool":
            ok = isinstance(value, bool)
        elif base == "List[bool]":
            ok = isinstance(value, (list, tuple)) and len(value) == 4 and all(isinstance(b, bool) for b in value)
        elif base in ("int", "SymInt"):
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            raise AssertionError(f"{schema.name}: unexpected argument type {kind}")
        assert ok, f"{schema.name}: {arg.name} ({kind}) got {value!r}"
        bound[arg.name] = value
    assert set(kwargs) <= {a.name for a in schema.arguments}, (schema.name, kwargs)
    return bound


def bias_alignment_errors(bias, dtype) -> list[str]:
    if bias is None:
        return []
    align = 4 if dtype == torch.float32 else 8
    errors = [] if bias.stride(-1) == 1 else [f"last-dim stride {bias.stride(-1)}"]
    for dim, name in enumerate(("batch", "head", "query")):
        if bias.shape[dim] > 1 and bias.stride(dim) % align:
            errors.append(f"{name} stride {bias.stride(dim)} not a multiple of {align}")
    address = bias.storage_offset() * bias.element_size() if bias.is_meta else bias.data_ptr()
    if address % 16:
        errors.append(f"address {address} not a multiple of 16 bytes")
    return errors


def bshd_laid_out(t) -> bool:
    return t.transpose(1, 2).is_contiguous()


def rule_errors(func, a: dict) -> list[str]:
    """Every rule the call breaks (empty: it follows them all)."""
    q, k = a["query"], a["key"]
    b, h, s_q, d = q.shape
    s_k = k.shape[2]
    errors = []
    if func in (FLASH_FWD, FLASH_BWD):
        if q.dtype not in (torch.bfloat16, torch.float16):
            errors.append(f"flash in {q.dtype}")
        if d % 8 or d > 256:
            errors.append(f"flash head dim {d}")
    if func is FLASH_BWD:
        for name in ("cum_seq_q", "cum_seq_k"):
            if a[name] is not None:
                errors.append(f"{name} defined: selects the variable-length path")
        if (a["max_q"], a["max_k"]) != (s_q, s_k):
            errors.append(f"max_q/max_k {a['max_q']}/{a['max_k']}")
        lse = a["logsumexp"]
        if tuple(lse.shape) != (b, h, s_q) or lse.dtype != torch.float32 or not lse.is_contiguous():
            errors.append(f"flash LSE {tuple(lse.shape)} {lse.dtype}")
    if func in (EFF_FWD, EFF_BWD):
        bias = a["attn_bias"]
        if bias is not None and tuple(bias.shape) != (b, h, s_q, s_k):
            errors.append(f"attn_bias shape {tuple(bias.shape)}")
        errors += bias_alignment_errors(bias, q.dtype)
    if func is EFF_FWD and not a["compute_log_sumexp"]:
        errors.append("forward without LSE")
    if func in (EFF_BWD, FLASH_BWD):
        for name in ("grad_out_" if func is EFF_BWD else "grad_out", "out"):
            if name in a and not bshd_laid_out(a[name]):
                errors.append(f"{name} not laid out (B, S, H, D): strides {a[name].stride()}")
    if func is EFF_BWD:
        lse = a["logsumexp"]
        rows = math.ceil(s_q / 32) * 32
        if tuple(lse.shape) != (b, h, rows) or lse.dtype != torch.float32 or not lse.is_contiguous():
            errors.append(f"efficient LSE {tuple(lse.shape)}, the kernel reads {rows} rows")
        if a["grad_input_mask"][3]:
            errors.append("asks for the mask's gradient")
    return errors


def inputs(dtype, mask, device="meta"):
    q = torch.randn(B, H, S_Q, D, dtype=dtype, device=device)
    # K/V as the ring holds them: contiguous B, S, H, D blocks seen as B, H, S, D views
    k, v = (torch.randn(B, S_K, H, D, dtype=dtype, device=device).transpose(1, 2) for _ in range(2))
    bias = None
    if mask is not None:
        bias = torch.zeros(B, H if mask == "head" else 1, 1, S_K, dtype=dtype, device=device)
    return q, k, v, bias


def run_kernel(name, dtype, mask, device="meta", fake_outputs=False):
    q, k, v, bias = inputs(dtype, mask, device)
    kernel = KERNELS[name]
    recorder = Recorder(fake_outputs)
    with recorder:
        out, lse = kernel.forward(q, k, v, bias, None)
        assert out.shape == q.shape and tuple(lse.shape) == (B, H, S_Q) and lse.dtype == torch.float32
        dq, dk, dv = kernel.backward(torch.ones_like(out), q, k, v, out.to(q.dtype), lse, bias, None)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    return recorder.calls


CASES = [
    (name, dtype, mask)
    for name in ("cuda_flash", "cuda_efficient")
    for dtype in (torch.bfloat16, torch.float32)
    for mask in (None, "sample", "head")
]


@pytest.mark.parametrize(("name", "dtype", "mask"), CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_cuda_kernel_calls_follow_the_schemas_and_the_kernels_rules(name, dtype, mask):
    kernel = KERNELS[name]
    refusal = kernel.refusal(torch.device("cuda"), dtype, mask is not None, D)
    if refusal is not None:  # flash in fp32 or with a mask: refused, never called
        assert name == "cuda_flash" and (dtype == torch.float32 or mask is not None), refusal
        with pytest.raises(ValueError, match="cuda_efficient"):
            pick_kernel(torch.device("cuda"), dtype, mask is not None, name, head_dim=D)
        return
    calls = run_kernel(name, dtype, mask)
    expected = (FLASH_FWD, FLASH_BWD) if name == "cuda_flash" else (EFF_FWD, EFF_BWD)
    assert [func for func, _ in calls] == list(expected)
    for func, bound in calls:
        assert rule_errors(func, bound) == [], (func, rule_errors(func, bound))


@pytest.mark.parametrize("mask", [None, "head"])
def test_efficient_backward_pads_the_lse_with_inf_and_passes_the_mask_values(mask):
    q, k, v, bias = inputs(torch.float32, mask, "cpu")
    if bias is not None:
        bias[..., -3:] = float("-inf")
    calls = []
    recorder = Recorder(fake_outputs=True)
    with recorder:
        lse = torch.randn(B, H, S_Q)
        KERNELS["cuda_efficient"].backward(torch.ones_like(q), q, k, v, q.clone(), lse, bias, None)
    calls = recorder.calls
    ((func, bound),) = calls
    padded = bound["logsumexp"]
    assert padded.shape[-1] == 64
    assert torch.equal(padded[..., :S_Q], lse) and torch.isposinf(padded[..., S_Q:]).all()
    if bias is not None:
        assert torch.equal(bound["attn_bias"], bias.expand(B, H, S_Q, S_K))


def test_the_rules_catch_the_bugs_they_describe():
    """The checker itself: calls as the kernels made them before the fixes are flagged."""
    q, k, v, _ = inputs(torch.bfloat16, None)
    old_flash = dict(
        query=q, key=k, cum_seq_q=torch.empty(0), cum_seq_k=torch.empty(0), max_q=S_Q, max_k=S_K,
        logsumexp=torch.empty(B, H, S_Q, device="meta"),
    )  # fmt: skip
    assert any("cum_seq_q" in e for e in rule_errors(FLASH_BWD, old_flash))
    bias = torch.zeros(B, 1, 1, S_K, dtype=torch.bfloat16, device="meta").expand(B, H, S_Q, S_K)
    old_eff = dict(
        query=q,
        key=k,
        attn_bias=bias,
        logsumexp=torch.empty(B, H, S_Q, device="meta"),
        grad_input_mask=[True, True, True, False],
    )
    errors = rule_errors(EFF_BWD, old_eff)
    assert any("batch stride 17" in e for e in errors) and any("reads 64 rows" in e for e in errors)
    # a key chunk of the mask as the ring sliced it (bf16, 1032 keys, from key 258), and out as (B, H, S, D)
    chunk = _chunk_bias(1032, 258, 1032).expand(1, H, S_Q, 1032 - 258)
    q1, k1 = q[:1], torch.empty(1, H, 1032 - 258, D, dtype=torch.bfloat16, device="meta")
    errors = rule_errors(EFF_FWD, dict(query=q1, key=k1, attn_bias=chunk, compute_log_sumexp=True))
    assert errors == ["address 516 not a multiple of 16 bytes"], errors
    old_eff.update(out=torch.empty(B, H, S_Q, D, device="meta"), attn_bias=None)
    assert any(e.startswith("out not laid out (B, S, H, D)") for e in rule_errors(EFF_BWD, old_eff))


@pytest.mark.parametrize(
    ("name", "dtype", "mask", "head_dim", "suggested"),
    [
        ("cuda_flash", torch.float32, False, 64, "cuda_efficient"),
        ("cuda_flash", torch.bfloat16, True, 64, "cuda_efficient"),
        ("cuda_flash", torch.bfloat16, False, 36, "math"),  # no 16-bit kernel takes 36 (issue 44)
        ("cuda_flash", torch.float32, False, 36, "cuda_efficient"),
        ("cuda_flash", torch.bfloat16, False, 512, "cuda_efficient"),
        ("cuda_efficient", torch.float32, False, 64, "cpu_flash"),
        ("cpu_flash", torch.bfloat16, False, 64, "cuda_flash"),
    ],
)
def test_a_kernel_that_cannot_take_the_inputs_names_one_that_can(name, dtype, mask, head_dim, suggested):
    device = "cpu" if name == "cuda_efficient" else "cuda"
    with pytest.raises(ValueError, match=f"{name!r}.*Pick one that can.*{suggested}"):
        pick_kernel(torch.device(device), dtype, mask, name, head_dim=head_dim)


def test_default_cuda_kernels_follow_mask_dtype_and_head_dim(monkeypatch):
    monkeypatch.setattr(kernels, "_flash_attn_interface", lambda: None)
    cuda = torch.device("cuda")
    assert pick_kernel(cuda, torch.bfloat16, False, head_dim=64).name == "cuda_flash"
    assert pick_kernel(cuda, torch.bfloat16, True, head_dim=64).name == "cuda_efficient"
    assert pick_kernel(cuda, torch.float32, False, head_dim=64).name == "cuda_efficient"
    assert pick_kernel(cuda, torch.float32, True, head_dim=36).name == "cuda_efficient"
    # 16-bit efficient kernels exist only for head dims that are multiples of 8 ("no kernel found to launch"):
    # neither flash nor efficient takes 36 in bf16/fp16, so the exact fp32 math kernel runs
    for dtype in (torch.bfloat16, torch.float16):
        for masked in (False, True):
            with pytest.warns(UserWarning, match="no CUDA kernel takes .* head dim 36.*'math'"):
                assert pick_kernel(cuda, dtype, masked, head_dim=36).name == "math", (dtype, masked)
    with pytest.warns(UserWarning, match="'math'"):
        assert pick_kernel(cuda, torch.float32, False, head_dim=34).name == "math"
    with pytest.raises(ValueError, match=r"'cuda_efficient' needs a head dim that is a multiple of 8.*'math'"):
        pick_kernel(cuda, torch.bfloat16, True, "cuda_efficient", head_dim=36)
    with pytest.raises(ValueError, match="'flash_attn' is not available"):
        pick_kernel(cuda, torch.bfloat16, False, "flash_attn", head_dim=64)


def _chunk_bias(keys: int, lo: int, hi: int, dtype=torch.bfloat16):
    """The ring's mask slice for keys [lo, hi) of a block of ``keys``: a view at a storage offset."""
    return torch.zeros(1, 1, 1, keys, dtype=dtype, device="meta")[..., lo:hi]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("keys", [16, 1032, 1040, 4103])
def test_efficient_kernels_get_aligned_masks_for_every_key_chunk(keys, dtype):
    """bf16, 1032 keys: the ring backward's second chunk starts at key 258, 516 bytes into the mask. Its
    strides are fine at batch 1 and ATen's host check passes it; the kernel's 16-byte loads fault."""
    quarter = keys // 4  # the ring backward's chunk boundary on the CPU (and on CUDA before issue 44)
    slices = {(0, keys), (0, quarter), (quarter, keys), (quarter // 128 * 128, keys), (1, keys), (3, keys - 2)}
    for lo, hi in sorted(slices):
        bias = _chunk_bias(keys, lo, hi, dtype)
        q = torch.empty(1, H, 5, D, dtype=dtype, device="meta")
        k = v = torch.empty(1, H, hi - lo, D, dtype=dtype, device="meta")
        recorder = Recorder()
        with recorder:
            out, lse = KERNELS["cuda_efficient"].forward(q, k, v, bias, None)
            KERNELS["cuda_efficient"].backward(torch.empty_like(out), q, k, v, out, lse, bias, None)
        for func, bound in recorder.calls:
            assert bias_alignment_errors(bound["attn_bias"], dtype) == [], (func, lo, hi)
            assert torch.equal(torch.tensor(bound["attn_bias"].shape), torch.tensor([1, H, 5, hi - lo]))


def test_ring_key_chunks_on_an_accelerator_fall_on_multiples_of_128_keys():
    from cp_lightning.ring import _key_chunks

    assert _key_chunks(1032) == [(0, 258), (258, 1032)]  # the CPU's quarter
    assert _key_chunks(1032, True, 128) == [(0, 256), (256, 1032)]
    assert _key_chunks(100, True, 128) == [(0, 25), (25, 100)]  # too short to round: the quarter
    assert _key_chunks(1032, False, 128) == [(0, 1032)]
    assert _key_chunks(3) == [(0, 3)]


def test_ring_backward_runs_whole_blocks_on_cuda_unless_memory_is_short(monkeypatch):
    from cp_lightning import ring

    cuda = torch.device("cuda")
    monkeypatch.setattr(ring, "_spare_bytes", lambda device: 10**12)
    assert ring._chunked(torch.device("cpu"), 10**9) and not ring._chunked(cuda, 10**9)
    monkeypatch.setattr(ring, "_spare_bytes", lambda device: 10**9)
    assert ring._chunked(cuda, 10**9)


@pytest.mark.parametrize("name", ["cuda_efficient", "cuda_flash"])
def test_backward_takes_out_and_grad_out_in_any_layout_and_copies_neither_in_the_rings(name):
    """The efficient backward misreads an ``out`` stored contiguous as (B, H, S, D) (silently wrong masked
    gradients): the wrapper lays it out as (B, S, H, D). In the ring's own layout nothing is copied: ATen
    copies grad_out to (B, S, H, D) unless it already is, so a ``.contiguous()`` of the (B, H, S, D) view
    made two copies of dO per call."""
    dtype = torch.bfloat16
    q, k, v, _ = inputs(dtype, None)
    lse = torch.empty(B, H, S_Q, device="meta")
    ring_layout = torch.empty(B, S_Q, H, D, dtype=dtype, device="meta").transpose(1, 2)  # what the ring holds
    bhsd = torch.empty(B, H, S_Q, D, dtype=dtype, device="meta")  # contiguous (B, H, S, D)
    for out, dout, copies in ((ring_layout, ring_layout, 0), (bhsd, bhsd, 2)):
        recorder = Recorder()
        with recorder:
            KERNELS[name].backward(dout, q, k, v, out, lse, None, None)
        ((func, bound),) = recorder.calls
        assert rule_errors(func, bound) == [], rule_errors(func, bound)
        assert sum(shape in ((B, H, S_Q, D), (B, S_Q, H, D)) for shape in recorder.clones) == copies, recorder.clones


# ----- flash-attn, through a stand-in with its signatures and (B, S, H, D) layout ----------------------


def _stand_in_flash_attn():
    """A module shaped like flash-attn 2.8: the LSE-returning private functions, math inside, and the
    checks the real ones make (layout, dtype, contiguous last dim, head dim, output buffers)."""

    def check(*tensors):
        for t in tensors:
            assert t.dim() == 4 and t.stride(-1) == 1, (t.shape, t.stride())
            assert t.dtype in (torch.bfloat16, torch.float16), t.dtype

    def forward(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi, return_softmax):
        check(q, k, v)
        assert q.shape[-1] % 8 == 0 and dropout_p == 0.0 and not causal and alibi is None
        out, lse = KERNELS["math"].forward(*(t.transpose(1, 2) for t in (q, k, v)), None, softmax_scale)
        return out.transpose(1, 2).contiguous(), lse.contiguous(), None, torch.empty(2, dtype=torch.int64)

    def backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal, wl, wr, softcap, alibi, det, rng):
        check(dout, q, k, v, out, dq, dk, dv)
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
        for buffer, like in ((dq, q), (dk, k), (dv, v)):
            assert buffer.shape == like.shape and buffer.is_contiguous()
        grads = KERNELS["math"].backward(*(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, None, scale)
        for buffer, grad in zip((dq, dk, dv), grads, strict=True):
            buffer.copy_(grad.transpose(1, 2))
        return torch.empty_like(lse)

    package = types.ModuleType("flash_attn")
    package.__version__ = "2.8.3"
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_forward, interface._flash_attn_backward = forward, backward
    package.flash_attn_interface = interface
    return package, interface


@pytest.fixture
def flash_attn_installed(monkeypatch):
    package, interface = _stand_in_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    kernels._flash_attn_interface.cache_clear()
    yield
    kernels._flash_attn_interface.cache_clear()


def test_flash_attn_is_the_default_for_unmasked_half_precision_when_installed(flash_attn_installed):
    cuda = torch.device("cuda")
    assert pick_kernel(cuda, torch.bfloat16, False, head_dim=64).name == "flash_attn"
    assert pick_kernel(cuda, torch.float16, False, head_dim=64).name == "flash_attn"
    assert pick_kernel(cuda, torch.bfloat16, True, head_dim=64).name == "cuda_efficient"
    assert pick_kernel(cuda, torch.float32, False, head_dim=64).name == "cuda_efficient"


def test_an_old_flash_attn_is_not_used(flash_attn_installed):
    sys.modules["flash_attn"].__version__ = "2.6.3"
    kernels._flash_attn_interface.cache_clear()
    assert not KERNELS["flash_attn"].available()
    assert pick_kernel(torch.device("cuda"), torch.bfloat16, False, head_dim=64).name == "cuda_flash"


def test_flash_attn_wrapper_matches_the_math_kernel_in_a_simulated_ring(flash_attn_installed):
    from benchmarks.gpu_steps import reference_attention, simulated_ring

    torch.manual_seed(0)
    q = torch.randn(B, H, S_Q, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, S_Q, H, D, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    dout = torch.randn(B, H, S_Q, D, dtype=torch.bfloat16)
    for blocks in (1, 3):
        got = simulated_ring(KERNELS["flash_attn"], q, k, v, None, dout, blocks)
        want = simulated_ring(KERNELS["math"], q, k, v, None, dout, blocks)
        ref = reference_attention(q, k, v, None, dout)
        for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, want, ref, strict=True):
            assert a.shape == r.shape, name
            assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=0), (name, blocks)
            assert torch.allclose(a.float(), r.float(), atol=3e-2, rtol=0), (name, blocks)

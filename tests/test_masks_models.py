"""Masks at the model level: SkyReels-V2 diffusion forcing (``num_frame_per_block > 1``) under CP (issue 45).

The library rows (tests/test_library.py, ``skyreels-v2-df-block2`` / ``-block3``) prove the model exact against
diffusers' own dense-mask forward. Here, in one spawned group of 2 processes (cp 2, Ulysses and ring):

* the causality probe: perturbing the last block's input frames leaves every earlier frame's outputs, and the
  gradients of a loss over them w.r.t. the earlier inputs, bitwise unchanged, gives the perturbed frames no
  gradient at all, and changes the last block's outputs; the same probe on the model without blocks (full
  attention) sees the earlier outputs change, so a dropped mask fails it;
* a tail block shorter than the rest (diffusers crashes on it) equals one process given the spec's dense mask;
* no S x S tensor: at 8,192 tokens no tensor of S^2 / 8 elements or more is made, forward or backward, where
  the stock model in one process makes its (1, 1, S, S) mask.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cp_lightning.check import GRAD_TOL, OUT_TOL
from tests.conftest import module_selected, selected
from tests.distributed import spawn

MODES = {"ulysses": 1, "ring": 2}  # cp 2: ring degree
# case -> (num_frame_per_block, frames, frame tokens, frames of the last block, checkpointing)
PROBES = {
    "blocks": (2, 6, 3, 2, False),  # 3 blocks of 2 frames, 18 tokens (9 per rank: shards cut frames)
    "blocks-ckpt": (2, 6, 3, 2, True),  # the spec reaches the blocks' recomputation in backward
    "tail": (3, 7, 3, 1, False),  # blocks of 3, 3 and 1 frames, 21 tokens (11 / 10)
    "full": (1, 6, 3, 2, False),  # control: no blocks, the perturbation reaches every frame
}
PROBE_ROWS = [(mode, case) for mode in MODES for case in PROBES]
LONG = (32, 16, 16, 4)  # frames, height, width (tokens per frame 256), frames per block: S = 8,192


def _model(per_block: int, *, layers: int = 2, heads: int = 4, head_dim: int = 12):
    from diffusers import SkyReelsV2Transformer3DModel

    from cp_lightning.parity import _wake

    torch.manual_seed(0)
    config = dict(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=layers, rope_max_seq_len=64, num_frame_per_block=per_block,
    )  # fmt: skip
    model = SkyReelsV2Transformer3DModel(**config)
    _wake(model, 100)
    return model


def _inputs(frames: int, height: int, width: int, batch: int = 2):
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(batch, 4, frames, height, width, generator=g),
        "encoder_hidden_states": torch.randn(batch, 7, 16, generator=g),
        "timestep": torch.randint(0, 1000, (batch, frames), generator=g),
        "enable_diffusion_forcing": True,
        "return_dict": False,
    }


def _probe(model, inputs, earlier: int) -> tuple:
    """Outputs and the input gradient of a fixed-weight loss over the first ``earlier`` frames' outputs."""

    x = inputs["hidden_states"].clone().requires_grad_(True)
    out = model(**{**inputs, "hidden_states": x})[0]
    weights = torch.randn(out[:, :, :earlier].shape, generator=torch.Generator().manual_seed(7))
    (out[:, :, :earlier] * weights).sum().backward()
    return out.detach(), x.grad


def _causality(mesh, ring: int, case: str) -> dict:

    from cp_lightning import parallelize, remove
    from cp_lightning.tiny import checkpoint

    per_block, frames, frame_tokens, last, ckpt = PROBES[case]
    model = _model(per_block)
    if ckpt:
        model.enable_gradient_checkpointing(checkpoint)
    parallelize(model, mesh=mesh, ring=ring)
    inputs = _inputs(frames, 2, 2 * frame_tokens)
    earlier = frames - last
    out, grad = _probe(model, inputs, earlier)
    x = inputs["hidden_states"].clone()
    x[:, :, earlier:] += torch.randn(x[:, :, earlier:].shape, generator=torch.Generator().manual_seed(3))
    out2, grad2 = _probe(model, {**inputs, "hidden_states": x}, earlier)
    remove(model)
    return {
        "earlier outputs equal": torch.equal(out[:, :, :earlier], out2[:, :, :earlier]),
        "earlier gradients equal": torch.equal(grad[:, :, :earlier], grad2[:, :, :earlier]),
        "gradients reach the earlier inputs": bool(grad[:, :, :earlier].any()),
        "last inputs get no gradient": not grad[:, :, earlier:].any() and not grad2[:, :, earlier:].any(),
        "last outputs changed": not torch.equal(out[:, :, earlier:], out2[:, :, earlier:]),
    }


def _tail_block(mesh, ring: int) -> dict:
    """7 frames in blocks of 3 under CP against one process with diffusers' attention given the spec's dense mask
    (the stock forward cannot build a mask for a tail block)."""

    from cp_lightning import parallelize, remove
    from cp_lightning.masks import block_causal
    from cp_lightning.mesh import cp_groups
    from cp_lightning.parity import grad_errors, grads
    from tests.distributed import sum_over

    per_block, frames, frame_tokens, _, _ = PROBES["tail"]
    inputs = _inputs(frames, 2, 2 * frame_tokens)
    weights = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator().manual_seed(7))
    reference = _model(1)  # no mask of its own: the hooks below hand its self-attention the dense one
    dense = block_causal(frames, frame_tokens, per_block).to_dense()[None, None]
    handles = [b.attn1.register_forward_pre_hook(lambda _m, a: (*a[:2], dense, *a[3:])) for b in reference.blocks]
    ref_out = reference(**inputs)[0]
    (ref_out * weights).sum().backward()
    for handle in handles:
        handle.remove()
    model = _model(per_block)
    parallelize(model, mesh=mesh, ring=ring)
    out = model(**inputs)[0]
    (out * weights).sum().backward()
    remove(model)
    got = grads([model])
    sum_over(got.values(), cp_groups(mesh, ring).cp)
    errs = grad_errors(got, grads([reference]))
    return {"out_err": (out - ref_out).abs().max().item(), "grad_err": max(errs.values())}


class _Largest(TorchDispatchMode):
    """Records the largest tensor (by elements) any operation returns while active, and that operation."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def _no_square(mesh, rank: int) -> dict:
    """SkyReels-V2 DF at 8,192 tokens, 1 layer of 2 heads x 8: the largest tensor made under CP (forward and
    backward, Ulysses and ring) and, on rank 0, by the stock model in one process (forward)."""

    from cp_lightning import parallelize, remove

    frames, height, width, per_block = LONG
    inputs = _inputs(frames, 2 * height, 2 * width, batch=1)
    out = {}
    for mode, ring in MODES.items():
        model = _model(per_block, layers=1, heads=2, head_dim=8)
        parallelize(model, mesh=mesh, ring=ring)
        with _Largest() as largest:
            model(**inputs)[0].sum().backward()
        remove(model)
        out[mode] = (largest.numel, largest.op)
    if rank == 0:
        model = _model(per_block, layers=1, heads=2, head_dim=8)
        with torch.no_grad(), _Largest() as largest:
            model(**inputs)
        out["stock"] = (largest.numel, largest.op)
    return out


def _group(rank, world, probes, tail, square):
    from cp_lightning import build_mesh
    from cp_lightning.mesh import cp_groups

    mesh = build_mesh(2)
    cp_groups(mesh, 2)  # the ring's groups, created collectively up front
    results = {row: _causality(mesh, MODES[row[0]], row[1]) for row in probes}
    for mode in MODES if tail else ():
        results[("tail", mode)] = _tail_block(mesh, MODES[mode])
    if square:
        results["square"] = _no_square(mesh, rank)
    return results


@pytest.fixture(scope="module")
def results(request):
    """Each rank's results (the probes' and the tail's are asserted on both)."""
    tail = module_selected(request, "test_a_tail_block_under_cp_equals_one_process_with_the_specs_dense_mask")
    square = module_selected(request, "test_no_s_by_s_tensor_at_8k_tokens")
    return spawn(_group, 2, selected(request, "probe"), tail, square, timeout_s=600)


@pytest.mark.parametrize("probe", PROBE_ROWS, ids=[f"{case}-{mode}" for mode, case in PROBE_ROWS])
def test_causality_probe(results, probe):
    r = {name: all(rank[probe][name] for rank in results) for name in results[0][probe]}
    assert r["last outputs changed"] and r["gradients reach the earlier inputs"], r
    if probe[1] == "full":  # the probe can fail: without the mask the perturbation reaches every frame
        assert not r["earlier outputs equal"] and not r["last inputs get no gradient"], r
        return
    assert r["earlier outputs equal"] and r["earlier gradients equal"] and r["last inputs get no gradient"], r


@pytest.mark.parametrize("mode", list(MODES))
def test_a_tail_block_under_cp_equals_one_process_with_the_specs_dense_mask(results, mode):
    for r in (rank[("tail", mode)] for rank in results):
        assert r["out_err"] <= OUT_TOL and r["grad_err"] <= GRAD_TOL, r


def test_no_s_by_s_tensor_at_8k_tokens(results):
    """Issue 45's acceptance: nothing of S^2 / 8 elements (a boolean S x S mask is 64 MiB here) under CP, forward
    and backward; the stock forward in one process builds its (1, 1, S, S) mask, so the probe can fail."""
    length = LONG[0] * LONG[1] * LONG[2]
    r = results[0]["square"]
    assert r["stock"][0] >= length * length, r
    for mode in MODES:
        assert all(rank["square"][mode][0] < length * length // 8 for rank in results), [r["square"] for r in results]

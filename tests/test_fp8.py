"""The fp8 frozen base (cp_lightning.fp8): quantization, layers, loading, and the model under CP, DDP, FSDP2, compile.

One spawned gloo group of 2 runs every multi-process case; each worker also computes the one-process reference
(the same seeded tiny Flux with the same fp8 weights and LoRA), so each case compares locally: cp=2 Ulysses and
ring, DDP over the CP group, FSDP2 at 32-true (fp8, fp32 and the LoRA's fp32 in one unit) and at bf16 mixed
precision, all with gradient checkpointing, and torch.compile(fullgraph=True) of the CP model (aot_eager, no
recompiles after the first step). Tolerances: fp32 outputs 1e-5, LoRA gradients 1e-4 relative.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cp_lightning.fp8 import FP8Linear, dequantize_fp8, fp8_weight_error, frozen_bytes, quantize_fp8, to_fp8_base
from tests.distributed import spawn, sum_over

OUT_TOL, GRAD_TOL = 1e-5, 1e-4
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp", "proj_out", "ff.net.2"]


# -- the model and one step (worker and single-process side) --------------------------------------------------
def lora_flux(dtype=torch.float32, fp8: bool = True, ckpt: bool = True) -> nn.Module:
    """The tiny Flux, frozen, its linears in fp8 (``fp8``), a seeded LoRA with non-zero B (so every LoRA weight
    has a gradient), gradient checkpointing."""
    from peft import LoraConfig

    from cp_lightning.tiny import tiny_model

    model = tiny_model("flux").to(dtype).requires_grad_(False)
    if fp8:
        model = to_fp8_base(model)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    if ckpt:
        model.enable_gradient_checkpointing()
    return model.train()


def inputs_of(model, seed: int, dtype=torch.float32) -> dict:
    from cp_lightning.tiny import tiny_inputs

    return tiny_inputs("flux", model, tokens=16, text_tokens=7, seed=seed, dtype=dtype)


def step(run, model, inputs, group=None, autocast=False):
    """Output and LoRA gradients (full tensors; summed over ``group``, the CP convention, when given)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = run(**inputs, return_dict=False)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out.float() * weights).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            grads[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            p.grad = None
    if group is not None:
        sum_over(grads.values(), group)
    grads = {name: g.float() for name, g in grads.items()}
    return out.detach().float(), grads


def errors(got, want) -> tuple[float, float]:
    out_err = (got[0] - want[0]).abs().max().item()
    grad_err = max((got[1][n] - g).abs().max().item() / max(g.abs().max().item(), 1e-8) for n, g in want[1].items())
    return out_err, grad_err


# -- the spawned cases --------------------------------------------------------------------------------------
def cp_cases(mesh, reference) -> dict:
    from cp_lightning import parallelize
    from cp_lightning.data_parallel import prepare_ddp, register_ddp_hook

    out = {}
    for ring in (1, 2):
        model = lora_flux()
        parallelize(model, mesh=mesh, ring=ring)
        out[f"cp2-ring{ring}"] = errors(step(model, model, inputs_of(model, 10), mesh["cp"].get_group()), reference)
    model = lora_flux()
    parallelize(model, mesh=mesh, ring=1)
    prepare_ddp(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    register_ddp_hook(ddp, 1, False)
    out["ddp-cp2"] = errors(step(ddp, model, inputs_of(model, 10)), reference)
    out["ddp-ignored"] = sorted(ddp.parameters_to_ignore)[:2]
    return out


def fsdp_cases(mesh, reference, reference_bf16) -> dict:
    from torch.distributed.tensor import DTensor

    from cp_lightning import parallelize
    from cp_lightning.sharding import FSDPOptions, apply_fsdp

    out = {}
    for name, options, autocast, ref in (
        ("fsdp-32", FSDPOptions(), False, reference),
        ("fsdp-bf16", FSDPOptions(param_dtype=torch.bfloat16), True, reference_bf16),
    ):
        model = lora_flux()
        parallelize(model, mesh=mesh, ring=1)
        apply_fsdp(model, mesh=mesh, plan=None, options=options, loss_parallel=False)
        out[name] = errors(step(model, model, inputs_of(model, 10), autocast=autocast), ref)
        weight = model.transformer_blocks[0].attn.to_q.base_layer.weight
        out[name + "-storage"] = (str(weight.to_local().dtype), isinstance(weight, DTensor))
    # the LoRA export of the sharded fp8 model: only the adapter is gathered (gloo has no float8 all-gather)
    from peft.utils import get_peft_model_state_dict

    from cp_lightning.sharding import lora_state_dict

    exported, want = lora_state_dict(model), get_peft_model_state_dict(lora_flux())
    out["lora-export"] = sorted(exported) == sorted(want) and all(torch.equal(exported[k], want[k]) for k in want)
    out["lora-export"] = out["lora-export"] if dist.get_rank() == 0 else exported == {}
    # frozen-base bytes this rank holds, fp8 against the same model with a bf16 base
    bf16 = lora_flux(torch.bfloat16, fp8=False)
    parallelize(bf16, mesh=mesh, ring=1)
    apply_fsdp(bf16, mesh=mesh, plan=None, options=FSDPOptions(), loss_parallel=False)
    out["bytes"] = (frozen_bytes(model), frozen_bytes(bf16))
    return out


def compile_cases(mesh) -> dict:
    import torch._dynamo

    from cp_lightning import parallelize

    out = {}
    for ring in (1, 2):
        torch._dynamo.reset()
        eager, compiled = lora_flux(), lora_flux()
        for model in (eager, compiled):
            parallelize(model, mesh=mesh, ring=ring)
        run = torch.compile(compiled, fullgraph=True, backend="aot_eager")
        worst = [0.0, 0.0]
        try:
            for i in range(3):
                torch._dynamo.config.error_on_recompile = i > 0
                inputs = inputs_of(eager, 20 + i)
                got = step(run, compiled, inputs, mesh["cp"].get_group())
                want = step(eager, eager, inputs, mesh["cp"].get_group())
                worst = [max(a, b) for a, b in zip(worst, errors(got, want), strict=True)]
        finally:
            torch._dynamo.config.error_on_recompile = False
        out[f"compile-ring{ring}"] = (*worst, torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return out


def worker(rank: int, world: int) -> dict:
    from cp_lightning import build_mesh

    mesh = build_mesh(world)  # dp 1 x cp 2
    one = lora_flux()
    reference = step(one, one, inputs_of(one, 10))
    reference_bf16 = step(one, one, inputs_of(one, 10), autocast=True)
    return {**cp_cases(mesh, reference), **fsdp_cases(mesh, reference, reference_bf16), **compile_cases(mesh)}


@pytest.fixture(scope="module")
def results():
    per_rank = spawn(worker, 2, timeout_s=600)
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


@pytest.mark.parametrize("case", ["cp2-ring1", "cp2-ring2", "ddp-cp2", "fsdp-32"])
def test_cp_ddp_fsdp_equal_one_process_with_the_same_fp8_weights(results, case):
    for out_err, grad_err in results[case]:
        assert out_err <= OUT_TOL and grad_err <= GRAD_TOL, (case, out_err, grad_err)


def test_ddp_broadcasts_the_fp8_weights_itself_and_hides_them_from_ddp(results):
    # gloo has no float8: DDP's own broadcast of them would raise "Invalid scalar type"
    for ignored in results["ddp-ignored"]:
        assert ignored and all(name.endswith(".weight") for name in ignored), ignored


def test_the_lora_of_a_sharded_fp8_model_exports_without_gathering_the_base(results):
    assert results["lora-export"] == [True, True]


def test_fsdp_keeps_sharded_fp8_storage(results):
    for name in ("fsdp-32", "fsdp-bf16"):
        assert all(r == ("torch.float8_e4m3fn", True) for r in results[name + "-storage"]), results[name]
    for out_err, grad_err in results["fsdp-bf16"]:  # bf16 compute on both sides, reduction orders differ
        assert out_err <= 5e-2 and grad_err <= 5e-2, (out_err, grad_err)
    for fp8, bf16 in results["bytes"]:  # the tiny model's rows are 16-64 wide: the scales weigh 4-12% here
        assert fp8 < 0.6 * bf16, (fp8, bf16)


@pytest.mark.parametrize("ring", [1, 2])
def test_compile_fullgraph_of_the_cp_fp8_model_equals_eager_without_recompiles(results, ring):
    for out_err, grad_err, graphs in results[f"compile-ring{ring}"]:
        assert graphs >= 1 and out_err <= OUT_TOL and grad_err <= GRAD_TOL, (out_err, grad_err, graphs)


# -- single process -------------------------------------------------------------------------------------
def test_the_autograd_function_equals_a_linear_on_the_dequantized_weight():
    torch.manual_seed(0)
    linear = nn.Linear(48, 32).requires_grad_(False)
    linear.bias.requires_grad_(True)  # a trainable bias gets its gradient
    layer = to_fp8_base(linear)
    assert isinstance(layer, FP8Linear) and isinstance(layer, nn.Linear) and layer.bias is linear.bias
    ref = nn.Linear(48, 32)
    with torch.no_grad():
        ref.weight.copy_(dequantize_fp8(layer.weight, layer.weight_scale, torch.float32))
        ref.bias.copy_(layer.bias)
    x = torch.randn(2, 5, 48, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    layer(x).square().sum().backward()
    ref(x_ref).square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.allclose(layer.bias.grad, ref.bias.grad, rtol=1e-6)
    assert layer.weight.grad is None and layer.weight.dtype == torch.float8_e4m3fn
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    # compute_dtype: fp32 math for a bf16 input, the output in the input's dtype
    fp32 = FP8Linear.from_linear(nn.Linear(48, 32).requires_grad_(False), compute_dtype=torch.float32)
    assert fp32(x.bfloat16()).dtype == torch.bfloat16


def test_scales_are_powers_of_two_rows_are_independent_and_bf16_input_quantizes_alike():
    w = torch.randn(64, 80) * torch.logspace(-4, 0, 64).unsqueeze(1)
    w[3] = 0
    q, scale = quantize_fp8(w)
    assert scale.dtype == torch.float32 and torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    amax = q.float().abs().amax(1)
    assert (((amax >= 224) & (amax <= 448)) | (amax == 0)).all()  # the top binade (224 is a rounded-down 224+)
    q_rows, s_rows = quantize_fp8(w[10:30])  # a loader's dim-0 shard
    assert torch.equal(q_rows.view(torch.uint8), q[10:30].view(torch.uint8)) and torch.equal(s_rows, scale[10:30])
    qb, sb = quantize_fp8(w.bfloat16())
    qf, sf = quantize_fp8(w.bfloat16().float())
    assert torch.equal(qb.view(torch.uint8), qf.view(torch.uint8)) and torch.equal(sb, sf)
    # a power-of-two scale: dequantizing in bf16 is exact
    assert torch.equal(dequantize_fp8(q, scale, torch.bfloat16).float(), dequantize_fp8(q, scale, torch.float32))


def test_the_per_channel_scale_beats_unscaled_e4m3_on_small_weights():
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 2e-3
    q, scale = quantize_fp8(w)
    scaled = ((dequantize_fp8(q, scale, torch.float32) - w).norm() / w.norm()).item()
    unscaled = ((w.to(torch.float8_e4m3fn).float() - w).norm() / w.norm()).item()
    assert scaled < 0.04 and unscaled > 5 * scaled, (scaled, unscaled)  # measured: 0.026 against 0.24


def test_quantization_error_against_bf16_per_tensor(capsys):
    from cp_lightning.tiny import tiny_model

    for name in ("flux", "wan"):
        model = tiny_model(name).bfloat16().requires_grad_(False)
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        errs = fp8_weight_error(to_fp8_base(model), reference)
        assert len(errs) == sum(isinstance(m, FP8Linear) for m in model.modules()) > 5
        assert max(errs.values()) < 0.05, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
        with capsys.disabled():
            print(
                f"\n{name}: fp8 e4m3 relative RMS error vs bf16 over {len(errs)} weights: "
                f"mean {sum(errs.values()) / len(errs):.4f}, max {max(errs.values()):.4f}"
            )


def test_a_high_precision_state_dict_loads_into_a_converted_model_as_converting_after_load():
    from cp_lightning.tiny import tiny_model

    loaded = tiny_model("flux", seed=0).requires_grad_(False)
    state = {k: v.clone() for k, v in loaded.state_dict().items()}  # an ordinary diffusers state dict
    want = to_fp8_base(loaded).state_dict()
    other = to_fp8_base(tiny_model("flux", seed=5).requires_grad_(False))
    assert other.load_state_dict(state, strict=True).missing_keys == []
    with torch.device("meta"):  # structure on meta, values from the state dict (assign)
        meta = tiny_model("flux", seed=0).requires_grad_(False)
    meta = to_fp8_base(meta)
    assert meta.transformer_blocks[0].attn.to_q.weight.device.type == "meta"
    meta.load_state_dict(state, assign=True)
    for model in (other, meta):
        got = model.state_dict()
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
        assert not any(p.requires_grad for p in model.parameters())
    # a float8 state dict (a converted model's own) loads as is
    other.load_state_dict(want)
    assert torch.equal(other.state_dict()["proj_out.weight_scale"], want["proj_out.weight_scale"])


def test_model_dtype_still_reports_the_base_dtype():
    from cp_lightning.tiny import tiny_model

    # the tiny Flux's first parameter is a linear's: the scale (bf16) is registered before the fp8 weight
    for name in ("flux", "wan"):
        model = to_fp8_base(tiny_model(name).bfloat16().requires_grad_(False))
        assert next(model.parameters()).dtype == torch.bfloat16 or name != "flux"
        assert model.dtype == torch.bfloat16, name  # what the Wan and HunyuanVideo pipelines cast inputs to


def test_frozen_base_bytes_halve_against_bf16_at_real_scale(capsys):
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    from tests.test_recipes import ROOT

    ratios = {}
    for cls, name in (
        (FluxTransformer2DModel, "flux1-dev"),
        (WanTransformer3DModel, "wan2.1-t2v-14b"),
    ):
        config = json.loads((ROOT / "configs" / "architectures" / f"{name}-transformer.json").read_text())
        with torch.device("meta"):
            model = cls.from_config(config).to(torch.bfloat16).requires_grad_(False)
        bf16 = frozen_bytes(model)
        ratios[name] = frozen_bytes(to_fp8_base(model)) / bf16
    with capsys.disabled():
        print("\nfrozen-base bytes, fp8 over bf16:", {k: round(v, 5) for k, v in ratios.items()})
    for ratio in ratios.values():
        assert math.isclose(ratio, 0.5, abs_tol=0.01), ratios  # (acceptance: 0.5 +- 2%)


def test_exclude_keeps_named_layers_and_a_second_call_changes_nothing():
    from cp_lightning import to_fp8_base as exported
    from cp_lightning.tiny import tiny_model

    model = exported(tiny_model("flux").requires_grad_(False), exclude=["proj_out", "norm_out.linear"])
    assert type(model.proj_out) is nn.Linear and type(model.norm_out.linear) is nn.Linear
    assert type(model.single_transformer_blocks[0].proj_out) is nn.Linear  # a suffix match: ".proj_out"
    assert isinstance(model.x_embedder, FP8Linear)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    to_fp8_base(model, exclude=["proj_out", "norm_out.linear"])
    assert all(torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)) for k, v in model.state_dict().items())


def test_bad_input_is_a_clear_error():
    linear = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="not a float8 storage dtype"):
        to_fp8_base(copy.deepcopy(linear), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="must be a torch.dtype"):
        to_fp8_base(copy.deepcopy(linear), dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="compute_dtype must be"):
        to_fp8_base(copy.deepcopy(linear), compute_dtype=torch.int8)
    with pytest.raises(ValueError, match="found no frozen nn.Linear.*Freeze it first"):
        to_fp8_base(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="exclude must be a list"):
        to_fp8_base(nn.Sequential(copy.deepcopy(linear)), exclude="0")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.ones(3))

    from recipes.flux import FluxFineTune

    with pytest.raises(ValueError, match="lora_rank=0 trains every weight"):
        FluxFineTune(lora_rank=0, base_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="base_dtype must be one of"):
        FluxFineTune(base_dtype="bfloat16")
    with pytest.raises(ValueError, match="base_dtype must be one of"):
        FluxFineTune(base_dtype="float8")
    from recipes.accelerate_flux_lora import FluxLoRA

    with pytest.raises(ValueError, match="lora_rank=0"):
        FluxLoRA(lora_rank=0, base_dtype="float8_e4m3fn")


@pytest.mark.slow
def test_the_tiny_recipe_loss_with_an_fp8_base_is_within_2_percent_of_bf16(tmp_path, capsys):
    """configs/tiny_flux_cp2.yaml (Lightning, cp=2, DDP) for 100 steps with a bf16 base, and with the same base
    in fp8: the same noise and timesteps per step, so the curves differ by the base's rounding only."""
    from tests.test_recipes import losses, run_recipe

    common = (
        "--trainer.max_steps=100",
        "--trainer.precision=bf16-mixed",
        "--model.weights_dtype=bfloat16",
        "--samples.every_n_steps=1000",  # step 0 and the end only: sampling runs through the fp8 layers too
        "--checkpoint.every_n_steps=1000",
    )
    bf16 = losses(run_recipe(tmp_path, "bf16", *common))
    fp8 = losses(run_recipe(tmp_path, "fp8", *common, "--model.base_dtype=float8_e4m3fn"))
    assert len(bf16) == len(fp8) == 100 and bf16 != fp8  # the base was converted: the curves are not identical
    smooth_bf16, smooth_fp8 = sum(bf16[-20:]) / 20, sum(fp8[-20:]) / 20  # the last 20 steps' mean
    with capsys.disabled():
        print(f"\nsmoothed loss at step 100: bf16 {smooth_bf16:.4f}, fp8 base {smooth_fp8:.4f}")
    assert abs(smooth_fp8 - smooth_bf16) <= 0.02 * smooth_bf16, (smooth_bf16, smooth_fp8)
    assert smooth_fp8 < 0.6 * sum(fp8[:10]) / 10  # and it learns

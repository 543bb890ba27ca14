"""Activation offload (cp_lightning.offload): exact, inputs packed to the CPU, no CP collective in the recompute.

One spawned group of 4 gloo processes runs every multi-process case: SGD trajectories with and without
``activation_offload`` at cp=2 Ulysses, cp=2 ring and USP cp=4 (ring 2), DDP and FSDP, through the Lightning
strategy and Accelerate; and, per layout, what the saved-tensor hooks pack and which CP collectives run in
backward. The single-process tests check the options and the order of the checks.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from tests.distributed import spawn
from tests.lightning_tasks import FlowMatching, Samples, param_rel_err

STEPS, OFFLOAD_TOL = 3, 1e-6
LAYOUTS = {"ulysses_cp2": {"cp": 2}, "ring_cp2": {"cp": 2, "ring": 2}, "usp_cp4_ring2": {"cp": 4, "ring": 2}}
COLLECTIVES = ("_c10d_functional.all_to_all_single.default", "cp_lightning.ring_attention_forward.default")


class CollectiveCalls(TorchDispatchMode):
    """Counts the CP collectives that actually run. Selective checkpointing's recompute mode sits above this
    one (it is entered later), so an op it answers from its cache never reaches here."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in COLLECTIVES:
            self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


# -- worker side ----------------------------------------------------------------------------------
def numpy_of(state: dict) -> dict:
    return {k: v.detach().float().numpy() for k, v in state.items()}


def lightning_case(layout: dict, fsdp: bool, offload: bool) -> dict:
    from tests.test_fsdp import fit

    strategy = {**layout, "fsdp": fsdp, "activation_offload": offload}
    with CollectiveCalls() as counted:
        params = fit({"checkpointing": True}, strategy, steps=STEPS)["params"]
    return {"params": params, "calls": dict(counted.calls)}


def accelerate_case(layout: dict, fsdp: bool, offload: bool) -> dict:
    from cp_lightning.accelerate import ContextParallel
    from cp_lightning.sharding import full_state_dict
    from tests.test_accelerate import PER_RANK_BATCH, fresh_accelerator, make_task, optimizer, train

    accelerator = fresh_accelerator()
    cpx = ContextParallel(accelerator, **layout, seed=0, fsdp=fsdp, activation_offload=offload)
    model = make_task(shape={"checkpointing": True})
    model.configure_model()  # enables gradient checkpointing
    opt = optimizer("sgd", model.parameters())
    batch = PER_RANK_BATCH * 2 // layout["cp"]  # a global batch of 4 at every layout
    loader = DataLoader(Samples(), batch_size=batch, shuffle=True)
    model, opt, loader = cpx.prepare(model, opt, loader)
    with CollectiveCalls() as counted:
        train(accelerator, model, opt, loader, STEPS)
    state = full_state_dict(model)
    return {"params": numpy_of(state) if dist.get_rank() == 0 else None, "calls": dict(counted.calls)}


def one_backward(layout: dict, offload: bool, monkeypatch_hooks=None) -> dict:
    """Forward and backward of the parallelized tiny Flux with checkpointing; what ran in backward."""
    from cp_lightning import build_mesh, parallelize
    from cp_lightning import offload as off
    from cp_lightning.collectives import count_bytes
    from cp_lightning.tiny import tiny_inputs, tiny_model

    torch.manual_seed(0)
    model = tiny_model("flux")
    inputs = tiny_inputs("flux", model, batch=1, tokens=16, text_tokens=8)
    model.enable_gradient_checkpointing()
    ring = layout.get("ring", 1)
    parallelize(model, mesh=build_mesh(layout["cp"], ring=ring), ring=ring)
    if offload:
        off.apply_activation_offload(model)
    forward_calls, backward_calls = CollectiveCalls(), CollectiveCalls()
    with count_bytes() as sent:
        with forward_calls:
            out = model(**inputs, return_dict=False)[0]
        forward_bytes = sent["all_to_all"]
        with backward_calls:
            out.square().sum().backward()
    return {
        "forward": dict(forward_calls.calls),
        "backward": dict(backward_calls.calls),
        "all_to_all_bytes": (forward_bytes, sent["all_to_all"] - forward_bytes),
    }


def packed_inputs(layout: dict) -> dict:
    """What the offload's saved-tensor hooks pack, against the arguments each checkpointed block got."""
    from cp_lightning import build_mesh, parallelize
    from cp_lightning import offload as off
    from cp_lightning.tiny import tiny_inputs, tiny_model

    torch.manual_seed(0)
    model = tiny_model("flux")
    inputs = tiny_inputs("flux", model, batch=1, tokens=16, text_tokens=8)
    model.enable_gradient_checkpointing()
    ring = layout.get("ring", 1)
    parallelize(model, mesh=build_mesh(layout["cp"], ring=ring), ring=ring)
    off.apply_activation_offload(model)
    block_args, packed, kept = [], [], []
    real_hooks, real_checkpoint, real_policy = off._saved_inputs_hooks, off.checkpoint, off.cp_checkpoint_policy

    def recording_hooks():
        hooks = real_hooks()
        pack = hooks.pack_hook

        def recording_pack(tensor):
            out = pack(tensor)
            packed.append((tensor, out[1]))
            return out

        hooks.pack_hook = recording_pack
        return hooks

    def recording_checkpoint(function, *args, **kwargs):
        block_args.append([a for a in args if isinstance(a, torch.Tensor)])
        return real_checkpoint(function, *args, **kwargs)

    def recording_policy(ctx, func, *args, **kwargs):
        policy = real_policy(ctx, func, *args, **kwargs)
        if policy == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE:
            outs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else [ctx.op_output]
            kept.append((str(func), sum(t.numel() * t.element_size() for t in outs)))
        return policy

    off._saved_inputs_hooks, off.checkpoint, off.cp_checkpoint_policy = (
        recording_hooks,
        recording_checkpoint,
        recording_policy,
    )
    try:
        out = model(**inputs, return_dict=False)[0]
        out.square().sum().backward()
    finally:
        off._saved_inputs_hooks, off.checkpoint, off.cp_checkpoint_policy = real_hooks, real_checkpoint, real_policy
    inputs_flat = [t for args in block_args for t in args]

    def nbytes(t):
        return t.numel() * t.element_size()

    return {
        "blocks": len(block_args),
        "packed": len(packed),
        "packed_are_the_inputs": len(packed) == len(inputs_flat)
        and all(
            src is arg and dst.device.type == "cpu" and torch.equal(dst, arg)
            for (src, dst), arg in zip(packed, inputs_flat, strict=False)
        ),
        "packed_bytes": sum(nbytes(dst) for _, dst in packed),
        "input_bytes": sum(nbytes(t) for t in inputs_flat),
        "hidden_bytes": sum(nbytes(args[0]) for args in block_args),
        "kept": kept,
    }


def worker(rank, world, tmp):
    os.environ["PL_GLOBAL_SEED"] = "0"
    out: dict = {"lightning": {}, "accelerate": {}, "backward": {}, "packed": {}}
    for name, layout in LAYOUTS.items():
        for fsdp in (False, True):
            key = f"{name}_{'fsdp' if fsdp else 'ddp'}"
            out["lightning"][key] = [lightning_case(layout, fsdp, offload) for offload in (False, True)]
            out["accelerate"][key] = [accelerate_case(layout, fsdp, offload) for offload in (False, True)]
        out["backward"][name] = [one_backward(layout, offload) for offload in (False, True)]
        out["packed"][name] = packed_inputs(layout)
    return out


# -- test side -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    return spawn(worker, 4, str(tmp), timeout_s=900, env={"PL_GLOBAL_SEED": "0", "LOCAL_WORLD_SIZE": "4"})


CASES = [f"{name}_{kind}" for name in LAYOUTS for kind in ("ddp", "fsdp")]


def _tensors(state: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in state.items()}


@pytest.mark.parametrize("adapter", ["lightning", "accelerate"])
@pytest.mark.parametrize("case", CASES)
def test_sgd_trajectory_with_offload_equals_without(results, adapter, case):
    plain, offloaded = (_tensors(run["params"]) for run in results[0][adapter][case])
    start = {n: p.detach() for n, p in FlowMatching().named_parameters()}  # tiny_model seeds itself
    plain_params = {k.removeprefix("module."): v for k, v in plain.items()}
    moved = param_rel_err(start, {k: plain_params[k] for k in start})
    err = param_rel_err(offloaded, plain)
    print(f"{adapter} {case}: offload vs no offload, max relative parameter error {err:.2e} (moved {moved:.2e})")
    assert moved > 100 * OFFLOAD_TOL  # the trajectory went somewhere
    assert err <= OFFLOAD_TOL, (adapter, case, err)
    # and the adapter did offload: the recompute repeated no collective in training (every rank)
    a2a, ring = COLLECTIVES
    for rank_result in results:
        plain_calls, offload_calls = (run["calls"] for run in rank_result[adapter][case])
        assert plain_calls  # the layout communicates
        # plain: forward, recompute, backward's own all-to-alls (3 each); offload: forward and backward (2)
        assert 2 * plain_calls.get(a2a, 0) == 3 * offload_calls.get(a2a, 0)
        # ring attention's forward op: in forward and recompute (2), then in forward only (1)
        assert plain_calls.get(ring, 0) == 2 * offload_calls.get(ring, 0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_cp_collective_runs_during_the_recompute(results, layout):
    for rank_result in results:
        plain, offloaded = rank_result["backward"][layout]
        a2a, ring = COLLECTIVES
        assert plain["forward"] == offloaded["forward"]
        forward = plain["forward"]
        assert forward  # the layout communicates in forward
        # plain checkpointing: the recompute repeats every forward collective, before backward's own
        assert plain["backward"].get(ring, 0) == forward.get(ring, 0)
        assert plain["backward"].get(a2a, 0) == 2 * forward.get(a2a, 0)
        # offload: only backward's own (Ulysses' transposed all-to-alls; ring attention's backward op)
        assert offloaded["backward"].get(ring, 0) == 0
        assert offloaded["backward"].get(a2a, 0) == forward.get(a2a, 0)
        # and collectives.count_bytes counts what is sent: no recompute all-to-all bytes
        fwd, bwd = offloaded["all_to_all_bytes"]
        assert bwd == fwd
        assert plain["all_to_all_bytes"] == (fwd, 2 * fwd)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_saved_block_inputs_are_packed_to_the_cpu(results, layout):
    for rank_result in results:
        packed = rank_result["packed"][layout]
        print(layout, {k: v for k, v in packed.items() if k != "kept"}, Counter(f for f, _ in packed["kept"]))
        assert packed["blocks"] == 2  # tiny Flux: one joint and one single block, each checkpointed once
        # exactly the blocks' tensor arguments went through the hooks, nothing the blocks computed inside
        assert packed["packed_are_the_inputs"]
        assert packed["packed_bytes"] == packed["input_bytes"] > packed["hidden_bytes"] > 0
        kept = {func for func, _ in packed["kept"]}
        expected = set()
        if LAYOUTS[layout]["cp"] // LAYOUTS[layout].get("ring", 1) > 1:
            expected.add("_c10d_functional.all_to_all_single.default")
        if LAYOUTS[layout].get("ring", 1) > 1:
            expected.add("cp_lightning.ring_attention_forward.default")
        assert expected <= kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host copies need CUDA")
def test_on_cuda_the_block_inputs_are_pinned_host_copies():
    from cp_lightning import offload as off

    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    block = torch.nn.Linear(8, 8).cuda()
    packed = []
    real = off._saved_inputs_hooks

    def recording():
        hooks = real()
        pack = hooks.pack_hook
        hooks.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]
        return hooks

    off._saved_inputs_hooks = recording
    try:
        off.offload_checkpoint(block, x).sum().backward()
    finally:
        off._saved_inputs_hooks = real
    assert len(packed) == 1
    device, host = packed[0]
    assert device.type == "cuda" and host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, x.detach().cpu())


# -- single process: options and checks ---------------------------------------------------------------
def test_non_bool_and_compile_are_refused_at_construction():
    from cp_lightning import ContextParallelStrategy, FabricContextParallelStrategy
    from cp_lightning.accelerate import ContextParallel

    for make in (
        lambda **kw: ContextParallelStrategy(cp=2, **kw),
        lambda **kw: FabricContextParallelStrategy(cp=2, **kw),
        lambda **kw: ContextParallel(None, cp=2, **kw),
    ):
        with pytest.raises(TypeError, match="activation_offload must be True or False, got 'yes'"):
            make(activation_offload="yes")
        with pytest.raises(ValueError, match="cannot be combined with compile="):
            make(activation_offload=True, compile=True)


def test_without_checkpointing_the_strategy_fails_before_parallelize():
    from cp_lightning import ContextParallelStrategy

    strategy = ContextParallelStrategy(cp=2, activation_offload=True)
    module = FlowMatching()  # checkpointing off
    # parallelize would first read the device mesh, which is not built here: the ValueError comes before
    with pytest.raises(ValueError, match="checkpoints none. Enable gradient checkpointing first"):
        strategy._parallelize(module)
    module.hparams.checkpointing = True
    module.configure_model()
    with pytest.raises(RuntimeError, match="device mesh is built when the strategy sets up"):
        strategy._parallelize(module)  # the check passes; parallelize itself starts


def test_a_module_offloading_already_cannot_be_compiled():
    from cp_lightning import ContextParallelStrategy, offload

    module = FlowMatching(checkpointing=True)
    module.configure_model()
    assert offload.apply_activation_offload(module) == 1  # the Flux transformer's own checkpointing function
    assert offload.offloading(module)
    with pytest.raises(ValueError, match="cannot be combined with compile="):
        ContextParallelStrategy(cp=2, compile=True)._parallelize(module)


def test_checkpoint_wrapper_blocks_are_offloaded_and_reentrant_ones_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from cp_lightning import offload

    plan = {"": {}}
    torch.manual_seed(0)
    root = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(4, 4)), torch.nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    root(x).square().sum().backward()
    expected = [p.grad.clone() for p in root.parameters()]
    root.zero_grad()
    assert offload.apply_activation_offload(root, plan) == 1
    assert root[0].checkpoint_fn is offload.offload_checkpoint
    root(x).square().sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(root.parameters(), expected, strict=True))
    reentrant = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(4, 4), checkpoint_impl=CheckpointImpl.REENTRANT))
    with pytest.raises(ValueError, match="reentrant checkpointing"):
        offload.apply_activation_offload(reentrant, plan)


def test_recipes_refuse_offload_without_checkpointing():
    from recipes.accelerate_flux_lora import parse_args
    from recipes.flux import FluxFineTune

    with pytest.raises(ValueError, match="set model.gradient_checkpointing: true as well"):
        FluxFineTune(activation_offload=True)
    with pytest.raises(TypeError, match="activation_offload must be True or False"):
        FluxFineTune(activation_offload=1, gradient_checkpointing=True)
    assert FluxFineTune(activation_offload=True, gradient_checkpointing=True).hparams.activation_offload
    with pytest.raises(SystemExit):
        parse_args(["--activation_offload"])
    assert parse_args(["--activation_offload", "--gradient_checkpointing"]).activation_offload


def test_recipe_offloads_its_transformer_in_configure_model(tmp_path):
    from cp_lightning import offload
    from recipes.flux import FluxFineTune

    module = FluxFineTune(activation_offload=True, gradient_checkpointing=True, cache_dir=str(tmp_path))
    module.configure_model()
    assert offload.offloading(module.transformer)

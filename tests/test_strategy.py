"""ContextParallelStrategy end to end: Lightning on 4 CPU processes, gloo.

Trajectory parity: the parameters after N optimizer steps equal those of one process trained on
the same global batches (tests/lightning_tasks.py builds both).

Starting processes costs far more than a 5-step fit, so the Lightning runs share two spawned groups
(one of 4 processes, one of 2): inside a group Lightning sees an externally launched job (as under
torchrun) and each case is a fresh Trainer and strategy on the same processes, every run starting
from the same seed as a fresh process would. The launcher's own paths (Lightning's spawn launcher,
a rank that fails, Fabric) keep their own processes.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from cp_lightning import ContextParallelStrategy, faults
from tests.distributed import spawn
from tests.lightning_tasks import (
    FlowMatching,
    Samples,
    param_rel_err,
    read_records,
    reference_params,
    update_rel_err,
)

STEPS, GLOBAL_BATCH = 5, 4
SGD_TOL = 1e-5
GROUP_ENV = {"PL_GLOBAL_SEED": "0"}  # Lightning's DistributedSampler seed


@pytest.fixture(autouse=True)
def _fixed_sampler_seed(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # Lightning's DistributedSampler seed, inherited by workers
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def fit(module, strategy, devices=4, steps=STEPS, clip=None, dataset=None, **trainer_kwargs):
    dataset = dataset or Samples()
    dp = devices // (strategy.cp if isinstance(strategy, ContextParallelStrategy) else 1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=clip,
        **trainer_kwargs,
    )
    trainer.fit(module, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp, shuffle=True))
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def cp(degree, **kwargs):
    return ContextParallelStrategy(cp=degree, start_method="spawn", **kwargs)


def module_for(**kwargs) -> FlowMatching:
    """The case's module, as every run of it starts: built right after seeding 0."""
    torch.manual_seed(0)
    return FlowMatching(**kwargs)


SGD_CASES = {
    "dp2xcp2": (dict(), dict(degree=2)),
    "dp1xcp4": (dict(), dict(degree=4)),
    "loss_parallel": (dict(), dict(degree=2, loss_parallel=True)),
    "ring2": (dict(), dict(degree=2, ring=2)),
    "usp_cp4_ring2": (dict(), dict(degree=4, ring=2)),
    "checkpointing": (dict(checkpointing=True), dict(degree=2)),
    "lora": (dict(lora=True, lr=0.5), dict(degree=2)),
    # lengths cp does not divide: 33 image + 13 text tokens over 2 ranks, 61 + 13 over 4 (USP);
    # loss-parallel there weighs each rank's loss by its share of the tokens
    "odd_length_dp2xcp2": (dict(tokens=33, text_tokens=13), dict(degree=2)),
    "odd_length_usp_cp4_ring2": (dict(tokens=61, text_tokens=13), dict(degree=4, ring=2)),
    "odd_length_loss_parallel": (dict(tokens=33, text_tokens=13), dict(degree=2, loss_parallel=True)),
}

ADAMW_CASES = {
    "dp2xcp2": (dict(), dict(degree=2)),
    "loss_parallel": (dict(), dict(degree=2, loss_parallel=True)),
    "ring2": (dict(), dict(degree=2, ring=2)),
    "checkpointing": (dict(checkpointing=True), dict(degree=2)),
    "lora": (dict(lora=True), dict(degree=2)),
}


def _clip(module_kwargs) -> float:
    return 0.05 if not module_kwargs.get("lora") else 0.002


def _sgd_samples(module_kwargs) -> Samples:
    return Samples(**{k: v for k, v in module_kwargs.items() if k in ("tokens", "text_tokens")})


# ---------------------------------------------------------------------------------------------
# the shared groups: each case a fresh Trainer on the group's processes


def _external(degree, **kwargs):
    return ContextParallelStrategy(cp=degree, **kwargs)  # default launcher: the processes exist already


def _resume_runs(root: Path) -> str:
    """12 samples, global batch 4: step 3 ends epoch 0; noise from the RNG exercises its restore. Runs the
    straight 5 steps, 3 steps with a checkpoint, and the resume from it to 5; returns the checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = module_for(optimizer="adamw", lr=1e-3, noise="rng")

    def run(record_dir, steps, ckpt_path=None, callbacks=()):
        record_dir.mkdir(parents=True, exist_ok=True)
        m = copy.deepcopy(module)
        m.hparams.record_dir = str(record_dir)
        torch.manual_seed(0)  # each run starts from one RNG state, as a fresh process does
        trainer = L.Trainer(
            accelerator="cpu",
            devices=4,
            strategy=_external(2),
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
            default_root_dir=str(root),
        )
        trainer.fit(m, DataLoader(Samples(), batch_size=2, shuffle=True), ckpt_path=ckpt_path)

    run(root / "full", 5)
    saver = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=3, save_top_k=-1)
    run(root / "first", 3, callbacks=[saver])
    torch.distributed.barrier()
    ckpt = next((root / "ckpt").glob("*step=3*.ckpt"))
    run(root / "second", 5, ckpt_path=str(ckpt))
    return str(ckpt)


def _portable(value):
    """Parameters as numpy arrays: tensors sent through the result queue would be shared memory that
    vanishes with the worker."""
    if isinstance(value, dict):
        return {n: p.numpy() if isinstance(p, torch.Tensor) else p for n, p in value.items()}
    return value


def _params(value) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(p) for n, p in value.items()}


def _world4_cases(rank, world, root):
    root = Path(root)
    out = {}

    def case(name, run, *args, **kwargs):
        torch.manual_seed(0)
        try:
            out[name] = _portable(run(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 - recorded per case; every rank raises alike here
            out[name] = err if name == "mismatch" else RuntimeError(f"{type(err).__name__}: {err}")

    def cp_fit(module_kwargs, strategy_kwargs, **fit_kwargs):
        strategy_kwargs = dict(strategy_kwargs)
        strategy = _external(strategy_kwargs.pop("degree"), **strategy_kwargs)
        return fit(module_for(**module_kwargs), strategy, **fit_kwargs)

    for name, (module_kwargs, strategy_kwargs) in SGD_CASES.items():
        sgd = dict(optimizer="sgd", **module_kwargs)
        case(f"sgd/{name}", cp_fit, sgd, strategy_kwargs, dataset=_sgd_samples(module_kwargs))
    for name, (module_kwargs, strategy_kwargs) in ADAMW_CASES.items():
        adamw = dict(optimizer="adamw", lr=1e-3, **module_kwargs)
        case(f"adamw/{name}", cp_fit, adamw, strategy_kwargs, clip=_clip(module_kwargs))
    (root / "rng").mkdir(parents=True, exist_ok=True)
    case("rng", cp_fit, dict(noise="rng", record_dir=str(root / "rng")), dict(degree=2), steps=2)
    case("resume", _resume_runs, root / "resume")

    # 2 micro-batches of 2 per rank and optimizer step: global batches of 8
    case("accumulated", cp_fit, dict(optimizer="sgd"), dict(degree=2), steps=3, dataset=Samples(n=16),
         accumulate_grad_batches=2)  # fmt: skip
    case("bf16", cp_fit, dict(optimizer="sgd"), dict(degree=2), precision="bf16-mixed")
    case("fsdp_nan_gradient", fit, _NanGradientAtStep2(optimizer="sgd"), _external(2, fsdp=True), steps=4)
    case("mismatch", cp_fit, dict(noise="per_rank"), dict(degree=2), steps=2)  # last: it raises
    return out


def _world2_cases(rank, world):
    """Plain DDP over 2 ranks (the AdamW baselines) and a model without a plan."""
    out = {}
    for lora in (False, True):
        torch.manual_seed(0)
        module = module_for(optimizer="adamw", lr=1e-3, lora=lora)
        out[f"ddp/{lora}"] = _portable(fit(module, "ddp", devices=2, clip=_clip({"lora": lora})))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_external(2),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    try:
        trainer.fit(_NoPlanModule(), DataLoader(torch.randn(8, 4), batch_size=2))
        out["no_plan"] = None
    except Exception as err:  # noqa: BLE001
        out["no_plan"] = f"{type(err).__name__}: {err}"
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategy_runs")
    return spawn(_world4_cases, 4, str(root), timeout_s=1200, env=GROUP_ENV)[0], root


@pytest.fixture(scope="module")
def world2():
    return spawn(_world2_cases, 2, timeout_s=600, env=GROUP_ENV)[0]


def _result(runs, name):
    value = runs[name]
    if isinstance(value, BaseException):
        raise value
    return _params(value) if isinstance(value, dict) else value


class _NanGradientAtStep2(FlowMatching):
    """Rank 1's loss at step 2 is finite but its gradient is NaN (d sqrt(x) at 0 is inf, times 0)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2 and self.global_rank == 1:
            loss = loss + (0 * loss).sqrt()
        return loss


class _NoPlanModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_trajectory_matches_one_process(world4, case):
    module_kwargs, _ = SGD_CASES[case]
    module = module_for(optimizer="sgd", **module_kwargs)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    reference = reference_params(module, _sgd_samples(module_kwargs), GLOBAL_BATCH, STEPS, clip=None)
    params = _result(world4[0], f"sgd/{case}")
    err = param_rel_err(params, reference)
    update_err = update_rel_err(params, reference, start)
    moved = param_rel_err(start, reference)
    print(f"{case}: max relative param error {err:.2e}, relative to the update {update_err:.2e}")
    assert moved > 100 * SGD_TOL  # training moved the parameters well past the tolerance
    assert err <= SGD_TOL, (case, err)
    assert update_err <= 1e-3, (case, update_err)  # a cp-times gradient scale error would be ~1


@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_adamw_with_active_clipping_is_as_close_as_plain_ddp(world4, world2, case):
    module_kwargs, _ = ADAMW_CASES[case]
    module = module_for(optimizer="adamw", lr=1e-3, **module_kwargs)
    clip = _clip(module_kwargs)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    reference = reference_params(module, Samples(), GLOBAL_BATCH, STEPS, clip=clip)
    # the clip threshold must be active: the first step's global gradient norm is above it
    probe = copy.deepcopy(module)
    probe.loss(torch.utils.data.default_collate([Samples()[i] for i in range(GLOBAL_BATCH)]))[0].backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in probe.parameters() if p.grad is not None]))
    assert norm > 5 * clip, norm

    cp_params = _result(world4[0], f"adamw/{case}")
    # plain DDP over the same 2 dp ranks; the model math is the same per case
    ddp_params = _params(world2[f"ddp/{bool(module_kwargs.get('lora'))}"])
    ddp_err, ddp_upd = param_rel_err(ddp_params, reference), update_rel_err(ddp_params, reference, start)
    cp_err, cp_upd = param_rel_err(cp_params, reference), update_rel_err(cp_params, reference, start)
    print(
        f"AdamW + clipping, {case}: worst parameter CP {cp_err:.2e} vs plain DDP {ddp_err:.2e}; "
        f"error over the update CP {cp_upd:.2e} vs plain DDP {ddp_upd:.2e}"
    )
    # Over all parameters (2-norm of the error against the 2-norm of the update) CP is as close as DDP; the
    # worst single parameter is dominated by AdamW dividing rounding noise by near-zero second moments,
    # so it is held to the ~2e-4 that plain DDP itself reaches on this workload.
    assert cp_upd <= 1.5 * ddp_upd, (cp_upd, ddp_upd)
    assert cp_err <= 2e-4 and ddp_err <= 2e-4, (cp_err, ddp_err)


def test_rng_is_shared_by_cp_peers_and_differs_across_dp(world4):
    _result(world4[0], "rng")
    rows = read_records(world4[1] / "rng")
    assert len(rows) == 4 * 2
    for step in (0, 1):
        at = {r["rank"]: r for r in rows if r["step"] == step}
        for rank, row in at.items():
            assert row["cp_group"] == [rank // 2 * 2, rank // 2 * 2 + 1] and row["dp_rank"] == rank // 2
        assert at[0]["noise_sum"] == at[1]["noise_sum"] and at[2]["noise_sum"] == at[3]["noise_sum"]  # CP peers
        assert at[0]["noise_sum"] != at[2]["noise_sum"]  # dp ranks


def test_a_nan_gradient_under_fsdp_is_an_error_naming_the_step_and_ranks(world4):
    """The loss is finite, so only the gradient shards (reduce-scattered: every rank's) show it."""
    err = world4[0]["fsdp_nan_gradient"]
    assert isinstance(err, BaseException), "the NaN gradient went unnoticed"
    assert "NonFiniteError: step 2: non-finite gradient shards on rank(s) [0, 1, 2, 3] (FSDP" in str(err), err
    assert "nonfinite='skip'" in str(err), err


def test_mismatched_inputs_on_cp_peers_raise_a_named_error(world4):
    err = world4[0]["mismatch"]
    assert isinstance(err, BaseException), err
    with pytest.raises(Exception, match=r"CP peers disagree on <root>\(hidden_states\) at training forward pass 1"):
        raise err


def test_resume_reproduces_the_uninterrupted_losses(world4):
    ckpt = _result(world4[0], "resume")
    root = world4[1] / "resume"

    def losses(d):
        return {r["step"]: r["loss"] for r in read_records(d) if r["rank"] == 0}

    uninterrupted, resumed = losses(root / "full"), losses(root / "second")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(resumed[step] - uninterrupted[step]) <= 1e-6, (step, resumed[step], uninterrupted[step])
    # the checkpoint is a plain state dict: it loads without cp_lightning into the bare model
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    bare = FlowMatching().transformer
    bare.load_state_dict({k.removeprefix("transformer."): v for k, v in state.items()})


def test_accumulated_gradients_match_one_process(world4):
    module = module_for(optimizer="sgd")
    # 2 micro-batches of 4 per optimizer step = one process on global batches of 8
    reference = reference_params(module, Samples(n=16), 8, 3, clip=None)
    assert param_rel_err(_result(world4[0], "accumulated"), reference) <= SGD_TOL


def test_bf16_mixed_is_no_worse_than_one_process_bf16(world4):
    module = module_for(optimizer="sgd")
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    reference = reference_params(module, Samples(), GLOBAL_BATCH, STEPS, clip=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_bf16 = reference_params(module, Samples(), GLOBAL_BATCH, STEPS, clip=None)
    params = _result(world4[0], "bf16")
    cp_err, plain_err = update_rel_err(params, reference, start), update_rel_err(plain_bf16, reference, start)
    print(f"bf16-mixed against fp32, relative to the update: CP {cp_err:.2e}, one process {plain_err:.2e}")
    assert cp_err <= 2 * plain_err, (cp_err, plain_err)


def test_lightnings_spawn_launcher_runs_the_strategy():
    """Lightning's own spawn launcher (the shared groups above run as externally launched jobs)."""
    module = module_for(optimizer="sgd")
    reference = reference_params(module, Samples(), GLOBAL_BATCH, STEPS, clip=None)
    assert param_rel_err(fit(module, cp(2), devices=2), reference) <= SGD_TOL


def test_a_failing_rank_raises_through_lightnings_launcher():
    with pytest.raises(Exception, match="deliberate failure at step 2"):
        fit(FlowMatching(fail_at_step=2, fail_rank=3), cp(2, timeout=timedelta(seconds=10)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(devices=1, strategy=ContextParallelStrategy(cp=2)), "needs cp processes"),
        (dict(devices=3, strategy=ContextParallelStrategy(cp=2)), "must divide the number of processes"),
        (dict(devices=2, num_nodes=2, strategy=ContextParallelStrategy(cp=4)), "would span nodes"),
    ],
)
def test_bad_layouts_fail_when_the_trainer_is_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        L.Trainer(accelerator="cpu", logger=False, **kwargs)


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="ring=3 must divide cp=4"):
        ContextParallelStrategy(cp=4, ring=3)
    with pytest.raises(TypeError, match="cp must be an int"):
        ContextParallelStrategy(cp="2")
    with pytest.raises(ValueError, match="unknown or cannot return the log-sum-exp"):
        ContextParallelStrategy(cp=2, kernel="sdpa")


def test_cp_degree_two_across_two_nodes_is_allowed_when_asked():
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        devices=1,
        num_nodes=2,
        strategy=ContextParallelStrategy(cp=2, allow_cross_node=True),
    )
    assert trainer.strategy.cp == 2


def test_a_model_without_any_plan_fails_at_setup(world2):
    assert world2["no_plan"] is not None
    assert "no submodule of _NoPlanModule has a diffusers `_cp_plan`" in world2["no_plan"], world2["no_plan"]


def test_mesh_is_a_clear_error_before_setup():
    with pytest.raises(RuntimeError, match="read it in configure_model"):
        _ = ContextParallelStrategy(cp=2).device_mesh


def _fabric_train(fabric):
    from torch.utils.data import DistributedSampler

    torch.manual_seed(0)
    module = FlowMatching(optimizer="sgd")
    model = fabric.setup(module)
    model.mark_forward_method("loss")
    optimizer = fabric.setup_optimizers(module.configure_optimizers())
    dataset = Samples()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, **fabric.strategy.distributed_sampler_kwargs)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=2, sampler=sampler), use_distributed_sampler=False)
    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step == STEPS:
                break
            optimizer.zero_grad()
            # the loss goes through the wrapped model's forward so DDP's hooks see the step
            fabric.backward(model.loss(batch)[0])
            optimizer.step()
            step += 1
        epoch += 1
    params = {n: p.detach() for n, p in module.named_parameters()}
    # a small result: Lightning's launcher reads it only after the workers exit, through a pipe
    torch.manual_seed(0)
    reference = reference_params(FlowMatching(optimizer="sgd"), dataset, GLOBAL_BATCH, STEPS, clip=None, seed=0)
    err = param_rel_err(params, reference)
    groups = faults.mesh_groups(fabric.strategy.device_mesh, fabric.strategy.ring)  # the world's and the mesh's
    local = {"timeouts": sorted({faults.group_timeout(g).total_seconds() for g in groups})}
    local.update(_fabric_nonfinite_steps(fabric, model, module, optimizer, batch))
    results: list = [None] * fabric.world_size
    torch.distributed.all_gather_object(results, local)
    return err, results


def _fabric_nonfinite_steps(fabric, model, module, optimizer, batch) -> dict:
    """A NaN loss on rank 1 at optimizer step 5: nonfinite="raise" raises on every rank, "skip" skips, and
    neither updates a weight."""
    before = [p.detach().clone() for p in module.parameters()]
    out = {}
    for mode in ("raise", "skip"):
        fabric.strategy.nonfinite.mode = mode
        optimizer.zero_grad()
        loss = model.loss(batch)[0]
        fabric.backward(loss * float("nan") if fabric.global_rank == 1 else loss)
        try:
            optimizer.step()
            out[mode] = None
        except faults.NonFiniteError as err:
            out[mode] = str(err)
    out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, module.parameters(), strict=True))
    out["skipped"] = fabric.strategy.skipped_steps
    return out


def test_fabric_strategy_matches_one_process():
    from lightning.fabric import Fabric

    from cp_lightning import FabricContextParallelStrategy

    strategy = FabricContextParallelStrategy(cp=2, start_method="spawn", timeout=120)
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    err, results = fabric.launch(_fabric_train)
    assert err <= SGD_TOL, err
    for r in results:
        assert r["timeouts"] == [120.0], r  # every group of every rank: timeout=120, not torch's 30 min
        assert r["raise"].startswith("step 5: non-finite loss on rank(s) [1]; non-finite gradients"), r
        assert "FabricContextParallelStrategy(..., nonfinite='skip')" in r["raise"], r
        assert (r["skip"], r["skipped"], r["unchanged"]) == (None, 1, True), r


def test_a_lightning_cli_yaml_selects_the_strategy_with_its_arguments(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 4\n  logger: false\n  strategy:\n"
        "    class_path: cp_lightning.ContextParallelStrategy\n    init_args: {cp: 2, ring: 2, loss_parallel: true}\n"
    )
    cli = LightningCLI(FlowMatching, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ContextParallelStrategy)
    assert (strategy.cp, strategy.ring, strategy.loss_parallel) == (2, 2, True)
    named = L.Trainer(accelerator="cpu", devices=2, strategy="context_parallel", logger=False).strategy
    assert isinstance(named, ContextParallelStrategy) and named.cp == 2

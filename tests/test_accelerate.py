"""cp_lightning.accelerate in an ordinary Accelerate loop: 4 CPU processes (dp=2 x cp=2), gloo.

One spawned group runs every multi-process case (a group costs seconds to start); each test asserts on
its part of the results. Every trajectory is compared with one process trained on the global batches the
ranks actually drew (recorded through the samples' indices), so the data sharding is checked as well.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from tests.distributed import spawn
from tests.lightning_tasks import FlowMatching, Samples, param_rel_err, update_rel_err

STEPS, PER_RANK_BATCH, SGD_LR, ADAMW_LR, CLIP = 5, 2, 0.05, 1e-3, 0.05
SGD_TOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]


class Task(FlowMatching):
    """The flow-matching loss of the tiny Flux as a plain module: ``forward(batch) -> (loss, noise)``."""

    def forward(self, batch):
        return self.loss(batch)


# 33 image + 13 text tokens: lengths cp=2 does not divide (uneven shards)
ODD = {"tokens": 33, "text_tokens": 13}


def make_task(noise: str = "sample", shape: dict | None = None) -> Task:
    with torch.random.fork_rng():  # tiny_model seeds the global RNG; keep the per-dp-rank seeds intact
        return Task(noise=noise, **(shape or {}))


def optimizer(kind: str, params):
    params = [p for p in params if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=0.01)
    return torch.optim.SGD(params, lr=SGD_LR)


def portable(obj, convert=lambda t: t.numpy()):
    """Tensors -> numpy arrays (and back with ``convert=torch.from_numpy``): tensors cross the result queue by
    shared memory, which is gone once the worker exits."""
    if isinstance(obj, dict):
        return {k: portable(v, convert) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v, convert) for v in obj]
    if isinstance(obj, torch.Tensor) or type(obj).__module__ == "numpy":
        return convert(obj)
    return obj


def fresh_accelerator(**kwargs):
    """A new Accelerator in a process that already made one (Accelerate's state objects are singletons)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


def params_of(model) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()}


def train(accelerator, model, opt, loader, steps, clip=None, start_epoch=0, after_step=None):
    """The loop under test; records what each rank saw. Returns per-step records."""
    records, step, epoch = [], 0, start_epoch
    while step < steps:
        loader.set_epoch(epoch)
        for batch in loader:
            with accelerator.accumulate(model):
                loss, noise = model(batch)
                accelerator.backward(loss)
                norm = None
                if clip is not None and accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), clip).item()
                opt.step()
                opt.zero_grad()
            records.append(
                {
                    "index": batch["index"].tolist(),
                    "loss": loss.item(),
                    "gathered_loss": accelerator.gather(loss.detach()).tolist(),
                    "noise_sum": noise.double().sum().item(),
                    "norm": norm,
                }
            )
            if accelerator.sync_gradients:
                step += 1
                if after_step is not None:
                    after_step(step)
                if step == steps:
                    break
        epoch += 1
    return records


def run_cp(kind, clip=None, samples=12, accumulation=1, steps=STEPS, shape=None, **cp_kwargs):
    from cp_lightning.accelerate import ContextParallel

    accelerator = fresh_accelerator(gradient_accumulation_steps=accumulation)
    cpx = ContextParallel(accelerator, cp=2, seed=0, **cp_kwargs)
    model = make_task(shape=shape)
    opt = optimizer(kind, model.parameters())
    loader = DataLoader(Samples(n=samples, **(shape or {})), batch_size=PER_RANK_BATCH, shuffle=True)
    model, opt, loader = cpx.prepare(model, opt, loader)
    records = train(accelerator, model, opt, loader, steps, clip=clip)
    first = next(iter(loader))
    return {
        "params": params_of(model),
        "records": records,
        "dp_gather": cpx.gather(first["index"]).tolist(),
        "first_index": first["index"].tolist(),
        "layout": (cpx.dp_size, cpx.dp_rank, cpx.cp_rank),
    }


def error_cases(rank):
    """Each bad configuration, on every rank, before any collective (a half-entered one would hang the rest)."""
    from unittest import mock

    from accelerate import FullyShardedDataParallelPlugin, ParallelismConfig
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, DistributedType

    from cp_lightning.accelerate import ContextParallel

    def message(fn):
        try:
            fn()
        except (ValueError, TypeError) as err:
            return f"{type(err).__name__}: {err}"
        return None

    out = {"cp3": message(lambda: ContextParallel(fresh_accelerator(), cp=3))}
    fsdp = FullyShardedDataParallelPlugin()
    out["fsdp"] = message(lambda: ContextParallel(fresh_accelerator(fsdp_plugin=fsdp), cp=2))
    os.environ.pop("ACCELERATE_USE_FSDP")  # the Accelerator set it for this process; later cases have no plugin
    accelerator = fresh_accelerator()
    with mock.patch.object(type(accelerator), "distributed_type", new=DistributedType.DEEPSPEED):
        out["deepspeed"] = message(lambda: ContextParallel(accelerator, cp=2))
    accelerator = fresh_accelerator()  # Accelerate's own CP (FSDP2 only); set on the object, as its init would
    with mock.patch.object(accelerator.state, "parallelism_config", new=ParallelismConfig(cp_size=2)):
        out["parallelism_config"] = message(lambda: ContextParallel(accelerator, cp=2))
    hook = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    out["comm_hook"] = message(lambda: ContextParallel(fresh_accelerator(kwargs_handlers=[hook]), cp=2))
    accelerator = fresh_accelerator()
    cpx = ContextParallel(accelerator, cp=2)
    ddp = accelerator.prepare(make_task())
    out["ddp_model"] = message(lambda: cpx.prepare(ddp))
    out["prepared_loader"] = message(lambda: cpx.prepare(accelerator.prepare(DataLoader(Samples()))))
    out["no_plan"] = message(lambda: cpx.prepare(torch.nn.Linear(2, 2)))
    return out


def timeout_case():
    """Seconds each mesh group waits: by default the world's (480 s here, not torch's 30 min), else `timeout`."""
    import torch.distributed as dist

    from cp_lightning import faults
    from cp_lightning.accelerate import ContextParallel

    def seconds(cpx):
        return sorted({faults.group_timeout(g).total_seconds() for g in faults.mesh_groups(cpx.mesh, cpx.ring)})

    world = faults.group_timeout()
    out = {"world": world.total_seconds(), "default": seconds(ContextParallel(fresh_accelerator(), cp=2, ring=2))}
    out["given"] = seconds(ContextParallel(fresh_accelerator(), cp=2, ring=2, timeout=timedelta(seconds=200)))
    dist.distributed_c10d._set_pg_timeout(world, dist.group.WORLD)  # the later cases keep the spawn's limit
    return out


def cp_worker(rank, world, tmp):
    out = {"errors": error_cases(rank), "timeouts": timeout_case()}
    out["sgd"] = run_cp("sgd")
    out["adamw"] = run_cp("adamw", clip=CLIP)
    out["accumulate"] = run_cp("sgd", samples=16, accumulation=2, steps=3)
    out["odd_length"] = run_cp("sgd", shape=ODD)
    out["odd_length_loss_parallel"] = run_cp("sgd", shape=ODD, loss_parallel=True)
    out["resume"] = resume_case(Path(tmp))
    out["mid_epoch_resume"] = mid_epoch_resume_case(Path(tmp))
    out["nonfinite"] = nonfinite_cases(rank)
    return portable(out)


def full_params(model) -> dict[str, torch.Tensor]:
    """Collective under FSDP: every parameter whole (a DTensor's full tensor)."""
    return {
        n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def mid_epoch_resume_case(tmp: Path):
    """FSDP, cp.save_state after step 4 (12 samples / global batch 4: one batch into epoch 1), fresh state,
    cp.load_state, 2 more steps from the loader's own epoch. Accelerate's default sampler (no seedable sampler):
    the epoch's order comes from its generator, so only a restored generator and position give the same batches."""
    from cp_lightning.accelerate import ContextParallel

    def setup():
        accelerator = fresh_accelerator()
        model = make_task(noise="rng")
        cpx = ContextParallel(accelerator, cp=2, seed=0, fsdp=True)
        opt = optimizer("adamw", model.parameters())
        loader = DataLoader(Samples(), batch_size=PER_RANK_BATCH, shuffle=True)
        return (cpx, accelerator, *cpx.prepare(model, opt, loader))

    cpx, accelerator, model, opt, loader = setup()
    full = train(accelerator, model, opt, loader, 6)
    want = full_params(model)
    cpx, accelerator, model, opt, loader = setup()
    train(accelerator, model, opt, loader, 4)
    cpx.save_state(tmp / "mid_epoch", model=model, optimizer=opt, note="kept")
    cpx, accelerator, model, opt, loader = setup()
    torch.manual_seed(12345)  # anything drawn now must be overwritten by load_state
    extra = cpx.load_state(tmp / "mid_epoch", model=model, optimizer=opt)
    epoch = loader.iteration
    resumed = train(accelerator, model, opt, loader, 2, start_epoch=epoch)
    return {
        "full": full,
        "resumed": resumed,
        "epoch": epoch,
        "extra": extra,
        "err": param_rel_err(full_params(model), want),
    }


def nonfinite_cases(rank):
    """A NaN loss (DDP, "raise"), a NaN gradient with a finite loss (DDP "skip"; FSDP "raise": the shards) on
    rank 1 at optimizer step 1 (of 3, one epoch). Records the error, whether each step changed a weight and
    whether the learning rate held."""
    from cp_lightning import faults
    from cp_lightning.accelerate import ContextParallel

    out = {}
    for name, mode, fsdp, kind in (
        ("ddp_raise", "raise", False, "loss"),
        ("ddp_skip", "skip", False, "grad"),
        ("fsdp_raise", "raise", True, "grad"),
    ):
        accelerator = fresh_accelerator()
        cpx = ContextParallel(accelerator, cp=2, seed=0, fsdp=fsdp, nonfinite=mode)
        model = make_task()
        opt = optimizer("sgd", model.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        loader = DataLoader(Samples(), batch_size=PER_RANK_BATCH, shuffle=True)
        model, opt, scheduler, loader = cpx.prepare(model, opt, scheduler, loader)
        case = {"error": None}
        for step, batch in enumerate(loader):
            loss = model(batch)[0]
            if step == 1 and rank == 1:  # NaN loss; or a finite one whose gradient is NaN (d sqrt(x) at 0, times 0)
                loss = loss * float("nan") if kind == "loss" else loss + (0 * loss).sqrt()
            accelerator.backward(loss)
            before, lr = full_params(model), scheduler.get_last_lr()
            try:
                opt.step()
            except faults.NonFiniteError as err:
                case["error"] = str(err)
            after = full_params(model)
            case[f"changed_{step}"] = any(not torch.equal(before[n], after[n]) for n in before)
            if case["error"] is not None:
                break
            scheduler.step()
            case[f"lr_held_{step}"] = scheduler.get_last_lr() == lr
            opt.zero_grad()
        case["skipped"] = cpx.skipped_steps
        out[name] = case
    return out


def resume_case(tmp: Path):
    """Uninterrupted 5 steps vs 3 steps, save_state, fresh process state, load_state, 2 more steps.

    Noise comes from torch's RNG (seeded per dp rank), so the resumed losses match only if load_state
    restores each rank's RNG; the data order comes from Accelerate's seedable sampler."""
    from accelerate.utils import DataLoaderConfiguration

    from cp_lightning.accelerate import ContextParallel

    def setup():
        accelerator = fresh_accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
        model = make_task(noise="rng")
        cpx = ContextParallel(accelerator, cp=2, seed=0)
        opt = optimizer("adamw", model.parameters())
        loader = DataLoader(Samples(), batch_size=PER_RANK_BATCH, shuffle=True)
        return (accelerator, *cpx.prepare(model, opt, loader))

    accelerator, model, opt, loader = setup()
    full = train(accelerator, model, opt, loader, STEPS)
    full_params = params_of(model)

    accelerator, model, opt, loader = setup()
    train(accelerator, model, opt, loader, 3)  # 12 samples / global batch 4: step 3 ends epoch 0
    accelerator.save_state(str(tmp / "state"))
    saved_params = params_of(model)
    accelerator, model, opt, loader = setup()
    torch.manual_seed(12345)  # anything drawn now must be overwritten by load_state
    accelerator.load_state(str(tmp / "state"))
    resumed = train(accelerator, model, opt, loader, 2, start_epoch=1)
    return {
        "full": full,
        "resumed": resumed,
        "full_params": full_params,
        "resumed_params": params_of(model),
        "state_dir": str(tmp / "state"),
        "saved_params": saved_params,
        "files": sorted(p.name for p in (tmp / "state").iterdir()),
    }


def ddp_worker(rank, world):
    """Plain Accelerate DDP over the same 2 dp ranks: the yardstick for AdamW + clipping."""
    accelerator = fresh_accelerator()
    model = make_task()
    opt = optimizer("adamw", model.parameters())
    loader = DataLoader(Samples(), batch_size=PER_RANK_BATCH, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    records = train(accelerator, model, opt, loader, STEPS, clip=CLIP)
    return portable({"params": params_of(model), "records": records})


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    # LOCAL_WORLD_SIZE: one node, as a launcher would say (Accelerate otherwise assumes 1 per node)
    tmp = str(tmp_path_factory.mktemp("acc"))
    return portable(spawn(cp_worker, 4, tmp, timeout_s=480, env={"LOCAL_WORLD_SIZE": "4"}), torch.from_numpy)


@pytest.fixture(scope="module")
def ddp_results():
    return portable(spawn(ddp_worker, 2, timeout_s=120, env={"LOCAL_WORLD_SIZE": "2"}), torch.from_numpy)


def global_batches(results, dp_ranks, case=None, micro_per_step=1):
    """The global batch of every optimizer step: each dp rank's micro-batches, in dp-rank order."""
    records = [(results[r][case] if case else results[r])["records"] for r in dp_ranks]
    n = len(records[0])
    return [
        [i for m in range(s, s + micro_per_step) for rec in records for i in rec[m]["index"]]
        for s in range(0, n, micro_per_step)
    ]


def reference(kind, batches, clip=None, samples=12, shape=None):
    """One process, one optimizer step per global batch; returns (params, start params, losses, norms)."""
    model = make_task(shape=shape)
    start = params_of(model)
    opt = optimizer(kind, model.parameters())
    data, losses, norms = Samples(n=samples, **(shape or {})), [], []
    for batch in batches:
        opt.zero_grad()
        loss = model(default_collate([data[i] for i in batch]))[0]
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return params_of(model), start, losses, norms


def test_cp_peers_share_batches_and_dp_ranks_split_them(cp_results):
    for case in ("sgd", "adamw"):
        records = [r[case]["records"] for r in cp_results]
        assert [r[case]["layout"] for r in cp_results] == [(2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]
        for step in range(STEPS):
            idx = [rec[step]["index"] for rec in records]
            assert idx[0] == idx[1] and idx[2] == idx[3], idx  # CP peers
            assert not set(idx[0]) & set(idx[2]), idx  # dp ranks draw different samples
        assert (
            len({i for b in global_batches(cp_results, (0, 2), case)[:3] for i in b}) == 12
        )  # one epoch, every sample


def test_sgd_trajectory_matches_one_process(cp_results):
    params = [r["sgd"]["params"] for r in cp_results]
    for other in params[1:]:  # every rank holds the same model
        assert param_rel_err(other, params[0]) == 0.0
    ref, start, _, _ = reference("sgd", global_batches(cp_results, (0, 2), "sgd"))
    err, moved = param_rel_err(params[0], ref), param_rel_err(start, ref)
    print(f"accelerate dp2 x cp2, SGD: max relative parameter error {err:.2e} (training moved them {moved:.2e})")
    assert moved > 100 * SGD_TOL
    assert err <= SGD_TOL, err
    assert update_rel_err(params[0], ref, start) <= 1e-3  # a cp-times gradient scale error would be ~0.5


@pytest.mark.parametrize("case", ["odd_length", "odd_length_loss_parallel"])
def test_sgd_trajectory_at_a_length_cp_does_not_divide(cp_results, case):
    params = cp_results[0][case]["params"]
    ref, start, _, _ = reference("sgd", global_batches(cp_results, (0, 2), case), shape=ODD)
    err = param_rel_err(params, ref)
    print(f"accelerate dp2 x cp2, SGD, 33 + 13 tokens, {case}: max relative parameter error {err:.2e}")
    assert param_rel_err(start, ref) > 100 * SGD_TOL
    assert err <= SGD_TOL, err
    assert update_rel_err(params, ref, start) <= 1e-3


def test_gather_gives_the_global_loss_and_cp_gather_drops_duplicates(cp_results):
    batches = global_batches(cp_results, (0, 2), "sgd")
    _, _, losses, _ = reference("sgd", batches[:1])
    gathered = cp_results[0]["sgd"]["records"][0]["gathered_loss"]
    assert len(gathered) == 4 and gathered[0] == gathered[1] and gathered[2] == gathered[3]
    assert abs(sum(gathered) / 4 - losses[0]) <= 1e-5 * abs(losses[0])  # the mean is the global mean
    for r in cp_results:  # ContextParallel.gather: one copy per dp rank, in dp order
        assert r["sgd"]["dp_gather"] == cp_results[0]["sgd"]["first_index"] + cp_results[2]["sgd"]["first_index"]


def test_adamw_with_active_clipping_is_as_close_as_plain_accelerate_ddp(cp_results, ddp_results):
    cp_batches, ddp_batches = global_batches(cp_results, (0, 2), "adamw"), global_batches(ddp_results, (0, 1))
    cp_ref, start, _, ref_norms = reference("adamw", cp_batches, clip=CLIP)
    ddp_ref, ddp_start, _, _ = reference("adamw", ddp_batches, clip=CLIP)
    cp_norms = [rec["norm"] for rec in cp_results[0]["adamw"]["records"]]
    # clipping is active, and accelerator.clip_grad_norm_ sees the full gradient (a cp-times error would show)
    assert min(ref_norms) > 5 * CLIP, ref_norms
    for got, want in zip(cp_norms, ref_norms, strict=True):
        assert abs(got - want) <= 1e-4 * want, (cp_norms, ref_norms)
    cp_params, ddp_params = cp_results[0]["adamw"]["params"], ddp_results[0]["params"]
    cp_upd, ddp_upd = update_rel_err(cp_params, cp_ref, start), update_rel_err(ddp_params, ddp_ref, ddp_start)
    cp_err, ddp_err = param_rel_err(cp_params, cp_ref), param_rel_err(ddp_params, ddp_ref)
    print(
        f"accelerate AdamW + clipping: error over the update CP {cp_upd:.2e} vs plain DDP {ddp_upd:.2e}; "
        f"worst parameter CP {cp_err:.2e} vs plain DDP {ddp_err:.2e}"
    )
    assert cp_upd <= 1.5 * ddp_upd, (cp_upd, ddp_upd)
    assert cp_err <= 2e-4, cp_err


def test_gradient_accumulation_matches_one_process(cp_results):
    params = cp_results[0]["accumulate"]["params"]
    batches = global_batches(cp_results, (0, 2), "accumulate", micro_per_step=2)
    assert len(batches) == 3 and all(len(b) == 8 for b in batches)  # 2 micro-batches x 2 dp ranks x 2 samples
    ref, start, _, _ = reference("sgd", batches, samples=16)
    assert param_rel_err(start, ref) > 100 * SGD_TOL
    assert param_rel_err(params, ref) <= SGD_TOL


def test_rng_is_shared_by_cp_peers_and_differs_across_dp(cp_results):
    sums = [r["resume"]["full"][0]["noise_sum"] for r in cp_results]
    assert sums[0] == sums[1] and sums[2] == sums[3], sums
    assert sums[0] != sums[2], sums


def test_save_state_load_state_resumes_exactly(cp_results):
    for r in cp_results:
        res = r["resume"]
        assert [rec["index"] for rec in res["resumed"]] == [rec["index"] for rec in res["full"][3:]]
        for got, want in zip(res["resumed"], res["full"][3:], strict=True):
            assert abs(got["loss"] - want["loss"]) <= 1e-6 * abs(want["loss"]), (got["loss"], want["loss"])
            assert got["noise_sum"] == want["noise_sum"]
        assert param_rel_err(res["resumed_params"], res["full_params"]) <= 1e-6
    files = cp_results[0]["resume"]["files"]
    assert "model.safetensors" in files and "optimizer.bin" in files, files
    assert {f"random_states_{i}.pkl" for i in range(4)} <= set(files), files


def test_cp_save_state_resumes_mid_epoch_with_the_loaders_position(cp_results):
    for r in cp_results:
        res = r["mid_epoch_resume"]
        assert res["epoch"] == 1 and res["extra"] == {"note": "kept"}, (res["epoch"], res["extra"])
        assert [rec["index"] for rec in res["resumed"]] == [rec["index"] for rec in res["full"][4:]]
        for got, want in zip(res["resumed"], res["full"][4:], strict=True):
            assert abs(got["loss"] - want["loss"]) <= 1e-6 * abs(want["loss"]), (got["loss"], want["loss"])
            assert got["noise_sum"] == want["noise_sum"]
        assert res["err"] <= 1e-6, res["err"]


def test_nonfinite_raise_names_the_step_and_ranks_on_every_rank_and_skip_skips(cp_results):
    for r in cp_results:
        raised = r["nonfinite"]["ddp_raise"]
        assert raised["error"].startswith("step 1: non-finite loss on rank(s) [1]"), raised["error"]
        assert "cp_lightning.accelerate.ContextParallel(..., nonfinite='skip')" in raised["error"], raised["error"]
        assert raised["changed_0"] and not raised["changed_1"], raised
        sharded = r["nonfinite"]["fsdp_raise"]  # the loss is finite: only the gradient shards show it
        assert sharded["error"].startswith(
            "step 1: non-finite gradient shards on rank(s) [0, 1, 2, 3] (FSDP, after the reduce-scatter)"
        ), sharded["error"]
        assert sharded["changed_0"] and not sharded["changed_1"], sharded
        skipped = r["nonfinite"]["ddp_skip"]
        assert skipped["error"] is None and skipped["skipped"] == 1, skipped
        assert skipped["changed_0"] and not skipped["changed_1"] and skipped["changed_2"], skipped
        assert not skipped["lr_held_0"] and skipped["lr_held_1"] and not skipped["lr_held_2"], skipped


def test_saved_model_loads_into_the_bare_model_without_cp_lightning(cp_results):
    from safetensors.torch import load_file

    bare = make_task()
    state = load_file(Path(cp_results[0]["resume"]["state_dir"]) / "model.safetensors")
    bare.load_state_dict(state, strict=True)  # plain keys: no DDP prefix, no CP hooks
    assert param_rel_err(params_of(bare), cp_results[0]["resume"]["saved_params"]) == 0.0
    assert param_rel_err(params_of(make_task()), cp_results[0]["resume"]["saved_params"]) > 1e-3  # trained weights


ERRORS = {
    "cp3": ("ValueError", "cp=3 must divide the number of processes (4)"),
    "fsdp": ("ValueError", "does not support FSDP"),
    "deepspeed": ("ValueError", "does not support DEEPSPEED"),
    "parallelism_config": ("ValueError", "replaces Accelerate's own context parallelism"),
    "comm_hook": ("ValueError", "drop comm_hook"),
    "ddp_model": ("TypeError", "already wrapped in DistributedDataParallel"),
    "prepared_loader": ("ValueError", "already prepared by accelerator.prepare"),
    "no_plan": ("ValueError", "nothing to split"),
}


def test_every_mesh_group_gets_the_world_timeout_or_the_given_one(cp_results):
    for r in cp_results:
        assert r["timeouts"] == {"world": 480.0, "default": [480.0], "given": [200.0]}, r["timeouts"]


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_configuration_is_a_clear_error_on_every_rank(cp_results, case):
    kind, text = ERRORS[case]
    for r in cp_results:
        got = r["errors"][case]
        assert got is not None and got.startswith(kind) and text in got, got


def test_single_process_errors():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from cp_lightning.accelerate import ContextParallel, prepare_context_parallel

    try:
        accelerator = fresh_accelerator()
        with pytest.raises(ValueError, match=r"cp=2 needs cp processes.*accelerate launch --num_processes 2"):
            prepare_context_parallel(accelerator, torch.nn.Linear(2, 2), cp=2)
        with pytest.raises(ValueError, match="ring=3 must divide cp=2"):
            ContextParallel(accelerator, cp=2, ring=3)
        with pytest.raises(TypeError, match="expected an accelerate.Accelerator"):
            ContextParallel(object(), cp=1)
        with pytest.raises(ValueError, match="timeout must be a positive, finite duration"):
            ContextParallel(accelerator, cp=2, timeout=-1)  # before the layout check: the first thing checked
        with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or seconds"):
            ContextParallel(accelerator, cp=1, timeout="30m")
        with pytest.raises(ValueError, match=r"fsdp_units must be one of \['blocks', 'children'\]"):
            ContextParallel(accelerator, cp=1, fsdp=True, fsdp_units="block")
        with pytest.raises(ValueError, match="fsdp_units='children' shards inside each block, and compile="):
            ContextParallel(accelerator, cp=1, fsdp=True, fsdp_units="children", compile=True)
    finally:
        AcceleratorState._reset_state()
        GradientState._reset_state()
        PartialState._reset_state()


def test_accelerate_launch_runs_the_recipe(tmp_path):
    cache = ROOT / "outputs" / "cache" / "tiny_flux_pipeline"  # reuse the main job's tiny pipeline when built
    cache_dir = tmp_path / "cache"
    if cache.exists():
        cache_dir.mkdir()
        (cache_dir / cache.name).symlink_to(cache)
    out = tmp_path / "out"
    cmd = [
        *(sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"),
        *("--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"),
        *("-m", "recipes.accelerate_flux_lora", "--cpu", "--max_steps", "3", "--synthetic_samples", "8"),
        *("--image_dir", str(tmp_path / "shapes"), "--cache_dir", str(cache_dir), "--output_dir", str(out)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dp=1 x cp=2" in proc.stdout
    # the bucket table knows the layout without a Trainer: 64 image and 32 text tokens at 32 px, 48 per CP rank
    assert "cp=2):" in proc.stdout and "cp=1" not in proc.stdout, proc.stdout[-3000:]
    with (out / "buckets.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert (int(row["tokens_per_sample"]), int(row["tokens_per_cp_rank"])) == (96, 48)
    with (out / "loss.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert all(0 < float(r["loss"]) < 10 for r in rows)
    from safetensors.torch import load_file

    lora = load_file(out / "lora" / "pytorch_lora_weights.safetensors")
    assert lora and all("lora" in k for k in lora), list(lora)[:4]
    assert (out / "samples.png").stat().st_size > 0 and (out / "loss.png").exists()


def test_recipe_refuses_cp_not_dividing_processes(tmp_path):
    cmd = [sys.executable, "-m", "recipes.accelerate_flux_lora", "--cpu", "--cp", "2", "--output_dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "cp=2 needs cp processes" in proc.stderr, proc.stderr[-2000:]
    assert not any(tmp_path.iterdir())  # refused before any data or model work

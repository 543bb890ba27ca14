"""FSDP2 over dp x cp against one process: Lightning, Fabric and Accelerate, 4 CPU processes, gloo.

One spawned group runs every multi-process case (a group costs seconds to start; Lightning and Fabric run
inside the already-launched workers, as under torchrun); each test asserts on its part of the results.
Every trajectory is 5 optimizer steps of the tiny Flux on global batches of 4, compared with one process
trained on the same global batches (tests/lightning_tasks.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from tests.distributed import spawn
from tests.lightning_tasks import FlowMatching, Samples, param_rel_err, read_records, reference_params, update_rel_err

STEPS, GLOBAL_BATCH, SGD_TOL, CLIP = 5, 4, 1e-5, 0.05


class Task(FlowMatching):
    """The flow-matching loss as a plain module, ``forward(batch) -> (loss, noise)`` (Fabric, Accelerate, DDP)."""

    def forward(self, batch):
        return self.loss(batch)


def numpy_of(state: dict) -> dict:
    return {k: v.detach().float().numpy() for k, v in state.items()}


def tensors_of(state: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in state.items()}


# -- worker side ----------------------------------------------------------------------------------
def fit(module_kwargs=None, strategy_kwargs=None, steps=STEPS, samples=None, ckpt_path=None, callbacks=(), **kw):
    """One Lightning fit inside the worker group; returns rank 0's consolidated parameters and recorded losses."""
    import lightning as L
    from torch.distributed.fsdp import FSDPModule

    from cp_lightning import ContextParallelStrategy
    from cp_lightning.sharding import full_state_dict

    module_kwargs, strategy_kwargs = dict(module_kwargs or {}), {"cp": 2, "fsdp": True, **(strategy_kwargs or {})}
    root = kw.pop("root", None)
    torch.manual_seed(0)
    module = FlowMatching(**module_kwargs)
    dp = 4 // strategy_kwargs["cp"]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=ContextParallelStrategy(**strategy_kwargs),
        max_steps=steps,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kw,
    )
    batch = (8 if kw.get("accumulate_grad_batches") else GLOBAL_BATCH) // dp // kw.get("accumulate_grad_batches", 1)
    trainer.fit(module, DataLoader(samples or Samples(), batch_size=batch, shuffle=True), ckpt_path=ckpt_path)
    state = full_state_dict(module)
    dist.barrier()
    out = {"params": numpy_of(state) if dist.get_rank() == 0 else None}
    out["units"] = [n for n, m in module.transformer.named_modules() if isinstance(m, FSDPModule)]
    if module_kwargs.get("record_dir"):
        out["losses"] = {r["step"]: r["loss"] for r in read_records(module_kwargs["record_dir"]) if r["rank"] == 0}
    return out


def error_of(fn):
    try:
        fn()
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def lightning_cases(tmp: Path) -> dict:
    out = {
        "dp2xcp2": fit(),
        "usp_cp4_ring2": fit(strategy_kwargs={"cp": 4, "ring": 2}),
        "loss_parallel": fit(strategy_kwargs={"loss_parallel": True, "reshard_after_forward": False}),
        "hsdp": fit(strategy_kwargs={"hsdp": True}),
        "cpu_offload": fit(strategy_kwargs={"cpu_offload": True}),
        "lora": fit({"lora": True, "lr": 0.5}),
        "checkpointing": fit({"checkpointing": True}),
        "children": fit({"checkpointing": True, "lora": True, "lr": 0.5}, strategy_kwargs={"fsdp_units": "children"}),
        "accumulate": fit(samples=Samples(n=16), steps=3, accumulate_grad_batches=2),
        "adamw_clip": fit({"optimizer": "adamw", "lr": 1e-3}, gradient_clip_val=CLIP),
        "bf16": fit(precision="bf16-mixed"),
    }
    out["resume"] = resume_cases(tmp)
    out["export"] = export_case(tmp)
    return out


def resume_cases(tmp: Path) -> dict:
    """Save at step 3 through ModelCheckpoint, resume through ckpt_path: the same layout with noise from the
    (per-dp-rank) RNG, and other layouts (dp1 x cp4, HSDP) with per-sample noise; AdamW, so optimizer state
    is resharded too."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = {}
    for name, noise, resumes in (
        ("same", "rng", {"same": {}}),
        ("cross", "sample", {"dp1xcp4": {"cp": 4}, "hsdp": {"hsdp": True}}),
    ):
        module = {"optimizer": "adamw", "lr": 1e-3, "noise": noise}
        dirs = {k: tmp / f"{name}_{k}" for k in ("full", "first", *resumes)}
        for d in dirs.values():
            d.mkdir(exist_ok=True)
        dist.barrier()
        full = fit({**module, "record_dir": str(dirs["full"])})
        saver = ModelCheckpoint(dirpath=tmp / f"ckpt_{name}", every_n_train_steps=3, save_top_k=-1)
        fit({**module, "record_dir": str(dirs["first"])}, steps=3, callbacks=[saver], root=str(tmp))
        ckpt = str(next((tmp / f"ckpt_{name}").glob("*step=3*")))
        out[name] = {"full": full, "ckpt": ckpt}
        for resume, strategy in resumes.items():
            out[name][resume] = fit({**module, "record_dir": str(dirs[resume])}, strategy, ckpt_path=ckpt)
    ckpt = out["same"]["ckpt"]
    out["is_dir"] = Path(ckpt).is_dir()
    # a checkpoint whose tensors this model does not have, and a sharded one given to the DDP strategy
    out["errors"] = {
        "not_reshardable": error_of(lambda: fit({"lora": True}, ckpt_path=ckpt)),
        "ddp_loads_sharded": error_of(lambda: fit(strategy_kwargs={"fsdp": False}, ckpt_path=ckpt)),
        "no_blocks": error_of(lambda: fit(strategy_kwargs={"fsdp_blocks": ["NoSuchBlock"]})),
    }
    return out


def export_case(tmp: Path) -> dict:
    """Consolidated diffusers export from the sharded model: LoRA (pytorch_lora_weights.safetensors) and full."""
    import lightning as L

    from cp_lightning import ContextParallelStrategy
    from cp_lightning.sharding import export_lora, export_pretrained, full_state_dict

    out = {}
    for lora in (True, False):
        torch.manual_seed(0)
        module = FlowMatching(lora=lora, lr=0.5)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=4,
            strategy=ContextParallelStrategy(cp=2, fsdp=True),
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, DataLoader(Samples(), batch_size=2, shuffle=True))
        where = tmp / ("lora" if lora else "full")
        if lora:
            export_lora(module.transformer, where)
        else:
            export_pretrained(module.transformer, where)
        state = full_state_dict(module.transformer)
        dist.barrier()
        if dist.get_rank() == 0:
            out["lora" if lora else "full"] = {"dir": str(where), "state": numpy_of(state)}
    return out


def plain_ddp_adamw(rank: int):
    """Plain DDP over the dp ranks (0 and 2) of the dp2 x cp2 runs, no CP: the AdamW + clipping yardstick."""
    group = dist.new_group([0, 2])
    if rank not in (0, 2):
        return None
    torch.manual_seed(0)
    module = Task(optimizer="adamw", lr=1e-3)
    model = torch.nn.parallel.DistributedDataParallel(module, process_group=group)
    optimizer = module.configure_optimizers()
    dataset = Samples()
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank // 2, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step == STEPS:
                break
            optimizer.zero_grad()
            model(batch)[0].backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
            optimizer.step()
            step += 1
        epoch += 1
    return numpy_of({n: p for n, p in module.named_parameters()})


def fabric_case(tmp: Path) -> dict:
    from lightning.fabric import Fabric

    from cp_lightning import FabricContextParallelStrategy
    from cp_lightning.sharding import full_state_dict

    fabric = Fabric(accelerator="cpu", devices=4, strategy=FabricContextParallelStrategy(cp=2, fsdp=True))
    fabric.launch()
    torch.manual_seed(0)
    errors = {}
    early = Task()
    errors["fabric_optimizer_first"] = error_of(lambda: fabric.setup(early, torch.optim.SGD(early.parameters())))
    stale = Task()
    stale_optimizer = torch.optim.SGD(stale.parameters(), lr=0.1)
    fabric.setup(stale)
    errors["fabric_stale_optimizer"] = error_of(lambda: fabric.setup_optimizers(stale_optimizer))

    module = Task(optimizer="sgd")
    model = fabric.setup(module)
    optimizer = fabric.setup_optimizers(module.configure_optimizers())
    dataset = Samples()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, **fabric.strategy.distributed_sampler_kwargs)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=2, sampler=sampler), use_distributed_sampler=False)
    step, epoch, norms, batches = 0, 0, [], []
    while step < STEPS:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step == STEPS:
                break
            optimizer.zero_grad()
            fabric.backward(model(batch)[0])
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=1e6).item())  # inactive: just the norm
            optimizer.step()
            batches.append(batch["index"].tolist())
            step += 1
        epoch += 1
    state = full_state_dict(module)
    # fabric.save / fabric.load: a sharded checkpoint, restored into a freshly set-up model and optimizer
    fabric.save(tmp / "fabric_ckpt", {"model": model, "optimizer": optimizer, "step": step})
    torch.manual_seed(1)
    fresh = Task(optimizer="sgd")
    fresh_model = fabric.setup(fresh)
    fresh_optimizer = fabric.setup_optimizers(fresh.configure_optimizers())
    restored = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(tmp / "fabric_ckpt", restored)
    loaded = full_state_dict(fresh)
    return {
        "params": numpy_of(state) if fabric.global_rank == 0 else None,
        "loaded": numpy_of(loaded) if fabric.global_rank == 0 else None,
        "loaded_step": restored["step"],
        "norms": norms,
        "errors": errors,
    }


def accelerate_cases(tmp: Path) -> dict:
    from cp_lightning.accelerate import ContextParallel
    from cp_lightning.sharding import full_state_dict
    from tests.test_accelerate import PER_RANK_BATCH, fresh_accelerator, make_task, optimizer, train

    out = {}
    for case, kind, clip, kwargs in (
        ("sgd", "sgd", None, {}),
        ("adamw_clip", "adamw", CLIP, {"hsdp": True}),
    ):
        accelerator = fresh_accelerator()
        cpx = ContextParallel(accelerator, cp=2, seed=0, fsdp=True, **kwargs)
        model = make_task()
        opt = optimizer(kind, model.parameters())  # before sharding, prepared together: repointed
        loader = DataLoader(Samples(), batch_size=PER_RANK_BATCH, shuffle=True)
        model, opt, loader = cpx.prepare(model, opt, loader)
        records = train(accelerator, model, opt, loader, STEPS, clip=clip)
        state = full_state_dict(model)
        out[case] = {"params": numpy_of(state) if dist.get_rank() == 0 else None, "records": records}
        if case == "sgd":  # sharded save/load through ContextParallel; accelerator.save_state refuses
            cpx.save_state(tmp / "acc_ckpt", model=model, optimizer=opt, step=STEPS)
            out["save_state_error"] = error_of(lambda acc=accelerator: acc.save_state(str(tmp / "acc_state")))
            accelerator = fresh_accelerator()
            cpx = ContextParallel(accelerator, cp=2, seed=0, fsdp=True)
            fresh, fresh_opt = make_task(), None
            torch.manual_seed(1)
            fresh_opt = optimizer(kind, fresh.parameters())
            fresh, fresh_opt = cpx.prepare(fresh, fresh_opt)
            out["loaded_extra"] = cpx.load_state(tmp / "acc_ckpt", model=fresh, optimizer=fresh_opt)
            loaded = full_state_dict(fresh)
            out["loaded"] = numpy_of(loaded) if dist.get_rank() == 0 else None
    accelerator = fresh_accelerator()
    cpx = ContextParallel(accelerator, cp=2, fsdp=True)
    model = make_task()
    opt = optimizer("sgd", model.parameters())
    cpx.prepare(model)
    out["errors"] = {"accelerate_stale_optimizer": error_of(lambda: cpx.prepare(opt))}
    return out


def worker(rank, world, tmp):
    os.environ["PL_GLOBAL_SEED"] = "0"
    tmp = Path(tmp)
    return {
        "lightning": lightning_cases(tmp),
        "plain_ddp": plain_ddp_adamw(rank),
        "fabric": fabric_case(tmp),
        "accelerate": accelerate_cases(tmp),
    }


# -- test side -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    return spawn(worker, 4, str(tmp), timeout_s=600, env={"PL_GLOBAL_SEED": "0", "LOCAL_WORLD_SIZE": "4"})


def one_process(module_kwargs=None, steps=STEPS, samples=None, global_batch=GLOBAL_BATCH, clip=None, bf16=False):
    torch.manual_seed(0)
    module = FlowMatching(**(module_kwargs or {}))
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ref = reference_params(module, samples or Samples(), global_batch, steps, clip=clip, seed=0)
    return ref, start


SGD_CASES = {
    "dp2xcp2": {},
    "usp_cp4_ring2": {},
    "loss_parallel": {},
    "hsdp": {},
    "cpu_offload": {},
    "lora": {"lora": True, "lr": 0.5},
    "checkpointing": {"checkpointing": True},
    "children": {"checkpointing": True, "lora": True, "lr": 0.5},
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_trajectory_matches_one_process(results, case):
    ref, start = one_process(SGD_CASES[case])
    params = tensors_of(results[0]["lightning"][case]["params"])
    err, moved = param_rel_err(params, ref), param_rel_err(start, ref)
    print(f"fsdp {case}: max relative parameter error {err:.2e} (training moved them {moved:.2e})")
    assert moved > 100 * SGD_TOL
    assert err <= SGD_TOL, (case, err)
    assert update_rel_err(params, ref, start) <= 1e-3  # a cp-times gradient scale error would be ~1


def test_fsdp_units_children_shards_each_block_by_its_parts(results):
    blocks = results[0]["lightning"]["dp2xcp2"]["units"]
    children = results[0]["lightning"]["children"]["units"]
    assert "transformer_blocks.0" in blocks and "transformer_blocks.0.attn" not in blocks
    assert set(blocks) < set(children)
    for part in ("attn", "ff", "norm1", "norm1_context", "ff_context"):
        assert f"transformer_blocks.0.{part}" in children, (part, children)
    for part in ("attn", "proj_mlp", "proj_out", "norm"):
        assert f"single_transformer_blocks.0.{part}" in children, (part, children)


def test_accumulated_gradients_match_one_process(results):
    ref, start = one_process(samples=Samples(n=16), steps=3, global_batch=8)
    params = tensors_of(results[0]["lightning"]["accumulate"]["params"])
    assert param_rel_err(start, ref) > 100 * SGD_TOL
    assert param_rel_err(params, ref) <= SGD_TOL


def test_adamw_with_active_clipping_is_as_close_as_plain_ddp(results):
    module = {"optimizer": "adamw", "lr": 1e-3}
    ref, start = one_process(module, clip=CLIP)
    probe = FlowMatching(**module)
    probe.loss(torch.utils.data.default_collate([Samples()[i] for i in range(GLOBAL_BATCH)]))[0].backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in probe.parameters() if p.grad is not None]))
    assert norm > 5 * CLIP, norm  # clipping is active
    fsdp = tensors_of(results[0]["lightning"]["adamw_clip"]["params"])
    ddp = tensors_of(results[0]["plain_ddp"])
    fsdp_upd, ddp_upd = update_rel_err(fsdp, ref, start), update_rel_err(ddp, ref, start)
    fsdp_err, ddp_err = param_rel_err(fsdp, ref), param_rel_err(ddp, ref)
    print(
        f"fsdp AdamW + clipping: error over the update FSDP {fsdp_upd:.2e} vs plain DDP {ddp_upd:.2e} "
        f"(ratio {fsdp_upd / ddp_upd:.2f}); worst parameter FSDP {fsdp_err:.2e} vs plain DDP {ddp_err:.2e}"
    )
    assert fsdp_upd <= 1.5 * ddp_upd, (fsdp_upd, ddp_upd)
    assert fsdp_err <= 2e-4, fsdp_err


def test_bf16_mixed_is_no_worse_than_one_process_bf16(results):
    ref, start = one_process()
    plain_bf16, _ = one_process(bf16=True)
    params = tensors_of(results[0]["lightning"]["bf16"]["params"])
    fsdp_err, plain_err = update_rel_err(params, ref, start), update_rel_err(plain_bf16, ref, start)
    print(f"fsdp bf16-mixed against fp32, relative to the update: FSDP {fsdp_err:.2e}, one process {plain_err:.2e}")
    assert plain_err > 0
    assert fsdp_err <= 2 * plain_err, (fsdp_err, plain_err)


@pytest.mark.parametrize("case", ["same", "dp1xcp4", "hsdp"])
def test_resume_from_a_sharded_checkpoint_equals_the_uninterrupted_run(results, case):
    resume = results[0]["lightning"]["resume"]
    assert resume["is_dir"]  # a torch.distributed.checkpoint directory
    run = resume["same" if case == "same" else "cross"]
    full, resumed = run["full"], run[case]
    assert sorted(resumed["losses"]) == [3, 4]
    worst = max(abs(resumed["losses"][s] - full["losses"][s]) for s in (3, 4))
    err = param_rel_err(tensors_of(resumed["params"]), tensors_of(full["params"]))
    print(f"fsdp resume at {case}: steps 4-5 loss difference {worst:.1e}, parameters {err:.1e} relative")
    assert worst <= 1e-6, (resumed["losses"], full["losses"])
    assert err <= 1e-6, err


def test_fabric_matches_one_process_and_clip_gradients_returns_the_full_norm(results):
    ref, start = one_process()
    fabric = results[0]["fabric"]
    err = param_rel_err(tensors_of(fabric["params"]), ref)
    print(f"fsdp Fabric dp2 x cp2 SGD: max relative parameter error {err:.2e}")
    assert err <= SGD_TOL, err
    # the first step's norm is the one-process norm of the first global batch's gradient
    torch.manual_seed(0)
    probe = Task()
    order = list(DistributedSampler(Samples(), num_replicas=1, rank=0, shuffle=True, seed=0))
    probe(torch.utils.data.default_collate([Samples()[i] for i in order[:GLOBAL_BATCH]]))[0].backward()
    norm = torch.nn.utils.clip_grad_norm_(probe.parameters(), 1e6).item()
    assert abs(fabric["norms"][0] - norm) <= 1e-5 * norm, (fabric["norms"][0], norm)
    # fabric.save / fabric.load round trip through a sharded checkpoint
    assert fabric["loaded_step"] == STEPS
    assert param_rel_err(tensors_of(fabric["loaded"]), tensors_of(fabric["params"])) == 0.0


def test_accelerate_matches_one_process(results):
    from tests.test_accelerate import global_batches, reference

    accel = [r["accelerate"] for r in results]
    ref, start, _, _ = reference("sgd", global_batches(accel, (0, 2), "sgd"))
    params = tensors_of(accel[0]["sgd"]["params"])
    err = param_rel_err(params, ref)
    print(f"fsdp Accelerate dp2 x cp2 SGD: max relative parameter error {err:.2e}")
    assert param_rel_err(start, ref) > 100 * SGD_TOL
    assert err <= SGD_TOL, err


def test_accelerate_sharded_save_and_load_state(results):
    accel = results[0]["accelerate"]
    assert accel["loaded_extra"] == {"step": STEPS}
    assert param_rel_err(tensors_of(accel["loaded"]), tensors_of(accel["sgd"]["params"])) == 0.0
    for r in results:  # accelerator.save_state would write rank 0's shards as the model: refused on every rank
        got = r["accelerate"]["save_state_error"]
        assert got is not None and "use cp.save_state(path, model=model, optimizer=optimizer)" in got, got


def test_accelerate_hsdp_adamw_clip_grad_norm_returns_the_one_process_norm(results):
    from tests.test_accelerate import global_batches, reference

    accel = [r["accelerate"] for r in results]
    ref, start, _, ref_norms = reference("adamw", global_batches(accel, (0, 2), "adamw_clip"), clip=CLIP)
    norms = [rec["norm"] for rec in accel[0]["adamw_clip"]["records"]]
    assert min(ref_norms) > 5 * CLIP
    for got, want in zip(norms, ref_norms, strict=True):
        assert abs(got - want) <= 1e-4 * want, (norms, ref_norms)
    assert param_rel_err(tensors_of(accel[0]["adamw_clip"]["params"]), ref) <= 2e-4


def test_consolidated_exports_load_without_cp_lightning(results):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    from cp_lightning.tiny import tiny_model

    export = results[0]["lightning"]["export"]
    full = FluxTransformer2DModel.from_pretrained(export["full"]["dir"])
    assert param_rel_err(dict(full.named_parameters()), tensors_of(export["full"]["state"])) == 0.0
    lora = load_file(Path(export["lora"]["dir"]) / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") and "lora" in k for k in lora), list(lora)[:4]
    bare = tiny_model("flux")
    bare.load_lora_adapter(lora, prefix="transformer", adapter_name="default")
    trained = {k: v for k, v in tensors_of(export["lora"]["state"]).items() if "lora" in k}
    got = {n: p.detach() for n, p in bare.named_parameters() if "lora" in n}
    assert sorted(got) == sorted(trained) and param_rel_err(got, trained) == 0.0


ERRORS = {
    "no_blocks": ("lightning", "found no repeated blocks to shard in FluxTransformer2DModel"),
    "not_reshardable": ("lightning", "cannot be resharded into this model"),
    "ddp_loads_sharded": ("lightning", "resume it with ContextParallelStrategy(..., fsdp=True)"),
    "fabric_optimizer_first": ("fabric", "would train stale copies. Call model = fabric.setup(model) first"),
    "fabric_stale_optimizer": ("fabric", "not the sharded model's"),
    "accelerate_stale_optimizer": ("accelerate", "stale, unsharded parameters"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_a_clear_error_on_every_rank(results, case):
    where, text = ERRORS[case]
    for r in results:
        errors = r[where]["resume"]["errors"] if where == "lightning" else r[where]["errors"]
        got = errors[case]
        assert got is not None and got.startswith("ValueError") and text in got, got


# -- single process ---------------------------------------------------------------------------------
def test_fsdp_options_are_checked_at_construction():
    import lightning as L

    from cp_lightning import ContextParallelStrategy

    with pytest.raises(ValueError, match="hsdp, cpu_offload only apply with fsdp=True"):
        ContextParallelStrategy(cp=2, hsdp=True, cpu_offload=True)
    with pytest.raises(TypeError, match="fsdp_blocks must be a list of block class names"):
        ContextParallelStrategy(cp=2, fsdp=True, fsdp_blocks="FluxTransformerBlock")
    with pytest.raises(ValueError, match=r"fsdp_units must be one of \['blocks', 'children'\], got 'layers'"):
        ContextParallelStrategy(cp=2, fsdp=True, fsdp_units="layers")
    with pytest.raises(ValueError, match="fsdp_units='children' only apply with fsdp=True"):
        ContextParallelStrategy(cp=2, fsdp_units="children")
    with pytest.raises(ValueError, match="fsdp_units='children' shards inside each block, and compile="):
        ContextParallelStrategy(cp=2, fsdp=True, fsdp_units="children", compile=True)
    from cp_lightning import FabricContextParallelStrategy

    with pytest.raises(ValueError, match="fsdp_units='children' only apply with fsdp=True"):
        FabricContextParallelStrategy(cp=2, fsdp_units="children")
    from lightning.pytorch.plugins.precision import MixedPrecision

    fp16 = MixedPrecision("16-mixed", "cpu")  # precision="16-mixed" on a CPU Trainer becomes bf16-mixed
    with pytest.raises(ValueError, match="does not support precision='16-mixed'"):
        L.Trainer(accelerator="cpu", devices=2, plugins=[fp16], strategy=ContextParallelStrategy(2, fsdp=True))
    with pytest.raises(ValueError, match="fsdp=True needs start_method='popen'"):
        L.Trainer(accelerator="cpu", devices=2, strategy=ContextParallelStrategy(2, fsdp=True, start_method="spawn"))


def test_a_model_without_repeated_blocks_names_the_fix():
    from cp_lightning.sharding import FSDPOptions, check_fsdp_model

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model._cp_plan = {"": {}}
    with pytest.raises(ValueError, match=r"found no repeated blocks to shard in Sequential .*fsdp_blocks=\['MyBlock'"):
        check_fsdp_model(model, None, FSDPOptions())
    outer = torch.nn.Module()
    outer.head = torch.nn.Linear(2, 2)
    outer.transformer = FlowMatching().transformer
    with pytest.raises(ValueError, match=r"trainable parameters lie outside them: \['head.weight'"):
        check_fsdp_model(outer, None, FSDPOptions())


def test_rng_states_must_cover_every_dp_rank():
    from cp_lightning.data_parallel import restore_rng_state

    states = {0: {"torch": torch.get_rng_state(), "python": __import__("random").getstate()}}
    restore_rng_state(states, 0, 1)
    with pytest.raises(ValueError, match=r"RNG states for dp ranks \[0\], but this run has dp ranks \[0, 1\]"):
        restore_rng_state(states, 0, 2)


def test_a_lightning_cli_yaml_sets_the_fsdp_options(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    from cp_lightning import ContextParallelStrategy

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 4\n  logger: false\n  strategy:\n"
        "    class_path: cp_lightning.ContextParallelStrategy\n"
        "    init_args: {cp: 2, fsdp: true, hsdp: true, reshard_after_forward: false,\n"
        "                fsdp_blocks: [FluxTransformerBlock]}\n"
    )
    cli = LightningCLI(FlowMatching, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ContextParallelStrategy) and strategy.fsdp
    options = strategy.fsdp_options
    assert (options.hsdp, options.reshard_after_forward, options.blocks) == (True, False, ("FluxTransformerBlock",))


def test_a_light_checkpoint_may_leave_out_frozen_tensors_but_no_trainable_one(tmp_path):
    import torch.distributed.checkpoint as dcp

    from cp_lightning.sharding import check_checkpoint_layout

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)  # the frozen base; model[1] trains
    light, base = tmp_path / "light", tmp_path / "base"
    dcp.save({"state_dict": {k: v for k, v in model.state_dict().items() if k.startswith("1.")}}, checkpoint_id=light)
    dcp.save({"state_dict": {k: v for k, v in model.state_dict().items() if k.startswith("0.")}}, checkpoint_id=base)
    check_checkpoint_layout(light, model, 1, strict=False)
    with pytest.raises(ValueError, match=r"2 tensors differ: 0.weight is missing; 0.bias is missing"):
        check_checkpoint_layout(light, model, 1)  # strict loading needs every tensor
    with pytest.raises(ValueError, match=r"1.weight is missing \(a trainable parameter\)"):
        check_checkpoint_layout(base, model, 1, strict=False)
    model[1] = torch.nn.Linear(3, 4)  # another architecture: a shape change is an error either way
    with pytest.raises(ValueError, match=r"1.weight has shape \(2, 3\), the model \(4, 3\)"):
        check_checkpoint_layout(light, model, 1, strict=False)

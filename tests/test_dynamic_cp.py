"""Dynamic CP degree (cp_lightning.dynamic): SGD parity with one process at degrees 1, 2, 4 and mixed, 4 processes.

One spawned group (world 4, gloo) runs every multi-process case, at cp=4 and at dp 2 x cp 2. A case is a
schedule: each optimizer step is a list of micro-batches, each micro-batch one token length (so one degree:
min_tokens_per_rank=4 puts 4 tokens at degree 1, 8 at 2, 16 at 4) and one batch per sub-group (world / degree of
them). The one-process reference trains on the same samples with the gradient rule written out:
sum_i w_i grad(l_i) / W per step. Samples (latents, text, noise, timestep) are determined by their id, so a
sample's loss does not depend on the degree it ran at.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_lightning import dynamic
from cp_lightning.tiny import tiny_inputs, tiny_model
from tests.distributed import spawn

WORLD, CP, MIN_TOKENS, TEXT, SGD_TOL, LR = 4, 4, 4, 8, 1e-5, 0.5

# schedules: steps -> micro-batches -> (tokens, batch size per sub-group)
SCHEDULES = {
    "degree1": [[(4, 1)], [(4, 2)]],
    "degree2": [[(8, 1)], [(8, 2)]],
    "degree4": [[(16, 2)], [(16, 1)]],
    # accumulation: micro-batches of one step at different degrees, and an uneven last batch
    "mixed": [[(4, 1), (16, 2)], [(8, 2), (4, 1)], [(16, 1), (8, 1)]],
}
CASES = {  # name -> (schedule, strategy kwargs, module kwargs)
    "ddp_degree1": ("degree1", {}, {}),
    "ddp_degree2": ("degree2", {}, {}),
    "ddp_degree4": ("degree4", {}, {}),
    "ddp_mixed": ("mixed", {}, {}),
    "fsdp_mixed": ("mixed", {"fsdp": True}, {}),
    # 2 heads: degree 4 falls back to ring 2 x Ulysses 2; per-token weights
    "ddp_mixed_tokens_2heads": ("mixed", {"dynamic_weighting": "tokens"}, {"heads": 2}),
    # dp 2 x cp 2: the DDP hook and the FSDP factor divide by 1, not by dp (at cp=4 on 4 ranks dp is 1 anyway)
    "ddp_cp2_mixed": ("mixed", {"cp": 2}, {}),
    "fsdp_cp2_mixed": ("mixed", {"cp": 2, "fsdp": True}, {}),
}


def plan_batches(schedule, cp: int = CP):
    """Per step, per micro-batch: (tokens, [sample ids of each sub-group]); ids are unique in the run."""
    out, next_id = [], 0
    for step in schedule:
        micro = []
        for tokens, batch in step:
            subgroups = WORLD // dynamic.choose_degree(tokens, cp, MIN_TOKENS)
            ids = [list(range(next_id + g * batch, next_id + (g + 1) * batch)) for g in range(subgroups)]
            next_id += subgroups * batch
            micro.append((tokens, ids))
        out.append(micro)
    return out


def sample(index: int, tokens: int) -> dict:
    g = dynamic.sample_generator(index, seed=7)
    return {
        "latents": torch.randn(tokens, 16, generator=g),
        "text": torch.randn(TEXT, 32, generator=g),
        "pooled": torch.randn(32, generator=g),
        "noise": torch.randn(tokens, 16, generator=g),
        "t": torch.rand((), generator=g),
    }


def step_total(micro, weighting: str) -> float:
    return float(sum(len(ids) * (tokens if weighting == "tokens" else 1) for tokens, group in micro for ids in group))


def collate(ids, tokens, total):
    batch = torch.utils.data.default_collate([sample(i, tokens) for i in ids])
    batch["W"] = torch.tensor(total)
    return batch


class Task(torch.nn.Module):
    """The tiny Flux's flow-matching loss on a batch of one token length (ids built per length)."""

    def __init__(self, heads: int = 4):
        super().__init__()
        self.transformer = tiny_model("flux", heads=heads)

    def forward(self, batch):
        tokens = batch["latents"].shape[1]
        ids = tiny_inputs("flux", self.transformer, batch=1, tokens=tokens, text_tokens=TEXT)
        x0, noise, t = batch["latents"], batch["noise"], batch["t"]
        xt = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * noise
        pred = self.transformer(
            hidden_states=xt,
            encoder_hidden_states=batch["text"],
            pooled_projections=batch["pooled"],
            timestep=t,
            img_ids=ids["img_ids"],
            txt_ids=ids["txt_ids"],
            return_dict=False,
        )[0]
        return F.mse_loss(pred, noise - x0)  # the batch's mean of per-sample means (one length per batch)


def reference(schedule, weighting: str, heads: int, cp: int = CP) -> dict:
    """One process: per step, sum_i w_i grad(l_i) / W over every sample of the step, then SGD."""
    torch.manual_seed(0)
    task = Task(heads)
    optimizer = torch.optim.SGD(task.parameters(), lr=LR)
    start = {n: p.detach().clone() for n, p in task.named_parameters()}
    for micro in plan_batches(schedule, cp):
        total = step_total(micro, weighting)
        optimizer.zero_grad()
        for tokens, groups in micro:
            for ids in groups:
                weight = len(ids) * (tokens if weighting == "tokens" else 1)
                (task(collate(ids, tokens, total)) * weight / total).backward()
        optimizer.step()
    return start, {n: p.detach().clone() for n, p in task.named_parameters()}


# -- worker side ----------------------------------------------------------------------------------
class Schedule(torch.utils.data.Sampler):
    """This rank's micro-batches of a schedule: its sub-group's ids at each micro-batch's degree."""

    def __init__(self, schedule, rank: int, cp: int = CP):
        self.batches = []
        for micro in plan_batches(schedule, cp):
            for tokens, groups in micro:
                self.batches.append(groups[rank // dynamic.choose_degree(tokens, cp, MIN_TOKENS)])

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class Data(torch.utils.data.Dataset):
    def __init__(self, schedule, weighting, cp: int = CP):
        self.tokens, self.total = {}, {}
        for micro in plan_batches(schedule, cp):
            total = step_total(micro, weighting)
            for tokens, groups in micro:
                for ids in groups:
                    for i in ids:
                        self.tokens[i], self.total[i] = tokens, total

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {**sample(i, self.tokens[i]), "W": torch.tensor(self.total[i])}


def lightning_fit(rank, schedule, strategy_kwargs, module_kwargs):
    import lightning as L

    from cp_lightning import ContextParallelStrategy
    from cp_lightning.sharding import full_state_dict

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.task = Task(**module_kwargs)

        def dynamic_cp_step(self, batch):
            return dynamic.DynamicStep(batch["latents"].shape[1], batch["latents"].shape[0], batch["W"][0].item())

        def training_step(self, batch, batch_idx):
            return self.task(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    weighting = strategy_kwargs.get("dynamic_weighting", "samples")
    steps = SCHEDULES[schedule]
    accumulate = {len(step) for step in steps}
    assert len(accumulate) == 1
    strategy_kwargs = {"cp": CP, **strategy_kwargs}
    cp = strategy_kwargs["cp"]
    strategy = ContextParallelStrategy(dynamic_cp=True, min_tokens_per_rank=MIN_TOKENS, **strategy_kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=len(steps),
        accumulate_grad_batches=accumulate.pop(),
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Module()
    loader = torch.utils.data.DataLoader(Data(steps, weighting, cp), batch_sampler=Schedule(steps, rank, cp))
    trainer.fit(module, loader)
    state = full_state_dict(module.task)
    dist.barrier()
    return {
        "params": {k: v.numpy() for k, v in state.items()} if rank == 0 else None,
        "degrees": strategy.dynamic.history,
        "ring": strategy.ring,
    }


def step_of(batch) -> dynamic.DynamicStep:
    return dynamic.DynamicStep(batch["latents"].shape[1], batch["latents"].shape[0], batch["W"][0].item())


def fabric_fit(rank, schedule):
    """Fabric, DDP: the loop's own accumulation under no_backward_sync (one all-reduce per step)."""
    from lightning.fabric import Fabric

    from cp_lightning import FabricContextParallelStrategy

    steps = SCHEDULES[schedule]
    strategy = FabricContextParallelStrategy(cp=CP, dynamic_cp=True, min_tokens_per_rank=MIN_TOKENS)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    task = Task()
    model = fabric.setup(task)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    batches = iter(torch.utils.data.DataLoader(Data(steps, "samples"), batch_sampler=Schedule(steps, rank)))
    for step in steps:
        optimizer.zero_grad()
        for m in range(len(step)):
            batch = next(batches)
            factor = strategy.dynamic_step(step_of(batch))  # before the forward
            with fabric.no_backward_sync(model, enabled=m < len(step) - 1):
                fabric.backward(model(batch) * factor)
        optimizer.step()
    return {"params": {k: v.detach().numpy().copy() for k, v in task.state_dict().items()} if rank == 0 else None}


def accelerate_fit(rank, schedule, fsdp: bool):
    """Accelerate: accelerator.accumulate and accelerator.backward (which divides by the accumulation steps)."""
    from cp_lightning.accelerate import ContextParallel
    from cp_lightning.sharding import full_state_dict
    from tests.test_accelerate import fresh_accelerator

    steps = SCHEDULES[schedule]
    accelerator = fresh_accelerator(gradient_accumulation_steps=len(steps[0]))
    cpx = ContextParallel(accelerator, cp=CP, seed=0, fsdp=fsdp, dynamic_cp=True, min_tokens_per_rank=MIN_TOKENS)
    torch.manual_seed(0)
    task = Task()
    optimizer = torch.optim.SGD(task.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(Data(steps, "samples"), batch_sampler=Schedule(steps, rank))
    model, optimizer, loader = cpx.prepare(task, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            factor = cpx.dynamic_step(step_of(batch))
            accelerator.backward(model(batch) * factor)
            optimizer.step()
            optimizer.zero_grad()
    state = full_state_dict(task)
    return {"params": {k: v.numpy() for k, v in state.items()} if rank == 0 else None, "degrees": cpx.dynamic.history}


def errors(rank) -> dict:
    """A degree disagreement and a sub-group whose peers hold different batches: the same ValueError everywhere."""
    from cp_lightning import build_mesh, parallelize

    task, mesh = Task(), build_mesh(CP)
    parallelize(task.transformer, mesh=mesh)
    controller = dynamic.DynamicCP(mesh, [task], min_tokens_per_rank=MIN_TOKENS)
    out = {}
    for name, step in {
        "degree": dynamic.DynamicStep(tokens=4 if rank == 3 else 16, samples=1),
        "peers": dynamic.DynamicStep(tokens=8, samples=1 + (rank == 1)),
    }.items():
        try:
            controller.begin(step)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    # the consistency check compares the peers of the step's sub-group: at degree 2 ranks 0 and 1 share a batch
    checked = Task()
    parallelize(checked.transformer, mesh=mesh, check_steps=5)
    checks = dynamic.DynamicCP(mesh, [checked], min_tokens_per_rank=MIN_TOKENS)
    for name, odd in (("other_subgroup", (2, 3)), ("same_subgroup", (1,))):
        checks.begin(dynamic.DynamicStep(tokens=8, samples=1))
        batch = collate([0], 8, 1.0)
        if rank in odd:
            batch["latents"] = batch["latents"] + 1
        try:
            checked(batch)
            out[name] = None
        except ValueError as err:
            out[name] = type(err).__name__
    return out


def worker(rank, world):
    os.environ["PL_GLOBAL_SEED"] = "0"
    out = {"errors": errors(rank)}
    for name, (schedule, strategy_kwargs, module_kwargs) in CASES.items():
        out[name] = lightning_fit(rank, schedule, strategy_kwargs, module_kwargs)
    out["fabric_ddp_mixed"] = fabric_fit(rank, "mixed")
    out["accelerate_ddp_mixed"] = accelerate_fit(rank, "mixed", fsdp=False)
    out["accelerate_fsdp_mixed"] = accelerate_fit(rank, "mixed", fsdp=True)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(worker, WORLD, timeout_s=600, env={"PL_GLOBAL_SEED": "0", "LOCAL_WORLD_SIZE": str(WORLD)})


def rel_err(params, ref):
    return max(
        ((torch.as_tensor(params[n]) - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for n, r in ref.items()
    )


@pytest.mark.parametrize("case", list(CASES))
def test_sgd_matches_one_process(results, case):
    schedule, strategy_kwargs, module_kwargs = CASES[case]
    weighting, cp = strategy_kwargs.get("dynamic_weighting", "samples"), strategy_kwargs.get("cp", CP)
    start, ref = reference(SCHEDULES[schedule], weighting, module_kwargs.get("heads", 4), cp)
    ref = {f"transformer.{n.split('transformer.', 1)[1]}": p for n, p in ref.items()}
    start = {f"transformer.{n.split('transformer.', 1)[1]}": p for n, p in start.items()}
    params = results[0][case]["params"]
    moved, err = rel_err({n: p.numpy() for n, p in start.items()}, ref), rel_err(params, ref)
    print(f"dynamic cp {case}: max relative parameter error {err:.2e} (training moved them {moved:.2e})")
    assert moved > 100 * SGD_TOL
    assert err <= SGD_TOL, (case, err)
    expected = [dynamic.choose_degree(t, cp, MIN_TOKENS) for step in SCHEDULES[schedule] for t, _ in step]
    assert all(r[case]["degrees"] == expected for r in results), [r[case]["degrees"] for r in results]


@pytest.mark.parametrize("case", ["fabric_ddp_mixed", "accelerate_ddp_mixed", "accelerate_fsdp_mixed"])
def test_fabric_and_accelerate_match_one_process(results, case):
    start, ref = reference(SCHEDULES["mixed"], "samples", 4)
    params = results[0][case]["params"]
    err = rel_err(params, ref)
    print(f"dynamic cp {case}: max relative parameter error {err:.2e}")
    assert rel_err({n: p.numpy() for n, p in start.items()}, ref) > 100 * SGD_TOL
    assert err <= SGD_TOL, (case, err)


def test_too_few_heads_fall_back_to_ring_for_the_full_degree(results):
    assert results[0]["ddp_mixed_tokens_2heads"]["ring"] == 2
    assert results[0]["ddp_mixed"]["ring"] == 1


def test_disagreements_are_the_same_error_on_every_rank(results):
    degree = {r["errors"]["degree"] for r in results}
    assert len(degree) == 1 and "different CP degrees" in degree.pop()
    peers = {r["errors"]["peers"] for r in results}
    assert len(peers) == 1 and "must share the micro-batch" in peers.pop()
    # ranks 2 and 3 feeding other latents is another sub-group's sample; rank 1's differ from its peer rank 0's
    assert [r["errors"]["other_subgroup"] for r in results] == [None] * 4
    assert [r["errors"]["same_subgroup"] for r in results] == ["CPMismatchError"] * 2 + [None] * 2


# -- no processes ---------------------------------------------------------------------------------
def test_degree_is_the_largest_that_keeps_min_tokens_per_rank():
    assert [dynamic.choose_degree(t, 8, 1024) for t in (500, 1024, 2047, 2048, 5000, 8192, 75_000)] == [
        1,
        1,
        1,
        2,
        4,
        8,
        8,
    ]
    assert dynamic.ring_for_heads([4, 8], 8, 1) == 2 and dynamic.ring_for_heads([24], 8, 1) == 1


def test_bad_options_fail_at_construction():
    from cp_lightning import ContextParallelStrategy

    def error(**kw):
        with pytest.raises(ValueError) as info:
            ContextParallelStrategy(**{"cp": 4, "dynamic_cp": True, **kw})
        return str(info.value)

    assert "power-of-two cp" in error(cp=6) and "cp=4 or 8" in error(cp=6)
    assert "loss_parallel" in error(loss_parallel=True)
    assert "compile" in error(compile=True)
    assert "hsdp" in error(fsdp=True, hsdp=True)
    assert "dynamic_weighting" in error(dynamic_weighting="pixels")
    assert "min_tokens_per_rank" in error(min_tokens_per_rank=0)
    with pytest.raises(ValueError, match="only applies with dynamic_cp"):
        ContextParallelStrategy(cp=4, min_tokens_per_rank=128)
    with pytest.raises(ValueError, match="DynamicStep.samples"):
        dynamic.DynamicStep(tokens=4, samples=0)


def test_a_module_without_dynamic_cp_step_is_refused():
    with pytest.raises(ValueError, match="dynamic_cp_step"):
        dynamic.check_module(copy.copy(torch.nn.Linear(1, 1)))


def test_the_bucket_sampler_gives_sub_groups_their_batches_and_resumes_mid_epoch():
    from recipes.buckets import BucketBatchSampler
    from recipes.checkpoints import _SkipBatches

    # buckets by tokens: 4 at degree 1, 8 at degree 2, 16 at degree 4; a per-bucket batch size
    buckets = [(1, 2, 2)] * 21 + [(1, 2, 4)] * 13 + [(1, 4, 4)] * 6
    tokens = {(1, 2, 2): 4, (1, 2, 4): 8, (1, 4, 4): 16}
    degrees = {b: dynamic.choose_degree(t, CP, MIN_TOKENS) for b, t in tokens.items()}
    sizes = {(1, 2, 2): 2, (1, 2, 4): 3, (1, 4, 4): 1}

    def sampler(rank, epoch=1):
        s = BucketBatchSampler(
            buckets, sizes, num_replicas=WORLD, rank=rank, seed=3, degrees=degrees, tokens=tokens, accumulate=2
        )
        s.set_epoch(epoch)
        return s

    ranks = [list(sampler(r)) for r in range(WORLD)]
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) == len(sampler(0)) > 4
    seen = set()
    for k in range(len(ranks[0])):
        batches = [ranks[r][k] for r in range(WORLD)]
        assert len({buckets[b[0][0]] for b in batches}) == 1  # one bucket, so one degree, on every rank
        bucket = buckets[batches[0][0][0]]
        degree = degrees[bucket]
        assert all(len(b) == sizes[bucket] and all(buckets[i] == bucket for i, *_ in b) for b in batches)
        assert all(item[2] == tokens[bucket] and item[1] == 1 for b in batches for item in b)
        for r in range(WORLD):  # sub-group peers share the batch, other sub-groups hold other samples
            same = [q for q in range(WORLD) if q // degree == r // degree]
            assert all(batches[q] == batches[r] for q in same)
            assert not {i for i, *_ in batches[r]} & {i for q in range(WORLD) if q not in same for i, *_ in batches[q]}
        ids = {i for b in batches for i, *_ in b}
        assert not ids & seen
        seen |= ids
    for start in range(0, len(ranks[0]), 2):  # W: the samples of the step's two micro-batches, every sub-group
        step = [ranks[r][k] for k in range(start, min(start + 2, len(ranks[0]))) for r in range(WORLD)]
        distinct = {tuple(i for i, *_ in b) for b in step}
        assert {item[3] for b in step for item in b} == {float(sum(len(b) for b in distinct))}
    assert list(sampler(0, epoch=2)) != ranks[0]  # reshuffled per epoch
    resumed = _SkipBatches(sampler(2))
    resumed.skip = 3
    assert list(resumed) == ranks[2][3:]  # a resume mid-epoch continues with the same batches


# -- the recipe: a mixed image/video run at cp=2 (images at degree 1, clips at 2), resumed mid-epoch ---------------
def mixed_folder(tmp) -> str:
    """24 still images and 8 four-frame clips in one imagefolder."""
    import json
    import shutil
    from pathlib import Path

    from recipes.synthetic import make_shapes

    tmp, lines = Path(tmp), []
    folder = tmp / "mixed"
    folder.mkdir()
    for prefix, frames, n in (("img", 1, 24), ("vid", 5, 8)):
        source = make_shapes(tmp / prefix, n, size=32, seed=frames, frames=frames)
        for line in (source / "metadata.jsonl").read_text().splitlines():
            row = json.loads(line)
            name = f"{prefix}_{row['file_name']}"
            shutil.copy(source / row["file_name"], folder / name)
            lines.append(json.dumps({**row, "file_name": name}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder)


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory):
    import json

    from tests.test_recipes import run_recipe

    tmp = tmp_path_factory.mktemp("dynamic_recipe")
    common = (
        "--trainer.strategy.init_args.dynamic_cp=true",
        "--trainer.strategy.init_args.min_tokens_per_rank=100",  # 64-token images at 1, 320-token clips at 2
        f"--data.data_dir={mixed_folder(tmp)}",
        "--data.synthetic_samples=0",
        "--data.frame_buckets=[1,5]",
        "--samples.every_n_steps=0",
        "--trainer.logger=false",
        "--trainer.max_steps=6",  # an epoch is 10 micro-batches: 6 image pairs at degree 1, 4 clips at degree 2
        "--checkpoint.every_n_steps=3",
    )
    straight = run_recipe(tmp, "straight", *common, recipe="wan")
    stop = json.dumps({"class_path": "tests.test_recipe_training.StopAt", "init_args": {"step": 3}})
    run_recipe(tmp, "resumed", *common, f"--trainer.callbacks+={stop}", recipe="wan")
    resumed = run_recipe(tmp, "resumed", *common, "--ckpt_path=last", recipe="wan")
    return straight, resumed


def test_a_dynamic_recipe_run_resumed_mid_epoch_reproduces_the_straight_run(recipe_runs):
    import csv

    from tests.test_recipes import losses

    straight, resumed = recipe_runs
    assert len(losses(straight)) == 6 and losses(resumed) == pytest.approx(losses(straight)[3:], abs=1e-6)
    with (straight / "buckets.csv").open() as f:
        rows = {r["bucket"]: r for r in csv.DictReader(f)}
    assert {b: (r["cp_degree"], r["tokens_per_cp_rank"]) for b, r in rows.items()} == {
        "32x32": ("1", "64"),
        "32x32x5f": ("2", "160"),
    }

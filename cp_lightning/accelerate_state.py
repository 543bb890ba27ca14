"""What :class:`cp_lightning.accelerate.ContextParallel` keeps across steps and restarts: sharded checkpoints with
each dp rank's RNG, the prepared data loaders' positions in their epoch, and the non-finite check of each
optimizer step."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cp_lightning import data_parallel, faults, sharding


class LoaderPositions:
    """Where each prepared data loader (an Accelerate ``DataLoaderShard``) is in its epoch: the epoch, the batches
    drawn in it and the shuffling generator's state at its start. A loader restored from them skips, in its next
    epoch only, the batches the saved run had drawn, with the same order: a resumed loop draws what the
    uninterrupted one would."""

    def __init__(self) -> None:
        self.loaders: list = []

    def track(self, loader):
        """Count ``loader``'s batches (through the hooks its ``__iter__`` calls); returns it unchanged."""
        if not all(hasattr(loader, a) for a in ("skip_batches", "iteration", "begin", "end", "_update_state_dict")):
            return loader  # not a DataLoaderShard: nothing to count
        loader._cp_drawn, loader._cp_generator_state, loader._cp_rng_before_pass = 0, None, None
        begin, end, update = loader.begin, loader.end, loader._update_state_dict

        def counting_begin():  # after Accelerate synchronised the generator, before the epoch's order is drawn
            begin()
            generator = getattr(loader, "synchronized_generator", None)
            loader._cp_drawn = 0
            loader._cp_generator_state = generator.get_state() if generator is not None else None
            # A DataLoader without a generator of its own draws its workers' base seed from torch's global RNG
            # as a pass starts. The saved run made that draw before the state was saved: a resumed pass must not
            # make it again, or everything drawn from the RNG afterwards (noise, timesteps) would shift.
            loader._cp_rng_before_pass = torch.get_rng_state() if loader.skip_batches > 0 else None

        def counting_update():  # once before each batch is handed out (skipped ones included), and once more at the end
            if loader._cp_rng_before_pass is not None:
                torch.set_rng_state(loader._cp_rng_before_pass)
                loader._cp_rng_before_pass = None
            if not loader.end_of_dataloader:
                loader._cp_drawn += 1
            update()

        def finishing_end():  # the epoch is over: the next one starts from its first batch
            end()
            loader._cp_drawn, loader.skip_batches = 0, 0

        loader.begin, loader.end, loader._update_state_dict = counting_begin, finishing_end, counting_update
        self.loaders.append(loader)
        return loader

    def state(self) -> list[dict]:
        return [
            {"epoch": loader.iteration, "drawn": loader._cp_drawn, "generator": loader._cp_generator_state}
            for loader in self.loaders
        ]

    def restore(self, saved: list[dict] | None, path) -> None:
        if not saved or not self.loaders:  # nothing saved, or a load without loaders (weights only, evaluation)
            return
        if len(saved) != len(self.loaders):
            raise ValueError(
                f"{path} holds the positions of {len(saved)} data loader(s) but ContextParallel.prepare prepared "
                f"{len(self.loaders)}; prepare the same loaders, in the same order, before load_state."
            )
        for loader, position in zip(self.loaders, saved, strict=True):
            loader.iteration, loader.skip_batches = position["epoch"], position["drawn"]
            generator = getattr(loader, "synchronized_generator", None)
            if generator is not None and position["generator"] is not None:
                generator.set_state(position["generator"])


class CheckedSteps:
    """``nonfinite=`` for an Accelerate loop: losses are noted in ``accelerator.backward``, local gradients in the
    DDP hook (FSDP: the gradient shards before the step), and every rank agrees in ``optimizer.step()``, which
    raises :class:`~cp_lightning.faults.NonFiniteError` on every rank or skips the update (and the scheduler's step
    with it). The step named is the number of optimizer steps before it."""

    def __init__(self, mode: str) -> None:
        self.check = faults.NonFiniteCheck(mode, owner="cp_lightning.accelerate.ContextParallel")
        self.optimizer_steps = 0

    def watch_backward(self, accelerator) -> None:
        if not self.check.active or getattr(accelerator, "_cp_checked_backward", False):
            return
        backward = accelerator.backward

        @functools.wraps(backward)
        def checked_backward(loss, **kwargs):
            self.check.note_loss(loss)
            return backward(loss, **kwargs)

        accelerator.backward, accelerator._cp_checked_backward = checked_backward, True

    def wrap(self, optimizer, accelerator, *, sharded: bool, device: torch.device):
        """Check ``optimizer`` (an ``AcceleratedOptimizer``) before each update; returns it."""
        if not self.check.active:
            return optimizer
        step = optimizer.step

        @functools.wraps(step)
        def checked_step(*args, **kwargs):
            if not accelerator.sync_gradients:  # an accumulation micro-step: Accelerate does not update either
                return step(*args, **kwargs)
            if sharded:
                self.check.note_sharded_grads(p for g in optimizer.param_groups for p in g["params"])
            index, self.optimizer_steps = self.optimizer_steps, self.optimizer_steps + 1
            skip = self.check.resolve(index, device)  # collective; raises in mode "raise"
            # Accelerate's schedulers do not step after an optimizer step it reports as skipped
            optimizer._is_overflow = skip
            if skip:
                optimizer.zero_grad(set_to_none=True)
                return None
            return step(*args, **kwargs)

        optimizer.step = checked_step
        return optimizer


def save_sharded(path, *, model: nn.Module, optimizer, dp_rank: int, meta: dict) -> None:
    """Collective. The model (and optimizer) as a ``torch.distributed.checkpoint`` directory; each dp rank's RNG
    state and ``meta`` (rank 0's) in ``meta.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    optimizer = getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer
    model_state, optim_state = get_state_dict(model, [optimizer] if optimizer is not None else [])
    state = {"model": model_state, **({"optimizer": optim_state} if optimizer is not None else {})}
    dcp.save(state, checkpoint_id=str(path))
    rng = data_parallel.gather_rng_states(dp_rank)
    if dist.get_rank() == 0:
        torch.save({**meta, "cp_lightning": {**meta.get("cp_lightning", {}), "rng_states": rng}}, path / "meta.pt")
    dist.barrier()


def load_sharded(path, *, model: nn.Module, optimizer, dp_rank: int, dp_size: int) -> dict:
    """Collective. Load what :func:`save_sharded` wrote (resharding as needed), restore this dp rank's RNG; returns
    the saved ``meta`` (its ``cp_lightning`` entry included)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    sharding.check_checkpoint_layout(path, model, dp_size, prefix="model.")  # no collectives
    optimizer = getattr(optimizer, "optimizer", optimizer)
    optimizers = [optimizer] if optimizer is not None else []
    model_state, optim_state = get_state_dict(model, optimizers)
    state = {"model": model_state, **({"optimizer": optim_state} if optimizer is not None else {})}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}))
    meta = torch.load(path / "meta.pt", weights_only=False, map_location="cpu")
    data_parallel.restore_rng_state(meta.get("cp_lightning", {}).get("rng_states"), dp_rank, dp_size)
    return meta

"""Validation loss on a held-out split, the same at every dp x cp layout.

The held-out samples are ``validation.data_dir`` (a folder of its own), or a part of ``data_dir`` chosen by a
hash of each file's relative name (a fixed, uniform key in [0, 1) per name and ``seed``):

- ``samples: 0.1`` (a fraction) holds out the files whose key is below 0.1. A file's membership depends on its
  own name only, so adding, editing or removing training files never changes the held-out set;
- ``samples: 8`` (a count) holds out the 8 files with the smallest keys. Editing or removing other files keeps
  it; a new file can only enter it if its key is smaller than those 8.

A video is held out whole (all of its clips). The data module (recipes/data.py) leaves the held-out files out of
training and encodes them into the cache like the training data.

Each held-out sample is evaluated at fixed flow-matching times (``timesteps``, mapped into the model's
``[min_timestep, max_timestep]``) with fixed noise drawn from a generator keyed by (seed, the sample's name and
clip, the time's position): never by rank, batch or layout. ``val_loss`` is the mean MSE over samples and times
(no loss weighting), in float64, summed in the samples' order: dp ranks split the samples, CP peers evaluate the
same one, rank 0 adds them up. It is logged to every logger at step 0, every ``every_n_steps`` and at the end,
written to ``<out_dir>/val_loss.csv`` and drawn in ``loss.png`` (recipes/callbacks.py).
"""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

DEFAULT_TIMESTEPS = (0.25, 0.5, 0.75)


def name_key(name: str, seed: int) -> float:
    """A fixed, uniform number in [0, 1) for a file's relative name."""
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def source_name(source, data_dir: str | Path) -> str:
    """A source's name relative to its folder (a dataset row: its row number)."""
    if source.row is not None:
        return f"row {source.row}"
    try:
        return Path(source.path).relative_to(data_dir).as_posix()
    except ValueError:
        return Path(source.path).as_posix()


def sample_seed(name: str, clip: int, position: int, seed: int) -> int:
    h = hashlib.sha256(f"{seed}:{name}:{clip}:{position}".encode()).digest()
    return int.from_bytes(h[:7], "big")


class Validation(L.Callback):
    """The held-out ``val_loss`` every ``every_n_steps`` optimizer steps, at step 0 and at the end.

    Args:
        out_dir: the run's folder (``val_loss.csv``).
        every_n_steps: period in optimizer steps; 0 evaluates only at step 0 and at the end.
        samples: what part of ``data_dir`` is held out (or, with ``data_dir`` given here, how much of that folder
            is used): a fraction in (0, 1) or a count >= 1. 0 with no ``data_dir``: no validation.
        data_dir: a held-out folder of its own (the layout ``data.data_dir`` takes); ``data.data_dir`` then trains
            on all of its files.
        timesteps: flow-matching times each sample is evaluated at, in (0, 1), mapped into the model's
            ``[min_timestep, max_timestep]``.
        seed: the hold-out keys and the noise.
    """

    def __init__(
        self,
        out_dir: str = "outputs/run",
        *,
        every_n_steps: int = 0,
        samples: float = 0,
        data_dir: str | None = None,
        timesteps: list[float] | None = None,
        seed: int = 0,
    ):
        if every_n_steps < 0:
            raise ValueError(f"validation.every_n_steps must be >= 0 (0: step 0 and the end), got {every_n_steps}.")
        if isinstance(samples, bool) or samples < 0 or (samples >= 1 and samples != int(samples)):
            raise ValueError(
                f"validation.samples is a fraction in (0, 1) or a count >= 1 of held-out files, got {samples!r}."
            )
        timesteps = list(DEFAULT_TIMESTEPS if timesteps is None else timesteps)
        if not timesteps or not all(0.0 < t < 1.0 for t in timesteps):
            raise ValueError(f"validation.timesteps must be times in (0, 1), e.g. [0.25, 0.5, 0.75]; got {timesteps}.")
        self.out_dir = Path(out_dir)
        self.every_n_steps, self.samples, self.data_dir = every_n_steps, samples, data_dir
        self.timesteps, self.seed = timesteps, seed
        self.history: dict[int, float] = {}  # step -> val_loss (every rank)

    @property
    def enabled(self) -> bool:
        return bool(self.samples) or self.data_dir is not None

    # -- the split ----------------------------------------------------------------------------------
    def split(self, sources: list, data_dir: str | Path) -> tuple[list, list]:
        """(training sources, held-out sources) of ``data_dir``'s sources; with a ``data_dir`` of its own, the
        sources are that folder's and all of them but the ones ``samples`` leaves out are held out."""
        named = [(name_key(source_name(s, data_dir), self.seed), s) for s in sources]
        if 0 < self.samples < 1:
            held = [s for key, s in named if key < self.samples]
        elif self.samples >= 1:
            chosen = {id(s) for _, s in sorted(named, key=lambda pair: pair[0])[: int(self.samples)]}
            held = [s for s in sources if id(s) in chosen]
        else:
            held = list(sources)
        rest = [s for s in sources if not any(s is h for h in held)]
        if not held:
            raise ValueError(
                f"validation.samples={self.samples} holds out none of the {len(sources)} files of {data_dir}: raise "
                "the fraction, give a count (e.g. validation.samples: 4) or a validation.data_dir."
            )
        if self.data_dir is None and not rest:
            raise ValueError(
                f"validation.samples={self.samples} holds out all {len(sources)} files of {data_dir}, leaving nothing "
                "to train on: lower it, or give a validation.data_dir."
            )
        return rest, held

    # -- the loss -----------------------------------------------------------------------------------
    def draws(self, pl_module, entry: dict, name: str, clip: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed noise (T, *latent shape) and times (T,) of one held-out sample."""
        h = pl_module.hparams
        x0 = entry["latents"]
        noise = torch.stack(
            [
                torch.randn(x0.shape, generator=torch.Generator().manual_seed(sample_seed(name, clip, k, self.seed)))
                for k in range(len(self.timesteps))
            ]
        ).to(x0.dtype)
        t = torch.tensor(self.timesteps, dtype=torch.float64)
        t = h.min_timestep + (h.max_timestep - h.min_timestep) * t
        return noise, t.to(x0.dtype)

    @torch.no_grad()
    def sample_loss(self, trainer, pl_module, entry: dict, name: str, clip: int) -> float:
        """The mean MSE of one held-out sample over the fixed times (every CP peer returns the same)."""
        from cp_lightning.parallelize import loss_shard, parallel_state

        device = pl_module.device
        noise, t = self.draws(pl_module, entry, name, clip)
        n = len(self.timesteps)
        # one sample -> a batch of its T evaluation times: 1, ... -> T, ...
        batch = {k: v.unsqueeze(0).expand(n, *v.shape).to(device) for k, v in entry.items() if torch.is_tensor(v)}
        batch |= {"index": torch.zeros(n, dtype=torch.long), "noise": noise.to(device), "t": t.to(device)}
        with trainer.precision_plugin.forward_context():
            pred, target, _ = pl_module.predict(batch)
        transformer = pl_module.transformer
        squared = (pred.double() - loss_shard(target, transformer).double()) ** 2
        total = torch.stack([squared.sum(), torch.tensor(squared.numel(), dtype=torch.float64, device=device)])
        state = parallel_state(transformer)
        if state is not None and state.loss_parallel:  # each CP rank holds its shard of the output
            dist.all_reduce(total, group=state.groups.cp)
        return float(total[0] / total[1])

    def evaluate(self, trainer, pl_module) -> float:
        """Every rank calls it: dp ranks evaluate every dp-th held-out sample, rank 0 adds them up."""
        dataset = trainer.datamodule.val_dataset
        strategy = trainer.strategy
        dp_size = getattr(strategy, "dp_size", None) or strategy.world_size
        dp_rank = getattr(strategy, "dp_rank", None) if hasattr(strategy, "cp") else strategy.global_rank
        transformer = pl_module.transformer
        modes = {m: m.training for m in transformer.modules()}
        transformer.eval()
        mine: dict[int, float] = {}
        try:
            # every rank runs as many forward passes (FSDP's all-gathers pair up): a short share repeats its last
            for k in range(-(-len(dataset) // dp_size)):
                i = min(dp_rank + k * dp_size, len(dataset) - 1)
                row = dataset.rows[i]
                mine[i] = self.sample_loss(trainer, pl_module, dataset[i], row["name"], row.get("clip", 0))
        finally:
            for m, mode in modes.items():
                m.train(mode)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            mine = {i: loss for part in every for i, loss in part.items()}
        return sum(mine[i] for i in range(len(dataset))) / len(dataset)  # the same order at every layout

    def validate(self, trainer, pl_module) -> None:
        step = trainer.global_step
        loss = self.evaluate(trainer, pl_module)
        self.history[step] = loss
        trainer.callback_metrics["val_loss"] = torch.tensor(loss)
        for logger in trainer.loggers:
            logger.log_metrics({"val_loss": loss}, step=step)

    # -- hooks --------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module):
        if self.enabled and trainer.global_step == 0:
            self.validate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self.enabled and self.every_n_steps and step % self.every_n_steps == 0 and step not in self.history:
            self.validate(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        if not self.enabled:
            return
        if trainer.global_step not in self.history:  # every rank decides alike
            self.validate(trainer, pl_module)
        if trainer.is_global_zero:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with (self.out_dir / "val_loss.csv").open("w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["step", "val_loss"])
                writer.writerows(sorted(self.history.items()))


def find(trainer) -> Validation | None:
    """The run's enabled Validation callback, if any."""
    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, Validation) and callback.enabled:
            return callback
    return None

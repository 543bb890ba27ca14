"""Train the tiny flow-matching task under ContextParallelStrategy with a fault injected; tests/test_faults.py runs it.

Launch it with torchrun (one process per rank) or directly (Lightning's own launcher then starts the other
ranks). Faults, each at a global step on one rank:

    --kill-at-step K --kill-rank R    the rank SIGKILLs itself in the middle of training step K (after forward)
    --hang-at-step K --hang-rank R    the rank sleeps in training step K (before forward)
    --nan-at-step K --nan-rank R      the rank's loss (--nan-kind loss) or gradient (grad) is NaN at step K
    --kill-in-save-at-step K          rank 0 SIGKILLs itself half way through writing last.ckpt at step K

Every rank writes its pid to ``<record-dir>/pid<rank>`` and a row per step (loss averaged over ranks) to
``<record-dir>/rank<rank>.jsonl``. An epoch is one step (4 samples, global batch 4), so every checkpoint is at
an epoch's end and a resumed run sees the batches the uninterrupted one saw. Checkpoints (every ``--every``
steps, plus ``last.ckpt``) go to ``--ckpt-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from cp_lightning import ContextParallelStrategy  # noqa: E402
from tests.lightning_tasks import FlowMatching, Samples  # noqa: E402


class FaultyFlowMatching(FlowMatching):
    def __init__(self, faults: dict, **kwargs):
        super().__init__(**kwargs)
        self.faults = faults

    def _at(self, name: str) -> bool:
        return self.faults.get(f"{name}_at_step") == self.global_step and self.global_rank == self.faults.get(
            f"{name}_rank"
        )

    def on_fit_start(self):
        if self.hparams.record_dir:
            (Path(self.hparams.record_dir) / f"pid{self.global_rank}").write_text(str(os.getpid()))

    def training_step(self, batch, batch_idx):
        if self._at("hang"):
            if self.hparams.record_dir:
                (Path(self.hparams.record_dir) / "hang_started").write_text(repr(time.time()))
            time.sleep(3600)
        loss, noise = self.loss(batch)
        if self._at("kill"):
            if self.hparams.record_dir:
                (Path(self.hparams.record_dir) / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self._at("nan"):
            if self.faults["nan_kind"] == "loss":
                loss = loss * float("nan")
            else:  # a finite loss whose gradient is NaN: d/dx sqrt(x) at x = 0 is inf, times 0
                loss = loss + (0 * loss).sqrt()
        self.log("loss", loss, sync_dist=True)
        if self.hparams.record_dir:
            self._record(loss.detach().clone(), noise)  # the reduce in _record works in place
            # the parameters the step starts from: a skipped step leaves them as they were
            row = {
                "step": self.global_step,
                "param_sum": sum(p.detach().double().sum().item() for p in self.parameters()),
            }
            with (Path(self.hparams.record_dir) / f"params{self.global_rank}.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
        return loss


class KillWhileSaving(ModelCheckpoint):
    """Rank 0 dies half way through writing ``last.ckpt`` at one step: half the bytes are on disk, unfinished."""

    def __init__(self, kill_at_step: int | None, **kwargs):
        super().__init__(**kwargs)
        self.kill_at_step = kill_at_step

    def _save_checkpoint(self, trainer, filepath):
        if trainer.global_step == self.kill_at_step and trainer.is_global_zero and Path(filepath).name == "last.ckpt":
            original = torch.save

            def half_then_die(obj, f, *args, **kwargs):
                if isinstance(f, io.BytesIO):  # torch.save nested inside torch.save (some objects pickle that way)
                    return original(obj, f, *args, **kwargs)
                buffer = io.BytesIO()
                original(obj, buffer, *args, **kwargs)
                data = buffer.getvalue()
                with contextlib.ExitStack() as stack:
                    out = f if hasattr(f, "write") else stack.enter_context(open(f, "wb"))
                    out.write(data[: len(data) // 2])
                    out.flush()
                    os.fsync(out.fileno())
                os.kill(os.getpid(), signal.SIGKILL)

            torch.save = half_then_die
        super()._save_checkpoint(trainer, filepath)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--timeout", type=float, default=None, help="collective timeout, seconds (default: Lightning's)"
    )
    parser.add_argument("--record-dir", default=None)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--resume", default=None, help="ckpt_path for trainer.fit, e.g. 'last'")
    parser.add_argument("--nonfinite", default=None)
    for name in ("kill", "hang", "nan"):
        parser.add_argument(f"--{name}-at-step", type=int, default=None)
        parser.add_argument(f"--{name}-rank", type=int, default=None)
    parser.add_argument("--nan-kind", choices=["loss", "grad"], default="loss")
    parser.add_argument("--kill-in-save-at-step", type=int, default=None)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    faults = {k: v for k, v in vars(args).items() if k.startswith(("kill_", "hang_", "nan_"))}
    module = FaultyFlowMatching(faults, optimizer="adamw", lr=1e-3, noise="rng", record_dir=args.record_dir)
    options = {}
    if args.timeout is not None:
        options["timeout"] = timedelta(seconds=args.timeout)
    if args.nonfinite is not None:
        options["nonfinite"] = args.nonfinite
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(
            KillWhileSaving(
                args.kill_in_save_at_step,
                dirpath=args.ckpt_dir,
                every_n_train_steps=args.every,
                save_top_k=-1,
                save_last=True,
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=ContextParallelStrategy(cp=args.cp, **options),
        max_steps=args.steps,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.ckpt_dir,
    )
    dp = args.devices // args.cp
    trainer.fit(module, DataLoader(Samples(n=4), batch_size=4 // dp, shuffle=True), ckpt_path=args.resume)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train tests/lightning_tasks.FlowMatching under ContextParallelStrategy; launched by torchrun in tests.

Rank 0 saves the final parameters to --out. Each rank records its mesh position under --record-dir.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from cp_lightning import ContextParallelStrategy  # noqa: E402
from tests.lightning_tasks import FlowMatching, Samples  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--record-dir", default=None)
    parser.add_argument("--fail-at-step", type=int, default=None)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = FlowMatching(record_dir=args.record_dir, fail_at_step=args.fail_at_step, fail_rank=args.fail_rank)
    strategy = ContextParallelStrategy(cp=args.cp, ring=args.ring, timeout=timedelta(seconds=args.timeout))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    dp = args.devices * args.num_nodes // args.cp
    trainer.fit(module, DataLoader(Samples(), batch_size=args.global_batch // dp, shuffle=True))
    if args.out and trainer.is_global_zero:
        torch.save({n: p.detach() for n, p in module.named_parameters()}, args.out)
    # An orderly exit: no rank tears its connections down while a peer (on another simulated node) is
    # still using them, which gloo can answer with an abort at interpreter exit.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

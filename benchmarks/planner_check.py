"""The planner's predicted training-step memory per rank against a measured one, on CPU, in 4 processes.

    PYTHONPATH=. python benchmarks/planner_check.py

One spawned group of 4 gloo processes runs every row: a tiny Wan-architecture transformer (full fine-tune,
activations dominate) and a 110M-parameter one (LoRA rank 4 on a fp32 frozen base, states dominate), at
cp 1, 2 and 4 (dp = 4 / cp), wrapped by DDP (with the exact SUM-cp / MEAN-dp hook) or FSDP2 over dp x cp,
with diffusers' gradient checkpointing off and on; fp32 throughout ("32-true"), AdamW.

Measured: the most bytes of tensor storage alive at once on a rank during one training step (forward, an fp32
loss on the gathered output, backward, AdamW's step) after a warm-up step, counted by a TorchDispatchMode that
sees every storage the rank creates from before the model is built (``cp_lightning.planner.trace.LiveBytes``:
parameters, gradients, AdamW's moments, DDP's buckets, FSDP's gathered blocks, activations, the collectives'
buffers) and follows FSDP2's in-place frees of its gathered parameters; the largest rank of the row.
Predicted: the planner's ``Estimate.allocated`` for the same model,
layout and tokens (states + FSDP in-flight + activations + CP buffers: what ``torch.cuda.max_memory_allocated``
would count), with no CUDA context, communication buffers or allocator margin, which a CPU process has not.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLD = 4
MODELS = {  # name: (Wan config overrides, LoRA rank, video tokens, text tokens)
    "tiny": (dict(num_attention_heads=4, attention_head_dim=16, ffn_dim=256, text_dim=64, freq_dim=32, num_layers=2),
             0, 2048, 32),
    "110M": (dict(num_attention_heads=12, attention_head_dim=64, ffn_dim=3072, text_dim=512, freq_dim=256,
                  num_layers=12), 4, 128, 32),
    # the 110M model with 4 of its 12 blocks: states still dominate; the test's rows (a third of the time)
    "37M": (dict(num_attention_heads=12, attention_head_dim=64, ffn_dim=3072, text_dim=512, freq_dim=256,
                 num_layers=4), 4, 128, 32),
}  # fmt: skip


def rows_of(models=("tiny", "110M")) -> list[tuple[str, int, str]]:
    return [(m, cp, mode) for m in models for cp in (1, 2, 4) for mode in ("ddp", "fsdp")]


ROWS = rows_of()


def config(name: str) -> dict:
    from cp_lightning.planner.architectures import CONFIGS

    return dict(CONFIGS["wan2.1-t2v-1.3b"], **MODELS[name][0])


def _measure(rank: int, world: int, rows: list) -> list[dict]:
    """Per (model, cp, mode): one build, a warm-up step, then a measured step with checkpointing off and on."""
    return [_row(name, cp, mode) for name, cp, mode in rows]


@contextlib.contextmanager
def _fsdp_resizes(counter):
    """FSDP2 frees and re-allocates its gathered parameters by resizing their storages in place (torch's
    ``_fsdp_param.free_storage`` / ``alloc_storage``, outside any op the counter sees): tell the counter."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    originals = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def follow(resize):
        def wrapper(tensor):
            resize(tensor)
            counter.resized(tensor.untyped_storage())

        return wrapper

    _fsdp_param.alloc_storage, _fsdp_param.free_storage = (follow(f) for f in originals)
    _fsdp_param_group.alloc_storage = _fsdp_param.alloc_storage
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage = originals
        _fsdp_param_group.alloc_storage = originals[0]


def _row(name: str, cp: int, mode: str) -> dict:
    import diffusers
    import torch

    from cp_lightning import build_mesh, data_parallel, parallelize, sharding
    from cp_lightning.models import CASES
    from cp_lightning.planner.trace import LiveBytes

    _, lora_rank, tokens, text = MODELS[name]
    gc.collect()
    counter = LiveBytes(set())  # every storage created from here on, while it lives
    out = {}
    with counter, _fsdp_resizes(counter):
        torch.manual_seed(0)
        cfg = {k: v for k, v in config(name).items() if not k.startswith("_")}
        model = diffusers.WanTransformer3DModel(**cfg).train()
        if lora_rank:
            from peft import LoraConfig

            from cp_lightning.planner.architectures import resolve_model

            targets = list(resolve_model("wan2.1-t2v-1.3b").family.lora_targets)
            model.requires_grad_(False)
            model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=targets))
        mesh = build_mesh(cp, device_type="cpu")
        parallelize(model, mesh=mesh)
        if mode == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
            data_parallel.register_ddp_hook(wrapped, mesh["dp"].size(), loss_parallel=False)
        else:
            options = sharding.FSDPOptions()
            wrapped = sharding.apply_fsdp(model, mesh=mesh, plan=None, options=options, loss_parallel=False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        inputs = CASES["wan2.1"].inputs(model, torch.Generator().manual_seed(0), 1, tokens, text, torch.float32)

        def step():
            loss = wrapped(**inputs, return_dict=False)[0].float().square().mean()
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # AdamW's moments exist from here on
        for checkpointing in (False, True):
            if checkpointing:
                model.enable_gradient_checkpointing()
            gc.collect()
            counter.peak = counter.live
            step()
            out[checkpointing] = counter.peak
    return {"model": name, "cp": cp, "mode": mode, "peak": out}


def predicted(name: str, cp: int, mode: str, checkpointing: bool) -> float:
    """The planner's allocator peak for a row, in bytes."""
    from cp_lightning.planner import Hardware, Layout, Training, estimate, resolve_model

    _, lora_rank, tokens, text = MODELS[name]
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(config(name)))
    spec = resolve_model(str(path))
    layout = Layout(WORLD // cp, cp, fsdp="full" if mode == "fsdp" else "off", checkpointing=checkpointing,
                    base_dtype="float32")  # fmt: skip
    hw = Hardware(gpus=WORLD, gpu_memory_gib=1e3, device="cpu")
    training = Training(lora_rank=lora_rank, precision="32-true")
    return estimate(spec, layout, hw, training, tokens, text).allocated


def run(rows: list | None = None) -> list[dict]:
    """Measured and predicted bytes per row (the largest rank's peak), in one spawned group of 4 processes."""
    from tests.distributed import spawn

    rows = ROWS if rows is None else rows
    per_rank = spawn(_measure, WORLD, rows, timeout_s=1800)
    out = []
    for i, (name, cp, mode) in enumerate(rows):
        for checkpointing in (False, True):
            measured = max(r[i]["peak"][checkpointing] for r in per_rank)
            pred = predicted(name, cp, mode, checkpointing)
            out.append({"model": name, "cp": cp, "mode": mode, "checkpointing": checkpointing,
                        "measured": measured, "predicted": pred, "error": pred / measured - 1})  # fmt: skip
    return out


def render(results: list[dict]) -> str:
    from benchmarks.common import table

    rows = [[r["model"], f"dp{WORLD // r['cp']} x cp{r['cp']}", r["mode"].upper(), "on" if r["checkpointing"] else
             "off", f"{r['measured'] / 2**20:.1f}", f"{r['predicted'] / 2**20:.1f}", f"{r['error']:+.1%}"]
            for r in results]  # fmt: skip
    head = ["model", "layout", "wrap", "checkpointing", "measured MiB", "predicted MiB", "error"]
    return table(head, rows)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.parse_args(argv)
    results = run()
    tiny, big = (MODELS[m] for m in ("tiny", "110M"))
    print(
        f"Wan-architecture training step per rank, 4 CPU processes (gloo), fp32, AdamW, batch 1; tiny: full "
        f"fine-tune, {tiny[2]} video + {tiny[3]} text tokens; 110M: LoRA rank {big[1]}, {big[2]} + {big[3]} "
        "tokens. Measured: peak bytes of live tensor storage on the rank over one step (largest rank).\n"
    )
    print(render(results))
    return results


if __name__ == "__main__":
    main()

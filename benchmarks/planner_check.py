"""The planner's predicted training-step memory against a measured CPU step (one process, fp32).

    PYTHONPATH=. python benchmarks/planner_check.py

For a tiny and a ~110M-parameter Wan-architecture transformer, with and without gradient checkpointing, a
full fine-tune step (forward, loss, backward) is measured after a warm-up step with AdamW: the peak resident
memory above what is held before the step (benchmarks/common.py's CPU meter: VmHWM after clear_refs, glibc
serving large blocks by mmap), which is the step's activations plus the parameter gradients it allocates.
The planner's prediction for the same config, tokens and fp32 ("32-true", cp=1, no fixed overheads, no
allocator margin) is its activation peak plus 4 bytes per parameter of gradients. Multi-process layouts
(cp 2/4, FSDP) are not measured here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {
    "tiny (0.6M)": dict(
        num_attention_heads=2, attention_head_dim=32, ffn_dim=256, text_dim=64, freq_dim=32, num_layers=2
    ),
    "110M": dict(
        num_attention_heads=12, attention_head_dim=64, ffn_dim=3072, text_dim=512, freq_dim=256, num_layers=12
    ),
}


def _worker(config_path: str, tokens: int, text: int, checkpointing: bool) -> dict:
    import diffusers
    import torch

    from benchmarks.common import Meter
    from cp_lightning.models import CASES

    torch.manual_seed(0)
    config = {k: v for k, v in json.loads(Path(config_path).read_text()).items() if not k.startswith("_")}
    model = diffusers.WanTransformer3DModel(**config).train()
    if checkpointing:
        model.enable_gradient_checkpointing()
    inputs = CASES["wan2.1"].inputs(model, torch.Generator().manual_seed(0), 1, tokens, text, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        out = model(**inputs, return_dict=False)[0]
        out.float().square().mean().backward()

    step()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    meter = Meter(torch.device("cpu"))
    peaks = []
    for _ in range(2):
        meter.start()
        step()
        peaks.append(meter.peak())
        model.zero_grad(set_to_none=True)
    return {"peak": min(peaks), "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    from benchmarks.common import table
    from cp_lightning.planner import Hardware, Layout, Training, estimate, resolve_model

    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")))
        return
    from cp_lightning.planner.architectures import CONFIGS

    rows = []
    tokens, text = 4096, 64
    for name, sizes in MODELS.items():
        path = Path(tempfile.mkdtemp()) / "config.json"
        path.write_text(json.dumps(dict(CONFIGS["wan2.1-t2v-1.3b"], **sizes)))
        spec = resolve_model(str(path))
        hw = Hardware(gpus=1, gpu_memory_gib=1e3, cuda_context_gib=0.0, comm_buffers_gib=0.0, allocator_margin=0.0)
        for ckpt in (False, True):
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, __file__, "--worker", str(path), str(tokens), str(text), "1" if ckpt else "0"]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            e = estimate(spec, Layout(1, 1, checkpointing=ckpt), hw, Training(precision="32-true"), tokens, text)
            predicted = e.activations + 4 * got["params"]
            rows.append([name, "on" if ckpt else "off", f"{got['peak'] / 2**20:.1f}", f"{predicted / 2**20:.1f}",
                         f"{predicted / got['peak'] - 1:+.1%}"])  # fmt: skip
    print(f"Wan-architecture full fine-tune step, {tokens} video + {text} text tokens, batch 1, fp32, 1 CPU process\n")
    print(table(["model", "checkpointing", "measured MiB", "predicted MiB", "error"], rows))


if __name__ == "__main__":
    main()

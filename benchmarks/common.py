"""Shared pieces of the benchmark scripts: the model, the launcher, the meter, tables and plots.

Launching. Every script runs each configuration in a fresh group of worker processes, so that one
configuration's allocations and thread pools cannot leak into the next:

- plain ``python benchmarks/<script>.py``: the script starts the groups itself (CPU, gloo, through
  the tests' spawn helper), one per configuration;
- ``torchrun --nproc-per-node P benchmarks/<script>.py ...``: the launched processes are the group
  (cp = P); gloo on CPU, nccl when CUDA is present.

Memory. On CPU the per-rank peak is the process high-water mark (VmHWM, reset through
/proc/self/clear_refs just before the step) minus the resident set just before it; glibc is told
to serve large blocks with mmap (MALLOC_MMAP_THRESHOLD_, read at process start) so that freed
tensors leave the resident set and the mark is honest. On CUDA it is
``torch.cuda.max_memory_allocated`` minus the allocated bytes before the step.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MMAP_THRESHOLD = str(64 * 1024)
MiB = 2**20


# ----- model and inputs -----------------------------------------------------------------------------


def build_model(*, layers: int, heads: int, head_dim: int, seed: int = 0):
    """A narrow Flux-architecture transformer: ``layers`` double- and ``layers`` single-stream blocks."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=layers,
        num_single_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
    )


def make_inputs(model, *, tokens: int, text_tokens: int, device: torch.device) -> dict:
    """Full, identical-on-every-rank inputs: ``tokens`` image tokens and ``text_tokens`` text tokens."""
    from cp_lightning.tiny import tiny_inputs

    inputs = tiny_inputs("flux", model, batch=1, tokens=tokens, text_tokens=text_tokens)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def step(model, inputs) -> None:
    """One training step's compute: forward, a loss on the gathered output, backward."""
    out = model(**inputs, return_dict=False)[0]
    out.float().square().mean().backward()


def add_model_args(parser, *, timing: bool = True) -> None:
    """The options every script shares: the model's size, text tokens, the timeout, and (``timing``)
    warm-up and timed repeats."""
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2, help="double- and single-stream blocks each")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    if timing:
        parser.add_argument("--warmup", type=int, default=1)
        parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)


# ----- formulas (DESIGN.md section 3) ---------------------------------------------------------------


def formula_bytes(
    mode: str,
    *,
    cp: int,
    ring: int,
    tokens: int,
    text_tokens: int,
    heads: int,
    head_dim: int,
    attention_layers: int,
    out_channels: int,
    element_size: int = 4,
) -> float:
    """Bytes one rank sends in one forward+backward under DESIGN.md section 3's per-layer formulas.

    M = b (s/P) h d elements per attention layer (s = image + text tokens: Flux attends jointly).
    Ulysses (degree u): 4 all-to-alls sending (u-1)/u of M forward, the same again backward.
    Ring (degree r) on the M elements left after Ulysses: K and V make r-1 hops forward; backward
    again r-1 hops plus the fp32 dK/dV accumulators' r hops home: 2M(r-1) + 2M(2r-1) in all.
    Plus the one all-gather of the model's output at the end (the plan's gather point).
    """
    if cp == 1:
        return 0.0
    m = (tokens + text_tokens) // cp * heads * head_dim * element_size
    u = cp // ring
    per_layer = 8 * m * (u - 1) / u
    if ring > 1:
        per_layer += 2 * m * (ring - 1) + 2 * m * (2 * ring - 1)
    gather = tokens // cp * out_channels * element_size * (cp - 1)
    return attention_layers * per_layer + gather


# ----- measuring ------------------------------------------------------------------------------------


def _proc_status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024


class Meter:
    """Per-rank peak memory of a region above the memory in use when it starts (see module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.baseline = _proc_status("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _proc_status("VmHWM") - self.baseline


def measure(
    model, inputs, *, device: torch.device, warmup: int, repeats: int, run: Callable = step, group=None
) -> dict:
    """Warm up, then time ``repeats`` steps; returns peak bytes (max), median wall and CPU seconds, bytes sent."""
    from cp_lightning import collectives

    for _ in range(warmup):
        run(model, inputs)
        model.zero_grad(set_to_none=True)
    meter, peaks, times, cpu, sent = Meter(device), [], [], [], Counter()
    for i in range(repeats):
        if dist.is_initialized():
            dist.barrier(group)
        meter.start()
        start, start_cpu = time.perf_counter(), time.process_time()
        with collectives.count_bytes() as counted:
            run(model, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        peaks.append(meter.peak())
        if i == 0:
            sent = counted
        model.zero_grad(set_to_none=True)
    return {
        "peak": max(peaks),
        "time": statistics.median(times),
        "times": times,
        "cpu": statistics.median(cpu),  # this process's CPU seconds, all its threads: robust to other load
        "sent": dict(sent),
    }


# ----- launching ------------------------------------------------------------------------------------


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_torchrun(threads: int | None) -> None:
    """Join the torchrun group: nccl when CUDA is present, else gloo."""
    if threads:
        torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
        dist.init_process_group("nccl", timeout=timedelta(minutes=30))
    else:
        dist.init_process_group("gloo", timeout=timedelta(minutes=30))
        if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD and dist.get_rank() == 0:
            print(
                f"warning: launch with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} torchrun ... for honest CPU peaks",
                file=sys.stderr,
            )


def launch(worker: Callable, world: int, *args, threads: int = 1, timeout: float = 1800) -> list:
    """Run ``worker(rank, world, *args)`` in a fresh group of ``world`` CPU processes; results by rank."""
    from tests.distributed import spawn

    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # glibc reads it at start: workers inherit it
    try:
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        return spawn(_threaded, world, worker, threads, args, timeout_s=timeout, env=env)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def _threaded(rank: int, world: int, worker: Callable, threads: int, args: tuple):
    torch.set_num_threads(threads)  # the spawn helper sets one thread; cp=1 baselines want more
    return worker(rank, world, *args)


def gather_results(value: dict) -> list[dict]:
    """Under torchrun: every rank's result dict, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ----- output ---------------------------------------------------------------------------------------


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f}"


def machine_line(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, nccl"
    return f"{os.cpu_count()} CPU cores, torch {torch.__version__}, gloo"

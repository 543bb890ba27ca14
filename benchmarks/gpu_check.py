"""The first GPU's ten minutes: does the shipped CUDA path run, run right and run fast, on one GPU?

    python benchmarks/gpu_check.py --out DIR          # a CUDA machine: one GPU ~5 min, at most --budget (570 s)
    python benchmarks/gpu_check.py --cpu --out DIR    # every step that can run on CPU, tiny shapes (CI, < 1 min)

Steps, in priority order (the most important first, so a cut-short run still answers it); docs/benchmarks.md
says what each checks, how long it takes and how to read the JSON:

 1 facts      versions, capability, memory, which SDPA backends run, which ring kernel each input gets
 2 kernels    every CUDA kernel at production shapes (batch 1, 2; head dims 64, 128 and a refused 36; 16, 1032,
              1040, 4103 keys; the ring backward's exact key-chunk slices; a fully masked block) vs fp64
 3 ring       the shipped ring loop, virtual ranks as threads on the one device: P = 2, 4, 8, uneven, masks
 4 compile    the ring's custom ops eager and under torch.compile(fullgraph=True), over a one-rank NCCL group
 5 speed      per-kernel TFLOP/s with the SDPA backend pinned; one ring rank at Flux-1024 / Wan-14B-720p
 6 memory     peak allocator memory of one ring rank against SDPA (CUDA only)
 7 fp8        FP8Linear against the bf16 linear it replaces
 8 e2e        one training step at world 1: parallelize, FSDP2, fp8, offload (and compile, on CUDA)
 9 loading    fp32 safetensors onto the device in bf16 and as fp8, cast there
10 multi_gpu  2+ GPUs only: NCCL parity of Ulysses, ring, USP on the tiny models; the scaling benchmark

Each step runs in a process of its own (on CUDA a fresh interpreter: a CUDA fault such as a misaligned
address is sticky, the process cannot go on; on CPU a fork of this one, which has imported everything once)
with its own timeout; a timeout kills the step's whole process tree (torchrun's workers run in sessions of
their own). Each step writes DIR/<step>.json and its output to DIR/<step>.log; DIR/summary.json collects
them. Exit status 0 when every step that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_speed, gpu_steps, gpu_steps_train  # noqa: E402


@dataclass(frozen=True)
class Step:
    """One step: ``fn(Context) -> dict`` (``"ok": False`` in it fails the step), where and how long it runs."""

    name: str
    fn: Callable[[Context], dict]
    timeout_s: float  # on CUDA; the CPU run gives each step CPU_TIMEOUT_S
    cpu: bool = True  # runs in --cpu (tiny shapes)
    min_gpus: int = 1


STEPS = [
    Step("facts", gpu_steps.facts, 30),
    Step("kernels", gpu_steps.kernels, 80),
    Step("ring", gpu_steps.ring, 60),
    Step("compile", gpu_steps.compile_ops, 60),
    Step("speed", gpu_speed.speed, 90),
    Step("memory", gpu_speed.memory, 40, cpu=False),
    Step("fp8", gpu_steps_train.fp8, 30),
    Step("e2e", gpu_steps_train.e2e, 90),
    Step("loading", gpu_steps_train.loading, 40),
    Step("multi_gpu", gpu_steps_train.multi_gpu, 300, min_gpus=2),
]
CPU_TIMEOUT_S = 120
MIN_STEP_S = 15  # a step is started only with at least this much of the budget left


@dataclass(frozen=True)
class Context:
    """What a step gets: its device, whether this is the CPU run (tiny shapes), the output folder."""

    device: torch.device
    cpu: bool
    out: Path


# ----- the child: one step -------------------------------------------------------------------------------


def run_step(name: str, out: Path, cpu: bool) -> int:
    """Run step ``name`` here and write out/<name>.json; returns the exit status."""
    step = next(s for s in STEPS if s.name == name)
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    if not cpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references in fp32, not TF32
        torch.backends.cudnn.allow_tf32 = False
    start = time.perf_counter()
    try:
        result = step.fn(Context(device, cpu, out))
        status = "ok" if result.get("ok", True) else "fail"
    except Exception as err:  # noqa: BLE001 - reported in the JSON, not lost with the process
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
        status = "error"
    record = {"name": name, "status": status, "seconds": time.perf_counter() - start, "result": result}
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
    return 0 if status == "ok" else 1


# ----- the parent: launching, waiting, killing ---------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), whatever session it started (torchrun's workers start their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant (found before any dies: orphans lose their parent)."""
    for _ in range(3):  # again, for processes started while the first sweep ran
        targets = [pid, *descendants(pid)]
        for target in targets:
            for kill in (lambda p: os.killpg(p, signal.SIGKILL), lambda p: os.kill(p, signal.SIGKILL)):
                try:
                    kill(target)
                except (ProcessLookupError, PermissionError):
                    pass
        if not descendants(pid):
            return
        time.sleep(0.1)


def run_isolated(command: list[str] | None, target, *, timeout: float, log: Path) -> tuple[str, int | None]:
    """Run ``command`` (a fresh interpreter) or, when it is None, ``target()`` in a fork, in a session of its own
    with output to ``log``; ("exited", status) or ("timeout", None) after killing the whole tree."""
    with open(log, "wb") as sink:
        if command is not None:
            proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
            pid = proc.pid
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: its own session, its output to the log, never back into the parent's code
                code = 70
                try:
                    os.setsid()
                    os.dup2(sink.fileno(), 1)
                    os.dup2(sink.fileno(), 2)
                    code = target()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "exited", os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            kill_tree(pid)
            os.waitpid(pid, 0)
            return "timeout", None
        time.sleep(0.05)


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def run_all(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = 0 if args.cpu else torch.cuda.device_count()
    started, records = time.monotonic(), []
    for step in STEPS:
        if args.steps and step.name not in args.steps:
            continue
        left = args.budget - (time.monotonic() - started)
        skip = None
        if args.cpu and not step.cpu:
            skip = "needs CUDA"
        elif not args.cpu and gpus < step.min_gpus:
            skip = f"needs {step.min_gpus} GPUs, found {gpus}"
        elif left < MIN_STEP_S:
            skip = f"budget: {left:.0f} s left"
        if skip:
            records.append({"name": step.name, "status": "skipped", "why": skip})
            print(f"{step.name:10s} skipped ({skip})", flush=True)
            continue
        timeout = min(CPU_TIMEOUT_S if args.cpu else step.timeout_s, left)
        (out / f"{step.name}.json").unlink(missing_ok=True)
        log = out / f"{step.name}.log"
        command = None
        if not args.cpu:
            command = [sys.executable, str(Path(__file__)), "--step", step.name, "--out", str(out)]
        t0 = time.monotonic()
        target = lambda step=step: run_step(step.name, out, args.cpu)  # noqa: E731 - the forked child's work
        how, code = run_isolated(command, target, timeout=timeout, log=log)
        seconds = time.monotonic() - t0
        result_file = out / f"{step.name}.json"
        if how == "timeout":
            record = {"name": step.name, "status": "timeout", "why": f"killed after {timeout:.0f} s"}
        elif result_file.exists():
            record = json.loads(result_file.read_text())
        else:  # died without a word: a sticky CUDA fault, a segfault, the OOM killer
            record = {"name": step.name, "status": "crashed", "why": f"exit status {code}", "log_tail": _tail(log)}
        record |= {"wall_s": seconds, "timeout_s": timeout, "log": log.name}
        records.append(record)
        print(f"{step.name:10s} {record['status']:8s} {seconds:6.1f} s  (timeout {timeout:.0f} s)", flush=True)
    failed = [r["name"] for r in records if r["status"] not in ("ok", "skipped")]
    facts = next((r.get("result", {}) for r in records if r["name"] == "facts"), {})
    summary = {
        "mode": "cpu" if args.cpu else "cuda",
        "device": facts.get("name", "unknown"),  # the parent never touches the GPU: the steps have it to themselves
        "gpus": gpus,
        "torch": torch.__version__,
        "budget_s": args.budget,
        "elapsed_s": time.monotonic() - started,
        "ok": not failed,
        "failed": failed,
        "steps": records,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check_results", help="folder for <step>.json, <step>.log, summary.json")
    parser.add_argument("--cpu", action="store_true", help="every step that can run on CPU, tiny shapes")
    parser.add_argument("--budget", type=float, default=570, help="seconds for all steps together (CUDA)")
    parser.add_argument("--steps", nargs="+", choices=[s.name for s in STEPS], help="only these steps")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # the child: run this one step here
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.step:
        return run_step(args.step, Path(args.out), args.cpu)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device here; run with --cpu to exercise the script on CPU", file=sys.stderr)
        return 2
    summary = run_all(args)
    print(f"\n{'ALL CHECKS PASSED' if summary['ok'] else 'FAILED: ' + ', '.join(summary['failed'])} "
          f"in {summary['elapsed_s']:.0f} s; results in {Path(args.out).resolve()}", flush=True)  # fmt: skip
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

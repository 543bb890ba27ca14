"""The one helper that runs a function in N gloo worker processes and returns what each returned.

``spawn(fn, world_size, *args)`` starts ``world_size`` processes, gives them a gloo process group on a
free loopback port and one thread each, calls ``fn(rank, world_size, *args)`` in each, and returns the
results ordered by rank. If a worker raises, the first exception is re-raised here with the worker's
traceback attached, and the other workers are stopped rather than left waiting in a collective.
Teardown always happens.

Workers are forked from one server process per pytest run (multiprocessing's "forkserver") that has
imported torch, diffusers, Lightning, the library and the recipes (tests/worker_imports.py): a fresh,
clean process per rank and group, as with "spawn", without every rank importing them again. On a 2-core
machine that is about 10 s saved per group (a 4-rank group starts in about 0.2 s).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

# read by OpenMP and MKL when torch loads, i.e. in the fork server, not in the workers forked from it
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_context = None


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of the re-raised exception."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def context():
    """The fork-server context shared by every group of the pytest run (started on first use)."""
    global _context
    if _context is None:
        os.environ.update(THREAD_ENV)  # the server inherits the environment it starts in
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(["tests.worker_imports"])
    return _context


def _mmap_threshold(nbytes: int) -> None:
    """What ``MALLOC_MMAP_THRESHOLD_`` does at a process's start (the benchmarks' honest peaks: freed blocks
    leave the resident set), for a process forked after it: glibc's ``mallopt(M_MMAP_THRESHOLD, nbytes)``."""
    import ctypes

    M_MMAP_THRESHOLD = -3
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, nbytes)


def _worker(
    rank: int, world_size: int, port: int, env: dict, fn: Callable, args: tuple, results, timeout_s: float, group: bool
):
    os.environ.update(env)
    if "MALLOC_MMAP_THRESHOLD_" in env:  # glibc reads it at process start, which the fork server had before
        _mmap_threshold(int(env["MALLOC_MMAP_THRESHOLD_"]))
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % int(env.get("LOCAL_WORLD_SIZE", world_size))),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException as err:  # noqa: BLE001 - everything must reach the parent
        text = traceback.format_exc()
        try:
            results.put((rank, False, (err, text)))
        except Exception:  # the exception itself may not pickle
            results.put((rank, False, (RuntimeError(f"{type(err).__name__}: {err}"), text)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable, world_size: int, *args, timeout_s: float = 300.0, env: dict | None = None, group: bool = True
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return results by rank.

    ``group=False`` leaves the process group to ``fn`` (the environment is set as torchrun sets it): a Lightning
    run then starts its own, as it does when launched externally."""
    ctx = context()
    results = ctx.Queue()
    # the parent's allocator setting (benchmarks set it for their workers), applied in each worker
    inherited = {k: os.environ[k] for k in ("MALLOC_MMAP_THRESHOLD_",) if k in os.environ}
    env = {**THREAD_ENV, **inherited, **(env or {})}
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(rank, world_size, port, env, fn, args, results, timeout_s, group), daemon=True
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    failure = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size and failure is None:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed test did not finish within {timeout_s:.0f}s") from None
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise RuntimeError(f"a worker process died with exit code {dead[0]} without reporting") from None
                continue
            if ok:
                out[rank] = value
            else:
                failure = (rank, value)
        if failure is not None:
            rank, (err, text) = failure
            raise err from RemoteTraceback(f"in worker rank {rank}:\n{text}")
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5 if failure is None else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()


def sum_over(tensors, group=None) -> None:
    """All-reduce (SUM) ``tensors`` in place over ``group`` with one collective: on a 2-core machine running 4
    ranks, each collective costs milliseconds of scheduling, so a model's gradients reduced one tensor at a time
    cost more than the model's step."""
    import torch
    import torch.distributed as dist

    tensors = list(tensors)
    if not tensors:
        return
    flat = torch.cat(
        [t.detach().reshape(-1).to(torch.float64 if t.dtype == torch.float64 else t.dtype) for t in tensors]
    )
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))

"""The one helper that runs a function in N gloo worker processes and returns what each returned.

``spawn(fn, world_size, *args)`` starts ``world_size`` processes (multiprocessing "spawn"), gives
them a gloo process group on a free loopback port and one thread each, calls
``fn(rank, world_size, *args)`` in each, and returns the results ordered by rank. If a worker
raises, the first exception is re-raised here with the worker's traceback attached, and the other
workers are stopped rather than left waiting in a collective. Teardown always happens.
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


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of the re-raised exception."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, env: dict, fn: Callable, args: tuple, results, timeout_s: float):
    os.environ.update(env)
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


def spawn(fn: Callable, world_size: int, *args, timeout_s: float = 300.0, env: dict | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, env, fn, args, results, timeout_s), daemon=True)
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

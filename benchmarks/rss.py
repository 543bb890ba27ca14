"""Per-rank peak anonymous memory of a launched process tree, polled from /proc (Linux).

The launched process is rank 0; its direct children that carry ``LOCAL_RANK`` in their environment (how
Lightning's script launcher and torchrun start ranks) are the other ranks. A rank's figure is the peak of
``RssAnon`` in /proc/PID/status: the anonymous pages it holds (heap, tensors), not the file pages it maps
(safetensors maps files copy-on-write; VmHWM would count those shared pages in every rank).
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

_RSS_ANON = re.compile(r"RssAnon:\s+(\d+) kB")


def rss_anon(pid: int) -> int | None:
    """Bytes of anonymous resident memory of ``pid``, or None once it has gone."""
    try:
        match = _RSS_ANON.search(Path(f"/proc/{pid}/status").read_text())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(match.group(1)) * 1024 if match else None  # a zombie has no RssAnon line


def children(pid: int) -> list[int]:
    """Children that ``pid``'s main thread started (where launchers call Popen)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def local_rank(pid: int) -> int | None:
    """``LOCAL_RANK`` from the environment ``pid`` was started with, or None."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    for item in environ:
        if item.startswith(b"LOCAL_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def mem_info() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    text = Path("/proc/meminfo").read_text()
    get = lambda key: int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024  # noqa: E731
    return get("MemTotal"), get("MemAvailable")


class RssPoller:
    """Polls the peak RssAnon of rank 0 (``pid``) and of its children with ``LOCAL_RANK`` every ``interval``
    seconds on a background thread, from ``__enter__`` to ``__exit__``; ``peaks`` maps rank -> bytes."""

    def __init__(self, pid: int, *, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.peaks: dict[int, int] = {}
        self._ranks: dict[int, int | None] = {pid: 0}  # pid -> rank (None: a child that is not a rank)
        self._polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> None:
        if self._polls % 10 == 0:  # new ranks appear once, at launch: look for them less often
            for child in children(self.pid):
                if self._ranks.get(child) is None:  # (again: read between fork and exec, it shows the parent's)
                    self._ranks[child] = local_rank(child)
        self._polls += 1
        for pid, rank in self._ranks.items():
            if rank is None:
                continue
            value = rss_anon(pid)
            if value is not None:
                self.peaks[rank] = max(self.peaks.get(rank, 0), value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def __enter__(self) -> RssPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_polled(cmd: list[str], *, env: dict, cwd: Path, log: Path, timeout: float, interval: float = 0.02) -> dict:
    """Run ``cmd`` (rank 0, in a session of its own) with its output in ``log`` while polling every rank's RssAnon;
    returns ``{"peaks": {rank: bytes}, "code": exit status or "timeout", "wall": seconds}``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        with RssPoller(proc.pid, interval=interval) as poller:
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the run's own session: rank 0 and the ranks it started
                proc.wait()
                code = "timeout"
    return {"peaks": poller.peaks, "code": code, "wall": time.perf_counter() - start}

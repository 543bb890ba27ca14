"""When a job goes wrong: say which collective failed and which rank is lost, and stop non-finite steps.

Two things the strategy uses:

* :func:`explain_collective_failure` turns a bare backend error ("Connection closed by peer", "Timed out
  waiting 5000ms for recv operation") into one that names the collective and its ranks, says which ranks
  are gone (a pid check for ranks on this host, from the table :func:`rank_table` gathers at setup) or
  still running (hung or far behind), and how to raise the timeout.
* :class:`NonFiniteCheck` flags a non-finite loss (per rank, in ``training_step``) and a non-finite local
  gradient (per rank, in the gradient communication hook, before the all-reduce mixes the ranks), then
  agrees on all ranks in one tiny all-reduce before the optimizer step: every rank raises, or every rank
  skips the step, so no rank updates weights the others do not.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

NONFINITE_MODES = ("raise", "skip", "ignore")
_LOST = ("connection closed", "connection reset", "broken pipe", "socket closed", "connection refused", "eof")
_TIMED_OUT = ("timed out", "timeout")
_COLLECTIVE_FILES = ("distributed_c10d.py", "_functional_collectives.py")
_OWN_COLLECTIVES = (str(Path("cp_lightning") / "collectives.py"),)


class NonFiniteError(RuntimeError):
    """A training step produced a non-finite loss or gradient; the weights were not updated."""


def rank_table() -> list[tuple[str, int]]:
    """(hostname, pid) of every rank, all-gathered (a collective: every rank calls it once at setup)."""
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, (socket.gethostname(), os.getpid()))
    return table


def is_collective_failure(err: BaseException) -> bool:
    """A backend error of a collective: a lost peer or a timeout (gloo, NCCL), not a user's exception."""
    for e in _chain(err):
        if isinstance(e, dist.DistError):
            return True
        text = str(e).lower()
        backend = any(word in text for word in ("gloo", "nccl", "processgroup", "c10d", "work"))
        if isinstance(e, RuntimeError) and backend and any(w in text for w in _LOST + _TIMED_OUT):
            return True
    return False


def explain_collective_failure(
    err: BaseException, *, rank: int, table: list[tuple[str, int]] | None, timeout: timedelta | None
) -> str:
    """The sentence to add to a collective's error: what failed, over which ranks, who is lost, what to do."""
    text = " ".join(str(e) for e in _chain(err)).lower()
    timed_out = any(w in text for w in _TIMED_OUT) and not any(w in text for w in _LOST)
    name, group, where = _failed_collective(err)
    ranks = _group_ranks(group)
    what = f"{name} over ranks {ranks}" if ranks is not None else name
    lines = [f"cp_lightning: rank {rank} {'timed out' if timed_out else 'lost a peer'} in {what}{where}."]
    peers = [r for r in (ranks if ranks is not None else range(len(table or []))) if r != rank]
    if table:
        gone, running, elsewhere = [], [], []
        host = socket.gethostname()
        local = [table[r][1] for r in peers if table[r][0] == host]
        deadline = time.monotonic() + (0 if timed_out else 2.0)
        while any(process_running(pid) for pid in local) and time.monotonic() < deadline:
            time.sleep(0.05)  # a killed peer's sockets close while it is still exiting
        for r in peers:
            peer_host, pid = table[r]
            if peer_host != host:
                elsewhere.append(f"{r} (host {peer_host})")
            elif process_running(pid):
                running.append(f"{r} (pid {pid})")
            else:
                gone.append(f"{r} (pid {pid})")
        if gone:
            lines.append(f"Lost rank(s) {', '.join(gone)}: the process is gone (killed or crashed; see its log).")
        if running and timed_out:
            lines.append(
                f"Rank(s) {', '.join(running)} still run but did not join: hung or far behind "
                "(see where with `py-spy dump --pid PID`)."
            )
        if elsewhere and (timed_out or not gone):
            lines.append(f"Rank(s) {', '.join(elsewhere)} run on other hosts: check their logs.")
    limit = f"{timeout.total_seconds():g} s" if timeout is not None else "the process group's default"
    lines.append(
        f"The collective timeout is {limit}; if a step, a checkpoint or a first compile can legitimately take "
        "longer, raise it with ContextParallelStrategy(..., timeout=timedelta(minutes=60)) (or timeout=3600)."
    )
    return "\n".join(lines)


def augment(err: BaseException, message: str) -> None:
    """Append ``message`` to the exception's text in place (so the traceback printed shows it)."""
    if err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}\n\n{message}", *err.args[1:])
    else:
        err.args = (*err.args, message)


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _failed_collective(err: BaseException) -> tuple[str, object, str]:
    """(collective name, its group, where in cp_lightning/Lightning) from the innermost traceback frames."""
    name, group, where = None, None, ""
    for e in _chain(err):
        frames = list(traceback.walk_tb(e.__traceback__))
        for frame, _ in reversed(frames):
            file = frame.f_code.co_filename
            if name is None and file.endswith(_COLLECTIVE_FILES) and not frame.f_code.co_name.startswith("_"):
                name, group = frame.f_code.co_name, frame.f_locals.get("group")
            if name is None and file.endswith(_OWN_COLLECTIVES):
                # functional collectives (torch.ops._c10d_functional) fail inside an op call, with no frame of
                # torch's named collectives: the cp_lightning function that issued it names it instead
                name, group = frame.f_code.co_name, frame.f_locals.get("group")
            if not where and ("cp_lightning" in file or "lightning" in file) and "faults.py" not in file:
                module = Path(file).stem
                package = "cp_lightning" if "cp_lightning" in file else "lightning"
                where = f" (called from {package} {module}.{frame.f_code.co_name})"
        if name is not None:
            break
        if any(f.f_code.co_name in ("backward", "_engine_run_backward") for f, _ in frames):
            name = "a collective of the backward pass (DDP's gradient all-reduce or a CP exchange)"
            break
    return name or "a collective", group, where


def _group_ranks(group) -> list[int] | None:
    try:
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except Exception:  # the group may already be torn down
        return None


def process_running(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, dead but not reaped yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child that its parent has not reaped yet is a zombie: gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class NonFiniteCheck:
    """Per-step flags of non-finite losses and local gradients, agreed on by all ranks before the update."""

    def __init__(self, mode: str, owner: str = "ContextParallelStrategy") -> None:
        if mode not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {mode!r}.")
        self.mode, self.owner = mode, owner  # owner: the class whose nonfinite= the error message points to
        self.skipped = 0
        self._loss_bad: torch.Tensor | None = None
        self._grad_bad: torch.Tensor | None = None
        self._shard_bad: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.mode != "ignore"

    def note_loss(self, loss: torch.Tensor) -> None:
        # no host sync here: a device-side flag, read once per optimizer step in resolve()
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def note_grads(self, buffer: torch.Tensor) -> None:
        bad = ~torch.isfinite(buffer).all()
        self._grad_bad = bad if self._grad_bad is None else self._grad_bad | bad

    def note_sharded_grads(self, parameters) -> None:
        """FSDP: this rank's gradient shards, after the reduce-scatter (a non-finite gradient on any rank reaches the
        shards that hold its elements). No host sync here either."""
        for p in parameters:
            if p.grad is None:
                continue
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            bad = ~torch.isfinite(grad).all()
            self._shard_bad = bad if self._shard_bad is None else self._shard_bad | bad

    def resolve(self, step: int, device: torch.device) -> bool:
        """Collective. False: the step is fine. True: skip it (mode "skip"). Raises :class:`NonFiniteError`
        (mode "raise") naming the step and the ranks, identically on every rank."""
        world, rank = dist.get_world_size(), dist.get_rank()
        flags = torch.zeros(3, world, dtype=torch.int32, device=device)
        for row, bad in enumerate((self._loss_bad, self._grad_bad, self._shard_bad)):
            if bad is not None:
                flags[row, rank] = bad.to(device)
        self._loss_bad = self._grad_bad = self._shard_bad = None
        dist.all_reduce(flags)
        loss_ranks, grad_ranks, shard_ranks = (torch.nonzero(row).flatten().tolist() for row in flags.cpu())
        if not loss_ranks and not grad_ranks and not shard_ranks:
            return False
        parts = []
        if loss_ranks:
            parts.append(f"non-finite loss on rank(s) {loss_ranks}")
        if grad_ranks:
            parts.append(f"non-finite gradients on rank(s) {grad_ranks} (before the all-reduce)")
        if shard_ranks:
            parts.append(f"non-finite gradient shards on rank(s) {shard_ranks} (FSDP, after the reduce-scatter)")
        what = f"step {step}: {'; '.join(parts)}"
        if self.mode == "raise":
            raise NonFiniteError(
                f"{what}. The weights were not updated. Look at this step's batch and the learning rate (or try "
                f"bf16-mixed / gradient clipping), or pass {self.owner}(..., nonfinite='skip') to skip "
                "such steps (they are counted and logged)."
            )
        self.skipped += 1
        if rank == 0:
            log.warning(f"cp_lightning: skipped {what} ({self.skipped} step(s) skipped so far)")
        return True


def check_timeout(timeout: timedelta | float | int) -> timedelta:
    """A positive ``timedelta`` from a ``timedelta`` or a number of seconds (ValueError/TypeError otherwise)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (timedelta, int, float)):
        raise TypeError(f"timeout must be a datetime.timedelta or seconds (a number), got {type(timeout).__name__}.")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"timeout must be a positive, finite duration, got {timeout!r}; e.g. timedelta(minutes=30).")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def mesh_groups(mesh, ring: int) -> list:
    """Every process group a CP job uses: the world, the mesh's (dp, cp, flattened) and the CP attention groups
    (cp, ulysses, ring)."""
    from cp_lightning.mesh import cp_groups

    groups = {id(g): g for g in [dist.group.WORLD, *mesh.get_all_groups()]}
    extra = cp_groups(mesh, ring)
    for g in (extra.cp, extra.ulysses, extra.ring):
        if g is not None:
            groups[id(g)] = g
    return list(groups.values())


def group_timeout(group=None) -> timedelta | None:
    """The timeout ``group``'s backend gives its collectives (default: the world's); None if unreadable."""
    group = group if group is not None else dist.group.WORLD
    for device in group._device_types:
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without options (a fake or wrapped one)
            continue
    return None


def set_collective_timeout(timeout: timedelta, mesh, ring: int) -> None:
    """Give every process group of ``mesh`` (dp, cp, ring, ulysses) and the world ``timeout``. Collective.

    ``new_group`` gives each new group the backend's default (30 min), not the world's timeout, so a hang
    inside a CP group would otherwise wait half an hour whatever the strategy was told. A barrier first,
    so that no rank starts collectives under the new limit while a slow peer still works under the old one.
    """
    groups = mesh_groups(mesh, ring)
    dist.barrier()
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def stop_processes(procs, grace: float = 2.0) -> None:
    """SIGKILL the ``subprocess.Popen`` children still running after ``grace`` seconds (time to print their own
    errors). SIGKILL, as Lightning's own observer does: a rank blocked in a collective ignores SIGTERM."""
    running = [p for p in procs if p.poll() is None]
    deadline = time.monotonic() + grace
    while running and time.monotonic() < deadline:
        time.sleep(0.1)
        running = [p for p in running if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGKILL)
        p.wait()

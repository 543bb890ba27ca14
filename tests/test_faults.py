"""Faults end to end: a killed or hung rank, an interrupted checkpoint write, a NaN; then resume.

One chain of runs of tests/scripts/faults.py (2 CPU processes, gloo, cp=2) under torchrun and Lightning's own
launcher, each in its own session so that the test can see every process it started. Each faulty run must
end soon after the fault (within the collective timeout), with a non-zero status and a message naming the
lost rank or the collective, leave no process behind, and leave a ``last.ckpt`` that the next run resumes
from (``ckpt_path="last"``). Every loss any of them records equals the uninterrupted run's within 1e-6.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from cp_lightning import ContextParallelStrategy, FabricContextParallelStrategy
from cp_lightning.checkpoint_io import AtomicCheckpointIO, repair_epoch_progress
from cp_lightning.faults import NonFiniteCheck, is_collective_failure
from tests.distributed import free_port
from tests.lightning_tasks import read_records

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "faults.py"
STEPS = 8
LOSS_TOL = 1e-6
DEFAULT_TIMEOUT = 1800  # Lightning's (and torch's) default collective timeout, seconds


@dataclass
class Run:
    code: int
    out: str
    ended: float  # time.time() once every process of the run was gone
    orphans: list[str]
    record_dir: Path

    def since(self, name: str) -> float:
        """Seconds from the moment the fault was injected (a timestamp file the faulty rank wrote) to the end."""
        return self.ended - float((self.record_dir / name).read_text())

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_records(self.record_dir) if r["rank"] == 0}


def _session(sid: int) -> list[str]:
    """Live processes of session ``sid`` ("pid command"), zombies excluded."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, _, _, session = text.rsplit(")", 1)[1].split()[:4]
        if int(session) == sid and state != "Z":
            members.append(f"{stat.parent.name} {text[text.index('(') : text.rindex(')') + 1]}")
    return members


def launch(launcher: str, record_dir: Path, *args, limit: float = 150) -> Run:
    record_dir.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_GLOBAL_SEED": "0", "MASTER_PORT": str(free_port())}
    script = [str(SCRIPT), "--record-dir", str(record_dir), "--steps", str(STEPS), *map(str, args)]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
        cmd += [f"--master-port={env['MASTER_PORT']}", *script]
    else:  # Lightning's launcher: the script starts the other rank itself
        cmd = [sys.executable, *script]
    log = record_dir / "output.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"{launcher} run did not end within {limit} s:\n{log.read_text()[-4000:]}") from None
    deadline = time.monotonic() + 10
    while (left := _session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = time.time()
    if left:  # clean up before failing the test
        os.killpg(proc.pid, signal.SIGKILL)
    return Run(proc.returncode, log.read_text(), ended, left, record_dir)


def check_failed(run: Run, *patterns: str) -> None:
    assert run.code != 0, run.out[-4000:]
    assert not run.orphans, f"processes left behind: {run.orphans}"
    for pattern in patterns:
        assert re.search(pattern, run.out), f"{pattern!r} not in the output:\n{run.out[-6000:]}"


def last_step(ckpt_dir: Path) -> int:
    return torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]


def test_faults_end_cleanly_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    resume = ("--ckpt-dir", ckpt, "--resume", "last")
    reference = launch("lightning", tmp_path / "reference")
    assert reference.code == 0 and not reference.orphans, reference.out[-4000:]
    expected = reference.losses()
    assert sorted(expected) == list(range(STEPS))
    runs = {}

    # A rank SIGKILLed mid-step under torchrun, short and default timeout: torchrun stops the other rank at
    # once and its summary names the lost rank and the signal.
    runs["kill_torchrun_short"] = run = launch(
        "torchrun", tmp_path / "k1", "--ckpt-dir", ckpt, "--timeout", 20, "--kill-at-step", 1, "--kill-rank", 1
    )
    check_failed(run, r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9")
    assert run.since("killed_at") < 20, run.since("killed_at")
    assert last_step(ckpt) == 1
    runs["kill_torchrun_default"] = run = launch(
        "torchrun", tmp_path / "k2", *resume, "--kill-at-step", 2, "--kill-rank", 0
    )
    check_failed(run, r"rank\s*:\s*0 \(local_rank: 0\)\s*\n\s*exitcode\s*:\s*-9")
    assert run.since("killed_at") < 60, run.since("killed_at")  # far below the default 30 min

    # Under Lightning's launcher the surviving rank names the lost one (Lightning's own message gives a pid).
    runs["kill_lightning_short"] = run = launch(
        "lightning", tmp_path / "k3", *resume, "--timeout", 20, "--kill-at-step", 3, "--kill-rank", 1
    )
    check_failed(run, r"rank 0 lost a peer in \w+ over ranks \[0, 1\]", r"Lost rank\(s\) 1 \(pid \d+\)")
    assert run.since("killed_at") < 20, run.since("killed_at")
    assert last_step(ckpt) == 3

    # Rank 0 (the launching process, default timeout) killed while writing last.ckpt at step 5: rank 1 is
    # not orphaned and names it; the previous last.ckpt is intact and is what "last" resumes from.
    runs["kill_in_save"] = run = launch("lightning", tmp_path / "save", *resume, "--kill-in-save-at-step", 5)
    check_failed(run, r"Lost rank\(s\) 0 \(pid \d+\)", r"The collective timeout is 1800 s")
    assert (ckpt / "epoch=4-step=5.ckpt").exists()  # the step's own checkpoint was written before last.ckpt
    assert last_step(ckpt) == 4
    assert list(ckpt.glob(".*.partial")), "the killed writer's temporary file should be there"

    # A rank that hangs: the other times out after ContextParallelStrategy(timeout=10) (not the default 30
    # min), naming the collective, the rank that did not join and how to raise the limit.
    runs["hang"] = run = launch(
        "lightning", tmp_path / "hang", *resume, "--timeout", 10, "--hang-at-step", 5, "--hang-rank", 1
    )
    check_failed(
        run,
        r"rank 0 timed out in \w+ over ranks \[0, 1\]",
        r"Rank\(s\) 1 \(pid \d+\) still run but did not join",
        r"The collective timeout is 10 s; .* raise it with ContextParallelStrategy\(\.\.\., timeout=",
    )
    assert 10 <= run.since("hang_started") < 10 + 15, run.since("hang_started")
    assert last_step(ckpt) == 5
    assert not list(ckpt.glob(".*.partial")), "the next save removes the dead writer's temporary file"

    # A NaN loss on rank 1 at step 6: every rank fails the step, naming it and the rank; no update.
    runs["nan_raise"] = run = launch("lightning", tmp_path / "nan", *resume, "--nan-at-step", 6, "--nan-rank", 1)
    check_failed(run, r"NonFiniteError: step 6: non-finite loss on rank\(s\) \[1\]", r"nonfinite='skip'")
    assert last_step(ckpt) == 6

    # Resume to the end; a NaN gradient on rank 0 at step 8 is skipped (counted, logged), leaving the weights.
    runs["skip"] = run = launch(
        "lightning", tmp_path / "skip", *resume, "--steps", STEPS + 2, "--nan-at-step", STEPS, "--nan-rank", 0,
        "--nan-kind", "grad", "--nonfinite", "skip",
    )  # fmt: skip
    assert run.code == 0 and not run.orphans, run.out[-4000:]
    assert re.search(
        rf"skipped step {STEPS}: non-finite gradients on rank\(s\) \[0(, 1)?\].*\(1 step\(s\) skipped", run.out
    )
    params = {r["step"]: r["param_sum"] for r in map(json.loads, (run.record_dir / "params0.jsonl").open())}
    assert params[STEPS + 1] == params[STEPS] and torch.isfinite(torch.tensor(params[STEPS]))
    final = torch.load(ckpt / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == STEPS + 2 and final["cp_lightning"]["skipped_steps"] == 1

    # Every loss recorded after a resume (and before each fault) is the uninterrupted run's.
    seen = {}
    for name, r in runs.items():
        for step, loss in r.losses().items():
            if step < STEPS and not (name == "nan_raise" and step == 6):  # not the injected NaN itself
                seen.setdefault(step, []).append((name, loss))
    assert set(seen) == set(range(STEPS)), sorted(seen)
    for step, losses in seen.items():
        for name, loss in losses:
            assert abs(loss - expected[step]) <= LOSS_TOL, (step, name, loss, expected[step])


def test_an_interrupted_or_full_disk_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, path)
    original = torch.save

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"x" * 100)  # some bytes land, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=r"no space left to write the checkpoint .*last\.ckpt .* untouched"):
        io.save_checkpoint({"step": 2, "w": torch.zeros(1000)}, path)
    monkeypatch.setattr(torch, "save", original)
    assert io.load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left

    # a process killed mid-write: a stale temporary file of a dead pid is removed by the next save
    stale = tmp_path / f".cp_lightning-{os.uname().nodename}-999999999-last.ckpt.partial"
    stale.write_bytes(b"half")
    io.save_checkpoint({"step": 3}, path)
    assert io.load_checkpoint(path)["step"] == 3 and not stale.exists()


def test_fault_options_are_checked_at_construction():
    assert ContextParallelStrategy(cp=2, timeout=90)._collective_timeout == timedelta(seconds=90)
    assert ContextParallelStrategy(cp=2, timeout=timedelta(hours=2))._timeout == timedelta(hours=2)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        ContextParallelStrategy(cp=2, timeout=0)
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or seconds"):
        ContextParallelStrategy(cp=2, timeout="10s")
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('raise', 'skip', 'ignore'\)"):
        ContextParallelStrategy(cp=2, nonfinite="warn")
    fabric = FabricContextParallelStrategy(cp=2, timeout=90)
    assert (fabric._collective_timeout, fabric._timeout) == (timedelta(seconds=90), timedelta(minutes=30))
    with pytest.raises(ValueError, match="timeout must be a positive, finite"):
        FabricContextParallelStrategy(cp=2, timeout=float("inf"))
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or seconds"):
        FabricContextParallelStrategy(cp=2, timeout=True)
    assert isinstance(ContextParallelStrategy(cp=2).checkpoint_io, AtomicCheckpointIO)
    assert NonFiniteCheck("ignore").active is False
    # only backend failures get the collective explanation, not the user's own errors
    assert not is_collective_failure(ValueError("bad shape"))
    assert is_collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))


def test_epoch_counters_of_a_checkpoint_saved_by_a_resumed_run_are_repaired():
    # Lightning 2.6's counters in a checkpoint saved inside epoch 3 by a run that resumed at the end of
    # epoch 2's last batch: ready == started == processed == completed == 3 (a fresh run holds 4, 4, 3, 3)
    def checkpoint(ready, started, processed, completed, batch_completed=0):
        counts = dict(ready=ready, started=started, processed=processed, completed=completed)
        batch = {"current": dict(ready=1, started=1, processed=1, completed=batch_completed)}
        progress = {"total": dict(counts), "current": dict(counts)}
        return {"loops": {"fit_loop": {"epoch_progress": progress, "epoch_loop.batch_progress": batch}}}

    drifted = checkpoint(3, 3, 3, 3)
    assert repair_epoch_progress(drifted)
    assert drifted["loops"]["fit_loop"]["epoch_progress"]["total"] == dict(ready=4, started=4, processed=3, completed=3)
    for sound in (checkpoint(4, 4, 3, 3), checkpoint(3, 3, 3, 3, batch_completed=1), {"state_dict": {}}):
        assert not repair_epoch_progress(sound)  # a fresh run's, a finished epoch's, a weights-only file

"""``AtomicCheckpointIO``: a checkpoint file is either the complete old one or the complete new one, never half.

The strategy's default checkpoint writer. ``torch.save`` streams into a hidden temporary file in the
checkpoint's own directory; the file is flushed and fsynced, then ``os.replace`` renames it over the target
(atomic on POSIX filesystems) and the directory entry is fsynced. A process killed mid-write, a full disk or
a node that loses power leaves the previous ``last.ckpt`` (or any other checkpoint) as it was, plus at worst
a hidden ``*.partial`` file that the next save in that directory removes.

Lightning's own ``TorchCheckpointIO`` serialises the whole checkpoint into memory first and commits through
a temporary file in the system temp dir; when that dir is on another filesystem than the checkpoints (a
local /tmp, checkpoints on NFS or Lustre) the commit is a copy, which a kill can cut short. The temporary
name here holds neither "last" nor ".ckpt", so ``ckpt_path="last"`` and ``ModelCheckpoint``'s top-k
bookkeeping never pick it up.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH

from cp_lightning.faults import process_running

_PREFIX = ".cp_lightning-"
_SUFFIX = ".partial"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file beside it and rename it into place (local paths; remote
    URLs such as ``s3://`` fall back to Lightning's writer, whose object stores commit whole objects)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(target.parent)
        temp = target.parent / f"{_PREFIX}{socket.gethostname()}-{os.getpid()}-{target.name}{_SUFFIX}"
        try:
            with open(temp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, target)
        except BaseException as err:
            temp.unlink(missing_ok=True)
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(
                    err.errno,
                    f"no space left to write the checkpoint {target} ({_free(target.parent)} free in "
                    f"{target.parent}); the previous file at that path is untouched. Free space, point the "
                    "checkpoint directory elsewhere, or keep fewer checkpoints (ModelCheckpoint(save_top_k=...)).",
                ) from err
            raise
        _fsync_dir(target.parent)


def remove_stale_partials(directory: Path) -> list[Path]:
    """Delete temporary files that writers on this host left behind when they died (their pid is gone)."""
    removed = []
    host = socket.gethostname()
    for temp in directory.glob(f"{_PREFIX}{host}-*{_SUFFIX}"):
        pid = temp.name[len(f"{_PREFIX}{host}-") :].split("-", 1)[0]
        if pid.isdigit() and not process_running(int(pid)):
            temp.unlink(missing_ok=True)
            removed.append(temp)
    return removed


def _is_local(path: _PATH) -> bool:
    return type(get_filesystem(path)).__name__ == "LocalFileSystem"


def _fsync_dir(directory: Path) -> None:
    # the rename is durable only once the directory entry is on disk (power loss, node crash)
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not fsync directories
    finally:
        os.close(fd)


def _free(directory: Path) -> str:
    try:
        st = os.statvfs(directory)
    except OSError:
        return "unknown"
    return f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB"


def repair_epoch_progress(checkpoint: dict) -> bool:
    """Undo Lightning's epoch-counter drift in a checkpoint saved inside an epoch by a resumed run. Returns
    whether it changed anything.

    Lightning (2.6) resumes a checkpoint saved at the end of an epoch's last batch by finishing that epoch
    and starting the next one without counting it as ready/started. A checkpoint that run saves inside the
    next epoch then holds ready == started == processed == completed, so the next resume hands the samplers
    the previous epoch's number (``set_epoch(processed)``): the same shuffle twice, and losses that are not
    the uninterrupted run's. Inside an epoch, ready and started are one more than processed; restore that.
    """
    try:
        progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]
        batch = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    except (KeyError, TypeError):
        return False
    inside_a_batch = batch["completed"] == batch["ready"] - 1 >= 0
    changed = False
    for counts in (progress["total"], progress["current"]):
        if inside_a_batch and counts["ready"] == counts["started"] == counts["processed"] == counts["completed"]:
            counts["ready"] += 1
            counts["started"] += 1
            changed = True
    return changed

"""A full disk as one line: a save, or another write in the workdir, that failed for lack of
space names the file and the last good checkpoint, which is kept."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator

import orbax.checkpoint as ocp
from etils import epath

from skipless_jax.checkpoint.orbax_io import abs_path


class DiskFullError(OSError):
    """A save that failed for lack of space; the checkpoints saved before it are kept."""


def _disk_full(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is a full disk: ENOSPC, or tensorstore's RESOURCE_EXHAUSTED."""
    seen = 0
    while err is not None and seen < 20:
        if getattr(err, "errno", None) == errno.ENOSPC or any(
                k in str(err) for k in ("RESOURCE_EXHAUSTED", "No space left on device")):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def disk_full_write(err: BaseException, workdir: str) -> DiskFullError | None:
    """A write in `workdir` other than a checkpoint save (the profiler trace, history.jsonl, the
    event files, the final metrics) that failed for lack of space, as one DiskFullError naming the
    file and the last good checkpoint; None for any other error (ENOSPC or 'No space left on
    device' only: a bare RESOURCE_EXHAUSTED may be a device's memory)."""
    seen = 0
    while err is not None and seen < 20:
        text = str(err)
        if getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in text:
            what = getattr(err, "filename", None) or _last_path(text.split("No space left on device")[0]) \
                or f"a file in {workdir}"
            good = _finished_in(os.path.join(abs_path(workdir), "checkpoints"))
            return DiskFullError(
                f"the disk is full: writing {what} failed (No space left on device); "
                f"{f'the last good checkpoint is step {max(good)}, kept' if good else 'no checkpoint was saved yet'}; "
                "free space and rerun the same command to resume")
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def _last_path(text: str) -> str | None:
    """The last file path (or bucket URL) in a library's error text, without its quotes and
    brackets ('... "/w/run/x.pb": [OS error 28] ...' -> '/w/run/x.pb'); None if it names none."""
    paths = re.findall(r"(?:\b[a-z][a-z0-9+]*://|(?<![\w.])/)[^\s\"'\[\]();,]+", text)
    return paths[-1].rstrip(":.") if paths else None


@contextlib.contextmanager
def disk_full_as_one_error(mngr: ocp.CheckpointManager, step: int | None) -> Iterator[None]:
    """Turns a full disk under `mngr` (a save, or its async completion) into DiskFullError: one line
    naming the folder and the last good checkpoint."""
    try:
        yield
    except Exception as err:
        if not _disk_full(err):
            raise
        good = _finished_steps(mngr)  # a failed save never got its final name
        raise DiskFullError(
            f"the disk is full: a checkpoint save in {mngr.directory} failed (No space left on device; step "
            f"{step}, or the save before it still finishing in the background); the last good checkpoint is "
            f"{f'step {max(good)}' if good else 'none'}, kept; free space and rerun the same command to resume"
        ) from None


def _finished_steps(mngr: ocp.CheckpointManager) -> list[int]:
    """The step folders on disk that orbax finished (renamed to their number)."""
    return _finished_in(mngr.directory)


def _finished_in(checkpoints: str) -> list[int]:
    directory = epath.Path(checkpoints)
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []

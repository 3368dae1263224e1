"""One run (or sweep) per folder: `<folder>/.lock`, made with O_CREAT | O_EXCL, which is atomic on
local file systems and on NFS (v3 and later), so the lock holds across the hosts that share the
folder. The file holds its holder's host, pid and start time.

    with workdir_lock.held(workdir):   # WorkdirBusy (one line naming the holder) if another holds it
        ...

A lock whose holder is gone is stale and taken over, with one warning line saying so. Gone:
- on the same host (the same boot), no process with the holder's pid and process start time
  (a pid reused by another process does not keep the lock);
- on another host, the file's mtime older than STALE_S: a holder touches its lock every
  HEARTBEAT_S (a thread), so a killed one stops within STALE_S (the hosts' clocks must agree
  to well within that; NTP does).
It is released on every exit that runs Python's `finally` (`release_held()` first for the
others, e.g. `os._exit`); after SIGKILL it is stale. A multi-process run takes it in process 0
only (main.py): its processes share the workdir.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from absl import logging

LOCK = ".lock"
HEARTBEAT_S = 20.0
STALE_S = 120.0

_held: dict[str, str] = {}  # lock path -> this holder's token


class WorkdirBusy(Exception):
    """Another live process holds the folder's lock; the message is one line naming it."""


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux /proc), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def holder_record() -> dict[str, Any]:
    """What this process writes into a lock it takes."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": time.time(), "boot_id": _boot_id(),
            "process_start": _process_start(pid), "token": uuid.uuid4().hex}


def describe(holder: dict[str, Any]) -> str:
    """'host H, pid N, started YYYY-MM-DD HH:MM:SS UTC'."""
    start = holder.get("start")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start)) if isinstance(start, (int, float)) else "?"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {when}"


def is_stale(holder: dict[str, Any], mtime: float, now: float | None = None) -> bool:
    """Whether the holder of a lock (its record, the file's mtime) is gone (see the module docstring)."""
    same_machine = holder.get("host") == socket.gethostname() and holder.get("boot_id") == _boot_id()
    if not same_machine:
        return (time.time() if now is None else now) - mtime > STALE_S
    pid = holder.get("pid")
    if not isinstance(pid, int) or not _alive(pid):
        return True
    started = holder.get("process_start")
    return started is not None and _process_start(pid) not in (None, started)


def _read(path: str) -> tuple[dict[str, Any], float] | None:
    """(the lock's record, its mtime); {} for a record cut short; None when there is no lock."""
    try:
        with open(path) as f:
            text = f.read()
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError:  # a holder killed between create and write: judged by the mtime alone
        record = {}
    return (record if isinstance(record, dict) else {}), mtime


def _create(path: str, record: dict[str, Any]) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return True


def acquire(folder: str, what: str = "--workdir") -> None:
    """Takes `<folder>/.lock` (making `folder`), or raises WorkdirBusy naming the live holder;
    a stale lock is taken over with one warning. `what` names the folder in messages."""
    path = os.path.join(folder, LOCK)
    os.makedirs(folder, exist_ok=True)
    record = holder_record()
    for _ in range(5):  # a lost race with another process taking over the same stale lock: look again
        if _create(path, record):
            break
        found = _read(path)
        if found is None:
            continue
        holder, mtime = found
        if holder.get("token") in _held.values():
            raise WorkdirBusy(f"{what}={folder} is already in use by this process ({path})")
        if is_stale(holder, mtime):  # a record cut short ({}) is judged by the mtime alone
            aside = f"{path}.stale.{record['token']}"
            try:
                os.rename(path, aside)  # atomic: of several taking over, one moves the stale file
            except FileNotFoundError:
                continue
            if _read(aside) != found:  # moved a lock taken meanwhile: put it back, look again
                with contextlib.suppress(OSError):
                    os.link(aside, path)
                os.unlink(aside)
                continue
            os.unlink(aside)
            logging.warning("%s=%s: taking over the lock of a run that is gone (%s).", what, folder,
                            describe(holder) if holder else "its record was never written")
            continue
        raise _busy(what, folder, holder, path)
    else:
        raise WorkdirBusy(f"{what}={folder}: could not take the lock {path} (other processes keep taking it)")
    _held[path] = record["token"]
    _start_heartbeat(path, record["token"])


def _busy(what: str, folder: str, holder: dict[str, Any], path: str) -> WorkdirBusy:
    return WorkdirBusy(f"{what}={folder} is in use by another run ({describe(holder)}; lock {path}): "
                       "wait for it to end, or use another folder")


def check_free(folder: str, what: str = "--workdir") -> None:
    """`acquire`'s WorkdirBusy when `<folder>/.lock` names a live holder, without taking the lock:
    a command can refuse a busy folder before it loads anything (`acquire` still decides, and
    judges a lock that is stale or cut short)."""
    path = os.path.join(folder, LOCK)
    try:
        found = _read(path)
    except OSError:
        return
    if found is not None and found[0] and not is_stale(*found):
        raise _busy(what, folder, found[0], path)


def _start_heartbeat(path: str, token: str) -> None:
    def beat() -> None:
        while _held.get(path) == token:
            time.sleep(HEARTBEAT_S)
            if _held.get(path) == token:
                with contextlib.suppress(OSError):
                    os.utime(path)

    threading.Thread(target=beat, name="workdir-lock-heartbeat", daemon=True).start()


def release(folder: str) -> None:
    """Removes `<folder>/.lock` if this process holds it."""
    path = os.path.join(folder, LOCK)
    token = _held.pop(path, None)
    if token is None:
        return
    found = _read(path)
    if found is not None and found[0].get("token") == token:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def release_held() -> None:
    """Releases every lock this process holds (before `os._exit`, which runs no `finally`)."""
    for path in list(_held):
        release(os.path.dirname(path))


@contextlib.contextmanager
def held(folder: str, what: str = "--workdir") -> Iterator[None]:
    """`acquire(folder)`, released on leaving (whatever ends the block)."""
    acquire(folder, what)
    try:
        yield
    finally:
        release(folder)

"""The one preemption/SIGTERM rule: `SignalFlag` records SIGTERM or a first Ctrl-C, and
`stop_rule` says at which step the loop saves and stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import jax
from absl import logging

from skipless_jax import workdir_lock
from skipless_jax.trainers.outcome import EXIT_INTERRUPTED


class SignalFlag:
    """Records SIGTERM, or a first Ctrl-C (SIGINT), so that the loop saves a checkpoint and stops
    at the next step; a second Ctrl-C exits at once (status 130). `close` puts back the handlers
    it replaced."""

    def __init__(self):
        self.raised = self.interrupted = False
        self.final = False  # the last step is saved and its final evaluation runs (Run.last_step_saved)
        self._previous = {}
        with contextlib.suppress(ValueError):  # not the main thread (e.g. a test runner thread)
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handler)

    def _handler(self, signum, frame):
        if signum == signal.SIGINT and self.interrupted:
            print("Interrupted again: exiting now, without saving (exit status 130).", file=sys.stderr, flush=True)
            workdir_lock.release_held()
            os._exit(EXIT_INTERRUPTED)  # at once: no pending save or writer is waited for
        if signum == signal.SIGINT:
            self.interrupted = True
        if self.final:
            logging.warning("%s during the final evaluation: the last step is saved; the evaluation finishes, "
                            "then the run ends (exit status 0)%s.", "Ctrl-C" if signum == signal.SIGINT else
                            f"Received signal {signum}", ", Ctrl-C again exits at once (rerun to evaluate again)"
                            if signum == signal.SIGINT else "")
        elif signum == signal.SIGINT:
            logging.warning("Ctrl-C: saving this step, then stopping (Ctrl-C again exits at once, without saving).")
        else:
            logging.warning("Received signal %d: will checkpoint and stop after this step.", signum)
        self.raised = True

    def close(self) -> None:
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)
        self._previous = {}


def stop_rule(mngr: Any, flag: SignalFlag | None = None) -> Callable[[int], bool]:
    """step -> whether to save and stop now.

    One process: `flag` (SIGTERM, a first Ctrl-C; made here when not given) and orbax's
    preemption notice. Several: only
    jax.distributed's preemption service, which catches SIGTERM and makes
    `mngr.reached_preemption(step)` true at the same step in every process; a Python handler
    would replace it, and the signalled process would save while the others keep stepping (a hang).
    """
    if jax.process_count() > 1:
        flag = None
    elif flag is None:
        flag = SignalFlag()
    return lambda step: bool(mngr.reached_preemption(step) or (flag is not None and flag.raised))

"""The profiler trace of a few steps after warm-up, once per run, into the workdir
(TensorBoard's profile layout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
from absl import logging
from etils import epath

DEFAULT_PROFILE_STEPS = 3


class Profiler:
    """Traces `config.profile_steps` steps (default 3; 0 off) after `warmup` steps past the
    first, on process 0, into `<workdir>/plugins/profile/` (TensorBoard's profile layout), once
    per run: a resumed run whose workdir holds a trace traces nothing.

    The trace is the device and runtime events without the Python tracer's, and without the
    compiled programs' HLO unless `config.profile_hlo` (TensorBoard's op profile and memory
    viewer need it): about 0.5 MB a step for the quickstart on CPU, 1.9 MB in all, against
    10.6 MB with JAX's defaults (Python events, HLO; 5 steps).

    `settle` (e.g. the checkpoint manager's `wait_until_finished`) is called before the trace
    starts and before it stops: XLA's profiler can crash (a segfault, seen in a two-process CPU
    run) collecting a trace while orbax's background save threads copy arrays, so no save is in
    flight at either moment. Saves during the traced steps are in the trace, as in a real run.
    `excluded` (the meter's): the settling and the trace's start and stop, after the traced
    steps finish, are not training time.
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, first_step: int, total_steps: int,
                 warmup: int = 2, settle: Callable[[], None] = lambda: None,
                 excluded: Callable[[], Any] = contextlib.nullcontext):
        steps = config.get("profile_steps", DEFAULT_PROFILE_STEPS)
        steps = DEFAULT_PROFILE_STEPS if steps is None else int(steps)
        self.start = first_step + warmup + 1
        self.stop = min(self.start + steps, total_steps + 1)
        self.enabled = (steps > 0 and jax.process_index() == 0 and self.start < self.stop
                        and not has_trace(workdir))
        self.workdir, self.settle, self.excluded, self.active = workdir, settle, excluded, False
        self.options = jax.profiler.ProfileOptions()
        self.options.python_tracer_level = 0
        self.options.enable_hlo_proto = bool(config.get("profile_hlo", False))

    def after_step(self, step: int, state: Any) -> None:
        """Called after each step: the trace begins after step start - 1 and ends after stop - 1."""
        if self.enabled and not self.active and step == self.start - 1:
            jax.block_until_ready(state)  # earlier steps' device work stays out of the trace
            with self.excluded():
                self.settle()
                jax.profiler.start_trace(self.workdir, profiler_options=self.options)
            self.active = True
        elif self.active and step >= self.stop - 1:
            self.close(state)

    def close(self, state: Any = None) -> None:
        if self.active:
            if state is not None:
                jax.block_until_ready(state)  # the traced steps' device work ends inside the trace
            with self.excluded():
                self.settle()
                jax.profiler.stop_trace()
            self.active = False
            logging.info("Profile of steps %d-%d in %s/plugins/profile/", self.start, self.stop - 1, self.workdir)


def has_trace(workdir: str) -> bool:
    """Whether `workdir` holds a profiler trace (a run folder under plugins/profile/)."""
    folder = epath.Path(workdir, "plugins", "profile")
    return folder.is_dir() and any(folder.iterdir())

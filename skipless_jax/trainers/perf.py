"""How well a run uses its devices: the step compiled ahead of time with its XLA cost and
memory (the fit check, before the loop: trainers/devices.py), and the perf/* fields of the train
records. The profiler trace is trainers/profiler.py's.

    step, cost = compile_for(jax.jit(train_step, ...), state, inputs.train_batch_spec(config), sharding, config)
                                                  # compiled before any data; the fit check's one line
    meter = Meter(cost, images_per_step, config, first_step)  # Run.log_train adds meter.fields(step);
                                                  # model FLOPs per example from models.flops
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import ml_collections
from absl import logging

from skipless_jax.trainers.devices import fit_check, peak_tflops


class StepCost(NamedTuple):
    """Per-device figures of the compiled step (XLA's cost and memory analyses)."""

    flops: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse a donated argument's buffer
    temp_bytes: int
    devices: int  # the devices the step runs on

    @property
    def bytes_needed(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def compile_step(jitted: Any, *args: Any, devices: int = 1) -> tuple[Any, StepCost]:
    """(the step compiled ahead of time for `args` (arrays or ShapeDtypeStructs), its per-device
    cost); `devices`: how many the step is laid over."""
    compiled = jitted.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per device
    mem = compiled.memory_analysis()
    return compiled, StepCost(
        flops=float((cost or {}).get("flops", 0.0)),
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        devices=devices,
    )


def model_flops_per_example(config: ml_collections.ConfigDict) -> tuple[float, float]:
    """(model FLOPs, Token Graying FLOPs) of one training example of `config`'s trainer
    (its record's `flops_per_example`: models/flops.py, docs/method/runs.md §25), from the config alone."""
    from skipless_jax import trainers

    return trainers.of_config(config).flops_per_example(config)


def throughput_unit(config: ml_collections.ConfigDict) -> tuple[str, int]:
    """(the name of what an example feeds, how many per example): the trainer record's
    `example_unit`, e.g. ('tokens', config.model.seq_len) for a language model (docs/method/lm.md §3),
    ('img', 1) for images."""
    from skipless_jax import trainers

    return trainers.of_config(config).example_unit(config)


class Meter:
    """The perf/* fields of a train record over the timing window (docs/method/runs.md §25).

    The window starts after the first `WARMUP_STEPS` steps of this process's loop
    (`step_done`); the time spent inside `excluded()` (evaluations, saves, the profiler's
    start/stop) is subtracted. Over the window's steps since the last record, s steps per
    training second: perf/img_per_sec = s × images per step (the global batch, each image once);
    perf/img_per_sec_per_device = that / devices; perf/tflops_per_device = model FLOPs per
    example (`model_flops_per_example`) × images/s / devices / 1e12; perf/mfu = that / the peak
    (absent where unknown); perf/xla_tflops_per_device = the compiled step's per-device FLOPs × s
    / 1e12; the lm trainer's records say perf/tokens_per_sec (sequences/s × seq_len) and
    perf/tokens_per_sec_per_device instead of the two image rates (`throughput_unit`); with
    Token Graying, perf/tg_tflops_per_device = its FLOPs per example × images/s /
    devices / 1e12 (not in the model FLOPs). perf/core_hours = `core_hours` (before a resume) +
    devices × this loop's training hours (wall-clock less the excluded time);
    perf/core_hours_total = `core_hours_total` + devices × this loop's wall-clock hours.
    """

    WARMUP_STEPS = 2

    def __init__(self, cost: StepCost, images_per_step: int, config: ml_collections.ConfigDict, first_step: int,
                 core_hours: float = 0.0, core_hours_total: float = 0.0, flops_per_example: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """`first_step`: the loop's first step is first_step + 1, from now on; `core_hours`,
        `core_hours_total`: the run's counts up to first_step (`workdir.resumed_core_hours`), which
        this one continues; `flops_per_example`: default `model_flops_per_example(config)`."""
        self.devices, self.core_hours, self.core_hours_total = cost.devices, core_hours, core_hours_total
        self.xla_flops, self.images = cost.flops, images_per_step
        tg = 0.0
        if flops_per_example is None:
            flops_per_example, tg = model_flops_per_example(config)
            logging.info("Model FLOPs per training example: %.4g (3 × forward; Token Graying %.4g more, not counted); "
                         "XLA's count of the compiled step: %.4g per device.", flops_per_example, tg, cost.flops)
        self.flops_per_example, self.tg_flops_per_example = float(flops_per_example), tg
        self.peak = peak_tflops(config, jax.devices()[0])
        self.unit, self.per_example = throughput_unit(config)
        self.clock = clock
        self.begin = clock()
        self.excluded_seconds, self._depth = 0.0, 0
        self.window_step = first_step + self.WARMUP_STEPS
        self.last: tuple[int, float, float] | None = None  # (step, time, excluded seconds) where the period began

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time inside is not training time (nested uses count once)."""
        self._depth += 1
        start = self.clock()
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.excluded_seconds += self.clock() - start

    def step_done(self, step: int, state: Any = None) -> None:
        """After each step: the window begins when step `first_step + WARMUP_STEPS` has finished
        on the devices (`state` is waited for then, once)."""
        if step == self.window_step and self.last is None:
            if state is not None:
                jax.block_until_ready(state)
            self.last = (step, self.clock(), self.excluded_seconds)

    def fields(self, step: int, now: float | None = None) -> dict[str, float]:
        """The record's perf/* fields (core hours only before the window has a step)."""
        now = self.clock() if now is None else now
        wall = now - self.begin
        out = {
            "perf/core_hours": self.core_hours + self.devices * (wall - self.excluded_seconds) / 3600,
            "perf/core_hours_total": self.core_hours_total + self.devices * wall / 3600,
        }
        if self.last is None or step <= self.last[0]:
            return out
        last_step, last_time, last_excluded = self.last
        seconds = max((now - last_time) - (self.excluded_seconds - last_excluded), 1e-9)
        self.last = (step, now, self.excluded_seconds)
        steps_per_sec = (step - last_step) / seconds
        images_per_sec = steps_per_sec * self.images
        out.update({
            f"perf/{self.unit}_per_sec": images_per_sec * self.per_example,
            f"perf/{self.unit}_per_sec_per_device": images_per_sec * self.per_example / self.devices,
            "perf/tflops_per_device": self.flops_per_example * images_per_sec / self.devices / 1e12,
            "perf/xla_tflops_per_device": self.xla_flops * steps_per_sec / 1e12,
        })
        if self.tg_flops_per_example:
            out["perf/tg_tflops_per_device"] = self.tg_flops_per_example * images_per_sec / self.devices / 1e12
        if self.peak:
            out["perf/mfu"] = out["perf/tflops_per_device"] / self.peak
        return out


def compile_for(
    jitted: Any, state: Any, spec: Mapping[str, tuple[tuple[int, ...], Any]],
    batch_sharding: jax.sharding.NamedSharding, config: ml_collections.ConfigDict,
) -> tuple[Any, StepCost]:
    """(the train step compiled ahead of time, its cost), then the fit check: the batch's global
    shapes `spec` ({name: (shape, dtype)}, `inputs.train_batch_spec`) come from the config, so
    this runs before the input pipeline is created and no data is read."""
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding) for k, (shape, dtype) in spec.items()}
    compiled, cost = compile_step(jitted, state, batch, devices=batch_sharding.mesh.size)
    fit_check(cost, config)
    return compiled, cost

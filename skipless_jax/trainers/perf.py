"""How well a run uses its devices: the step compiled ahead of time with its XLA cost and
memory (the fit check, before the loop), the perf/* fields of the train records, and the
profiler trace of a few steps after warm-up.

    step, cost = compile_for(jax.jit(train_step, ...), state, inputs.train_batch_spec(config), sharding, config)
                                                  # compiled before any data; the fit check's one line
    meter = Meter(cost, images_per_step, config)  # Run.train_step_done adds meter.fields(step)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import ml_collections
from absl import logging
from etils import epath

DEFAULT_PROFILE_STEPS = 3

# Peak dense bf16 TFLOP/s per device (a TPU chip, or one GPU), by `device_kind` substring;
# `config.peak_tflops` overrides it. Absent kinds (CPUs, others): no perf/mfu.
PEAK_TFLOPS = {
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v5": 459.0,  # v5p reports "TPU v5"
    "TPU v6 lite": 918.0,  # v6e (Trillium)
    "TPU v6e": 918.0,
    "A100": 312.0,
    "H100": 989.0,
    "H200": 989.0,
}


class DoesNotFit(ValueError):
    """The compiled train step needs more memory than a device has (one line: bytes and knobs)."""


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


def memory_limit(device: jax.Device) -> int | None:
    """The bytes the device says it can hold (`memory_stats()['bytes_limit']`), None where unknown (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory stats
        return None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps them >= 1 (GiB at most)."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{int(n)} B"


def fit_check(cost: StepCost, config: ml_collections.ConfigDict, limit: int | None = None) -> str:
    """Logs the step's per-device bytes and FLOPs in one line and returns it; a one-line
    DoesNotFit (a ValueError) if the devices report a memory `limit` (default: the first local device's) that
    the step exceeds, naming the knobs that shrink it."""
    limit = memory_limit(jax.local_devices()[0]) if limit is None else limit
    line = (
        f"Train step per device: arguments {_gib(cost.argument_bytes)}, outputs {_gib(cost.output_bytes)} "
        f"({_gib(cost.alias_bytes)} donated), temporaries {_gib(cost.temp_bytes)}, "
        f"{cost.flops / 1e12:.4g} TFLOP; device memory limit {_gib(limit) if limit else 'unknown'}"
    )
    logging.info("%s", line)
    if limit is not None and cost.bytes_needed > limit:
        raise DoesNotFit(
            f"the train step needs {_gib(cost.bytes_needed)} per device ({cost.bytes_needed} bytes) but the device "
            f"has {_gib(limit)} ({limit} bytes); lower config.input.batch_size={config.input.batch_size}, raise "
            f"config.grad_accum_steps={config.get('grad_accum_steps', 1)}, set config.model.remat=True or shard "
            f"the state over more devices (config.mesh.fsdp={config.mesh.get('fsdp', 1)})"
        )
    return line


def peak_tflops(config: ml_collections.ConfigDict, device: jax.Device) -> float | None:
    """`config.peak_tflops`, else the PEAK_TFLOPS entry whose name is in the device kind (longest match)."""
    if config.get("peak_tflops"):
        return float(config.peak_tflops)
    kind = device.device_kind
    matches = [name for name in PEAK_TFLOPS if name.lower() in kind.lower()]
    return PEAK_TFLOPS[max(matches, key=len)] if matches else None


class Meter:
    """The perf/* fields of a train record, from the wall-clock between records.

    steps/s s over the period; perf/img_per_sec = s × images per step (the global batch, each
    image once); perf/img_per_sec_per_device = that / devices; perf/tflops_per_device = the
    compiled step's per-device FLOPs × s / 1e12; perf/mfu = that / the peak (absent where
    unknown); perf/core_hours = `core_hours` (what the run used before a resume) + devices ×
    the hours since this process's loop began.
    """

    def __init__(self, cost: StepCost, images_per_step: int, config: ml_collections.ConfigDict, first_step: int,
                 core_hours: float = 0.0):
        """`first_step`: the loop's first step is first_step + 1, from now on; `core_hours`: the
        run's count up to first_step (`run.resumed_core_hours`), which this one continues."""
        self.devices, self.core_hours = cost.devices, core_hours
        self.flops, self.images = cost.flops, images_per_step
        self.peak = peak_tflops(config, jax.devices()[0])
        self.start = self.last_time = time.perf_counter()
        self.last_step = first_step

    def fields(self, step: int, now: float | None = None) -> dict[str, float]:
        now = time.perf_counter() if now is None else now
        steps_per_sec = (step - self.last_step) / max(now - self.last_time, 1e-9)
        self.last_time, self.last_step = now, step
        out = {
            "perf/img_per_sec": steps_per_sec * self.images,
            "perf/img_per_sec_per_device": steps_per_sec * self.images / self.devices,
            "perf/tflops_per_device": self.flops * steps_per_sec / 1e12,
            "perf/core_hours": self.core_hours + self.devices * (now - self.start) / 3600,
        }
        if self.peak:
            out["perf/mfu"] = out["perf/tflops_per_device"] / self.peak
        return out


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
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, first_step: int, total_steps: int,
                 warmup: int = 2, settle: Callable[[], None] = lambda: None):
        steps = config.get("profile_steps", DEFAULT_PROFILE_STEPS)
        steps = DEFAULT_PROFILE_STEPS if steps is None else int(steps)
        self.start = first_step + warmup + 1
        self.stop = min(self.start + steps, total_steps + 1)
        self.enabled = (steps > 0 and jax.process_index() == 0 and self.start < self.stop
                        and not has_trace(workdir))
        self.workdir, self.settle, self.active = workdir, settle, False
        self.options = jax.profiler.ProfileOptions()
        self.options.python_tracer_level = 0
        self.options.enable_hlo_proto = bool(config.get("profile_hlo", False))

    def after_step(self, step: int, state: Any) -> None:
        """Called after each step: the trace begins after step start - 1 and ends after stop - 1."""
        if self.enabled and not self.active and step == self.start - 1:
            jax.block_until_ready(state)  # earlier steps' device work stays out of the trace
            self.settle()
            jax.profiler.start_trace(self.workdir, profiler_options=self.options)
            self.active = True
        elif self.active and step >= self.stop - 1:
            self.close(state)

    def close(self, state: Any = None) -> None:
        if self.active:
            if state is not None:
                jax.block_until_ready(state)  # the traced steps' device work ends inside the trace
            self.settle()
            jax.profiler.stop_trace()
            self.active = False
            logging.info("Profile of steps %d-%d in %s/plugins/profile/", self.start, self.stop - 1, self.workdir)


def has_trace(workdir: str) -> bool:
    """Whether `workdir` holds a profiler trace (a run folder under plugins/profile/)."""
    folder = epath.Path(workdir, "plugins", "profile")
    return folder.is_dir() and any(folder.iterdir())


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

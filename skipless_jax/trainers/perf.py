"""How well a run uses its devices: the step compiled ahead of time with its XLA cost and
memory (the fit check, before the loop), the perf/* fields of the train records, and the
profiler trace of a few steps after warm-up.

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
from etils import epath

DEFAULT_PROFILE_STEPS = 3

# Peak dense bf16 TFLOP/s per JAX device (a TPU chip, one TPU v3 TensorCore, one GPU), by the
# exact `device_kind` JAX reports; `config.peak_tflops` overrides it. MFU is always against this
# bf16 peak, float32 runs included (docs/method/runs.md §25). Another kind: no perf/mfu, one log line.
PEAK_TFLOPS = {
    # NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): BF16 Tensor Core 312 (624 sparse)
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    # NVIDIA H100 datasheet (nvidia-tensor-core-gpu-datasheet): BF16 1,979 (SXM) / 1,513 (PCIe) /
    # 1,671 (NVL) TFLOPS with sparsity; dense is half
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    # NVIDIA H800 SXM5 / H800 PCIe datasheets (the export H100s; same Tensor Cores and clocks):
    # BF16 1,979 / 1,513 TFLOPS with sparsity
    "NVIDIA H800": 989.0,
    "NVIDIA H800 PCIe": 756.0,
    # NVIDIA H200 datasheet: BF16 1,979 (SXM) / 1,671 (NVL) TFLOPS with sparsity
    "NVIDIA H200": 989.0,
    "NVIDIA H200 NVL": 835.0,
    # NVIDIA HGX B200 datasheet: FP16/BF16 4.5 PFLOPS per GPU with sparsity (36 per 8-GPU board)
    "NVIDIA B200": 2250.0,
    # NVIDIA L40S datasheet: BF16 Tensor Core 362.05 (733 sparse)
    "NVIDIA L40S": 362.0,
    # Google Cloud TPU documentation, one system-architecture page per version (TPU v3, v4, v5e,
    # v5p, v6e): "peak compute per chip (bf16)"
    "TPU v3": 61.5,  # 123 per v3 chip of 2 TensorCores; JAX's v3 device is one TensorCore
    "TPU v4": 275.0,  # one device = one chip (megacore)
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5": 459.0,  # v5p (JAX's kind for a v5p chip)
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,  # v6e (Trillium)
}


class DoesNotFit(ValueError):
    """The compiled train step needs more memory than a device has (one line: bytes and knobs)."""

    exit_status = 1  # cli.exit_status: the run does not fit, whatever the command line


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
    """`config.peak_tflops`, else the PEAK_TFLOPS entry of the device's exact kind; None (and one
    log line naming the kind and `--config.peak_tflops`) for a kind the table does not list."""
    if config.get("peak_tflops"):
        return float(config.peak_tflops)
    kind = device.device_kind
    if kind not in PEAK_TFLOPS:
        logging.info("No bf16 peak for device kind %r: no perf/mfu; pass --config.peak_tflops=<TFLOP/s per "
                     "device> to get it.", kind)
        return None
    return PEAK_TFLOPS[kind]


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
        `core_hours_total`: the run's counts up to first_step (`run.resumed_core_hours`), which
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

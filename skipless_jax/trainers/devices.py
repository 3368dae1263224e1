"""The devices' facts a run checks: each kind's peak bf16 TFLOP/s (for perf/mfu), a device's
memory limit, and the fit check of the compiled step against it.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
from absl import logging

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


class DoesNotFit(ValueError):
    """The compiled train step needs more memory than a device has (one line: bytes and knobs)."""

    exit_status = 1  # cli.exit_status: the run does not fit, whatever the command line


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


def fit_check(cost: Any, config: ml_collections.ConfigDict, limit: int | None = None) -> str:
    """Logs the per-device bytes and FLOPs of the step's `cost` (a `perf.StepCost`) in one line
    and returns it; a one-line DoesNotFit (a ValueError) if the devices report a memory `limit`
    (default: the first local device's) that the step exceeds, naming the knobs that shrink it."""
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


"""Multi-process start-up: `jax.distributed.initialize` when the run spans processes.

Sources, in order: explicit coordinator flags (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID), then the cluster environment that JAX detects itself (SLURM with more than one
task, Cloud TPU VM pod slices). A single machine with no such environment runs one process.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
from absl import logging


def _cluster_detected() -> bool:
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ
    tpu_pod = "TPU_WORKER_HOSTNAMES" in os.environ and "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return slurm or tpu_pod


def check_processes(coordinator_address: Optional[str], num_processes: Optional[int], process_id: Optional[int]) -> None:
    """One-line ValueError for a process count or id that cannot be what the user meant: more than
    one process with no coordinator to join (and no cluster that names one), or an id outside
    [0, num_processes). The values are the flags', else the JAX_* environment's."""
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num_processes={num_processes} (or JAX_NUM_PROCESSES) must be a positive integer")
    if process_id is not None and (process_id < 0 or (num_processes is not None and process_id >= num_processes)):
        allowed = f"[0, {num_processes}) for --num_processes={num_processes}" if num_processes is not None else "a non-negative integer"
        raise ValueError(f"--process_id={process_id} (or JAX_PROCESS_ID) is out of range; allowed: {allowed}")
    if coordinator_address is not None:
        if not coordinator_address.strip() or ":" not in coordinator_address:
            raise ValueError(f"--coordinator_address={coordinator_address!r} (or JAX_COORDINATOR_ADDRESS) must be HOST:PORT")
        return
    if _cluster_detected():
        return
    if (num_processes or 1) > 1 or process_id:
        what = f"--num_processes={num_processes}" if (num_processes or 1) > 1 else f"--process_id={process_id}"
        raise ValueError(
            f"{what} (or JAX_NUM_PROCESSES/JAX_PROCESS_ID) asks for a multi-process run, but there is no "
            "--coordinator_address=HOST:PORT (or JAX_COORDINATOR_ADDRESS) and no SLURM or Cloud TPU cluster to join"
        )


def initialize(
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    initialization_timeout: int = 300,
    heartbeat_timeout: Optional[int] = None,
) -> None:
    """Joins the multi-process job if there is one; call before any other JAX use."""
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    check_processes(coordinator_address, num_processes, process_id)
    if coordinator_address is None and not _cluster_detected():
        return
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        # Cross-process collectives on the CPU backend (tests, laptops) go through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout,
        # A dead peer is noticed after this many seconds and the run exits instead of hanging.
        heartbeat_timeout_seconds=heartbeat_timeout or int(os.environ.get("JAX_HEARTBEAT_TIMEOUT", "100")),
    )


def log_topology(mesh: jax.sharding.Mesh) -> None:
    """Every process logs who it is, its local devices and the mesh."""
    logging.info(
        "Process %d/%d, local devices %s, global devices %d, mesh %s",
        jax.process_index(),
        jax.process_count(),
        [d.id for d in jax.local_devices()],
        jax.device_count(),
        dict(mesh.shape),
    )

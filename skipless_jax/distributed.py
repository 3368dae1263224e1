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

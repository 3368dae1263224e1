"""Multi-process start-up: `jax.distributed.initialize` when the run spans processes.

Sources, in order: explicit coordinator flags (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID), then the cluster environment that JAX detects itself (SLURM with more than one
task, Cloud TPU VM pod slices). A single machine with no such environment runs one process.

CPU runs (tests, laptops) exchange data between processes through gloo. XLA creates a gloo
communicator lazily, the first time each device's thread reaches a collective of a new device
group, and gloo's rendezvous then waits for every peer device with gloo's built-in 30 s context
timeout (XLA never sets it; no JAX option, XLA flag or environment variable reaches it): a device
whose thread is more than 30 s behind its peers at that moment, e.g. busy with queued work on a
loaded machine, fails the run with "Gloo context initialization failed: DEADLINE_EXCEEDED:
GetKeyValue() timed out ... 30s". Processes that arrive late as a whole are not affected (an
earlier rendezvous waits for them), and collectives on communicators that exist wait
`--xla_cpu_collective_timeout_seconds` (30 min). So `warm_up_collectives(mesh)` (called by
`log_topology`) creates the communicators of every device group of the mesh at start-up, when
no device has work queued. A dead peer is still noticed by the heartbeat (`heartbeat_timeout`).
"""

from __future__ import annotations

import itertools
import os
import time
import uuid

import jax
import numpy as np
from absl import logging

WORKDIR_TOKEN = ".process_0_token"  # written by process 0 into the workdir, read by the others
# NFS and similar file systems may show a new file to other hosts a little late (attribute caches).
TOKEN_WAIT_S = 10.0


def _cluster_detected() -> bool:
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ
    tpu_pod = "TPU_WORKER_HOSTNAMES" in os.environ and "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return slurm or tpu_pod


def check_processes(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
    """One-line ValueError for a process count or id that cannot be what the user meant: more than
    one process with no coordinator to join (and no cluster that names one), or an id outside
    [0, num_processes). The values are the flags', else the JAX_* environment's."""
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num_processes={num_processes} (or JAX_NUM_PROCESSES) must be a positive integer")
    if process_id is not None and (process_id < 0 or (num_processes is not None and process_id >= num_processes)):
        allowed = (
            f"[0, {num_processes}) for --num_processes={num_processes}"
            if num_processes is not None
            else "a non-negative integer"
        )
        raise ValueError(f"--process_id={process_id} (or JAX_PROCESS_ID) is out of range; allowed: {allowed}")
    if coordinator_address is not None:
        if not coordinator_address.strip() or ":" not in coordinator_address:
            raise ValueError(
                f"--coordinator_address={coordinator_address!r} (or JAX_COORDINATOR_ADDRESS) must be HOST:PORT"
            )
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
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout: int | None = None,
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
    """Every process logs who it is, its local devices and the mesh; then, in a multi-process
    CPU run, `warm_up_collectives(mesh)` (every process calls this at the same point)."""
    logging.info(
        "Process %d/%d, local devices %s, global devices %d, mesh %s",
        jax.process_index(),
        jax.process_count(),
        [d.id for d in jax.local_devices()],
        jax.device_count(),
        dict(mesh.shape),
    )
    warm_up_collectives(mesh)


def warm_up_collectives(mesh: jax.sharding.Mesh) -> None:
    """Creates the gloo communicators of every device group of `mesh` now (see the module
    docstring): one all-reduce over each non-empty set of mesh axes, so that later collectives
    of any of these groups, whenever their devices reach them, find their communicator made.

    Multi-process CPU runs only (elsewhere a no-op); every process calls it at the same point.
    Cost: 2^(mesh axes) - 1 tiny programs, once.
    """
    if jax.process_count() == 1 or mesh.devices.flat[0].platform != "cpu":
        return
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    names = [n for n in mesh.axis_names if mesh.shape[n] > 1]
    every = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    ones = jax.make_array_from_callback(
        (mesh.devices.size,), every, lambda index: np.ones(len(range(mesh.devices.size)[index[0]]), np.int32)
    )
    for k in range(1, len(names) + 1):
        for axes in itertools.combinations(names, k):
            summed = jax.shard_map(
                lambda x, axes=axes: jax.lax.psum(x, axes),
                mesh=mesh,
                in_specs=P(tuple(mesh.axis_names)),
                out_specs=P(tuple(mesh.axis_names)),
            )(ones)
            expected = int(np.prod([mesh.shape[a] for a in axes]))
            got = {int(np.asarray(shard.data)[0]) for shard in summed.addressable_shards}
            if got != {expected}:
                raise RuntimeError(f"collective warm-up over mesh axes {axes} summed {got}, expected {expected}")
    logging.info("Cross-process collectives ready on every device group of mesh %s.", dict(mesh.shape))


def check_shared_workdir(workdir: str) -> None:
    """In a multi-process run, every process must see the same `workdir` (else one finds a
    checkpoint the others do not, and they hang at the first collective that differs): process 0
    writes a token unique to this attempt into it and broadcasts the token (the broadcast is also
    the barrier: the file exists before anyone looks), the others read it back, and every process
    learns who could not. A one-line ValueError in every process, naming the workdir and the
    processes that do not see it. Before anything else compiles; a no-op with one process."""
    if jax.process_count() == 1:
        return
    from etils import epath
    from jax.experimental import multihost_utils

    path = epath.Path(workdir, WORKDIR_TOKEN)
    token = np.frombuffer(uuid.uuid4().bytes, np.uint8)
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(token.tobytes())
    token = np.asarray(multihost_utils.broadcast_one_to_all(token)).astype(np.uint8).tobytes()
    deadline = time.monotonic() + TOKEN_WAIT_S
    while not (seen := path.exists() and path.read_bytes() == token) and time.monotonic() < deadline:
        time.sleep(0.5)
    seen_by = np.asarray(multihost_utils.process_allgather(np.array(seen)))
    if jax.process_index() == 0:
        path.unlink(missing_ok=True)
    blind = [int(i) for i in np.flatnonzero(~seen_by)]
    if blind:
        raise ValueError(
            f"--workdir={workdir} is not shared by the processes: process(es) {blind} of {jax.process_count()} "
            f"(this is process {jax.process_index()}) do not see the token process 0 wrote to {path}; give every "
            "process the same directory on a file system they all mount"
        )

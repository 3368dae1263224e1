"""The device end of the input pipeline: process-local host batches become global arrays split
over the mesh's data axes, a few steps ahead of the train step (docs/method/recipes.md §14)."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping

import jax
import ml_collections
import numpy as np


def global_batch(batch: Mapping[str, np.ndarray], batch_sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
    """Process-local host arrays -> global arrays split over the data axes (leading dim)."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding, x), dict(batch))


def device_batches(
    local: Iterator[Mapping[str, np.ndarray]], batch_sharding: jax.sharding.NamedSharding, ahead: int
) -> Iterator[dict[str, jax.Array]]:
    """Global device batches from process-local host batches, with `ahead` more already copied
    (the copies are asynchronous, so step s+1's transfer overlaps step s). The loop's one
    explicit host→device copy; at most `ahead + 1` batches live on the devices."""
    queue: collections.deque = collections.deque()
    try:
        for batch in local:
            queue.append(global_batch(batch, batch_sharding))
            if len(queue) > ahead:
                yield queue.popleft()
    finally:  # closed by the trainer's loop: stops the pipeline's worker processes
        close = getattr(local, "close", None)
        if close is not None:
            close()


def device_prefetch(config: ml_collections.ConfigDict) -> int:
    """`config.input.device_prefetch` (default 2): batches copied to the devices ahead of the step."""
    ahead = config.input.get("device_prefetch")
    return 2 if ahead is None else int(ahead)


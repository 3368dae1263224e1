"""What every trainer shares: the single-model train state (`TrainState`), and plain functions:
the mesh, step counts, the train state's shardings and abstract shapes, the train batches on
the devices. None of the functions changes its arguments. The rest of a trainer's shared
pieces each have their own home:

    skipless_jax/pretrained.py       restore precedence, saved-config check, init_from
    trainers/warm_start.py           the init_from loader, the classifier's renames
    skipless_jax/data/device_input   host batches -> global device batches, prefetched
    trainers/nonfinite.py            the non-finite guard (in the step) and its host side
    trainers/workdir.py              open_workdir: a finished run's final metrics, the resumed history
    trainers/signals.py              the preemption rule
    trainers/run.py                  Run (records, checkpoints, final metrics)
    trainers/loop.py                 the one training loop

A trainer (supervised.py, dino.py, ...) builds its state, step and evaluation on these pieces
and hands them to the loop:

    mesh, is_chief = setup(config, devices)
    total_steps, warmup_steps = train_steps(config, steps_per_epoch)
    rng, abstract, shardings = abstract_state(init_state, config, mesh)
    mngr, finished = open_workdir(config, workdir, total_steps, allow_config_change)
    state = pretrained.restore_or_init(config, workdir, mngr, init_state, rng, abstract, shardings, ...)
    train_step, cost = perf.compile_for(jax.jit(step), state, batch_spec, ...)
    return loop.train(config, workdir, mesh, mngr, state, train_step, cost, total_steps=total_steps,
                      guarded=nonfinite.guarded_parts(abstract), train_iterator=..., results_at=...,
                      eval_every=...)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_collections
from absl import logging
from flax import struct

from skipless_jax import distributed, sharding
from skipless_jax.data import device_input
from skipless_jax.trainers.nonfinite import Nonfinite


@struct.dataclass(kw_only=True)
class TrainState:
    """The train state of a single-model trainer (supervised, MAE, LM); DINO has its own
    (dino.DinoState). Each field is one entry of its checkpoint, under the same name; a None
    field is not saved (`checkpoint.save`). The fields are in alphabetical order, as the
    entries of a checkpoint, so the state's leaves flatten in the checkpoint's order."""

    batch_stats: Any = None  # the model's running statistics; None for a model without them
    ema: Any = None  # the model EMA {'params'[, 'batch_stats']} (trainers/model_ema.py); None: off
    nonfinite: Nonfinite  # the non-finite guard's counters (trainers/nonfinite.py)
    opt_state: Any
    params: Any
    rng: jax.Array  # the train stream's key, folded with the step
    step: jax.Array  # int32: the optimizer updates made


def setup(
    config: ml_collections.ConfigDict,
    devices: Sequence[jax.Device] | None = None,
    check: Callable[[ml_collections.ConfigDict, int | None], None] | None = None,
) -> jax.sharding.Mesh:
    """A trainer's opening: `check(config, number of devices or None)` (the trainer's one-line
    errors, before anything compiles), then the mesh over `devices` (default all); only process 0
    logs beyond warnings."""
    if check is not None:
        check(config, len(devices) if devices is not None else None)
    mesh = sharding.make_mesh(config.mesh, devices)
    distributed.log_topology(mesh)
    if jax.process_index() != 0:
        logging.set_verbosity(logging.WARNING)
    return mesh


def train_steps(config: ml_collections.ConfigDict, steps_per_epoch: float) -> tuple[int, int]:
    """(the run's total steps, its warm-up steps): `steps_of` 'total' and 'warmup', for the
    optimizer's schedule (`build_optimizer(config, total, warmup)`); the config stays as it is."""
    return steps_of(config, "total", steps_per_epoch), steps_of(config, "warmup", steps_per_epoch)


def device_batches(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, train_iterator: Callable[..., Any], first_step: int
) -> Iterator[dict[str, jax.Array]]:
    """The global train batches from step `first_step + 1` on, on the devices: this process's share
    from `train_iterator(config, first_step, process, processes, on_device=True, shards=S)` (inputs'
    or multicrop's; S the mesh's data shards), laid out over the mesh's data axes and prefetched
    (`config.input.device_prefetch`)."""
    local = train_iterator(config, first_step, jax.process_index(), jax.process_count(), on_device=True,
                           shards=sharding.num_data_shards(mesh))
    return device_input.device_batches(local, sharding.batch_sharding(mesh), device_input.device_prefetch(config))


def steps_of(config: ml_collections.ConfigDict, name: str, steps_per_epoch: float) -> int:
    """`config.<name>_steps`, else `config.<name>_epochs` × steps per epoch (rounded up);
    name 'warmup' reads `config.schedule`."""
    holder = config.schedule if name == "warmup" else config
    steps = holder.get(f"{name}_steps")
    if steps is not None:
        return int(steps)
    return int(math.ceil((holder.get(f"{name}_epochs") or 0) * steps_per_epoch))


def state_shardings(abstract_state: Any, mesh: jax.sharding.Mesh, config: ml_collections.ConfigDict) -> Any:
    """NamedShardings of the whole train state from its abstract shapes and `config.sharding_rules`.

    Leaves under `sharding.MIN_SHARD_SIZE` elements and PRNG keys stay replicated; the
    optimizer state and the model EMA (`ema`) are ZeRO-sharded over all the data axes
    (`sharding.zero_spec`), so that on a data-parallel mesh every device keeps and updates 1/N
    of them. An explicit rule that does not fit a leaf is a one-line ValueError here, before
    anything compiles.
    """
    return sharding.tree_shardings(
        abstract_state, mesh, config.sharding_rules, min_size=sharding.MIN_SHARD_SIZE, zero=("opt_state", "ema")
    )


def abstract_state(
    init_state: Callable[[jax.Array], Any], config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh
) -> tuple[jax.Array, Any, Any]:
    """(rng of `config.seed`, the state's abstract shapes, its shardings): nothing is allocated yet."""
    rng = jax.random.PRNGKey(config.seed)
    abstract = jax.eval_shape(init_state, rng)
    return rng, abstract, state_shardings(abstract, mesh, config)


def present(state: Any, name: str) -> bool:
    """Whether the train state has field `name` set (not None): a state of any trainer."""
    return getattr(state, name, None) is not None


def entries(state: Any, key: str | tuple[str, ...]) -> Any:
    """What a trainer's `evaluation()` names in the state (a train state, or a checkpoint's as
    `checkpoint.load_raw` reads it, a mapping): one entry (`state.<key>`) or several ({name:
    state.<name>}, e.g. ('params', 'batch_stats') as flax variables)."""
    get = state.__getitem__ if isinstance(state, Mapping) else lambda name: getattr(state, name)
    return get(key) if isinstance(key, str) else {k: get(k) for k in key}


def microbatches(x: jax.Array, k: int) -> jax.Array:
    """(B, ...) -> (k, B/k, ...) strided micro-batches: micro-batch j holds examples j, j + k,
    j + 2k, ..., so each keeps the batch sharding and every micro-step runs on all the devices
    (gradient accumulation, docs/design.md)."""
    strided = x.reshape(-1, k, *x.shape[1:]).swapaxes(0, 1)
    return sharding.constrain_batch(strided, dim=1)


def leaf_names(tree: Any) -> list[str]:
    return [sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def num_parameters(tree: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


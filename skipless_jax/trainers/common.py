"""What every trainer shares, as plain functions (and one small record of a run's bookkeeping).

A trainer (supervised.py, dino.py, ...) is a flat loop on these pieces:

    mesh, is_chief = setup(config, devices)
    abstract = jax.eval_shape(init_state, rng); shardings = state_shardings(abstract, mesh, config)
    state, first_step = restore_or_init(config, workdir, mngr, init_state, rng, abstract, shardings, ...)
    run = Run(config, workdir, mngr, total_steps, first_step, leaf_names)
    for step in ...:  state, metrics = train_step(state, global_batch(next(data), batch_sharding))
                      run.log(step, metrics); ... run.save(step, state); run.stop_requested(step)
    run.finish(step)

Rules that live here and nowhere else: the restore precedence (workdir > `config.resume` >
`config.init_from`), the comparison of a rerun's config with the one saved in the checkpoint,
the non-finite guard (loss, gradients, new parameters and optimizer state), the one
preemption/SIGTERM rule, first/last evaluation, and final metrics (written only by a run that
reached its last step; a finished run re-run reports them and changes nothing).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import metric_writers, periodic_actions
from etils import epath

from skipless_jax import checkpoint, distributed, sharding

# A run stopped by SIGTERM or a preemption notice saved its state and is not finished:
# the entry point exits with this status (EX_TEMPFAIL) so schedulers and retry loops rerun it.
EXIT_PREEMPTED = 75
FINAL_METRICS = "final_metrics.json"

# Config fields that may differ between a run and its resumption: they change how a run is
# executed, logged or evaluated, not what it trains. Everything else must match the saved config.
RUNTIME_FIELDS = (
    "mesh", "sharding_rules", "log_every_steps", "eval_every_steps", "checkpoint_every_steps", "keep_checkpoints",
    "analysis", "evals", "eval", "eval_at_start", "input.num_workers", "input.device_prefetch", "input.cache_eval",
    "input.eval_batch_size",
    "dataset.data_dir",
    "resume", "init_from", "init_from_key", "model.remat", "model.attention_impl",
)


class Preempted(Exception):
    """Raised by a trainer after it saved the step it stopped at on a preemption/SIGTERM."""

    def __init__(self, step: int):
        super().__init__(f"preempted at step {step}; checkpoint saved, rerun the same command to resume")
        self.step = step


class NonFiniteError(FloatingPointError):
    """A non-finite loss, gradient, parameter or optimizer state stopped the run."""


class ConfigChangedError(checkpoint.IncompatibleCheckpointError):
    """The workdir's checkpoint was written by a config that trains something else."""


# ----------------------------------------------------------------------------------------
# Mesh, steps, shardings, batches.


def setup(
    config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None
) -> tuple[jax.sharding.Mesh, bool]:
    """(mesh over `devices` (default all), is_chief); only process 0 logs beyond warnings."""
    mesh = sharding.make_mesh(config.mesh, devices)
    distributed.log_topology(mesh)
    is_chief = jax.process_index() == 0
    if not is_chief:
        logging.set_verbosity(logging.WARNING)
    return mesh, is_chief


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
    optimizer state is ZeRO-sharded over all the data axes (`sharding.zero_spec`), so that on a
    data-parallel mesh every device keeps and updates 1/N of it. An explicit rule that does not
    fit a leaf is a one-line ValueError here, before anything compiles.
    """
    return sharding.tree_shardings(
        abstract_state, mesh, config.sharding_rules, min_size=sharding.MIN_SHARD_SIZE, zero=("opt_state",)
    )


def abstract_state(
    init_state: Callable[[jax.Array], Any], config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh
) -> tuple[jax.Array, Any, Any]:
    """(rng of `config.seed`, the state's abstract shapes, its shardings): nothing is allocated yet."""
    rng = jax.random.PRNGKey(config.seed)
    abstract = jax.eval_shape(init_state, rng)
    return rng, abstract, state_shardings(abstract, mesh, config)


def entries(state: Mapping[str, Any], key: str | tuple[str, ...]) -> Any:
    """What a trainer's `evaluation()` names in the state: one entry (`state[key]`) or several
    ({name: state[name]}, e.g. ('params', 'batch_stats') as flax variables)."""
    return state[key] if isinstance(key, str) else {k: state[k] for k in key}


def leaf_names(tree: Any) -> list[str]:
    return [sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def num_parameters(tree: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


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


# ----------------------------------------------------------------------------------------
# The non-finite guard (inside the jitted step) and its host side.


def init_nonfinite() -> dict[str, jax.Array]:
    """The state's non-finite bookkeeping: skipped updates, and the first one's step and leaf."""
    return {
        "count": jnp.zeros((), jnp.int32),
        "first_step": jnp.full((), -1, jnp.int32),
        "first_leaf": jnp.full((), -1, jnp.int32),
    }


def track_nonfinite(
    loss: jax.Array, parts: Mapping[str, Any], nonfinite: dict[str, jax.Array], step: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(ok, updated bookkeeping) for the update that makes `step` + 1 (numbered like checkpoints).

    `parts` are the trees an update must leave finite, e.g. {'gradient': grads, 'parameter':
    new_params, 'optimizer state': new_opt_state}: SOAP with a huge lr can turn finite gradients
    into infinite parameters. ok is false when the loss or any leaf is not finite; the first such
    update records its step and the index of its first bad leaf (-1: only the loss).
    """
    leaves = [x for tree in parts.values() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    leaf_ok = jnp.stack([jnp.isfinite(x).all() for x in leaves]) if leaves else jnp.ones((1,), bool)
    ok = jnp.isfinite(loss) & leaf_ok.all()
    # One predicate, computed once. Left to itself XLA fuses this cheap and-of-every-leaf into
    # each of the selects that consume it (`keep_if`: one per state leaf), so the step holds
    # O(leaves²) fusion operands; a ViT-Ti's step then compiled in 300 s instead of 14 s on CPU.
    # A conditional is never fused into its consumers (an optimization barrier is expanded
    # away before fusion on CPU and GPU).
    ok = jax.lax.cond(ok, lambda: jnp.array(True), lambda: jnp.array(False))
    first = (nonfinite["count"] == 0) & ~ok
    return ok, {
        "count": nonfinite["count"] + (~ok).astype(jnp.int32),
        "first_step": jnp.where(first, step + 1, nonfinite["first_step"]),
        "first_leaf": jnp.where(first, jnp.where(leaf_ok.all(), -1, jnp.argmin(leaf_ok)), nonfinite["first_leaf"]),
    }


def guarded_parts(state: Mapping[str, Any]) -> dict[str, Any]:
    """The trees `guarded_update` checks, in its order, for `Run`'s leaf names: the gradient (shaped
    as the parameters), the parameters, the optimizer state, and running statistics if kept."""
    parts = {"gradient": state["params"], "parameter": state["params"], "optimizer state": state["opt_state"]}
    if "batch_stats" in state:
        parts["running statistics"] = state["batch_stats"]
    return parts


def guarded_update(
    state: Mapping[str, Any], loss: jax.Array, grads: Any, tx: Any, schedule: Callable[[Any], Any],
    batch_stats: Any = None, **metrics: jax.Array,
) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """The tail of a single-model step on a {step, params, opt_state, rng, nonfinite[, batch_stats]}
    state: the optimizer update (and the step's new running statistics `batch_stats`, if the
    state keeps them), kept only if the loss, gradient, new parameters, optimizer state and
    statistics are all finite (else the state stays as it was; the host stops the run or counts
    the skipped step), and the standard metrics (loss, grad/param norms, lr, skipped steps) plus
    `metrics`."""
    import optax

    step, params = state["step"], state["params"]
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    parts = {"gradient": grads, "parameter": new_params, "optimizer state": opt_state}
    if "batch_stats" in state:
        parts["running statistics"] = batch_stats
    ok, nonfinite = track_nonfinite(loss, parts, state["nonfinite"], step)
    new_state = {
        "step": step + 1,
        "params": keep_if(ok, new_params, params),
        "opt_state": keep_if(ok, opt_state, state["opt_state"]),
        "rng": state["rng"],
        "nonfinite": nonfinite,
    }
    if "batch_stats" in state:
        new_state["batch_stats"] = keep_if(ok, batch_stats, state["batch_stats"])
    return new_state, {
        "loss": loss,
        **metrics,
        "grad_norm": optax.tree.norm(grads),
        "param_norm": optax.tree.norm(params),
        "lr": schedule(step),
        "nonfinite_steps": nonfinite["count"],
    }


def inexact_names(parts: Mapping[str, Any]) -> list[str]:
    """Names of the floating leaves `track_nonfinite` checks, in its order: "<part> <leaf path>"."""
    return [
        f"{part} {sharding.path_str(p)}"
        for part, tree in parts.items()
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    """new where ok, else old, leaf by leaf (a rejected update leaves the state as it was)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def nonfinite_error(
    nonfinite: Mapping[str, Any], names: Sequence[str], step: int, last_saved: int | None
) -> NonFiniteError | None:
    """The error to raise for fetched bookkeeping with skipped updates, else None."""
    if int(nonfinite["count"]) == 0:
        return None
    leaf = names[int(nonfinite["first_leaf"])] if int(nonfinite["first_leaf"]) >= 0 else "the loss"
    return NonFiniteError(
        f"Non-finite values at step {int(nonfinite['first_step'])} (first: {leaf}); "
        f"stopped at step {step}, last good checkpoint: {last_saved}"
    )


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.array(True)


# ----------------------------------------------------------------------------------------
# Restore precedence: workdir > config.resume > config.init_from (> scratch).


def _flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in config.items():
        if isinstance(v, Mapping):
            out.update(_flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Fields (dotted) whose values differ between two config dicts, runtime fields excepted."""
    a, b = _flat_config(saved), _flat_config(json.loads(json.dumps(dict(current), default=str)))
    runtime = lambda k: any(k == f or k.startswith(f + ".") for f in RUNTIME_FIELDS)
    return sorted(k for k in set(a) | set(b) if not runtime(k) and a.get(k) != b.get(k))


def check_saved_config(config: ml_collections.ConfigDict, workdir: str, allow_change: bool) -> bool:
    """A one-line ConfigChangedError when the workdir's newest checkpoint was written by a config
    that trains something else (a flipped skip switch, another optimizer, depth, ...); with
    `allow_change` a warning instead. Returns whether the config changed."""
    saved = checkpoint.saved_config(workdir)
    if saved is None:
        return False
    diffs = config_differences(saved, config.to_dict())
    if not diffs:
        return False
    flat_saved, flat_now = _flat_config(saved), _flat_config(json.loads(config.to_json()))
    shown = ", ".join(f"{k}: {flat_saved.get(k)!r} -> {flat_now.get(k)!r}" for k in diffs[:4])
    more = f" (+{len(diffs) - 4} more)" if len(diffs) > 4 else ""
    if allow_change:
        logging.warning("Resuming %s with a changed config (--allow_config_change): %s%s", workdir, shown, more)
        return True
    raise ConfigChangedError(
        f"the checkpoint in {workdir} was written with another config ({shown}{more}); "
        "use a new --workdir, or pass --allow_config_change to resume it with this config deliberately"
    )


Source = str | Callable[[tuple[int, ...]], np.ndarray] | None


def init_from(
    path: str, params: Any, shardings: Any, key: str = "params", rename: Callable[[str], Source] | None = None
) -> Any:
    """`_init_from` across the scanned and unrolled encoder layouts (models/vit.py): a source whose
    layout differs from the model's is read in its own layout and converted (`stack_blocks` /
    `unstack_blocks`), so a checkpoint of either layout initializes a model of either."""
    from skipless_jax.models import vit
    from skipless_jax.models.common import SCANNED_BLOCKS

    source_scanned = any(SCANNED_BLOCKS in name.split("/") for name in checkpoint.param_shapes(path, key))
    target_scanned = isinstance(params, Mapping) and SCANNED_BLOCKS in params
    if source_scanned == target_scanned:
        return _init_from(path, params, shardings, key, rename)
    view = vit.unstack_blocks(params) if target_scanned else vit.stack_blocks(params)
    mesh = jax.tree.leaves(shardings)[0].mesh
    whole = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), view)
    loaded = _init_from(path, jax.device_put(view, whole), whole, key, rename)
    logging.info("init_from: converted the %s checkpoint to this model's %s layout",
                 *(("unrolled", "scanned") if target_scanned else ("scanned", "unrolled")))
    converted = vit.stack_blocks(loaded) if target_scanned else vit.unstack_blocks(loaded)
    return jax.device_put(converted, shardings)


def _init_from(
    path: str, params: Any, shardings: Any, key: str = "params", rename: Callable[[str], Source] | None = None
) -> Any:
    """`params` with the leaves found in checkpoint `path` (its `state[key]`) loaded over them.

    `rename(target_path)` maps a parameter of this model to its source: a path in the checkpoint
    (e.g. 'block_0/...' <- 'backbone/block_0/...' for a DINO teacher), None (keep the fresh
    initialization, e.g. a new classifier head), or a function of the target shape returning the
    value (e.g. the fixed position table an MAE encoder did not store). Identity by default; every
    kept leaf is logged. A position table (`pos_embedding`) of another grid is resized
    (docs/method.md §9); any other shape mismatch is a one-line error.
    """
    rename = rename or (lambda name: name)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    source: dict[str, Any] = {}
    wanted: dict[str, str] = {}
    made: dict[str, np.ndarray] = {}
    available = checkpoint.param_shapes(path, key)
    for p, x in flat:
        target = sharding.path_str(p)
        src = rename(target)
        if src is None:
            continue
        if callable(src):
            made[target] = np.asarray(src(tuple(x.shape)), dtype=x.dtype)
            continue
        wanted[target] = src
        shape = tuple(available.get(src, x.shape))
        node = source
        *parents, leaf = src.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        leaf_sharding = _leaf_at(shardings, p)
        if shape != tuple(x.shape):  # restored whole, resized below
            leaf_sharding = jax.sharding.NamedSharding(leaf_sharding.mesh, jax.sharding.PartitionSpec())
        node[leaf] = jax.ShapeDtypeStruct(shape, x.dtype, sharding=leaf_sharding)
    missing = sorted(s for s in wanted.values() if s not in available)
    if missing:
        raise ValueError(
            f"config.init_from={path!r} has no {key}/{missing[0]} (+{len(missing) - 1} more); "
            f"its {key} are e.g. {sorted(available)[:3]}"
        )
    for target, src in wanted.items():
        have, want = tuple(available[src]), _leaf_shape(params, target)
        if have != want and not (target.endswith("pos_embedding") and posemb_extra(have, want) is not None):
            raise ValueError(
                f"config.init_from={path!r}: {key}/{src} has shape {have}, this model's {target} needs {want}"
            )
    _, loaded = checkpoint.restore_params(path, source, key=key)
    kept = [sharding.path_str(p) for p, _ in flat if sharding.path_str(p) not in wanted | made.keys()]
    if kept:
        logging.info("init_from: %d parameters keep their initialization: %s", len(kept), ", ".join(kept[:8]))

    def pick(p: tuple[Any, ...], x: Any) -> Any:
        target = sharding.path_str(p)
        if target in made:
            value = made[target]
            return jax.make_array_from_callback(value.shape, _leaf_at(shardings, p), lambda index: value[index])
        if target not in wanted:
            return x
        node = loaded
        for part in wanted[target].split("/"):
            node = node[part]
        if tuple(node.shape) != tuple(x.shape):  # a position table of another grid
            logging.info("init_from: %s resized from %s to %s", target, tuple(node.shape), tuple(x.shape))
            node = jax.device_put(resize_posemb_table(node, x.shape).astype(x.dtype), _leaf_at(shardings, p))
        return node

    return jax.tree_util.tree_map_with_path(pick, params)


def posemb_extra(have: tuple[int, ...], want: tuple[int, ...]) -> int | None:
    """The number e (0 or 1) of extra rows two (1, e + g², d) position tables share, or None."""
    if len(have) != 3 or len(want) != 3 or have[0] != 1 or want[0] != 1 or have[2] != want[2]:
        return None
    for extra in (0, 1):
        if all(n - extra > 0 and math.isqrt(n - extra) ** 2 == n - extra for n in (have[1], want[1])):
            return extra
    return None


def resize_posemb_table(table: Any, shape: tuple[int, ...]) -> jax.Array:
    """(1, e + g_s², d) -> (1, e + g_t², d): extra rows kept, the grid resized bicubically (§9)."""
    from skipless_jax.models.common import resize_posemb

    extra = posemb_extra(tuple(table.shape), tuple(shape))
    grid = math.isqrt(shape[1] - extra)
    table = jnp.asarray(table)
    return jnp.concatenate([table[:, :extra], resize_posemb(table[:, extra:], grid, grid)], axis=1)


def _leaf_at(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        tree = tree[getattr(k, "key", getattr(k, "idx", k))]
    return tree


def _leaf_shape(tree: Any, name: str) -> tuple[int, ...]:
    for part in name.split("/"):
        tree = tree[part]
    return tuple(tree.shape)


def restore_or_init(
    config: ml_collections.ConfigDict,
    workdir: str,
    mngr: Any,
    init_state: Callable[[jax.Array], Any],
    rng: jax.Array,
    abstract_state: Any,
    shardings: Any,
    *,
    load_init_from: Callable[[Any], Any] | None = None,
) -> Any:
    """The train state, by precedence: the workdir's newest good checkpoint > `config.resume` >
    a fresh init with `config.init_from`'s weights (`load_init_from(state) -> state`, the
    trainer's name mapping) > a fresh init. Created already sharded. Call `finished_run` first
    (it compares the config with the saved one)."""
    target = checkpoint.abstract(abstract_state, shardings)
    restored = checkpoint.restore_latest(mngr, target)
    if restored is not None:
        step, state, _ = restored
        logging.info("Resumed from %s at step %d.", mngr.directory, step)
        return state
    if config.get("resume"):
        step, state, _ = checkpoint.restore_from_path(config.resume, target)
        logging.info("Resumed from config.resume=%s at step %d.", config.resume, step)
        return state
    state = jax.jit(init_state, out_shardings=shardings)(rng)
    if config.get("init_from"):
        if load_init_from is None:
            raise ValueError(f"config.init_from={config.init_from!r} is not supported by the {config.trainer} trainer")
        state = load_init_from(state)
        logging.info("Initialized weights from config.init_from=%s.", config.init_from)
    return state


# ----------------------------------------------------------------------------------------
# Final metrics.


def read_final_metrics(workdir: str) -> dict[str, Any] | None:
    path = epath.Path(workdir, FINAL_METRICS)
    return json.loads(path.read_text()) if path.exists() else None


def open_workdir(
    config: ml_collections.ConfigDict, workdir: str, total_steps: int, allow_config_change: bool
) -> tuple[Any, dict[str, Any] | None]:
    """(checkpoint manager of `workdir`, the final metrics if the run already finished there, else None).

    The saved config is compared first (`check_saved_config`); a finished run's manager is closed.
    """
    mngr = checkpoint.manager(workdir, keep=config.get("keep_checkpoints", 3))
    finished = finished_run(config, workdir, mngr, total_steps, allow_config_change)
    if finished is not None:
        logging.info("%s already finished at step %d; its final metrics are unchanged.", workdir, total_steps)
        mngr.close()
    return mngr, finished


def finished_run(
    config: ml_collections.ConfigDict, workdir: str, mngr: Any, total_steps: int, allow_config_change: bool
) -> dict[str, Any] | None:
    """Before anything is restored: the saved config must match (`check_saved_config`); then the
    final metrics of a run that already reached `total_steps` in `workdir`, else None."""
    changed = check_saved_config(config, workdir, allow_config_change)
    final = read_final_metrics(workdir)
    if (
        changed
        or final is None
        or final.get("step") != total_steps
        or max(mngr.all_steps(), default=None) != total_steps
    ):
        return None
    return final


# ----------------------------------------------------------------------------------------
# Preemption: one rule for every trainer.


class SignalFlag:
    """Records SIGTERM so that the loop saves a checkpoint and stops at the next step."""

    def __init__(self):
        self.raised = False
        with contextlib.suppress(ValueError):  # not the main thread (e.g. a test runner thread)
            signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame):
        logging.warning("Received signal %d: will checkpoint and stop after this step.", signum)
        self.raised = True


def stop_rule(mngr: Any) -> Callable[[int], bool]:
    """step -> whether to save and stop now.

    One process: our SIGTERM flag (and orbax's preemption notice). Several: only
    jax.distributed's preemption service, which catches SIGTERM and makes
    `mngr.reached_preemption(step)` true at the same step in every process; a Python handler
    would replace it, and the signalled process would save while the others keep stepping (a hang).
    """
    flag = SignalFlag() if jax.process_count() == 1 else None
    return lambda step: bool(mngr.reached_preemption(step) or (flag is not None and flag.raised))


# ----------------------------------------------------------------------------------------
# The run's bookkeeping: logging, periodic work, history, checkpoints, final metrics.


def stack_metrics(metrics: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """Per-step metric dicts -> one dict of stacked arrays (one device_get for a log period)."""
    return {k: jnp.stack([m[k] for m in metrics]) for k in metrics[0]}


def flatten_dict(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1} (config hyperparameters for TensorBoard)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def every(step: int, period: int | None, total_steps: int) -> bool:
    """True on multiples of `period` (0/None: never) and on the last step."""
    return step == total_steps or bool(period and step % period == 0)


class Run:
    """One run's bookkeeping, shared by every trainer's loop (the loop itself stays in the trainer).

    Writes TensorBoard scalars and `history.jsonl` (one JSON line per logged record; a resumed
    run keeps the records up to its checkpoint), checks the non-finite counters before logging
    and saving, saves checkpoints (never a non-finite one), and writes `final_metrics.json` only
    when the run reaches its last step.
    """

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        workdir: str,
        mngr: Any,
        total_steps: int,
        first_step: int,
        guarded: Mapping[str, Any],
    ):
        """`guarded`: the abstract trees the step's non-finite guard checks, in its order."""
        self.config, self.workdir, self.mngr = config, workdir, mngr
        self.total_steps, self.step = total_steps, first_step
        self.guarded = inexact_names(guarded)
        self.is_chief = jax.process_index() == 0
        self.skip_nonfinite = bool(config.get("skip_nonfinite_steps", False))
        self.writer = (
            metric_writers.create_default_writer(workdir, asynchronous=True)
            if self.is_chief
            else metric_writers.MultiWriter([])
        )
        if first_step == 0:
            self.writer.write_hparams({k: str(v) for k, v in flatten_dict(config.to_dict()).items()})
        self.progress = periodic_actions.ReportProgress(
            num_train_steps=total_steps, writer=self.writer, every_steps=config.log_every_steps
        )
        self.should_stop = stop_rule(mngr)
        self.pending: list[dict[str, jax.Array]] = []
        self.last_saved = max(mngr.all_steps(), default=None)
        self.metrics: dict[str, float] = {}
        self._history_path = epath.Path(workdir, "history.jsonl")
        self._history: list[str] = []
        if self.is_chief and self._history_path.exists():
            self._history = [
                line for line in self._history_path.read_text().splitlines() if json.loads(line)["step"] <= first_step
            ]

    def record(self, step: int, values: Mapping[str, float], prefix: str) -> None:
        """Scalars `prefix/name` to TensorBoard, `prefix_name` to the final metrics and history."""
        self.writer.write_scalars(step, {f"{prefix}/{k}": v for k, v in values.items()})
        flat = {f"{prefix}_{k}": float(v) for k, v in values.items()}
        self.metrics.update(flat)
        if self.is_chief:
            self._history.append(json.dumps({"step": step, **flat}))
            self._history_path.write_text("\n".join(self._history) + "\n")

    def check_finite(self, state: Mapping[str, Any], step: int) -> None:
        error = nonfinite_error(jax.device_get(state["nonfinite"]), self.guarded, step, self.last_saved)
        if error is not None and not self.skip_nonfinite:
            raise error

    def train_step_done(self, step: int, metrics: dict[str, jax.Array], state: Mapping[str, Any]) -> None:
        """After each step: progress; every `log_every_steps` (and last) the means of the period."""
        self.step = step
        self.pending.append(metrics)
        self.progress(step)
        if every(step, self.config.log_every_steps, self.total_steps):
            self.check_finite(state, step)
            means = {k: float(np.mean(v)) for k, v in jax.device_get(stack_metrics(self.pending)).items()}
            means["nonfinite_steps"] = float(self.pending[-1]["nonfinite_steps"])
            self.pending = []
            self.record(step, means, "train")

    def evaluate(self, step: int, results: Iterable[tuple[str, str, float]], prefix: str = "") -> None:
        """Records `(evaluator prefix, metric, value)` triples (an evaluator run) at `step`."""
        by_prefix: dict[str, dict[str, float]] = {}
        for eval_prefix, name, value in results:
            by_prefix.setdefault(prefix + eval_prefix, {})[name] = value
        for p, values in by_prefix.items():
            self.record(step, values, p)
            logging.info("Step %d: %s", step, ", ".join(f"{p}_{k}={v:.4f}" for k, v in values.items()))

    def save(self, step: int, state: Any, force: bool = False) -> None:
        """Saves at `config.checkpoint_every_steps` multiples, the last step, or when `force`."""
        if not (force or every(step, self.config.get("checkpoint_every_steps"), self.total_steps)):
            return
        self.check_finite(state, step)
        if not bool(_all_finite(state)):  # belt and braces: never a non-finite checkpoint
            raise NonFiniteError(
                f"the state at step {step} is not finite; not saved (last good checkpoint: {self.last_saved})"
            )
        meta = {"step": step, "data_position": step * self.config.input.batch_size, "config": self.config.to_json()}
        checkpoint.save(self.mngr, step, state, meta)
        self.last_saved = step

    def end_of_step(self, step: int, state: Any, results: Iterable[tuple[str, str, float]]) -> None:
        """After the step's own logging: the evaluators due (`results`), the checkpoint, the preemption rule."""
        self.evaluate(step, results)
        self.save(step, state)
        self.stop_if_preempted(step, state)

    def stop_if_preempted(self, step: int, state: Any) -> None:
        """The preemption rule: on a signal, save this step and raise Preempted."""
        if self.should_stop(step):
            self.save(step, state, force=True)
            logging.warning("Stopping at step %d on a preemption/termination signal; checkpoint saved.", step)
            raise Preempted(step)

    def close(self) -> None:
        """Completes pending saves and metric writes (called whatever stopped the loop)."""
        try:
            self.mngr.wait_until_finished()
        finally:
            self.mngr.close()
            self.writer.flush()

    def finish(self) -> dict[str, Any]:
        """Final metrics of a run that reached its last step, written to `final_metrics.json`."""
        final = {**self.metrics, "step": self.step}
        if self.is_chief and self.step == self.total_steps:
            epath.Path(self.workdir, FINAL_METRICS).write_text(json.dumps(final, indent=2))
        return final

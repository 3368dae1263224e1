"""Loading what a run starts from, next to `checkpoint/`: the restore precedence (the workdir's
newest good checkpoint > `config.resume` > `config.init_from` > scratch), the comparison of a
rerun's config with the one saved in the checkpoint, and `init_from` with a parameter name map
and position-table resizing (docs/method/ssl.md §9)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from skipless_jax import checkpoint, models, sharding
from skipless_jax.models import roles
from skipless_jax.nested import flatten

# Config fields that may differ between a run and its resumption: they change how a run is
# executed, logged or evaluated, not what it trains. Everything else must match the saved config.
RUNTIME_FIELDS = (
    "mesh", "sharding_rules", "log_every_steps", "eval_every_steps", "checkpoint_every_steps", "keep_checkpoints",
    "analysis", "evals", "eval", "eval_at_start", "input.num_workers", "input.device_prefetch", "input.cache_eval",
    "input.eval_batch_size",
    "dataset.data_dir", "dataset.eval_windows",
    "resume", "init_from", "init_from_key", "model.remat", "model.attention_impl", "compilation_cache_dir",
    "profile_steps", "profile_hlo", "peak_tflops", "wandb", "model_ema.evals",
)


class ConfigChangedError(checkpoint.IncompatibleCheckpointError):
    """The workdir's checkpoint was written by a config that trains something else."""


def _flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted fields; tuples as lists, as a config reads back from its JSON."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in flatten(config, ".").items()}


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Fields (dotted) whose values differ between two config dicts, runtime fields excepted."""
    a, b = _flat_config(saved), _flat_config(json.loads(json.dumps(dict(current), default=str)))
    runtime = lambda k: any(k == f or k.startswith(f + ".") for f in RUNTIME_FIELDS)
    return sorted(k for k in set(a) | set(b) if not runtime(k) and a.get(k) != b.get(k))


def saved_or_given(saved: Mapping[str, Any] | None, config: ml_collections.ConfigDict | None,
                   workdir: str | None) -> ml_collections.ConfigDict:
    """What a tool reading `workdir` (analyze, evaluate) starts from: its `saved` config, else the
    given `config` (--config); with neither, the one-line ValueError naming the workdir."""
    if saved is not None:
        return ml_collections.ConfigDict(saved)
    if config is None:
        raise ValueError(f"--workdir={workdir!r} has no checkpoint with a saved config; pass --config")
    return config


def check_saved_config(config: ml_collections.ConfigDict, workdir: str, allow_change: bool,
                       derived: Mapping[str, Any] | None = None) -> bool:
    """A one-line ConfigChangedError when the workdir's newest checkpoint was written by a config
    that trains something else (a flipped skip switch, another optimizer, depth, ...); with
    `allow_change` a warning instead. Returns whether the config changed.

    `derived`: dotted fields the trainer computes from the config when the config leaves them
    unset (e.g. {'schedule.warmup_steps': 113} from warm-up epochs); a checkpoint written while
    trainers still stored them in the config holds them resolved, which is no change."""
    saved = checkpoint.saved_config(workdir)
    if saved is None:
        return False
    flat_saved, flat_now = _flat_config(saved), _flat_config(json.loads(config.to_json()))
    diffs = [k for k in config_differences(saved, config.to_dict())
             if not (k in (derived or {}) and flat_now.get(k) is None and flat_saved.get(k) == derived[k])]
    if not diffs:
        return False
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
    kept leaf is logged. A position table (a leaf whose role is `roles.POSITION_TABLE`) of another
    grid is resized (docs/method/ssl.md §9); any other shape mismatch is a one-line error.
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
        if have != want and not (posemb_extra(have, want) is not None
                                 and models.role_of(target) == roles.POSITION_TABLE):
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
    return resize_posemb(jnp.asarray(table), grid, grid, extra=extra)


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


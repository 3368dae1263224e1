r"""Checkpoint cost: save and restore time of a ViT-B/16 train state, and what an asynchronous
save costs the train steps that run while it is written.

    OPENBLAS_NUM_THREADS=1 python benchmarks/checkpoint.py --optimizers=adamw,soap \
        --output=benchmarks/results/checkpoint.json [--dir=/fast/disk] [--fsdp=8]

Save/restore: the trainer's state pytree (step, params, optimizer state, RNG, non-finite
counters) of `configs/vitb_skipless.py` with each optimizer (an optimizer missing from
`skipless_jax.optim.OPTIMIZERS` is reported as skipped), created sharded by the config's rules,
saved through `skipless_jax.checkpoint` (orbax, async). Reported per save: the time `save`
blocks the caller (device→host copy and bookkeeping), the time until the checkpoint is final
on disk, its size; per restore: the time to read it back onto the target shardings. Medians
of `--repeats`, after one untimed save that pays one-time set-up.

The state is initialized with `init=default`: the same shapes as the skipless init, whose 144
per-head SVDs in one jitted program deadlock XLA:CPU unless XLA_FLAGS has
--xla_cpu_enable_concurrency_optimized_scheduler=false.

Async cost: a small ViT (`--small_variant`) trains with the trainer's step; the median step
time with no save in flight is compared with the steps that run while its own state is saved
(plus the blocking part of `save`, charged to the step that called it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skipless_jax import checkpoint, models, sharding
from skipless_jax.models import vit
from skipless_jax.optim import OPTIMIZERS, build_optimizer
from skipless_jax.trainers import nonfinite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_CLASSES = 1000


def load_config(arg: str):
    """configs/vitb_skipless.py:<arg>, with the warm-up in steps (the trainer sets it from epochs)."""
    path = os.path.join(ROOT, "configs", "vitb_skipless.py")
    spec = importlib.util.spec_from_file_location("configs_vitb_skipless", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg)
    config.schedule.warmup_steps = 10
    return config


def make_state(config: Any, image_size: int, fsdp: int):
    """(model, tx, state, target, mesh): the trainer's state, created sharded, with dense (random)
    optimizer moments as after training; target = abstract state + shardings, for restoring."""
    config.mesh.fsdp = fsdp
    mesh = sharding.make_mesh(config.mesh)
    model = vit.build(config.model, NUM_CLASSES)
    tx, _ = build_optimizer(config, 1000)
    dummy = jnp.zeros((1, image_size, image_size, 3), jnp.float32)

    def init_state(rng: jax.Array) -> dict[str, Any]:
        init_rng, train_rng = jax.random.split(rng)
        params = models.init_variables(config.model, model, init_rng, dummy)["params"]
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
                "rng": train_rng, "nonfinite": nonfinite.init_nonfinite()}

    def trained_like(rng: jax.Array) -> dict[str, Any]:
        # Zero moments compress to nothing on disk; after training they are dense (and ≥ 0 for
        # second moments, hence abs).
        state = init_state(rng)
        leaves, treedef = jax.tree.flatten(state["opt_state"])
        keys = jax.random.split(jax.random.fold_in(rng, 1), len(leaves))
        leaves = [
            1e-3 * jnp.abs(jax.random.normal(k, x.shape, x.dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else x
            for k, x in zip(keys, leaves)
        ]
        return {**state, "opt_state": jax.tree.unflatten(treedef, leaves)}

    abstract = jax.eval_shape(trained_like, jax.random.PRNGKey(0))
    shardings = sharding.tree_shardings(abstract, mesh, config.sharding_rules)
    state = jax.jit(trained_like, out_shardings=shardings)(jax.random.PRNGKey(0))
    jax.block_until_ready(state)
    return model, tx, state, checkpoint.abstract(abstract, shardings), mesh


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def bench_save_restore(opt: str, image_size: int, fsdp: int, repeats: int, root: str) -> dict[str, Any]:
    # Default init: the same pytree as the skipless init, without 144 head SVDs in one program
    # (which stalls XLA:CPU's concurrency-optimized scheduler; see the module docstring).
    config = load_config(f"opt={opt},init=default")
    _, _, state, target, mesh = make_state(config, image_size, fsdp)
    workdir = tempfile.mkdtemp(prefix=f"ckpt_{opt}_", dir=root)
    mngr = checkpoint.manager(workdir, keep=2)
    meta = {"step": 0, "data_position": 0, "config": config.to_json()}
    checkpoint.save(mngr, 0, state, meta)  # one-time set-up (directories, tensorstore contexts)
    mngr.wait_until_finished()
    blocking, total, restore, size = [], [], [], 0
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        checkpoint.save(mngr, step, state, meta)
        blocking.append(time.perf_counter() - t0)
        mngr.wait_until_finished()
        total.append(time.perf_counter() - t0)
        size = dir_bytes(os.path.join(workdir, "checkpoints", str(step)))
        t0 = time.perf_counter()
        found = checkpoint.restore_latest(mngr, target)
        jax.block_until_ready(found[1])
        restore.append(time.perf_counter() - t0)
        assert found[0] == step
        del found
    mngr.close()
    shutil.rmtree(workdir, ignore_errors=True)
    state_bytes = tree_bytes(state)
    return dict(
        model="B/16", optimizer=opt, devices=jax.device_count(), mesh=dict(mesh.shape),
        num_params=sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"])),
        state_mb=state_bytes / 2**20, disk_mb=size / 2**20,
        save_blocking_s=statistics.median(blocking), save_total_s=statistics.median(total),
        restore_s=statistics.median(restore), save_mb_per_s=state_bytes / 2**20 / statistics.median(total),
        restore_mb_per_s=state_bytes / 2**20 / statistics.median(restore),
    )


def bench_async_cost(variant: str, image_size: int, batch: int, steps: int, saves: int, root: str) -> dict[str, Any]:
    """Median step time with and without an asynchronous save of the same state in flight."""
    config = load_config(f"opt=adamw,variant={variant},skip_sab=True,skip_ffn=True,init=default")
    config.model.dtype = "float32"
    model, tx, state, _, _ = make_state(config, image_size, 1)
    images = jax.random.normal(jax.random.PRNGKey(1), (batch, image_size, image_size, 3))
    labels = jax.nn.one_hot(jnp.arange(batch) % NUM_CLASSES, NUM_CLASSES)

    def step_fn(state, images, labels):  # the trainer's update, without the metric extras
        def loss_fn(params):
            logits, _ = model.apply({"params": params}, images, train=False)
            return optax.softmax_cross_entropy(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {**state, "step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss

    step = jax.jit(step_fn, donate_argnums=0)

    def timed(state):
        t0 = time.perf_counter()
        state, loss = step(state, images, labels)
        loss.block_until_ready()
        return state, time.perf_counter() - t0

    for _ in range(2):  # compile and warm up
        state, _ = timed(state)
    idle = []
    for _ in range(steps):
        state, dt = timed(state)
        idle.append(dt)
    workdir = tempfile.mkdtemp(prefix="ckpt_async_", dir=root)
    mngr = checkpoint.manager(workdir, keep=2)
    meta = {"step": 0, "data_position": 0, "config": config.to_json()}
    checkpoint.save(mngr, 0, state, meta)
    mngr.wait_until_finished()
    blocking, during, overlapped = [], [], []
    for k in range(1, saves + 1):
        t0 = time.perf_counter()
        checkpoint.save(mngr, k, state, meta)
        blocking.append(time.perf_counter() - t0)
        n = 0
        while mngr.is_saving_in_progress() or n == 0:  # at least the step right after the save call
            state, dt = timed(state)
            during.append(dt + (blocking[-1] if n == 0 else 0.0))
            n += 1
        overlapped.append(n)
        mngr.wait_until_finished()
    mngr.close()
    shutil.rmtree(workdir, ignore_errors=True)
    idle_s, during_s = statistics.median(idle), statistics.median(during)
    return dict(
        model=variant, image_size=image_size, batch=batch, state_mb=tree_bytes(state) / 2**20,
        step_idle_s=idle_s, step_during_save_s=during_s, mean_step_during_save_s=float(np.mean(during)),
        save_blocking_s=statistics.median(blocking), steps_overlapped=statistics.median(overlapped),
        slowdown=float(np.mean(during)) / idle_s - 1.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizers", default="adamw,soap")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--fsdp", type=int, default=1, help="size of the fsdp mesh axis (≤ devices)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small_variant", default="Ti/16")
    parser.add_argument("--small_image_size", type=int, default=224)
    parser.add_argument("--small_batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps with no save in flight")
    parser.add_argument("--saves", type=int, default=3, help="saves timed in the async-cost part")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--output", default="benchmarks/results/checkpoint.json")
    args = parser.parse_args()
    root = args.dir or tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)

    rows, skipped = [], []
    for opt in args.optimizers.split(","):
        if opt not in OPTIMIZERS:
            skipped.append(opt)
            print(f"skipped optimizer {opt!r}: not in skipless_jax.optim.OPTIMIZERS {sorted(OPTIMIZERS)}")
            continue
        rows.append(bench_save_restore(opt, args.image_size, args.fsdp, args.repeats, root))
    cost = bench_async_cost(args.small_variant, args.small_image_size, args.small_batch, args.steps, args.saves, root)

    print(f"devices: {jax.device_count()} × {jax.devices()[0].device_kind}; checkpoints in {root}")
    print(
        f"{'state':14} {'params':>11} {'state MB':>9} {'disk MB':>8} {'save blocks s':>13} {'save total s':>12} "
        f"{'restore s':>9} {'save MB/s':>9} {'restore MB/s':>12}"
    )
    for r in rows:
        print(
            f"{r['model'] + ' ' + r['optimizer']:14} {r['num_params']:>11,} {r['state_mb']:>9.0f} {r['disk_mb']:>8.0f} "
            f"{r['save_blocking_s']:>13.2f} {r['save_total_s']:>12.2f} {r['restore_s']:>9.2f} "
            f"{r['save_mb_per_s']:>9.0f} {r['restore_mb_per_s']:>12.0f}"
        )
    c = cost
    print(
        f"async save, {c['model']} (image {c['image_size']}, batch {c['batch']}, state {c['state_mb']:.0f} MB): "
        f"step {1e3 * c['step_idle_s']:.1f} ms idle, {1e3 * c['step_during_save_s']:.1f} ms median "
        f"({1e3 * c['mean_step_during_save_s']:.1f} ms mean) with a save in flight incl. the "
        f"{1e3 * c['save_blocking_s']:.1f} ms the save call blocks; {c['steps_overlapped']:.0f} step(s) "
        f"overlap a save; slowdown {100 * c['slowdown']:+.1f}%"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"save_restore": rows, "skipped": skipped, "async_cost": cost, "args": vars(args),
                   "device_kind": jax.devices()[0].device_kind}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

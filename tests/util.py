"""Small configs shared by the tests."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import ml_collections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`configs/<name>.py` through its get_config(arg), as the CLI loads it."""
    path = os.path.join(ROOT, "configs", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"configs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def one_device() -> list:
    """The first of the tests' 8 fake CPU devices, for a trainer run whose test checks what it
    computes, not how it is sharded (the runs of several devices are tests/test_scaling.py's,
    tests/test_sharding.py's and the tests that compare them with one device): a tiny run's
    programs compile and run in less time on one device than partitioned over 8."""
    import jax

    return jax.devices()[:1]


def tiny_config(arg: str | None = None, **overrides: Any) -> ml_collections.ConfigDict:
    """The quickstart shrunk to seconds: width 32, depth 1, 12 steps, no checkpoints between, no
    profiler trace.

    Standard ViT with AdamW unless `arg` says otherwise (later args win).
    """
    c = load_config("quickstart", "skip_sab=True,skip_ffn=True,init=default,opt=adamw," + (arg or ""))
    c.model.width, c.model.mlp_dim, c.model.num_heads = 32, 64, 2
    if not arg or "depth" not in arg:
        c.model.depth = 1
    c.total_epochs = None
    c.total_steps = 12
    c.schedule.warmup_epochs = None
    c.schedule.warmup_steps = 2
    c.input.batch_size = 32
    c.log_every_steps = 4
    c.checkpoint_every_steps = 0
    c.profile_steps = 0  # no profiler trace (about a second a run); the tests of the trace turn it on
    for key, value in overrides.items():
        holder = c
        *parents, field = key.split(".")
        for parent in parents:
            holder = holder[parent]
        holder[field] = value
    return c


# The smallest sizes of each non-ViT family (tests): images of 8 px and more (Swin: 8 or 32 px).
TINY_MODELS: dict[str, dict[str, Any]] = {
    "convmixer": dict(width=16, depth=1, kernel_size=3, patch_size=2),
    "swin": dict(width=8, depths=(2, 1), num_heads=(2, 2), window_size=2, patch_size=2),
    "cait": dict(width=16, depth=1, num_heads=2, mlp_dim=32, depth_token_only=1),
    "pvt_v2": dict(widths=(8, 16), depths=(1, 1), num_heads=(1, 2), sr_ratios=(2, 1), mlp_ratios=(2, 2),
                   patch_size=2),
}


def tiny_model(model_config: dict[str, Any], image_size: int) -> dict[str, Any]:
    """`model_config` with its family's smallest sizes (CaiT's patch: 2 on 8-px images, else 8)."""
    family = model_config.get("name") or "vit"
    sizes = dict(TINY_MODELS[family])
    if family == "cait":
        sizes["patch_size"] = 2 if image_size <= 8 else 8
    return {**dict(model_config), "variant": None, **sizes}


def read_scalars(workdir: str) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in a run's TensorBoard event files (clu's writer)."""
    import glob

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(glob.glob(os.path.join(str(workdir), "events.out.tfevents.*"))):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.HasField("tensor") and not value.tensor.string_val and not value.tensor.tensor_shape.dim:
                    scalars.setdefault(value.tag, {})[int(event.step)] = float(tensor_util.make_ndarray(value.tensor))
    return scalars


def init_params(model: Any, rngs: Any, *args: Any, **kwargs: Any) -> Any:
    """`model.init(rngs, *args, **kwargs)["params"]` as one compiled program: run eagerly, every
    parameter's initializer and every op compiles on its own (most of a small test's time)."""
    import jax

    return jax.jit(lambda r, *a: model.init(r, *a, **kwargs))(rngs, *args)["params"]


def single_and_fsdp_start(tx: Any, params: Any, grads: list, mesh: Any, rules: Any) -> tuple:
    """The optimizer tests' step (the gradient g + 0.3·params, then `tx`) run on one device over
    `grads`, and the sharded start of the same run: (step, (params, state) after `grads` on one
    device, (params, state) placed by `rules` over `mesh`, (their shardings))."""
    import jax
    import optax

    from skipless_jax import sharding

    def step(params, state, g):
        g = jax.tree.map(lambda gi, p: gi + 0.3 * p, g, params)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    p1, s1 = params, tx.init(params)
    single = jax.jit(step)
    for g in grads:
        p1, s1 = single(p1, s1, g)
    p_sh = sharding.tree_shardings(params, mesh, rules, prefix="params")
    s_sh = sharding.tree_shardings(jax.eval_shape(tx.init, params), mesh, rules, prefix="opt_state")
    p8 = jax.device_put(params, p_sh)
    s8 = jax.jit(tx.init, out_shardings=s_sh)(p8)
    return step, (p1, s1), (p8, s8), (p_sh, s_sh)

r"""Per-device FLOPs and memory of the trainers' own update steps on 1/2/4/8 fake CPU devices.

    OPENBLAS_NUM_THREADS=1 python benchmarks/scaling.py --output=benchmarks/results/scaling.json

Each step is the trainer's own (`supervised.make_train_step`, `dino.make_train_step`) on its
own state (built as the trainer builds it, shardings from `common.state_shardings`), jitted
with the trainer's donation and output shardings, lowered for abstract inputs and compiled;
nothing runs. XLA's per-device figures: `cost_analysis()["flops"]` and `memory_analysis()`
(argument and temporary bytes), and the per-device bytes of parameters + optimizer state
from the shardings. Steps: supervised AdamW, supervised SOAP, supervised eigenvalue-corrected
Shampoo (`shampoo_ec`), supervised AdamW with `grad_accum_steps=4`, DINO (AdamW), and the
Fashion-MNIST study's step (configs/fashion_vit.py
at its own sizes: ViT width 64, depth 8, 49 tokens, batch 128, AdamW; --width/--depth/--batch
do not apply to it); meshes: data-parallel (`{data: N}`) and FSDP (`{fsdp: N}`). The ideal
per-device FLOPs ratio against one device is 1/N; the Fashion-MNIST step's on 8 devices should
be at most 0.13:

    OPENBLAS_NUM_THREADS=1 python benchmarks/scaling.py --steps="fashion_mnist vit" --devices=1,8 \
        --meshes=data --output=/tmp/scaling_fashion.json

The functions `supervised_program` and `dino_program` are also what tests/test_scaling.py
compiles.
"""

from __future__ import annotations

import os

if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    ).strip()

import argparse
import dataclasses
import importlib.util
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from skipless_jax import config_blocks, models, sharding
from skipless_jax.data import device_images, device_input, inputs, sources
from skipless_jax.optim import build_optimizer
from skipless_jax.trainers import common, dino, model_ema, supervised

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Program:
    """A trainer's jitted step with its abstract (sharded) inputs and the means to run it."""

    step: Any  # jax.jit of the trainer's step (donating the state)
    mesh: jax.sharding.Mesh
    abstract_state: Any  # ShapeDtypeStructs with the trainer's shardings
    abstract_batch: dict[str, jax.ShapeDtypeStruct]
    init: Callable[[], Any]  # -> the initial state, created sharded
    shardings: Any

    def lower(self) -> Any:
        with jax.set_mesh(self.mesh):
            return self.step.lower(self.abstract_state, self.abstract_batch)

    def compile(self) -> Any:
        return self.lower().compile()

    def batch(self, host: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return device_input.global_batch(host, sharding.batch_sharding(self.mesh))

    def run(self, state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any]:
        with jax.set_mesh(self.mesh):
            return self.step(state, batch)


def load_config(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of configs/<name>.py."""
    spec = importlib.util.spec_from_file_location(f"configs_{name}", os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def supervised_config(opt: str = "adamw", width: int = 64, depth: int = 2, batch: int = 64,
                      accum: int = 1) -> ml_collections.ConfigDict:
    """The quickstart (standard ViT on 8×8 digits, 16 tokens) at `width`, `depth` and `batch`."""
    c = load_config("quickstart", f"skip_sab=True,skip_ffn=True,init=default,opt={opt}")
    c.model.update(dict(width=width, mlp_dim=2 * width, num_heads=max(width // 32, 1), depth=depth))
    c.total_epochs, c.total_steps = None, 100
    c.schedule.warmup_epochs, c.schedule.warmup_steps = None, 2
    c.input.batch_size = batch
    c.grad_accum_steps = accum
    return c


def convmixer_config(width: int = 128, depth: int = 1, batch: int = 256) -> ml_collections.ConfigDict:
    """`supervised_config`'s recipe with a ConvMixer (kernel 3, patch 2, running BatchNorm
    statistics in the state) of `width` and `depth` on the 8×8 digits."""
    c = supervised_config("adamw", batch=batch)
    c.model = load_config("families_digits", "family=convmixer").model
    c.model.update(dict(width=width, depth=depth, kernel_size=3, patch_size=2))
    return c


def vit_config(variant: str, image_size: int, batch: int, opt: str = "adamw", dtype: str = "float32",
               skips: bool = True, init: str = "default") -> ml_collections.ConfigDict:
    """The supervised recipe (configs/quickstart.py: AdamW lr 1e-3 or SOAP lr 3e-3, weight decay
    0.05, clipping 1.0) for a ViT variant, e.g. 'B/16' at 224 px, with `skips` or without."""
    c = load_config("quickstart", f"skip_sab={skips},skip_ffn={skips},init={init},opt={opt}")
    c.model.update(dict(variant=variant, width=None, depth=None, num_heads=None, mlp_dim=None, patch_size=None,
                        dtype=dtype))
    c.total_epochs, c.total_steps = None, 100
    c.schedule.warmup_epochs, c.schedule.warmup_steps = None, 2
    c.input.image_size, c.input.batch_size = image_size, batch
    return c


# A Tiny/Small model of each family; '@32': its own image size (ConvMixer-256/8 is the CIFAR model).
FAMILY_VARIANTS = "vit:Ti/16,convmixer:256/8@32,swin:T,cait:XXS24,pvt_v2:b0"


def family_config(spec: str, image_size: int, batch: int, opt: str = "adamw", dtype: str = "float32",
                  skips: bool = True, init: str = "default") -> ml_collections.ConfigDict:
    """`vit_config`'s recipe for 'family:variant[@image size]' (e.g. 'swin:T', 'convmixer:256/8@32';
    a bare variant is a ViT's)."""
    spec, _, size = spec.partition("@")
    image_size = int(size) if size else image_size
    family, _, variant = spec.rpartition(":")
    c = vit_config(variant if family in ("", "vit") else "Ti/16", image_size, batch, opt, dtype, skips, init)
    if family not in ("", "vit"):
        fields = dict(skip_sab=skips, skip_ffn=skips and family != "convmixer", init=init)
        c.model = config_blocks.family_model(family, fields, 0.0, variant=variant)
        c.model.dtype = dtype
    return c


def fashion_config() -> ml_collections.ConfigDict:
    """configs/fashion_vit.py's default (the standard ViT the study's Table 1 starts from) at its
    own sizes, 100 steps."""
    c = load_config("fashion_vit")
    c.total_epochs, c.total_steps = None, 100
    c.schedule.warmup_epochs, c.schedule.warmup_steps = None, 2
    return c


def dino_config(opt: str = "adamw", width: int = 64, depth: int = 2, batch: int = 64) -> ml_collections.ConfigDict:
    """configs/dino_digits.py (2 global 8×8 and 2 local 4×4 crops) at `width`, `depth` and `batch`."""
    c = load_config("dino_digits", f"opt={opt}")
    c.model.update(dict(width=width, mlp_dim=2 * width, num_heads=max(width // 32, 1), depth=depth))
    c.total_epochs, c.total_steps = None, 100
    c.schedule.warmup_epochs, c.schedule.warmup_steps = None, 2
    c.input.batch_size = batch
    c.evals = ml_collections.ConfigDict()
    return c


def _mesh_config(config: ml_collections.ConfigDict, axes: dict[str, int]) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(config.to_dict())
    config.mesh = ml_collections.ConfigDict({"data": axes.get("data", 1), "fsdp": axes.get("fsdp", 1)})
    return config


def _program(config, mesh, init_state, make_step, batch_shapes) -> Program:
    rng, abstract, shardings = common.abstract_state(init_state, config, mesh)
    step = jax.jit(make_step(), donate_argnums=0, out_shardings=(shardings, sharding.replicated(mesh)))
    batch_sharding = sharding.batch_sharding(mesh)
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )
    abstract_batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding)
                      for k, (shape, dtype) in batch_shapes.items()}
    return Program(step, mesh, abstract_state, abstract_batch,
                   lambda: jax.jit(init_state, out_shardings=shardings)(rng), shardings)


def supervised_program(config: ml_collections.ConfigDict, axes: dict[str, int],
                       devices: Sequence[jax.Device] | None = None, num_classes: int | None = None,
                       channels: int | None = None) -> Program:
    """The supervised trainer's step and state (as `supervised.train_and_evaluate` builds them).

    `num_classes`/`channels` replace the dataset's (e.g. 1000 classes of RGB images at
    `config.input.image_size` for the ViT benchmarks on random data)."""
    config = _mesh_config(config, axes)
    devices = list(devices if devices is not None else jax.devices())[: math.prod(axes.values())]
    mesh = sharding.make_mesh(config.mesh, devices)
    info = sources.dataset_info(config.dataset.name)
    info = dataclasses.replace(info, num_classes=num_classes or info.num_classes,
                               image_shape=(*info.image_shape[:-1], channels or info.image_shape[-1]))
    size = inputs.image_size(config)
    model = models.build(config.model, info.num_classes)
    tx, schedule = build_optimizer(config, config.total_steps)
    init_state = supervised.make_init_state(config.model, model, tx,
                                            jnp.zeros((1, size, size, info.image_shape[-1]), jnp.float32),
                                            ema=model_ema.enabled(config))
    b = config.input.batch_size
    # What the trainer's pipeline ships (inputs.train_iterator(on_device=True)): uint8 images,
    # one-hot labels, and the random-erasing boxes when the recipe erases.
    aug = config.input.get("aug")
    shapes = {"image": ((b, size, size, info.image_shape[-1]), jnp.uint8),
              "label": ((b, info.num_classes), jnp.float32)}
    if aug is not None and aug.get("reprob", 0) > 0:
        shapes["erase"] = ((b, 4), jnp.int32)
    return _program(config, mesh, init_state, lambda: supervised.make_train_step(model, tx, schedule, config), shapes)


def dino_program(config: ml_collections.ConfigDict, axes: dict[str, int],
                 devices: Sequence[jax.Device] | None = None) -> Program:
    """The DINO trainer's step and state (as `dino.train_and_evaluate` builds them)."""
    config = _mesh_config(config, axes)
    devices = list(devices if devices is not None else jax.devices())[: math.prod(axes.values())]
    mesh = sharding.make_mesh(config.mesh, devices)
    info = sources.dataset_info(config.dataset.name)
    sched = dino.schedules_from_config(config, inputs.num_train_examples(config))
    g, mc = inputs.image_size(config), config.input.multicrop
    c = info.image_shape[-1]
    model = dino.build_model(config)
    tx = dino.build_dino_optimizer(config, sched)
    dummy = jnp.zeros((1, g, g, c), jnp.float32)
    init_state = dino.init_state_fn(config.model, model, tx, sched, dummy, config.dino.out_dim)
    b = config.input.batch_size
    shapes = {"global": ((b, 2, g, g, c), jnp.uint8),
              "local": ((b, mc.num_local, mc.local_size, mc.local_size, c), jnp.uint8)}
    stats = device_images.dataset_stats(config)
    return _program(config, mesh, init_state, lambda: dino.make_train_step(model, tx, sched, config.dino, stats),
                    shapes)


def lm_program(config: ml_collections.ConfigDict, axes: dict[str, int],
               devices: Sequence[jax.Device] | None = None) -> Program:
    """The lm trainer's step and state (as `lm.train_and_evaluate` builds them), on int32 windows."""
    from skipless_jax.data import text
    from skipless_jax.trainers import lm

    config = _mesh_config(config, axes)
    devices = list(devices if devices is not None else jax.devices())[: math.prod(axes.values())]
    mesh = sharding.make_mesh(config.mesh, devices)
    model = models.build(config.model, lm.vocab_size(config))
    tx, schedule = build_optimizer(config, config.total_steps)
    init_state = lm.make_init_state(config.model, model, tx, config.model.seq_len)
    return _program(config, mesh, init_state, lambda: lm.make_train_step(model, tx, schedule, config),
                    text.train_batch_spec(config))


def random_batch(program: Program, seed: int = 0) -> dict[str, np.ndarray]:
    """Host arrays for the program's batch: uniform uint8 images (float ones N(0, 1)), one-hot
    labels, random-erasing boxes inside the image (half of them empty)."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, x in program.abstract_batch.items():
        if k == "label":
            out[k] = np.eye(x.shape[1], dtype=np.float32)[rng.integers(0, x.shape[1], x.shape[0])]
        elif k == "erase":
            height, width = program.abstract_batch["image"].shape[1:3]
            h, w = rng.integers(1, height, x.shape[0]), rng.integers(1, width, x.shape[0])
            top, left = rng.integers(0, height - h + 1), rng.integers(0, width - w + 1)
            out[k] = np.stack([top, left, h, w], 1).astype(np.int32) * (rng.random(x.shape[0]) < 0.5)[:, None]
        elif x.dtype == np.uint8:
            out[k] = rng.integers(0, 256, x.shape, dtype=np.uint8)
        elif k == "tokens":  # byte-level windows (data/text.py)
            out[k] = rng.integers(0, 257, x.shape).astype(np.int32)
        else:
            out[k] = rng.standard_normal(x.shape).astype(np.float32)
    return out


def state_bytes_per_device(program: Program, keys: Sequence[str] = ("params", "opt_state")) -> int:
    """Bytes of `keys` of the state that one device holds (its shard of every leaf)."""
    total = 0
    for key in keys:
        for x in jax.tree.leaves(getattr(program.abstract_state, key)):
            shard = x.sharding.shard_shape(x.shape)
            total += math.prod(shard) * np.dtype(x.dtype).itemsize
    return total


def figures(program: Program) -> dict[str, float]:
    """Per-device XLA figures of the compiled step (and its compile time)."""
    t0 = time.perf_counter()
    compiled = program.compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = compiled.memory_analysis()
    return dict(
        flops=float(cost["flops"]),
        argument_bytes=int(mem.argument_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        state_bytes=state_bytes_per_device(program),
        compile_s=compile_s,
    )


STEPS: dict[str, Callable[..., Program]] = {
    "supervised adamw": lambda axes, **kw: supervised_program(supervised_config("adamw", **kw), axes),
    "supervised soap": lambda axes, **kw: supervised_program(supervised_config("soap", **kw), axes),
    "supervised shampoo_ec": lambda axes, **kw: supervised_program(supervised_config("shampoo_ec", **kw), axes),
    "supervised adamw accum 4": lambda axes, **kw: supervised_program(supervised_config("adamw", accum=4, **kw), axes),
    "dino adamw": lambda axes, **kw: dino_program(dino_config("adamw", **kw), axes),
    "fashion_mnist vit": lambda axes, **kw: supervised_program(fashion_config(), axes),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--devices", default="1,2,4,8")
    parser.add_argument("--meshes", default="data,fsdp")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output", default="benchmarks/results/scaling.json")
    args = parser.parse_args()

    rows = []
    for name in args.steps.split(","):
        base = None
        for n in [int(d) for d in args.devices.split(",")]:
            for axis in args.meshes.split(","):
                if n == 1 and axis != args.meshes.split(",")[0]:
                    continue  # one device: one mesh
                program = STEPS[name]({axis: n}, width=args.width, depth=args.depth, batch=args.batch)
                row = dict(step=name, devices=n, mesh=axis if n > 1 else "-", **figures(program))
                base = base or row
                for k in ("flops", "argument_bytes", "temp_bytes", "state_bytes"):
                    row[f"{k}_ratio"] = row[k] / base[k]
                rows.append(row)
                print(json.dumps(row), flush=True)

    print(f"\nPer-device figures of the trainers' steps (ViT width {args.width}, depth {args.depth}, "
          f"global batch {args.batch}; ratios to 1 device; ideal 1/N):")
    print(f"{'step':26} {'N':>2} {'mesh':5} {'GFLOP':>8} {'ratio':>6} {'args MiB':>9} {'ratio':>6} "
          f"{'temp MiB':>9} {'ratio':>6} {'state MiB':>9} {'ratio':>6} {'compile s':>9}")
    for r in rows:
        print(f"{r['step']:26} {r['devices']:>2} {r['mesh']:5} {r['flops'] / 1e9:8.3f} {r['flops_ratio']:6.3f} "
              f"{r['argument_bytes'] / 2**20:9.2f} {r['argument_bytes_ratio']:6.3f} "
              f"{r['temp_bytes'] / 2**20:9.2f} {r['temp_bytes_ratio']:6.3f} "
              f"{r['state_bytes'] / 2**20:9.2f} {r['state_bytes_ratio']:6.3f} {r['compile_s']:9.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"rows": rows, "args": vars(args), "device": jax.devices()[0].device_kind}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

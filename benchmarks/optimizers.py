r"""SOAP and eigenvalue-corrected Shampoo vs AdamW: update time (ordinary / refresh / amortized),
compile time, state memory.

    OPENBLAS_NUM_THREADS=1 python benchmarks/optimizers.py \
        --variants=Ti/16,S/16,B/16 --time_variants=Ti/16,S/16 \
        --output=benchmarks/results/optimizers.json

Part 1, per ViT variant (parameter shapes of `models.vit.ViT`, 1000 classes, 224 px): the jitted
optimizer update alone (`tx.update` + `apply_updates`, donated), with random gradients.
  ordinary   median time of a step that does no factorization;
  refresh    median time of a refresh step (SOAP: power iteration + QR of every factor;
             shampoo_ec: eigh of every factor);
  amortized  ((frequency - 1)·ordinary + refresh) / frequency, the cost per step in training, at
             each optimizer's recipe frequency (SOAP --frequency 10, shampoo_ec --ec_frequency 100);
  compile    lower + compile of the update; state  bytes of the optimizer state.
Variants outside --time_variants report compile time and memory only (B/16 SOAP steps take
tens of seconds on a 2-core CPU).
Part 2: the whole train step (forward, backward, update), by default of ViT-Ti/4 on 32×32
images, batch 128 (--step_variant, --step_image_size, --step_batch), SOAP and shampoo_ec vs AdamW
measured interleaved in one process and reported as ratios; targets (issue #52, at ViT-S/16):
amortized step ≤ 1.10× AdamW, compile ≤ 1.5× AdamW. The issue's size, without part 1:

    OPENBLAS_NUM_THREADS=1 python benchmarks/optimizers.py --variants= \
        --step_variant=S/16 --step_image_size=224 --step_batch=128 --step_repeats=2 \
        --output=benchmarks/results/optimizers_s16.json

The step of the call that builds the preconditioner (eigh, once per run) is reported apart.
`--step_scan` measures part 2 with the encoder scanned (`config.model.scan`): one stacked leaf per
block parameter, so each optimizer's state has about 1/depth of the leaves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scaling  # benchmarks/scaling.py: the trainers' own steps (this script's folder is on sys.path)

from skipless_jax.models import vit
from skipless_jax.optim import shampoo_ec, soap

FREQUENCY = 10  # SOAP's (Cutting the Skip)
EC_FREQUENCY = 100  # shampoo_ec's (the authors' MAE fork)
OPTIMIZERS = ("adamw", "soap", "shampoo_ec")


def make_optimizers(frequency: int, ec_frequency: int) -> dict[str, optax.GradientTransformation]:
    """The recipes' settings: SOAP b1 0.9, b2 0.95 (Cutting the Skip); shampoo_ec the fork's call;
    AdamW as the baseline."""
    return {
        "adamw": optax.adamw(1e-3, b1=0.9, b2=0.999, weight_decay=0.05),
        "soap": soap(3e-3, b1=0.9, b2=0.95, weight_decay=0.05, precondition_frequency=frequency),
        "shampoo_ec": shampoo_ec(1e-3, weight_decay=0.05, precondition_frequency=ec_frequency),
    }


def refresh_count(name: str, frequency: int) -> int:
    """The state's count at which `name`'s next call refreshes: SOAP refreshes at count % f == 0,
    shampoo_ec at step count + 1 = f (its first refresh)."""
    return frequency - 1 if name == "shampoo_ec" else frequency


def set_count(state: Any, count: int) -> Any:
    """Every `count` field of a (chained) optimizer state set to `count` (selects SOAP's branch).

    Each field gets its own array: the state is donated, and one buffer may be donated once.
    """
    if hasattr(state, "_fields"):
        state = type(state)(*(set_count(getattr(state, f), count) for f in state._fields))
        if "count" in state._fields:
            state = state._replace(count=jnp.array(count, jnp.int32))
        return state
    if isinstance(state, (tuple, list)):
        return type(state)(set_count(x, count) for x in state)
    return state


def tree_bytes(tree: Any) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def block(tree: Any) -> None:
    jax.block_until_ready(tree)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    block(fn())
    return time.perf_counter() - t0


def model_for(variant: str, image_size: int, num_classes: int) -> vit.ViT:
    return vit.ViT(num_classes=num_classes, **vit.decode_variant(variant))


def abstract_params(model: vit.ViT, image_size: int) -> Any:
    x = jnp.zeros((1, image_size, image_size, 3))
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x)["params"])


def random_like(tree: Any, seed: int, scale: float = 1.0) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return treedef.unflatten(
        [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    )


# ---------------------------------------------------------------------------------------------
# Part 1: the update alone.


def bench_update(variant: str, tx: optax.GradientTransformation, timing: bool, repeats: int,
                 frequency: int, refresh: int) -> dict[str, Any]:
    abstract = abstract_params(model_for(variant, 224, 1000), 224)
    state_abstract = jax.eval_shape(tx.init, abstract)
    row: dict[str, Any] = dict(
        variant=variant,
        param_bytes=tree_bytes(abstract),
        state_bytes=tree_bytes(state_abstract),
    )

    def update(params, state, grads):
        u, state = tx.update(grads, state, params)
        return optax.apply_updates(params, u), state

    jitted = jax.jit(update, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    compiled = jitted.lower(abstract, state_abstract, abstract).compile()
    row["compile_s"] = time.perf_counter() - t0
    if not timing:
        return row

    params = random_like(abstract, 0)
    grads = random_like(abstract, 1, 1e-2)
    state = jax.jit(tx.init)(params)
    # Call 0 (builds the preconditioner; plain count bookkeeping for AdamW), timed once.
    t0 = time.perf_counter()
    params, state = compiled(params, state, grads)
    block((params, state))
    row["first_call_s"] = time.perf_counter() - t0
    for kind, count in (("ordinary", 1), ("refresh", refresh)):
        times = []
        for _ in range(repeats + 1):  # first run of each branch warms caches, dropped
            state = set_count(state, count)
            t0 = time.perf_counter()
            params, state = compiled(params, state, grads)
            block((params, state))
            times.append(time.perf_counter() - t0)
        row[f"{kind}_s"] = statistics.median(times[1:])
    row["amortized_s"] = ((frequency - 1) * row["ordinary_s"] + row["refresh_s"]) / frequency
    return row


# ---------------------------------------------------------------------------------------------
# Part 2: the whole train step of ViT-Ti/4 on 32×32 images.


def bench_train_step(variant: str, image_size: int, batch: int, repeats: int,
                     frequencies: dict[str, int], scan: bool = False) -> dict[str, Any]:
    """The supervised trainer's own step (`supervised.make_train_step`, built as the trainer
    builds it by benchmarks/scaling.py) with the recipe's AdamW, SOAP and shampoo_ec, on random
    data; `frequencies`: each optimizer's refresh period; `scan`: the encoder scanned
    (`config.model.scan`, one stacked leaf per block parameter)."""
    images_labels = None
    runs: dict[str, dict[str, Any]] = {}
    for name in OPTIMIZERS:
        config = scaling.vit_config(variant, image_size, batch, opt=name)
        config.optimizer.weight_decay = 0.05
        config.model.scan = scan
        if name != "adamw":
            config.optimizer.precondition_frequency = frequencies[name]
        program = scaling.supervised_program(config, {"data": 1}, num_classes=10, channels=3)
        state = program.init()
        images_labels = images_labels or program.batch(scaling.random_batch(program, seed=1))
        t0 = time.perf_counter()
        compiled = program.compile()
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        state, metrics = compiled(state, images_labels)
        block(metrics)
        runs[name] = dict(compiled=compiled, state=state, compile_s=compile_s,
                          first_call_s=time.perf_counter() - t0, ordinary=[], refresh=[])
        print(f"{name}: compile {compile_s:.1f} s, call 0 {runs[name]['first_call_s']:.1f} s", flush=True)

    # Interleaved: each round times one ordinary and one refresh step of each optimizer.
    for r in range(repeats + 1):
        for kind in ("ordinary", "refresh"):
            for name, run in runs.items():
                count = 1 if kind == "ordinary" else refresh_count(name, frequencies.get(name, FREQUENCY))
                run["state"] = run["state"].replace(opt_state=set_count(run["state"].opt_state, count))
                t0 = time.perf_counter()
                run["state"], metrics = run["compiled"](run["state"], images_labels)
                block(metrics)
                if r:  # round 0 warms up
                    run[kind].append(time.perf_counter() - t0)
                    print(f"round {r} {kind} {name}: {run[kind][-1]:.2f} s", flush=True)

    out: dict[str, Any] = dict(variant=variant, image_size=image_size, batch=batch, frequencies=frequencies)
    for name, run in runs.items():
        ordinary, refresh = statistics.median(run["ordinary"]), statistics.median(run["refresh"])
        f = frequencies.get(name, FREQUENCY)
        out[name] = dict(
            compile_s=run["compile_s"], first_call_s=run["first_call_s"], ordinary_s=ordinary,
            refresh_s=refresh, amortized_s=((f - 1) * ordinary + refresh) / f,
        )
    a = out["adamw"]
    out["ratios"] = {
        name: dict(
            amortized=out[name]["amortized_s"] / a["amortized_s"],
            ordinary=out[name]["ordinary_s"] / a["ordinary_s"],
            refresh=out[name]["refresh_s"] / a["amortized_s"],
            compile=out[name]["compile_s"] / a["compile_s"],
        )
        for name in OPTIMIZERS[1:]
    }
    return out


# ---------------------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="Ti/16,S/16,B/16")
    parser.add_argument("--time_variants", default="Ti/16,S/16", help="variants whose steps are timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frequency", type=int, default=FREQUENCY, help="SOAP's refresh period")
    parser.add_argument("--ec_frequency", type=int, default=EC_FREQUENCY, help="shampoo_ec's refresh period")
    parser.add_argument("--step_variant", default="Ti/4")
    parser.add_argument("--step_image_size", type=int, default=32)
    parser.add_argument("--step_batch", type=int, default=128)
    parser.add_argument("--step_repeats", type=int, default=3)
    parser.add_argument("--step_scan", action="store_true", help="part 2 with the encoder scanned (config.model.scan)")
    parser.add_argument("--skip_step", action="store_true", help="skip part 2")
    parser.add_argument("--output", default="benchmarks/results/optimizers.json")
    args = parser.parse_args()
    timing = set(args.time_variants.split(",")) if args.time_variants else set()

    frequencies = {"soap": args.frequency, "shampoo_ec": args.ec_frequency}
    rows = []
    for variant in [v for v in args.variants.split(",") if v]:  # --variants= skips part 1
        for name, tx in make_optimizers(args.frequency, args.ec_frequency).items():
            f = frequencies.get(name, args.frequency)
            row = bench_update(variant, tx, variant in timing, args.repeats, f, refresh_count(name, f))
            row["optimizer"] = name
            rows.append(row)
            print(json.dumps(row), flush=True)

    device = f"{jax.device_count()} × {jax.devices()[0].device_kind}"
    print(f"\nOptimizer update alone ({device}; frequency SOAP {args.frequency}, shampoo_ec "
          f"{args.ec_frequency}; ms):")
    print(f"{'variant':8} {'opt':10} {'params':>10} {'state':>10} {'state/params':>12} {'compile s':>9} "
          f"{'ordinary':>9} {'refresh':>9} {'amortized':>9} {'call 0':>9}")
    for r in rows:
        ms = lambda k, r=r: f"{1e3 * r[k]:9.1f}" if k in r else f"{'-':>9}"
        print(f"{r['variant']:8} {r['optimizer']:10} {fmt_bytes(r['param_bytes']):>10} "
              f"{fmt_bytes(r['state_bytes']):>10} {r['state_bytes'] / r['param_bytes']:12.2f} "
              f"{r['compile_s']:9.1f} {ms('ordinary_s')} {ms('refresh_s')} {ms('amortized_s')} {ms('first_call_s')}")

    step = None
    if not args.skip_step:
        step = bench_train_step(args.step_variant, args.step_image_size, args.step_batch,
                                args.step_repeats, frequencies, scan=args.step_scan)
        print(f"\nWhole train step, ViT-{args.step_variant} {args.step_image_size}px batch {args.step_batch}"
              f"{', scanned encoder' if args.step_scan else ''} ({device}):")
        print(f"{'opt':10} {'compile s':>9} {'ordinary ms':>11} {'refresh ms':>10} {'amortized ms':>12}")
        for name in OPTIMIZERS:
            s = step[name]
            print(f"{name:10} {s['compile_s']:9.1f} {1e3 * s['ordinary_s']:11.1f} "
                  f"{1e3 * s['refresh_s']:10.1f} {1e3 * s['amortized_s']:12.1f}")
        for name, ratios in step["ratios"].items():
            print(f"{name} / AdamW: amortized {ratios['amortized']:.3f}× (target ≤ 1.10), ordinary "
                  f"{ratios['ordinary']:.3f}×, refresh step {ratios['refresh']:.3f}×, compile "
                  f"{ratios['compile']:.2f}× (target ≤ 1.5)")

    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(dict(update=rows, train_step=step, args=vars(args), device=device), f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

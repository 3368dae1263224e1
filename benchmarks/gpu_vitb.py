r"""ViT-B/16 bf16 train-step throughput and MFU on one GPU, with XLA and cuDNN attention, AdamW
and SOAP: the supervised trainer's own step (`supervised.make_train_step`), donated state.

    python benchmarks/gpu_vitb.py [--batch=256] [--steps=30] [--peak_tflops=989] \
        [--out=benchmarks/results/gpu_vitb.json]

MFU = model FLOPs per step / step time / peak, the trainer's definition (`perf/mfu`,
docs/method/runs.md §25): model FLOPs are `models.flops.train_flops_per_example` (3 × the forward
matmuls), so rematerialisation or an attention kernel's extra work does not count as useful;
XLA's own `cost_analysis()` FLOPs are reported next to it. `--peak_tflops`: the chip's dense
bf16 peak; default: `trainers/devices.py`'s table entry for the device's kind.

Data are random device arrays (uint8 images, as the pipeline ships them; no input pipeline):
this measures the step. The step time is the
median of `--steps` timed steps after 3 warm-up steps, each synchronised with
`block_until_ready`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def measure(batch: int, steps: int, opt: str, attention_impl: str | None) -> dict:
    from benchmarks.large_model import vitb_config
    from skipless_jax import models
    from skipless_jax.models import flops
    from skipless_jax.optim import build_optimizer
    from skipless_jax.trainers import common, nonfinite, supervised

    config = vitb_config(opt, dtype="bfloat16", attention_impl=attention_impl)
    model = models.build(config.model, 1000)
    tx, schedule = build_optimizer(config, 10_000)

    def init_state(rng):
        params = models.init_variables(config.model, model, rng, jnp.zeros((1, 224, 224, 3)))["params"]
        return common.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng,
                                 nonfinite=nonfinite.init_nonfinite())

    state = jax.jit(init_state)(jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(1)
    # What the trainer's pipeline ships: uint8 images (normalized inside the step), one-hot labels.
    batch_data = {"image": jax.random.randint(key, (batch, 224, 224, 3), 0, 256, jnp.int32).astype(jnp.uint8),
                  "label": jax.nn.one_hot(jax.random.randint(key, (batch,), 0, 1000), 1000)}
    step = jax.jit(supervised.make_train_step(model, tx, schedule, config), donate_argnums=0)
    start = time.perf_counter()
    compiled = step.lower(state, batch_data).compile()
    compile_s = time.perf_counter() - start
    xla_flops = float(compiled.cost_analysis().get("flops", float("nan")))
    times = []
    for i in range(steps + 3):
        t = time.perf_counter()
        state, metrics = compiled(state, batch_data)
        jax.block_until_ready(metrics["loss"])
        if i >= 3:
            times.append(time.perf_counter() - t)
    seconds = statistics.median(times)
    model_flops = batch * flops.train_flops_per_example(config.model, 224, 1000)
    return dict(opt=opt, attention=attention_impl or "default", batch=batch, step_ms=round(1e3 * seconds, 2),
                images_per_s=round(batch / seconds, 1), model_tflops_per_step=round(model_flops / 1e12, 3),
                xla_tflops_per_step=round(xla_flops / 1e12, 3), compile_s=round(compile_s, 1),
                achieved_tflops=round(model_flops / seconds / 1e12, 1), loss=float(metrics["loss"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--peak_tflops", type=float, default=None, help="default: the device kind's table entry")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu_vitb.json"))
    args = parser.parse_args()
    print("devices:", jax.devices(), flush=True)
    if args.peak_tflops is None:
        import ml_collections

        from skipless_jax.trainers.devices import peak_tflops

        args.peak_tflops = peak_tflops(ml_collections.ConfigDict(), jax.devices()[0]) or float("nan")
    rows = []
    for opt, impl in (("adamw", "xla"), ("adamw", "cudnn"), ("soap", "cudnn"), ("soap", "xla")):
        try:
            row = measure(args.batch, args.steps, opt, impl)
            row["mfu"] = round(row["achieved_tflops"] / args.peak_tflops, 3)
        except Exception as err:  # e.g. cuDNN attention unavailable: record why, go on
            row = dict(opt=opt, attention=impl, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = next((r for r in rows if r.get("opt") == "adamw" and "step_ms" in r and r["attention"] == "cudnn"),
                next((r for r in rows if "step_ms" in r), None))
    print(f"\n| optimizer | attention | images/s | step ms | MFU (peak {args.peak_tflops:g} TFLOP/s) | × AdamW |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "step_ms" in r:
            ratio = r["step_ms"] / base["step_ms"] if base else float("nan")
            print(f"| {r['opt']} | {r['attention']} | {r['images_per_s']} | {r['step_ms']} | {100 * r['mfu']:.1f}% | "
                  f"{ratio:.2f} |")
        else:
            print(f"| {r['opt']} | {r['attention']} | {r['error']} | | | |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=str(jax.devices()[0]), peak_tflops=args.peak_tflops, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

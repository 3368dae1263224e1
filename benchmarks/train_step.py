r"""Train-step time, images/s, FLOPs (XLA cost analysis) and MFU of ViT variants and of every
model family.

    OPENBLAS_NUM_THREADS=1 python benchmarks/train_step.py --variants=Ti/16,S/16,B/16 \
        --batch=8 --output=benchmarks/results/train_step.json [--peak_tflops=989]
    OPENBLAS_NUM_THREADS=1 python benchmarks/train_step.py --variants=families --batch=4 \
        --output=benchmarks/results/train_step_families.json

A variant is a ViT's ('B/16') or 'family:variant[@image size]' ('swin:T', 'convmixer:256/8@32');
`families` is one Tiny/Small model of each family (scaling.FAMILY_VARIANTS).

The supervised trainer's own jitted step (`trainers/supervised.make_train_step`, AdamW or
`--optimizer=soap`, built by benchmarks/scaling.py as the trainer builds it, data-parallel over
all devices) on random data, timed after compilation, median of `--repeats`. Throughput is
counted as the trainer counts it (docs/method/runs.md §25): model FLOPs per step = batch ×
`models.flops.train_flops_per_example` (3 × the forward matmuls and convolutions), and
MFU = model FLOPs per step / step time / (peak × devices), with the peak the dense bf16 peak of
the device's exact kind (`trainers.devices.PEAK_TFLOPS`) or `--peak_tflops`; XLA's count of the
compiled step is reported beside it (`xla_gflop_per_step`), not used for MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import ml_collections
import scaling  # benchmarks/scaling.py: the trainers' own steps (this script's folder is on sys.path)

from skipless_jax.models import flops as model_flops
from skipless_jax.trainers.devices import peak_tflops

NUM_CLASSES, CHANNELS = 1000, 3  # the random ImageNet-shaped batches every variant is timed on


def timed_program(variant: str, batch: int, image_size: int, dtype: str, skips: bool, init: str,
                  opt: str = "adamw") -> tuple[ml_collections.ConfigDict, scaling.Program, float]:
    """The config, the supervised trainer's program on random 1000-class RGB data (data-parallel
    over all devices), and its model FLOPs per step counted for that data (docs/method/runs.md §25), not for
    the config's own dataset."""
    config = scaling.family_config(variant, image_size, batch, opt=opt, dtype=dtype, skips=skips, init=init)
    program = scaling.supervised_program(config, {"data": jax.device_count()}, num_classes=NUM_CLASSES,
                                         channels=CHANNELS)
    flops = batch * model_flops.train_flops_per_example(config.model, config.input.image_size, NUM_CLASSES,
                                                        channels=CHANNELS)
    return config, program, flops


def bench(variant: str, batch: int, image_size: int, dtype: str, repeats: int, skips: bool, init: str,
          opt: str = "adamw") -> dict:
    """Compile and time the supervised trainer's own step (`supervised.make_train_step`: loss,
    gradient, clipping, optimizer, non-finite guard, metrics) on random 1000-class data."""
    config, program, flops = timed_program(variant, batch, image_size, dtype, skips, init, opt)
    state = program.init()
    batch_arrays = program.batch(scaling.random_batch(program))
    t0 = time.perf_counter()
    compiled = program.compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla_flops = float(cost.get("flops", float("nan"))) * jax.device_count()  # per device -> the whole step
    with jax.set_mesh(program.mesh):
        state, metrics = compiled(state, batch_arrays)  # warm-up
        jax.block_until_ready(metrics)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch_arrays)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return dict(
        variant=variant, batch=batch, image_size=config.input.image_size, dtype=dtype, skips=skips, init=init,
        optimizer=opt,
        compile_s=compile_s, step_s=step_s, step_s_min=min(times), images_per_s=batch / step_s,
        flops_per_step=flops, xla_flops_per_step=xla_flops, achieved_tflops=flops / step_s / 1e12,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="Ti/16,S/16,B/16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skipless", action="store_true", help="benchmark the skipless block (same FLOPs)")
    parser.add_argument("--init", default="default")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "soap"])
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="per-device dense bf16 peak TFLOP/s for MFU (default: the device kind's table entry)")
    parser.add_argument("--output", default="benchmarks/results/train_step.json")
    args = parser.parse_args()

    variants = scaling.FAMILY_VARIANTS if args.variants == "families" else args.variants
    rows = []
    for v in variants.split(","):  # each row as it is measured: a large model takes minutes
        rows.append(bench(v, args.batch, args.image_size, args.dtype, args.repeats, not args.skipless, args.init,
                          args.optimizer))
        r = rows[-1]
        print(f"measured {v}: compile {r['compile_s']:.1f} s, step {1e3 * r['step_s']:.1f} ms, "
              f"{r['flops_per_step'] / 1e9:.1f} model GFLOP", flush=True)
    devices = jax.device_count()
    peak = peak_tflops(ml_collections.ConfigDict(dict(peak_tflops=args.peak_tflops)), jax.devices()[0])
    for row in rows:
        row["devices"] = devices
        row["device_kind"] = jax.devices()[0].device_kind
        row["peak_tflops"] = peak
        row["mfu"] = row["achieved_tflops"] / (peak * devices) if peak else None

    base = rows[0]["step_s"] / rows[0]["flops_per_step"]
    header = (
        f"{'variant':16} {'batch':>5} {'compile s':>9} {'step ms':>9} {'img/s':>8} {'GFLOP/step':>11} "
        f"{'XLA GFLOP':>10} {'TFLOP/s':>8} "
        f"{'s/FLOP vs ' + rows[0]['variant']:>16} {'MFU':>6}"
    )
    print(f"devices: {devices} × {rows[0]['device_kind']}, dtype {args.dtype}, image {args.image_size}")
    print(header)
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        ratio = (r["step_s"] / r["flops_per_step"]) / base
        print(
            f"{r['variant']:16} {r['batch']:>5} {r['compile_s']:>9.1f} {1e3 * r['step_s']:>9.1f} "
            f"{r['images_per_s']:>8.1f} {r['flops_per_step'] / 1e9:>11.1f} {r['xla_flops_per_step'] / 1e9:>10.1f} "
            f"{r['achieved_tflops']:>8.3f} "
            f"{ratio:>16.2f} {mfu:>6}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"rows": rows, "args": vars(args)}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

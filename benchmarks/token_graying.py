r"""Cost of Token Graying inside a full ViT train step, as ratios to the same step without TG.

    OPENBLAS_NUM_THREADS=1 python benchmarks/token_graying.py \
        --output=benchmarks/results/token_graying.json

Cases (`--cases`): Ti/4 at 32×32 (batch 128) and S/16 at 224×224 (batch 8); each is one
jitted AdamW step (softmax cross-entropy) of `skipless_jax.models.vit.ViT` with
`token_graying` = None, 'dct', 'svd', 'svd_fast'. All variants of a case are compiled first,
then timed in interleaved rounds (round r runs every variant once), so machine noise hits
them alike. Three estimates of the cost, as a fraction of the no-TG step:
- step ratio: median over rounds of (variant / no-TG) from the same round;
- ratio of minima: fastest variant step / fastest no-TG step (load only ever adds time);
- TG alone / step: the TG function alone on the case's patch batch (timed in the same rounds)
  over the no-TG step. TG acts on the input, so the step runs its forward only: on a loaded
  machine this is the most stable of the three.
Inputs are crops of scikit-learn's two bundled photos, so the SVDs see real spectra.

Paper (Always Skip Attention, ViT-B on GPUs): DCT-TG +1.2%, SVD-TG 6.3× the training time.
Targets here: DCT-TG within 2% of the step, the fast SVD-TG within 25%, judged on
1 + (TG alone / step); the table shows the direct step ratios beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_sample_images

from skipless_jax import token_graying
from skipless_jax.models import vit

import common  # benchmarks/common.py (this script's folder is on sys.path)

VARIANTS = (None, "dct", "svd", "svd_fast")
CASES = {"Ti/4@32": ("Ti/4", 32, 128), "S/16@224": ("S/16", 224, 8)}
TARGETS = {"dct": 1.02, "svd_fast": 1.25}


def photo_batch(image_size: int, batch: int, seed: int = 0) -> np.ndarray:
    """(batch, S, S, 3) crops in [-1, 1]; for S < 64 from 4×-downsampled photos (CIFAR-like)."""
    rng = np.random.default_rng(seed)
    photos = [im.astype(np.float32) / 127.5 - 1.0 for im in load_sample_images().images]
    if image_size < 64:
        photos = [
            im[: im.shape[0] // 4 * 4, : im.shape[1] // 4 * 4]
            .reshape(im.shape[0] // 4, 4, im.shape[1] // 4, 4, 3)
            .mean((1, 3))
            for im in photos
        ]
    out = []
    for i in range(batch):
        im = photos[i % len(photos)]
        y = rng.integers(0, im.shape[0] - image_size + 1)
        x = rng.integers(0, im.shape[1] - image_size + 1)
        out.append(im[y : y + image_size, x : x + image_size])
    return np.stack(out)


def make_step(variant: str, tg: str | None, eps: float, dtype: str):
    model = vit.ViT(
        num_classes=1000, **vit.decode_variant(variant), dtype=jnp.dtype(dtype), token_graying=tg, tg_eps=eps
    )
    tx = optax.adamw(1e-3, weight_decay=0.05)

    step = common.classifier_step(model, tx)

    def init(rng, images):
        params = model.init(rng, images[:1])["params"]
        return params, tx.init(params)

    return jax.jit(step, donate_argnums=(0, 1)), jax.jit(init)


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def bench_case(name: str, batch: int | None, eps: float, rounds: int, dtype: str) -> list[dict]:
    variant, image_size, default_batch = CASES[name]
    batch = batch or default_batch
    images = jnp.asarray(photo_batch(image_size, batch))
    labels = jnp.arange(batch) % 1000
    patches = vit.patchify(images, vit.decode_variant(variant)["patch_size"])
    state, steps, tg_fns, compile_s = {}, {}, {}, {}
    for tg in VARIANTS:
        step, init = make_step(variant, tg, eps, dtype)
        params, opt_state = init(jax.random.key(0), images)
        t0 = time.perf_counter()
        steps[tg] = step.lower(params, opt_state, images, labels).compile()
        compile_s[tg] = time.perf_counter() - t0
        params, opt_state, _ = steps[tg](params, opt_state, images, labels)  # warm-up
        state[tg] = (params, opt_state)
        if tg is not None:
            tg_fns[tg] = jax.jit(token_graying.TOKEN_GRAYING[tg]).lower(patches, eps).compile()
            jax.block_until_ready(tg_fns[tg](patches, eps))
    step_times = {tg: [] for tg in VARIANTS}
    tg_times = {tg: [] for tg in tg_fns}
    for _ in range(rounds):
        for tg in VARIANTS:
            dt, (params, opt_state, _) = _timed(steps[tg], *state[tg], images, labels)
            state[tg] = (params, opt_state)
            step_times[tg].append(dt)
            if tg is not None:
                tg_times[tg].append(_timed(tg_fns[tg], patches, eps)[0])
    base = step_times[None]
    rows = []
    for tg in VARIANTS:
        ratios = [t / b for t, b in zip(step_times[tg], base)]
        tg_alone = [t / b for t, b in zip(tg_times.get(tg, [0.0] * rounds), base)]
        rows.append(
            dict(
                case=name, variant=variant, image_size=image_size, batch=batch, patches=list(patches.shape[1:]),
                token_graying=tg or "none", eps=eps, dtype=dtype, compile_s=compile_s[tg],
                step_ms=1e3 * statistics.median(step_times[tg]), step_ratio=statistics.median(ratios),
                step_ratio_min=min(ratios), step_ratio_max=max(ratios), ratio_of_minima=min(step_times[tg]) / min(base),
                tg_alone_ms=1e3 * statistics.median(tg_times[tg]) if tg else 0.0,
                tg_alone_over_step=statistics.median(tg_alone),
                target_ratio=TARGETS.get(tg),
                meets_target=(1 + statistics.median(tg_alone) <= TARGETS[tg]) if tg in TARGETS else None,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    parser.add_argument("--batch", type=int, default=None, help="override every case's batch")
    parser.add_argument("--eps", type=float, default=0.95)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype (TG is float32)"
    )
    parser.add_argument("--output", default="benchmarks/results/token_graying.json")
    args = parser.parse_args()
    token_graying.validate_token_graying("svd", args.eps)

    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise ValueError(f"--cases entry {case!r} is unknown; allowed: {list(CASES)}")
        rows += bench_case(case, args.batch, args.eps, args.rounds, args.dtype)

    device = f"{jax.device_count()} × {jax.devices()[0].device_kind}"
    print(f"devices: {device}; model dtype {args.dtype}; ε = {args.eps}; {args.rounds} interleaved rounds")
    print(
        f"{'case':9} {'batch':>5} {'TG':9} {'step ms':>9} {'step ratio':>10} {'[min, max]':>14} {'min/min':>8} "
        f"{'TG alone ms':>11} {'TG/step':>8} {'target':>7}"
    )
    for r in rows:
        spread = f"[{r['step_ratio_min']:.3f}, {r['step_ratio_max']:.3f}]"
        if r["target_ratio"] is None:
            target = "-"
        else:
            target = f"≤{r['target_ratio']:.2f}" + (" ok" if r["meets_target"] else " MISS")
        print(
            f"{r['case']:9} {r['batch']:>5} {r['token_graying']:9} {r['step_ms']:>9.1f} {r['step_ratio']:>10.3f} "
            f"{spread:>14} {r['ratio_of_minima']:>8.3f} {r['tg_alone_ms']:>11.1f} "
            f"{100 * r['tg_alone_over_step']:>7.1f}% {target:>7}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"rows": rows, "args": vars(args), "device": device}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

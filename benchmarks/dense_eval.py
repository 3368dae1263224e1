r"""Cost of the dense evaluators (docs/method/dense.md §7, §8) on this machine, and an estimate of a
full PASCAL VOC12 run on one accelerator.

    OPENBLAS_NUM_THREADS=1 python benchmarks/dense_eval.py [--size 224] [--variant S/16] [--reps 3]

Times, on a random-init ViT (default ViT-S/16 at 224, CLS token, float32), per image:
  * TokenCut: the jitted keys forward (`TokenCut._keys`, batch 16), and `ncut` + `box` on the
    host in float64 (one image's h·w tokens);
  * the linear segmentation probe: its jitted train step (`LinearSegmentation._step`, batch 16:
    frozen backbone forward + BatchNorm/linear head forward and backward + AdamW), its window
    inference (`_window_logits`), and the host's train crop (`train_batch`: resize, class-ratio
    crop, flip, photometric distortion) of 375×500 VOC-like records for `lin` and `ms`;
and the FLOPs XLA counts for them (`.lower().compile().cost_analysis()`). The VOC12 figures
are ESTIMATES: those FLOPs at VOC resolutions (compiled, not run) × the protocol's counts, over
an assumed sustained accelerator throughput, plus the host `ncut` measured here at VOC's token
count. Writes benchmarks/results/dense_eval.json (git-ignored) and prints a table.

The whole segmentation test pass (`--test-pass`, docs/method/dense.md §8), per image, on a random-init
backbone with ViT-S/16's width and heads (the DINO configs') at depth 4, the blocks `ms` reads
(`--test-width` 384, `--test-depth` 4, `--test-heads` 6; the full depth-12 forward costs ~3x
more, so its ratio is lower still; `--test-width 64 --test-heads 2` shows the per-pixel floor
on a toy network): `ms` on an ADE20K-sized input (512×683, 150 classes: 10 views, 168 windows
of 640²) and `lin` on a VOC-sized one (375×500, 21 classes), through
`LinearSegmentation.confusion` (host views and windows one image ahead, device forward, resizes,
accumulation, softmax, argmax, host confusion), against the windows' forward alone (the same
`_window_grid` calls, timed by themselves); the ratio (whole ÷ forward) is the test pass's
overhead over the network. The host's share (`host_views`) is also timed alone, and the host
reference path (`scores`) for `lin` only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from skipless_jax import evaluators, models, sharding
from skipless_jax.data import dense
from skipless_jax.evaluators import segmentation as seg
from skipless_jax.evaluators import tokencut as tc

BATCH = 16
# VOC12 (docs/method/dense.md §7, §8): TokenCut on trainval (11,540 images, ~500×375 → padded to
# 512×384 for p = 16); the `lin` probe: 40k steps of 16 crops 512², test on val (1,449 images,
# short side 512 → ~512×683: 2 sliding 512 windows at stride 341 each).
VOC12_TRAINVAL, VOC12_VAL = 11_540, 1_449
VOC_TOKENCUT_HW = (384, 512)
SEG_CROP, SEG_STEPS, SEG_WINDOWS = 512, 40_000, 2
ASSUMED_TFLOPS = {"300 TFLOP/s (~30% of H200 bf16 dense peak)": 300e12, "50 TFLOP/s (~fp32 without TF32)": 50e12}


def flops(jitted, *args) -> float:
    cost = jitted.lower(*args).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", float("nan")))


def timed(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs after one warm-up."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def setup(variant: str, size: int):
    model_cfg = ml_collections.ConfigDict(dict(variant=variant, pool="tok", posemb="learn", dtype="float32"))
    config = ml_collections.ConfigDict(dict(model=model_cfg, seed=0))
    model = models.build(model_cfg, 0, image_size=size)  # the position table resized for other inputs
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1})
    ctx = evaluators.Context(config, mesh, 21, outputs=lambda p, x: model.apply({"params": p}, x)[1])
    return model, ctx


def batch(n: int, hw: tuple[int, int], rng: np.random.Generator) -> dict[str, jax.Array]:
    return {
        "image": jnp.asarray(rng.normal(size=(n, *hw, 3)), jnp.float32),
        "segmentation": jnp.asarray(rng.integers(0, 21, (n, *hw)), jnp.uint8),
        "mask": jnp.ones((n,), jnp.float32),
    }


class VocLike:
    """Records shaped like VOC's (375×500 RGB, labels 0..20 in blobs, 255 borders), for the host costs."""

    def __init__(self, n: int = 8):
        rng = np.random.default_rng(0)
        self.records = []
        for _ in range(n):
            label = np.kron(rng.integers(0, 21, (15, 20)), np.ones((25, 25), int)).astype(np.uint8)
            label[::25] = 255
            self.records.append({"image": rng.integers(0, 256, (375, 500, 3)).astype(np.uint8), "segmentation": label})

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        return self.records[i]


def host_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def ncut_seconds(keys: np.ndarray, grid: tuple[int, int], patch: int, reps: int) -> float:
    times = []
    for i in range(reps):
        t = time.perf_counter()
        _, mask, seed = tc.ncut(keys[i % len(keys)], grid)
        tc.box(mask, seed, patch, (grid[0] * patch, grid[1] * patch))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


class Records:
    """`n` random records of one size (uint8 RGB image, labels in [0, classes) with 255 borders)."""

    def __init__(self, n: int, hw: tuple[int, int], classes: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.records = []
        for _ in range(n):
            label = rng.integers(0, classes, hw).astype(np.uint8)
            label[::25] = 255
            self.records.append({"image": rng.integers(0, 256, (*hw, 3)).astype(np.uint8), "segmentation": label})

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        return dict(self.records[i])  # confusion() clears the records it scored


def test_pass(width: int, depth: int, heads: int, reps: int) -> dict[str, dict[str, float]]:
    """Seconds per image of the whole test pass and of its windows' forward alone, `ms` on
    ADE20K-sized and `lin` on VOC-sized inputs (see the module docstring)."""
    model_cfg = ml_collections.ConfigDict(dict(width=width, depth=depth, mlp_dim=4 * width, num_heads=heads,
                                               patch_size=16, pool="tok", posemb="learn", dtype="float32"))
    config = ml_collections.ConfigDict(dict(model=model_cfg, seed=0))
    model = models.build(model_cfg, 0, image_size=224)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1})
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3)))["params"]
    params = jax.device_put(params, sharding.replicated(mesh))
    out = {}
    for name, dataset, hw, classes in (("ms", "ade20k", (512, 683), 150), ("lin", "voc12_seg", (375, 500), 21)):
        ctx = evaluators.Context(config, mesh, classes, outputs=lambda p, x: model.apply({"params": p}, x)[1])
        probe = seg.LinearSegmentation("seg", "seg", None, "x", ctx, "x", num_classes=classes,
                                       protocol=dense.PROTOCOLS[name], dataset=dataset, chunk=16)
        state = probe.init(params, (probe.protocol.crop, probe.protocol.crop, 3))
        head = {"params": state["params"], "stats": state["stats"]}
        records = Records(reps, hw, classes)
        probe.source = lambda split, records=records: records
        calls, grid = [], probe._window_grid

        def recording(*a, grid=grid, calls=calls):
            calls.append(a)
            return grid(*a)

        probe._window_grid = recording
        probe.confusion(params, head)  # compiles every program once; records the windows' batches
        probe._window_grid = grid
        t = time.perf_counter()
        probe.confusion(params, head)
        whole = (time.perf_counter() - t) / reps
        # The windows' forward alone: the same calls on the same batches, nothing else on the device.
        t = time.perf_counter()
        jax.block_until_ready([grid(*a) for a in calls])
        forward = (time.perf_counter() - t) / reps
        windows = sum(int(a[2]["mask"].sum()) for a in calls) / reps
        # The host's share alone (view resizes, normalization, window crops; `host_views`, one thread):
        # on an accelerator it is what the host must keep up with (made one image ahead, in parallel).
        t = time.perf_counter()
        for i in range(reps):
            probe.host_views(records.records[i]["image"])
        host = (time.perf_counter() - t) / reps
        row = {"whole_s_per_image": whole, "forward_s_per_image": forward,
               "ratio": whole / forward, "windows_per_image": windows, "host_share_s_per_image": host,
               "input": f"{hw[0]}x{hw[1]}, {classes} classes"}
        if name == "lin":
            t = time.perf_counter()
            probe.confusion(params, head, device=False)
            row["host_reference_s_per_image"] = (time.perf_counter() - t) / reps
        out[name] = row
    return out


# Val sets of the dense evaluations (docs/method/dense.md §8) with a typical stored size (H, W).
DENSE_VAL = {"VOC12": (1_449, (375, 500), ("lin", "ms")), "ADE20K": (2_000, (512, 683), ("lin", "ms")),
             "COCO-Stuff": (5_000, (480, 640), ("lin",))}
VIT_S16 = dict(width=384, depth=12, patch=16)  # the DINO configs' backbone
ACCELERATOR_TFLOPS = 300e12  # assumed sustained (~30% of an H200's bf16 dense peak), as above
ACCELERATORS = 8


def window_flops(side: int, width: int = VIT_S16["width"], depth: int = VIT_S16["depth"],
                 patch: int = VIT_S16["patch"]) -> float:
    """Forward FLOPs of a ViT on one side×side window: 2·n·(12·d²) per block for the
    projections and MLP (4d hidden) plus 4·n²·d for QKᵀ and AV (n = 1 + tokens)."""
    n = 1 + (side // patch) ** 2
    return depth * (2 * n * 12 * width**2 + 4 * n * n * width)


def hours_estimate(ratios: dict[str, float]) -> dict[str, dict[str, float]]:
    """ESTIMATE of each test pass on one 8-accelerator host: windows per image (all views) ×
    images × the ViT-S/16 window forward at the assumed throughput × the measured (whole ÷
    forward) ratio of the protocol, over 8 accelerators; plus the probe's 40k train steps of 16
    crops (forward + the head's backward ≈ the forward)."""
    out = {}
    for name, (images, hw, protocols) in DENSE_VAL.items():
        for proto in protocols:
            pr = dense.PROTOCOLS[proto]
            wins = sum(len(dense.windows(v, pr.crop, pr.stride)) * (2 if pr.test_flip else 1)
                       for v in dense.view_sizes(hw, pr))
            forward_s = wins * images * window_flops(pr.crop) / ACCELERATOR_TFLOPS
            test_h = forward_s * ratios[proto] / ACCELERATORS / 3600
            train_h = SEG_STEPS * BATCH * window_flops(pr.crop) / ACCELERATOR_TFLOPS / ACCELERATORS / 3600
            out[f"{name} {proto}"] = {"images": images, "windows_per_image": wins, "test_pass_h": test_h,
                                      "probe_train_h": train_h}
    return out


def print_test_pass(rows: dict[str, dict[str, float]], backbone: str) -> None:
    print(f"\nWhole test pass per image ({backbone}, {jax.device_count()} {jax.devices()[0].platform} devices):")
    print(f"{'protocol':10s} {'input':>22s} {'windows':>8s} {'whole s':>9s} {'forward s':>10s} {'ratio':>6s} "
          f"{'host share s':>13s}")
    for name, r in rows.items():
        print(f"{name:10s} {r['input']:>22s} {r['windows_per_image']:8.0f} {r['whole_s_per_image']:9.2f} "
              f"{r['forward_s_per_image']:10.2f} {r['ratio']:6.2f} {r['host_share_s_per_image']:13.2f}")
    if "host_reference_s_per_image" in rows.get("lin", {}):
        print(f"lin host reference path (numpy resizes): {rows['lin']['host_reference_s_per_image']:.2f} s/image")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="S/16")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "dense_eval.json"))
    ap.add_argument("--test-pass", action="store_true", help="only the whole segmentation test pass")
    # Default: ViT-S/16's width and heads (the DINO configs' backbone) at depth 4, the blocks `ms`
    # reads; the full depth-12 network's forward costs ~3x more, so its ratio is lower still.
    ap.add_argument("--test-width", type=int, default=384)
    ap.add_argument("--test-depth", type=int, default=4)
    ap.add_argument("--test-heads", type=int, default=6)
    ap.add_argument("--test-images", type=int, default=1)
    args = ap.parse_args()
    if args.test_pass:
        rows = test_pass(args.test_width, args.test_depth, args.test_heads, args.test_images)
        backbone = (f"ViT width {args.test_width}, depth {args.test_depth}, {args.test_heads} heads, "
                    "patch 16, random init")
        print_test_pass(rows, backbone)
        estimate = hours_estimate({k: r["ratio"] for k, r in rows.items()})
        print(f"\nESTIMATE, one host of {ACCELERATORS} accelerators at {ACCELERATOR_TFLOPS / 1e12:.0f} TFLOP/s each "
              "(ViT-S/16, this CPU's ratios):")
        for k, e in estimate.items():
            print(f"  {k:16s} {e['images']:6d} images x {e['windows_per_image']:4d} windows: test pass "
                  f"{e['test_pass_h']:.3f} h, probe training {e['probe_train_h']:.3f} h")
        path = args.out.replace(".json", "_test_pass.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"machine": f"{jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} cores visible",
                       "backbone": backbone, "test_pass": rows, "estimate_8_accelerators": estimate}, f, indent=2)
        print(f"wrote {path}")
        return
    rng = np.random.default_rng(0)
    model, ctx = setup(args.variant, args.size)
    p = models.describe(ctx.config.model).token_stride
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, args.size, args.size, 3)))["params"]
    params = jax.device_put(params, sharding.replicated(ctx.mesh))
    hw = (args.size, args.size)
    grid = (args.size // p, args.size // p)
    b = batch(BATCH, hw, rng)

    cut = tc.TokenCut("tc", "tc", None, "x", ctx, dataset="digit_scenes")
    probe = seg.LinearSegmentation("seg", "seg", None, "x", ctx, "x", num_classes=21,
                                   protocol=dense.PROTOCOLS["lin"], dataset="voc12_seg", steps=SEG_STEPS)
    state = probe.init(params, b["image"].shape[1:])
    window = lambda head, x: probe._window_logits(head, params, x)

    rows: dict[str, dict[str, float]] = {}
    t = timed(lambda: cut._keys(params, b), args.reps)
    gflop = flops(cut._keys, params, b) / BATCH / 1e9
    rows["tokencut keys forward"] = {"s_per_image": t / BATCH, "gflop_per_image": gflop}
    keys = np.asarray(jax.device_get(cut._keys(params, b)))[:, 1:]
    rows["tokencut ncut + box (host, float64)"] = {"s_per_image": ncut_seconds(keys, grid, p, max(args.reps, 5) * 3)}
    t = timed(lambda: probe._step(state, params, b), args.reps)
    gflop = flops(probe._step, state, params, b) / BATCH / 1e9
    rows["probe train step"] = {"s_per_image": t / BATCH, "gflop_per_image": gflop}
    head = {"params": state["params"], "stats": state["stats"]}
    t = timed(lambda: window(head, b), args.reps)
    gflop = flops(probe._window_logits, head, params, b) / BATCH / 1e9
    rows["probe window inference"] = {"s_per_image": t / BATCH, "gflop_per_image": gflop}
    voc_like = VocLike()
    for name in ("lin", "ms"):  # the host's share: crops (resize, crop, flip, photometric) per train example
        probe.protocol = dense.PROTOCOLS[name]
        rows[f"probe train crop on the host ({name}, 375x500 → {probe.protocol.crop}²)"] = {
            "s_per_image": host_seconds(lambda: probe.train_batch(voc_like, 0), args.reps) / BATCH}
    probe.protocol = dense.PROTOCOLS["lin"]

    # ---- VOC12 estimate: FLOPs at VOC resolutions (compiled only) and ncut at VOC's token count.
    voc_cut = batch(1, VOC_TOKENCUT_HW, rng)
    voc_crop = batch(BATCH, (SEG_CROP, SEG_CROP), rng)
    voc_state = probe.init(params, voc_crop["image"].shape[1:])
    voc_head = {"params": voc_state["params"], "stats": voc_state["stats"]}
    f_cut = flops(cut._keys, params, voc_cut)
    f_step = flops(probe._step, voc_state, params, voc_crop)
    f_window = flops(probe._window_logits, voc_head, params, voc_crop) / BATCH
    # Windows per VOC val image (~375×500) for each protocol: all test views' sliding windows.
    windows = {name: sum(len(dense.windows(hw_v, pr.crop, pr.stride)) * (2 if pr.test_flip else 1)
                         for hw_v in dense.view_sizes((375, 500), pr))
               for name, pr in dense.PROTOCOLS.items()}
    voc_grid = (VOC_TOKENCUT_HW[0] // p, VOC_TOKENCUT_HW[1] // p)
    voc_keys = rng.normal(size=(3, voc_grid[0] * voc_grid[1], 384))
    ncut_voc = ncut_seconds(voc_keys, voc_grid, p, 3)
    estimate = {
        "tokencut_forward_flops": f_cut * VOC12_TRAINVAL,
        "tokencut_host_ncut_s": ncut_voc * VOC12_TRAINVAL,  # measured here per image x 11,540
        "probe_train_flops": f_step * SEG_STEPS,
        "probe_test_flops": f_window * SEG_WINDOWS * VOC12_VAL,
        "windows_per_val_image": windows,
    }
    seconds = {
        name: {
            "tokencut_forward_s": estimate["tokencut_forward_flops"] / thr,
            "probe_train_s": estimate["probe_train_flops"] / thr,
            "probe_test_s": estimate["probe_test_flops"] / thr,
        }
        for name, thr in ASSUMED_TFLOPS.items()
    }

    result = {
        "machine": f"{jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} cores visible",
        "backbone": f"ViT-{args.variant} at {args.size}, random init, float32, batch {BATCH}",
        "measured": rows,
        "voc12_estimate": {
            "note": "ESTIMATE: XLA-counted FLOPs at VOC resolutions x protocol counts / assumed throughput",
            "flops_per_unit": {
                "tokencut_image_384x512": f_cut, "probe_step_16x512^2": f_step, "probe_window_512^2": f_window,
            },
            "totals": estimate,
            "accelerator_seconds": seconds,
        },
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    print(f"{result['backbone']} on {result['machine']}")
    print(f"{'':40s} {'ms / image':>12s} {'GFLOP / image':>14s}")
    for name, r in rows.items():
        g = r.get("gflop_per_image", math.nan)
        print(f"{name:40s} {1e3 * r['s_per_image']:12.2f} {g:14.2f}")
    print("\nVOC12 — ESTIMATE (XLA FLOPs x protocol counts / assumed sustained throughput):")
    print(f"  TokenCut forward, 11,540 trainval images at 384x512: {f_cut / 1e9:.1f} GFLOP each, "
          f"{estimate['tokencut_forward_flops']:.3g} total")
    print(f"  TokenCut ncut + box on the host (measured here at {voc_grid[0]}x{voc_grid[1]} tokens): "
          f"{1e3 * ncut_voc:.0f} ms/image, {estimate['tokencut_host_ncut_s'] / 60:.1f} min total (this host)")
    print(f"  probe train, 40k steps x 16 crops 512^2: {f_step / 1e12:.2f} TFLOP/step, "
          f"{estimate['probe_train_flops']:.3g} total")
    print(f"  probe test, 1,449 val x {SEG_WINDOWS} windows 512^2: {estimate['probe_test_flops']:.3g} total")
    print(f"  windows per 375x500 val image (all views): lin {windows['lin']} of 512², ms {windows['ms']} of 640² "
          "(ms windows cost ~1.6x a 512² one: not in the totals above)")
    for name, s in seconds.items():
        print(f"  at {name}: TokenCut forward {s['tokencut_forward_s']:.0f} s, "
              f"probe train {s['probe_train_s'] / 60:.1f} min, probe test {s['probe_test_s']:.0f} s")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

"""Host throughput of the project's input pipeline on real JPEG bytes, and the host cores an
accelerator needs.

Generates JPEGs of ImageNet-like sizes and file sizes (400–500 × 333–375 pixels, ~100 KB; the
ImageNet train set averages ~115 KB per image) into an in-memory source that decodes on read
(`record_sources.EncodedSource`, as `tfds.data_source` does), then reads batches through the
trainers' own pipeline (`pipeline.train_batches` / `eval_batches`, the transforms as the
trainers build them with `on_device=True`: uint8 out, normalization and erasing on device):
  train      decode + the DeiT train transform (224², RandAugment 'rand-m9-mstd0.5-inc1',
             random-erasing box 0.25)
  eval       decode + the eval transform (resize 256, centre crop 224)
  multicrop  decode + DINO's multi-crop (2 × 224² + 10 × 96²)
with 0 worker processes (reads in this process), 1 and 2 (`config.input.num_workers`). For
each: images/s (the fastest of `--repeats` runs), the per-step latency distribution, this
process's RSS and each worker's.

From the one-worker train rate r (images per second of the worker's CPU time: one busy core)
it prints, for each accelerator throughput T, the worker processes T needs, ceil(T / r), and
the uint8 bytes/s the host hands the accelerator. Default targets are ViT-B/16 and ViT-S/16 at 224²
estimated from training FLOPs (3 × forward, multiply-adds counted as 2 FLOPs) at a stated MFU,
plus the rate implied by the paper's 0.723-day ViT-B run; pass measured rates with --target.

    OPENBLAS_NUM_THREADS=1 python benchmarks/input_pipeline.py --workers=0,1,2 \
        --output=benchmarks/results/input_pipeline.json
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import ml_collections
import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from skipless_jax import config_blocks
from skipless_jax.data import augment, multicrop, pipeline, record_sources
from skipless_jax.data.transforms import IMAGENET_MEAN, IMAGENET_STD

IMAGENET_TRAIN_IMAGES = 1_281_167
IMAGE_SIZE = 224
DEIT_AUG = dict(randaug="rand-m9-mstd0.5-inc1", scale=(0.08, 1.0), flip=True, reprob=0.25,
                mixup=0.8, cutmix=1.0, mixup_switch_prob=0.5, label_smoothing=0.1)


# ------------------------------------------------------------------------------------------
# Accelerator demand.


def vit_train_flops(width: int, depth: int, mlp_dim: int, patch: int, image: int = IMAGE_SIZE) -> float:
    """Training FLOPs per image: 3 × forward (backward ≈ 2 × forward), a multiply-add = 2."""
    n = (image // patch) ** 2 + 1  # tokens incl. the class token
    per_block = 4 * n * width * width + 2 * n * width * mlp_dim + 2 * n * n * width  # MACs
    embed = (n - 1) * (3 * patch * patch) * width
    return 3 * 2 * (depth * per_block + embed)


VIT_B16 = vit_train_flops(768, 12, 3072, 16)  # ≈ 1.05e11 (forward 17.6 GMACs)
VIT_S16 = vit_train_flops(384, 12, 1536, 16)  # ≈ 2.8e10


def default_targets() -> dict[str, float]:
    """Accelerator throughputs (images/s) the host must feed; estimates, not measurements."""
    tpu_v4, a100, h100 = 275e12, 312e12, 989e12  # peak dense bf16 FLOP/s per chip
    return {
        "paper ViT-B/16 run (300 ep in 0.723 d)": 300 * IMAGENET_TRAIN_IMAGES / (0.723 * 86400),
        "TPU v4 host (4 chips) ViT-B/16 @50% MFU": 4 * tpu_v4 * 0.50 / VIT_B16,
        "TPU v4 host (4 chips) ViT-S/16 @50% MFU": 4 * tpu_v4 * 0.50 / VIT_S16,
        "8xA100 host ViT-B/16 @40% MFU": 8 * a100 * 0.40 / VIT_B16,
        "8xH100 host ViT-B/16 @35% MFU": 8 * h100 * 0.35 / VIT_B16,
    }


# ------------------------------------------------------------------------------------------
# Synthetic ImageNet-like JPEGs.


def _smooth_noise(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A 1/f-like RGB texture: Gaussian noise at octave scales, upsampled bicubic and summed."""
    image = np.zeros((height, width, 3), np.float32)
    for scale, amplitude in ((128, 60), (64, 40), (32, 28), (16, 20), (8, 21), (4, 15), (2, 10)):
        small = rng.normal(0, 1, (max(height // scale, 2), max(width // scale, 2), 3)).astype(np.float32)
        for c in range(3):
            up = Image.fromarray(small[..., c], mode="F").resize((width, height), Image.Resampling.BICUBIC)
            image[..., c] += amplitude * np.asarray(up)
    image += rng.normal(0, 8, image.shape).astype(np.float32)
    return np.clip(image + 120, 0, 255).astype(np.uint8)


def make_jpegs(count: int, seed: int = 0, quality: int = 95) -> list[bytes]:
    """`count` JPEGs, landscape 400–500 × 333–375 (one in six portrait), ~100 KB each."""
    rng = np.random.default_rng(seed)
    jpegs = []
    for _ in range(count):
        width, height = int(rng.integers(400, 501)), int(rng.integers(333, 376))
        if rng.random() < 1 / 6:
            width, height = height, width
        buffer = io.BytesIO()
        Image.fromarray(_smooth_noise(rng, height, width)).save(buffer, "JPEG", quality=quality)
        jpegs.append(buffer.getvalue())
    return jpegs


# ------------------------------------------------------------------------------------------
# Timed work: the project's pipeline over the JPEGs.


def transforms() -> dict[str, Callable]:
    """The per-example transforms the trainers use for ImageNet (uint8 out, `on_device=True`)."""
    deit = ml_collections.ConfigDict(config_blocks.deit_aug())
    train = dataclasses.replace(augment.train_transform(deit, IMAGE_SIZE), uint8=True)
    evaluate = dataclasses.replace(augment.eval_transform(IMAGE_SIZE, 0.875), uint8=True)
    crops = multicrop.MultiCrop(global_size=IMAGE_SIZE, local_size=96, num_local=10, mean=IMAGENET_MEAN,
                                std=IMAGENET_STD, uint8=True)
    return {"train": train, "eval": evaluate, "multicrop": crops}


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker_pids() -> list[int]:
    """This process's pipeline worker processes (spawned children running spawn_main)."""
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == me and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def batches(name: str, source: record_sources.EncodedSource, workers: int, batch_size: int, steps: int) -> Any:
    transform = transforms()[name]
    if name == "eval":  # the split repeated: enough batches to time
        copies = math.ceil((steps + 1) * batch_size / len(source))
        source = record_sources.EncodedSource(source.blobs * copies, np.tile(source.labels, copies))
        return pipeline.eval_batches(source, transform, num_classes=1000, global_batch_size=batch_size,
                                     num_workers=workers)
    return pipeline.train_batches(source, transform, num_classes=1000, global_batch_size=batch_size, seed=0,
                                  num_workers=workers)


def measure(
    name: str, source: record_sources.EncodedSource, workers: int, batch_size: int, steps: int
) -> dict[str, Any]:
    """One run: a warm-up batch (worker start-up excluded), then `steps` timed batches."""
    it = batches(name, source, workers, batch_size, steps)
    first = next(it)
    pids = worker_pids() or [os.getpid()]  # who transforms: the workers, else this process
    cpu0 = [cpu_seconds(pid) for pid in pids]
    latencies, t0 = [], time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        next(it)
        latencies.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    cpu = sum(cpu_seconds(pid) - c for pid, c in zip(pids, cpu0))
    rss = [_rss_mb(pid) for pid in worker_pids()]
    out = dict(images_per_s=steps * batch_size / total, latency_ms=[1e3 * x for x in latencies],
               images_per_cpu_s=steps * batch_size / cpu,
               main_rss_mb=_rss_mb(os.getpid()), worker_rss_mb=rss,
               batch_bytes=int(sum(v.nbytes for v in first.values())))
    it.close()  # stops the workers
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=64, help="distinct JPEGs generated")
    parser.add_argument("--workers", default="0,1,2", help="comma-separated worker-process counts")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="timed batches per run")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved runs per cell; the fastest is kept (shared hosts are noisy)")
    parser.add_argument("--pipelines", default="train,eval,multicrop")
    parser.add_argument("--target", action="append", default=[],
                        help="NAME=IMAGES_PER_S accelerator throughput to size the host for (repeatable)")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    workers = sorted({int(w) for w in args.workers.split(",")})
    names = args.pipelines.split(",")
    for name in names:
        if name not in transforms():
            parser.error(f"--pipelines: {name!r} unknown; allowed {sorted(transforms())}")
    targets = default_targets()
    for item in args.target:
        key, _, value = item.rpartition("=")
        targets[key] = float(value)

    jpegs = make_jpegs(args.images)
    source = record_sources.EncodedSource(jpegs, np.arange(len(jpegs)) % 1000)
    sizes = [Image.open(io.BytesIO(j)).size for j in jpegs]
    jpeg_kb = float(np.mean([len(j) for j in jpegs]) / 1024)
    print(f"{len(jpegs)} JPEGs, mean {jpeg_kb:.0f} KB, mean {np.mean([w for w, _ in sizes]):.0f}x"
          f"{np.mean([h for _, h in sizes]):.0f} px; host: {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}")

    rows = []
    for name in names:
        # Interleaved rounds (0, 1, 2, 0, 1, 2, ...): a slow spell of a shared host hits every count.
        runs_of: dict[int, list[dict[str, Any]]] = {n: [] for n in workers}
        for _ in range(args.repeats):
            for n in workers:
                runs_of[n].append(measure(name, source, n, args.batch_size, args.steps))
        for n in workers:
            runs = runs_of[n]
            best = max(runs, key=lambda r: r["images_per_s"])
            lat = np.concatenate([r["latency_ms"] for r in runs])
            rows.append(dict(pipeline=name, workers=n, images_per_s=best["images_per_s"],
                             runs_images_per_s=[r["images_per_s"] for r in runs],
                             median_images_per_s=float(np.median([r["images_per_s"] for r in runs])),
                             images_per_cpu_s=float(np.median([r["images_per_cpu_s"] for r in runs])),
                             latency_ms={q: float(np.percentile(lat, q)) for q in (50, 90, 99)} | {
                                 "max": float(lat.max())},
                             main_rss_mb=best["main_rss_mb"], worker_rss_mb=best["worker_rss_mb"],
                             bytes_per_image=best["batch_bytes"] / args.batch_size))
        one = next((r["images_per_s"] for r in rows if r["pipeline"] == name and r["workers"] == 1), None)
        for r in rows:
            if r["pipeline"] == name:
                r["vs_1_worker"] = r["images_per_s"] / one if one else None

    print(f"\nbatch {args.batch_size}; latency per step (ms) over {args.repeats} × {args.steps} steps")
    print(f"{'pipeline':<10} {'workers':>7} {'images/s':>9} {'median':>7} {'vs 1 worker':>11} {'p50':>7} {'p90':>7} "
          f"{'p99':>7} {'img/CPU s':>9} "
          f"{'main RSS MB':>11} {'RSS MB per worker':>17} {'KB/image':>8}")
    for r in rows:
        per_worker = f"{np.mean(r['worker_rss_mb']):.0f}" if r["worker_rss_mb"] else "-"
        vs = f"{r['vs_1_worker']:.2f}" if r["vs_1_worker"] else "-"
        lat = r["latency_ms"]
        print(f"{r['pipeline']:<10} {r['workers']:>7} {r['images_per_s']:>9.0f} {r['median_images_per_s']:>7.0f} "
              f"{vs:>11} {lat[50]:>7.0f} "
              f"{lat[90]:>7.0f} {lat[99]:>7.0f} {r['images_per_cpu_s']:>9.0f} {r['main_rss_mb']:>11.0f} "
              f"{per_worker:>17} "
              f"{r['bytes_per_image'] / 1024:>8.0f}")

    # One busy core's rate: the 1-worker run's images per second of the worker's CPU time (steal
    # time and other tenants' load do not count there, unlike wall-clock rates on a shared VM).
    train_one = next((r["images_per_cpu_s"] for r in rows if r["pipeline"] == "train" and r["workers"] == 1), None)
    sizing = []
    if train_one:
        bytes_per_image = IMAGE_SIZE * IMAGE_SIZE * 3
        print(f"\nhost sizing (estimates) for the train transform at {train_one:.0f} images per worker CPU second")
        print(f"{'accelerator throughput':<44} {'images/s':>9} {'workers':>8} {'uint8 GB/s':>11}")
        for key, value in targets.items():
            cores = math.ceil(value / train_one)
            sizing.append(dict(target=key, images_per_s=value, worker_processes=cores,
                               uint8_gb_per_s=value * bytes_per_image / 1e9))
            print(f"{key:<44} {value:>9.0f} {cores:>8d} {value * bytes_per_image / 1e9:>11.2f}")

    result = dict(
        host=dict(cpus=os.cpu_count(), machine=platform.machine(), python=platform.python_version(),
                  pillow=Image.__version__, numpy=np.__version__),
        jpegs=dict(count=len(jpegs), mean_kb=jpeg_kb, mean_width=float(np.mean([w for w, _ in sizes])),
                   mean_height=float(np.mean([h for _, h in sizes]))),
        batch_size=args.batch_size, steps=args.steps, repeats=args.repeats, rows=rows, sizing=sizing,
        flops=dict(vit_b16_train=VIT_B16, vit_s16_train=VIT_S16),
    )
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.output}")
    return result


if __name__ == "__main__":
    main()

"""Host throughput of the ImageNet input transforms, and the host cores an accelerator needs.

Generates JPEGs of ImageNet-like sizes and file sizes (400–500 × 333–375 pixels, ~100 KB; the
ImageNet train set averages ~115 KB per image), then times, per image:
  decode  JPEG → uint8 RGB (PIL, as `tfds.data_source` decodes without OpenCV)
  train   decode + the DeiT train transform (`augment.train_transform`, 224², RandAugment
          'rand-m9-mstd0.5-inc1', random erasing 0.25), float32 out
  eval    decode + the eval transform (resize 256, centre crop 224)
with one worker and with N workers (processes by default; `--mode=threads` shows what
thread-based map workers reach under the GIL). Mixup/cutmix is per batch and negligible.

From the one-worker train rate r (images per CPU second: one fully busy core) it prints, for
each accelerator throughput T (images/s), the busy cores (worker processes) T needs,
ceil(T / r), and the float32 bytes/s the host hands the accelerator. Default targets are
ViT-B/16 and ViT-S/16 at 224² estimated from training FLOPs (3 × forward, multiply-adds
counted as 2 FLOPs) at a stated MFU, plus the rate implied by the paper's 0.723-day ViT-B run;
pass measured rates with --target.

    python benchmarks/input_pipeline.py --workers=1,2 --seconds=10 \
        --output=benchmarks/results/input_pipeline.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable

import ml_collections
import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from skipless_jax.data import augment

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


def decode(jpeg: bytes) -> np.ndarray:
    """JPEG bytes → uint8 (H, W, 3) RGB."""
    with Image.open(io.BytesIO(jpeg)) as image:
        return np.asarray(image.convert("RGB"))


# ------------------------------------------------------------------------------------------
# Timed work. Worker processes fork with the JPEGs and transforms as module globals.

_JPEGS: list[bytes] = []
_TRAIN = augment.train_transform(ml_collections.ConfigDict(DEIT_AUG), IMAGE_SIZE)
_EVAL = augment.eval_transform(IMAGE_SIZE, 0.875)
PIPELINES: dict[str, Callable[[int], float]] = {
    "decode": lambda i: float(decode(_JPEGS[i % len(_JPEGS)])[0, 0, 0]),
    "train": lambda i: float(_TRAIN(decode(_JPEGS[i % len(_JPEGS)]), np.random.default_rng([0, i]))[0, 0, 0]),
    "eval": lambda i: float(_EVAL(decode(_JPEGS[i % len(_JPEGS)]))[0, 0, 0]),
}


def _run_chunk(args: tuple[str, int, int]) -> int:
    name, start, count = args
    fn = PIPELINES[name]
    for i in range(start, start + count):
        fn(i)
    return count


def _rate_one(name: str, seconds: float) -> tuple[float, float]:
    """(images per wall second, images per CPU second) of one worker in this process.

    The CPU-second rate is what one fully busy core delivers; on a shared host it is far less
    disturbed by other processes than the wall-clock rate.
    """
    _run_chunk((name, 0, 8))  # warm caches
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        done += _run_chunk((name, done, 16))
    return done / (time.perf_counter() - start), done / (time.process_time() - cpu)


def _rate_many(name: str, workers: int, seconds: float, rate_one: float, mode: str) -> float:
    """Aggregate images/s of `workers` processes (or threads) sharing chunks of 16 images."""
    total = max(int(rate_one * workers * seconds), 16 * workers)
    chunks = [(name, i, 16) for i in range(0, total, 16)]
    if mode == "processes":
        context = multiprocessing.get_context("fork")
        with context.Pool(workers) as pool:
            pool.map(_run_chunk, [(name, 0, 4)] * workers)  # start-up excluded
            start = time.perf_counter()
            done = sum(pool.imap_unordered(_run_chunk, chunks))
            return done / (time.perf_counter() - start)
    with concurrent.futures.ThreadPoolExecutor(workers) as executor:
        list(executor.map(_run_chunk, [(name, 0, 4)] * workers))
        start = time.perf_counter()
        done = sum(executor.map(_run_chunk, chunks))
        return done / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=64, help="distinct JPEGs generated")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--mode", choices=("processes", "threads"), default="processes")
    parser.add_argument("--seconds", type=float, default=5.0, help="timed seconds per measurement")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements per cell; the fastest is kept (shared hosts are noisy)")
    parser.add_argument("--pipelines", default="decode,train,eval")
    parser.add_argument("--target", action="append", default=[],
                        help="NAME=IMAGES_PER_S accelerator throughput to size the host for (repeatable)")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    workers = sorted({int(w) for w in args.workers.split(",")})
    names = args.pipelines.split(",")
    for name in names:
        if name not in PIPELINES:
            parser.error(f"--pipelines: {name!r} unknown; allowed {sorted(PIPELINES)}")
    targets = default_targets()
    for item in args.target:
        key, _, value = item.rpartition("=")
        targets[key] = float(value)

    _JPEGS[:] = make_jpegs(args.images)
    sizes = [Image.open(io.BytesIO(j)).size for j in _JPEGS]
    jpeg_kb = float(np.mean([len(j) for j in _JPEGS]) / 1024)
    print(f"{len(_JPEGS)} JPEGs, mean {jpeg_kb:.0f} KB, mean {np.mean([w for w, _ in sizes]):.0f}x"
          f"{np.mean([h for _, h in sizes]):.0f} px; host: {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}")

    rows = []
    for name in names:
        measured = [_rate_one(name, args.seconds) for _ in range(args.repeats)]
        one, one_cpu = max(m[0] for m in measured), max(m[1] for m in measured)
        for n in workers:
            rate = one if n == 1 else max(
                _rate_many(name, n, args.seconds, one, args.mode) for _ in range(args.repeats))
            rows.append(dict(pipeline=name, workers=n, mode=args.mode, images_per_s=rate,
                             per_worker=rate / n, scaling=rate / (n * one),
                             cpu_ms_per_image=1e3 / one_cpu, images_per_cpu_s=one_cpu))

    print(f"\n{'pipeline':<8} {'workers':>7} {'images/s':>9} {'per worker':>10} {'scaling':>8} "
          f"{'CPU ms/img':>11} {'img per CPU s':>14}")
    for r in rows:
        print(f"{r['pipeline']:<8} {r['workers']:>7} {r['images_per_s']:>9.0f} {r['per_worker']:>10.0f} "
              f"{r['scaling']:>8.2f} {r['cpu_ms_per_image']:>11.2f} {r['images_per_cpu_s']:>14.0f}")

    train_one = next((r["images_per_cpu_s"] for r in rows if r["pipeline"] == "train" and r["workers"] == 1), None)
    sizing = []
    if train_one:
        bytes_per_image = IMAGE_SIZE * IMAGE_SIZE * 3 * 4
        print(f"\nhost sizing for the train transform at {train_one:.0f} images per CPU second "
              "(one fully busy core per worker process)")
        print(f"{'accelerator throughput':<44} {'images/s':>9} {'workers':>8} {'float32 GB/s':>13}")
        for key, value in targets.items():
            cores = math.ceil(value / train_one)
            sizing.append(dict(target=key, images_per_s=value, worker_processes=cores,
                               float32_gb_per_s=value * bytes_per_image / 1e9))
            print(f"{key:<44} {value:>9.0f} {cores:>8d} {value * bytes_per_image / 1e9:>13.2f}")

    result = dict(
        host=dict(cpus=os.cpu_count(), machine=platform.machine(), python=platform.python_version(),
                  pillow=Image.__version__, numpy=np.__version__),
        jpegs=dict(count=len(_JPEGS), mean_kb=jpeg_kb, mean_width=float(np.mean([w for w, _ in sizes])),
                   mean_height=float(np.mean([h for _, h in sizes]))),
        seconds=args.seconds, repeats=args.repeats, rows=rows, sizing=sizing,
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

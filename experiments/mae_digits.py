r"""MAE on digits, 3 seeds: pre-training with and without DCT Token Graying, then fine-tuning, next
to the same fine-tuning recipe from scratch (docs/results.md, "MAE on digits").

    OPENBLAS_NUM_THREADS=1 python experiments/mae_digits.py --out=docs/figures/mae_digits \
        --workdirs=/tmp/mae_digits_runs

Pre-training runs configs/mae_digits_pretrain.py into `<workdirs>/pretrain_<tg>_seed<s>` (kept:
the fine-tuning runs load them; a rerun reuses a finished one), fine-tuning runs
configs/mae_digits_finetune.py with `init_from` pointing there. Results go to `<out>.json` as runs
finish (a rerun skips finished runs), then a Markdown table to `<out>.md`, and the seed-0
reconstruction pictures are copied to `<out>_reconstruction_<tg>.png`. Worker i of n
(`--worker`, `--workers`) takes every n-th run of each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import numpy as np

import grid

PRETRAIN = {"none": "tg=none", "dct": "tg=dct"}
# fine-tuning row -> (pre-training or None, fine-tuning args)
FINETUNE = {
    "from scratch": (None, ""),
    "MAE pre-training": ("none", ""),
    "MAE + DCT-TG in pre-training": ("dct", ""),
    "MAE + DCT-TG in pre-training and fine-tuning": ("dct", "tg=dct"),
}


def _train(config_name: str, arg: str, workdir: str) -> dict:
    from skipless_jax import trainers

    config = grid.load_config(config_name, arg)
    start = time.time()
    metrics = trainers.get(config.trainer).train_and_evaluate(config, workdir)
    return {**metrics, "wall_s": round(time.time() - start, 1)}


def run_all(out: str, workdirs: str, seeds: list[int], worker: int = 0, workers: int = 1) -> dict:
    path = f"{out}.json"
    pre = [(tg, seed) for tg in PRETRAIN for seed in seeds]
    for tg, seed in pre[worker::workers]:
        key = f"pretrain|{tg}|seed={seed}"
        if key not in grid.load(path):
            workdir = os.path.join(workdirs, f"pretrain_{tg}_seed{seed}")
            grid.merge_save(path, key, _train("mae_digits_pretrain", f"{PRETRAIN[tg]},seed={seed}", workdir))
    runs = [(name, seed) for name in FINETUNE for seed in seeds]
    for name, seed in runs[worker::workers]:
        key = f"finetune|{name}|seed={seed}"
        if key in grid.load(path):
            continue
        source, arg = FINETUNE[name]
        args = [a for a in (arg, f"seed={seed}") if a]
        if source is not None:
            src = os.path.join(workdirs, f"pretrain_{source}_seed{seed}")
            if not os.path.exists(os.path.join(src, "final_metrics.json")):
                continue  # its pre-training is another worker's and not finished yet: rerun later
            args.insert(0, f"init_from={src}")
        workdir = os.path.join(workdirs, f"finetune_{name.replace(' ', '_').replace('+', 'plus')}_seed{seed}")
        shutil.rmtree(workdir, ignore_errors=True)
        grid.merge_save(path, key, _train("mae_digits_finetune", ",".join(args), workdir))
    for tg in PRETRAIN:
        picture = os.path.join(workdirs, f"pretrain_{tg}_seed0", "reconstruction.png")
        if os.path.exists(picture):
            shutil.copy(picture, f"{out}_reconstruction_{tg}.png")
    return grid.load(path)


def _mean_std(values: list[float]) -> str:
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values):.1f}" if values else "n/m"


def table(results: dict, seeds: list[int]) -> str:
    lines = ["| pre-training | kNN accuracy of the encoder (%) | seeds |", "|---|---|---|"]
    for tg in PRETRAIN:
        vals = [results[k]["test_knn_accuracy"] for s in seeds if (k := f"pretrain|{tg}|seed={s}") in results]
        lines.append(f"| MAE, Token Graying {tg} | {_mean_std(vals)} | {len(vals)} |")
    lines += ["", "| fine-tuning | test accuracy (%) | seeds |", "|---|---|---|"]
    for name in FINETUNE:
        vals = [results[k]["test_accuracy"] for s in seeds if (k := f"finetune|{name}|seed={s}") in results]
        lines.append(f"| {name} | {_mean_std(vals)} | {len(vals)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(grid.ROOT, "docs", "figures", "mae_digits"))
    parser.add_argument("--workdirs", default="/tmp/mae_digits_runs")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--worker", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    os.makedirs(args.workdirs, exist_ok=True)
    results = run_all(args.out, args.workdirs, seeds, args.worker, args.workers)
    text = table(results, seeds)
    with open(f"{args.out}.md", "w") as f:
        f.write(text + "\n")
    print(text)
    print(json.dumps({k: v.get("wall_s") for k, v in results.items()}))


if __name__ == "__main__":
    main()

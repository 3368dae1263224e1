r"""MAE on digits, 3 seeds: pre-training with and without DCT Token Graying, then fine-tuning, next
to the same fine-tuning recipe from scratch (docs/results/mae_digits.md).

    OPENBLAS_NUM_THREADS=1 python experiments/mae_digits.py --out=docs/figures/mae_digits \
        [--root=DIR] [--workers=2] [--config.x=y ...]

Both phases train with `python -m skipless_jax.sweep`'s runner into kept folders under --root
(default `<out>_runs`, git-ignored; a rerun resumes; `python -m skipless_jax.report ROOT`
tabulates it), `--config.*` overrides passed to every run of both. Pre-training runs
configs/mae_digits_pretrain.py into `<root>/pretrain/tg=<tg>/seed=<s>`; fine-tuning runs
configs/mae_digits_finetune.py with `init_from` pointing there, into
`<root>/finetune/pretrain=<none|dct|scratch>[/tg=dct]/seed=<s>` (a fine-tuning run whose
pre-training has not finished is left for a rerun). `<out>.json` is written from the finished
runs, then a Markdown table to `<out>.md`, and the seed-0 reconstruction pictures are copied to
`<out>_reconstruction_<tg>.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np

from skipless_jax import report, sweep

PRETRAIN_CONFIG = "configs/mae_digits_pretrain.py"  # relative to the checkout, where the sweep runs its runs
FINETUNE_CONFIG = "configs/mae_digits_finetune.py"
PRETRAIN = {"none": "tg=none", "dct": "tg=dct"}
# fine-tuning row -> (pre-training or None, fine-tuning args)
FINETUNE = {
    "from scratch": (None, ""),
    "MAE pre-training": ("none", ""),
    "MAE + DCT-TG in pre-training": ("dct", ""),
    "MAE + DCT-TG in pre-training and fine-tuning": ("dct", "tg=dct"),
}


def _nested(*args: str) -> str:
    """'a=1', 'b=x,c=2' -> 'a=1/b=x/c=2': one folder per arg, so that a path names no comma
    (it is passed as the config arg init_from) and `report` still reads every arg."""
    return "/".join(a for arg in args for a in arg.split(",") if a)


def pretrain_runs(seeds: list[int]) -> dict[str, sweep.SweepRun]:
    """{result key: its sweep run} of the pre-training."""
    module = sweep.load_config_module(os.path.join(sweep.ROOT, PRETRAIN_CONFIG))
    out = {}
    for tg, arg in PRETRAIN.items():
        for seed in seeds:
            run = sweep.one_run(PRETRAIN_CONFIG, f"{arg},seed={seed}", module)
            out[f"pretrain|{tg}|seed={seed}"] = run._replace(name=_nested("pretrain", arg, f"seed={seed}"))
    return out


def finetune_runs(root: str, seeds: list[int]) -> dict[str, sweep.SweepRun]:
    """{result key: its sweep run} of the fine-tuning, `init_from` the pre-training's folder under `root`."""
    module = sweep.load_config_module(os.path.join(sweep.ROOT, FINETUNE_CONFIG))
    out = {}
    for name, (source, arg) in FINETUNE.items():
        for seed in seeds:
            init = f"init_from={os.path.join(root, _nested('pretrain', PRETRAIN[source], f'seed={seed}'))}," \
                if source else ""
            run = sweep.one_run(FINETUNE_CONFIG, f"{init}{arg},seed={seed}", module)
            folder = _nested("finetune", f"pretrain={source or 'scratch'}", arg, f"seed={seed}")
            out[f"finetune|{name}|seed={seed}"] = run._replace(name=folder)
    return out


def _source(key: str) -> str | None:
    """The key of a fine-tuning run's pre-training (None: from scratch)."""
    _, name, seed = key.split("|")
    source = FINETUNE[name][0]
    return None if source is None else f"pretrain|{source}|{seed}"


def record(workdir: str, metrics: dict) -> dict:
    return {**metrics, "core_hours": report.core_hours(workdir)}


def run_all(out: str, root: str, seeds: list[int], overrides: list[str], workers: int = 1) -> tuple[dict, int]:
    """Trains the unfinished runs of both phases under `root`, writes `<out>.json` from the
    finished ones; (results, the exit status: the fine-tuning's, else the pre-training's)."""
    pre = pretrain_runs(seeds)
    status = sweep.train(list(pre.values()), root, overrides, workers)
    done = {k for k, r in pre.items() if sweep.is_finished(os.path.join(root, r.name), r, overrides)}
    fine = finetune_runs(root, seeds)
    ready = [r for k, r in fine.items() if _source(k) is None or _source(k) in done]  # the others: a rerun
    status = sweep.train(ready, root, overrides, workers) or status
    results = {**sweep.collect(pre, root, overrides, record), **sweep.collect(fine, root, overrides, record)}
    with open(f"{out}.json", "w") as f:
        json.dump(results, f, indent=1)
    for tg, arg in PRETRAIN.items():
        picture = os.path.join(root, _nested("pretrain", arg, "seed=0"), "reconstruction.png")
        if os.path.exists(picture):
            shutil.copy(picture, f"{out}_reconstruction_{tg}.png")
    return results, status


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
    parser.add_argument("--out", default=os.path.join(sweep.ROOT, "docs", "figures", "mae_digits"))
    parser.add_argument("--root", default=None, help="the runs' folders (default <out>_runs)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=1, help="runs at a time")
    args, rest = parser.parse_known_args()
    overrides = sweep.overrides_of(parser, rest)
    seeds = [int(s) for s in args.seeds.split(",")]
    results, status = run_all(args.out, os.path.abspath(args.root or f"{args.out}_runs"), seeds, overrides,
                              args.workers)
    text = table(results, seeds)
    with open(f"{args.out}.md", "w") as f:
        f.write(text + "\n")
    print(text)
    print(json.dumps({k: v.get("wall_s", v.get("core_hours")) for k, v in results.items()}))
    sys.exit(status)


if __name__ == "__main__":
    main()

r"""bf16 against float32 on digits: the quickstart's default (no skips, skipless init, SOAP) and
the standard ViT (both skips, default init, AdamW), each with `config.model.dtype` float32 and
bfloat16 (float32 parameters, bf16 matmuls; docs/design.md), 3 seeds.

    OPENBLAS_NUM_THREADS=1 python experiments/bf16_digits.py --out=docs/figures/bf16_digits

Results go to `<out>.json` as runs finish (a rerun skips finished runs; `--workers=2
--worker=i` in two processes share the grid), then `<out>.md` holds the table.
"""

from __future__ import annotations

import argparse

import grid

VARIANTS = {
    "skipless + init + SOAP": "",
    "standard ViT, AdamW": "skip_sab=True,skip_ffn=True,init=default,opt=adamw",
}
DTYPES = ("float32", "bfloat16")


def run_all(out: str, seeds: list[int], variants: list[str], worker: int = 0, workers: int = 1) -> dict[str, dict]:
    results = {}
    for dtype in DTYPES:
        runs = [grid.Run(f"{name}|{dtype}|seed={seed}", "quickstart", ",".join(filter(None, (arg, f"seed={seed}"))))
                for name, arg in VARIANTS.items() if name in variants for seed in seeds]

        def configure(config, dtype=dtype):
            config.model.dtype = dtype

        results = grid.run_grid(f"{out}.json", runs, configure=configure, worker=worker, workers=workers)
    return results


def summarize(results: dict[str, dict], out: str) -> str:
    import numpy as np

    lines = ["| variant | float32 test accuracy (%) | bfloat16 test accuracy (%) | bf16 − fp32 (points) |",
             "|---|---|---|---|"]
    for name in VARIANTS:
        acc = {d: np.array([v["test_accuracy"] for k, v in sorted(results.items()) if k.startswith(f"{name}|{d}|")])
               * 100 for d in DTYPES}
        if any(len(a) == 0 for a in acc.values()):
            continue
        diff = acc["bfloat16"].mean() - acc["float32"].mean()
        cells = [f"{a.mean():.1f} ± {a.std():.1f} ({', '.join(f'{x:.1f}' for x in a)})" for a in acc.values()]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {diff:+.1f} |")
    table = "\n".join(lines)
    with open(f"{out}.md", "w") as f:
        f.write(table + "\n")
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/figures/bf16_digits")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    grid.add_worker_args(parser)
    args = parser.parse_args()
    variants = args.variants.split(",")
    for name in variants:
        if name not in VARIANTS:
            parser.error(f"--variants: {name!r} is unknown; allowed: {list(VARIANTS)}")
    results = run_all(args.out, [int(s) for s in args.seeds.split(",")], variants, args.worker, args.workers)
    print(summarize(results, args.out))

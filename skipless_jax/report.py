r"""A table of finished runs: `python -m skipless_jax.report`.

    python -m skipless_jax.report DIR... [--format=md|csv] [--mean_over=seed] [--plot=FILE.png]

    python -m skipless_jax.report /tmp/table1 --mean_over=seed --metrics=test_accuracy,test_loss
    python -m skipless_jax.report /tmp/table1 --format=csv > table1.csv
    python -m skipless_jax.report /tmp/table1 --plot=curves.png --plot_metric=train_loss

A run is every folder under a DIR (at any depth) that holds `final_metrics.json`. One row per
run: `run` (its folder relative to DIR), its config args — the `name=value` items of that
folder path, comma-separated in each part as `python -m skipless_jax.sweep` names them, e.g.
`opt=adamw,seed=0` — and every key of its final metrics (`--metrics` keeps some).
`--mean_over=seed` groups the runs by their other args: per metric `<metric>_mean`,
`<metric>_std` (the sample std, ddof=1; docs/method.md §19) and `n`, the group's runs.
Rows are in natural order of their folders (`depth=8` before `depth=12`).
`--plot` draws each run's `--plot_metric` from its `history.jsonl` against the step (matplotlib,
saved; with --mean_over, one colour per group). With `--plot_x=ARG` it draws instead the final
`--plot_metric` (from `final_metrics.json`) against that numeric arg: each run a dot, and per
group of the other args (--mean_over's excluded) a line through the means with ± std bars, e.g.

    python -m skipless_jax.report /tmp/depth --mean_over=seed --plot=depth.png \
        --plot_metric=test_accuracy --plot_x=depth
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from skipless_jax.trainers.outcome import FINAL_METRICS, HISTORY

FORMATS = ("md", "csv")


def run_args(run: str) -> dict[str, str]:
    """'depth=8/opt=adamw,seed=0' -> {'depth': '8', 'opt': 'adamw', 'seed': '0'} (other parts ignored)."""
    out = {}
    for part in run.replace(os.sep, "/").split("/"):
        items = part.split(",")
        if all("=" in item for item in items):
            out.update(item.split("=", 1) for item in items)
    return out


def find_runs(root: str) -> list[str]:
    """The folders under `root` (itself included) that hold final metrics, sorted."""
    if not os.path.isdir(root):
        raise ValueError(f"{root!r} is not a directory")
    return sorted((d for d, _, files in os.walk(root) if FINAL_METRICS in files), key=natural_key)


def natural_key(text: str) -> list[tuple[int, float, str]]:
    """Sort key that orders the numbers inside `text` by value: 'depth=8' < 'depth=12'."""
    return [(0, float(p), "") if i % 2 else (1, 0.0, p) for i, p in enumerate(re.split(r"(\d+(?:\.\d+)?)", text))]


def rows(roots: Sequence[str], metrics: Sequence[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """(one dict per run: run, its args (strings), its final metrics as in the file; its folders)."""
    out, folders, have = [], [], {}
    for root in roots:
        for folder in find_runs(root):
            run = os.path.relpath(folder, root)
            with open(os.path.join(folder, FINAL_METRICS)) as f:
                final = json.load(f)
            have.update(dict.fromkeys(final))
            if metrics is not None:
                final = {k: final[k] for k in metrics if k in final}
            out.append({"run": run, **run_args(run), **final})
            folders.append(folder)
    unknown = [m for m in metrics or () if m not in have]
    if out and unknown:
        raise ValueError(f"--metrics: {', '.join(map(repr, unknown))} is in no run's {FINAL_METRICS}; "
                         f"the runs have: {', '.join(sorted(have))}")
    return out, folders


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """(mean, sample std with ddof=1; nan for one value) of `xs` (docs/method.md §19)."""
    mean = math.fsum(xs) / len(xs)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan
    return mean, std


def mean_over(table: list[dict[str, Any]], key: str, arg_names: Sequence[str]) -> list[dict[str, Any]]:
    """Groups by the args other than `key`: `<m>_mean`, `<m>_std` (ddof=1; nan for one run) and `n`."""
    missing = [r["run"] for r in table if key not in r]
    if missing:
        args = sorted(run_args(missing[0]))
        raise ValueError(f"--mean_over={key}: run {missing[0]!r} has no arg {key}; its args: {args}")
    group_by = [a for a in arg_names if a != key]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in table:
        groups.setdefault(tuple(r.get(a, "") for a in group_by), []).append(r)
    out = []
    for values, members in groups.items():
        row: dict[str, Any] = dict(zip(group_by, values))
        names = [k for k in members[0] if k not in ("run", *arg_names)]
        for m in names:
            xs = [r[m] for r in members if _number(r.get(m))]
            if not xs:
                continue
            row[f"{m}_mean"], row[f"{m}_std"] = mean_std(xs)
        row["n"] = len(members)
        out.append(row)
    return out


def columns(table: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in table:
        cols += [k for k in r if k not in cols]
    return cols


def _md_cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def format_table(table: list[dict[str, Any]], fmt: str) -> str:
    """Markdown (floats to 4 significant digits) or CSV (floats as Python writes them: exact)."""
    cols = columns(table)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, cols, lineterminator="\n")
        writer.writeheader()
        writer.writerows(table)
        return buf.getvalue()
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_md_cell(r.get(c, "")) for c in cols) + " |" for r in table]
    return "\n".join(lines) + "\n"


def read_history(folder: str, metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric` in the folder's history.jsonl (records without it skipped)."""
    steps, values = [], []
    path = os.path.join(folder, HISTORY)
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if metric in record:
                    steps.append(record["step"])
                    values.append(record[metric])
    return steps, values


def plot(
    table: list[dict[str, Any]], folders: Sequence[str], path: str, metric: str, group_by: Sequence[str]
) -> None:
    """Each run's `metric` over steps from its history.jsonl into the PNG `path`."""
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) is left alone

    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    colors: dict[tuple, Any] = {}
    drawn = 0
    for r, folder in zip(table, folders):
        steps, values = read_history(folder, metric)
        if not steps:
            continue
        group = tuple(r.get(a, "") for a in group_by) if group_by else (r["run"],)
        label = None
        if group not in colors:
            colors[group] = f"C{len(colors) % 10}"
            label = ",".join(f"{a}={v}" for a, v in zip(group_by, group)) if group_by else r["run"]
        ax.plot(steps, values, color=colors[group], lw=1, alpha=0.8, label=label)
        drawn += 1
    if not drawn:
        raise ValueError(f"--plot: no run's {HISTORY} has {metric!r}")
    if all(v > 0 for line in ax.get_lines() for v in line.get_ydata()):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_final(
    table: list[dict[str, Any]], path: str, metric: str, x: str, group_by: Sequence[str]
) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """Each run's final `metric` against its numeric arg `x` into the PNG `path`: a dot per run, a
    line through each group's means (groups: the args `group_by` other than `x`) with ± std bars
    (ddof=1, as --mean_over; 0 for one run). Returns {group label: (xs, means, stds)} as drawn."""
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) is left alone

    bad = [r["run"] for r in table if not _is_float(r.get(x))]
    if bad:
        raise ValueError(f"--plot_x={x}: run {bad[0]!r} has no numeric arg {x}; its args: {sorted(run_args(bad[0]))}")
    keys = [a for a in group_by if a != x]
    groups: dict[tuple, dict[float, list[float]]] = {}
    for r in table:
        if _number(r.get(metric)):
            groups.setdefault(tuple(r.get(a, "") for a in keys), {}).setdefault(float(r[x]), []).append(r[metric])
    if not groups:
        raise ValueError(f"--plot: no run's {FINAL_METRICS} has {metric!r}")
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    drawn = {}
    for i, (group, by_x) in enumerate(sorted(groups.items())):
        color, xs = f"C{i % 10}", sorted(by_x)
        means, stds = zip(*(mean_std(by_x[v]) for v in xs))
        means, stds = list(means), [0.0 if math.isnan(sd) else sd for sd in stds]
        label = ",".join(f"{a}={v}" for a, v in zip(keys, group)) or metric
        ax.errorbar(xs, means, yerr=stds, color=color, marker="o", capsize=3, lw=1.5, label=label)
        drawn[label] = (xs, means, stds)
        for v in xs:
            ax.scatter([v] * len(by_x[v]), by_x[v], color=color, s=10, alpha=0.5)
    ax.set_xlabel(x)
    ax.set_ylabel(f"final {metric}")
    ax.set_xticks(sorted({v for by_x in groups.values() for v in by_x}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return drawn


def _is_float(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skipless_jax.report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", metavar="DIR")
    parser.add_argument("--format", default="md", help="md | csv")
    parser.add_argument("--mean_over", default=None, help="an arg to average over, e.g. seed")
    parser.add_argument("--metrics", default=None, help="comma-separated final metrics to keep (default: all)")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw the runs' curves from history.jsonl")
    parser.add_argument("--plot_metric", default="train_loss", help="the history.jsonl key --plot draws")
    parser.add_argument("--plot_x", default=None, metavar="ARG",
                        help="--plot the final --plot_metric against this numeric arg (mean ± std per group)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.format not in FORMATS:
        parser.error(f"--format={args.format!r} is unknown; allowed: {', '.join(FORMATS)}")
    try:
        metrics = args.metrics.split(",") if args.metrics else None
        table, folders = rows(args.dirs, metrics)
        if not table:
            raise ValueError(f"no run (a folder with {FINAL_METRICS}) under {', '.join(args.dirs)}")
        arg_names = columns([run_args(r["run"]) for r in table])
        group_by = [a for a in arg_names if a != args.mean_over] if args.mean_over else []
        if args.plot_x and not args.plot:
            raise ValueError(f"--plot_x={args.plot_x} needs --plot=FILE.png")
        if args.plot_x and args.plot_x not in arg_names:
            raise ValueError(f"--plot_x={args.plot_x} is not an arg of the runs; allowed: {', '.join(arg_names)}")
        if args.plot and args.plot_x:
            plot_final(table, args.plot, args.plot_metric, args.plot_x, group_by or arg_names)
        elif args.plot:
            plot(table, folders, args.plot, args.plot_metric, group_by)
        if args.plot:
            print(f"report: wrote {args.plot}", file=sys.stderr, flush=True)  # stdout: the table
        if args.mean_over:
            table = mean_over(table, args.mean_over, arg_names)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    sys.stdout.write(format_table(table, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())

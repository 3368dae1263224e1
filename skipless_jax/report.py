r"""A table of finished runs, and the papers' claims judged over them: `python -m skipless_jax.report`.

    python -m skipless_jax.report SRC... [--format=md|csv] [--mean_over=seed] [--plot=FILE.png]
        [--config=PATH --grid=NAME] [--claims=PATH[:NAME,...] [--alpha=0.05] [--failed_as=VALUE]]

    python -m skipless_jax.report /tmp/table1 --mean_over=seed --metrics=test_accuracy,test_loss
    python -m skipless_jax.report /tmp/table1 --format=csv > table1.csv
    python -m skipless_jax.report /tmp/table1 --plot=curves.png --plot_metric=train_loss
    python -m skipless_jax.report docs/figures/quickstart_runs.csv --claims=configs/quickstart.py
    python -m skipless_jax.report --refresh=docs/results      # every page's tables, from their commands

A SRC is a folder or a CSV file. Under a folder a run is every folder (at any depth) that holds
`final_metrics.json`, or that a sweep started (`sweep_run.json`) and that has no final metrics:
its run failed, was stopped non-finite or has not finished, and its row has only `status`
("no final metrics"). A CSV file is what `--format=csv` writes (one row per run), so a committed
CSV recomputes every table and verdict. One row per run: `run` (its folder relative to SRC),
its config args — the `name=value` items of that folder path, comma-separated in each part as
`python -m skipless_jax.sweep` names them, e.g. `opt=adamw,seed=0` — and every key of its final
metrics (`--metrics` keeps some; a name no run has is an error). `--config=PATH --grid=NAME`
keeps the runs of one of the config's named grids.
`--mean_over=seed` groups the runs by their other args: per metric `<metric>_mean`,
`<metric>_std` (the sample std, ddof=1; docs/method/reports.md §19) and `<metric>_n`, the number of
runs that have it, then `runs`, the group's runs (those without final metrics included).
Rows are in natural order of their folders (`depth=8` before `depth=12`).
`--claims=PATH[:NAME,...]` judges the `CLAIMS` of that config module (all, or the named ones)
over the runs instead: one row per claim × setting with both cells' n, mean ± std, the gap and
its 95% Welch interval, the Welch, permutation and Mann–Whitney p-values (Fisher's for a
trained-count claim), the Holm-adjusted p within the claim's family (all its rows over every
run of SRC: `--grid` and `:NAME` only choose the rows printed), P(A>B), the lr each cell chose
on validation (a `select` claim), the runs that trained (k/n) and the verdict (`holds`, `not
shown`, `reversed`, `untested`; docs/method/reports.md §19, docs/method/verdicts.md); with `--plot`, a
forest plot of the gaps and their intervals coloured by verdict. A run's args there are the
config's defaults, then its `sweep_run.json`'s args, then its folder's; a printed claim's cell
that matches no run gets one line naming the filters that match nothing. Runs without
final metrics count as not trained and are left out of the tests, unless `--failed_as=VALUE`
gives their value (e.g. 0.1, chance accuracy); the report lists them.
A Markdown file's report blocks — `<!-- report: ARGS -->`, the output of `report ARGS`, then
`<!-- /report -->` — are rewritten from their args by `--refresh=FILE.md` (or `--refresh=DIR`: each
`.md` file in it), which says how many changed (tests/test_results_docs.py checks that the blocks of
docs/results/*.md equal their commands' output).
`--history=KEY[,KEY]` adds each run's `KEY` values of its `history.jsonl` as columns `KEY@STEP`
(a `kind='steps'` claim adds its metric's own), so that a committed CSV keeps the curves the
claims read.
`--plot` draws each run's `--plot_metric` from its `history.jsonl` against the step (matplotlib,
saved; with --mean_over, one colour per group). With `--plot_x=ARG` it draws instead the final
`--plot_metric` (from `final_metrics.json`) against that numeric arg: each run a dot, and per
group of the other args (--mean_over's excluded) a line through the means with ± std bars, e.g.

    python -m skipless_jax.report /tmp/depth --mean_over=seed --plot=depth.png \
        --plot_metric=test_accuracy --plot_x=depth
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import re
import shlex
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from skipless_jax import claims as claims_lib
from skipless_jax import cli, stats
from skipless_jax.trainers.outcome import FINAL_METRICS, HISTORY, RUN_RECORD

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
    """The folders under `root` (itself included) that hold final metrics or a sweep's run
    record, sorted."""
    if not os.path.isdir(root):
        raise ValueError(f"{root!r} is not a directory")
    return sorted((d for d, _, files in os.walk(root) if FINAL_METRICS in files or RUN_RECORD in files),
                  key=natural_key)


def natural_key(text: str) -> list[tuple[int, float, str]]:
    """Sort key that orders the numbers inside `text` by value: 'depth=8' < 'depth=12'."""
    return [(0, float(p), "") if i % 2 else (1, 0.0, p) for i, p in enumerate(re.split(r"(\d+(?:\.\d+)?)", text))]


def record_args(folder: str) -> dict[str, str]:
    """The args of the command a sweep trained the run folder with: the `name=value` items after
    the ':' of its `sweep_run.json`'s config ({} without a readable record)."""
    try:
        with open(os.path.join(folder, RUN_RECORD)) as f:
            config = json.load(f).get("config", "")
    except (OSError, ValueError, AttributeError):
        return {}
    items = [item for item in str(config).partition(":")[2].split(",") if "=" in item]
    return dict(item.split("=", 1) for item in items)


def rows(roots: Sequence[str], metrics: Sequence[str] | None = None, recorded: bool = False,
         curves: Sequence[str] = ()) -> tuple[list[dict[str, Any]], list[str]]:
    """(one dict per run: run, its args (strings), its final metrics as in the file, or `status`
    for a run without final metrics; its folders, None for a CSV's rows). A root is a folder or
    a CSV file that `--format=csv` wrote. `recorded`: a folder's args start from those of its
    `sweep_run.json` (`record_args`), its folder's args winning. `curves`: history.jsonl keys
    added to a folder's row as `<key>@<step>` columns (a CSV's rows have them as written)."""
    out, folders, args_of = [], [], []  # args_of: each row's arg names
    for root in roots:
        if os.path.isfile(root) and root.endswith(".csv"):
            table = read_csv(root)
            out += table
            folders += [None] * len(table)
            args_of += [set(run_args(r["run"])) for r in table]
            continue
        for folder in find_runs(root):
            run = os.path.relpath(folder, root)
            path = os.path.join(folder, FINAL_METRICS)
            if os.path.exists(path):
                with open(path) as f:
                    final = json.load(f)
            else:
                final = {"status": claims_lib.FAILED}
            args = {**record_args(folder), **run_args(run)} if recorded else run_args(run)
            points = {f"{key}@{r['step']}": r[key] for r in (history(folder) if curves else []) for key in curves
                      if key in r}
            out.append({"run": run, **args, **final, **points})
            args_of.append(set(args))
            folders.append(folder)
    if metrics is not None:
        have = columns(out)
        unknown = [m for m in metrics if m not in have]
        if unknown:
            arg_names = set(columns([run_args(r["run"]) for r in out]))
            known = ", ".join(sorted(c for c in have if c not in ("run", "status") and c not in arg_names))
            raise ValueError(f"--metrics: {', '.join(map(repr, unknown))} is in no run's {FINAL_METRICS}; "
                             f"the runs have: {known}")
        out = [{**{k: v for k, v in r.items() if k in ("run", "status") or k in names},
                **{m: r[m] for m in metrics if m in r},
                **{k: v for k, v in r.items() if k.partition("@")[0] in curves}}
               for r, names in zip(out, args_of)]  # --metrics' order
    return out, folders


def read_csv(path: str) -> list[dict[str, Any]]:
    """The per-run rows of a CSV that `--format=csv` wrote: args as strings, numbers as ints or
    floats as written (CSV floats are exact), empty cells absent."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or "run" not in reader.fieldnames:
            raise ValueError(f"{path}: not a per-run table of report (no 'run' column)")
        table = []
        for record in reader:
            args = run_args(record["run"])
            row: dict[str, Any] = {"run": record["run"], **args}
            for k, v in record.items():
                if k in row or v in ("", None):
                    continue
                row[k] = int(v) if v.lstrip("-").isdigit() else float(v) if _is_float(v) else v
            table.append(row)
    return table


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def mean_over(table: list[dict[str, Any]], key: str, arg_names: Sequence[str]) -> list[dict[str, Any]]:
    """Groups by the args other than `key`: `<m>_mean`, `<m>_std` (ddof=1; nan for one run) and
    `<m>_n` (the group's runs that have m) per metric, then `runs` (the group's runs)."""
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
        names = [k for k in columns(members) if k not in ("run", "status", *arg_names)]
        for m in names:
            xs = [r[m] for r in members if _number(r.get(m))]
            if not xs:
                continue
            row[f"{m}_mean"], row[f"{m}_std"] = stats.mean_std(xs)
            row[f"{m}_n"] = len(xs)
        row["runs"] = len(members)
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


def history(folder: str | None) -> list[dict[str, Any]]:
    """Every record of the run folder's history.jsonl, in order ([] without one; None: a CSV's row)."""
    path = os.path.join(folder, HISTORY) if folder is not None else None
    if path is None or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_history(folder: str | None, metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric` in the folder's history.jsonl (records without it skipped)."""
    records = [r for r in history(folder) if metric in r]
    return [r["step"] for r in records], [r[metric] for r in records]


def core_hours(folder: str) -> float | None:
    """The run's `perf/core_hours_total` (devices × wall-clock hours of its training loops, resumes
    summed; start-up, compilation and the final evaluation not counted) from its last train record."""
    values = read_history(folder, "perf/core_hours_total")[1]
    return values[-1] if values else None


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
    fig = Figure(figsize=(11, 4.5))
    ax = fig.subplots()
    drawn = {}
    for i, (group, by_x) in enumerate(sorted(groups.items())):
        color, xs = f"C{i % 10}", sorted(by_x)
        means, stds = zip(*(stats.mean_std(by_x[v]) for v in xs))
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
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the dots
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return drawn


def _is_float(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def grid_runs(config: str, grid: str) -> set[str]:
    """The folder names of a config's grid (`sweep --config=config --grid=grid`)."""
    from skipless_jax import sweep

    return {run.name for run in sweep.expand(config, grid)}


class ClaimsSpec(NamedTuple):
    """What `--claims=PATH[:NAME,...]` names: the claims to print, every claim of their families
    (judged together: the Holm families), the number of classes of the config's dataset (None:
    unknown), the config's arg defaults and its module."""

    printed: list[claims_lib.Claim]
    judged: list[claims_lib.Claim]
    num_classes: int | None
    defaults: dict[str, str]
    module: Any


def config_defaults(module: Any) -> dict[str, str]:
    """The args a config module's `get_config` hands `config_args.parse`, with their defaults as
    strings ({} for a config without `get_config` or args): recorded while `get_config()` runs."""
    from skipless_jax import config_args

    seen: list[dict[str, Any]] = []
    parse = config_args.parse

    def recording(arg: str | None, **defaults: Any) -> dict[str, Any]:
        seen.append(defaults)
        return parse(arg, **defaults)

    config_args.parse = recording
    try:
        module.get_config()
    except (AttributeError, TypeError, ValueError):
        pass  # no get_config, or one that needs its args: no defaults
    finally:
        config_args.parse = parse
    return {k: str(v) for k, v in seen[0].items()} if seen else {}


def load_claims(spec: str) -> ClaimsSpec:
    """The claims of `PATH[:NAME,...]` (all, or the named ones) and what judging them needs."""
    from skipless_jax import sweep

    path, _, names = spec.partition(":")
    module = sweep.load_config_module(path)
    printed = claims_lib.from_module(module, [n for n in names.split(",") if n], path)
    families = {c.family for c in printed}
    judged = [c for c in claims_lib.from_module(module, None, path) if c.family in families]
    try:
        from skipless_jax.data import sources

        num_classes = sources.dataset_info(module.get_config().dataset.name).num_classes
    except (AttributeError, ValueError, KeyError):
        num_classes = None  # claims then need trained_below
    return ClaimsSpec(printed, judged, num_classes, config_defaults(module), module)


def select_value(spec: ClaimsSpec) -> claims_lib.SelectValue:
    """A run's value of a claim's `select` arg: the arg as a number, or where it is not one (unset:
    'None'), the claim's `select_field` of the config built from the run's args."""
    built: dict[str, Any] = {}

    def value(run: dict[str, Any], claim: claims_lib.Claim) -> float:
        if not claim.select_field or _is_float(run.get(claim.select, spec.defaults.get(claim.select))):
            return claims_lib.arg_number(run, claim, spec.defaults)
        from skipless_jax import config_args

        arg = config_args.to_arg({k: run[k] for k in spec.defaults if k in run})
        if arg not in built:
            built[arg] = spec.module.get_config(arg)
        field = built[arg]
        for part in claim.select_field.split("."):
            field = field[part]
        return float(field)

    return value


def judge_claims(spec: ClaimsSpec, table: list[dict[str, Any]], alpha: float, failed_as: float | None,
                 printed_runs: set[str] | None) -> tuple[list[dict[str, Any]], list[str]]:
    """(the rows of the printed claims, in their order, that have a run in `printed_runs` (None:
    all), judged with their families over all of `table`; one line per printed cell that matches
    no run)."""
    verdicts = claims_lib.judge(spec.judged, table, num_classes=spec.num_classes, alpha=alpha,
                                failed_as=failed_as, natural_key=natural_key, defaults=spec.defaults,
                                select_value=select_value(spec))
    order = {c.name: i for i, c in enumerate(spec.printed)}
    shown = [r for r in verdicts if r["claim"] in order and (printed_runs is None or r["_runs"] & printed_runs)]
    shown.sort(key=lambda r: order[r["claim"]])  # stable: each claim's settings stay in order
    notes = [line for c in spec.printed for line in claims_lib.unmatched(c, table, spec.defaults)]
    return shown, notes


def format_claims(rows_: list[dict[str, Any]], claims: Sequence[claims_lib.Claim], fmt: str, alpha: float,
                  failed_as: float | None, notes: Sequence[str] = ()) -> str:
    """The verdicts as CSV (the notes then go to stderr) or Markdown."""
    if fmt == "csv":
        for note in notes:
            print(f"report: {note}", file=sys.stderr, flush=True)
        return format_table(claims_lib.public(rows_), "csv")
    return claims_lib.markdown(rows_, claims, alpha, failed_as, notes)


# A table in a Markdown file made by `report`: the command's args in a comment, its output below,
# up to the closing comment. `--refresh=FILE.md` rewrites every such block from its args; the
# tests check that each block equals its command's output (docs/results/*.md cannot drift).
DOC_BLOCK = re.compile(r"<!-- report: (?P<args>[^\n]+?) -->\n(?P<body>.*?)<!-- /report -->", re.S)


def doc_blocks(text: str) -> list[tuple[list[str], str]]:
    """The (args, body) of each report block of a Markdown text."""
    return [(shlex.split(m["args"]), m["body"]) for m in DOC_BLOCK.finditer(text)]


def render(argv: Sequence[str]) -> str:
    """What `python -m skipless_jax.report ARGV` prints (a ValueError where it fails)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    if status != 0:
        raise ValueError(f"report {shlex.join(argv)}: {err.getvalue().strip()}")
    return out.getvalue()


def refresh(path: str) -> tuple[int, int]:
    """Rewrites each report block of the Markdown file `path` from its args: (the blocks whose
    text changed, all blocks). The file is written only when one changed."""
    with open(path) as f:
        text = f.read()
    blocks = list(DOC_BLOCK.finditer(text))
    changed = 0
    for m in reversed(blocks):
        body = render(shlex.split(m["args"]))
        changed += body != m["body"]
        text = text[: m.start("body")] + body + text[m.end("body"):]
    if changed:
        with open(path, "w") as f:
            f.write(text)
    return changed, len(blocks)


def _flag_number(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag}={text!r} is not a number") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skipless_jax.report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="*", metavar="SRC", help="a sweep root (folder) or a CSV of --format=csv")
    parser.add_argument("--refresh", default=None, metavar="FILE.md|DIR",
                        help="rewrite the report blocks (<!-- report: ARGS -->) of the file, or of each .md "
                             "file of the folder, from their args")
    parser.add_argument("--format", default="md", help="md | csv")
    parser.add_argument("--mean_over", default=None, help="an arg to average over, e.g. seed")
    parser.add_argument("--metrics", default=None, help="comma-separated final metrics to keep (default: all)")
    parser.add_argument("--config", default=None, metavar="PATH[:args]", help="with --grid: the config of the grid")
    parser.add_argument("--grid", default=None, metavar="NAME", help="keep the runs of this named grid of --config")
    parser.add_argument("--claims", default=None, metavar="PATH[:NAME,...]",
                        help="judge the CLAIMS of this config module (all, or the named ones) over the runs")
    parser.add_argument("--alpha", default="0.05", help="--claims: the family-wise level (Holm)")
    parser.add_argument("--failed_as", default=None, metavar="VALUE",
                        help="--claims: the value of a run without final metrics (default: left out)")
    parser.add_argument("--history", default=None, metavar="KEY[,KEY]",
                        help="add each run's history.jsonl values of these keys as <key>@<step> columns")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw the runs' curves from history.jsonl")
    parser.add_argument("--plot_metric", default="train_loss", help="the history.jsonl key --plot draws")
    parser.add_argument("--plot_x", default=None, metavar="ARG",
                        help="--plot the final --plot_metric against this numeric arg (mean ± std per group)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.format not in FORMATS:
        parser.error(f"--format={args.format!r} is unknown; allowed: {', '.join(FORMATS)}")
    if bool(args.refresh) == bool(args.dirs):
        parser.error("give SRC... (a sweep root or a CSV), or --refresh=FILE.md alone")
    try:
        if args.refresh:
            paths = [args.refresh]
            if os.path.isdir(args.refresh):  # a folder of pages: each .md file, in name order
                paths = [os.path.join(args.refresh, n) for n in sorted(os.listdir(args.refresh)) if n.endswith(".md")]
            for path in paths:
                changed, total = refresh(path)
                print(f"report: {changed} of {total} table(s) of {path} changed (each rewritten from its command)")
            return 0
        if bool(args.grid) != bool(args.config):
            raise ValueError("--grid=NAME and --config=PATH go together")
        if args.claims and (args.mean_over or args.plot_x):
            raise ValueError("--claims is its own table: drop --mean_over / --plot_x")
        alpha = _flag_number("--alpha", args.alpha)
        failed_as = None if args.failed_as is None else _flag_number("--failed_as", args.failed_as)
        spec = load_claims(args.claims) if args.claims else None
        metrics = args.metrics.split(",") if args.metrics else None
        curves = [k for k in (args.history or "").split(",") if k]
        if spec is not None:  # a steps-to-target claim reads its metric's curve
            curves += [c.metric for c in spec.judged if c.kind == "steps" and c.metric not in curves]
        table, folders = rows(args.dirs, metrics, recorded=spec is not None, curves=curves)
        names = grid_runs(args.config, args.grid) if args.grid else None
        if spec is not None:  # the families are judged over every run; --grid chooses the rows printed
            if not table:
                raise ValueError(f"no run (a folder with {FINAL_METRICS}) under {', '.join(args.dirs)}")
            verdicts, notes = judge_claims(spec, table, alpha, failed_as, names)
            if args.plot:
                claims_lib.plot(verdicts, args.plot)
            sys.stdout.write(format_claims(verdicts, spec.printed, args.format, alpha, failed_as, notes))
            return 0
        if names is not None:
            kept = [(r, f) for r, f in zip(table, folders) if r["run"] in names]
            table, folders = [r for r, _ in kept], [f for _, f in kept]
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
    except OSError as err:  # a folder that cannot take --refresh's or --plot's file: one line (cli.write_error)
        written = ("--refresh", args.refresh) if args.refresh else ("--plot", args.plot)
        if isinstance(err, FileNotFoundError) or written[1] is None:
            raise
        return cli.say_write_error(err, *written)
    sys.stdout.write(format_table(table, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())

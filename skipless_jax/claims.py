"""The papers' claims as code, judged over seeds (docs/method.md §19).

A config module may define `CLAIMS` beside `GRIDS`: a claim's name -> a dict of the `Claim`
fields below but `name`. Cells A and B are arg filters over the runs (the `name=value` args of
their folders, as `report` reads them), e.g.

    CLAIMS = {
        "init_beats_default_adamw": dict(
            a={"skip_sab": "False", "skip_ffn": "False", "init": "skipless", "opt": "adamw"},
            b={"skip_sab": "False", "skip_ffn": "False", "init": "default", "opt": "adamw"},
            per=("depth",),
        ),
    }

`judge` gives one row per claim × setting (the values of its `per` args among the runs of
either cell; a run without one of them has the value "", so runs that differ in any `per` arg
are never pooled): the two cells' values, `stats.compare`, the Holm-adjusted p over all the rows
judged together, runs that trained as k/n per cell, and the verdict (method.md §19).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from skipless_jax import stats

VERDICTS = ("holds", "not shown", "reversed", "untested")
FAILED = "no final metrics"  # a run folder whose run failed, stopped non-finite or has not finished
OPPOSITE = {"greater": "less", "less": "greater"}


@dataclasses.dataclass(frozen=True)
class Claim:
    """H1: the `metric` of cell A, plus `margin`, is `alternative` than cell B's, in each setting
    of the `per` args. A run trained when its final `trained_metric` is below `trained_below`
    (None: half the chance-level loss, ½ ln(number of classes) of the config's dataset)."""

    name: str
    a: Mapping[str, str]
    b: Mapping[str, str]
    metric: str = "test_accuracy"
    alternative: str = "greater"
    margin: float = 0.0
    per: tuple[str, ...] = ()
    trained_metric: str = "train_loss"
    trained_below: float | None = None
    text: str = ""  # the claim in words, for the report's legend

    def __post_init__(self):
        where = f"claim {self.name!r}"
        if self.alternative not in stats.ALTERNATIVES:
            raise ValueError(f"{where}: alternative={self.alternative!r}; allowed: {', '.join(stats.ALTERNATIVES)}")
        for cell in ("a", "b"):
            value = getattr(self, cell)
            if not isinstance(value, Mapping) or not value:
                raise ValueError(f"{where}: cell {cell} must be a non-empty dict of arg filters, got {value!r}")
            object.__setattr__(self, cell, {str(k): str(v) for k, v in value.items()})
        if isinstance(self.per, str):
            object.__setattr__(self, "per", (self.per,))
        object.__setattr__(self, "per", tuple(self.per))
        if not math.isfinite(self.margin) or self.margin < 0:
            raise ValueError(f"{where}: margin={self.margin} must be a finite number >= 0")


def from_module(module: Any, names: Sequence[str] | None = None, path: str = "the config") -> list[Claim]:
    """The claims of a config module's `CLAIMS` (all, or `names` in that order)."""
    table = getattr(module, "CLAIMS", None)
    if not table:
        raise ValueError(f"{path} defines no CLAIMS")
    fields = {f.name for f in dataclasses.fields(Claim)} - {"name"}
    out = {}
    for name, spec in table.items():
        unknown = sorted(set(spec) - fields)
        if unknown:
            raise ValueError(f"claim {name!r} of {path}: unknown field(s) {unknown}; allowed: {sorted(fields)}")
        out[name] = Claim(name=name, **spec)
    if names:
        missing = [n for n in names if n not in out]
        if missing:
            raise ValueError(f"--claims: {missing[0]!r} is not a claim of {path}; its claims: {', '.join(out)}")
        return [out[n] for n in names]
    return list(out.values())


def _matches(run: Mapping[str, Any], cell: Mapping[str, str]) -> bool:
    return all(str(run.get(k, "")) == v for k, v in cell.items())


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _cell_values(runs: Sequence[Mapping[str, Any]], claim: Claim, threshold: float, failed_as: float | None):
    """(values for the test, trained count, the runs without final metrics (folders): left out
    of the test, or counted as `failed_as`)."""
    values, trained, failed = [], 0, []
    for r in runs:
        loss = r.get(claim.trained_metric)
        trained += bool(_finite(loss) and loss < threshold)
        if r.get("status") == FAILED or not _finite(r.get(claim.metric)):
            failed.append(r["run"])
            if failed_as is not None:
                values.append(failed_as)
        else:
            values.append(float(r[claim.metric]))
    return values, trained, failed


def judge(
    claims: Iterable[Claim],
    table: Sequence[Mapping[str, Any]],
    *,
    num_classes: int | None = None,
    alpha: float = 0.05,
    failed_as: float | None = None,
    natural_key: Any = str,
) -> list[dict[str, Any]]:
    """One row per claim × setting over the runs of `table` (report's rows: `run`, its args, its
    final metrics, `status` for runs without final metrics); verdicts by method.md §19."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"--alpha={alpha} must be in (0, 1)")
    out = []
    for claim in claims:
        threshold = claim.trained_below
        if threshold is None:
            if not num_classes or num_classes < 2:
                raise ValueError(f"claim {claim.name!r}: trained_below is not set and the number of classes is unknown")
            threshold = 0.5 * math.log(num_classes)
        cells = {c: [r for r in table if _matches(r, getattr(claim, c))] for c in ("a", "b")}
        settings = sorted({tuple(str(r.get(k, "")) for k in claim.per) for rs in cells.values() for r in rs},
                          key=lambda s: natural_key(",".join(s)))
        for setting in settings:
            named = ",".join(f"{k}={v}" for k, v in zip(claim.per, setting) if v)  # an absent arg: not shown
            row: dict[str, Any] = {"claim": claim.name, "setting": named or "all", "margin": claim.margin}
            failed = []
            for c in ("a", "b"):
                members = [r for r in cells[c] if tuple(str(r.get(k, "")) for k in claim.per) == setting]
                values, trained, failed_runs = _cell_values(members, claim, threshold, failed_as)
                row[f"n_{c}"] = len(values)
                row[f"mean_{c}"], row[f"std_{c}"] = stats.mean_std(values)
                row[f"trained_{c}"] = f"{trained}/{len(members)}"
                row[f"_values_{c}"] = values
                failed += failed_runs
            row["left_out"] = 0 if failed_as is not None else len(failed)  # of the test
            row["failed_runs"] = ";".join(failed)  # without final metrics, left out or counted as failed_as
            def compare(alternative: str, row=row, claim=claim) -> stats.Comparison:
                return stats.compare(row["_values_a"], row["_values_b"], alternative=alternative, margin=claim.margin)

            c = compare(claim.alternative) if min(row["n_a"], row["n_b"]) >= 2 else None
            if c is not None:
                row.update(gap=c.gap, ci_low=c.ci_low, ci_high=c.ci_high, p_welch=c.p_welch,
                           p_permutation=c.p_permutation, p_mannwhitney=c.p_mannwhitney,
                           prob_superiority=c.prob_superiority)
                row["_p"] = _deciding(c)
                if claim.alternative in OPPOSITE:
                    row["_p_reverse"] = _deciding(compare(OPPOSITE[claim.alternative]))
            out.append(row)
    tested = [r for r in out if "_p" in r]
    for key, adjusted in (("_p", "p_holm"), ("_p_reverse", "_p_holm_reverse")):
        with_p = [r for r in tested if key in r]
        for r, p in zip(with_p, stats.holm([r[key] for r in with_p]) if with_p else []):
            r[adjusted] = p
    for r in out:
        if "_p" not in r:
            r["verdict"] = "untested"
        elif r["p_holm"] <= alpha:
            r["verdict"] = "holds"
        elif r.get("_p_holm_reverse", 1.0) <= alpha:
            r["verdict"] = "reversed"
        else:
            r["verdict"] = "not shown"
    return out


def _deciding(c: stats.Comparison) -> float:
    """The p that decides (method.md §19): the larger of Welch's and the permutation test's; the
    permutation p alone where Welch's is undefined (both cells without variance)."""
    return c.p_permutation if math.isnan(c.p_welch) else max(c.p_welch, c.p_permutation)


PUBLIC = ("claim", "setting", "n_a", "n_b", "mean_a", "std_a", "mean_b", "std_b", "gap", "ci_low", "ci_high",
          "p_welch", "p_permutation", "p_mannwhitney", "p_holm", "prob_superiority", "trained_a", "trained_b",
          "left_out", "failed_runs", "verdict")


def _g(v: Any, digits: int) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}g}"


def markdown(rows: Sequence[Mapping[str, Any]], claims: Sequence[Claim], alpha: float,
             failed_as: float | None) -> str:
    """The verdict table, its legend and the runs left out, as Markdown."""
    head = ["claim", "setting", "n_a", "n_b", "A mean ± std", "B mean ± std", "gap", "95% CI", "p_welch",
            "p_perm", "p_mw", "p_holm", "P(A>B)", "trained A", "trained B", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ci = f"[{_g(r['ci_low'], 3)}, {_g(r['ci_high'], 3)}]" if "ci_low" in r and not math.isnan(r["ci_low"]) else ""
        cells = [r["claim"], r["setting"], str(r["n_a"]), str(r["n_b"]),
                 f"{_g(r['mean_a'], 4)} ± {_g(r['std_a'], 2)}".strip(" ±"),
                 f"{_g(r['mean_b'], 4)} ± {_g(r['std_b'], 2)}".strip(" ±"),
                 _g(r.get("gap"), 3), ci, _g(r.get("p_welch"), 3), _g(r.get("p_permutation"), 3),
                 _g(r.get("p_mannwhitney"), 3), _g(r.get("p_holm"), 3), _g(r.get("prob_superiority"), 3),
                 r["trained_a"], r["trained_b"], f"**{r['verdict']}**"]
        lines.append("| " + " | ".join(cells) + " |")
    tested = sum("_p" in r for r in rows)
    lines.append("")
    lines.append(f"Verdicts at α = {alpha:g}, Holm over the {tested} tested rows; p_holm adjusts max(p_welch, p_perm).")
    for c in claims:
        margin = f", margin {c.margin:g}" if c.margin else ""
        what = f"{c.text}: " if c.text else ""
        lines.append(f"- `{c.name}`: {what}A = {_filter(c.a)} vs B = {_filter(c.b)}; "
                     f"{c.metric}, H1 A {_SYMBOL[c.alternative]} B{margin}, per {', '.join(c.per) or '-'}.")
    left = list(dict.fromkeys(run for r in rows for run in r["failed_runs"].split(";") if run))
    how = f"counted as {failed_as:g}" if failed_as is not None else "left out of the tests"
    if left:
        lines.append(f"- {len(left)} run(s) without final metrics (failed, non-finite or unfinished), {how}: "
                     + ", ".join(f"`{run}`" for run in left) + ".")
    else:
        lines.append("- 0 runs without final metrics left out.")
    return "\n".join(lines) + "\n"


_SYMBOL = {"greater": ">", "less": "<", "two-sided": "≠"}


def _filter(cell: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in cell.items())


COLORS = {"holds": "tab:green", "not shown": "tab:gray", "reversed": "tab:red", "untested": "white"}


def plot(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """A forest plot into the PNG `path`: each tested row's gap (mean A − mean B) with its 95 %
    Welch interval, coloured by verdict, the claim's −margin line where it has one. Drawn on a
    matplotlib `Figure` (no backend is chosen)."""
    from matplotlib.figure import Figure

    tested = [r for r in rows if "gap" in r]
    if not tested:
        raise ValueError("--plot: no claim row has two cells with at least 2 values each")
    fig = Figure(figsize=(7.5, 0.35 * len(tested) + 1.2))
    ax = fig.subplots()
    for y, r in enumerate(reversed(tested)):
        color = COLORS[r["verdict"]]
        low, high = r["ci_low"], r["ci_high"]
        if not math.isnan(low):
            ax.plot([low, high], [y, y], color=color, lw=2)
        ax.plot([r["gap"]], [y], "o", color=color, ms=5)
        if r.get("margin"):
            ax.plot([-r["margin"]] * 2, [y - 0.4, y + 0.4], color="k", lw=1, ls=":")
    ax.axvline(0.0, color="k", lw=0.8)
    ax.set_yticks(range(len(tested)), [f"{r['claim']} {r['setting']}" for r in reversed(tested)], fontsize=7)
    ax.set_xlabel("gap = mean A − mean B, with its 95 % Welch interval")
    for verdict, color in COLORS.items():
        if verdict != "untested" and any(r["verdict"] == verdict for r in tested):
            ax.plot([], [], "o-", color=color, label=verdict)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def public(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows' public columns (for CSV)."""
    return [{k: r.get(k, "") for k in PUBLIC} for r in rows]

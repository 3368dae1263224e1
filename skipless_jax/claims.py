"""The papers' claims as code, judged over seeds (docs/method/reports.md §19, docs/method/verdicts.md).

A config module may define `CLAIMS` beside `GRIDS`: a claim's name -> a dict of the `Claim`
fields below but `name`. Cells A and B are arg filters over the runs (a run's args: the config's
defaults, its sweep record's args and its folder's `name=value` parts, as `report` reads them),
e.g.

    CLAIMS = {
        "init_beats_default_adamw": dict(
            a={"skip_sab": "False", "skip_ffn": "False", "init": "skipless", "opt": "adamw"},
            b={"skip_sab": "False", "skip_ffn": "False", "init": "default", "opt": "adamw"},
            per=("depth",),
        ),
    }

A run's value is its final `metric`, or what the claim derives from the run's row: `metric`
minus another final metric (`minus`, e.g. the loss a quantization adds), the largest or smallest
of the metrics a pattern matches (`reduce`, e.g. 'val_kurtosis_layer_*'), or for `kind='steps'`
the log2 of the first step its `metric` curve reaches a target (columns `<metric>@<step>`, that
`report --history` reads from each run's history; docs/method/verdicts.md).

`judge` gives one row per claim × setting (the values of its `per` args among the runs of
either cell, as the runs give them: "" where a run does not, so runs that differ in any `per` arg
are never pooled): the two cells' values, `stats.compare` (or `stats.fisher_exact` on the trained
counts for `kind='trained'`), the Holm-adjusted p within the claim's `family` (every row of the
family over every run judged, whatever is printed), runs that trained as k/n per cell, and the
verdict (docs/method/reports.md §19). With `select='lr'` each cell chooses its lr on validation first.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from skipless_jax import stats

VERDICTS = ("holds", "not shown", "reversed", "untested")
KINDS = ("mean", "trained", "steps")
REDUCE = ("max", "min")
REACH = ("below", "above")
FAILED = "no final metrics"  # a run folder whose run failed, stopped non-finite or has not finished
OPPOSITE = {"greater": "less", "less": "greater"}


@dataclasses.dataclass(frozen=True)
class Claim:
    """H1: the `metric` of cell A, plus `margin`, is `alternative` than cell B's, in each setting
    of the `per` args (`kind='trained'`: A's runs train more often than B's, Fisher's exact
    test). A run trained when its final `trained_metric` is below `trained_below` (None: half
    the chance-level loss, ½ ln(number of classes) of the config's dataset). `family`: the Holm
    family (default: the claim's name). `select`: an arg each cell chooses per setting, the
    value whose runs' mean `select_by` is the largest (`select_max`; the smallest otherwise);
    `select_field` is the config field that gives it where a run leaves the arg unset
    (docs/method/verdicts.md). `minus`, `reduce`: the run's value derived as the module says;
    `kind='steps'`: the value is log2 of the first step at which the run's `metric` is at or
    `reach` ('below' | 'above') the target, cell A's mean `metric` at `target_step` in the same
    setting; a run that never reaches it counts log2 of twice its last recorded step (a margin
    of log2(r) then reads "B takes under r× A's steps")."""

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
    family: str = ""
    kind: str = "mean"
    select: str = ""
    select_by: str = "val_accuracy"
    select_max: bool = True
    select_field: str = ""
    minus: str = ""
    reduce: str = ""
    target_step: int = 0
    reach: str = "below"

    def __post_init__(self):
        where = f"claim {self.name!r}"
        if self.alternative not in stats.ALTERNATIVES:
            raise ValueError(f"{where}: alternative={self.alternative!r}; allowed: {', '.join(stats.ALTERNATIVES)}")
        if self.kind not in KINDS:
            raise ValueError(f"{where}: kind={self.kind!r}; allowed: {', '.join(KINDS)}")
        for cell in ("a", "b"):
            value = getattr(self, cell)
            if not isinstance(value, Mapping) or not value:
                raise ValueError(f"{where}: cell {cell} must be a non-empty dict of arg filters, got {value!r}")
            object.__setattr__(self, cell, {str(k): str(v) for k, v in value.items()})
        if isinstance(self.per, str):
            object.__setattr__(self, "per", (self.per,))
        object.__setattr__(self, "per", tuple(self.per))
        object.__setattr__(self, "family", self.family or self.name)
        if not math.isfinite(self.margin) or self.margin < 0:
            raise ValueError(f"{where}: margin={self.margin} must be a finite number >= 0")
        if self.kind == "trained" and (self.margin or self.select):
            raise ValueError(f"{where}: kind='trained' (Fisher's exact test on trained counts) takes no margin or "
                             f"select; got margin={self.margin}, select={self.select!r}")
        if ("*" in self.metric) != bool(self.reduce) or self.reduce not in ("", *REDUCE):
            raise ValueError(f"{where}: metric={self.metric!r} with reduce={self.reduce!r}; a metric pattern "
                             f"(with '*') takes reduce= {' | '.join(REDUCE)}, a metric name none")
        if self.kind == "steps":
            if not (isinstance(self.target_step, int) and self.target_step > 0) or self.reach not in REACH:
                raise ValueError(f"{where}: kind='steps' needs target_step > 0 and reach in {', '.join(REACH)}; got "
                                 f"target_step={self.target_step!r}, reach={self.reach!r}")
            if self.select or self.minus or self.reduce:
                raise ValueError(f"{where}: kind='steps' reads one metric's curve; it takes no select, minus or reduce")
        elif self.target_step:
            raise ValueError(f"{where}: target_step={self.target_step} is for kind='steps', not kind={self.kind!r}")
        if self.select and self.select in self.per:
            raise ValueError(f"{where}: select={self.select!r} is also in per={self.per}; an arg is chosen "
                             "per cell or judged per setting, not both")


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


def _arg(run: Mapping[str, Any], key: str, defaults: Mapping[str, str]) -> str:
    return str(run[key]) if key in run else defaults.get(key, "")


def _filter_matches(run: Mapping[str, Any], key: str, value: str, defaults: Mapping[str, str]) -> bool:
    """One filter: "" matches a run that does not give the arg itself; another value, the run's
    arg or else its default."""
    return str(run.get(key, "")) == "" if value == "" else _arg(run, key, defaults) == value


def _matches(run: Mapping[str, Any], cell: Mapping[str, str], defaults: Mapping[str, str]) -> bool:
    return all(_filter_matches(run, k, v, defaults) for k, v in cell.items())


def unmatched(claim: Claim, table: Sequence[Mapping[str, Any]], defaults: Mapping[str, str] | None = None
              ) -> list[str]:
    """One line per cell of `claim` that matches no run of `table`: the filters that match none
    on their own, or that each matches some run but not all of them together."""
    defaults = defaults or {}
    lines = []
    for c in ("a", "b"):
        cell = getattr(claim, c)
        if any(_matches(r, cell, defaults) for r in table):
            continue
        empty = [f"{k}={v}" for k, v in cell.items() if not any(_filter_matches(r, k, v, defaults) for r in table)]
        why = (f"{', '.join(empty)} {'matches' if len(empty) == 1 else 'match'} none of the {len(table)} runs"
               if empty else f"each of {_filter(cell)} matches some run, never all together")
        lines.append(f"`{claim.name}`: cell {c.upper()} matches no run: {why}.")
    return lines


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def run_value(run: Mapping[str, Any], claim: Claim) -> float | None:
    """The run's value of a `kind='mean'` claim: its final `metric`, less `minus`, or the `reduce`
    of the metrics `metric` matches (None: the run lacks one)."""
    if claim.reduce:
        found = [float(v) for k, v in run.items() if fnmatch.fnmatchcase(k, claim.metric) and _finite(v)]
        return (max if claim.reduce == "max" else min)(found) if found else None
    value = run.get(claim.metric)
    if not _finite(value):
        return None
    if claim.minus:
        other = run.get(claim.minus)
        return float(value) - float(other) if _finite(other) else None
    return float(value)


def curve(run: Mapping[str, Any], metric: str) -> list[tuple[int, float]]:
    """The run's (step, value) pairs of `metric` from its `<metric>@<step>` columns, by step."""
    head = metric + "@"
    return sorted((int(k[len(head):]), float(v)) for k, v in run.items()
                  if k.startswith(head) and k[len(head):].isdigit() and _finite(v))


def steps_to_target(run: Mapping[str, Any], claim: Claim, target: float | None) -> float | None:
    """log2 of the first step at which the run's curve reaches `target` (`claim.reach`), log2 of
    twice its last step where it never does; None without a curve or a target."""
    points = curve(run, claim.metric)
    if not points or target is None:
        return None
    for step, value in points:
        if step > 0 and (value <= target if claim.reach == "below" else value >= target):
            return math.log2(step)
    return math.log2(2 * max(points[-1][0], 1))


def target_of(runs: Sequence[Mapping[str, Any]], claim: Claim) -> float | None:
    """Cell A's mean `metric` at `claim.target_step` over its runs that recorded it."""
    at = [float(r[key]) for r in runs if _finite(r.get(key := f"{claim.metric}@{claim.target_step}"))]
    return sum(at) / len(at) if at else None


def value_function(claim: Claim, target: float | None = None) -> Callable[[Mapping[str, Any]], float | None]:
    """run -> the value `claim` tests (`run_value`, or `steps_to_target` of `target`)."""
    if claim.kind == "steps":
        return lambda run: steps_to_target(run, claim, target)
    return lambda run: run_value(run, claim)


def _cell_values(runs: Sequence[Mapping[str, Any]], claim: Claim, threshold: float, failed_as: float | None,
                 value_of: Callable[[Mapping[str, Any]], float | None]):
    """(values for the test, trained count, the runs without a value (folders): left out of the
    test, or counted as `failed_as`)."""
    values, trained, failed = [], 0, []
    for r in runs:
        loss = r.get(claim.trained_metric)
        trained += bool(_finite(loss) and loss < threshold)
        value = None if r.get("status") == FAILED else value_of(r)
        if value is None:
            failed.append(r["run"])
            if failed_as is not None:
                values.append(failed_as)
        else:
            values.append(value)
    return values, trained, failed


SelectValue = Callable[[Mapping[str, Any], Claim], float]


def choose(runs: Sequence[Mapping[str, Any]], claim: Claim, value_of: SelectValue
           ) -> tuple[list[Mapping[str, Any]], float | None, list[float]]:
    """(the runs of the chosen value, the value, the values tried, ascending): the value of
    `claim.select` whose runs' mean `select_by` is best (largest, or smallest without
    `select_max`; a tie: the smaller value); no run with `select_by`: ([], None, values)."""
    groups: dict[float, list[Mapping[str, Any]]] = {}
    for r in runs:
        groups.setdefault(value_of(r, claim), []).append(r)
    grid = sorted(groups)
    scores = {v: stats.mean_std([float(r[claim.select_by]) for r in rs if _finite(r.get(claim.select_by))])[0]
              for v, rs in groups.items()}
    scored = [v for v in grid if not math.isnan(scores[v])]
    if not scored:
        return [], None, grid
    sign = -1.0 if claim.select_max else 1.0
    best = min(scored, key=lambda v: (sign * scores[v], v))
    return groups[best], best, grid


def interior(value: float | None, grid: Sequence[float]) -> bool:
    """Whether a chosen value lies strictly inside a grid of at least 3 values."""
    return value is not None and len(grid) >= 3 and grid[0] < value < grid[-1]


def arg_number(run: Mapping[str, Any], claim: Claim, defaults: Mapping[str, str]) -> float:
    """The run's `claim.select` arg (its own, else the default) as a number; a one-line error if not."""
    text = _arg(run, claim.select, defaults)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"claim {claim.name!r}: run {run['run']!r} has {claim.select}={text!r}, not a number; "
                         "the claim's select_field names the config field that gives it") from None


def judge(
    claims: Iterable[Claim],
    table: Sequence[Mapping[str, Any]],
    *,
    num_classes: int | None = None,
    alpha: float = 0.05,
    failed_as: float | None = None,
    natural_key: Any = str,
    defaults: Mapping[str, str] | None = None,
    select_value: SelectValue | None = None,
) -> list[dict[str, Any]]:
    """One row per claim × setting over the runs of `table` (report's rows: `run`, its args, its
    final metrics, `status` for runs without final metrics; an arg a run lacks is its `defaults`
    value); verdicts by docs/method/reports.md §19 with Holm within each claim's family over these rows."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"--alpha={alpha} must be in (0, 1)")
    defaults = defaults or {}
    select_value = select_value or (lambda run, claim: arg_number(run, claim, defaults))
    out = []
    for claim in claims:
        threshold = claim.trained_below
        if threshold is None:
            if not num_classes or num_classes < 2:
                raise ValueError(f"claim {claim.name!r}: trained_below is not set and the number of classes is unknown")
            threshold = 0.5 * math.log(num_classes)
        cells = {c: [r for r in table if _matches(r, getattr(claim, c), defaults)] for c in ("a", "b")}
        settings = sorted({tuple(str(r.get(k, "")) for k in claim.per) for rs in cells.values() for r in rs},
                          key=lambda s: natural_key(",".join(s)))
        for setting in settings:
            named = ",".join(f"{k}={v}" for k, v in zip(claim.per, setting) if v)  # an absent arg: not shown
            row: dict[str, Any] = {"claim": claim.name, "setting": named or "all", "margin": claim.margin,
                                   "family": claim.family, "kind": claim.kind, "_runs": set()}
            failed = []
            members_of = {c: [r for r in cells[c] if tuple(str(r.get(k, "")) for k in claim.per) == setting]
                          for c in ("a", "b")}
            if claim.kind == "steps":
                row["target"] = target_of(members_of["a"], claim)
            value_of = value_function(claim, row.get("target"))
            for c in ("a", "b"):
                members = members_of[c]
                row["_runs"] |= {r["run"] for r in members}
                if claim.select:
                    members, chosen, grid = choose(members, claim, select_value)
                    row[f"chosen_{c}"], row[f"interior_{c}"] = chosen, interior(chosen, grid)
                values, trained, failed_runs = _cell_values(members, claim, threshold, failed_as, value_of)
                if claim.kind == "trained":
                    row[f"n_{c}"], row[f"_k_{c}"] = len(members), trained
                    row[f"mean_{c}"], row[f"std_{c}"] = trained / len(members) if members else math.nan, math.nan
                else:
                    row[f"n_{c}"] = len(values)
                    row[f"mean_{c}"], row[f"std_{c}"] = stats.mean_std(values)
                row[f"trained_{c}"] = f"{trained}/{len(members)}"
                row[f"_values_{c}"] = values
                failed += failed_runs
            row["left_out"] = 0 if failed_as is not None or claim.kind == "trained" else len(failed)  # of the test
            row["failed_runs"] = ";".join(failed)  # without final metrics, left out or counted as failed_as
            if min(row["n_a"], row["n_b"]) >= 2:
                _test(row, claim)
            out.append(row)
    families: dict[str, list[dict[str, Any]]] = {}
    for r in out:
        if "_p" in r:
            families.setdefault(r["family"], []).append(r)
    for members in families.values():
        for key, adjusted in (("_p", "p_holm"), ("_p_reverse", "_p_holm_reverse")):
            with_p = [r for r in members if key in r]
            for r, p in zip(with_p, stats.holm([r[key] for r in with_p]) if with_p else []):
                r[adjusted] = p
        for r in members:
            r["family_size"] = len(members)
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


def _test(row: dict[str, Any], claim: Claim) -> None:
    """The row's tests, its deciding p (`_p`) and that of the opposite alternative (`_p_reverse`)."""
    if claim.kind == "trained":
        def fisher(alternative: str) -> float:
            return stats.fisher_exact(row["_k_a"], row["n_a"], row["_k_b"], row["n_b"], alternative)

        row.update(gap=row["mean_a"] - row["mean_b"], p_fisher=fisher(claim.alternative))
        row["_p"] = row["p_fisher"]
        if claim.alternative in OPPOSITE:
            row["_p_reverse"] = fisher(OPPOSITE[claim.alternative])
        return

    def compare(alternative: str) -> stats.Comparison:
        return stats.compare(row["_values_a"], row["_values_b"], alternative=alternative, margin=claim.margin)

    c = compare(claim.alternative)
    row.update(gap=c.gap, ci_low=c.ci_low, ci_high=c.ci_high, p_welch=c.p_welch, p_permutation=c.p_permutation,
               p_mannwhitney=c.p_mannwhitney, prob_superiority=c.prob_superiority)
    row["_p"] = _deciding(c)
    if claim.alternative in OPPOSITE:
        row["_p_reverse"] = _deciding(compare(OPPOSITE[claim.alternative]))


def _deciding(c: stats.Comparison) -> float:
    """The p that decides (docs/method/reports.md §19): the larger of Welch's and the permutation test's; the
    permutation p alone where Welch's is undefined (both cells without variance)."""
    return c.p_permutation if math.isnan(c.p_welch) else max(c.p_welch, c.p_permutation)


PUBLIC = ("claim", "setting", "family", "kind", "n_a", "n_b", "mean_a", "std_a", "mean_b", "std_b", "gap",
          "ci_low", "ci_high", "p_welch", "p_permutation", "p_mannwhitney", "p_fisher", "p_holm", "family_size",
          "prob_superiority", "target", "chosen_a", "interior_a", "chosen_b", "interior_b", "trained_a", "trained_b",
          "left_out", "failed_runs", "verdict")


def _g(v: Any, digits: int) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}g}"


def _chosen(r: Mapping[str, Any], select: str) -> str:
    """'A lr=0.001; B lr=0.0003, not interior' (the values each cell chose on validation)."""
    parts = []
    for c in ("a", "b"):
        value = r.get(f"chosen_{c}")
        text = f"{c.upper()} {select}={_g(value, 4) or '-'}"
        parts.append(text if r.get(f"interior_{c}") else f"{text}, not interior")
    return "; ".join(parts)


def markdown(rows: Sequence[Mapping[str, Any]], claims: Sequence[Claim], alpha: float,
             failed_as: float | None, notes: Sequence[str] = ()) -> str:
    """The verdict table, its legend (the claims with rows here), `notes` (e.g. cells that
    match no run) and the runs left out, as Markdown. A p_fisher column where a row is a
    trained-count claim, a `chosen` column where a row chose an arg on validation."""
    by_name = {c.name: c for c in claims}
    fisher = any(r.get("kind") == "trained" for r in rows)
    chosen = any("chosen_a" in r for r in rows)
    head = ["claim", "setting", "n_a", "n_b", "A mean ± std", "B mean ± std", "gap", "95% CI", "p_welch",
            "p_perm", "p_mw", *(["p_fisher"] if fisher else []), "p_holm", "P(A>B)",
            *(["chosen on validation"] if chosen else []), "trained A", "trained B", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ci = f"[{_g(r['ci_low'], 3)}, {_g(r['ci_high'], 3)}]" if "ci_low" in r and not math.isnan(r["ci_low"]) else ""
        select = by_name[r["claim"]].select if r["claim"] in by_name else ""
        cells = [r["claim"], r["setting"], str(r["n_a"]), str(r["n_b"]),
                 f"{_g(r['mean_a'], 4)} ± {_g(r['std_a'], 2)}".strip(" ±"),
                 f"{_g(r['mean_b'], 4)} ± {_g(r['std_b'], 2)}".strip(" ±"),
                 _g(r.get("gap"), 3), ci, _g(r.get("p_welch"), 3), _g(r.get("p_permutation"), 3),
                 _g(r.get("p_mannwhitney"), 3), *([_g(r.get("p_fisher"), 3)] if fisher else []),
                 _g(r.get("p_holm"), 3), _g(r.get("prob_superiority"), 3),
                 *([_chosen(r, select) if "chosen_a" in r else ""] if chosen else []),
                 r["trained_a"], r["trained_b"], f"**{r['verdict']}**"]
        lines.append("| " + " | ".join(cells) + " |")
    sizes = {r["family"]: r["family_size"] for r in rows if "family_size" in r}
    lines.append("")
    deciding = "max(p_welch, p_perm)" + (" (p_fisher for a trained-count claim)" if fisher else "")
    if sizes:
        families = ", ".join(f"`{f}` {n} row{'s' if n > 1 else ''}" for f, n in sizes.items())
        lines.append(f"Verdicts at α = {alpha:g}; p_holm is Holm's adjustment of {deciding} within each claim's "
                     f"family (every tested row of it over these runs, printed or not): {families}.")
    else:
        lines.append(f"Verdicts at α = {alpha:g}; no row has at least 2 runs in each cell, so none is tested.")
    shown = {r["claim"] for r in rows}
    for c in claims:
        if c.name not in shown:
            continue
        margin = f", margin {c.margin:g}" if c.margin else ""
        what = f"{c.text}: " if c.text else ""
        test = (f"runs trained (k/n), Fisher's exact test, H1 A {_SYMBOL[c.alternative]} B" if c.kind == "trained"
                else f"{_measured(c, rows)}, H1 A {_SYMBOL[c.alternative]} B{margin}")
        select = (f"; each cell's {c.select} chosen by the {'largest' if c.select_max else 'smallest'} mean "
                  f"{c.select_by}" if c.select else "")
        lines.append(f"- `{c.name}`: {what}A = {_filter(c.a)} vs B = {_filter(c.b)}; "
                     f"{test}, per {', '.join(c.per) or '-'}{select}.")
    lines += [f"- {note}" for note in notes]
    def failed(kinds: tuple[str, ...]) -> list[str]:
        return list(dict.fromkeys(run for r in rows if r.get("kind", "mean") in kinds
                                  for run in r["failed_runs"].split(";") if run))

    left, untrained = failed(("mean",)), failed(("trained",))
    how = f"counted as {failed_as:g}" if failed_as is not None else "left out of the tests"
    if left:
        lines.append(f"- {len(left)} run(s) without final metrics (failed, non-finite or unfinished), {how}: "
                     + ", ".join(f"`{run}`" for run in left) + ".")
    else:
        lines.append("- 0 runs without final metrics left out.")
    if untrained:
        lines.append(f"- {len(untrained)} run(s) without final metrics counted as not trained in the trained-count "
                     "tests: " + ", ".join(f"`{run}`" for run in untrained) + ".")
    return "\n".join(lines) + "\n"


_SYMBOL = {"greater": ">", "less": "<", "two-sided": "≠"}


def _measured(c: Claim, rows: Sequence[Mapping[str, Any]]) -> str:
    """What a claim's values are, in words (with each setting's target for `kind='steps'`)."""
    if c.kind == "steps":
        targets = ", ".join(f"{r['setting']} {_g(r.get('target'), 4) or '-'}" for r in rows if r["claim"] == c.name)
        return (f"log2 of the steps until {c.metric} is {c.reach} the target, A's mean at step {c.target_step} "
                f"({targets}; never reached: log2 of twice the last step)")
    if c.reduce:
        return f"the {c.reduce} of {c.metric}"
    return f"{c.metric} − {c.minus}" if c.minus else c.metric


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
        low, high = r.get("ci_low", math.nan), r.get("ci_high", math.nan)
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

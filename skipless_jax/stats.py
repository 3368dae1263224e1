"""Two-sample tests over seeds, and Holm's correction (docs/method/reports.md §19).

    from skipless_jax import stats
    c = stats.compare(skipless_init_accuracies, default_init_accuracies)   # H1: mean(a) > mean(b)
    c.p_welch, c.p_permutation, c.p_mannwhitney, c.ci_low, c.ci_high
    stats.holm([c.p_welch for c in comparisons])

Each test is computed here from its definition (numpy, and scipy's t and normal distributions);
tests/test_stats.py checks them against scipy's `ttest_ind`, `permutation_test`,
`mannwhitneyu` and `fisher_exact`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np
from scipy import special
from scipy import stats as scipy_stats

ALTERNATIVES = ("greater", "less", "two-sided")
FLOAT32_UNIT = 2.0**-24  # float32's unit roundoff: the relative error of a metric stored in float32


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Cell A against cell B (docs/method/reports.md §19). `gap`, the interval and `prob_superiority` describe
    a and b as they are; the p-values test a + margin against b."""

    n_a: int
    n_b: int
    gap: float  # mean(a) − mean(b)
    ci_low: float  # two-sided Welch interval of μa − μb at `confidence` (no margin)
    ci_high: float
    welch_t: float  # NaN where both cells have zero variance
    welch_df: float
    p_welch: float
    p_permutation: float  # difference of means over the re-splits of the pooled values
    p_mannwhitney: float
    prob_superiority: float  # P(A > B) + ½ P(A = B) over the n_a · n_b pairs


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """(mean, sample std with ddof=1) of `xs` (docs/method/reports.md §19): std NaN for one value, both NaN for none."""
    if not len(xs):
        return math.nan, math.nan
    mean = math.fsum(xs) / len(xs)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan
    return mean, std


def _values(x: Sequence[float], name: str) -> np.ndarray:
    v = np.asarray(x, dtype=np.float64).reshape(-1)
    if v.size < 2:
        raise ValueError(f"cell {name} has {v.size} value(s); a comparison needs at least 2 per cell")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"cell {name} has non-finite values {v.tolist()}; allowed: finite numbers")
    return v


def _tail(stat_cdf: float, stat_sf: float, alternative: str) -> float:
    if alternative == "greater":
        return stat_sf
    if alternative == "less":
        return stat_cdf
    return min(1.0, 2.0 * min(stat_cdf, stat_sf))


def welch(a: np.ndarray, b: np.ndarray, alternative: str) -> tuple[float, float, float]:
    """(t, df, p) of Welch's unequal-variance t test of mean(a) against mean(b); NaNs where both
    samples have zero variance (the statistic is 0/0 or ±∞ there, and has no t distribution)."""
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    if va + vb == 0.0:
        return math.nan, math.nan, math.nan
    t = (a.mean() - b.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    return float(t), float(df), float(_tail(scipy_stats.t.cdf(t, df), scipy_stats.t.sf(t, df), alternative))


def permutation_pvalue(a: np.ndarray, b: np.ndarray, alternative: str, permutations: int, seed: int) -> float:
    """p of the difference of means over the re-splits of the pooled values into groups of
    a.size and b.size: all C(n, n_a) splits when there are at most `permutations` of them
    (exact; the observed split is one of them), else `permutations` random splits from `seed`
    with the observed one added (p = (k + 1) / (R + 1)), as scipy's `permutation_test`.

    With the pooled total fixed, mean(A) − mean(B) = sum(A)·(1/n_a + 1/n_b) − total/n_b is
    increasing in sum(A), so splits are compared by their A-sums. Two sums within
    2 · n_a · 2⁻²⁴ · max|pooled| + 100 float64 ulp of Σ|pooled| count as equal
    (docs/method/verdicts.md §6): float32 accuracies k/N carry rounding errors of up to 2⁻²⁴
    each, so splits equal in counts (tied values, the observed split itself) differ by about
    that much, while distinct sums of k/N differ by at least 1/N."""
    pooled = np.concatenate([a, b])
    n, n_a = pooled.size, a.size
    splits = math.comb(n, n_a)
    if splits <= permutations:
        chosen = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(n), n_a)),
                             dtype=np.int64, count=splits * n_a).reshape(splits, n_a)
        adjustment, resamples = 0, splits
    else:
        rng = np.random.default_rng(seed)
        chosen = np.argsort(rng.random((permutations, n)), axis=1)[:, :n_a]
        adjustment, resamples = 1, permutations
    sums = pooled[chosen].sum(axis=1)
    observed = math.fsum(a)
    tolerance = (2 * n_a * FLOAT32_UNIT * float(np.max(np.abs(pooled)))
                 + 100 * np.finfo(np.float64).eps * math.fsum(np.abs(pooled)))
    p_less = (np.count_nonzero(sums <= observed + tolerance) + adjustment) / (resamples + adjustment)
    p_greater = (np.count_nonzero(sums >= observed - tolerance) + adjustment) / (resamples + adjustment)
    return float(min(1.0, _tail(p_less, p_greater, alternative)))


def _u_counts(n1: int, n2: int) -> np.ndarray:
    """Number of orderings of n1 + n2 distinct values giving each U = 0..n1·n2 for the first
    sample (the recursion f(m, k, u) = f(m − 1, k, u − k) + f(m, k − 1, u)), as floats."""
    counts = np.zeros((n1 + 1, n1 * n2 + 1))  # counts[m, u] for the current k
    counts[:, 0] = 1.0  # k = 0: only U = 0
    for k in range(1, n2 + 1):
        new = np.zeros_like(counts)
        new[0, 0] = 1.0
        for m in range(1, n1 + 1):
            new[m] = counts[m]  # the largest value is from the second sample: U unchanged
            new[m, k:] += new[m - 1, :-k]  # from the first sample: it beats all k of the second
        counts = new
    return counts[n1]


def mann_whitney(a: np.ndarray, b: np.ndarray, alternative: str) -> tuple[float, float]:
    """(U of a, p) of the Mann–Whitney U test as scipy's `method="auto"` chooses: exact when a
    sample has at most 8 values and there are no ties, else the normal approximation with the
    tie correction and the continuity correction."""
    n1, n2 = a.size, b.size
    pooled = np.concatenate([a, b])
    ranks = scipy_stats.rankdata(pooled)  # average ranks for ties
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2)
    u2 = n1 * n2 - u1
    u, factor = {"greater": (u1, 1), "less": (u2, 1)}.get(alternative, (max(u1, u2), 2))
    _, tie_counts = np.unique(pooled, return_counts=True)
    if (n1 <= 8 or n2 <= 8) and np.all(tie_counts == 1):
        counts = _u_counts(n1, n2)
        p = counts[int(round(u)):].sum() / counts.sum()
    else:
        n = n1 + n2
        tie_term = float(np.sum(tie_counts.astype(np.float64) ** 3 - tie_counts))
        s = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1))))
        p = special.ndtr(-(u - n1 * n2 / 2 - 0.5) / s) if s > 0 else math.nan
    return u1, float(min(1.0, max(0.0, p * factor)))


def compare(
    a: Sequence[float],
    b: Sequence[float],
    *,
    alternative: str = "greater",
    margin: float = 0.0,
    confidence: float = 0.95,
    permutations: int = 100_000,
    seed: int = 0,
) -> Comparison:
    """Cell A (per-run values `a`) against cell B (`b`), docs/method/reports.md §19.

    The tests compare a + margin with b: with alternative="greater" and margin δ > 0 this is
    non-inferiority, H1: μa > μb − δ. Fewer than 2 values in a cell is a ValueError.
    """
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative={alternative!r} is unknown; allowed: {', '.join(ALTERNATIVES)}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    if permutations < 1:
        raise ValueError(f"permutations={permutations} must be at least 1")
    a, b = _values(a, "A"), _values(b, "B")
    shifted = a + margin
    t, df, p_welch = welch(shifted, b, alternative)
    gap = float(a.mean() - b.mean())
    if math.isnan(df):
        ci_low = ci_high = math.nan
    else:
        half = scipy_stats.t.ppf(0.5 + confidence / 2, df) * math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
        ci_low, ci_high = gap - half, gap + half
    u_plain, _ = mann_whitney(a, b, "greater")
    _, p_mw = mann_whitney(shifted, b, alternative)
    return Comparison(
        n_a=int(a.size),
        n_b=int(b.size),
        gap=gap,
        ci_low=float(ci_low),
        ci_high=float(ci_high),
        welch_t=t,
        welch_df=df,
        p_welch=p_welch,
        p_permutation=permutation_pvalue(shifted, b, alternative, permutations, seed),
        p_mannwhitney=p_mw,
        prob_superiority=u_plain / (a.size * b.size),
    )


def fisher_exact(k_a: int, n_a: int, k_b: int, n_b: int, alternative: str = "greater") -> float:
    """Fisher's exact p for "cell A's runs succeed (train) more often than B's" from the counts:
    k_a of n_a against k_b of n_b (docs/method/verdicts.md §3). Given the margins, k_a is
    hypergeometric, P(x) = C(K, x) C(N − K, n_a − x) / C(N, n_a) with N = n_a + n_b, K = k_a + k_b;
    greater: P(X ≥ k_a), less: P(X ≤ k_a), two-sided: the sum of the P(x) ≤ P(k_a). Exact
    integer ratios (scipy's `fisher_exact` compares the two-sided terms with a 1e-7 tolerance)."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative={alternative!r} is unknown; allowed: {', '.join(ALTERNATIVES)}")
    for k, n, name in ((k_a, n_a, "A"), (k_b, n_b, "B")):
        if not 0 <= k <= n or n < 1:
            raise ValueError(f"cell {name}: {k} of {n} runs; allowed: 0 <= k <= n, n >= 1")
    total, successes = n_a + n_b, k_a + k_b
    support = range(max(0, successes - n_b), min(successes, n_a) + 1)
    weight = {x: math.comb(successes, x) * math.comb(total - successes, n_a - x) for x in support}
    if alternative == "greater":
        tail = sum(w for x, w in weight.items() if x >= k_a)
    elif alternative == "less":
        tail = sum(w for x, w in weight.items() if x <= k_a)
    else:
        tail = sum(w for w in weight.values() if w <= weight[k_a])
    return float(min(1.0, tail / math.comb(total, n_a)))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: the i-th smallest p (1-based)
    becomes max over j ≤ i of min(1, (m − j + 1) · p_(j)), so the adjusted values keep the
    order of the raw ones and never exceed 1. NaN inputs are a ValueError."""
    p = np.asarray(pvalues, dtype=np.float64).reshape(-1)
    if np.any(np.isnan(p)) or np.any((p < 0) | (p > 1)):
        raise ValueError(f"holm: p-values must be numbers in [0, 1]; got {p.tolist()}")
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out.tolist()

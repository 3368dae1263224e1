"""skipless_jax.stats against scipy (Welch, permutation, Mann–Whitney) and a plain reading of
Holm, on random, tied and small samples, for every alternative and with a margin."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as ss

from skipless_jax import stats

ALTERNATIVES = ("greater", "less", "two-sided")
# scipy's t test warns on the cell without variance ("catastrophic cancellation"): expected there.
pytestmark = pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")


def _samples():
    """(name, a, b): random, tied (values on a 1-point grid, as accuracies of 360 images tie),
    small (3 vs 3, 5 vs 5), unequal sizes, and one cell without variance."""
    rng = np.random.default_rng(0)
    yield "random 5v5", rng.normal(0.9, 0.02, 5), rng.normal(0.88, 0.05, 5)
    yield "random 3v3", rng.normal(0.5, 0.1, 3), rng.normal(0.6, 0.1, 3)
    yield "random 4v9", rng.normal(0.0, 1.0, 4), rng.normal(0.3, 2.0, 9)
    yield "tied 5v5", np.round(rng.normal(90, 2, 5)) / 64, np.round(rng.normal(89, 2, 5)) / 64  # exact sums
    yield "tied 3v3", np.array([0.1, 0.1, 0.2]), np.array([0.1, 0.2, 0.2])
    yield "tied 10v10", np.round(rng.normal(5, 1, 10)), np.round(rng.normal(5.5, 1, 10))
    yield "constant a 5v5", np.full(5, 0.1), rng.normal(0.7, 0.3, 5)


CASES = [(name, a, b, alt, margin) for name, a, b in _samples() for alt in ALTERNATIVES for margin in (0.0, 0.015)]


@pytest.mark.parametrize("name,a,b,alternative,margin", CASES, ids=[f"{c[0]}-{c[3]}-m{c[4]}" for c in CASES])
def test_compare_equals_scipy(name, a, b, alternative, margin):
    c = stats.compare(a, b, alternative=alternative, margin=margin)
    welch = ss.ttest_ind(a + margin, b, equal_var=False, alternative=alternative)
    assert (c.n_a, c.n_b) == (a.size, b.size)
    assert c.gap == pytest.approx(a.mean() - b.mean(), abs=1e-12)
    assert c.welch_t == pytest.approx(float(welch.statistic), abs=1e-10, rel=1e-10)
    assert c.welch_df == pytest.approx(float(welch.df), abs=1e-10, rel=1e-10)
    assert c.p_welch == pytest.approx(float(welch.pvalue), abs=1e-10)
    low, high = ss.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (c.ci_low, c.ci_high) == (pytest.approx(low, abs=1e-10), pytest.approx(high, abs=1e-10))
    mw = ss.mannwhitneyu(a + margin, b, alternative=alternative, method="auto")
    assert c.p_mannwhitney == pytest.approx(float(mw.pvalue), abs=1e-10)
    u_plain = ss.mannwhitneyu(a, b, method="auto").statistic
    assert c.prob_superiority == pytest.approx(u_plain / (a.size * b.size), abs=1e-12)
    perm = ss.permutation_test((a + margin, b), lambda x, y, axis: x.mean(axis) - y.mean(axis),
                               permutation_type="independent", alternative=alternative, vectorized=True,
                               n_resamples=100_000, rng=np.random.default_rng(0))
    if math.comb(a.size + b.size, a.size) <= 100_000:  # exact in both
        assert c.p_permutation == pytest.approx(float(perm.pvalue), abs=1e-10)
    else:  # random splits in both (independent draws): 5 standard deviations of their difference,
        # each a mean of 100,000 Bernoulli draws of the one-sided p (doubled when two-sided)
        p = float(perm.pvalue)
        sides = 2 if alternative == "two-sided" else 1
        q = min(p / sides, 0.5)
        sd_difference = math.sqrt(2 * sides**2 * q * (1 - q) / 100_000)
        assert c.p_permutation == pytest.approx(p, abs=5 * sd_difference)


def test_exact_permutation_p_counts_splits_equal_in_exact_arithmetic():
    """Accuracies tie on a grid of 1/100 (not exact in binary): the splits whose means equal the
    observed in exact arithmetic all count, as a count over Fractions gives. (scipy's tolerance is
    relative to the observed statistic, so near-zero gaps can separate such splits by rounding.)"""
    from fractions import Fraction

    a = [0.90, 0.91, 0.89, 0.92, 0.90]
    b = [0.91, 0.90, 0.88, 0.92, 0.89]
    exact_a = [Fraction(round(x * 100), 100) for x in a]
    pooled = exact_a + [Fraction(round(x * 100), 100) for x in b]
    observed = sum(exact_a)
    splits = list(itertools.combinations(range(10), 5))
    p_greater = sum(sum(pooled[i] for i in s) >= observed for s in splits) / len(splits)
    p_less = sum(sum(pooled[i] for i in s) <= observed for s in splits) / len(splits)
    assert stats.compare(a, b).p_permutation == pytest.approx(p_greater, abs=1e-15)
    assert stats.compare(a, b, alternative="less").p_permutation == pytest.approx(p_less, abs=1e-15)
    two = min(1.0, 2 * min(p_greater, p_less))
    assert stats.compare(a, b, alternative="two-sided").p_permutation == pytest.approx(two, abs=1e-15)


def test_prob_superiority_counts_ties_as_half():
    a, b = [1.0, 2.0, 3.0], [2.0, 2.0, 0.0]  # pairs: 1<2,1<2,1>0; 2=2,2=2,2>0; 3>2,3>2,3>0
    assert stats.compare(a, b).prob_superiority == pytest.approx((1 + 1 + 0.5 * 2 + 3) / 9)


def test_random_permutations_approach_the_exact_p_and_follow_the_seed():
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.3, 1, 9), rng.normal(0, 1, 9)  # C(18, 9) = 48,620 splits
    exact = stats.compare(a, b, permutations=48_620).p_permutation
    sampled = stats.compare(a, b, permutations=20_000, seed=1).p_permutation
    assert sampled == pytest.approx(exact, abs=4 * math.sqrt(exact * (1 - exact) / 20_000) + 1e-4)
    assert stats.compare(a, b, permutations=20_000, seed=1).p_permutation == sampled
    assert stats.compare(a, b, permutations=20_000, seed=2).p_permutation != sampled


def test_exact_permutation_p_is_a_count_of_splits():
    """3 vs 3, all values distinct: the most extreme split is 1 of the C(6, 3) = 20."""
    a, b = [5.0, 6.0, 7.0], [1.0, 2.0, 3.0]
    c = stats.compare(a, b)
    assert c.p_permutation == pytest.approx(1 / 20, abs=1e-15)
    assert c.p_mannwhitney == pytest.approx(1 / 20, abs=1e-15)  # exact U distribution, same count
    assert stats.compare(a, b, alternative="two-sided").p_permutation == pytest.approx(2 / 20, abs=1e-15)


def test_both_cells_without_variance_give_nan_welch_and_a_permutation_p():
    c = stats.compare([0.1] * 5, [0.1] * 5)
    assert math.isnan(c.welch_t) and math.isnan(c.welch_df) and math.isnan(c.p_welch)
    assert math.isnan(c.ci_low) and math.isnan(c.ci_high)
    assert c.p_permutation == 1.0 and c.gap == 0.0
    d = stats.compare([0.9] * 5, [0.1] * 5)  # every split's statistic: 1 of 252 is this extreme
    assert math.isnan(d.p_welch) and d.p_permutation == pytest.approx(1 / 252)


@pytest.mark.parametrize("a,b,message", [
    ([0.5], [0.1, 0.2], "cell A has 1 value(s); a comparison needs at least 2 per cell"),
    ([0.5, 0.6], [], "cell B has 0 value(s)"),
    ([0.5, float("nan")], [0.1, 0.2], "cell A has non-finite values"),
])
def test_too_few_or_bad_values_are_one_line_errors(a, b, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        stats.compare(a, b)
    assert "\n" not in str(err.value)


def test_bad_alternative_is_one_line():
    with pytest.raises(ValueError, match="alternative='bigger' is unknown; allowed: greater, less, two-sided"):
        stats.compare([1, 2], [3, 4], alternative="bigger")


def _holm_plain(p):
    """Holm (1979) as a procedure: at level α, reject H_(1), H_(2), ... while (m − j + 1) p_(j) ≤ α
    and stop at the first that fails; the adjusted p of H_i is the smallest α that rejects it
    (scanned over the levels where a decision can change, and 1)."""
    m = len(p)
    order = sorted(range(m), key=lambda k: (p[k], k))

    def rejected(alpha):
        out = set()
        for j, k in enumerate(order):
            if (m - j) * p[k] > alpha:
                break
            out.add(k)
        return out

    levels = sorted({min(1.0, (m - j) * p[k]) for j, k in enumerate(order)} | {1.0})
    return [next(a for a in levels if i in rejected(a)) for i in range(m)]


@pytest.mark.parametrize("p", [
    [0.01, 0.04, 0.03, 0.005],
    [0.5, 0.5, 0.01],
    [0.2],
    [0.01, 0.02, 0.03, 0.04, 0.05, 0.9],
    list(np.random.default_rng(1).uniform(0, 0.2, 12)),
])
def test_holm_equals_its_definition(p):
    adjusted = stats.holm(p)
    assert adjusted == pytest.approx(_holm_plain(p), abs=1e-10)
    assert all(x <= 1.0 for x in adjusted) and all(x >= y - 1e-15 for x, y in zip(adjusted, p))
    ranked = sorted(zip(p, adjusted))
    assert all(a1 <= a2 for (_, a1), (_, a2) in itertools.pairwise(ranked))  # monotone in the raw p


def test_holm_rejections_match_the_step_down_procedure():
    p = [0.01, 0.04, 0.03, 0.005]  # m = 4: 0.005 ≤ .05/4, 0.01 ≤ .05/3, 0.03 > .05/2: stop
    rejected = [a <= 0.05 for a in stats.holm(p)]
    assert rejected == [True, False, False, True]


def test_float32_accuracies_equal_in_counts_are_equal_splits():
    """The skip ablation at depth 4 (docs/figures/quickstart_runs.csv, init_beats_default_adamw):
    float32 accuracies k/360 whose counts tie across splits differ by about 6e-8 in their sums;
    the p is the count over the integer counts, 181/252 = 0.718 (rounding gave 0.714)."""
    counts_a, counts_b = [326, 328, 329, 338, 326], [334, 335, 327, 321, 340]
    a = [float(np.float32(k / 360)) for k in counts_a]
    b = [float(np.float32(k / 360)) for k in counts_b]
    pooled = counts_a + counts_b
    splits = list(itertools.combinations(range(10), 5))
    for alternative, at_least in (("greater", lambda s: s >= sum(counts_a)), ("less", lambda s: s <= sum(counts_a))):
        exact = sum(at_least(sum(pooled[i] for i in s)) for s in splits) / len(splits)
        assert stats.compare(a, b, alternative=alternative).p_permutation == pytest.approx(exact, abs=1e-15)
    assert stats.compare(a, b).p_permutation == pytest.approx(181 / 252, abs=1e-15)


@pytest.mark.parametrize("alternative", ALTERNATIVES)
def test_fisher_exact_equals_scipy(alternative):
    for n_a, n_b in ((5, 5), (10, 10), (3, 7), (1, 4)):
        for k_a in range(n_a + 1):
            for k_b in range(n_b + 1):
                expected = ss.fisher_exact([[k_a, n_a - k_a], [k_b, n_b - k_b]], alternative=alternative).pvalue
                assert stats.fisher_exact(k_a, n_a, k_b, n_b, alternative) == pytest.approx(expected, abs=1e-12)
    assert stats.fisher_exact(5, 5, 0, 5) == pytest.approx(1 / 252, abs=1e-15)  # the smallest 5 against 5 allow
    assert stats.fisher_exact(4, 5, 1, 5) == pytest.approx(26 / 252, abs=1e-15)  # 64 tokens: p 0.10


@pytest.mark.parametrize("args,message", [
    ((6, 5, 0, 5), "cell A: 6 of 5 runs"),
    ((1, 5, 0, 0), "cell B: 0 of 0 runs"),
])
def test_fisher_exact_bad_counts_are_one_line_errors(args, message):
    with pytest.raises(ValueError, match=message):
        stats.fisher_exact(*args)
    with pytest.raises(ValueError, match="alternative='more' is unknown"):
        stats.fisher_exact(1, 5, 0, 5, "more")

"""Per-layer evaluation (docs/method/per_layer_eval.md): `config.evals.<name>.layers` of the kNN
and linear-probe entries, the blocks it names, and the curve of the per-layer metrics as a PNG.

    config.evals.knn = dict(type='knn', k=20, layers='all')      # or 'last' (default), or [0, 3, 7]

The features of every requested block come from one forward pass (`Context.extract_rows` /
`extract` with `layers`: the blocks' `pre_logits`); `FeatureFitEvaluator.scores` names the
metrics `layer_<i>/<metric>` and adds `best_layer`.
"""

from __future__ import annotations

import os
import re
from typing import Any

LAST = "last"
ALL = "all"
_LAYER_METRIC = re.compile(r"(?:^|_)layer_(\d+)/(.+)$")


def check(where: str, layers: Any) -> None:
    """One-line ValueError unless `layers` is 'last', 'all' or a non-empty list of distinct block
    indices ≥ 0; `where` names the entry (config.evals.<name>)."""
    if layers is None or layers in (LAST, ALL):
        return
    ok = isinstance(layers, (list, tuple)) and len(layers) > 0 and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers) and len(set(layers)) == len(layers)
    if not ok:
        raise ValueError(f"{where}.layers={layers!r} is not allowed; allowed: 'last', 'all' or a list of distinct "
                         "block indices >= 0")


def check_model(where: str, layers: Any, model: Any) -> None:
    """One-line ValueError for per-layer `layers` on a family without per-block features, or an
    index past the model's blocks (`model`: a `models.ModelDescription`)."""
    if layers is None or layers == LAST:
        return
    if not model.block_pre_logits:
        raise ValueError(f"{where}.layers={layers!r}: the {model.family!r} family has no per-block features "
                         "(docs/method/per_layer_eval.md §1); allowed: 'last'")
    if layers != ALL and max(layers) >= model.depth:
        raise ValueError(f"{where}.layers={list(layers)!r}: block {max(layers)} does not exist; allowed: "
                         f"0 … {model.depth - 1} ({model.depth} blocks)")


def blocks(where: str, layers: Any, model_config: Any) -> tuple[int, ...] | None:
    """The block indices `layers` names for the model of `config.model` (None for 'last': the
    evaluator as before, the model not described), after `check` and `check_model`."""
    check(where, layers)
    if layers is None or layers == LAST:
        return None
    from skipless_jax import models

    model = models.describe(model_config)
    check_model(where, layers, model)
    return tuple(range(model.depth)) if layers == ALL else tuple(int(i) for i in layers)


def curves(metrics: dict[str, float]) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(block, value), ...] in block order, from names ending in `layer_<i>/<metric>`."""
    out: dict[str, list[tuple[int, float]]] = {}
    for name, value in metrics.items():
        match = _LAYER_METRIC.search(name)
        if match:
            out.setdefault(match.group(2), []).append((int(match.group(1)), float(value)))
    return {metric: sorted(points) for metric, points in out.items()}


def draw(path: str, metrics: dict[str, float], title: str) -> bool:
    """The PNG of each per-layer metric against the block (matplotlib Figure, Agg canvas, no
    pyplot); False (nothing written) when `metrics` has no per-layer entries."""
    lines = curves(metrics)
    if not lines:
        return False
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(5, 3.2))
    ax = fig.subplots()
    for metric, points in lines.items():
        indices, values = zip(*points)
        ax.plot(indices, values, marker="o", label=metric)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("block")
    ax.set_ylabel("value")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return True

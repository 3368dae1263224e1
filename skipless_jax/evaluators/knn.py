"""Weighted k-nearest-neighbour classification on frozen features (DINO's kNN evaluation).

Features are L2-normalized; a test example's k most cosine-similar train examples vote for
their labels with weight exp(sim/T); the prediction is the class with the largest vote
(Wu et al. 2018, as DINO uses it with k = 20, T = 0.07).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import PartitionSpec as P

from skipless_jax import sharding
from skipless_jax.evaluators import per_layer
from skipless_jax.evaluators.common import FeatureFitEvaluator
from skipless_jax.models.dino_head import l2_normalize

_HIGHEST = jax.lax.Precision.HIGHEST


def validate_knn(k: int, temperature: float, num_train: int | None = None, where: str = "config.evals.knn") -> None:
    """One-line ValueError for a bad k or temperature (before any compile); `where` names the entry."""
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{where}.k={k!r} must be a positive integer")
    if num_train is not None and k > num_train:
        raise ValueError(f"{where}.k={k} exceeds the {num_train} train examples of the kNN bank")
    if (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or not temperature > 0
        or not math.isfinite(temperature)
    ):
        raise ValueError(f"{where}.temperature={temperature!r} must be a finite number > 0")


@functools.partial(jax.jit, static_argnames=("num_classes", "k"))
def _vote(
    bank: jax.Array, bank_labels: jax.Array, queries: jax.Array, num_classes: int, k: int, temperature: float
) -> jax.Array:
    sims = jnp.matmul(l2_normalize(queries), bank.T, precision=_HIGHEST)  # (q, n)
    top, idx = jax.lax.top_k(sims, k)  # (q, k), descending
    weights = jnp.exp(top / temperature)
    votes = jnp.einsum("qk,qkc->qc", weights, jax.nn.one_hot(bank_labels[idx], num_classes), precision=_HIGHEST)
    return votes


@functools.cache  # one compile per (mesh, classes, k, T), not per evaluation round
def _sharded_vote(mesh: jax.sharding.Mesh, num_classes: int, k: int, temperature: float) -> Any:
    """`_vote` over a bank whose rows are split over the mesh's data axes: each device takes the
    top k of its rows (padding rows, label −1, never chosen), the k·D candidates are gathered and
    the global top k vote. Memory per device: its bank rows and chunk × n/D similarities."""
    axes = sharding.data_axes(mesh)
    spec = P(axes)

    def local(bank: jax.Array, labels: jax.Array, queries: jax.Array) -> jax.Array:
        sims = jnp.matmul(l2_normalize(queries), bank.T, precision=_HIGHEST)  # (q, n/D)
        sims = jnp.where(labels[None] >= 0, sims, -jnp.inf)
        top, idx = jax.lax.top_k(sims, min(k, bank.shape[0]))
        top = jax.lax.all_gather(top, axes, axis=1, tiled=True)  # (q, k·D)
        cand = jax.lax.all_gather(labels[idx], axes, axis=1, tiled=True)
        top, j = jax.lax.top_k(top, k)
        weights = jnp.exp(top / temperature)
        picked = jnp.take_along_axis(cand, j, axis=1)
        return jnp.einsum("qk,qkc->qc", weights, jax.nn.one_hot(picked, num_classes), precision=_HIGHEST)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, P()), out_specs=P(), check_vma=False))


def knn_votes(
    train_features: np.ndarray | jax.Array,
    train_labels: np.ndarray | jax.Array,
    test_features: np.ndarray,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    chunk: int = 256,
    mesh: jax.sharding.Mesh | None = None,
) -> np.ndarray:
    """(n_test, num_classes) weighted votes; train (n, d) / (n,) int, test (m, d).

    The test set goes through in chunks of `chunk` (the last one padded), so memory is
    chunk × n similarities whatever the test size. The bank is split over the data axes of a
    mesh (`_sharded_vote`: the same votes, 1/D of the bank and similarities per device) when it
    comes as global arrays with rows split over the devices (`Context.extract_rows`; label −1
    marks padding rows) or with a `mesh` of D > 1 data devices (host arrays, every process holding
    all of them: placed by `sharding.host_rows`, each device receiving its rows).
    """
    if mesh is not None and sharding.num_data_shards(mesh) > 1 and not sharding.on_mesh(train_features):
        pad = -len(train_labels) % sharding.num_data_shards(mesh)  # padding rows: label −1, never chosen
        feats = np.asarray(train_features, np.float32)
        train_features, train_labels = sharding.host_rows(
            mesh, np.concatenate([feats, np.zeros((pad, feats.shape[1]), np.float32)]),
            np.concatenate([np.asarray(train_labels, np.int32), np.full((pad,), -1, np.int32)]))
    if sharding.on_mesh(train_features):
        validate_knn(k, temperature, int(jax.device_get(jnp.sum(train_labels >= 0))))
        bank = jax.jit(l2_normalize, out_shardings=train_features.sharding)(train_features)
        labels = train_labels
        vote = _sharded_vote(train_features.sharding.mesh, num_classes, int(k), float(temperature))
    else:
        validate_knn(k, temperature, len(train_labels))
        bank = l2_normalize(jnp.asarray(train_features, jnp.float32))
        labels = jnp.asarray(train_labels, jnp.int32)
        vote = functools.partial(_vote, num_classes=num_classes, k=int(k), temperature=float(temperature))
    test = np.asarray(test_features, np.float32)
    m = len(test)
    out = []
    for start in range(0, m, chunk):
        block = test[start : start + chunk]
        pad = chunk - len(block)
        if pad:  # a fixed chunk shape compiles once
            block = np.concatenate([block, np.ones((pad, block.shape[1]), np.float32)])
        votes = vote(bank, labels, block)  # host queries: the same on every process
        out.append(np.asarray(votes)[: chunk - pad])
    return np.concatenate(out) if out else np.zeros((0, num_classes), np.float32)


def knn_accuracy(
    train_features: np.ndarray,
    train_labels: np.ndarray,
    test_features: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    mesh: jax.sharding.Mesh | None = None,
) -> float:
    """Top-1 accuracy of the weighted kNN classifier (bank split over `mesh`'s data axes, if given)."""
    votes = knn_votes(train_features, train_labels, test_features, num_classes, k, temperature, mesh=mesh)
    return float(np.mean(votes.argmax(-1) == np.asarray(test_labels)))


@dataclasses.dataclass
class KNN(FeatureFitEvaluator):
    """config.evals entry `type='knn'`: yields ('knn_accuracy', top-1) of the weighted kNN
    classifier whose bank is the features of `train_split` (default the dataset's train split);
    with `layers` ('all' or block indices) ('layer_<i>/knn_accuracy', ·) per block and
    ('best_layer', ·) (docs/method/per_layer_eval.md)."""

    k: int = 20
    temperature: float = 0.07

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]:
        yield from self.scores(params, self.score)  # the bank stays on the devices

    def score(self, train_x: Any, train_y: Any, n: int, test_x: np.ndarray, test_y: np.ndarray) -> tuple[str, float]:
        k = min(self.k, n)  # a bank smaller than k (a tiny split) votes with all of it
        if k < self.k:
            logging.warning("kNN: only %d train examples; using k=%d instead of %d.", n, k, self.k)
        return "knn_accuracy", knn_accuracy(train_x, train_y, test_x, test_y, self.ctx.num_classes, k,
                                            self.temperature, mesh=self.ctx.mesh)

    @staticmethod
    def check(name: str, entry: Any) -> None:
        validate_knn(entry.get("k", 20), entry.get("temperature", 0.07), where=f"config.evals.{name}")
        per_layer.check(f"config.evals.{name}", entry.get("layers"))

    @classmethod
    def from_config(cls, name: str, entry: Any, ctx: Any, **common: Any) -> KNN:
        cls.check(name, entry)
        k, temperature = entry.get("k", 20), entry.get("temperature", 0.07)
        return cls(name=name, ctx=ctx, train_split=cls.train_split_of(entry, ctx), k=k, temperature=temperature,
                   layers=cls.layers_of(name, entry, ctx), **common)

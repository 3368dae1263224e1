"""Text for the language-model trainer (trainers/lm.py, docs/method.md §25): the embedded corpus,
byte-level tokens, packing into windows, and the train and validation batches.

The embedded corpus `stdlib` is the running Python's standard library: the `.py` files under
`sysconfig.get_paths()['stdlib']` (site-packages and dist-packages excluded), a fixed sorted
list of relative paths; file i is in the validation split when i % VALIDATION_EVERY ==
VALIDATION_EVERY - 1, else in train. Nothing is downloaded; `corpus_facts` (the Python version,
the files, bytes and a SHA-256 of the paths and contents) goes into `final_metrics.json`, so a
number is tied to its corpus.

Tokens: the 256 byte values and END_OF_DOCUMENT (256), VOCAB_SIZE = 257. A split's stream is its
documents in order, each followed by END_OF_DOCUMENT. Packing: window w of a stream is its
tokens [w·T, w·T + T + 1) (T = config.model.seq_len: T inputs and their T next-token targets),
so consecutive windows share one token and every token but the first is a target of exactly
one window.

Train: global position i of the example stream reads window order_e[i mod W] of epoch
e = i // W, order_e a permutation drawn from (seed, e); step s holds positions [s·B, (s+1)·B)
and process p of P reads its contiguous slice of each global batch, as the image pipelines
(data/pipeline.py): the window at a position depends only on (seed, position), so a resumed run
reads what the uninterrupted one would have. Validation: the first `config.dataset.eval_windows`
windows (None: all) in order, the last batch padded; `mask` (B, T) is 1 on real targets, so
every token of those windows counts exactly once.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from typing import Any

import numpy as np

from skipless_jax import rng_streams
from skipless_jax.checks import is_positive_int, require

CORPORA = ("stdlib",)
SPLITS = ("train", "validation")
END_OF_DOCUMENT = 256
VOCAB_SIZE = 257
VALIDATION_EVERY = 20  # one file in 20 is validation
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


@functools.cache
def stdlib_files(root: str | None = None) -> tuple[str, ...]:
    """The corpus's files: sorted '/'-joined paths of every `.py` file under `root` (default the
    standard library's folder), installed packages and caches excluded."""
    root = root or stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        rel = os.path.relpath(folder, root)
        found += [f if rel == "." else f"{rel}/{f}".replace(os.sep, "/") for f in files if f.endswith(".py")]
    return tuple(sorted(found))


def split_files(files: tuple[str, ...], split: str) -> list[str]:
    """The files of `split`: every VALIDATION_EVERY-th of the sorted list is validation, the rest train."""
    require(split in SPLITS, f"config.dataset split {split!r} is unknown; allowed: {list(SPLITS)}")
    held_out = [i % VALIDATION_EVERY == VALIDATION_EVERY - 1 for i in range(len(files))]
    return [f for f, h in zip(files, held_out) if h == (split == "validation")]


def encode(text: str | bytes) -> np.ndarray:
    """Byte-level tokens (int32) of a text (UTF-8) or bytes."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, np.uint8).astype(np.int32)


def decode(tokens: Any) -> str:
    """Tokens -> text: bytes decoded as UTF-8 (invalid sequences replaced), END_OF_DOCUMENT as a newline."""
    values = [int(t) for t in np.asarray(tokens).reshape(-1)]
    return bytes(10 if t == END_OF_DOCUMENT else t for t in values if 0 <= t <= END_OF_DOCUMENT).decode(
        "utf-8", errors="replace")


def pack(documents: list[bytes]) -> np.ndarray:
    """The stream (uint16) of `documents`, each followed by END_OF_DOCUMENT."""
    parts = []
    for doc in documents:
        parts += [np.frombuffer(doc, np.uint8).astype(np.uint16), np.array([END_OF_DOCUMENT], np.uint16)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


@functools.lru_cache(maxsize=4)
def _corpus(root: str) -> dict[str, Any]:
    files = stdlib_files(root)
    digest, streams = hashlib.sha256(), {}
    contents = {}
    for name in files:
        with open(os.path.join(root, name), "rb") as f:
            contents[name] = f.read()
        digest.update(name.encode() + b"\0" + str(len(contents[name])).encode() + b"\0" + contents[name])
    for split in SPLITS:
        streams[split] = pack([contents[name] for name in split_files(files, split)])
    facts = {
        "corpus_python": sys.version.split()[0],
        "corpus_files": len(files),
        "corpus_bytes": sum(len(c) for c in contents.values()),
        "corpus_sha256": digest.hexdigest(),
        **{f"corpus_{split}_tokens": int(len(streams[split])) for split in SPLITS},
    }
    return {"streams": streams, "facts": facts}


def _root(config: Any) -> str:
    """`config.dataset.data_dir` (a folder read as the standard library is) or the standard library."""
    return config.dataset.get("data_dir") or stdlib_root()


def stream(config: Any, split: str) -> np.ndarray:
    """The token stream of `split` of `config.dataset`."""
    return _corpus(_root(config))["streams"][split]


def corpus_facts(config: Any) -> dict[str, Any]:
    """Python version, files, bytes, SHA-256 and split sizes (tokens) of the corpus."""
    return dict(_corpus(_root(config))["facts"])


def num_windows(length: int, seq_len: int) -> int:
    """Windows of T + 1 tokens, T apart, in a stream of `length` tokens."""
    return max((length - 1) // seq_len, 0)


def window(tokens: np.ndarray, w: int, seq_len: int) -> np.ndarray:
    return np.asarray(tokens[w * seq_len: w * seq_len + seq_len + 1], np.int32)


def epoch_order(seed: int, epoch: int, windows: int) -> np.ndarray:
    """The window order of `epoch`: a permutation drawn from (seed, epoch)."""
    return np.random.default_rng([seed, epoch, rng_streams.TEXT_ORDER]).permutation(windows)


def _local_slice(global_batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    require(global_batch_size % process_count == 0,
            f"config.input.batch_size={global_batch_size} is not divisible by the {process_count} processes")
    local = global_batch_size // process_count
    return process_index * local, local


def train_batches(tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int, start_step: int = 0,
                  process_index: int = 0, process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Process-local train batches {'tokens': (b, T + 1) int32} from step `start_step` on."""
    windows = num_windows(len(tokens), seq_len)
    require(windows > 0, f"the train split holds {len(tokens)} tokens: no window of {seq_len + 1}")
    offset, local = _local_slice(global_batch_size, process_index, process_count)
    orders: dict[int, np.ndarray] = {}
    step = start_step
    while True:
        rows = []
        for k in range(local):
            epoch, i = divmod(step * global_batch_size + offset + k, windows)
            if epoch not in orders:
                orders = {epoch: epoch_order(seed, epoch, windows)}  # one epoch's order kept at a time
            rows.append(window(tokens, int(orders[epoch][i]), seq_len))
        yield {"tokens": np.stack(rows)}
        step += 1


def eval_batches(tokens: np.ndarray, seq_len: int, global_batch_size: int, max_windows: int | None = None,
                 process_index: int = 0, process_count: int = 1) -> tuple[list[dict[str, np.ndarray]], int]:
    """(process-local validation batches {'tokens': (b, T + 1), 'mask': (b, T)}, targets counted):
    the first `max_windows` windows (None: every window, the last one short) in order; padding
    (rows past the end, the short window's tail) has mask 0."""
    total = -(-(len(tokens) - 1) // seq_len)  # the last window may be short
    count = total if max_windows is None else min(total, max_windows)
    offset, local = _local_slice(global_batch_size, process_index, process_count)
    batches, targets = [], 0
    for start in range(0, count, global_batch_size):
        rows, masks = [], []
        for k in range(local):
            w = start + offset + k
            piece = window(tokens, w, seq_len) if w < count else np.zeros((0,), np.int32)
            real = max(len(piece) - 1, 0)
            rows.append(np.pad(piece, (0, seq_len + 1 - len(piece)), constant_values=END_OF_DOCUMENT))
            masks.append(np.arange(seq_len) < real)
        batches.append({"tokens": np.stack(rows), "mask": np.stack(masks).astype(np.float32)})
    for w in range(count):
        targets += len(window(tokens, w, seq_len)) - 1
    return batches, targets


def check_config(config: Any) -> None:
    """The corpus name, its splits, the eval window cap; one line each."""
    name = config.dataset.get("name")
    require(name in CORPORA, f"config.dataset.name={name!r} is not a text corpus of the lm trainer; "
                             f"allowed: {list(CORPORA)}")
    for field in ("train_split", "eval_split"):
        split = config.dataset.get(field)
        require(split in SPLITS, f"config.dataset.{field}={split!r} is unknown; allowed: {list(SPLITS)}")
    cap = config.dataset.get("eval_windows")
    require(cap is None or is_positive_int(cap),
            f"config.dataset.eval_windows={cap!r} must be a positive integer (None: the whole validation split)")
    data_dir = config.dataset.get("data_dir")
    require(data_dir is None or os.path.isdir(data_dir),
            f"config.dataset.data_dir={data_dir!r} is not a folder (None: the standard library's)")


def train_iterator(config: Any, start_step: int, process_index: int, process_count: int,
                   on_device: bool = True) -> Iterator[dict[str, np.ndarray]]:
    """Process-local train batches of the config from `start_step` on (`common.device_batches`' signature)."""
    del on_device  # tokens are tokens
    return train_batches(stream(config, config.dataset.train_split), config.model.seq_len, config.input.batch_size,
                         config.seed, start_step, process_index, process_count)


def train_batch_spec(config: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The global train batch as {name: (shape, dtype)}, from the config alone."""
    return {"tokens": ((config.input.batch_size, config.model.seq_len + 1), np.dtype(np.int32))}


def unigram_entropy_bits(tokens: np.ndarray) -> float:
    """H = −Σ p log₂ p of the token frequencies of `tokens` (bits per token)."""
    counts = np.bincount(np.asarray(tokens, np.int64), minlength=VOCAB_SIZE).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())

"""Text for the language-model trainer (trainers/lm.py, docs/method/gpt.md §26): the embedded corpus,
byte-level tokens, packing into windows, and the train and validation batches.

The embedded corpus `stdlib` is the running Python's standard library: the `.py` files under
`sysconfig.get_paths()['stdlib']` (site-packages and dist-packages excluded), a fixed sorted
list of relative paths; file i is in the validation split when i % VALIDATION_EVERY ==
VALIDATION_EVERY - 1, else in train. Nothing is downloaded; `corpus_facts` (the Python version,
the files, bytes and a SHA-256 of the paths and contents) goes into `final_metrics.json`, so a
number is tied to its corpus.

Any other `config.dataset.name` is a TFDS text dataset (e.g. 'lm1b', 'c4', 'wikipedia'): the
records of the split (`config.dataset.train_split` / `eval_split`, tfds split strings) in
order, their `config.dataset.text_key` field (default 'text') as the documents, the first
`config.dataset.max_documents` of each split (None: all; the split is read into memory).

Tokens: the 256 byte values and END_OF_DOCUMENT (256), VOCAB_SIZE = 257; or, with
`config.dataset.tokenizer=PATH.model`, the ids of that SentencePiece model (the `sentencepiece`
package) and END_OF_DOCUMENT = its piece count. A split's stream is END_OF_DOCUMENT, then its
documents in order, each followed by END_OF_DOCUMENT: every document follows an END_OF_DOCUMENT
(as `generate`'s prompt does), so each of its tokens is a target. Each token of a stream carries
a byte weight (`token_bytes`): a document's UTF-8 bytes, as read, shared among its tokens in
proportion to their pieces' byte lengths, END_OF_DOCUMENT 0; validation's bits per byte divides
by the weights of the targets it counts (docs/method/lm.md §1). Packing: window w of a stream is its
tokens [w·T, w·T + T + 1) (T = config.model.seq_len: T inputs and their T next-token targets),
so consecutive windows share one token and every token but the first is a target of exactly
one window.

Train: global position i of the example stream reads window order_e[i mod W] of epoch
e = i // W, order_e a permutation drawn from (seed, e); step s holds positions [s·B, (s+1)·B)
and process p of P reads its contiguous slice of each global batch, as the image pipelines
(data/pipeline.py): the window at a position depends only on (seed, position), so a resumed run
reads what the uninterrupted one would have. `config.dataset.random_offsets=True`: epoch e's
windows start at an offset o_e ∈ [0, T) drawn from (seed, e), ⌊(n − T)/T⌋ windows an epoch
(docs/method/lm.md §5). `config.dataset.packing='documents'`: each batch also holds `segments`
and `positions` (B, T) of its inputs (`segments_and_positions`), so that attention stays within a
document and positions restart at each (models/gpt.py). Validation: `config.dataset.eval_windows` windows
spread evenly over the split (None: all), in order, the last batch padded; `mask` (B, T) is 1 on real targets, so
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
PACKINGS = ("windows", "documents")
# 'tune' (one train file in 20, held out of 'train_less_tune'): where a study chooses its
# learning rates, so that its claims are judged on 'validation' (configs/lm_skipless_study.py).
SPLITS = ("train", "validation", "tune", "train_less_tune")
TUNE_AT = 9  # file i is in 'tune' when i % VALIDATION_EVERY == TUNE_AT
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
    """The files of `split`: every VALIDATION_EVERY-th of the sorted list is validation, the rest
    train; of the train files, those at TUNE_AT in each VALIDATION_EVERY are 'tune' and the others
    'train_less_tune'."""
    require(split in SPLITS, f"config.dataset split {split!r} is unknown; allowed: {list(SPLITS)}")
    member = {"train": lambda r: r != VALIDATION_EVERY - 1, "validation": lambda r: r == VALIDATION_EVERY - 1,
              "tune": lambda r: r == TUNE_AT, "train_less_tune": lambda r: r not in (VALIDATION_EVERY - 1, TUNE_AT)}
    return [f for i, f in enumerate(files) if member[split](i % VALIDATION_EVERY)]


def encode(text: str | bytes) -> np.ndarray:
    """Byte-level tokens (int32) of a text (UTF-8) or bytes."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, np.uint8).astype(np.int32)


def decode(tokens: Any) -> str:
    """Byte tokens -> text: bytes decoded as UTF-8 (invalid sequences replaced), END_OF_DOCUMENT as a newline."""
    values = [int(t) for t in np.asarray(tokens).reshape(-1)]
    return bytes(10 if t == END_OF_DOCUMENT else t for t in values if 0 <= t <= END_OF_DOCUMENT).decode(
        "utf-8", errors="replace")


def pack(documents: list[Any], end_of_document: int = END_OF_DOCUMENT) -> np.ndarray:
    """The stream of `documents` (bytes, or token arrays): `end_of_document`, then each document
    followed by `end_of_document`; uint16 when every id fits, else int32."""
    dtype = np.uint16 if end_of_document < 1 << 16 else np.int32
    parts = [np.array([end_of_document], dtype)]
    for doc in documents:
        ids = np.frombuffer(doc, np.uint8) if isinstance(doc, bytes) else np.asarray(doc)
        parts += [ids.astype(dtype), np.array([end_of_document], dtype)]
    return np.concatenate(parts)


class ByteTokenizer:
    """The 256 byte values and END_OF_DOCUMENT."""

    vocab_size = VOCAB_SIZE
    end_of_document = END_OF_DOCUMENT
    bytes_per_token = np.ones((VOCAB_SIZE,), np.float32)

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def decode(self, tokens: Any) -> str:
        return decode(tokens)


class SentencePieceTokenizer:
    """The ids of a SentencePiece model and END_OF_DOCUMENT = its piece count."""

    def __init__(self, path: str):
        try:
            import sentencepiece
        except ImportError:
            raise ValueError(f"config.dataset.tokenizer={path!r} needs the sentencepiece package "
                             "(pip install sentencepiece, or the 'text' extra)") from None
        self.path = path
        self.model = sentencepiece.SentencePieceProcessor(model_file=path)
        pieces = self.model.get_piece_size()
        self.vocab_size, self.end_of_document = pieces + 1, pieces
        lengths = [1.0 if self.model.is_byte(i) else 0.0 if self.model.is_control(i) or self.model.is_unknown(i)
                   else float(len(self.model.id_to_piece(i).replace("\u2581", " ").encode("utf-8")))
                   for i in range(pieces)]
        self.bytes_per_token = np.asarray([*lengths, 1.0], np.float32)

    def encode(self, data: bytes) -> np.ndarray:
        return np.asarray(self.model.encode(data.decode("utf-8", errors="replace")), np.int32)

    def decode(self, tokens: Any) -> str:
        ids = [int(t) for t in np.asarray(tokens).reshape(-1)]
        pieces, text = [], []
        for t in ids + [self.end_of_document]:
            if t == self.end_of_document or not 0 <= t < self.end_of_document:
                text.append(self.model.decode(pieces))
                pieces = []
            else:
                pieces.append(t)
        return "\n".join(text)  # END_OF_DOCUMENT as a newline


@functools.cache
def _tokenizer(path: str | None) -> Any:
    return SentencePieceTokenizer(path) if path else ByteTokenizer()


def tokenizer(config: Any) -> Any:
    """The config's tokenizer: `config.dataset.tokenizer` (a SentencePiece model), else bytes."""
    return _tokenizer(config.dataset.get("tokenizer") or None)


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
        streams[split] = [contents[name] for name in split_files(files, split)]
    facts = {
        "corpus_python": sys.version.split()[0],
        "corpus_files": len(files),
        "corpus_bytes": sum(len(c) for c in contents.values()),
        "corpus_sha256": digest.hexdigest(),
    }
    return {"documents": streams, "facts": facts}


def _source(config: Any) -> tuple[Any, ...]:
    """What the documents are read from: ('stdlib', folder) — `config.dataset.data_dir`, read as the
    standard library is, else the standard library — or ('tfds', name, data_dir, text_key, max_documents)."""
    d = config.dataset
    if d.name in CORPORA:
        return ("stdlib", d.get("data_dir") or stdlib_root())
    return ("tfds", d.name, d.get("data_dir"), d.get("text_key") or "text", d.get("max_documents"))


def _documents(source: tuple[Any, ...], split: str) -> list[bytes]:
    if source[0] == "stdlib":
        return _corpus(source[1])["documents"][split]
    from skipless_jax.data import record_sources

    _, name, data_dir, key, cap = source
    records = record_sources.tfds_source(name, split, data_dir)
    count = len(records) if cap is None else min(len(records), cap)
    out = []
    for i in range(count):
        value = records[i][key]
        out.append(value if isinstance(value, bytes) else str(value).encode("utf-8"))
    return out


@functools.lru_cache(maxsize=8)
def _stream(source: tuple[Any, ...], split: str, tokenizer_path: str | None) -> np.ndarray:
    tok = _tokenizer(tokenizer_path)
    docs = _documents(source, split)
    return pack(docs if tokenizer_path is None else [tok.encode(doc) for doc in docs], tok.end_of_document)


def stream(config: Any, split: str) -> np.ndarray:
    """The token stream of `split` of `config.dataset`."""
    return _stream(_source(config), split, config.dataset.get("tokenizer") or None)


def document_weights(num_bytes: int, piece_bytes: np.ndarray) -> np.ndarray:
    """The byte weights of one document's tokens and its END_OF_DOCUMENT (docs/method/lm.md §1):
    `num_bytes` (the document's UTF-8 bytes as read) shared among its m tokens in proportion to
    their pieces' byte lengths `piece_bytes` (m,), then 0; all `num_bytes` on END_OF_DOCUMENT when
    the pieces have no bytes. (m + 1,) float64, summing to `num_bytes`."""
    piece_bytes = np.asarray(piece_bytes, np.float64)
    total = piece_bytes.sum()
    if total > 0:
        return np.append(piece_bytes * (num_bytes / total), 0.0)
    return np.append(np.zeros_like(piece_bytes), float(num_bytes))


@functools.lru_cache(maxsize=4)
def _token_bytes(source: tuple[Any, ...], split: str, tokenizer_path: str | None) -> np.ndarray:
    tok = _tokenizer(tokenizer_path)
    docs = _documents(source, split)
    if tokenizer_path is None:  # a byte token is its byte
        return (_stream(source, split, None) != END_OF_DOCUMENT).astype(np.float64)
    parts = [document_weights(len(doc), tok.bytes_per_token[tok.encode(doc)]) for doc in docs]
    return np.concatenate([np.zeros((1,)), *parts])  # the stream's leading END_OF_DOCUMENT: 0


def token_bytes(config: Any, split: str) -> np.ndarray:
    """The byte weight of each token of `stream(config, split)` (float64, same length; docs/method/lm.md
    §1): summed over a document's tokens, its UTF-8 bytes as read."""
    return _token_bytes(_source(config), split, config.dataset.get("tokenizer") or None)


def corpus_facts(config: Any) -> dict[str, Any]:
    """What the numbers are tied to: for `stdlib` the Python version, files, bytes and SHA-256; for
    a TFDS dataset its name; the tokenizer (with the SHA-256 of its model file) and the split sizes
    in tokens."""
    source = _source(config)
    facts = dict(_corpus(source[1])["facts"]) if source[0] == "stdlib" else {"corpus_tfds": source[1]}
    path = config.dataset.get("tokenizer")
    if path:
        with open(path, "rb") as f:
            facts.update(corpus_tokenizer=path, corpus_tokenizer_sha256=hashlib.sha256(f.read()).hexdigest())
    for field in ("train_split", "eval_split"):
        facts[f"corpus_{config.dataset[field]}_tokens"] = int(len(stream(config, config.dataset[field])))
    return facts


def num_windows(length: int, seq_len: int) -> int:
    """Windows of T + 1 tokens, T apart, in a stream of `length` tokens."""
    return max((length - 1) // seq_len, 0)


def window(tokens: np.ndarray, w: int, seq_len: int, offset: int = 0) -> np.ndarray:
    """Window w of a stream: its tokens [offset + w·T, offset + w·T + T + 1)."""
    start = offset + w * seq_len
    return np.asarray(tokens[start: start + seq_len + 1], np.int32)


def epoch_order(seed: int, epoch: int, windows: int) -> np.ndarray:
    """The window order of `epoch`: a permutation drawn from (seed, epoch)."""
    return np.random.default_rng([seed, epoch, rng_streams.TEXT_ORDER]).permutation(windows)


def epoch_offset(seed: int, epoch: int, seq_len: int) -> int:
    """The window offset of `epoch` under random offsets: an integer in [0, T) drawn from (seed, epoch)."""
    return int(np.random.default_rng([seed, epoch, rng_streams.TEXT_OFFSET]).integers(seq_len))


def segments_and_positions(inputs: np.ndarray, end_of_document: int) -> tuple[np.ndarray, np.ndarray]:
    """(segments, positions), int32 like `inputs` (…, T) (docs/method/lm.md §5): an
    END_OF_DOCUMENT starts a segment, the segment of t is the count of END_OF_DOCUMENT at
    positions ≤ t; the position of t is t less the position where its segment starts (0 for the
    window's first segment)."""
    inputs = np.asarray(inputs)
    starts = inputs == end_of_document
    t = np.broadcast_to(np.arange(inputs.shape[-1]), inputs.shape)
    first = np.maximum.accumulate(np.where(starts, t, 0), axis=-1)
    return np.cumsum(starts, axis=-1).astype(np.int32), (t - first).astype(np.int32)


def _with_segments(batch: dict[str, np.ndarray], end_of_document: int | None) -> dict[str, np.ndarray]:
    """`batch` with the `segments` and `positions` of its inputs when `end_of_document` is given."""
    if end_of_document is None:
        return batch
    segments, positions = segments_and_positions(batch["tokens"][:, :-1], end_of_document)
    return {**batch, "segments": segments, "positions": positions}


def _local_slice(global_batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    require(global_batch_size % process_count == 0,
            f"config.input.batch_size={global_batch_size} is not divisible by the {process_count} processes")
    local = global_batch_size // process_count
    return process_index * local, local


def train_batches(tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int, start_step: int = 0,
                  process_index: int = 0, process_count: int = 1, random_offsets: bool = False,
                  end_of_document: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Process-local train batches {'tokens': (b, T + 1) int32} from step `start_step` on;
    `random_offsets`: each epoch's windows from its own offset (`epoch_offset`); with
    `end_of_document`, also the inputs' {'segments', 'positions': (b, T) int32}."""
    windows = num_windows(len(tokens) - (seq_len - 1 if random_offsets else 0), seq_len)
    require(windows > 0, f"the train split holds {len(tokens)} tokens: no window of {seq_len + 1}")
    offset, local = _local_slice(global_batch_size, process_index, process_count)
    orders: dict[int, tuple[np.ndarray, int]] = {}
    step = start_step
    while True:
        rows = []
        for k in range(local):
            epoch, i = divmod(step * global_batch_size + offset + k, windows)
            if epoch not in orders:  # one epoch's order and offset kept at a time
                orders = {epoch: (epoch_order(seed, epoch, windows),
                                  epoch_offset(seed, epoch, seq_len) if random_offsets else 0)}
            order, start = orders[epoch]
            rows.append(window(tokens, int(order[i]), seq_len, start))
        yield _with_segments({"tokens": np.stack(rows)}, end_of_document)
        step += 1


def eval_batches(tokens: np.ndarray, seq_len: int, global_batch_size: int, max_windows: int | None = None,
                 process_index: int = 0, process_count: int = 1, weights: np.ndarray | None = None,
                 end_of_document: int | None = None) -> tuple[list[dict[str, np.ndarray]], int]:
    """(process-local validation batches {'tokens': (b, T + 1), 'mask': (b, T), 'bytes': (b, T)},
    targets counted): `max_windows` windows spread evenly over the split, window ⌊j·W/max_windows⌋
    for j = 0 … max_windows − 1 (None: all W windows, the last one short), in order; padding
    (rows past the end, the short window's tail) has mask 0; `bytes` is each counted target's
    byte weight (`weights`: one per token of `tokens`, `token_bytes`; default 1 each); with
    `end_of_document`, also the inputs' `segments` and `positions` (b, T)."""
    total = -(-(len(tokens) - 1) // seq_len)  # the last window may be short
    count = total if max_windows is None else min(total, max_windows)
    chosen = np.arange(count) * total // count  # spread evenly over the split (all of them: 0 … total-1)
    offset, local = _local_slice(global_batch_size, process_index, process_count)
    batches, targets = [], 0
    for start in range(0, count, global_batch_size):
        rows, masks, lengths = [], [], []
        for k in range(local):
            w = start + offset + k
            piece = window(tokens, int(chosen[w]), seq_len) if w < count else np.zeros((0,), np.int32)
            real = max(len(piece) - 1, 0)
            rows.append(np.pad(piece, (0, seq_len + 1 - len(piece)), constant_values=END_OF_DOCUMENT))
            masks.append(np.arange(seq_len) < real)
            first = int(chosen[w]) * seq_len + 1 if w < count else 0  # the window's first target
            lengths.append(np.pad(np.ones(real) if weights is None else weights[first:first + real],
                                  (0, seq_len - real)))
        rows_, mask = np.stack(rows), np.stack(masks).astype(np.float32)
        batches.append(_with_segments({"tokens": rows_, "mask": mask, "bytes": (mask * np.stack(lengths)).astype(
            np.float32)}, end_of_document))
    for w in chosen:
        targets += len(window(tokens, int(w), seq_len)) - 1
    return batches, targets


def check_config(config: Any) -> None:
    """The corpus name, its splits, the eval window cap; one line each."""
    name = config.dataset.get("name")
    require(isinstance(name, str) and name, f"config.dataset.name={name!r} must name a text corpus: "
                                            f"{list(CORPORA)} or a TFDS text dataset (e.g. 'lm1b')")
    for field in ("train_split", "eval_split"):
        split = config.dataset.get(field)
        if name in CORPORA:
            require(split in SPLITS, f"config.dataset.{field}={split!r} is unknown; allowed: {list(SPLITS)}")
        else:
            require(isinstance(split, str) and split, f"config.dataset.{field}={split!r} must name a split")
    for field in ("eval_windows", "max_documents"):
        cap = config.dataset.get(field)
        require(cap is None or is_positive_int(cap), f"config.dataset.{field}={cap!r} must be a positive integer "
                                                     "(None: the whole split)")
    packing = config.dataset.get("packing", "windows")
    require(packing in PACKINGS, f"config.dataset.packing={packing!r} is unknown; allowed: {list(PACKINGS)}")
    offsets = config.dataset.get("random_offsets", False)
    require(isinstance(offsets, bool), f"config.dataset.random_offsets={offsets!r} must be True or False")
    data_dir = config.dataset.get("data_dir")
    require(data_dir is None or name not in CORPORA or os.path.isdir(data_dir),
            f"config.dataset.data_dir={data_dir!r} is not a folder (None: the standard library's)")
    path = config.dataset.get("tokenizer")
    require(path is None or os.path.isfile(path),
            f"config.dataset.tokenizer={path!r}: no such SentencePiece model file (None: byte tokens)")
    if path:
        tokenizer(config)  # the package and the file load, or one line


def train_iterator(config: Any, start_step: int, process_index: int, process_count: int,
                   on_device: bool = True, shards: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Process-local train batches of the config from `start_step` on (`common.device_batches`' signature;
    `shards` places repeated-augmentation copies, which text has none of)."""
    del on_device, shards  # tokens are tokens
    return train_batches(stream(config, config.dataset.train_split), config.model.seq_len, config.input.batch_size,
                         config.seed, start_step, process_index, process_count,
                         bool(config.dataset.get("random_offsets", False)), segment_end(config))


def segment_end(config: Any) -> int | None:
    """The END_OF_DOCUMENT that starts a segment under `config.dataset.packing='documents'`, else None."""
    return tokenizer(config).end_of_document if config.dataset.get("packing", "windows") == "documents" else None


def train_batch_spec(config: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The global train batch as {name: (shape, dtype)}, from the config alone."""
    b, t = config.input.batch_size, config.model.seq_len
    spec = {"tokens": ((b, t + 1), np.dtype(np.int32))}
    if config.dataset.get("packing", "windows") == "documents":
        spec.update(segments=((b, t), np.dtype(np.int32)), positions=((b, t), np.dtype(np.int32)))
    return spec


def unigram_entropy_bits(tokens: np.ndarray) -> float:
    """H = −Σ p log₂ p of the token frequencies of `tokens` (bits per token)."""
    counts = np.bincount(np.asarray(tokens, np.int64), minlength=VOCAB_SIZE).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())

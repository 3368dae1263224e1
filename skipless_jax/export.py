r"""A workdir's evaluation forward as a `jax.export` artifact that runs with jax alone.

    python -m skipless_jax.export --workdir=DIR [--examples=N|all] [--platforms=cpu,cuda,tpu] \
        [--params=model|ema] [--weights_dtype=float32|bfloat16] [--output=DIR/export]

writes (into `--output` where given: a read-only workdir's artifact goes elsewhere; a folder that
cannot be written is one `error:` line before anything is lowered, exit status 2, a full disk 1)

    DIR/export/model.jax       serialized jax.export.Exported: uint8 images (B, H, W, C), as the
                               eval pipeline delivers them (after resize and crop), → float32
                               logits (B, K), or the pooled features (B, d) of a backbone-only
                               (DINO, MAE) workdir; B is symbolic, the weights are constants
    DIR/export/model.json      image_size, channels, mean/std, output, num_classes (logits only),
                               step, config, params (model: as trained, ema: the run's model EMA),
                               weights_dtype, built_with (the model's attention_impl and remat)
    DIR/export/examples.npz    with --examples: `images` (N, H, W, C) uint8 and `labels` (N,)
                               int64 of the first N examples of the eval split

Normalization (x = (u/255 − mean)/std, data/device_images.py) happens inside the artifact, so
a server feeds it the pipeline's uint8 crops. The model is built with XLA attention and without
remat whatever the run trained with (`config.model.attention_impl='cudnn'` cannot lower off a
GPU; remat only changes memory in training): the same function, so the same numbers.
`--weights_dtype=bfloat16` stores the weights (the artifact's constants) in bfloat16, computed
in float32 as before; an artifact over 2 GB (the flatbuffer limit of `serialize`) is refused
before it is written. Loading needs no skipless_jax:

    exported = jax.export.deserialize(bytearray(open('DIR/export/model.jax', 'rb').read()))
    logits = exported.call(images_uint8)

A language model's workdir (`config.trainer='lm'`) exports int32 token windows (B, T) → float32
logits (B, T, vocab), T = `config.model.seq_len` (model.json: `input`, `vocab_size`, `seq_len`,
`tokenizer`); its examples.npz holds the validation windows `tokens` (N, T + 1) int32 and `mask`
(N, T) float32 (all of them with `--examples=all`), so that the mean next-token cross-entropy of
`exported.call(tokens[:, :-1])` under `mask` is the run's `val_loss`. A run packed as documents
(`config.dataset.packing='documents'`) computes its segments and positions inside the artifact,
from the END_OF_DOCUMENT tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from skipless_jax import checkpoint, trainers
from skipless_jax.data import device_images, inputs, sources
from skipless_jax.trainers import common

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
WEIGHTS_DTYPES = ("float32", "bfloat16")
MAX_ARTIFACT_BYTES = 2**31  # a serialized jax.export.Exported is one flatbuffer: at most 2 GB
# Runtime fields of the model replaced in the exported forward: how it runs, not what it computes.
EXPORT_BUILD = {"attention_impl": "xla", "remat": None}
DEFAULT_PLATFORMS = ("cpu", "cuda", "tpu")  # one artifact for a CPU, GPU or TPU server


def parse_examples(examples: str | None) -> int | None:
    """`--examples`: None (none), 'all' (-1) or a positive count."""
    if examples is None:
        return None
    if examples == "all":
        return -1
    try:
        count = int(examples)
    except ValueError:
        count = 0
    if count <= 0:
        raise ValueError(f"--examples={examples!r} must be a positive number of examples or 'all'")
    return count


def parse_platforms(platforms: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in platforms.split(",") if p.strip())
    bad = [p for p in names if p not in PLATFORMS]
    if bad or not names:
        raise ValueError(f"--platforms={platforms!r}: {bad or 'none given'}; allowed: {', '.join(PLATFORMS)}")
    return names


def parse_weights_dtype(weights_dtype: str) -> Any:
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"--weights_dtype={weights_dtype!r} is unknown; allowed: {', '.join(WEIGHTS_DTYPES)}")
    return jnp.dtype(weights_dtype)


def forward(workdir: str, params: str = "model", weights_dtype: str = "float32") -> tuple[Any, dict[str, Any]]:
    """(uint8 images (B, H, W, C) -> logits or features, the model.json description) of the
    workdir's newest checkpoint, built by its trainer's `evaluation()` (the evaluators' forward)
    with EXPORT_BUILD's model fields; `params`: the trained weights ('model') or their EMA
    ('ema'); floating weights cast to `weights_dtype`."""
    import ml_collections

    from skipless_jax.trainers import model_ema

    dtype = parse_weights_dtype(weights_dtype)
    saved = checkpoint.saved_config(workdir)
    if saved is None:
        raise ValueError(f"--workdir={workdir!r} has no checkpoint with a saved config")
    model_ema.check_params(params, checkpoint.state_entries(workdir), workdir)
    config = ml_collections.ConfigDict(saved)
    trained_with = {k: config.model.get(k) for k in EXPORT_BUILD if k in config.model}  # the fields a family has
    for k in trained_with:
        config.model[k] = EXPORT_BUILD[k]
    trainer = trainers.of_config(config)
    device = jax.local_devices()[0]
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=[device])
    ctx, key = trainer.evaluation(config, mesh)
    for entry in (key,) if isinstance(key, str) else key:
        checkpoint.param_shapes(workdir, entry)  # a one-line error if the checkpoint lacks the entry
    step, state = checkpoint.load_raw(workdir)
    tree = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        common.entries(model_ema.weights(state, params), key))
    shared = {
        "step": int(step), "params": params, "weights_dtype": weights_dtype,
        "weights_bytes": int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))),
        "built_with": {**{k: EXPORT_BUILD[k] for k in trained_with}, "trained_with": trained_with}, "config": saved,
    }
    if trainer.own_inputs:  # not images: the trainer's own inputs (the lm trainer's token windows)
        fn, meta = trainer.export_forward(config, ctx, tree)
        return fn, {**meta, **shared}
    mean, std = device_images.dataset_stats(config)
    output = "logits" if ctx.logits is not None else "features"
    apply = ctx.logits if ctx.logits is not None else ctx.features

    def fn(images: jax.Array) -> jax.Array:
        return apply(tree, device_images.normalize(images, mean, std)).astype(jnp.float32)

    info = sources.dataset_info(config.dataset.name)
    size, channels = inputs.image_size(config), int(info.image_shape[-1])
    meta = {
        "input": {"shape": [None, size, size, channels], "dtype": "uint8", "what": "images"},
        "image_size": size, "channels": channels, "mean": list(mean), "std": list(std), "output": output,
        **({"num_classes": int(info.num_classes)} if output == "logits" else {}),  # a backbone has no classes
        "dataset": config.dataset.name, "eval_split": config.dataset.eval_split, **shared,
    }
    return fn, meta


def export(workdir: str, examples: str | None = None, platforms: Sequence[str] = DEFAULT_PLATFORMS,
           params: str = "model", weights_dtype: str = "float32", output: str | None = None) -> dict[str, Any]:
    """Writes DIR/export/{model.jax, model.json[, examples.npz]} (or into `output`); returns
    model.json's content.
    `params`: 'model' (as trained) or 'ema' (the run's model EMA); `weights_dtype`: the stored
    weights' dtype. Any failure to lower or serialize the forward is a one-line ValueError
    naming its cause, and nothing is written."""
    count = parse_examples(examples)
    fn, meta = forward(workdir, params, weights_dtype)
    _check_size(meta["weights_bytes"], "weights", weights_dtype)
    (batch,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((batch, *meta["input"]["shape"][1:]), jnp.dtype(meta["input"]["dtype"]))
    where = f"the forward of {workdir!r} for {','.join(platforms)}"
    exported = _one_line(f"lowering {where}", lambda: jax.export.export(jax.jit(fn), platforms=tuple(platforms))(spec))
    _check_size(len(exported.mlir_module_serialized), "lowered program", weights_dtype)
    artifact = _one_line(f"serializing {where}", exported.serialize)
    meta.update(platforms=list(exported.platforms), output_shape=[None, *map(int, exported.out_avals[0].shape[1:])])
    out = output or os.path.join(workdir, "export")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "model.jax"), "wb") as f:
        f.write(artifact)
    with open(os.path.join(out, "model.json"), "w") as f:
        json.dump(meta, f, indent=2)
    if count is not None:
        arrays = example_arrays(workdir, count)
        np.savez(os.path.join(out, "examples.npz"), **arrays)
        meta["examples"] = len(next(iter(arrays.values())))
    return meta


def _one_line(what: str, fn: Any) -> Any:
    """`fn()`, any exception it raises as a one-line ValueError naming `what` and the cause."""
    try:
        return fn()
    except Exception as err:  # jax.export's errors (e.g. RuntimeError), not a traceback for the user
        cause = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"{what} failed: {type(err).__name__}: {cause}") from None


def _check_size(size: int, what: str, weights_dtype: str) -> None:
    """One-line ValueError before serializing an artifact over MAX_ARTIFACT_BYTES."""
    if size > MAX_ARTIFACT_BYTES:
        smaller = "; --weights_dtype=bfloat16 halves the weights" if weights_dtype == "float32" else ""
        raise ValueError(f"the {what} take {size / 2**30:.2f} GB, over the {MAX_ARTIFACT_BYTES / 2**30:.0f} GB "
                         f"a jax.export artifact can hold (one flatbuffer){smaller}; otherwise serve the "
                         "checkpoint's orbax weights (DIR/checkpoints) beside the artifact instead of inside it")


def example_arrays(workdir: str, count: int) -> dict[str, np.ndarray]:
    """examples.npz's arrays: `images` and `labels` of `eval_examples`, or the trainer's own
    (`export_examples`: the lm trainer's validation windows `tokens` and their `mask`)."""
    import ml_collections

    config = ml_collections.ConfigDict(checkpoint.saved_config(workdir))
    trainer = trainers.of_config(config)
    if trainer.own_inputs:
        return trainer.export_examples(config, count)
    images, labels = eval_examples(workdir, count)
    return {"images": images, "labels": labels}


def eval_examples(workdir: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images (N, H, W, C), int labels (N,)) of the first `count` (-1: all) examples of the
    eval split, through the eval pipeline (resize, crop, no normalization)."""
    import ml_collections

    config = ml_collections.ConfigDict(checkpoint.saved_config(workdir))
    batches, n = inputs.eval_iterator(config, 0, 1, on_device=True)
    images, labels = [], []
    for batch in batches:
        keep = np.asarray(batch["mask"], bool)
        images.append(np.asarray(batch["image"])[keep])
        labels.append(np.asarray(batch["label"])[keep].argmax(-1))
    images, labels = np.concatenate(images), np.concatenate(labels)
    if len(labels) != n or images.dtype != np.uint8:
        raise AssertionError(f"the eval pipeline gave {len(labels)} {images.dtype} images of {n}")
    stop = n if count == -1 else min(count, n)
    return images[:stop], labels[:stop].astype(np.int64)


def main(argv: Sequence[str]) -> None:
    del argv
    from absl import flags

    from skipless_jax import cli

    cli.quiet_console(tensorflow=False)  # main's console: orbax's bookkeeping at --verbosity=1 only
    f = flags.FLAGS
    out = f.output or os.path.join(f.workdir, "export")
    cli.check_writable("--output", out)  # before the lowering: a folder that cannot be written is one line
    try:
        with cli.writing("--output", out):
            meta = export(f.workdir, f.examples, parse_platforms(f.platforms), f.params, f.weights_dtype, out)
    except (ValueError, FileNotFoundError) as err:  # one line for the user, not a traceback
        cli.fail(err)  # a bad value: status 2; a missing file or a damaged checkpoint: 1
    extra = f", {meta['examples']} examples" if "examples" in meta else ""
    shape = ", ".join(["B", *map(str, meta["input"]["shape"][1:])])
    print(f"wrote {out}: step {meta['step']}, {meta['output']} "
          f"{meta['output_shape']} for {meta['input']['dtype']} ({shape}) "
          f"on {','.join(meta['platforms'])}{extra}", flush=True)


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("workdir", None, "The run's workdir (its newest checkpoint is exported).")
    flags.DEFINE_string("examples", None, "Also write DIR/export/examples.npz with N eval examples (or 'all').")
    flags.DEFINE_string("platforms", ",".join(DEFAULT_PLATFORMS),
                        f"Platforms the artifact is lowered for ({', '.join(PLATFORMS)}).")
    flags.DEFINE_string("params", "model", "The weights exported: model (as trained) or ema (the run's model EMA).")
    flags.DEFINE_string("weights_dtype", "float32", f"dtype of the stored weights ({', '.join(WEIGHTS_DTYPES)}).")
    flags.DEFINE_string("output", None, "The folder the files go to (default DIR/export): a read-only workdir's "
                        "export goes elsewhere.")
    flags.mark_flags_as_required(["workdir"])
    from skipless_jax.cli import parse_flags  # --help exits 0, flag errors are one line (status 2)

    app.run(main, flags_parser=parse_flags)

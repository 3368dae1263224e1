r"""Evaluate a finished (or pretrained) checkpoint without training.

    python -m skipless_jax.evaluate --workdir=DIR [--config=configs/X.py[:args]] [--step=N] [--only=a,b] \
        [--params=model|ema] [--quantize=int8,int4]

The config is the one saved with the workdir's checkpoint (what its parameters are); a
`--config` adds or replaces the evaluators (`config.evals`) and data settings, and a config that
trains another model than the saved one is refused in one line. A checkpoint converted from
timm (timm_convert.py) saved its model only: `--config` gives the rest (dataset,
evaluators), the model is the checkpoint's. The trainer's evaluators run
on the state entry the trainer evaluates (a classifier's parameters, DINO's EMA teacher); the
metrics are printed and written to `DIR/evaluation[_step<N>].json`, and each evaluator's to
`DIR/eval/<name>[_step<N>].json` (printed first: a workdir that cannot take the files, e.g.
read-only, is then one `error:` line, exit status 2; a full disk 1);
`--only=voc_lin,voc07_tokencut` runs the named entries of `config.evals` only (and leaves
`evaluation.json` as it was). `--params=ema` evaluates the
run's model EMA instead (trainers/model_ema.py): its metrics are named `ema_<prefix>_<metric>`
as the run logged them, in `DIR/evaluation_ema[_step<N>].json` and `DIR/eval/<name>_ema*.json`. Evaluators that draw
(`feature_pca`, `tokencut`) write `DIR/pictures/<prefix>_step<N>.png`. Compiled programs are
kept in the persistent compilation cache (skipless_jax/compilation_cache.py), so a second
evaluation of the same model skips its compiles.

A language model's run (`config.trainer='lm'`) evaluates its validation (`val_loss`,
`val_bits_per_byte`, `val_perplexity`) and the measures its `config.lm_evals` turns on
(docs/method/lm_measures.md); `--quantize=int8,int4` adds `val_<format>_bits_per_byte`, the
weights fake-quantized to each format.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import ml_collections

# JAX, the trainers (and TensorFlow, where a tfds dataset needs it) load inside the functions: `--help` and flag errors
# answer before them.
if TYPE_CHECKING:
    import jax


def resolve_config(workdir: str, config: ml_collections.ConfigDict | None) -> ml_collections.ConfigDict:
    """The workdir's saved config, with `config`'s evaluators and data fields where given."""
    from skipless_jax import checkpoint, pretrained

    saved = checkpoint.saved_config(workdir)
    if saved is not None and "converted_from" in saved and "dataset" not in saved:  # timm's: the model only
        return converted_config(workdir, saved, config)
    resolved = pretrained.saved_or_given(saved, config, workdir)
    if saved is not None and config is not None:
        diffs = pretrained.config_differences(saved, config.to_dict())
        trained = [d for d in diffs if not d.startswith(("dataset.", "input.eval_batch_size"))]
        if trained:
            raise ValueError(
                f"--config trains another model than the checkpoint in {workdir} ({', '.join(trained[:4])}); "
                "leave --config out to evaluate with the saved config"
            )
        for field in ("evals", "dataset"):
            if field in config:
                resolved[field] = config[field]
        resolved.input.eval_batch_size = config.input.get("eval_batch_size")
    return resolved


def converted_config(workdir: str, saved: dict[str, Any], config: ml_collections.ConfigDict | None
                     ) -> ml_collections.ConfigDict:
    """A converted checkpoint (timm_convert.py; its saved config is its model only): `config`
    (the dataset, evaluators, data and mesh settings) with the checkpoint's model; without a
    `config`, the one-line ValueError saying to name one."""
    if config is None:
        raise ValueError(f"--workdir={workdir} holds a converted checkpoint (from {saved['converted_from']}), whose "
                         "saved config is its model only and names no dataset; pass --config=configs/X.py[:args] "
                         "(or its --config.dataset.* flags) for the dataset and evaluators")
    resolved = ml_collections.ConfigDict(config.to_dict())
    resolved.model = ml_collections.ConfigDict(saved["model"])
    return resolved


def select(config: ml_collections.ConfigDict, only: Sequence[str] | None) -> ml_collections.ConfigDict:
    """`config` with `config.evals` cut to the entries named in `only` (None: all), in that order;
    a name the config lacks is a one-line error listing the available ones."""
    if only is None:
        return config
    from skipless_jax import evaluators, trainers

    available = trainers.of_config(config).evaluator_names(config)
    names = [n.strip() for n in only if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown or not names:
        raise ValueError(f"--only={','.join(only)}: {unknown[0] if unknown else 'no name'!r} is not an evaluator "
                         f"of the config; available: {list(available)}")
    if config.get("evals") is None:
        return config  # its evaluators are the trainer's own or the default one: nothing to cut
    entries = evaluators.entries(config)
    config = ml_collections.ConfigDict(config.to_dict())
    config.evals = ml_collections.ConfigDict({n: entries[n] for n in names})
    return config


@dataclasses.dataclass
class _Recorded:
    """An evaluator whose metrics are also recorded under its name (the per-evaluator files)."""

    evaluator: Any
    results: dict[str, dict[str, float]]

    def __getattr__(self, attr: str) -> Any:  # name, prefix, every_steps
        return getattr(self.evaluator, attr)

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]:
        mine = self.results.setdefault(self.evaluator.name, {})
        for metric, value in self.evaluator.run(params, step):
            mine[f"{self.evaluator.prefix}_{metric}"] = float(value)
            yield metric, value


def evaluate(
    workdir: str, config: ml_collections.ConfigDict | None = None, step: int | None = None,
    devices: Sequence[jax.Device] | None = None, only: Sequence[str] | None = None, params: str = "model",
    quantize: str | None = None, announce: bool = False,
) -> dict[str, Any]:
    """Runs every evaluator of the (saved) config on the checkpoint's trained weights (`params`
    'model') or their EMA ('ema'), or those named in `only`; returns {prefix_metric: value,
    'step'} (prefix 'ema_<prefix>' for the EMA). `quantize` ('int8,int4'): a language model's
    validation also with its weights fake-quantized to those formats (docs/method/lm_measures.md §2)."""
    config = select(resolve_config(workdir, config), only)
    import jax

    from skipless_jax import checkpoint, evaluators, sharding, trainers
    from skipless_jax.evaluators import per_layer
    from skipless_jax.trainers import common, model_ema

    model_ema.check_params(params, checkpoint.state_entries(workdir), workdir)
    trainer = trainers.of_config(config)
    if quantize is not None:
        if trainer.with_quantize is None:
            raise ValueError(f"--quantize={quantize}: post-training quantization is measured for language models "
                             f"(config.trainer='lm'); this run's trainer is {trainer.name!r}")
        config = trainer.with_quantize(config, quantize)
    trainer.check_evaluators(config)
    mesh = sharding.make_mesh(config.mesh, devices)
    ctx, key = trainer.evaluation(config, mesh, picture_dir=workdir)
    for entry in (key,) if isinstance(key, str) else key:
        checkpoint.param_shapes(workdir, entry)  # read first: a one-line error if the checkpoint lacks the entry
    found_step, state = checkpoint.load_raw(workdir, step)
    tree = jax.device_put(common.entries(model_ema.weights(state, params), key), sharding.replicated(mesh))
    ema = model_ema.PREFIX if params == "ema" else ""
    results: dict[str, Any] = {"step": int(found_step)}
    per_evaluator: dict[str, dict[str, float]] = {}
    built = [_Recorded(ev, per_evaluator) for ev in trainer.build_evaluators(config, ctx)]
    with jax.set_mesh(mesh):
        # Every evaluator (the step is the last), pictures as <workdir>/pictures/<prefix>_step<N>.png.
        for prefix, metric, value in evaluators.run_all(built, ctx, tree, int(found_step), int(found_step)):
            results[f"{ema}{prefix}_{metric}"] = value
    suffix = ("_ema" if ema else "") + ("" if step is None else f"_step{found_step}")
    if jax.process_index() == 0 and announce:  # `announce`: printed before the files, which may fail
        print(summary_line(results), flush=True)
    if jax.process_index() == 0:
        os.makedirs(os.path.join(workdir, "eval"), exist_ok=True)
        for name, metrics in per_evaluator.items():
            with open(os.path.join(workdir, "eval", f"{name}{suffix}.json"), "w") as f:
                json.dump({"step": int(found_step), **{ema + k: v for k, v in metrics.items()}}, f, indent=2)
            # per-layer metrics: their curve beside the JSON (docs/method/per_layer_eval.md §2)
            per_layer.draw(os.path.join(workdir, "eval", f"{name}{suffix}_layers.png"), metrics,
                           f"{name}, step {found_step}")
        if only is None:
            with open(os.path.join(workdir, f"evaluation{suffix}.json"), "w") as f:
                json.dump(results, f, indent=2)
    return results


def main(argv: Sequence[str]) -> None:
    del argv
    from absl import flags

    from skipless_jax import checkpoint, cli, compilation_cache

    cli.quiet_console()
    try:
        compilation_cache.setup(flags.FLAGS.config or checkpoint.saved_config(flags.FLAGS.workdir))
        with cli.writing("--workdir", flags.FLAGS.workdir):  # a folder that cannot take the files: one line
            evaluate(flags.FLAGS.workdir, flags.FLAGS.config, flags.FLAGS.step, only=flags.FLAGS.only,
                     params=flags.FLAGS.params, quantize=flags.FLAGS.quantize, announce=True)
    except (ValueError, FileNotFoundError) as err:  # one line for the user, not a traceback
        cli.fail(err)  # a bad value: status 2; a missing file or a damaged checkpoint: 1


def summary_line(results: dict[str, Any]) -> str:
    """'Evaluated step N: name=value, ...', what the command prints."""
    return f"Evaluated step {results['step']}: " + ", ".join(
        f"{k}={v:.4f}" for k, v in sorted(results.items()) if k != "step")


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Config file (default: the workdir's saved config).", lock_config=False
    )
    flags.DEFINE_string("workdir", None, "The run's workdir.")
    flags.DEFINE_integer("step", None, "The checkpoint step (default: the newest).")
    flags.DEFINE_list("only", None, "Run only these entries of config.evals (comma-separated names).")
    flags.DEFINE_string("params", "model", "The weights evaluated: model (as trained) or ema (the run's model EMA).")
    flags.DEFINE_string("quantize", None, "A language model's weight formats, e.g. int8,int4: validation bits per "
                        "byte of the fake-quantized weights too (docs/method/lm_measures.md).")
    flags.mark_flags_as_required(["workdir"])
    from skipless_jax import cli

    app.run(main, flags_parser=cli.parse_flags)

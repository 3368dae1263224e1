r"""Condition-number analysis of a ViT, at initialization or from a run's latest checkpoint.

    python -m skipless_jax.analyze --config=configs/quickstart.py:skip_sab=False \
        [--workdir=/tmp/quickstart] [--output_dir=DIR] [--num_images=64] [--jacobian] [--params=ema]

Prints a table of per-layer log κ (natural log, docs/method/papers.md §2) of the token matrices at
① SAB output, ①+②, ③ FFN output and ③+④ (mean over a fixed probe batch: the first
`num_images` test images), and writes `log_kappa.png` (one line per point) and
`log_kappa.json` to `--output_dir` (the paths are printed) (default: `<workdir>/analysis`, else `./analysis`).
With `--jacobian` (small models only, n·d ≤ 4096) it adds, per layer at the first probe image,
log κ of the attention Jacobian K_ℓ, of B_ℓ = Σ_h A_h ⊗ (Wⱽ_h Wᴼ_h)ᵀ, ‖K−B‖/‖K‖ and log κ of
the whole skipless block's Jacobian, all in float64, drawn in `jacobian.png`. For a ViT it also
prints the self-attention share at init of the config's init (docs/method/papers.md §3).

Parameters come from the newest readable checkpoint in `--workdir`; without one (or without a
workdir) they are the trainer's own initialization for `config.seed`; `--params=ema`: the
run's model EMA (trainers/model_ema.py) instead of its trained parameters. For a DINO config
(`config.trainer='dino'`) the analyzed network is the EMA teacher's ViT backbone, the network
DINO's kNN and linear evaluations use (at initialization teacher = student).

For a language model (`config.trainer='lm'`, e.g. `--workdir` of an LM run) the probe is the
first `num_images` validation windows (default `config.analysis.probe_size`), and the table is
followed by the measures of docs/method/lm_measures.md on the validation windows: per layer the
excess kurtosis of the block output and the logit lens's bits per byte, then the validation
bits per byte with the weights as trained and fake-quantized to int8 and int4 (`measures` in
log_kappa.json).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from skipless_jax import compilation_cache, conditioning

MAX_JACOBIAN_SIZE = 4096  # n·d; the (nd × nd) float64 SVD stays around a second on a CPU core


def _backbone_of(config: ml_collections.ConfigDict) -> tuple[Any, str] | None:
    """(the trainer's whole model, the state entry holding its 'backbone') where the tools analyse
    a backbone inside it (DINO's teacher), else None (`backbone_key` of the trainer's record)."""
    from skipless_jax import trainers

    trainer = trainers.of_config(config)
    return (trainer.build_model(config), trainer.backbone_key) if trainer.backbone_key else None


def build(config: ml_collections.ConfigDict) -> tuple[Any, tuple[int, int, int]]:
    """(model of the registry, (H, W, C) input shape) for `config` (DINO: the backbone, no head)."""
    from skipless_jax import models
    from skipless_jax.data import inputs, sources

    info = sources.dataset_info(config.dataset.name)
    size = inputs.image_size(config)
    shape = (size, size, info.image_shape[-1])
    whole = _backbone_of(config)
    if whole:
        return whole[0].backbone, shape
    return models.build(config.model, info.num_classes), shape


def config_of_workdir(config: ml_collections.ConfigDict | None, workdir: str | None) -> ml_collections.ConfigDict:
    """The config the workdir's checkpoint was written with (what its parameters are), else `config`.

    A `--config` that trains something else than the saved one is reported on one line and the
    saved config is used: analysing the checkpoint through the wrong model gives wrong numbers.
    """
    from skipless_jax import checkpoint, pretrained

    has_checkpoints = workdir and os.path.isdir(os.path.join(workdir, "checkpoints"))
    saved = checkpoint.saved_config(workdir) if has_checkpoints else None
    saved_config = pretrained.saved_or_given(saved, config, workdir)
    if saved is not None and config is not None:
        given = config.to_dict()
        # A field the given config leaves unset (None) is one the trainer derives, e.g.
        # schedule.warmup_steps from warmup_epochs (older checkpoints saved it): not a difference.
        diffs = [k for k in pretrained.config_differences(saved, given) if _value_at(given, k) is not None]
        if diffs:
            print(f"note: --config differs from the config saved in {workdir} ({', '.join(diffs[:4])}"
                  f"{' ...' if len(diffs) > 4 else ''}); analysing with the saved config", flush=True)
    return saved_config


def _value_at(tree: dict[str, Any], dotted: str) -> Any:
    """tree['a']['b'] for 'a.b'; None when a part is missing."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def init_params(model: Any, config: ml_collections.ConfigDict, image_shape: Sequence[int],
                abstract: bool = False) -> Any:
    """The trainer's step-0 parameters: `models.init_variables` (every `config.model.init`, the
    references' schemes included) with the first half of split(PRNGKey(seed)) (DINO: the
    backbone's part of the backbone + head init). `abstract`: their shapes and dtypes only
    (nothing compiled or computed), e.g. as the target of a restore."""
    from skipless_jax import models

    init_rng, _ = jax.random.split(jax.random.PRNGKey(config.seed))
    dummy = jnp.zeros((1, *image_shape), jnp.float32)
    whole = _backbone_of(config)
    if whole:
        init = lambda rng: models.init_variables(config.model, whole[0], rng, (dummy,))["params"]["backbone"]
    else:
        init = lambda rng: models.init_variables(config.model, model, rng, dummy)["params"]
    return jax.eval_shape(init, init_rng) if abstract else jax.jit(init)(init_rng)


def load_params(
    model: Any, config: ml_collections.ConfigDict, image_shape: Sequence[int], workdir: str | None,
    weights: str = "model",
) -> tuple[Any, int, str]:
    """(params, step, source): the latest checkpoint in `workdir` (`weights` 'ema': its model
    EMA's), else the initialization."""
    from skipless_jax import checkpoint
    from skipless_jax.trainers import model_ema

    if workdir and "://" not in workdir and not os.path.isdir(workdir):
        raise ValueError(f"--workdir={workdir!r} is not a directory")
    if weights != "model":
        model_ema.check_params(weights, checkpoint.state_entries(workdir) if workdir else [], workdir or "--config")
    if workdir:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shapes = init_params(model, config, image_shape, abstract=True)
        target = checkpoint.abstract(shapes, jax.tree.map(lambda _: device, shapes))
        try:
            if weights == "ema":  # the model EMA's parameters: state['ema']['params']
                step, restored = checkpoint.restore_params(workdir, {"params": target}, key="ema")
                return restored["params"], int(step), "checkpoint (model EMA)"
            whole = _backbone_of(config)
            if whole:  # the teacher's backbone (what DINO evaluates); no head
                step, restored = checkpoint.restore_params(workdir, {"backbone": target}, key=whole[1])
                return restored["backbone"], int(step), "checkpoint"
            step, restored = checkpoint.restore_params(workdir, target)
            return restored, int(step), "checkpoint"
        except FileNotFoundError:  # a workdir without checkpoints yet: analyze the init
            pass
    return init_params(model, config, image_shape), 0, "init"


def probe_images(config: ml_collections.ConfigDict, num_images: int) -> np.ndarray:
    """The first `num_images` real (unpadded) test images, as the trainer's probe batch."""
    from skipless_jax.data import inputs

    batches, total = inputs.eval_iterator(config, 0, 1)
    if not 0 < num_images <= total:
        raise ValueError(f"--num_images={num_images} must be in [1, {total}] (the eval split size)")
    images = []
    for batch in batches:
        images.append(batch["image"][batch["mask"].astype(bool)])
        if sum(len(i) for i in images) >= num_images:
            break
    return np.concatenate(images)[:num_images]


def embedding_kappa(model: Any, params: Any, images: np.ndarray, **kwargs: np.ndarray) -> dict[str, np.ndarray]:
    """{point: (L,) mean log κ} of ①, ①+②, ③, ③+④ over `images` (`kwargs`: the model's other
    inputs, e.g. a language model's segments and positions).

    Forward pass in the model's dtype, SVD in float64 on CPU. With a float32 forward σ_min
    carries an error of about 1e-7·σ_max, so values above log κ ≈ 12 are good to ~0.1 only.
    """
    _, out = jax.jit(lambda p, x, kw: model.apply({"params": p}, x, train=False, **kw))(params, images, kwargs)
    with jax.enable_x64(jax.default_backend() == "cpu"):
        kappa = jax.jit(conditioning.embedding_log_kappa)({"blocks": out["blocks"]})
        return {k: np.asarray(v, np.float64) for k, v in kappa.items()}


def jacobian_rows(model: Any, params: Any, images: np.ndarray, image: int = 0) -> list[dict[str, float]]:
    """Per layer at probe image `image`: K_ℓ vs B_ℓ and the block Jacobian (the model's skips), float64."""
    if not hasattr(model, "num_heads") or getattr(model, "depth", None) is None:
        raise ValueError(f"--jacobian is implemented for the ViT family; this model is {type(model).__name__}")
    with jax.enable_x64(True):
        model64 = model.clone(dtype=jnp.float64)
        params64 = conditioning.to_float64(params)
        forward = jax.jit(lambda p, x: model64.apply({"params": p}, x, train=False)[1])  # one program, not op by op
        out = forward(params64, jnp.asarray(images[image:image + 1], jnp.float64))
        n, d = out["blocks"][0]["sab"].shape[1:]
        if n * d > MAX_JACOBIAN_SIZE:
            raise ValueError(f"--jacobian needs n·d <= {MAX_JACOBIAN_SIZE}; this model has n={n}, d={d}")
        return conditioning.jacobian_report(
            params64, out, num_heads=model.num_heads, image=0,
            skip_sab=model.skip_sab, skip_ffn=model.skip_ffn, gelu_approximate=model.gelu_approximate,
        )


def format_table(result: dict[str, Any]) -> str:
    """Fixed-width table: one row per layer, log κ of ①..④ (and Jacobian columns if present)."""
    kappa = result["log_kappa"]
    header = ["layer"] + [conditioning.POINT_LABELS[p].split(" ")[0] for p in conditioning.EMBEDDING_POINTS]
    jac = result.get("jacobian") or []
    if jac:
        header += ["K_l", "B_l", "|K-B|/|K|", "block"]
    lines = [
        result["title"].replace("\n", ": "),
        f"log κ (natural log) per layer, {result['source']} at step {result['step']}, "
        f"mean over {result.get('probe') or str(result['num_images']) + ' test images'}",
        "".join(f"{h:>11}" for h in header),
    ]
    for layer in range(len(kappa["sab"])):
        row = [f"{layer:>11d}"] + [f"{kappa[p][layer]:>11.3f}" for p in conditioning.EMBEDDING_POINTS]
        if jac:
            j = jac[layer]
            row += [f"{j['log_kappa_K']:>11.3f}", f"{j['log_kappa_B']:>11.3f}",
                    f"{j['rel_diff_K_B']:>11.3f}", f"{j['log_kappa_block']:>11.3f}"]
        lines.append("".join(row))
    return "\n".join(lines)


def format_measures(measures: dict[str, float]) -> str:
    """A language model's measures (docs/method/lm_measures.md): one row per layer (excess
    kurtosis, logit-lens bits per byte), then the validation and quantized bits per byte."""
    layers = sorted({int(k.rsplit("_", 1)[1]) for k in measures if k.startswith("kurtosis_layer_")})
    lines = ["validation windows: per layer, excess kurtosis of the block output and logit-lens bits per byte",
             f"{'layer':>11}{'kurtosis':>11}{'lens bpb':>11}"]
    for layer in layers:
        lines.append(f"{layer:>11d}{measures[f'kurtosis_layer_{layer}']:>11.3f}"
                     f"{measures.get(f'logit_lens_bits_per_byte_layer_{layer}', float('nan')):>11.4f}")
    whole = [f"{'float32' if name == 'bits_per_byte' else name.removesuffix('_bits_per_byte')} {value:.4f}"
             for name, value in sorted(measures.items()) if name.endswith("bits_per_byte") and "layer" not in name]
    return "\n".join(lines + ["validation bits per byte, weights as trained and fake-quantized: " + ", ".join(whole)])


def plot_log_kappa(
    curves: dict[str, Sequence[float]],
    path: str,
    title: str,
    references: dict[str, float] | None = None,
    unused: Sequence[str] = (),
) -> None:
    """PNG of log κ per layer, one line per point (①, ①+②, ③, ③+④); dashed paper references.

    Points in `unused` (a sum the model does not form because its skip is off) are dotted.
    """
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) is left alone

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    markers = dict(sab="o", sab_skip="s", ffn="^", ffn_skip="D")
    for point, values in curves.items():
        label = conditioning.POINT_LABELS.get(point, point)
        style = dict(linestyle=":", alpha=0.6) if point in unused else {}
        ax.plot(np.arange(len(values)), values, marker=markers.get(point, "o"),
                label=label + (" (not in the model)" if point in unused else ""), **style)
    for label, value in (references or {}).items():
        ax.axhline(value, color="gray", linestyle="--", linewidth=1)
        ax.annotate(label, (1.0, value), xycoords=("axes fraction", "data"), textcoords="offset points",
                    xytext=(-4, 3), ha="right", fontsize=8, color="gray")
    ax.set_xlabel("layer (block index, 0 = first)")
    ax.set_ylabel("log κ of the token matrix (natural log)")
    ax.set_title(title, fontsize=9)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_jacobian(rows: Sequence[dict[str, float]], path: str, title: str) -> None:
    """PNG of the `--jacobian` columns per layer: log κ of K_ℓ, of B_ℓ and of the block's Jacobian,
    and ‖K−B‖/‖K‖ on its own axis."""
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) is left alone

    layers = np.arange(len(rows))
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for key, label, marker in (("log_kappa_K", "K_l (attention Jacobian)", "o"),
                               ("log_kappa_B", "B_l = Σ_h A_h ⊗ (W^V_h W^O_h)^T", "s"),
                               ("log_kappa_block", "whole block", "^")):
        ax.plot(layers, [r[key] for r in rows], marker=marker, label=label)
    ax.set_xlabel("layer (block index, 0 = first)")
    ax.set_ylabel("log κ (natural log, float64)")
    ratio = ax.twinx()
    ratio.plot(layers, [r["rel_diff_K_B"] for r in rows], color="gray", linestyle="--", marker=".",
               label="‖K−B‖/‖K‖ (right axis)")
    ratio.set_ylabel("‖K−B‖/‖K‖")
    ax.set_title(title, fontsize=9)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    more = ratio.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def describe(config: ml_collections.ConfigDict, config_name: str) -> str:
    """A two-line title: the config (with its args), then what distinguishes its variants."""
    m = config.model
    size = m.get("variant") or f"d={m.get('width')} L={m.get('depth')} h={m.get('num_heads')}"
    tg = f", tg={m.get('token_graying')}" if m.get("token_graying") else ""
    return (f"{config_name}\n{size}, skip_sab={m.get('skip_sab')}, skip_ffn={m.get('skip_ffn')}, "
            f"init={m.get('init')}{tg}, seed={config.seed}")


def unused_points(model_config: Any) -> tuple[str, ...]:
    """The sums ①+② / ③+④ that a model with that skip off never forms."""
    return tuple(p for p, on in (("sab_skip", model_config.get("skip_sab", True)),
                                 ("ffn_skip", model_config.get("skip_ffn", True))) if not on)


def analyze(
    config: ml_collections.ConfigDict,
    workdir: str | None = None,
    output_dir: str | None = None,
    num_images: int | None = None,
    jacobian: bool = False,
    config_name: str = "config",
    params: str = "model",
) -> dict[str, Any]:
    """Runs the analysis, prints the table, writes log_kappa.{png,json}; returns the result. A
    trainer whose inputs are not images (the lm trainer) analyses its own probe inputs (token
    windows) and adds its measures (`measures`: docs/method/lm_measures.md)."""
    from skipless_jax import models, trainers
    from skipless_jax.data import inputs

    config = config_of_workdir(config, workdir)
    weights = params
    trainer = trainers.of_config(config)
    extra: dict[str, Any] = {}
    if trainer.own_inputs:
        if jacobian:
            raise ValueError(f"--jacobian is implemented for image models; this run's trainer is {config.trainer!r}")
        got = trainer.analysis(config, workdir, weights, num_images)
        model, params, step, source, probe_inputs = (got[k] for k in ("model", "params", "step", "source", "inputs"))
        probe, extra["measures"], probe_kwargs = got["probe"], got["measures"], got.get("inputs_kwargs", {})
    else:
        models.check_config(config.model, inputs.image_size(config))
        config = ml_collections.ConfigDict(config)  # β from its target share, if set, in this copy
        config.model = models.apply_init_self_share(config.model, inputs.image_size(config))[0]
        num_images = num_images or config.get("analysis", {}).get("probe_size", 32)
        model, image_shape = build(config)
        params, step, source = load_params(model, config, image_shape, workdir, weights)
        probe_inputs = probe_images(config, num_images)
        probe, probe_kwargs = f"{len(probe_inputs)} test images", {}
    title = describe(config, config_name)
    result: dict[str, Any] = dict(
        title=title, source=source, step=step, num_images=int(len(probe_inputs)), probe=probe, params=weights,
        model=config.model.to_dict(),
        log_kappa={k: v.tolist() for k, v in embedding_kappa(model, params, probe_inputs, **probe_kwargs).items()},
        **extra,
    )
    if jacobian:
        result["jacobian"] = jacobian_rows(model, params, probe_inputs)
    if (config.model.get("name") or "vit") == "vit":  # docs/method/papers.md §3
        from skipless_jax.models import init as init_lib

        result["num_tokens"] = models.num_tokens(config.model, image_shape[0])
        result["self_attention_share"] = init_lib.self_attention_share(config.model, result["num_tokens"])
    output_dir = output_dir or os.path.join(workdir or ".", "analysis")
    os.makedirs(output_dir, exist_ok=True)
    plot_log_kappa(result["log_kappa"], os.path.join(output_dir, "log_kappa.png"),
                   f"{title}\n{source}, step {step}, mean over {probe}",
                   unused=unused_points(config.model))
    written = [os.path.join(output_dir, "log_kappa.png"), os.path.join(output_dir, "log_kappa.json")]
    if jacobian:
        written.append(os.path.join(output_dir, "jacobian.png"))
        plot_jacobian(result["jacobian"], written[-1], f"{title}\n{source}, step {step}, probe image 0")
    with open(written[1], "w") as f:
        json.dump(result, f, indent=2)
    print(format_table(result), flush=True)
    if "measures" in result:
        print(format_measures(result["measures"]), flush=True)
    if "self_attention_share" in result:
        print(f"Self-attention share at init: {result['self_attention_share']:.4f} (a token's mean attention on "
              f"itself over heads and blocks, {result['num_tokens']} N(0, I) tokens; uniform "
              f"{1 / result['num_tokens']:.4f}; docs/method/papers.md §3)", flush=True)
    print(f"Wrote {', '.join(written)}", flush=True)
    return result


def main(argv: Sequence[str]) -> None:
    del argv
    from absl import flags
    from ml_collections import config_flags

    from skipless_jax import cli

    cfg_flag = flags.FLAGS["config"]
    name = config_flags.get_config_filename(cfg_flag) if cfg_flag.value is not None else "saved config"
    try:
        if cfg_flag.value is None and not flags.FLAGS.workdir:
            raise ValueError("pass --config, or --workdir of a run (its saved config is used)")
        cli.quiet_console(tensorflow=False)
        output_dir = flags.FLAGS.output_dir or os.path.join(flags.FLAGS.workdir or ".", "analysis")
        cli.check_writable("--output_dir", output_dir)  # before the analysis: one line, exit status 2
        compilation_cache.setup(cfg_flag.value)  # before anything compiles (--config's field, else the default)
        with cli.writing("--output_dir", output_dir):
            analyze(
                cfg_flag.value,
                workdir=flags.FLAGS.workdir,
                output_dir=output_dir,
                num_images=flags.FLAGS.num_images,
                jacobian=flags.FLAGS.jacobian,
                config_name=os.path.basename(name),
                params=flags.FLAGS.params,
            )
    except (ValueError, FileNotFoundError) as err:  # one line for the user, not a traceback
        cli.fail(err)  # a bad value: status 2; a missing file or a damaged checkpoint: 1


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Config file, optionally with ':args'.", lock_config=False)
    flags.DEFINE_string("workdir", None, "A run's workdir: analyze its latest checkpoint.")
    flags.DEFINE_string("output_dir", None, "Where log_kappa.png/json go (default <workdir>/analysis).")
    flags.DEFINE_integer("num_images", None, "Probe images (default config.analysis.probe_size).")
    flags.DEFINE_bool("jacobian", False, "Also the per-layer Jacobian κ (small models, float64).")
    flags.DEFINE_string("params", "model", "The weights analysed: model (as trained) or ema (the run's model EMA).")
    from skipless_jax.cli import parse_flags

    app.run(main, flags_parser=parse_flags)

r"""Official DINO and MAE checkpoints as this project's workdirs (docs/method/families.md §20).

    python -m skipless_jax.official_convert --source=dino --input=dino_deitsmall16_pretrain_full_checkpoint.pth \
        --config=configs/dino_vits_baseline.py --workdir=/tmp/dino_official [--which=teacher]
    python -m skipless_jax.official_convert --source=mae --input=mae_pretrain_vit_base.pth \
        --config=configs/mae_vitb_finetune.py --workdir=/tmp/mae_official [--target=mae]
    python -m skipless_jax.evaluate --workdir=/tmp/dino_official    # kNN, linear, dense probes

`--config` is the recipe whose data and evaluators the workdir gets (its `config.model` and,
for DINO, `config.dino` head sizes are replaced by the checkpoint's: width, depth, MLP width
and patch from the shapes, the number of heads from the standard ViT sizes of that width or
`--num_heads`; class token, learned table, exact GELU, both skips, no Token Graying). The
workdir holds one checkpoint (step 0) that `python -m skipless_jax.evaluate` and
`python -m skipless_jax.export` read, and that `--config.init_from` starts a run from.

- facebookresearch/dino (`main_dino.py`'s checkpoint {'student', 'teacher', ...}, the student's
  names under DDP's `module.`; or a released backbone-only state dict): `backbone.*` is a ViT
  in timm's layout (`timm_convert.convert('vit', ...)`), `head.*` the DINO head: `mlp.{0,2,4}`
  Linear layers → `mlp_{0,1,2}`, `last_layer.weight_v` (K, 256) → `last_layer_v` (256, K);
  `last_layer.weight_g` (K, 1) all ones is DINO's `norm_last_layer` (the project's head then
  has no scale), otherwise it becomes `last_layer_g` with `norm_last_layer=False`. The
  workdir is a DINO run's: state {'teacher', 'params'} (both the chosen network).
- facebookresearch/mae (`{'model': state_dict, ...}`): the encoder (`cls_token`, `pos_embed`,
  `patch_embed`, `blocks`, `norm`; the decoder and `mask_token` are dropped) becomes a
  supervised ViT workdir (state {'params'}) with `posemb='learn'` holding MAE's own fixed
  sin-cos table, so its forward is MAE's exactly (the project's `sincos2d` has other
  frequencies, §20); no classifier in the checkpoint: a zero head of the dataset's classes.
  A fine-tuned checkpoint (`fc_norm`, `head`, no `norm`) becomes `pool='gap_fc_norm'`.
  `--target=mae` (a pre-training checkpoint with its decoder) writes an MAE run's workdir
  instead: encoder + `decoder` (`decoder_embed`, `mask_token`, `decoder_blocks` →
  `decoder_block_{i}`, `decoder_norm`, `decoder_pred`), `config.mae` sizes from the shapes
  (`--decoder_num_heads`, MAE's 16 by default). This project's MAE computes its fixed tables
  (`sincos2d`), so both of MAE's are checked to be MAE's formula and replaced (the change is
  printed); the reconstructions then come from the official weights under the project's tables.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
import numpy as np

from skipless_jax import models, timm_convert
from skipless_jax.models import roles
from skipless_jax.nested import flatten

SOURCES = ("dino", "mae")
TARGETS = {"dino": ["dino"], "mae": ["vit", "mae"]}  # the trainer whose workdir is written
WHICH = ("teacher", "student")


def _numpy(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in state_dict.items():
        if hasattr(v, "detach"):  # a torch tensor
            v = v.detach().float().numpy()
        out[k] = np.asarray(v)
    return out


def load(path: str) -> dict[str, Any]:
    """The checkpoint at `path`: a torch file (the official `.pth`, read with torch's safe loader;
    their `args` Namespace allowed), or a flat `.npz`/`.safetensors` state dict."""
    if path.endswith((".npz", ".safetensors")):
        return timm_convert.load_state_dict(path)
    try:
        import torch
    except ImportError:
        raise ValueError(f"--input={path!r} is a torch file; reading it needs torch "
                         "(pip install 'skipless_jax[timm]')") from None
    torch.serialization.add_safe_globals([argparse.Namespace])
    return torch.load(path, map_location="cpu", weights_only=True)


def _strip(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def vit_sizes(backbone: Mapping[str, np.ndarray], num_heads: int | None = None) -> dict[str, int]:
    """width, depth, mlp_dim, patch_size (and num_heads) of a timm-layout ViT state dict."""
    from skipless_jax.models import vit

    width, _, patch, _ = backbone["patch_embed.proj.weight"].shape
    depth = len(timm_convert.block_indices(r"blocks\.(\d+)\.", backbone))
    mlp_dim = int(backbone["blocks.0.mlp.fc1.weight"].shape[0])
    if num_heads is None:
        standard = [h for (w, _, _, h) in vit.VARIANTS.values() if w == width]
        if not standard:
            widths = sorted({v[0] for v in vit.VARIANTS.values()})
            raise ValueError(f"a ViT of width {width} is no standard size ({widths}); pass --num_heads")
        num_heads = standard[0]
    return dict(width=int(width), depth=depth, mlp_dim=mlp_dim, patch_size=int(patch), num_heads=int(num_heads))


def official_model_config(config: ml_collections.ConfigDict, sizes: Mapping[str, int], pool: str) -> None:
    """`config.model` becomes the official ViT's: its sizes, class token or MAE's pooling, a
    learned table, exact GELU, both skips, default init, no Token Graying."""
    config.model.update(dict(
        name="vit", variant=None, **sizes, pool=pool, posemb="learn", gelu="exact", skip_sab=True, skip_ffn=True,
        init="default", token_graying=None,
    ))


def position_table(params: Mapping[str, Any]) -> str:
    """The name of a ViT's learned position table (its role, models/roles.py)."""
    return next(path for path in flatten(params) if models.role_of(path) == roles.POSITION_TABLE)


def _backbone_params(backbone: Mapping[str, np.ndarray], config: ml_collections.ConfigDict) -> dict[str, Any]:
    """timm_convert's ViT, its position table resized to `config`'s grid if it has another (§9)."""
    from skipless_jax.data import inputs
    from skipless_jax.pretrained import posemb_extra, resize_posemb_table

    params = timm_convert.convert("vit", backbone)["params"]
    grid = inputs.image_size(config) // config.model.patch_size
    want = (1, 1 + grid * grid, config.model.width)
    name = position_table(params)
    table = params[name]
    if tuple(table.shape) != want:
        if posemb_extra(tuple(table.shape), want) != 1:
            raise ValueError(f"the checkpoint's pos_embed {tuple(table.shape)} is no (1, 1 + g², d) table")
        params[name] = np.asarray(resize_posemb_table(table, want))
    return params


def dino_head(head: Mapping[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DINOHead params, config.dino sizes) of DINO's `head.*` tensors (prefix stripped)."""
    if "mlp.weight" in head:  # nlayers=1: one Linear
        layers = ["mlp"]
    else:
        layers = [f"mlp.{i}" for i in timm_convert.block_indices(r"mlp\.(\d+)\.", head)]
    if any(k.startswith("mlp.") and k.endswith(("running_mean", "running_var")) for k in head):
        raise ValueError("a DINO head with BatchNorm (use_bn_in_head=True) is not supported")
    params: dict[str, Any] = {}
    for i, name in enumerate(layers):
        params[f"mlp_{i}"] = {"kernel": timm_convert.linear(head[f"{name}.weight"]),
                              "bias": np.asarray(head[f"{name}.bias"])}
    g = head.get("last_layer.weight_g", head.get("last_layer.parametrizations.weight.original0"))
    v = head.get("last_layer.weight_v", head.get("last_layer.parametrizations.weight.original1"))
    if g is None or v is None:
        raise ValueError("the DINO head has no weight-normalized last_layer (weight_g/weight_v); "
                         f"it has {sorted(head)[:6]}")
    params["last_layer_v"] = timm_convert.linear(v)
    norm_last_layer = bool(np.all(np.asarray(g) == 1))
    if not norm_last_layer:
        params["last_layer_g"] = np.asarray(g, np.float32).reshape(-1)
    out_dim, bottleneck = np.asarray(v).shape
    hidden = int(params["mlp_0"]["kernel"].shape[1]) if len(layers) > 1 else 2048
    sizes = dict(out_dim=int(out_dim), bottleneck_dim=int(bottleneck), hidden_dim=hidden, num_layers=len(layers),
                 norm_last_layer=norm_last_layer)
    return params, sizes


def convert_dino(checkpoint: Mapping[str, Any], config: ml_collections.ConfigDict, which: str = "teacher",
                 num_heads: int | None = None) -> tuple[dict[str, Any], ml_collections.ConfigDict]:
    """(state {'teacher', 'params'}, the DINO config) of an official DINO checkpoint."""
    if which not in WHICH:
        raise ValueError(f"--which={which!r} is unknown; allowed: {list(WHICH)}")
    sd = checkpoint.get(which, checkpoint) if isinstance(checkpoint.get(which), Mapping) else checkpoint
    sd = _numpy({k.removeprefix("module."): v for k, v in sd.items()})
    backbone = _strip(sd, "backbone.") if any(k.startswith("backbone.") for k in sd) else {
        k: v for k, v in sd.items() if not k.startswith("head.")}
    head = _strip(sd, "head.")
    config = ml_collections.ConfigDict(config.to_dict())
    config.trainer = "dino"
    official_model_config(config, vit_sizes(backbone, num_heads), "tok")
    params = {"backbone": _backbone_params(backbone, config)}
    if head:
        params["head"], sizes = dino_head(head)
        config.dino.update(sizes)

    def init(model: Any, rng: Any, images: Any) -> Any:  # the student's global crop; the head where converted
        variables = model.init(rng, (images,))
        return variables if head else {"params": {"backbone": variables["params"]["backbone"]}}

    _check_tree(config, params, init)
    return {"teacher": params, "params": params}, config


def convert_mae(checkpoint: Mapping[str, Any], config: ml_collections.ConfigDict,
                num_heads: int | None = None) -> tuple[dict[str, Any], ml_collections.ConfigDict]:
    """(state {'params'}, the supervised ViT config) of an official MAE checkpoint's encoder."""
    from skipless_jax.data import sources

    sd = checkpoint["model"] if isinstance(checkpoint.get("model"), Mapping) else checkpoint
    sd = _numpy({k.removeprefix("module."): v for k, v in sd.items()})
    encoder = {k: v for k, v in sd.items() if not k.startswith(("decoder_", "mask_token"))}
    fine_tuned = "fc_norm.weight" in encoder and "norm.weight" not in encoder
    head = {k: encoder.pop(k) for k in ("head.weight", "head.bias") if k in encoder}
    fc_norm = {k: encoder.pop(k) for k in ("fc_norm.weight", "fc_norm.bias") if k in encoder}
    if fine_tuned:  # timm_convert reads a final `norm`; MAE's global pool has `fc_norm` instead
        encoder.update({k.replace("fc_norm.", "norm."): v for k, v in fc_norm.items()})
    config = ml_collections.ConfigDict(config.to_dict())
    config.trainer = "supervised"
    official_model_config(config, vit_sizes(encoder, num_heads), "gap_fc_norm" if fine_tuned else "tok")
    params = _backbone_params(encoder, config)
    if fine_tuned:
        params["fc_norm"] = params.pop("encoder_norm")
    classes = sources.dataset_info(config.dataset.name).num_classes
    if head and head["head.weight"].shape[0] == classes:
        params["head"] = {"kernel": timm_convert.linear(head["head.weight"]), "bias": np.asarray(head["head.bias"])}
    else:  # a fresh classifier of the dataset's size (kNN and linear probes read the features)
        params["head"] = {"kernel": np.zeros((config.model.width, classes), np.float32),
                          "bias": np.zeros((classes,), np.float32)}
    _check_tree(config, params)
    return {"params": params}, config


def mae_table(width: int, grid: int) -> np.ndarray:
    """MAE's `get_2d_sincos_pos_embed(width, grid, cls_token=True)` (util/pos_embed.py), (1, 1 + g², width)
    float64: [sin(x ω), cos(x ω), sin(y ω), cos(y ω)], ω_k = 10000^(−k/(width/4)) (docs/method/families.md §20)."""
    x, y = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))  # "w goes first"
    omega = 1.0 / 10000 ** (np.arange(width // 4) / (width / 4))
    x, y = x.reshape(-1)[:, None] * omega, y.reshape(-1)[:, None] * omega
    table = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
    return np.concatenate([np.zeros((1, width)), table])[None]


def _fixed_table(name: str, table: np.ndarray) -> float:
    """max |table − MAE's formula| must be float32 rounding (the project's MAE has no learned table);
    returns max |MAE's − this project's sincos2d| (what the conversion changes)."""
    from skipless_jax.models.mae import encoder_position_table

    _, n, width = table.shape
    grid = int(round((n - 1) ** 0.5))
    if np.abs(table - mae_table(width, grid)).max() > 1e-5:
        raise ValueError(f"the checkpoint's {name} is not MAE's fixed sin-cos table; convert it with --target=vit")
    return float(np.abs(mae_table(width, grid) - np.asarray(encoder_position_table(grid, width, table.shape))).max())


def convert_mae_pretraining(checkpoint: Mapping[str, Any], config: ml_collections.ConfigDict,
                            num_heads: int | None = None,
                            decoder_num_heads: int = 16) -> tuple[dict[str, Any], ml_collections.ConfigDict, float]:
    """(state {'params'} with the decoder, the MAE config, max table change) of an official MAE
    pre-training checkpoint: encoder and decoder as this project's MAE, whose fixed tables are
    its own `sincos2d` (MAE's differ in their frequencies, docs/method/families.md §20)."""
    sd = checkpoint["model"] if isinstance(checkpoint.get("model"), Mapping) else checkpoint
    sd = _numpy({k.removeprefix("module."): v for k, v in sd.items()})
    if "decoder_embed.weight" not in sd:
        raise ValueError("the MAE checkpoint has no decoder (decoder_embed.weight); "
                         "convert its encoder with --target=vit")
    changed = max(_fixed_table(name, sd[name]) for name in ("pos_embed", "decoder_pos_embed"))
    encoder = {k: v for k, v in sd.items() if not k.startswith(("decoder_", "mask_token"))}
    config = ml_collections.ConfigDict(config.to_dict())
    config.trainer = "mae"
    official_model_config(config, vit_sizes(encoder, num_heads), "tok")
    params = timm_convert.convert("vit", encoder)["params"]
    del params[position_table(params)]  # fixed: the model computes it
    r = timm_convert.Reader({k: v for k, v in sd.items() if k.startswith(("decoder_", "mask_token"))})
    r("decoder_pos_embed")
    width = int(r.sd["decoder_embed.weight"].shape[0])
    decoder = {"decoder_embed": timm_convert.dense(r, "decoder_embed"), "mask_token": r("mask_token").reshape(-1),
               "decoder_norm": timm_convert.ln(r, "decoder_norm"),
               "decoder_pred": timm_convert.dense(r, "decoder_pred")}
    blocks = timm_convert.block_indices(r"decoder_blocks\.(\d+)\.", r.sd)
    for i in blocks:
        decoder[f"decoder_block_{i}"] = timm_convert.vit_block(r, f"decoder_blocks.{i}", width)
    if r.unused():
        raise ValueError(f"the MAE decoder has tensors this conversion does not know, e.g. {r.unused()[:3]}")
    params["decoder"] = decoder
    mlp_ratio = int(r.sd["decoder_blocks.0.mlp.fc1.weight"].shape[0]) // width if blocks else 4
    config.mae.update(dict(decoder_width=width, decoder_depth=len(blocks), decoder_num_heads=decoder_num_heads,
                           decoder_mlp_ratio=mlp_ratio))
    _check_tree(config, params, lambda model, rng, images: model.init({"params": rng, "masking": rng}, images))
    return {"params": params}, config, changed


def _check_tree(config: ml_collections.ConfigDict, params: Mapping[str, Any],
                init: Callable[[Any, Any, Any], Any] | None = None) -> None:
    """The converted tree against the trainer's model (every leaf, with its shape): the model of
    the trainer record's `build_model` (else the classifier of config.model) initialised by
    `init(model, rng, images)` (default: a classifier's `model.init(rng, images, train=False)`)."""
    import jax
    import jax.numpy as jnp

    from skipless_jax import trainers
    from skipless_jax.data import inputs, sources

    size = inputs.image_size(config)
    channels = sources.dataset_info(config.dataset.name).image_shape[-1]
    dummy = jnp.zeros((1, size, size, channels))
    build = trainers.of_config(config).build_model
    classes = sources.dataset_info(config.dataset.name).num_classes
    model = build(config) if build else models.build(config.model, classes)
    init = init or (lambda m, rng, x: m.init(rng, x, train=False))
    shapes = jax.eval_shape(lambda: init(model, jax.random.PRNGKey(0), dummy))["params"]
    want = {k: tuple(v.shape) for k, v in flatten(shapes).items()}
    got = {k: tuple(np.shape(v)) for k, v in flatten(params).items()}
    wrong = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    if wrong:
        raise ValueError(f"the converted {wrong[0]} is {got.get(wrong[0])}, the {config.trainer} model of the config "
                         f"needs {want.get(wrong[0])} ({len(wrong)} leaves differ)")


def write_workdir(workdir: str, state: Mapping[str, Any], config: ml_collections.ConfigDict, source: str) -> None:
    """`workdir` with one checkpoint (step 0) of `state` and `config` saved with it."""
    if os.path.exists(os.path.join(workdir, "checkpoints")):
        raise ValueError(f"--workdir={workdir!r} already holds checkpoints; choose a new folder")
    config = ml_collections.ConfigDict(config.to_dict())
    config.converted_from = source
    timm_convert.save_state(workdir, state, config.to_json())


def main(argv: list[str]) -> None:
    del argv
    from absl import flags

    from skipless_jax import cli

    f = flags.FLAGS
    cli.check_writable("--workdir", f.workdir)  # a read-only folder, or a file in its place: one line
    try:
        if f.source not in SOURCES:
            raise ValueError(f"--source={f.source!r} is unknown; allowed: {list(SOURCES)}")
        f.target = f.target or TARGETS[f.source][0]
        if f.config is None:
            raise ValueError("--config is required: the recipe whose data and evaluators the workdir gets")
        checkpoint = load(f.input)
        if f.target not in TARGETS[f.source]:
            raise ValueError(f"--target={f.target!r} is not one for --source={f.source}; allowed: {TARGETS[f.source]}")
        if f.source == "dino":
            state, config = convert_dino(checkpoint, f.config, f.which, f.num_heads)
        elif f.target == "mae":
            state, config, changed = convert_mae_pretraining(checkpoint, f.config, f.num_heads, f.decoder_num_heads)
            print(f"the fixed sin-cos tables become this project's sincos2d (max change {changed:.3g}, "
                  "docs/method/families.md §20)")
        else:
            state, config = convert_mae(checkpoint, f.config, f.num_heads)
        with cli.writing("--workdir", f.workdir):
            write_workdir(f.workdir, state, config, os.path.basename(f.input))
    except (ValueError, FileNotFoundError, KeyError) as err:
        raise SystemExit(f"error: {err}") from None
    m = config.model
    print(f"wrote the {f.source} ViT (width {m.width}, depth {m.depth}, patch {m.patch_size}, {m.num_heads} heads, "
          f"pool {m.pool}) to {f.workdir}; run python -m skipless_jax.evaluate --workdir={f.workdir}")


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "The recipe (data, evaluators) of the workdir.", lock_config=False)
    flags.DEFINE_string("source", None, f"Which official repository the checkpoint is from: {', '.join(SOURCES)}.")
    flags.DEFINE_string("input", None, "The official checkpoint (.pth; or a flat .npz/.safetensors state dict).")
    flags.DEFINE_string("workdir", None, "The workdir to write.")
    flags.DEFINE_string("which", "teacher", "DINO: the network to take, 'teacher' or 'student'.")
    flags.DEFINE_string("target", None, "The workdir's kind: dino (--source=dino); vit (default) or mae (with "
                        "the decoder, for reconstructions or more pre-training) for --source=mae.")
    flags.DEFINE_integer("decoder_num_heads", 16, "MAE's decoder heads (--target=mae; MAE's models use 16).")
    flags.DEFINE_integer("num_heads", None, "Attention heads (default: the standard ViT size of that width).")
    flags.mark_flags_as_required(["source", "input", "workdir"])
    app.run(main)

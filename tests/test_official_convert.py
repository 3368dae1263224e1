"""Official DINO and MAE checkpoints (skipless_jax/official_convert.py) on random weights in
their repositories' formats: the converted workdir's forward equals float64 numpy readings of the
official forward (DINO's backbone and head with its weight-normalized last layer; MAE's encoder
with its own sin-cos table, and its fine-tuned global-pool classifier); `evaluate` and `export`
run on the workdirs; MAE's table vs the project's `sincos2d` (docs/method/reports.md §19).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skipless_jax import evaluate, export, models, official_convert
from skipless_jax.models import mae as mae_lib
from skipless_jax.models.common import posemb_sincos_2d
from skipless_jax.trainers import dino
from tests.test_timm_convert import (
    HEADS,
    D,
    P,
    _add,
    _gelu,
    _heads,
    _layer_norm,
    _lin,
    _linear,
    _ln,
    _merge,
    _mlp,
    _mlp_np,
    _np,
    _softmax,
    vit_state_dict,
)
from tests.util import load_config

IMG, CHANNELS, DEPTH = 8, 1, 2  # the digits: 8×8 grey images, 2×2 patches of 4 pixels
GRID = IMG // P


def vit_backbone(sd, rng, prefix="", norm="norm", pos_embed=None):
    sd.update(vit_state_dict(DEPTH, rng=rng, channels=CHANNELS, tokens=GRID * GRID, prefix=prefix, norm=norm,
                             pos_embed=pos_embed, head=False))


HIDDEN, BOTTLENECK, OUT = 16, 8, 12


def dino_checkpoint(seed=0, scaled_last_layer=False):
    """main_dino.py's checkpoint: the student under DDP's `module.`, the teacher plain."""
    out = {"epoch": 3}
    for which, prefix in (("student", "module."), ("teacher", "")):
        rng, sd = np.random.default_rng(seed + (which == "teacher")), {}
        vit_backbone(sd, rng, f"{prefix}backbone.")
        for i, (n_out, n_in) in zip((0, 2, 4), ((HIDDEN, D), (HIDDEN, HIDDEN), (BOTTLENECK, HIDDEN))):
            _linear(sd, rng, f"{prefix}head.mlp.{i}", n_out, n_in)
        g = 1 + 0.5 * rng.random((OUT, 1)) if scaled_last_layer else np.ones((OUT, 1))
        sd[f"{prefix}head.last_layer.weight_g"] = g.astype(np.float32)
        _add(sd, rng, f"{prefix}head.last_layer.weight_v", OUT, BOTTLENECK)
        out[which] = sd
    return out


def official_vit_tokens(sd, images_nchw):
    """timm/DINO/MAE's VisionTransformer up to the blocks' output (before the final norm)."""
    b, c, h, w = images_nchw.shape
    x = images_nchw.reshape(b, c, h // P, P, w // P, P)
    x = np.einsum("bcipjq,ocpq->bijo", x, _np(sd["patch_embed.proj.weight"])) + _np(sd["patch_embed.proj.bias"])
    x = x.reshape(b, -1, D)
    x = np.concatenate([np.broadcast_to(_np(sd["cls_token"]), (b, 1, D)), x], 1) + _np(sd["pos_embed"])
    return blocks_np(sd, "blocks", DEPTH, x)


def blocks_np(sd, prefix, depth, x):
    """timm's pre-LN `Block`s `prefix.{i}` (HEADS heads, exact GELU) on tokens x (B, n, width)."""
    width = x.shape[-1]
    for i in range(depth):
        blk = f"{prefix}.{i}"
        qkv = _lin(sd, f"{blk}.attn.qkv", _layer_norm(sd, f"{blk}.norm1", x, 1e-6))
        q, k, v = (_heads(qkv[..., j * width:(j + 1) * width]) for j in range(3))
        attn = _softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(width // HEADS))
        x = x + _lin(sd, f"{blk}.attn.proj", _merge(attn @ v))
        x = x + _mlp_np(sd, f"{blk}.mlp", _layer_norm(sd, f"{blk}.norm2", x, 1e-6))
    return x


def dino_reading(sd, images_nchw):
    """(CLS features, head output) of DINO's `vision_transformer.py` + `DINOHead`."""
    backbone = {k.removeprefix("backbone."): v for k, v in sd.items() if k.startswith("backbone.")}
    feats = _layer_norm(backbone, "norm", official_vit_tokens(backbone, images_nchw), 1e-6)[:, 0]
    x = _gelu(_lin(sd, "head.mlp.0", feats))
    x = _gelu(_lin(sd, "head.mlp.2", x))
    x = _lin(sd, "head.mlp.4", x)
    x = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)  # F.normalize
    v, g = _np(sd["head.last_layer.weight_v"]), _np(sd["head.last_layer.weight_g"])
    weight = g * v / np.linalg.norm(v, axis=1, keepdims=True)  # torch weight_norm, dim=0
    return feats, x @ weight.T


def _images(n=3, seed=0):
    return np.random.default_rng(seed).normal(size=(n, IMG, IMG, CHANNELS)).astype(np.float32)


def dino_config():
    c = load_config("dino_digits")
    c.evals = dict(knn=dict(type="knn", k=5, temperature=0.07, prefix="test"),
                   linear=dict(type="linear_probe", steps=10, l2=1e-3, prefix="test_linear"))
    return c


@pytest.mark.slow
@pytest.mark.parametrize("which, scaled", [("teacher", False), ("student", True)])
def test_dino_checkpoint_gives_the_official_forward(which, scaled):
    checkpoint = dino_checkpoint(scaled_last_layer=scaled)
    state, config = official_convert.convert_dino(checkpoint, dino_config(), which, num_heads=HEADS)
    assert config.dino.norm_last_layer == (not scaled) and config.dino.out_dim == OUT
    assert config.model.width == D and config.model.depth == DEPTH and config.model.patch_size == P
    images = _images()
    heads, feats = dino.build_model(config).apply({"params": state["teacher"]}, (jnp.asarray(images),))
    sd = {k.removeprefix("module."): v for k, v in checkpoint[which].items()}
    want_feats, want_heads = dino_reading(sd, images.transpose(0, 3, 1, 2).astype(np.float64))
    assert np.abs(want_heads).max() > 0.05
    np.testing.assert_allclose(np.asarray(feats), want_feats, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(heads), want_heads, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_dino_workdir_evaluates_and_exports_its_features(tmp_path):
    checkpoint = dino_checkpoint()
    state, config = official_convert.convert_dino(checkpoint, dino_config(), "teacher", num_heads=HEADS)
    workdir = str(tmp_path / "dino")
    official_convert.write_workdir(workdir, state, config, "synthetic")
    results = evaluate.evaluate(workdir)
    assert results["step"] == 0 and 0 < results["test_knn_accuracy"] <= 1
    assert 0 < results["test_linear_linear_accuracy"] <= 1
    meta = export.export(workdir, None, ("cpu",))
    assert meta["output"] == "features" and meta["output_shape"] == [None, D]
    with open(f"{workdir}/export/model.jax", "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    pixels = np.random.default_rng(1).integers(0, 256, (4, IMG, IMG, CHANNELS), dtype=np.uint8)
    normalized = (pixels / 255.0 - 0.5) / 0.5  # the digits' mean and std
    want, _ = dino_reading(checkpoint["teacher"], normalized.transpose(0, 3, 1, 2))
    np.testing.assert_allclose(np.asarray(exported.call(pixels)), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"already holds checkpoints"):
        official_convert.write_workdir(workdir, state, config, "synthetic")


def mae_table(width, grid, denominator):
    """MAE's util/pos_embed.py get_2d_sincos_pos_embed (cls row 0), with ω_k = 10000^(−k/denominator)."""
    gw, gh = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))  # w goes first

    def one_d(pos):
        omega = 1.0 / 10000 ** (np.arange(width // 4) / denominator)
        out = pos.reshape(-1)[:, None] * omega[None]
        return np.concatenate([np.sin(out), np.cos(out)], 1)

    table = np.concatenate([one_d(gw), one_d(gh)], 1)
    return np.concatenate([np.zeros((1, width)), table])[None]


def test_mae_table_differs_from_sincos2d_only_in_its_frequencies():
    width, grid = 16, 4
    ours = np.asarray(posemb_sincos_2d(grid, grid, width), np.float64)
    np.testing.assert_allclose(ours, mae_table(width, grid, width // 4 - 1)[:, 1:], atol=1e-6)  # big_vision's ω
    assert np.abs(ours - mae_table(width, grid, width // 4)[:, 1:]).max() > 0.1  # MAE's ω: another table


def mae_checkpoint(fine_tuned=False, seed=5):
    rng, sd = np.random.default_rng(seed), {}
    table = None if fine_tuned else mae_table(D, GRID, D // 4).astype(np.float32)
    vit_backbone(sd, rng, norm="fc_norm" if fine_tuned else "norm", pos_embed=table)
    if fine_tuned:
        _linear(sd, rng, "head", 10, D)
    else:  # the pre-training decoder, dropped by the conversion
        _add(sd, rng, "mask_token", 1, 1, 4)
        _linear(sd, rng, "decoder_embed", 4, D)
        _add(sd, rng, "decoder_pos_embed", 1, GRID * GRID + 1, 4)
        _ln(sd, rng, "decoder_norm", 4)
        _linear(sd, rng, "decoder_pred", P * P * CHANNELS, 4)
    return {"model": sd, "epoch": 799}


@pytest.mark.slow
@pytest.mark.parametrize("fine_tuned", [False, True])
def test_mae_checkpoint_gives_the_official_forward(fine_tuned, tmp_path):
    checkpoint = mae_checkpoint(fine_tuned)
    base = load_config("mae_digits_finetune")
    base.evals = dict(knn=dict(type="knn", k=5, temperature=0.07, prefix="test"))
    state, config = official_convert.convert_mae(checkpoint, base, num_heads=HEADS)
    assert config.trainer == "supervised" and config.model.pool == ("gap_fc_norm" if fine_tuned else "tok")
    images = _images()
    logits, out = models.build(config.model, 10).apply({"params": state["params"]}, jnp.asarray(images), train=False)
    sd = checkpoint["model"]
    tokens = official_vit_tokens(sd, images.transpose(0, 3, 1, 2).astype(np.float64))
    if fine_tuned:  # models_vit.py global_pool: the patch tokens' mean, fc_norm, head
        want = _layer_norm(sd, "fc_norm", tokens[:, 1:].mean(1), 1e-6)
        np.testing.assert_allclose(np.asarray(logits), _lin(sd, "head", want), rtol=1e-4, atol=1e-5)
    else:  # MAE's linear probing reads the class token after the norm
        want = _layer_norm(sd, "norm", tokens, 1e-6)[:, 0]
        assert not np.any(np.asarray(logits))  # a zero classifier of the dataset's size
    np.testing.assert_allclose(np.asarray(out["pre_logits"]), want, rtol=1e-4, atol=1e-5)
    workdir = str(tmp_path / "mae")
    official_convert.write_workdir(workdir, state, config, "synthetic")
    assert 0 < evaluate.evaluate(workdir)["test_knn_accuracy"] <= 1


def test_one_line_errors():
    with pytest.raises(ValueError, match=r"a ViT of width 8 is no standard size .*; pass --num_heads"):
        official_convert.convert_dino(dino_checkpoint(), dino_config())
    with pytest.raises(ValueError, match=r"--which='ema' is unknown; allowed: \['teacher', 'student'\]"):
        official_convert.convert_dino(dino_checkpoint(), dino_config(), "ema", HEADS)
    broken = dino_checkpoint()
    del broken["teacher"]["head.last_layer.weight_g"]
    with pytest.raises(ValueError, match=r"no weight-normalized last_layer"):
        official_convert.convert_dino(broken, dino_config(), "teacher", HEADS)


@pytest.mark.slow
def test_cli_converts_a_flat_state_dict_and_refuses_an_unknown_source(tmp_path):
    import subprocess
    import sys

    from skipless_jax import checkpoint
    from tests.util import ROOT

    path = str(tmp_path / "teacher.npz")
    np.savez(path, **dino_checkpoint()["teacher"])  # a released-style flat state dict
    workdir = str(tmp_path / "dino")
    command = [sys.executable, "-m", "skipless_jax.official_convert", f"--input={path}",
               f"--config={ROOT}/configs/dino_digits.py", f"--workdir={workdir}", "--num_heads=2"]
    done = subprocess.run([*command, "--source=dino"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote the dino ViT (width 8, depth 2, patch 4, 2 heads, pool tok)" in done.stdout
    saved = checkpoint.saved_config(workdir)
    assert saved["trainer"] == "dino" and saved["converted_from"] == "teacher.npz"
    assert saved["dino"]["out_dim"] == OUT and saved["model"]["num_heads"] == 2
    bad = subprocess.run([*command, "--source=moco"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == "error: --source='moco' is unknown; allowed: ['dino', 'mae']"
    bad = subprocess.run([*command, "--source=dino", "--target=mae"], capture_output=True, text=True, timeout=300)
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: --target='mae' is not one for --source=dino; allowed: ['dino']")


DW = 8  # the decoder's width (HEADS heads, one block)


def mae_pretraining_checkpoint(seed=6):
    rng, sd = np.random.default_rng(seed), {}
    vit_backbone(sd, rng, pos_embed=official_convert.mae_table(D, GRID).astype(np.float32))
    _add(sd, rng, "mask_token", 1, 1, DW)
    _linear(sd, rng, "decoder_embed", DW, D)
    sd["decoder_pos_embed"] = official_convert.mae_table(DW, GRID).astype(np.float32)
    for k in ("norm1", "norm2"):
        _ln(sd, rng, f"decoder_blocks.0.{k}", DW)
    _linear(sd, rng, "decoder_blocks.0.attn.qkv", 3 * DW, DW)
    _linear(sd, rng, "decoder_blocks.0.attn.proj", DW, DW)
    _mlp(sd, rng, "decoder_blocks.0.mlp", DW, 4 * DW)
    _ln(sd, rng, "decoder_norm", DW)
    _linear(sd, rng, "decoder_pred", P * P * CHANNELS, DW)
    return {"model": sd}


def mae_reading(sd, images_nchw, noise, ratio):
    """models_mae.py's forward (forward_encoder, forward_decoder, forward_loss): (loss, pred, mask)."""
    b, c, h, w = images_nchw.shape
    x = images_nchw.reshape(b, c, h // P, P, w // P, P)
    x = np.einsum("bcipjq,ocpq->bijo", x, _np(sd["patch_embed.proj.weight"])) + _np(sd["patch_embed.proj.bias"])
    x = x.reshape(b, -1, D) + _np(sd["pos_embed"])[:, 1:]
    length = x.shape[1]
    keep = int(length * (1 - ratio))
    ids_shuffle = np.argsort(noise, axis=1, kind="stable")
    ids_restore = np.argsort(ids_shuffle, axis=1, kind="stable")
    x = np.take_along_axis(x, ids_shuffle[:, :keep, None], axis=1)
    mask = np.ones((b, length))
    mask[:, :keep] = 0
    mask = np.take_along_axis(mask, ids_restore, axis=1)
    cls = _np(sd["cls_token"]) + _np(sd["pos_embed"])[:, :1]
    x = np.concatenate([np.broadcast_to(cls, (b, 1, D)), x], 1)
    x = _layer_norm(sd, "norm", blocks_np(sd, "blocks", DEPTH, x), 1e-6)
    y = _lin(sd, "decoder_embed", x)
    tokens = np.concatenate([y[:, 1:], np.broadcast_to(_np(sd["mask_token"]), (b, length + 1 - y.shape[1], DW))], 1)
    y = np.concatenate([y[:, :1], np.take_along_axis(tokens, ids_restore[:, :, None], axis=1)], 1)
    y = blocks_np(sd, "decoder_blocks", 1, y + _np(sd["decoder_pos_embed"]))
    pred = _lin(sd, "decoder_pred", _layer_norm(sd, "decoder_norm", y, 1e-6))[:, 1:]
    target = np.einsum("nchpwq->nhwpqc", images_nchw.reshape(b, c, h // P, P, w // P, P)).reshape(b, length, -1)
    loss = ((pred - target) ** 2).mean(-1)
    return (loss * mask).sum() / mask.sum(), pred, mask


@pytest.mark.slow
def test_mae_pretraining_checkpoint_gives_the_official_reconstruction_under_this_projects_tables(tmp_path):
    from skipless_jax.trainers import mae

    checkpoint = mae_pretraining_checkpoint()
    base = load_config("mae_digits_pretrain")
    state, config, changed = official_convert.convert_mae_pretraining(checkpoint, base, HEADS, decoder_num_heads=HEADS)
    assert config.trainer == "mae" and config.mae.decoder_width == DW and config.mae.decoder_depth == 1
    assert changed > 5e-3  # MAE's tables are not sincos2d (docs/method/families.md §20; 0.0099 on this 2×2 grid)
    images = _images()
    noise = np.random.default_rng(2).random((len(images), GRID * GRID))
    loss, pred, mask = mae.build_model(config).apply(
        {"params": state["params"]}, jnp.asarray(images), train=False, noise=jnp.asarray(noise, jnp.float32))
    ours = {"pos_embed": official_convert.mae_table(D, GRID), "decoder_pos_embed": official_convert.mae_table(DW, GRID)}
    ours = {k: np.asarray(mae_lib.encoder_position_table(GRID, v.shape[-1], v.shape)) for k, v in ours.items()}
    sd = {**checkpoint["model"], **ours}  # the official forward with this project's fixed tables
    want_loss, want_pred, want_mask = mae_reading(sd, images.transpose(0, 3, 1, 2).astype(np.float64), noise,
                                                  config.mae.mask_ratio)
    np.testing.assert_array_equal(np.asarray(mask), want_mask)
    np.testing.assert_allclose(np.asarray(pred), want_pred, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-4)
    workdir = str(tmp_path / "mae")
    official_convert.write_workdir(workdir, state, config, "synthetic")
    assert 0 < evaluate.evaluate(workdir)["test_knn_accuracy"] <= 1
    learned = dict(checkpoint["model"], pos_embed=checkpoint["model"]["pos_embed"] + 0.01)
    with pytest.raises(ValueError, match=r"pos_embed is not MAE's fixed sin-cos table; convert it with --target=vit"):
        official_convert.convert_mae_pretraining({"model": learned}, base, HEADS, HEADS)

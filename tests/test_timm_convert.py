"""The timm converter (skipless_jax/timm_convert.py): synthetic state dicts with timm's
names and shapes → this project's parameters; the converted tiny ViT and CaiT equal float64
numpy readings of timm's forward written from the state dict; every family's tree fits its
model; the written checkpoint loads through `config.init_from`. With timm installed, logits
equal timm's for the same weights.
"""

import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import erf

from skipless_jax import models, timm_convert

D, HEADS, MLP, P, IMG, CLASSES = 8, 2, 16, 4, 8, 5
N = (IMG // P) ** 2


def _rng(seed=0):
    return np.random.default_rng(seed)


def _add(sd, rng, name, *shape):
    sd[name] = rng.normal(0, 0.3, shape).astype(np.float32)


def _ln(sd, rng, name, d):
    sd[f"{name}.weight"] = (1 + 0.1 * rng.normal(size=d)).astype(np.float32)
    sd[f"{name}.bias"] = (0.1 * rng.normal(size=d)).astype(np.float32)


def _linear(sd, rng, name, n_out, n_in, bias=True):
    _add(sd, rng, f"{name}.weight", n_out, n_in)
    if bias:
        _add(sd, rng, f"{name}.bias", n_out)


def _mlp(sd, rng, name, d, hidden):
    _linear(sd, rng, f"{name}.fc1", hidden, d)
    _linear(sd, rng, f"{name}.fc2", d, hidden)


def vit_state_dict(depth=2, seed=0, rng=None, channels=3, tokens=N, prefix="", norm="norm", pos_embed=None,
                   head=True):
    """timm's ViT names (also DINO's and MAE's backbones: `prefix`, the final `norm`'s name, a given table)."""
    rng, sd = rng or _rng(seed), {}
    _add(sd, rng, f"{prefix}cls_token", 1, 1, D)
    if pos_embed is None:
        _add(sd, rng, f"{prefix}pos_embed", 1, tokens + 1, D)
    else:
        sd[f"{prefix}pos_embed"] = pos_embed
    _add(sd, rng, f"{prefix}patch_embed.proj.weight", D, channels, P, P)
    _add(sd, rng, f"{prefix}patch_embed.proj.bias", D)
    for i in range(depth):
        b = f"{prefix}blocks.{i}"
        _ln(sd, rng, f"{b}.norm1", D)
        _linear(sd, rng, f"{b}.attn.qkv", 3 * D, D)
        _linear(sd, rng, f"{b}.attn.proj", D, D)
        _ln(sd, rng, f"{b}.norm2", D)
        _mlp(sd, rng, f"{b}.mlp", D, MLP)
    _ln(sd, rng, f"{prefix}{norm}", D)
    if head:
        _linear(sd, rng, "head", CLASSES, D)
    return sd


def cait_state_dict(depth=2, depth_token_only=1, seed=1):
    rng, sd = _rng(seed), {}
    _add(sd, rng, "cls_token", 1, 1, D)
    _add(sd, rng, "pos_embed", 1, N, D)
    _add(sd, rng, "patch_embed.proj.weight", D, 3, P, P)
    _add(sd, rng, "patch_embed.proj.bias", D)
    for i in range(depth):
        b = f"blocks.{i}"
        _ln(sd, rng, f"{b}.norm1", D)
        _linear(sd, rng, f"{b}.attn.qkv", 3 * D, D)
        _linear(sd, rng, f"{b}.attn.proj", D, D)
        _linear(sd, rng, f"{b}.attn.proj_l", HEADS, HEADS)
        _linear(sd, rng, f"{b}.attn.proj_w", HEADS, HEADS)
        _add(sd, rng, f"{b}.gamma_1", D)
        _add(sd, rng, f"{b}.gamma_2", D)
        _ln(sd, rng, f"{b}.norm2", D)
        _mlp(sd, rng, f"{b}.mlp", D, MLP)
    for k in range(depth_token_only):
        b = f"blocks_token_only.{k}"
        _ln(sd, rng, f"{b}.norm1", D)
        for name in ("q", "k", "v", "proj"):
            _linear(sd, rng, f"{b}.attn.{name}", D, D)
        _add(sd, rng, f"{b}.gamma_1", D)
        _add(sd, rng, f"{b}.gamma_2", D)
        _ln(sd, rng, f"{b}.norm2", D)
        _mlp(sd, rng, f"{b}.mlp", D, MLP)
    _ln(sd, rng, "norm", D)
    _linear(sd, rng, "head", CLASSES, D)
    return sd


def swin_state_dict(seed=2):
    """embed 8, depths (2, 1), heads (2, 2), window 2, patch 2 (timm ≥ 0.9 layout)."""
    rng, sd = _rng(seed), {}
    _add(sd, rng, "patch_embed.proj.weight", 8, 3, 2, 2)
    _add(sd, rng, "patch_embed.proj.bias", 8)
    _ln(sd, rng, "patch_embed.norm", 8)
    for s, (depth, d) in enumerate(((2, 8), (1, 16))):
        if s:
            _ln(sd, rng, f"layers.{s}.downsample.norm", 4 * d // 2)
            _linear(sd, rng, f"layers.{s}.downsample.reduction", d, 2 * d, bias=False)
        for j in range(depth):
            b = f"layers.{s}.blocks.{j}"
            _ln(sd, rng, f"{b}.norm1", d)
            _linear(sd, rng, f"{b}.attn.qkv", 3 * d, d)
            _linear(sd, rng, f"{b}.attn.proj", d, d)
            _add(sd, rng, f"{b}.attn.relative_position_bias_table", 9, 2)
            sd[f"{b}.attn.relative_position_index"] = np.zeros((4, 4), np.int64)  # a buffer: ignored
            _ln(sd, rng, f"{b}.norm2", d)
            _mlp(sd, rng, f"{b}.mlp", d, 4 * d)
    _ln(sd, rng, "norm", 16)
    _linear(sd, rng, "head.fc", CLASSES, 16)
    return sd


def pvt_state_dict(seed=3):
    """widths (8, 16), depths (1, 1), heads (1, 2), sr (2, 1), mlp ratios (2, 2), stem stride 2."""
    rng, sd = _rng(seed), {}
    _add(sd, rng, "patch_embed.proj.weight", 8, 3, 3, 3)
    _add(sd, rng, "patch_embed.proj.bias", 8)
    _ln(sd, rng, "patch_embed.norm", 8)
    for s, (d, sr) in enumerate(((8, 2), (16, 1))):
        if s:
            _add(sd, rng, f"stages.{s}.downsample.proj.weight", d, d // 2, 3, 3)
            _add(sd, rng, f"stages.{s}.downsample.proj.bias", d)
            _ln(sd, rng, f"stages.{s}.downsample.norm", d)
        b = f"stages.{s}.blocks.0"
        _ln(sd, rng, f"{b}.norm1", d)
        _linear(sd, rng, f"{b}.attn.q", d, d)
        _linear(sd, rng, f"{b}.attn.kv", 2 * d, d)
        _linear(sd, rng, f"{b}.attn.proj", d, d)
        if sr > 1:
            _add(sd, rng, f"{b}.attn.sr.weight", d, d, sr, sr)
            _add(sd, rng, f"{b}.attn.sr.bias", d)
            _ln(sd, rng, f"{b}.attn.norm", d)
        _ln(sd, rng, f"{b}.norm2", d)
        _linear(sd, rng, f"{b}.mlp.fc1", 2 * d, d)
        _add(sd, rng, f"{b}.mlp.dwconv.weight", 2 * d, 1, 3, 3)
        _add(sd, rng, f"{b}.mlp.dwconv.bias", 2 * d)
        _linear(sd, rng, f"{b}.mlp.fc2", d, 2 * d)
        _ln(sd, rng, f"stages.{s}.norm", d)
    _linear(sd, rng, "head", CLASSES, 16)
    return sd


def convmixer_state_dict(seed=4):
    """dim 8, depth 2, kernel 3, patch 2."""
    rng, sd = _rng(seed), {}

    def bn(name):
        _ln(sd, rng, name, 8)
        sd[f"{name}.running_mean"] = (0.1 * rng.normal(size=8)).astype(np.float32)
        sd[f"{name}.running_var"] = (1 + 0.2 * rng.random(8)).astype(np.float32)
        sd[f"{name}.num_batches_tracked"] = np.array(3)

    _add(sd, rng, "stem.0.weight", 8, 3, 2, 2)
    _add(sd, rng, "stem.0.bias", 8)
    bn("stem.2")
    for i in range(2):
        _add(sd, rng, f"blocks.{i}.0.fn.0.weight", 8, 1, 3, 3)
        _add(sd, rng, f"blocks.{i}.0.fn.0.bias", 8)
        bn(f"blocks.{i}.0.fn.2")
        _add(sd, rng, f"blocks.{i}.1.weight", 8, 8, 1, 1)
        _add(sd, rng, f"blocks.{i}.1.bias", 8)
        bn(f"blocks.{i}.3")
    _linear(sd, rng, "head", CLASSES, 8)
    return sd


VIT_CFG = dict(name="vit", width=D, depth=2, num_heads=HEADS, mlp_dim=MLP, patch_size=P, gelu="exact", pool="tok")
CAIT_CFG = dict(name="cait", width=D, depth=2, num_heads=HEADS, mlp_dim=MLP, patch_size=P, depth_token_only=1)
FAMILY_CASES = {
    "vit": (vit_state_dict, VIT_CFG),
    "cait": (cait_state_dict, CAIT_CFG),
    "swin": (swin_state_dict, dict(name="swin", width=8, depths=(2, 1), num_heads=(2, 2), window_size=2,
                                   patch_size=2)),
    "pvt_v2": (pvt_state_dict, dict(name="pvt_v2", widths=(8, 16), depths=(1, 1), num_heads=(1, 2),
                                    sr_ratios=(2, 1), mlp_ratios=(2, 2), patch_size=2)),
    "convmixer": (convmixer_state_dict, dict(name="convmixer", width=8, depth=2, kernel_size=3, patch_size=2)),
}

# ------------------------------------------------------------------ numpy readings of timm


def _np(x):
    return np.asarray(x, np.float64)


def _lin(sd, name, x):
    return x @ _np(sd[f"{name}.weight"]).T + _np(sd[f"{name}.bias"])


def _layer_norm(sd, name, x, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * _np(sd[f"{name}.weight"]) + _np(sd[f"{name}.bias"])


def _gelu(x):
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _patch_embed(sd, images_nchw):
    b, c, h, w = images_nchw.shape
    x = images_nchw.reshape(b, c, h // P, P, w // P, P)
    y = np.einsum("bcipjq,ocpq->bijo", x, _np(sd["patch_embed.proj.weight"])) + _np(sd["patch_embed.proj.bias"])
    return y.reshape(b, -1, y.shape[-1])  # tokens row-major, as torch's flatten(2)


def _heads(t):  # (B, N, D) -> (B, h, N, dh)
    b, n, _ = t.shape
    return t.reshape(b, n, HEADS, -1).transpose(0, 2, 1, 3)


def _merge(t):
    b, _, n, _ = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b, n, -1)


def _mlp_np(sd, name, x):
    return _lin(sd, f"{name}.fc2", _gelu(_lin(sd, f"{name}.fc1", x)))


def timm_vit_forward(sd, images_nchw, depth=2):
    x = _patch_embed(sd, images_nchw)
    x = np.concatenate([np.broadcast_to(_np(sd["cls_token"]), (x.shape[0], 1, D)), x], 1) + _np(sd["pos_embed"])
    for i in range(depth):
        b = f"blocks.{i}"
        qkv = _lin(sd, f"{b}.attn.qkv", _layer_norm(sd, f"{b}.norm1", x, 1e-6))
        q, k, v = (_heads(qkv[..., j * D:(j + 1) * D]) for j in range(3))
        attn = _softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(D // HEADS))
        x = x + _lin(sd, f"{b}.attn.proj", _merge(attn @ v))
        x = x + _mlp_np(sd, f"{b}.mlp", _layer_norm(sd, f"{b}.norm2", x, 1e-6))
    x = _layer_norm(sd, "norm", x, 1e-6)
    return _lin(sd, "head", x[:, 0])


def _talk(sd, name, a):  # Linear over the head axis: (B, h, N, N) -> (B, h, N, N)
    return _lin(sd, name, a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def timm_cait_forward(sd, images_nchw, depth=2, depth_token_only=1):
    x = _patch_embed(sd, images_nchw) + _np(sd["pos_embed"])
    for i in range(depth):
        b = f"blocks.{i}"
        qkv = _lin(sd, f"{b}.attn.qkv", _layer_norm(sd, f"{b}.norm1", x, 1e-6))
        q, k, v = (_heads(qkv[..., j * D:(j + 1) * D]) for j in range(3))
        logits = _talk(sd, f"{b}.attn.proj_l", (q / math.sqrt(D // HEADS)) @ k.transpose(0, 1, 3, 2))
        attn = _talk(sd, f"{b}.attn.proj_w", _softmax(logits))
        x = x + _np(sd[f"{b}.gamma_1"]) * _lin(sd, f"{b}.attn.proj", _merge(attn @ v))
        x = x + _np(sd[f"{b}.gamma_2"]) * _mlp_np(sd, f"{b}.mlp", _layer_norm(sd, f"{b}.norm2", x, 1e-6))
    cls = np.broadcast_to(_np(sd["cls_token"]), (x.shape[0], 1, D))
    for kk in range(depth_token_only):
        b = f"blocks_token_only.{kk}"
        u = _layer_norm(sd, f"{b}.norm1", np.concatenate([cls, x], 1), 1e-6)
        q = _heads(_lin(sd, f"{b}.attn.q", u[:, :1]))
        k, v = _heads(_lin(sd, f"{b}.attn.k", u)), _heads(_lin(sd, f"{b}.attn.v", u))
        attn = _softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(D // HEADS))
        cls = cls + _np(sd[f"{b}.gamma_1"]) * _lin(sd, f"{b}.attn.proj", _merge(attn @ v))
        cls = cls + _np(sd[f"{b}.gamma_2"]) * _mlp_np(sd, f"{b}.mlp", _layer_norm(sd, f"{b}.norm2", cls, 1e-6))
    x = _layer_norm(sd, "norm", np.concatenate([cls, x], 1), 1e-6)
    return _lin(sd, "head", x[:, 0])


def _images(n=2, seed=0):
    return np.random.default_rng(seed).normal(size=(n, IMG, IMG, 3)).astype(np.float32)


def _forward(cfg, params, images):
    model = models.build(cfg, CLASSES)
    return np.asarray(model.apply({"params": params}, jnp.asarray(images), train=False)[0], np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("family, reference", [("vit", timm_vit_forward), ("cait", timm_cait_forward)])
def test_converted_weights_reproduce_timms_forward(family, reference):
    make, cfg = FAMILY_CASES[family]
    sd = make()
    params = timm_convert.convert(family, sd, cfg, image_size=IMG)["params"]
    images = _images()
    got = _forward(cfg, params, images)
    want = reference(sd, images.transpose(0, 3, 1, 2).astype(np.float64))
    assert np.abs(want).max() > 0.1  # a non-trivial output
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_every_family_converts_into_its_parameter_tree(family):
    make, cfg = FAMILY_CASES[family]
    sd = make()
    result = timm_convert.convert(family, sd, cfg, image_size=IMG)  # raises on a missing/extra/wrong leaf
    assert result["params"]["head"]["kernel"].shape[-1] == CLASSES
    if family == "convmixer":
        assert set(result["batch_stats"]["embedding_norm"]) == {"mean", "var"}
    with pytest.raises(ValueError, match=r"does not know 1 tensors of the state dict"):
        timm_convert.convert(family, {**sd, "extra.weight": np.zeros(3)}, cfg, image_size=IMG)
    missing = dict(sd)
    missing.pop(next(k for k in sd if k.endswith("norm2.weight") or k.endswith(".3.weight")))
    with pytest.raises(ValueError, match=r"the state dict has no"):
        timm_convert.convert(family, missing, cfg, image_size=IMG)


def test_swin_older_layout_and_new_head():
    sd = swin_state_dict()
    old = {}
    for k, v in sd.items():  # timm < 0.9: the merging at the end of the stage before, head without .fc
        k = k.replace("layers.1.downsample", "layers.0.downsample").replace("head.fc", "head")
        old[k] = v
    cfg = FAMILY_CASES["swin"][1]
    a = timm_convert.convert("swin", sd, cfg, image_size=IMG)["params"]
    b = timm_convert.convert("swin", old, cfg, image_size=IMG)["params"]
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_convmixer_eval_uses_the_converted_running_statistics():
    make, cfg = FAMILY_CASES["convmixer"]
    result = timm_convert.convert("convmixer", make(), cfg, image_size=IMG)
    model = models.build(cfg, CLASSES)
    images = jnp.asarray(_images())
    with_stats = model.apply({"params": result["params"], "batch_stats": result["batch_stats"]}, images, train=False)[0]
    one = model.apply({"params": result["params"], "batch_stats": result["batch_stats"]}, images[:1], train=False)[0]
    np.testing.assert_allclose(with_stats[:1], one, rtol=1e-5, atol=1e-6)  # per-example at eval
    batch_only = model.apply({"params": result["params"]}, images, train=False)[0]
    assert not np.allclose(with_stats, batch_only, atol=1e-4)


def test_written_checkpoint_loads_through_init_from(tmp_path):
    from skipless_jax import pretrained

    make, cfg = FAMILY_CASES["vit"]
    params = timm_convert.convert("vit", make(), cfg, num_classes=3, image_size=IMG)["params"]
    assert np.all(params["head"]["kernel"] == 0) and params["head"]["kernel"].shape == (D, 3)
    out = str(tmp_path / "converted")
    timm_convert.write_checkpoint(params, out, cfg, "synthetic")
    model = models.build(cfg, 3)
    fresh = model.init({"params": jax.random.PRNGKey(0)}, jnp.zeros((1, IMG, IMG, 3)), train=False)["params"]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    loaded = pretrained.init_from(out, fresh, jax.tree.map(lambda _: device, fresh))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), loaded, params)


def test_npz_input_and_cli_errors(tmp_path):
    path = str(tmp_path / "sd.npz")
    np.savez(path, **vit_state_dict())
    assert sorted(timm_convert.load_state_dict(path)) == sorted(vit_state_dict())
    with pytest.raises(ValueError, match=r"--family='resnet' is unknown"):
        timm_convert.model_config("resnet", "50")


TIMM_MODELS = {  # family -> (timm constructor path, kwargs, our config)
    "vit": ("timm.models.vision_transformer.VisionTransformer",
            dict(img_size=IMG, patch_size=P, embed_dim=D, depth=2, num_heads=HEADS, mlp_ratio=MLP / D,
                 num_classes=CLASSES), VIT_CFG),
    "cait": ("timm.models.cait.Cait", dict(img_size=IMG, patch_size=P, embed_dim=D, depth=2, num_heads=HEADS,
                                           mlp_ratio=MLP / D, mlp_ratio_token_only=MLP / D, depth_token_only=1,
                                           num_classes=CLASSES), CAIT_CFG),
    "swin": ("timm.models.swin_transformer.SwinTransformer",
             dict(img_size=IMG, patch_size=2, embed_dim=8, depths=(2, 1), num_heads=(2, 2), window_size=2,
                  num_classes=CLASSES), FAMILY_CASES["swin"][1]),
    # timm's PVTv2 stem has stride 4: its tiny model gets 16×16 images (stage grids 4 and 2).
    "pvt_v2": ("timm.models.pvt_v2.PyramidVisionTransformerV2",
               dict(depths=(1, 1), embed_dims=(8, 16), num_heads=(1, 2), sr_ratios=(2, 1), mlp_ratios=(2, 2),
                    num_classes=CLASSES), dict(FAMILY_CASES["pvt_v2"][1], patch_size=4)),
    "convmixer": ("timm.models.convmixer.ConvMixer",
                  dict(dim=8, depth=2, kernel_size=3, patch_size=2, num_classes=CLASSES), FAMILY_CASES["convmixer"][1]),
}


# timm runs in its own process: torch (and the triton it imports) beside this process's jax and
# TensorFlow can crash at import. One process makes every family's timm model (its own random
# weights, logits on fixed images); a second loads the state dicts `to_timm` wrote back into
# fresh timm models with strict=True and gives their logits.
_TIMM_SCRIPT = """
import importlib, json, os, sys
import numpy as np, torch
cases, folder = json.loads(sys.argv[1]), sys.argv[2]
for mode in ("make", "load"):  # one torch process: "load" once the test says its files are written
    if mode == "load" and sys.stdin.readline().strip() != "load":
        break
    for family, (path, kwargs, size) in cases.items():
        module, name = path.rsplit(".", 1)
        torch.manual_seed(0)
        net = getattr(importlib.import_module(module), name)(**kwargs).eval()
        images = np.random.default_rng(0).normal(size=(2, size, size, 3)).astype(np.float32)
        if mode == "load":
            from safetensors.torch import load_file
            net.load_state_dict(load_file(os.path.join(folder, family + ".safetensors")), strict=True)
        with torch.no_grad():
            logits = net(torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).numpy()
        sd = {k: v.detach().numpy() for k, v in net.state_dict().items()}
        np.savez(os.path.join(folder, f"{family}_{mode}.npz"), __images=images, __logits=logits, **sd)
    print(mode, flush=True)
"""


def _timm_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "timm"))


def _timm_files(mode: str, folder: str) -> dict[str, dict[str, np.ndarray]]:
    return {f: dict(np.load(os.path.join(folder, f"{f}_{mode}.npz"))) for f in TIMM_MODELS}


@pytest.fixture(scope="module")
def timm_runs(tmp_path_factory):
    """{'made': family -> timm's state dict + __images/__logits, 'loaded': the same after
    timm → project → timm, loaded with strict=True}; both from one torch process."""
    import json
    import subprocess
    import sys

    folder = str(tmp_path_factory.mktemp("timm"))
    cases = {f: (path, kwargs, 16 if f == "pvt_v2" else IMG) for f, (path, kwargs, _) in TIMM_MODELS.items()}
    torch = subprocess.Popen([sys.executable, "-c", _TIMM_SCRIPT, json.dumps(cases), folder],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert torch.stdout.readline().strip() == "make", "the timm process failed (its stderr is above)"
        made = _timm_files("make", folder)
        for family, saved in made.items():
            saved = {k: v for k, v in saved.items() if not k.startswith("__")}
            cfg = TIMM_MODELS[family][2]
            result = timm_convert.convert(family, saved, cfg, image_size=16 if family == "pvt_v2" else IMG)
            back = timm_convert.to_timm(family, result["params"], cfg, result.get("batch_stats"))
            timm_convert.write_safetensors(back, os.path.join(folder, f"{family}.safetensors"), {"family": family})
        out, _ = torch.communicate("load\n", timeout=600)
    finally:
        if torch.poll() is None:
            torch.kill()
            torch.wait()
    assert torch.returncode == 0 and out.split() == ["load"], out
    return {"made": made, "loaded": _timm_files("load", folder)}


timm_only = pytest.mark.skipif(not _timm_available(), reason="needs the optional timm extra (requirements-timm.txt)")
safetensors_only = pytest.mark.skipif(importlib.util.find_spec("safetensors") is None,
                                      reason="needs safetensors, of the optional timm extra (requirements-timm.txt)")


@pytest.mark.slow
@timm_only
@pytest.mark.parametrize("family", sorted(TIMM_MODELS))
def test_logits_equal_timms_when_timm_is_installed(family, timm_runs):
    """Runs only with the optional extra (torch, timm): the timm model's own random weights,
    converted, give its logits."""
    _, _, cfg = TIMM_MODELS[family]
    saved = dict(timm_runs["made"][family])
    images, want = saved.pop("__images"), saved.pop("__logits")
    result = timm_convert.convert(family, saved, cfg, image_size=16 if family == "pvt_v2" else IMG)
    variables = {k: result[k] for k in ("params", "batch_stats") if k in result}
    got = np.asarray(models.build(cfg, CLASSES).apply(variables, jnp.asarray(images), train=False)[0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.slow
@timm_only
@pytest.mark.parametrize("family", sorted(TIMM_MODELS))
def test_timm_to_project_to_timm_is_exact(family, timm_runs):
    """timm's state dict → convert → to_timm → timm (load_state_dict strict=True): every tensor
    and the logits bit for bit."""
    made, loaded = timm_runs["made"][family], timm_runs["loaded"][family]
    assert sorted(made) == sorted(loaded)
    for name in made:
        np.testing.assert_array_equal(loaded[name], made[name], err_msg=name)
    assert np.abs(made["__logits"]).max() > 0


def test_to_timm_inverts_convert_on_random_state_dicts():
    """Without timm: convert then to_timm gives back every tensor of the synthetic state dicts
    (timm's computed buffers aside; BatchNorm's step counter comes back as 0)."""
    for family, (make, cfg) in FAMILY_CASES.items():
        sd = make()
        result = timm_convert.convert(family, sd, cfg, image_size=IMG)
        back = timm_convert.to_timm(family, result["params"], cfg, result.get("batch_stats"))
        want = {k: v for k, v in sd.items() if not k.endswith("relative_position_index")}
        assert sorted(back) == sorted(want), family
        for name, value in want.items():
            expected = np.zeros((), np.int64) if name.endswith("num_batches_tracked") else value
            assert back[name].dtype == expected.dtype, name
            np.testing.assert_array_equal(back[name], expected, err_msg=f"{family} {name}")


def test_to_timm_of_a_scanned_vit_equals_the_unrolled_one():
    from skipless_jax.models import vit

    make, cfg = FAMILY_CASES["vit"]
    params = timm_convert.convert("vit", make(), cfg, image_size=IMG)["params"]
    stacked = jax.tree.map(np.asarray, vit.stack_blocks(params))
    a, b = timm_convert.to_timm("vit", params, cfg), timm_convert.to_timm("vit", stacked, dict(cfg, scan=True))
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("family, field, value, message", [
    ("vit", "skip_sab", False, r"config.model.skip_sab=False: timm's vit cannot express it \(it needs skip_sab=True\)"),
    ("swin", "skip_ffn", False, r"config.model.skip_ffn=False: timm's swin cannot express it"),
    ("pvt_v2", "token_graying", "svd", r"config.model.token_graying='svd': timm's pvt_v2 cannot express it"),
    ("vit", "gelu", "tanh", r"config.model.gelu='tanh': .* \(it needs gelu='exact'\)"),
    ("vit", "pool", "gap", r"config.model.pool='gap'"),
    ("cait", "skip_class_ffn", False, r"config.model.skip_class_ffn=False"),
    ("convmixer", "skip_sab", False, r"config.model.skip_sab=False: timm's convmixer"),
])
def test_to_timm_refuses_what_timm_cannot_express(family, field, value, message):
    make, cfg = FAMILY_CASES[family]
    result = timm_convert.convert(family, make(), cfg, image_size=IMG)
    with pytest.raises(ValueError, match=message):
        timm_convert.to_timm(family, result["params"], {**cfg, field: value}, result.get("batch_stats"))


def test_to_timm_errors_and_init_fields():
    make, cfg = FAMILY_CASES["vit"]
    params = timm_convert.convert("vit", make(), cfg, image_size=IMG)["params"]
    # init-only fields choose starting weights, not the forward: they convert.
    same = timm_convert.to_timm("vit", params, {**cfg, "init": "skipless", "head_zero_init": False, "drop_path": 0.1})
    jax.tree.map(np.testing.assert_array_equal, same, timm_convert.to_timm("vit", params, cfg))
    with pytest.raises(ValueError, match=r"does not know 1 parameters, e.g. \['extra/kernel'\]"):
        timm_convert.to_timm("vit", {**params, "extra": {"kernel": np.zeros((2, 2))}}, cfg)
    with pytest.raises(ValueError, match=r"family='resnet' is unknown"):
        timm_convert.to_timm("resnet", params, cfg)
    make, cfg = FAMILY_CASES["convmixer"]
    with pytest.raises(ValueError, match=r"needs batch_stats"):
        timm_convert.to_timm("convmixer", timm_convert.convert("convmixer", make(), cfg, image_size=IMG)["params"], cfg)


@pytest.mark.slow
@safetensors_only
def test_reverse_cli_writes_safetensors(tmp_path):
    import subprocess
    import sys

    from safetensors.numpy import load_file

    make, cfg = FAMILY_CASES["convmixer"]
    sd = make()
    result = timm_convert.convert("convmixer", sd, cfg, image_size=IMG)
    folder = str(tmp_path / "converted")
    timm_convert.write_checkpoint(result["params"], folder, cfg, "synthetic", result["batch_stats"])
    out = str(tmp_path / "back.safetensors")
    command = [sys.executable, "-m", "skipless_jax.timm_convert", "--reverse", f"--input={folder}"]
    done = subprocess.run([*command, f"--output={out}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    back = load_file(out)
    for name, value in sd.items():
        if not name.endswith("num_batches_tracked"):
            np.testing.assert_array_equal(back[name], value, err_msg=name)
    bad = subprocess.run([*command, f"--output={tmp_path / 'x.pth'}"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1] == (
        f"error: --output={str(tmp_path / 'x.pth')!r}: --reverse writes a .safetensors file")


def test_converted_convmixer_checkpoint_holds_its_running_statistics(tmp_path):
    from skipless_jax import checkpoint, pretrained

    make, cfg = FAMILY_CASES["convmixer"]
    result = timm_convert.convert("convmixer", make(), cfg, image_size=IMG)
    out = str(tmp_path / "converted")
    timm_convert.write_checkpoint(result["params"], out, cfg, "synthetic", result["batch_stats"])
    assert checkpoint.state_entries(out) == ["batch_stats", "params"]
    fresh = models.build(cfg, CLASSES).init({"params": jax.random.PRNGKey(0)}, jnp.zeros((1, IMG, IMG, 3)),
                                            train=False)["batch_stats"]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    loaded = pretrained.init_from(out, fresh, jax.tree.map(lambda _: device, fresh), "batch_stats")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), loaded, result["batch_stats"])


# ---- The quickstart's standard ViT, out to timm from the command line (docs/families.md, "Back to timm").

_QUICKSTART_VIT = ["--config=configs/quickstart.py:skip_sab=True,skip_ffn=True,init=default,opt=adamw,depth=1,epochs=1",
                   "--config.schedule.warmup_epochs=0", "--config.model.gelu=exact", "--config.model.pool=tok"]
# timm's ViT with the quickstart's sizes (width 64, 4 heads, MLP 128, 2×2 patches of the 8×8 digits).
_TIMM_QUICKSTART = """
import json, sys
import numpy as np, torch
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer
net = VisionTransformer(img_size=8, patch_size=2, in_chans=1, embed_dim=64, depth=1, num_heads=4, mlp_ratio=2.0,
                        num_classes=10).eval()
net.load_state_dict(load_file(sys.argv[1]), strict=True)
images = np.load(sys.argv[2])
with torch.no_grad():
    print(json.dumps(net(torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).numpy().tolist()))
"""


@pytest.fixture(scope="module")
def quickstart_vit(tmp_path_factory):
    """(the workdir, the CLI's result) of the quickstart's standard ViT trained one epoch with
    the fields timm's ViT needs, given on the command line."""
    import subprocess_runs as sr

    workdir = str(tmp_path_factory.mktemp("quickstart_vit") / "run")
    done = sr.run_cli("skipless_jax.main", *_QUICKSTART_VIT, f"--workdir={workdir}")
    return workdir, done


@pytest.mark.slow
def test_quickstart_takes_the_fields_timms_vit_needs_on_the_command_line(quickstart_vit):
    from skipless_jax import checkpoint

    workdir, done = quickstart_vit
    assert done.returncode == 0, done.stderr[-3000:]
    model = checkpoint.saved_config(workdir)["model"]
    assert (model["gelu"], model["pool"], model["skip_sab"], model["skip_ffn"]) == ("exact", "tok", True, True)
    f = timm_convert.check_timm_expressible("vit", model)  # what --reverse checks first
    assert (f["width"], f["depth"], f["num_heads"], f["patch_size"]) == (64, 1, 4, 2)


@pytest.mark.slow
@safetensors_only
def test_quickstart_vit_goes_back_to_timm_from_the_command_line(quickstart_vit, tmp_path):
    """`timm_convert --reverse` of the run: a .safetensors that timm's ViT of the same sizes loads
    with strict=True and that gives the run's logits (with timm installed)."""
    import json
    import subprocess
    import sys

    from safetensors.numpy import load_file

    import subprocess_runs as sr

    workdir, done = quickstart_vit
    assert done.returncode == 0, done.stderr[-3000:]
    out = str(tmp_path / "vit.safetensors")
    back = sr.run_cli("skipless_jax.timm_convert", "--reverse", f"--input={workdir}", f"--output={out}")
    assert back.returncode == 0 and back.stdout.startswith("wrote 20 tensors"), back.stderr[-3000:]
    sd = load_file(out)
    assert sd["patch_embed.proj.weight"].shape == (64, 1, 2, 2) and sd["pos_embed"].shape == (1, 17, 64)
    if not _timm_available():
        return
    family, cfg, weights, _ = timm_convert.read_checkpoint(workdir)
    images = np.random.default_rng(0).normal(size=(2, 8, 8, 1)).astype(np.float32)
    want = np.asarray(models.build(cfg, 10).apply({"params": weights}, jnp.asarray(images), train=False)[0])
    np.save(tmp_path / "images.npy", images)
    timm = subprocess.run([sys.executable, "-c", _TIMM_QUICKSTART, out, str(tmp_path / "images.npy")],
                          capture_output=True, text=True, timeout=300)
    assert timm.returncode == 0, timm.stderr[-3000:]
    np.testing.assert_allclose(np.array(json.loads(timm.stdout)), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

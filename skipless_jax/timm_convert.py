r"""Weights of timm models (ViT/DeiT, ConvMixer, Swin, CaiT, PVTv2) as this project's parameters.

    python -m skipless_jax.timm_convert --family=swin --variant=S \
        --input=swin_small_patch4_window7_224.pth --output=/tmp/swin_s_timm [--num_classes=10]

`--input` is a timm state dict: a torch file (`.pth`/`.pt`/`.bin`, read with torch, which is
only needed for this: `pip install skipless_jax[timm]`), a `.safetensors` file, or a `.npz` of
name -> array. `--output` becomes a checkpoint folder in this project's format (step 0, the
state `{'params': ...}`), so `--config.init_from=/tmp/swin_s_timm` starts a run from it.
`--num_classes` other than the checkpoint's replaces the classifier by a zero-initialized one
of that size (fine-tuning on another dataset). For a ViT/DeiT `--variant` is the ViT's
('S/16', 'B/16', ...); the converted ViT needs `config.model.gelu='exact'` and `pool='tok'`
(timm's), ConvMixer's BatchNorm running statistics are converted too (`convert` returns them
as `batch_stats`; the checkpoint holds the parameters only).

Back to timm (`to_timm`, the exact inverse of `convert`):

    python -m skipless_jax.timm_convert --reverse --input=WORKDIR --output=model.safetensors [--params=ema]

reads the newest checkpoint of a workdir (or a folder written here) with its saved
`config.model` (`--params=ema`: the run's model EMA instead of the trained weights) and writes
timm's state dict; `timm.create_model(...).load_state_dict(
safetensors.torch.load_file(path), strict=True)` takes it. A model timm cannot express (a
residual switched off, Token Graying on, the tanh GELU, a ViT without the class token or with
the fixed sin-cos table) is a one-line error naming the field.

In code: `convert(family, state_dict, model_config, num_classes) -> {'params': ..., 'batch_stats': ...}`
(nested dicts of numpy arrays), checked against the model's own parameter tree: every
parameter filled with its shape, every tensor of the state dict used (timm's buffers
`relative_position_index`, `attn_mask`, `num_batches_tracked` aside).

Layouts: torch Linear (out, in) → kernel (in, out); Conv (out, in/groups, kh, kw) → (kh, kw,
in/groups, out), a stride-p patch conv flattened to (p·p·in, out) (the `PatchStem` order);
fused qkv (3d, d) → query, key, value; PVTv2's kv (2d, d) → key, value; talking heads (h, h)
transposed like a Linear; Swin checkpoints with the patch merging at the end of stage s (older
timm) or at the start of stage s + 1 (timm ≥ 0.9), and the head as `head` or `head.fc`.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from skipless_jax.nested import flatten

FAMILY_NAMES = ("vit", "convmixer", "swin", "cait", "pvt_v2")
IGNORED = re.compile(r".*(relative_position_index|attn_mask|num_batches_tracked)$")


def linear(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(w).T)


def conv(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(w).transpose(2, 3, 1, 0))


def patch_conv(w: np.ndarray) -> np.ndarray:
    k = conv(w)
    return k.reshape(-1, k.shape[-1])


class _Tensors:
    """Arrays by name (`source`), remembering which were taken: what was left unused is an error."""

    what = "the state dict"

    def __init__(self, source: Mapping[str, Any]):
        self.source = source
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.source:
            raise ValueError(f"{self.what} has no {name!r} (it has e.g. {sorted(self.source)[:4]})")
        self.used.add(name)
        return self.source[name]

    def unused(self) -> list[str]:
        return sorted(set(self.source) - self.used)


class Reader(_Tensors):
    """Takes tensors out of a timm state dict by name (timm's computed buffers ignored)."""

    def __init__(self, state_dict: Mapping[str, Any]):
        super().__init__({k: np.asarray(v, np.float32) for k, v in state_dict.items() if not IGNORED.fullmatch(k)})
        self.sd = self.source


def _set(tree: dict[str, Any], path: str, value: np.ndarray) -> None:
    *parents, leaf = path.split("/")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def ln(r: Reader, src: str) -> dict[str, np.ndarray]:
    return {"scale": r(f"{src}.weight"), "bias": r(f"{src}.bias")}


def dense(r: Reader, src: str, bias: bool = True) -> dict[str, np.ndarray]:
    out = {"kernel": linear(r(f"{src}.weight"))}
    if bias:
        out["bias"] = r(f"{src}.bias")
    return out


def _attention(r: Reader, src: str, d: int) -> dict[str, np.ndarray]:
    """timm's fused qkv (+ proj) -> query/key/value/out kernels and biases."""
    w, b = r(f"{src}.qkv.weight"), r(f"{src}.qkv.bias")
    out = {}
    for i, name in enumerate(("query", "key", "value")):
        out[name], out[f"{name}_bias"] = linear(w[i * d:(i + 1) * d]), b[i * d:(i + 1) * d]
    out["out"], out["out_bias"] = linear(r(f"{src}.proj.weight")), r(f"{src}.proj.bias")
    return out


def _mlp(r: Reader, src: str) -> dict[str, Any]:
    return {"Dense_0": dense(r, f"{src}.fc1"), "Dense_1": dense(r, f"{src}.fc2")}


def block_indices(prefix_re: str, keys: Any) -> list[int]:
    return sorted({int(m.group(1)) for k in keys if (m := re.match(prefix_re, k))})


# ------------------------------------------------------------------ per family


def _class_token_stem(r: Reader) -> dict[str, Any]:
    """The class token, position table, patch embedding and final norm of timm's ViT layout (CaiT's too)."""
    return {
        "cls": r("cls_token"), "pos_embedding": r("pos_embed"),
        "embedding": {"kernel": patch_conv(r("patch_embed.proj.weight")), "bias": r("patch_embed.proj.bias")},
        "encoder_norm": ln(r, "norm"),
    }


def _vit(r: Reader) -> dict[str, Any]:
    if "dist_token" in r:
        raise ValueError("distilled DeiT checkpoints (dist_token, head_dist) are not supported; "
                         "use a non-distilled one")
    p = _class_token_stem(r)
    d = p["cls"].shape[-1]
    for i in block_indices(r"blocks\.(\d+)\.", r.sd):
        p[f"block_{i}"] = vit_block(r, f"blocks.{i}", d)
    if "head.weight" in r:
        p["head"] = dense(r, "head")
    return {"params": p}


def vit_block(r: Reader, src: str, d: int) -> dict[str, Any]:
    """timm's `Block` at `src` (norm1, attn, norm2, mlp) -> an `EncoderBlock`'s parameters."""
    return {"LayerNorm_0": ln(r, f"{src}.norm1"), "MultiHeadAttention_0": _attention(r, f"{src}.attn", d),
            "LayerNorm_1": ln(r, f"{src}.norm2"), "MlpBlock_0": _mlp(r, f"{src}.mlp")}


def _bn(r: Reader, src: str, stats: dict[str, Any], name: str) -> dict[str, np.ndarray]:
    stats[name] = {"mean": r(f"{src}.running_mean"), "var": r(f"{src}.running_var")}
    return {"scale": r(f"{src}.weight"), "bias": r(f"{src}.bias")}


def _convmixer(r: Reader) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    p: dict[str, Any] = {
        "embedding": {"kernel": patch_conv(r("stem.0.weight")), "bias": r("stem.0.bias")},
        "embedding_norm": _bn(r, "stem.2", stats, "embedding_norm"),
    }
    for i in block_indices(r"blocks\.(\d+)\.", r.sd):
        s = f"blocks.{i}"
        p[f"block_{i}_depthwise"] = {"kernel": conv(r(f"{s}.0.fn.0.weight")), "bias": r(f"{s}.0.fn.0.bias")}
        p[f"block_{i}_depthwise_norm"] = _bn(r, f"{s}.0.fn.2", stats, f"block_{i}_depthwise_norm")
        p[f"block_{i}_pointwise"] = {"kernel": conv(r(f"{s}.1.weight"))[0, 0], "bias": r(f"{s}.1.bias")}
        p[f"block_{i}_pointwise_norm"] = _bn(r, f"{s}.3", stats, f"block_{i}_pointwise_norm")
    if "head.weight" in r:
        p["head"] = dense(r, "head")
    return {"params": p, "batch_stats": stats}


def _swin(r: Reader) -> dict[str, Any]:
    p: dict[str, Any] = {
        "embedding": {"kernel": patch_conv(r("patch_embed.proj.weight")), "bias": r("patch_embed.proj.bias")},
        "embedding_norm": ln(r, "patch_embed.norm"),
        "encoder_norm": ln(r, "norm"),
    }
    stages = block_indices(r"layers\.(\d+)\.", r.sd)
    old_layout = "layers.0.downsample.reduction.weight" in r  # merging at the end of a stage (timm < 0.9)
    for s in stages:
        if f"layers.{s}.downsample.reduction.weight" in r:
            target = s + 1 if old_layout else s
            p[f"stage_{target}_merge_norm"] = ln(r, f"layers.{s}.downsample.norm")
            p[f"stage_{target}_merge"] = dense(r, f"layers.{s}.downsample.reduction", bias=False)
        for j in block_indices(rf"layers\.{s}\.blocks\.(\d+)\.", r.sd):
            b = f"layers.{s}.blocks.{j}"
            d = r.sd[f"{b}.norm1.weight"].shape[0]
            p[f"stage_{s}_block_{j}"] = {
                "norm1": ln(r, f"{b}.norm1"), "norm2": ln(r, f"{b}.norm2"), "mlp": _mlp(r, f"{b}.mlp"),
                "window_attention": {"relative_position_bias": r(f"{b}.attn.relative_position_bias_table"),
                                     "attention": _attention(r, f"{b}.attn", d)},
            }
    for name in ("head.fc", "head"):
        if f"{name}.weight" in r:
            p["head"] = dense(r, name)
            break
    return {"params": p}


def _cait(r: Reader) -> dict[str, Any]:
    p = _class_token_stem(r)
    d = p["cls"].shape[-1]
    for i in block_indices(r"blocks\.(\d+)\.", r.sd):
        s = f"blocks.{i}"
        attention = _attention(r, f"{s}.attn", d)
        for name in ("proj_l", "proj_w"):
            attention[name] = linear(r(f"{s}.attn.{name}.weight"))
            attention[f"{name}_bias"] = r(f"{s}.attn.{name}.bias")
        p[f"block_{i}"] = {"norm1": ln(r, f"{s}.norm1"), "norm2": ln(r, f"{s}.norm2"), "attention": attention,
                           "mlp": _mlp(r, f"{s}.mlp"), "gamma_1": r(f"{s}.gamma_1"), "gamma_2": r(f"{s}.gamma_2")}
    for k in block_indices(r"blocks_token_only\.(\d+)\.", r.sd):
        s = f"blocks_token_only.{k}"
        attention = {}
        for src, name in (("q", "query"), ("k", "key"), ("v", "value"), ("proj", "out")):
            attention[name], attention[f"{name}_bias"] = linear(r(f"{s}.attn.{src}.weight")), r(f"{s}.attn.{src}.bias")
        p[f"class_block_{k}"] = {"norm1": ln(r, f"{s}.norm1"), "norm2": ln(r, f"{s}.norm2"), "attention": attention,
                                 "mlp": _mlp(r, f"{s}.mlp"), "gamma_1": r(f"{s}.gamma_1"), "gamma_2": r(f"{s}.gamma_2")}
    if "head.weight" in r:
        p["head"] = dense(r, "head")
    return {"params": p}


def _pvt_v2(r: Reader) -> dict[str, Any]:
    p: dict[str, Any] = {
        "embedding": {"proj": {"kernel": conv(r("patch_embed.proj.weight")), "bias": r("patch_embed.proj.bias")},
                      "norm": ln(r, "patch_embed.norm")},
    }
    for s in block_indices(r"stages\.(\d+)\.", r.sd):
        if f"stages.{s}.downsample.proj.weight" in r:
            ds = f"stages.{s}.downsample"
            p[f"stage_{s}_downsample"] = {
                "proj": {"kernel": conv(r(f"{ds}.proj.weight")), "bias": r(f"{ds}.proj.bias")},
                "norm": ln(r, f"{ds}.norm"),
            }
        p[f"stage_{s}_norm"] = ln(r, f"stages.{s}.norm")
        for j in block_indices(rf"stages\.{s}\.blocks\.(\d+)\.", r.sd):
            b = f"stages.{s}.blocks.{j}"
            d = r.sd[f"{b}.norm1.weight"].shape[0]
            kv_w, kv_b = r(f"{b}.attn.kv.weight"), r(f"{b}.attn.kv.bias")
            attention = {"query": linear(r(f"{b}.attn.q.weight")), "query_bias": r(f"{b}.attn.q.bias"),
                         "key": linear(kv_w[:d]), "key_bias": kv_b[:d], "value": linear(kv_w[d:]),
                         "value_bias": kv_b[d:], "out": linear(r(f"{b}.attn.proj.weight")),
                         "out_bias": r(f"{b}.attn.proj.bias")}
            sra: dict[str, Any] = {"attention": attention}
            if f"{b}.attn.sr.weight" in r:
                sra["sr"] = {"kernel": conv(r(f"{b}.attn.sr.weight")), "bias": r(f"{b}.attn.sr.bias")}
                sra["sr_norm"] = ln(r, f"{b}.attn.norm")
            p[f"stage_{s}_block_{j}"] = {
                "norm1": ln(r, f"{b}.norm1"), "norm2": ln(r, f"{b}.norm2"), "sra": sra,
                "mlp": {"fc1": dense(r, f"{b}.mlp.fc1"), "fc2": dense(r, f"{b}.mlp.fc2"),
                        "dwconv": {"kernel": conv(r(f"{b}.mlp.dwconv.weight")), "bias": r(f"{b}.mlp.dwconv.bias")}},
            }
    if "head.weight" in r:
        p["head"] = dense(r, "head")
    return {"params": p}


CONVERTERS: dict[str, Callable[[Reader], dict[str, Any]]] = {
    "vit": _vit, "convmixer": _convmixer, "swin": _swin, "cait": _cait, "pvt_v2": _pvt_v2,
}


# ------------------------------------------------------------------ back to timm (the inverse)


def unlinear(k: np.ndarray) -> np.ndarray:
    """kernel (in, out) -> torch Linear weight (out, in)."""
    return np.ascontiguousarray(np.asarray(k, np.float32).T)


def unconv(k: np.ndarray) -> np.ndarray:
    """(kh, kw, in/groups, out) -> torch Conv weight (out, in/groups, kh, kw)."""
    return np.ascontiguousarray(np.asarray(k, np.float32).transpose(3, 2, 0, 1))


def unpatch_conv(k: np.ndarray, patch_size: int) -> np.ndarray:
    """(p·p·in, out) `PatchStem` kernel -> the stride-p patch conv weight (out, in, p, p)."""
    rows, out = k.shape
    return unconv(np.asarray(k).reshape(patch_size, patch_size, rows // patch_size**2, out))


class _Writer(_Tensors):
    """Builds a timm state dict (`sd`) from the project's parameter tree, read by '/'-joined path."""

    what = "the parameters"

    def __init__(self, params: Mapping[str, Any]):
        super().__init__({k: np.asarray(v, np.float32) for k, v in flatten(params).items()})
        self.sd: dict[str, np.ndarray] = {}

    def put(self, name: str, value: np.ndarray) -> None:
        self.sd[name] = np.ascontiguousarray(value, np.float32)

    def ln(self, dst: str, src: str) -> None:
        self.put(f"{dst}.weight", self(f"{src}/scale"))
        self.put(f"{dst}.bias", self(f"{src}/bias"))

    def dense(self, dst: str, src: str, bias: bool = True) -> None:
        self.put(f"{dst}.weight", unlinear(self(f"{src}/kernel")))
        if bias:
            self.put(f"{dst}.bias", self(f"{src}/bias"))

    def attention(self, dst: str, src: str) -> None:
        """query/key/value/out -> timm's fused qkv + proj."""
        self.put(f"{dst}.qkv.weight", np.concatenate([unlinear(self(f"{src}/{n}")) for n in ("query", "key", "value")]))
        self.put(f"{dst}.qkv.bias", np.concatenate([self(f"{src}/{n}_bias") for n in ("query", "key", "value")]))
        self.put(f"{dst}.proj.weight", unlinear(self(f"{src}/out")))
        self.put(f"{dst}.proj.bias", self(f"{src}/out_bias"))

    def mlp(self, dst: str, src: str) -> None:
        self.dense(f"{dst}.fc1", f"{src}/Dense_0")
        self.dense(f"{dst}.fc2", f"{src}/Dense_1")

    def indices(self, pattern: str) -> list[int]:
        return block_indices(pattern, self.source)


def _patch_embed_to_timm(w: _Writer, f: dict[str, Any], class_token: bool = False) -> None:
    """timm's `patch_embed.proj` conv (and, with `class_token`, `cls_token` and `pos_embed` first)."""
    if class_token:
        w.put("cls_token", w("cls"))
        w.put("pos_embed", w("pos_embedding"))
    w.put("patch_embed.proj.weight", unpatch_conv(w("embedding/kernel"), f["patch_size"]))
    w.put("patch_embed.proj.bias", w("embedding/bias"))


def _vit_to_timm(w: _Writer, f: dict[str, Any]) -> None:
    _patch_embed_to_timm(w, f, class_token=True)
    for i in w.indices(r"block_(\d+)/"):
        s, b = f"block_{i}", f"blocks.{i}"
        w.ln(f"{b}.norm1", f"{s}/LayerNorm_0")
        w.attention(f"{b}.attn", f"{s}/MultiHeadAttention_0")
        w.ln(f"{b}.norm2", f"{s}/LayerNorm_1")
        w.mlp(f"{b}.mlp", f"{s}/MlpBlock_0")
    w.ln("norm", "encoder_norm")


def _bn_to_timm(w: _Writer, stats: _Writer, dst: str, src: str) -> None:
    w.ln(dst, src)
    w.put(f"{dst}.running_mean", stats(f"{src}/mean"))
    w.put(f"{dst}.running_var", stats(f"{src}/var"))
    w.sd[f"{dst}.num_batches_tracked"] = np.zeros((), np.int64)  # timm's counter; unused at eval


def _convmixer_to_timm(w: _Writer, f: dict[str, Any], stats: _Writer) -> None:
    w.put("stem.0.weight", unpatch_conv(w("embedding/kernel"), f["patch_size"]))
    w.put("stem.0.bias", w("embedding/bias"))
    _bn_to_timm(w, stats, "stem.2", "embedding_norm")
    for i in w.indices(r"block_(\d+)_depthwise/"):
        s, b = f"block_{i}", f"blocks.{i}"
        w.put(f"{b}.0.fn.0.weight", unconv(w(f"{s}_depthwise/kernel")))
        w.put(f"{b}.0.fn.0.bias", w(f"{s}_depthwise/bias"))
        _bn_to_timm(w, stats, f"{b}.0.fn.2", f"{s}_depthwise_norm")
        w.put(f"{b}.1.weight", unlinear(w(f"{s}_pointwise/kernel"))[:, :, None, None])
        w.put(f"{b}.1.bias", w(f"{s}_pointwise/bias"))
        _bn_to_timm(w, stats, f"{b}.3", f"{s}_pointwise_norm")


def _swin_to_timm(w: _Writer, f: dict[str, Any]) -> None:
    """timm ≥ 0.9's layout: the patch merging at the start of stage s + 1 (`layers.{s+1}.downsample`)."""
    _patch_embed_to_timm(w, f)
    w.ln("patch_embed.norm", "embedding_norm")
    for s in w.indices(r"stage_(\d+)_"):
        if f"stage_{s}_merge/kernel" in w:
            w.ln(f"layers.{s}.downsample.norm", f"stage_{s}_merge_norm")
            w.dense(f"layers.{s}.downsample.reduction", f"stage_{s}_merge", bias=False)
        for j in w.indices(rf"stage_{s}_block_(\d+)/"):
            src, b = f"stage_{s}_block_{j}", f"layers.{s}.blocks.{j}"
            w.ln(f"{b}.norm1", f"{src}/norm1")
            w.put(f"{b}.attn.relative_position_bias_table", w(f"{src}/window_attention/relative_position_bias"))
            w.attention(f"{b}.attn", f"{src}/window_attention/attention")
            w.ln(f"{b}.norm2", f"{src}/norm2")
            w.mlp(f"{b}.mlp", f"{src}/mlp")
    w.ln("norm", "encoder_norm")


def _cait_to_timm(w: _Writer, f: dict[str, Any]) -> None:
    _patch_embed_to_timm(w, f, class_token=True)
    for i in w.indices(r"block_(\d+)/"):
        s, b = f"block_{i}", f"blocks.{i}"
        w.attention(f"{b}.attn", f"{s}/attention")
        for name in ("proj_l", "proj_w"):
            w.put(f"{b}.attn.{name}.weight", unlinear(w(f"{s}/attention/{name}")))  # talking heads (h, h)
            w.put(f"{b}.attn.{name}.bias", w(f"{s}/attention/{name}_bias"))
        _cait_block_rest(w, b, s)
    for k in w.indices(r"class_block_(\d+)/"):
        s, b = f"class_block_{k}", f"blocks_token_only.{k}"
        for dst, name in (("q", "query"), ("k", "key"), ("v", "value"), ("proj", "out")):
            w.put(f"{b}.attn.{dst}.weight", unlinear(w(f"{s}/attention/{name}")))
            w.put(f"{b}.attn.{dst}.bias", w(f"{s}/attention/{name}_bias"))
        _cait_block_rest(w, b, s)
    w.ln("norm", "encoder_norm")


def _cait_block_rest(w: _Writer, b: str, s: str) -> None:
    w.ln(f"{b}.norm1", f"{s}/norm1")
    w.ln(f"{b}.norm2", f"{s}/norm2")
    w.mlp(f"{b}.mlp", f"{s}/mlp")
    w.put(f"{b}.gamma_1", w(f"{s}/gamma_1"))
    w.put(f"{b}.gamma_2", w(f"{s}/gamma_2"))


def _pvt_v2_to_timm(w: _Writer, f: dict[str, Any]) -> None:
    del f  # its stem is a plain (overlapping) conv
    downsamples = [(f"stages.{s}.downsample", f"stage_{s}_downsample") for s in w.indices(r"stage_(\d+)_downsample/")]
    for dst, src in [("patch_embed", "embedding"), *downsamples]:
        w.put(f"{dst}.proj.weight", unconv(w(f"{src}/proj/kernel")))
        w.put(f"{dst}.proj.bias", w(f"{src}/proj/bias"))
        w.ln(f"{dst}.norm", f"{src}/norm")
    for s in w.indices(r"stage_(\d+)_norm/"):
        w.ln(f"stages.{s}.norm", f"stage_{s}_norm")
        for j in w.indices(rf"stage_{s}_block_(\d+)/"):
            src, b = f"stage_{s}_block_{j}", f"stages.{s}.blocks.{j}"
            a = f"{src}/sra/attention"
            w.ln(f"{b}.norm1", f"{src}/norm1")
            w.put(f"{b}.attn.q.weight", unlinear(w(f"{a}/query")))
            w.put(f"{b}.attn.q.bias", w(f"{a}/query_bias"))
            w.put(f"{b}.attn.kv.weight", np.concatenate([unlinear(w(f"{a}/key")), unlinear(w(f"{a}/value"))]))
            w.put(f"{b}.attn.kv.bias", np.concatenate([w(f"{a}/key_bias"), w(f"{a}/value_bias")]))
            w.put(f"{b}.attn.proj.weight", unlinear(w(f"{a}/out")))
            w.put(f"{b}.attn.proj.bias", w(f"{a}/out_bias"))
            if f"{src}/sra/sr/kernel" in w:
                w.put(f"{b}.attn.sr.weight", unconv(w(f"{src}/sra/sr/kernel")))
                w.put(f"{b}.attn.sr.bias", w(f"{src}/sra/sr/bias"))
                w.ln(f"{b}.attn.norm", f"{src}/sra/sr_norm")
            w.ln(f"{b}.norm2", f"{src}/norm2")
            w.dense(f"{b}.mlp.fc1", f"{src}/mlp/fc1")
            w.put(f"{b}.mlp.dwconv.weight", unconv(w(f"{src}/mlp/dwconv/kernel")))
            w.put(f"{b}.mlp.dwconv.bias", w(f"{src}/mlp/dwconv/bias"))
            w.dense(f"{b}.mlp.fc2", f"{src}/mlp/fc2")


REVERSE: dict[str, Callable[..., None]] = {
    "vit": _vit_to_timm, "convmixer": _convmixer_to_timm, "swin": _swin_to_timm, "cait": _cait_to_timm,
    "pvt_v2": _pvt_v2_to_timm,
}


def resolved_fields(family: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """`config.model` of `family` with its defaults and variant sizes filled in."""
    from skipless_jax import models

    cfg = dict(cfg)
    if cfg.get("name", family) not in (family, None):
        raise ValueError(f"config.model.name={cfg['name']!r} is not family={family!r}")
    module = models.family({**cfg, "name": family})
    if family != "vit":
        return module.resolve(cfg)
    defaults = dict(skip_sab=True, skip_ffn=True, pool="tok", posemb="learn", gelu="tanh", token_graying=None)
    return {**defaults, **{k: v for k, v in module.resolve_sizes(cfg).items() if v is not None}}


def timm_forward_fields(family: str) -> dict[str, Any]:
    """The config.model fields whose value must be timm's for timm's forward to be the model's:
    the residual switches, Token Graying off, the exact GELU; ViT: class token, learned table."""
    fields: dict[str, Any] = dict(skip_sab=True, skip_ffn=family != "convmixer", token_graying=None, gelu="exact")
    if family == "vit":
        fields.update(pool="tok", posemb="learn")
    if family == "cait":
        fields.update(skip_class_sab=True, skip_class_ffn=True)
    return fields


def check_timm_expressible(family: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved fields of `cfg`; a one-line ValueError naming the first field timm cannot express.

    The init fields (init, init_alpha/beta/c, layerscale_init, head_zero_init, ...) only choose
    the starting weights, so any value converts; dropout and drop-path act in training only.
    """
    if family not in REVERSE:
        raise ValueError(f"family={family!r} is unknown; allowed: {list(REVERSE)}")
    f = resolved_fields(family, cfg)
    for field, want in timm_forward_fields(family).items():
        if f.get(field) != want:
            raise ValueError(f"config.model.{field}={f.get(field)!r}: timm's {family} cannot express it "
                             f"(it needs {field}={want!r})")
    return f


def to_timm(family: str, params: Mapping[str, Any], model_config: Mapping[str, Any],
            batch_stats: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """This project's parameters (+ ConvMixer's running statistics) -> a timm state dict, the
    exact inverse of `convert` (float32 tensors in torch layouts; timm's computed buffers
    `relative_position_index` / `attn_mask` left out, BatchNorm's `num_batches_tracked` 0).

    Swin comes out in timm ≥ 0.9's layout. Every parameter must be used, so a tree that does
    not fit the family (or a scanned ViT's stacked blocks, unstacked first) fails in one line.
    """
    f = check_timm_expressible(family, model_config)
    if family == "vit":
        from skipless_jax.models.vit import unstack_blocks

        params = unstack_blocks(dict(params))
    w = _Writer(params)
    if family == "convmixer":
        if batch_stats is None:
            raise ValueError("family='convmixer' needs batch_stats (its BatchNorm running statistics)")
        stats = _Writer(batch_stats)
        REVERSE[family](w, f, stats)
        unused_stats = stats.unused()
        if unused_stats:
            raise ValueError(f"to_timm('convmixer') does not know the running statistics {unused_stats[:3]}")
    else:
        REVERSE[family](w, f)
    if "head/kernel" in w:
        w.dense("head.fc" if family == "swin" else "head", "head")
    unused = w.unused()
    if unused:
        raise ValueError(f"to_timm({family!r}) does not know {len(unused)} parameters, e.g. {unused[:3]}")
    return w.sd


def read_checkpoint(
    path: str, params: str = "model"
) -> tuple[str, dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """(family, config.model, params, batch_stats or None) of the newest checkpoint at `path` (a
    workdir, or a folder `write_checkpoint` wrote); `params='ema'`: those of the run's model EMA."""
    from skipless_jax import checkpoint, trainers
    from skipless_jax.trainers import model_ema

    saved = checkpoint.saved_config(path)
    if saved is None or "model" not in saved:
        raise ValueError(f"--input={path!r} has no checkpoint with a saved config.model")
    trainer = trainers.name_of(saved)
    if not trainers.get(trainer).classifier:
        raise ValueError(f"--input={path!r} is a {trainer} workdir: its backbone ({trainer}'s parameters, no "
                         "classifier) has no timm counterpart that --reverse writes; reverse a supervised run, or "
                         "fine-tune this one first (config.init_from) and reverse that")
    entries = checkpoint.state_entries(path)
    if "params" not in entries:
        raise ValueError(f"--input={path!r}: its checkpoint has no 'params' (it has {entries}); "
                         "a supervised or converted checkpoint is needed")
    model_ema.check_params(params, entries, path)
    _, state = checkpoint.load_raw(path)
    state = model_ema.weights(state, params)
    to_np = functools.partial(_tree_map, np.asarray)
    stats = to_np(state["batch_stats"]) if "batch_stats" in state else None
    return saved["model"].get("name") or "vit", dict(saved["model"]), to_np(state["params"]), stats


def write_safetensors(state_dict: Mapping[str, np.ndarray], output: str, metadata: Mapping[str, str]) -> None:
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise ValueError(f"--output={output!r}: writing a .safetensors file needs the safetensors package "
                         "(pip install safetensors, or 'skipless_jax[timm]')") from None

    save_file({k: np.ascontiguousarray(v) for k, v in state_dict.items()}, output, metadata=dict(metadata))


def model_config(family: str, variant: str, **fields: Any) -> dict[str, Any]:
    """The `config.model` of a timm model of `family`/`variant` (timm's exact GELU; ViT: class token)."""
    if family not in FAMILY_NAMES:
        raise ValueError(f"--family={family!r} is unknown; allowed: {list(FAMILY_NAMES)}")
    cfg = {"name": family, "variant": variant, "gelu": "exact", **fields}
    if family == "vit":
        cfg.update(pool="tok", posemb="learn")
    return cfg


def abstract_params(cfg: Mapping[str, Any], num_classes: int, image_size: int, channels: int = 3) -> dict[str, Any]:
    """{path: shape} of the model's parameters (jax.eval_shape: nothing is allocated)."""
    import jax
    import jax.numpy as jnp

    from skipless_jax import models

    model = models.build(cfg, num_classes)
    shapes = jax.eval_shape(lambda: model.init({"params": jax.random.PRNGKey(0)},
                                               jnp.zeros((1, image_size, image_size, channels)), train=False))
    return {k: tuple(v.shape) for k, v in flatten(shapes["params"]).items()}


def convert(
    family: str, state_dict: Mapping[str, Any], cfg: Mapping[str, Any] | None = None, num_classes: int | None = None,
    image_size: int = 224,
) -> dict[str, Any]:
    """timm state dict -> {'params': tree[, 'batch_stats': tree]} of numpy float32 arrays.

    With `cfg` (a `config.model`), the result is checked against that model's parameter tree
    (every parameter present with its shape). `num_classes` other than the checkpoint's head
    replaces the head by zeros of that size.
    """
    if family not in CONVERTERS:
        raise ValueError(f"family={family!r} is unknown; allowed: {list(CONVERTERS)}")
    reader = Reader(state_dict)
    result = CONVERTERS[family](reader)
    unused = reader.unused()
    if unused:
        raise ValueError(f"the {family} converter does not know {len(unused)} tensors of the state dict, "
                         f"e.g. {unused[:3]}")
    params = result["params"]
    if num_classes is not None and (params.get("head", {}).get("kernel", np.zeros((0, 0))).shape[-1] != num_classes):
        d = _pre_logits_width(params)
        params["head"] = {"kernel": np.zeros((d, num_classes), np.float32),
                          "bias": np.zeros((num_classes,), np.float32)}
    if cfg is not None:
        channels = _input_channels(family, reader)
        classes = num_classes if num_classes is not None else _num_classes(params)
        want = abstract_params(cfg, classes, image_size, channels)
        got = {k: tuple(v.shape) for k, v in flatten(params).items()}
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            raise ValueError(f"the converted {family} parameters do not fit config.model={dict(cfg)}: "
                             f"missing {missing[:3]}, unexpected {extra[:3]}")
        wrong = [(k, got[k], want[k]) for k in want if got[k] != want[k]]
        if wrong:
            raise ValueError(f"the converted {family} parameter {wrong[0][0]} has shape {wrong[0][1]}, "
                             f"config.model={dict(cfg)} needs {wrong[0][2]}")
    return result


def _num_classes(params: Mapping[str, Any]) -> int:
    return int(params["head"]["kernel"].shape[-1]) if "head" in params else 0


def _pre_logits_width(params: Mapping[str, Any]) -> int:
    if "head" in params:
        return int(params["head"]["kernel"].shape[0])
    for name in ("encoder_norm",):
        if name in params:
            return int(params[name]["scale"].shape[0])
    norms = sorted((k for k in params if re.fullmatch(r"(stage_\d+_norm|block_\d+_pointwise_norm)", k)),
                   key=lambda k: int(re.findall(r"\d+", k)[0]))
    return int(params[norms[-1]]["scale"].shape[0])


def _input_channels(family: str, reader: Reader) -> int:
    """In-channels of the first convolution (torch layout (out, in, kh, kw))."""
    return int(reader.sd["stem.0.weight" if family == "convmixer" else "patch_embed.proj.weight"].shape[1])


def _line(err: BaseException) -> str:
    return " ".join(str(err).split())


def load_state_dict(path: str) -> dict[str, np.ndarray]:
    """A timm state dict from .pth/.pt/.bin (torch), .safetensors or .npz; a missing reader
    package or a file that cannot be read (e.g. a download cut short) is one ValueError."""
    if path.endswith((".npz", ".safetensors")) and not os.path.isfile(path):
        raise FileNotFoundError(f"--input={path!r}: no such file")
    if path.endswith(".npz"):
        try:
            with np.load(path) as f:
                return {k: f[k] for k in f.files}
        except Exception as err:  # zipfile.BadZipFile, EOFError, ValueError, OSError: one line
            raise ValueError(f"--input={path!r} is not a readable .npz ({type(err).__name__}: {_line(err)}); "
                             "is the file complete? Write it again with numpy.savez") from None
    if path.endswith(".safetensors"):
        try:
            from safetensors.numpy import load_file
        except ImportError:
            raise ValueError(f"--input={path!r} is a .safetensors file; reading it needs the safetensors package "
                             "(pip install safetensors, or 'skipless_jax[timm]'), or pass an .npz of name -> array"
                             ) from None
        try:
            return load_file(path)
        except Exception as err:  # safetensors' SafetensorError (e.g. incomplete metadata), OSError
            raise ValueError(f"--input={path!r} is not a readable .safetensors file ({type(err).__name__}: "
                             f"{_line(err)}); "
                             "is the file complete? Download it again") from None
    try:
        import torch
    except ImportError:
        raise ValueError(f"--input={path!r} is a torch file; reading it needs torch "
                         "(pip install 'skipless_jax[timm]'), or pass an .npz of name -> array") from None
    sd = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict", "model_ema"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
            break
    return {k.removeprefix("module."): v.float().numpy() for k, v in sd.items() if hasattr(v, "numpy")}


def write_checkpoint(params: Mapping[str, Any], output: str, model_cfg: Mapping[str, Any], source: str,
                     batch_stats: Mapping[str, Any] | None = None) -> None:
    """`output` as a checkpoint folder of this project (step 0, state {'params': params} and, for
    a model with running statistics, 'batch_stats'; `config.init_from` loads both)."""
    state = {"params": params}
    if batch_stats is not None:
        state["batch_stats"] = batch_stats
    save_state(output, state, json.dumps({"model": dict(model_cfg), "converted_from": source}))


def save_state(output: str, state: Mapping[str, Any], config_json: str) -> None:
    """`output` as a workdir with one checkpoint: step 0, `state` (nested dicts of arrays), the config."""
    import jax.numpy as jnp

    from skipless_jax import checkpoint

    mngr = checkpoint.manager(output, keep=1, async_save=False)
    checkpoint.save(mngr, 0, _tree_map(jnp.asarray, state), {"step": 0, "config": config_json}, announce=False)
    mngr.wait_until_finished()
    mngr.close()


def _tree_map(fn: Callable[[Any], Any], tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _tree_map(fn, v) if isinstance(v, Mapping) else fn(v) for k, v in tree.items()}


def reverse_main(input_path: str, output: str, params: str = "model") -> None:
    """`--reverse`: the checkpoint at `input_path` (its `params`: 'model' or 'ema') -> a timm
    state dict in `output` (.safetensors; its metadata names the weights)."""
    try:
        if not output.endswith(".safetensors"):
            raise ValueError(f"--output={output!r}: --reverse writes a .safetensors file")
        family, cfg, weights, stats = read_checkpoint(input_path, params)
        sd = to_timm(family, weights, cfg, stats)
        write_safetensors(sd, output, {"family": family, "config.model": json.dumps(cfg), "source": input_path,
                                       "params": params})
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None
    count = sum(int(v.size) for k, v in sd.items() if not k.endswith("num_batches_tracked"))
    print(f"wrote {len(sd)} tensors ({count:,} values) of {family} to {output} (timm: load_state_dict(strict=True))")


def main(argv: list[str]) -> None:
    del argv
    from absl import flags

    from skipless_jax import cli

    cli.quiet_console(tensorflow=False)  # main's console: orbax's bookkeeping at --verbosity=1 only
    f = flags.FLAGS
    cli.check_writable("--output", f.output, file=f.reverse)  # a read-only folder, a file in its place: one line
    if f.reverse:
        with cli.writing("--output", f.output):
            return reverse_main(f.input, f.output, f.params)
    try:
        if f.family is None or f.variant is None:
            raise ValueError("--family and --variant are required (unless --reverse)")
        cfg = model_config(f.family, f.variant)
        sd = load_state_dict(f.input)
        result = convert(f.family, sd, cfg, f.num_classes, f.image_size)
        if os.path.exists(os.path.join(f.output, "checkpoints")):
            raise ValueError(f"--output={f.output!r} already holds checkpoints; choose a new folder")
        with cli.writing("--output", f.output):
            write_checkpoint(result["params"], f.output, cfg, os.path.basename(f.input), result.get("batch_stats"))
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None
    count = sum(int(np.prod(v.shape)) for v in flatten(result["params"]).values())
    print(f"wrote {count:,} parameters of {f.family} {f.variant} to {f.output} (use --config.init_from={f.output})")


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_enum("family", None, list(FAMILY_NAMES), "Model family of the checkpoint.")
    flags.DEFINE_string("variant", None, "The family's variant name (ViT: e.g. 'B/16'; swin: 'T', 'S', 'B'; ...).")
    flags.DEFINE_string("input", None, "timm state dict: .pth/.pt/.bin (torch), .safetensors or .npz "
                        "(--reverse: a workdir or converted checkpoint folder).")
    flags.DEFINE_string("output", None, "Checkpoint folder to write (for config.init_from); --reverse: a .safetensors.")
    flags.DEFINE_bool("reverse", False, "This project's checkpoint (--input) -> a timm state dict (--output).")
    flags.DEFINE_string("params", "model", "--reverse: the weights converted, model (as trained) or ema (the run's "
                        "model EMA).")
    flags.DEFINE_integer("num_classes", None, "Classifier size (default: the checkpoint's).")
    flags.DEFINE_integer("image_size", 224, "Image size the model is checked at (ViT/CaiT: the position table's).")
    flags.mark_flags_as_required(["input", "output"])
    from skipless_jax.cli import parse_flags  # --help exits 0, flag errors are one line (status 2)

    app.run(main, flags_parser=parse_flags)

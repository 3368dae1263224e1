"""Parameter roles (skipless_jax/models/roles.py): every parameter of every family, of MAE's
pre-training model, of DINO's head and of the causal decoder has a role, read from its own
model's `ROLES`; the roles that the init schemes, decay masks, layer decay and init_from act on
are the ones their names say (the names written out here, independently of the tables). Roles
fail closed: no pattern is a catch-all, every pattern names a parameter that exists, and a model
with an unlabelled parameter fails to build."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import pytest

from skipless_jax import models
from skipless_jax.models import dino_head, gpt, mae, roles, vit
from skipless_jax.nested import flatten

from util import tiny_model

SIZE = 32
FAMILIES = tuple(f for f in models.FAMILIES if f != "gpt")  # the image families; a new one is checked too
VIT = dict(name="vit", width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=4)
# Leaves whose role the consumers rely on, by family (top-level path -> role).
KNOWN = {
    "vit": {"cls": roles.CLASS_TOKEN, "pos_embedding": roles.POSITION_TABLE, "embedding/kernel": roles.PATCH_KERNEL,
            "block_0/MultiHeadAttention_0/query": roles.ATTENTION_QKV, "head/kernel": roles.HEAD_KERNEL,
            "encoder_norm/scale": roles.NORM_SCALE, "block_1/MlpBlock_0/Dense_0/bias": roles.BIAS},
    "convmixer": {"block_0_depthwise/kernel": roles.DEPTHWISE_KERNEL, "embedding_norm/scale": roles.NORM_SCALE,
                  "block_0_pointwise/kernel": roles.KERNEL},
    "swin": {"stage_0_block_0/window_attention/relative_position_bias": roles.RELATIVE_POSITION_TABLE,
             "stage_1_merge/kernel": roles.KERNEL, "embedding/bias": roles.PATCH_BIAS},
    "cait": {"block_0/gamma_1": roles.LAYER_SCALE, "block_0/attention/proj_l": roles.TALKING_HEADS,
             "block_0/attention/proj_w_bias": roles.ATTENTION_BIAS, "cls": roles.CLASS_TOKEN,
             "pos_embedding": roles.POSITION_TABLE},
    "pvt_v2": {"embedding/proj/kernel": roles.PATCH_KERNEL, "stage_1_downsample/proj/kernel": roles.CONV_KERNEL,
               "stage_0_block_0/sra/sr/kernel": roles.CONV_KERNEL,
               "stage_0_block_0/mlp/dwconv/bias": roles.DEPTHWISE_BIAS,
               "stage_0_norm/scale": roles.NORM_SCALE},
}


def family_config(family: str) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(VIT if family == "vit" else tiny_model({"name": family}, SIZE))


def param_shapes(model, *args) -> dict:
    rngs = {"params": jax.random.PRNGKey(0), "masking": jax.random.PRNGKey(1)}
    return jax.eval_shape(lambda: model.init(rngs, *args))["params"]


def param_paths(model, *args) -> list[str]:
    return sorted(flatten(param_shapes(model, *args)))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_of_every_family_has_a_role(family):
    config = family_config(family)
    paths = param_paths(models.build(config, 10, SIZE), jnp.zeros((1, SIZE, SIZE, 3)))
    description = models.describe(config)
    found = {path: description.role_of(path) for path in paths}
    assert set(found.values()) <= set(roles.ROLES)
    assert {path: found[path] for path in KNOWN.get(family, {})} == KNOWN.get(family, {})
    assert {path: models.role_of(path) for path in paths} == found  # the family-blind reading agrees


def test_the_vit_s_other_layouts_and_poolings_have_roles():
    for fields in (dict(pool="gap_fc_norm"), dict(scan=True), dict(pool="gap", posemb="sincos2d")):
        config = ml_collections.ConfigDict({**VIT, **fields})
        paths = param_paths(models.build(config, 10, SIZE), jnp.zeros((1, SIZE, SIZE, 3)))
        assert all(models.describe(config).role_of(p) in roles.ROLES for p in paths)
    assert models.role_of("fc_norm/bias") == roles.NORM_BIAS
    assert models.role_of("backbone/pos_embedding") == roles.POSITION_TABLE  # a DINO student's backbone
    assert models.role_of("encoder_layers/block/MultiHeadAttention_0/out") == roles.ATTENTION_OUT


def test_mae_and_the_causal_decoder_have_roles():
    model = mae.MAE(patch_size=4, width=16, depth=1, mlp_dim=32, num_heads=2, decoder_width=8, decoder_depth=1,
                    decoder_num_heads=2)
    found = roles.roles(param_shapes(model, jnp.zeros((1, 16, 16, 3))), mae.ROLES)
    assert found["decoder/mask_token"] == roles.MASK_TOKEN and found["cls"] == roles.CLASS_TOKEN
    assert found["decoder/decoder_embed/kernel"] == roles.KERNEL
    assert found["decoder/decoder_norm/scale"] == roles.NORM_SCALE
    config = ml_collections.ConfigDict(dict(name="gpt", width=16, depth=1, mlp_dim=32, num_heads=2, seq_len=8,
                                            tied_head=False))
    paths = param_paths(gpt.build(config, 11), jnp.zeros((1, 8), jnp.int32))
    found = {path: models.describe(config).role_of(path) for path in paths}
    assert found["token_embedding/embedding"] == roles.TOKEN_TABLE
    assert found["pos_embedding"] == roles.POSITION_TABLE and found["head/kernel"] == roles.HEAD_KERNEL


def test_a_dino_model_has_roles_under_its_backbone_prefix():
    model = dino_head.DINO(models.build(ml_collections.ConfigDict(VIT), 0, SIZE),
                           dino_head.DINOHead(out_dim=16, hidden_dim=8, bottleneck_dim=4))
    paths = param_paths(model, (jnp.zeros((1, SIZE, SIZE, 3)),))
    found = {path: models.role_of(path) for path in paths}
    assert found["backbone/cls"] == roles.CLASS_TOKEN and found["head/last_layer_v"] == roles.KERNEL
    assert found["backbone/block_0/MultiHeadAttention_0/query"] == roles.ATTENTION_QKV


def test_a_parameter_without_a_role_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"'block_0/extra' has no role"):
        roles.role_of("block_0/extra", vit.ROLES)
    with pytest.raises(ValueError, match="has no role"):
        models.describe(ml_collections.ConfigDict(VIT)).role_of("cls_token")


GPT = dict(name="gpt", width=16, depth=1, mlp_dim=32, num_heads=2, seq_len=8)


def every_model() -> dict[str, tuple[nn.Module, tuple]]:
    """name -> (model, init inputs): every family (the ViT's poolings, GPT's attention shapes and
    heads), DINO on every image family, MAE."""
    image = jnp.zeros((1, SIZE, SIZE, 3))
    out = {}
    for family in FAMILIES:
        out[family] = (models.build(family_config(family), 10, SIZE), (image,))
        head = dino_head.DINOHead(out_dim=16, hidden_dim=8, bottleneck_dim=4, norm_last_layer=family != "vit")
        out[f"dino_{family}"] = (dino_head.DINO(models.build(family_config(family), 0, SIZE), head), ((image,),))
    out["vit_gap_fc_norm"] = (models.build(ml_collections.ConfigDict({**VIT, "pool": "gap_fc_norm"}), 10, SIZE),
                              (image,))
    out["vit_scan"] = (models.build(ml_collections.ConfigDict({**VIT, "scan": True}), 10, SIZE), (image,))
    for shape in ("softmax", "value_skip", "sas", "sas_p"):
        config = ml_collections.ConfigDict({**GPT, "attention_shape": shape, "tied_head": shape != "sas"})
        out[f"gpt_{shape}"] = (gpt.build(config, 11), (jnp.zeros((1, 8), jnp.int32),))
    out["mae"] = (mae.MAE(patch_size=4, width=16, depth=1, mlp_dim=32, num_heads=2, decoder_width=8, decoder_depth=1,
                          decoder_num_heads=2), (jnp.zeros((1, 16, 16, 3)),))
    return out


def test_no_unlabelled_parameter_in_any_model():
    """Every leaf of every model has a role in its own table (`models.role_table`), and every
    pattern of every table names a leaf that exists (no catch-all, no stale name)."""
    used = set()
    for name, (model, args) in every_model().items():
        table = models.role_table(model)
        for path in flatten(param_shapes(model, *args)):
            assert roles.role_of(path, table) in roles.ROLES, (name, path)
            used.add(next(p for p, _ in (*table, *roles.SHARED) if re.search(p, path)))
    patterns = {p for module in models.ROLE_MODULES for p, _ in roles.table_of(module)} | {p for p, _ in roles.SHARED}
    assert patterns - used == set()
    for leaf in ("kernel", "bias", "block_0/extra/kernel", "block_0/Dense_0/bias", "head/extra/kernel"):
        assert models.find_role(leaf) is None  # no catch-all


class ExtraDense(vit.ViT):
    """A ViT with one Dense layer that no table names."""

    @nn.compact
    def __call__(self, images, train=False):
        logits, out = super().__call__(images, train)
        return nn.Dense(3, name="extra")(logits), out


def test_a_model_with_an_unlabelled_dense_fails_to_build():
    config = ml_collections.ConfigDict(VIT)
    model = ExtraDense(**vit.model_kwargs(config, 10))
    with pytest.raises(ValueError) as error:
        models.init_variables(config, model, jax.random.PRNGKey(0), jnp.zeros((1, SIZE, SIZE, 3)))
    assert "'extra/kernel' has no role" in str(error.value) and "\n" not in str(error.value)

"""Every trainer step divides its work over 8 fake CPU devices and equals the 1-device step.

The steps are the trainers' own (`supervised.make_train_step`, `dino.make_train_step`) on the
state the trainers build, compiled by `benchmarks/scaling.py` for 1 and 8 devices; XLA's
per-device figures (`cost_analysis()["flops"]`, `memory_analysis()`) are compared:
  - per-device FLOPs of the data-parallel step ≤ 0.2× the 1-device step (ideal 0.125);
  - under FSDP (all devices on `fsdp`) per-device parameter + optimizer-state bytes ≤ 0.2×;
  - gradient accumulation with k = 4 needs ≤ 0.5× the temporary memory of k = 1 (same batch);
  - two steps on every mesh give the 1-device state and metrics (1e-5).
The sharding rules' floor, key replication and one-line errors are tested without compiling.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from skipless_jax import sharding
from skipless_jax.trainers import common

from util import init_params

_SCALING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "scaling.py")
_spec = importlib.util.spec_from_file_location("benchmarks_scaling", _SCALING)
scaling = sys.modules.setdefault("benchmarks_scaling", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(scaling)

# Big enough that the model's work dominates the replicated bookkeeping (non-finite guard,
# norms), small enough to compile in seconds: one block. SOAP at width 128, where its factor
# math is a third of the 1-device step; refreshed every step so that two steps run eigh and QR.
CONFIGS = {
    "adamw": lambda: scaling.supervised_config("adamw", width=64, depth=1, batch=256),
    "accum4": lambda: scaling.supervised_config("adamw", width=64, depth=1, batch=256, accum=4),
    "mixup": lambda: _mixup_config(),  # mixup/cutmix per device shard inside the step
    "soap": lambda: _soap_config(),
    "soap_scan": lambda: _soap_config(scan=True),  # stacked layers: per-layer factors (L, s, s)
    "dino": lambda: scaling.dino_config("adamw", width=64, depth=1, batch=64),
    "convmixer": lambda: scaling.convmixer_config(width=128, depth=1, batch=256),  # BatchNorm over the global batch
    "ema": lambda: _ema_config(),  # model EMA in the state (ZeRO-sharded), moved inside the step
}
MESHES = {"one": {"data": 1}, "data": {"data": 8}, "fsdp": {"fsdp": 8}, "mixed": {"data": 2, "fsdp": 4}}


def _mixup_config():
    import ml_collections

    from skipless_jax import config_blocks

    c = scaling.supervised_config("adamw", width=64, depth=1, batch=256)
    c.input.aug = ml_collections.ConfigDict(config_blocks.deit_aug(mixup_switch_prob=0.5))
    return c


def _ema_config():
    c = scaling.supervised_config("adamw", width=64, depth=1, batch=256)
    c.model_ema.decay = 0.9
    return c


@pytest.mark.slow
def test_the_ema_is_kept_and_moved_in_shards():
    """The EMA's bytes per device on 8 data-parallel devices are ≤ 0.2× the 1-device EMA (ZeRO),
    and the EMA after two steps differs from the parameters (it was moved, not copied)."""
    one, eight = compiled("ema", "one"), compiled("ema", "data")
    ratio = scaling.state_bytes_per_device(eight.program, ("ema",)) / scaling.state_bytes_per_device(one.program,
                                                                                                      ("ema",))
    assert ratio <= 0.2, f"the EMA takes {ratio:.3f}× its 1-device bytes per device"
    state, _ = eight.after_two_steps()
    assert not np.allclose(state.ema["params"]["head"]["kernel"], state.params["head"]["kernel"])


def _soap_config(scan: bool = False):
    c = scaling.supervised_config("soap", width=128, depth=1, batch=64)
    c.optimizer.precondition_frequency = 1
    c.model.scan = scan
    return c


class Compiled:
    """A trainer step compiled for one mesh, its XLA figures and the state after two steps."""

    def __init__(self, kind: str, mesh: str):
        build = scaling.dino_program if kind == "dino" else scaling.supervised_program
        self.program = build(CONFIGS[kind](), MESHES[mesh])
        self.compiled = self.program.compile()
        cost = self.compiled.cost_analysis()
        self.flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
        self.memory = self.compiled.memory_analysis()
        self.state_bytes = scaling.state_bytes_per_device(self.program)
        self._after = None

    def after_two_steps(self):
        if self._after is None:
            state, metrics = self.program.init(), []
            for seed in range(2):
                batch = self.program.batch(scaling.random_batch(self.program, seed))
                with jax.set_mesh(self.program.mesh):
                    state, m = self.compiled(state, batch)
                metrics.append(m)
            self._after = jax.device_get((state, metrics))
        return self._after


_CACHE: dict[tuple[str, str], Compiled] = {}


def compiled(kind: str, mesh: str) -> Compiled:
    if (kind, mesh) not in _CACHE:
        _CACHE[kind, mesh] = Compiled(kind, mesh)
    return _CACHE[kind, mesh]


# Leaves whose update is rounding noise, so that any two reduction orders (1 vs 8 devices)
# differ, however the step is partitioned:
#  - key_bias: its exact gradient is zero (a shift of every key leaves the softmax unchanged);
#    Adam and SOAP normalize the rounding noise to an lr-sized step;
#  - head/kernel under SOAP: its factor over the input axis, G Gᵀ with G = featuresᵀ (p − y),
#    has rank ≤ classes − 1 (softmax gradients sum to zero over classes) < width, and eigh's
#    basis of the null space is whatever it makes of the noise (replicated SOAP state alike).
NOISE = ("key_bias",)
SOAP_NOISE = (*NOISE, "head/kernel")


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6, skip=NOISE):
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        name = sharding.path_str(path)
        if any(part in name for part in skip):
            continue
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_data_parallel_step_divides_flops_and_equals_one_device(kind):
    one, eight = compiled(kind, "one"), compiled(kind, "data")
    ratio = eight.flops / one.flops
    assert ratio <= 0.2, f"{kind}: per-device FLOPs on 8 devices are {ratio:.3f}× the 1-device step"
    if kind in PER_DEVICE:
        return
    skip = SOAP_NOISE if kind.startswith("soap") else NOISE
    assert_trees_close(eight.after_two_steps(), one.after_two_steps(), skip=skip)


# Steps whose result depends on the device count by definition: the mix is drawn per device
# shard (docs/method/recipes.md §23, docs/design.md "1 vs 8 devices").
PER_DEVICE = ("mixup",)


def test_per_device_mixing_moves_no_image_batch_between_devices():
    """The 8-device mixup step's HLO holds no all-to-all / collective-permute / all-gather /
    all-reduce whose operand or result has the image batch's per-device or global shape."""
    import re

    from skipless_jax.data import inputs

    eight = compiled("mixup", "data")
    config = CONFIGS["mixup"]()
    size, batch = inputs.image_size(config), config.input.batch_size
    hlo = eight.compiled.as_text()
    # (B | B/8, H, W, C) and a per-shard view (S, B/S, H, W, C) of it, any dtype
    image = re.compile(rf"\[(\d+,)?({batch}|{batch // 8}),{size},{size},\d+\]")
    ops = r"(all-to-all|collective-permute|all-gather|all-reduce|reduce-scatter)(-start)?"
    moved = [line.strip() for line in hlo.splitlines() if re.search(rf"\b{ops}\(", line) and image.search(line)]
    assert not moved, "\n".join(moved[:3])
    assert re.search(rf"\b{ops}\(", hlo)  # the check can see collectives: the gradients are reduced


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_fsdp_state_bytes_per_device(kind):
    """Parameters + optimizer state per device under FSDP (the shards the shardings give)."""
    config = CONFIGS[kind]()
    build = scaling.dino_program if kind == "dino" else scaling.supervised_program
    one, fsdp = build(config, MESHES["one"]), build(config, MESHES["fsdp"])
    ratio = scaling.state_bytes_per_device(fsdp) / scaling.state_bytes_per_device(one)
    assert ratio <= 0.2, f"{kind}: FSDP keeps {ratio:.3f}× the state per device"


@pytest.mark.slow
def test_soap_on_a_mixed_mesh():
    """data 2 × fsdp 4: parameters split 4 ways, SOAP's state 8 ways (ZeRO), its math partitioned."""
    one, other = compiled("soap", "one"), compiled("soap", "mixed")
    assert other.flops / one.flops <= 0.2
    bytes_ratio = other.memory.argument_size_in_bytes / one.memory.argument_size_in_bytes
    assert bytes_ratio <= 0.2, f"XLA's per-device argument bytes are {bytes_ratio:.3f}× one device's"
    assert_trees_close(other.after_two_steps(), one.after_two_steps(), skip=SOAP_NOISE)


@pytest.mark.slow
@pytest.mark.parametrize("kind, mesh", [("soap", "data"), ("soap", "mixed"), ("soap_scan", "fsdp")])
def test_soap_factorizations_are_divided_over_the_devices(kind, mesh):
    """Each device's program factorizes its share of SOAP's factors: counted as LAPACK calls in
    the compiled per-device program (eigh: syevd at call 0; QR: orgqr on refresh)."""
    import re

    def calls(c):
        text = c.compiled.as_text()
        return {name: len(re.findall(rf"custom_call_target=\"[^\"]*{name}", text)) for name in ("syevd", "orgqr")}

    one, many = calls(compiled(kind, "one")), calls(compiled(kind, mesh))
    for name in one:
        assert one[name] >= 4 and many[name] <= 0.5 * one[name], (name, one, many)


def test_accumulation_memory_and_gradient():
    """k = 4 strided micro-batches: ≤ 0.5× the temporaries of k = 1 at the same global batch on
    8 devices, and the same update as the full batch."""
    full, accum = compiled("adamw", "data"), compiled("accum4", "data")
    ratio = accum.memory.temp_size_in_bytes / full.memory.temp_size_in_bytes
    assert ratio <= 0.5, f"accumulation over 4 micro-batches needs {ratio:.3f}× the temporaries"
    (state_a, metrics_a), (state_f, metrics_f) = accum.after_two_steps(), full.after_two_steps()
    assert_trees_close(state_a.params, state_f.params)
    for m_a, m_f in zip(metrics_a, metrics_f):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(m_a[key], m_f[key], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# The rules, without compiling.


def _mesh(**axes):
    mesh = {"data": axes.get("data", 1), "fsdp": axes.get("fsdp", 1)}
    return sharding.make_mesh(mesh, jax.devices()[: math.prod(mesh.values())])


def _shardings(tree, mesh, rules=((".*", "fsdp"),)):
    config = scaling.supervised_config()
    config.sharding_rules = list(rules)
    return common.state_shardings(tree, mesh, config)


def test_floor_keys_and_zero_optimizer_state():
    s = jax.ShapeDtypeStruct
    params = {"dense": {"kernel": s((64, 48), np.float32), "bias": s((48,), np.float32)}}
    state = {
        "params": params,
        "opt_state": jax.eval_shape(optax.adamw(1e-3).init, params),
        "rng": s((2,), np.uint32),
        "typed": jax.eval_shape(lambda: jax.random.key(0)),
        "step": s((), np.int32),
    }
    dp = _shardings(state, _mesh(data=8))
    assert dp["params"]["dense"]["kernel"].spec == P()  # data-parallel: parameters replicated
    mu = dp["opt_state"][0].mu
    assert mu["dense"]["kernel"].spec == P(("data", "fsdp"), None)  # ZeRO: the largest dim over data × fsdp
    assert mu["dense"]["bias"].spec == P()  # under the floor
    fsdp = _shardings(state, _mesh(fsdp=2))  # a raw key (2,) would divide: never split
    assert fsdp["rng"].spec == P() and fsdp["typed"].spec == P() and fsdp["step"].spec == P()
    assert fsdp["params"]["dense"]["kernel"].spec == P("fsdp", None)
    assert fsdp["params"]["dense"]["bias"].spec == P()
    mixed = _shardings(state, _mesh(data=2, fsdp=4))
    assert mixed["params"]["dense"]["kernel"].spec == P("fsdp", None)
    assert mixed["opt_state"][0].nu["dense"]["kernel"].spec == P(("data", "fsdp"), None)
    # An explicit rule never splits a key; "replicate" on the optimizer state is honoured.
    explicit = _shardings(state, _mesh(fsdp=2), [("rng", ("fsdp",)), ("opt_state", "replicate"), (".*", "fsdp")])
    assert explicit["rng"].spec == P() and explicit["opt_state"][0].mu["dense"]["kernel"].spec == P()
    assert sharding.zero_spec((6, 12), _mesh(data=2, fsdp=4)) == P(None, "fsdp")  # 12 % 8 != 0: one axis


@pytest.mark.parametrize(
    "rule, match",
    [
        ((None, None, "fsdp"), r"\('kernel', \(None, None, 'fsdp'\)\) matches params/kernel of shape \(6, 16\): "
                               r"the rule has 3 dimensions, the leaf 2"),
        (("fsdp", None), r"matches params/kernel of shape \(6, 16\): dimension 0 \(6\) is not divisible by mesh "
                         r"axis fsdp of size 4"),
        ((None, ("data", "fsdp")), r"dimension 1 \(16\) is not divisible by mesh axis data×fsdp of size 32"),
    ],
)
def test_explicit_rule_errors_are_one_line(rule, match):
    tree = {"params": {"kernel": jax.ShapeDtypeStruct((6, 16), np.float32)}}
    devices = jax.devices()
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4}, devices)
    if rule == (None, ("data", "fsdp")):
        tree = {"params": {"kernel": jax.ShapeDtypeStruct((6, 20), np.float32)}}
        match = match.replace("16", "20").replace("32", "8")
    with pytest.raises(ValueError, match=match) as info:
        _shardings(tree, mesh, [("kernel", rule)])
    assert "\n" not in str(info.value)


def test_rules_naming_an_unknown_axis_fail_in_the_config_check():
    with pytest.raises(ValueError, match=r"names mesh axis 'model'; allowed: data, fsdp or None"):
        sharding.validate_rules([("kernel", (None, "model"))])


@pytest.mark.slow
def test_the_encoder_keeps_the_batch_split_even_from_a_replicated_input():
    """vit.encoder_blocks constrains the batch axis between blocks: a batch that arrives replicated
    (as after a careless reshape) is split again, so the blocks' work still divides by 8."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from skipless_jax.models import vit

    model = vit.ViT(num_classes=10, patch_size=2, width=64, depth=2, mlp_dim=128, num_heads=4)
    x = jnp.zeros((64, 8, 8, 1))
    params = init_params(model, jax.random.PRNGKey(0), x[:1])
    forward = lambda p, images: model.apply({"params": p}, images)[0]
    flops = {}
    for n in (1, 8):
        mesh = sharding.make_mesh({"data": n}, jax.devices()[:n])
        repl = NamedSharding(mesh, P())
        with jax.set_mesh(mesh):
            args = jax.device_put((params, x), repl)
            flops[n] = jax.jit(forward).lower(*args).compile().cost_analysis()["flops"]
    assert flops[8] <= 0.35 * flops[1], flops


def test_benchmark_family_configs_name_each_family():
    """benchmarks/train_step.py's `families` preset: one model of every registered family, the
    ConvMixer without an FFN switch to turn on."""
    from skipless_jax import models

    specs = scaling.FAMILY_VARIANTS.split(",")
    image_families = sorted(f for f in models.FAMILIES if f != "gpt")  # gpt reads tokens: tests/test_lm.py
    assert sorted(s.split(":")[0] for s in specs) == image_families
    for spec in specs:
        config = scaling.family_config(spec, 224, 2)
        family, variant = spec.partition("@")[0].split(":")
        assert (config.model.get("name") or "vit", config.model.variant) == (family, variant)
        models.check_config(config.model, config.input.image_size)
    assert scaling.family_config("convmixer:768/32", 224, 2).model.skip_ffn is False
    assert scaling.family_config("convmixer:256/8@32", 224, 2).input.image_size == 32


def test_train_step_benchmark_counts_the_data_it_times():
    """benchmarks/train_step.py times its step on 1000-class RGB batches, so its model FLOPs are
    that model's count (`models.flops`, 1000 classes, 3 channels), not the count for the config's
    own dataset (digits: 10 classes, 1 channel). The program is built, not compiled: its batch and
    head shapes are the data the count is for (XLA's count is checked in tests/test_flops.py)."""
    from skipless_jax.models import flops

    sys.modules.setdefault("scaling", scaling)  # the benchmark imports its sibling by name
    spec = importlib.util.spec_from_file_location("benchmarks_train_step",
                                                  os.path.join(os.path.dirname(_SCALING), "train_step.py"))
    train_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_step)
    config, program, count = train_step.timed_program("vit:Ti/16@32", batch=8, image_size=32, dtype="float32",
                                                      skips=True, init="default")
    assert config.dataset.name == "digits"  # the config's own data differs from what is timed
    images = program.abstract_batch["image"]
    assert images.shape[0] == 8 and images.shape[-1] == 3
    assert program.abstract_batch["label"].shape == (8, 1000)
    head = program.abstract_state.params["head"]["kernel"]
    assert head.shape == (192, 1000)  # ViT-Ti's width
    expected = 8 * flops.train_flops_per_example(config.model, 32, 1000, channels=3)
    assert count == pytest.approx(expected, rel=1e-12)
    assert expected != pytest.approx(8 * flops.train_flops_per_example(config.model, 32, 10, channels=1),
                                     rel=1e-3)


def _fusion_operand_counts(hlo: str) -> list[int]:
    """The number of operands of every fusion instruction in an optimized HLO module's text."""
    counts = []
    for line in hlo.splitlines():
        head, sep, rest = line.partition(" fusion(")
        if sep and " = " in head:
            counts.append(rest.split("), kind=")[0].count("%"))
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["supervised", "dino"])
def test_the_nonfinite_predicate_is_computed_once(kind):
    """The guard's and-of-every-leaf is one value the state's selects read, not a computation XLA
    fuses into each of them (then the step holds O(leaves²) fusion operands and a 12-block ViT-Ti
    compiled in minutes on CPU): no more than a handful of fusions read as many operands as there
    are guarded leaves (the bookkeeping scalars), where each of the hundreds of state leaves did."""
    if kind == "supervised":
        program = scaling.supervised_program(scaling.supervised_config("adamw", width=32, depth=2, batch=8),
                                             {"data": 1})
    else:
        program = scaling.dino_program(scaling.dino_config("adamw", width=32, depth=2, batch=8), {"data": 1})
    leaves = [x for x in jax.tree.leaves(program.abstract_state) if np.issubdtype(x.dtype, np.inexact)]
    counts = _fusion_operand_counts(program.compile().as_text())
    assert len(counts) > len(leaves)  # the parser sees the program's fusions
    wide = [c for c in counts if c >= len(leaves) // 2]
    assert len(wide) <= 8, (len(wide), len(leaves))

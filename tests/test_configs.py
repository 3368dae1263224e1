"""Every config in configs/: its docstring matches what it resolves to, and it trains one step
and evaluates once on `tfds.testing.mock_data` (or a generated Tiny-ImageNet folder) with a
tiny model. Also the Tiny-ImageNet-200 folder source.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import re
from collections.abc import Callable

import ml_collections
import numpy as np
import pytest
from idx_folders import write_folder
from PIL import Image

from skipless_jax import trainers
from skipless_jax.data import inputs, randaugment, sources, tiny_imagenet

from util import ROOT, TINY_MODELS, one_device, tiny_model

CONFIGS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "configs", "*.py")))
MOCK_EXAMPLES = 16
EMBEDDED = ("digits", "digit_scenes")  # read from the package, not tfds (mock_data does not shrink them)


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"configs_{name}", os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_examples(c: ml_collections.ConfigDict) -> int:
    if c.dataset.name == "tiny_imagenet":
        return tiny_imagenet.SPLITS[tiny_imagenet.parse_split(c.dataset.train_split)[0]]
    splits = sources.dataset_info(c.dataset.name).splits
    sliced = re.fullmatch(r"(\w+)\[:(\d+)%\]", c.dataset.train_split)  # the ImageNet recipes' train[:99%]
    return round(splits[sliced[1]] * int(sliced[2]) / 100) if sliced else splits[c.dataset.train_split]


def _total_steps(c: ml_collections.ConfigDict) -> int:
    """As the trainer derives it: total_steps, else ceil(epochs × train examples / batch)."""
    if c.get("total_steps"):
        return c.total_steps
    return math.ceil(c.total_epochs * _train_examples(c) / c.input.batch_size)


def _patch_size(c: ml_collections.ConfigDict) -> int:
    if c.model.get("patch_size"):
        return c.model.patch_size
    return int(c.model.variant.split("/")[1])


# ------------------------------------------------------------------------------------------
# Docstring ↔ resolved config. Each phrase, where a docstring has it, must state the value the
# config resolves to; `documented` is parsed from the phrase, `actual` read from the config.

NUMBER = r"(\d+(?:\.\d+)?(?:e-?\d+)?)"
PHRASES: list[tuple[str, str, Callable[[ml_collections.ConfigDict, re.Match], list]]] = [
    ("batch", rf"\bbatch {NUMBER}", lambda c, m: [(float(m[1]), c.input.batch_size)]),
    ("lr", rf"\blr {NUMBER}", lambda c, m: [(float(m[1]), c.optimizer.lr)]),
    ("weight decay", rf"weight decay {NUMBER}", lambda c, m: [(float(m[1]), c.optimizer.weight_decay)]),
    ("warm-up", rf"{NUMBER} warm-up epochs", lambda c, m: [(float(m[1]), c.schedule.warmup_epochs)]),
    ("end lr", rf"cosine to {NUMBER}", lambda c, m: [(float(m[1]), c.schedule.end_lr)]),
    ("clipping", rf"gradient clipping {NUMBER}", lambda c, m: [(float(m[1]), c.grad_clip_norm)]),
    ("smoothing", rf"label smoothing {NUMBER}", lambda c, m: [(float(m[1]), c.label_smoothing)]),
    ("randaug", r"RandAugment m(\d+)",
     lambda c, m: [(float(m[1]), randaugment.parse_randaug(c.input.aug.randaug).magnitude)]),
    ("mixup", rf"mixup {NUMBER} / cutmix {NUMBER}",
     lambda c, m: [(float(m[1]), c.input.aug.mixup), (float(m[2]), c.input.aug.cutmix)]),
    ("erasing", rf"random erasing {NUMBER}", lambda c, m: [(float(m[1]), c.input.aug.reprob)]),
    ("pad crop", r"zero-pad (\d+) \+ random crop",
     lambda c, m: [("pad", c.input.aug.crop), (int(m[1]), c.input.aug.crop_padding)]),
    ("epochs", r"(?<![-\w~≈])(\d+) epochs", lambda c, m: [(float(m[1]), c.total_epochs)]),
    ("image size", r"on (\d+)×(\d+) images", lambda c, m: [(float(m[1]), c.input.image_size)]),
    ("patch", r"with patch (\d+)", lambda c, m: [(float(m[1]), _patch_size(c))]),
    ("sizes", r"width (\d+), depth (\d+), (\d+) heads, MLP (\d+)",
     lambda c, m: [(float(m[1]), c.model.width), (float(m[2]), c.model.depth),
                   (float(m[3]), c.model.num_heads), (float(m[4]), c.model.mlp_dim)]),
    ("steps", r"≈ (\d+)k steps", lambda c, m: [(float(m[1]), round(_total_steps(c) / 1000))]),
]


def _spaced(pattern: str) -> str:
    """A phrase pattern whose spaces also match line breaks (docstrings wrap anywhere)."""
    return pattern.replace(" ", r"\s+")


def _documented_facts(name: str, module=None) -> list[tuple[str, object, object]]:
    """(phrase, documented value, resolved value) for every phrase in the docstring."""
    module = module or _module(name)
    doc, c = module.__doc__, module.get_config()
    facts = []
    for label, pattern, read in PHRASES:
        for match in re.finditer(_spaced(pattern), doc):
            facts += [(label, want, got) for want, got in read(c, match)]
    drop = re.search(_spaced(rf"drop-path {NUMBER} with skips and {NUMBER} without"), doc)
    if drop:
        both = module.get_config("skip_sab=True,skip_ffn=True").model.drop_path
        none = module.get_config("skip_sab=False,skip_ffn=False").model.drop_path
        facts += [("drop-path with skips", float(drop[1]), both), ("drop-path without", float(drop[2]), none)]
    soap = re.search(_spaced(rf"SOAP: b1 {NUMBER}, b2 {NUMBER}, preconditioning every (\d+) steps"), doc)
    if soap:
        opt = module.get_config("opt=soap").optimizer
        facts += [("SOAP b1", float(soap[1]), opt.b1), ("SOAP b2", float(soap[2]), opt.b2),
                  ("SOAP frequency", float(soap[3]), opt.precondition_frequency)]
    return facts


# Config args and where they land in the resolved config.
ARG_FIELDS = {
    "skip_sab": lambda c: c.model.skip_sab, "skip_ffn": lambda c: c.model.skip_ffn,
    "init": lambda c: c.model.init, "opt": lambda c: c.optimizer.name, "seed": lambda c: c.seed,
    "depth": lambda c: c.model.depth, "variant": lambda c: c.model.variant,
    "tg": lambda c: c.model.token_graying, "eps": lambda c: c.model.tg_eps, "epochs": lambda c: c.total_epochs,
    # The dense evaluations: 'all' when every one of config_blocks.DENSE_EVALS is there; their folder.
    "dense": lambda c: "all" if set(_dense_names()) <= set(c.evals) else "+".join(n for n in _dense_names()
                                                                              if n in c.evals) or "none",
    "dense_root": lambda c: {e.data_dir for n, e in c.evals.items() if n in _dense_names()}.pop(),
    # The quickstart's miniature knobs.
    "lr": lambda c: c.optimizer.lr, "label_smoothing": lambda c: c.label_smoothing,
    "tokens": lambda c: (inputs.image_size(c) // c.model.patch_size) ** 2,
    "self_share": lambda c: c.model.get("init_self_share"),
    "val": lambda c: c.dataset.train_split == "train[:90%]" and "val" in c.get("evals", {}),
}


def _dense_names() -> list[str]:
    from skipless_jax import config_blocks

    return list(config_blocks.DENSE_EVALS)


def _same(documented: object, actual: object) -> bool:
    if isinstance(documented, str) or isinstance(actual, (str, bool)) or actual is None:
        return str(documented).lower() == str(actual).lower()
    return math.isclose(float(documented), float(actual), rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("name", CONFIGS)
def test_docstring_states_command_hardware_expectation_and_true_hyperparameters(name):
    module = _module(name)
    doc = module.__doc__ or ""
    assert f"--config=configs/{name}.py" in doc, f"{name}: the docstring must give the exact command"
    assert "Hardware:" in doc, f"{name}: the docstring must state the hardware it was sized for"
    assert "Expected" in doc, f"{name}: the docstring must state the expected result (accuracy, wall-clock)"
    facts = _documented_facts(name)
    if "Schedule" in doc:  # a recipe: its schedule sentence must be checkable, not prose
        assert len(facts) >= 10, f"{name}: only {len(facts)} checkable facts: {facts}"
    wrong = [(label, want, got) for label, want, got in facts if not _same(want, got)]
    assert not wrong, f"{name}: docstring disagrees with the config (phrase, documented, actual): {wrong}"


@pytest.mark.parametrize("name", CONFIGS)
def test_docstring_args_resolve_to_their_switches(name):
    module = _module(name)
    rows = re.findall(r"^\s+(:\S+|\(no args\))\s{2,}", module.__doc__ or "", flags=re.MULTILINE)
    for row in rows:
        arg = None if row == "(no args)" else row[1:]
        c = module.get_config(arg)
        for item in filter(None, (arg or "").split(",")):
            key, value = item.split("=")
            assert _same(value, ARG_FIELDS[key](c)), f"{name}:{arg}: {key} resolves to {ARG_FIELDS[key](c)!r}"


def test_recipe_docstrings_are_checked():
    """The checks above must bite on the recipe configs: the phrases are found, not skipped."""
    for name in ("cifar10_vit_tiny", "cifar100_vit_tiny", "tiny_imagenet_vit", "vitb_skipless"):
        labels = {label for label, _, _ in _documented_facts(name)}
        required = {"batch", "lr", "weight decay", "warm-up", "epochs", "steps", "drop-path without"}
        assert required <= labels, (name, labels)
    cifar = {}
    for label, want, _ in _documented_facts("cifar10_vit_tiny"):
        cifar.setdefault(label, []).append(want)
    assert cifar["steps"] == [78] and cifar["sizes"] == [192, 12, 3, 768] and cifar["pad crop"] == ["pad", 4]
    assert set(cifar["epochs"]) == {200}  # "diverges after ~30 epochs" is not a schedule fact


def test_a_wrong_docstring_is_caught():
    module = _module("cifar10_vit_tiny")
    get_config = module.get_config

    def drifted(arg=None):  # the config changed, its docstring did not
        c = get_config(arg)
        c.optimizer.lr, c.input.aug.reprob = 5e-4, 0.0
        return c

    module.get_config = drifted
    wrong = {label for label, want, got in _documented_facts("cifar10_vit_tiny", module) if not _same(want, got)}
    assert wrong == {"lr", "erasing"}


# ------------------------------------------------------------------------------------------
# One train step and one evaluation per config.


def _write_tiny_imagenet(root: str, per_class: int = 1, val: int = MOCK_EXAMPLES) -> list[str]:
    """A Tiny-ImageNet-200 folder: 200 classes, `per_class` train images each, `val` val images."""
    rng = np.random.default_rng(0)
    wnids = [f"n{9000000 + 17 * i:08d}" for i in range(200)]
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "wnids.txt"), "w") as f:
        f.write("\n".join(rng.permutation(wnids)) + "\n")
    for wnid in wnids:
        folder = os.path.join(root, "train", wnid, "images")
        os.makedirs(folder)
        for k in range(per_class):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
                os.path.join(folder, f"{wnid}_{k}.JPEG"))
    os.makedirs(os.path.join(root, "val", "images"))
    with open(os.path.join(root, "val", "val_annotations.txt"), "w") as f:
        for k in range(val):
            gray = rng.integers(0, 256, (64, 64), dtype=np.uint8)  # some Tiny-ImageNet files are grayscale
            Image.fromarray(gray).save(os.path.join(root, "val", "images", f"val_{k}.JPEG"))
            f.write(f"val_{k}.JPEG\t{wnids[(7 * k) % 200]}\t0\t0\t32\t32\n")
    return wnids


def _tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config with a tiny model, one step, small train batches (and eval batches on mock data)
    and evaluators that train (linear probe, linear segmentation) for a few steps; everything else
    as configured."""
    from skipless_jax import models

    if models.family(c.model).FAMILY in TINY_MODELS:  # a family whose sizes are not the ViT's fields
        if c.input.get("image_size") and c.input.image_size > 8:
            c.input.image_size = 32
        c.model = ml_collections.ConfigDict(tiny_model(c.model.to_dict(), c.input.get("image_size") or 8))
    else:
        c.model.variant = None
        c.model.width, c.model.depth, c.model.num_heads, c.model.mlp_dim = 16, 1, 2, 32
        if c.input.get("image_size") and c.input.image_size > 8:
            c.input.image_size, c.model.patch_size = 32, 8
    if c.get("mae"):  # MAE's 512-wide, 8-block decoder dominates otherwise
        c.mae.update(dict(decoder_width=16, decoder_depth=1, decoder_num_heads=2, picture_images=2))
    c.input.batch_size = 8  # on one device (one_device())
    if c.dataset.name not in EMBEDDED:  # the embedded sets' test splits are real (360-720 images): own batches
        c.input.eval_batch_size = 8
    c.input.num_workers = 0
    if c.input.get("repeated_augmentation"):  # its epoch needs >= 256 examples; the mock split has fewer
        c.input.repeated_augmentation = 1
    c.total_epochs, c.total_steps = None, 1
    c.schedule.warmup_epochs, c.schedule.warmup_steps = None, 0
    c.log_every_steps, c.eval_every_steps, c.checkpoint_every_steps = 1, 0, 0
    c.profile_steps = 0  # no profiler trace (tests/test_perf.py traces)
    if c.get("analysis"):
        c.analysis.every_steps = 0
    for entry in c.get("evals", {}).values():  # the evaluators' own training: a few steps, not hundreds
        if entry.get("type") == "linear_probe":
            entry.steps = 5
        elif entry.get("type") == "linear_segmentation":
            entry.update(dict(steps=2, warmup=1))
    if c.get("dino"):  # the 65,536-wide head and 8 × 96-px local crops dominate otherwise
        c.dino.update(dict(out_dim=64, hidden_dim=32, bottleneck_dim=16))
        c.input.multicrop.update(dict(local_size=16, num_local=2))
    return c


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_config_trains_one_step_and_evaluates_on_mock_data(name, tmp_path, monkeypatch):
    import tensorflow_datasets as tfds

    if _module(name).get_config().get("trainer") == "lm":
        pytest.skip("a text config: tests/test_lm.py trains it one step")
    c = _tiny(_module(name).get_config())
    if c.dataset.name == "tiny_imagenet":
        if "tiny_imagenet" not in sources.DATASETS:
            pytest.skip("sources.DATASETS has no 'tiny_imagenet' entry yet")
        c.dataset.data_dir = str(tmp_path / "tiny-imagenet-200")
        _write_tiny_imagenet(c.dataset.data_dir)
    if c.dataset.name == "fashion_mnist":  # the four IDX files of tests/idx_folders.py, not the real 70,000
        c.dataset.data_dir = str(tmp_path / "fashion-mnist")
        write_folder(c.dataset.data_dir, train=MOCK_EXAMPLES, test=MOCK_EXAMPLES)
    with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES, policy=tfds.testing.MockPolicy.USE_CODE):
        # mock_data serves any split but leaves is_prepared() False; the trainer checks it first.
        monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: True)
        num_classes = sources.dataset_info(c.dataset.name).num_classes
        if c.get("trainer", "supervised") == "supervised":
            batch = next(inputs.train_iterator(c, 0, 0, 1))
            size = inputs.image_size(c)
            b = c.input.batch_size
            assert batch["image"].shape == (b, size, size, sources.dataset_info(c.dataset.name).image_shape[-1])
            assert batch["image"].dtype == np.float32 and np.all(np.isfinite(batch["image"]))
            assert batch["label"].shape == (b, num_classes)
            np.testing.assert_allclose(batch["label"].sum(-1), 1.0, atol=1e-5)
        trainer = trainers.get(c.get("trainer", "supervised"))
        metrics = trainer.train_and_evaluate(c, str(tmp_path / "workdir"), devices=one_device())
    assert metrics["step"] == 1
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    accuracies = [v for k, v in metrics.items() if k.startswith("test_") and k.endswith("accuracy")]
    assert accuracies and all(0.0 <= v <= 1.0 for v in accuracies), metrics
    drawn = [e.get("prefix") or k for k, e in c.get("evals", {}).items()
             if e.get("type") in ("feature_pca", "tokencut")]
    for prefix in drawn:  # the evaluators that draw wrote their pictures at the last step
        assert (tmp_path / "workdir" / "pictures" / f"{prefix}_step000001.png").exists(), prefix
    if "test_loss" in metrics:  # after one step a classifier is near chance: loss ≈ ln(classes)
        assert abs(metrics["test_loss"] - math.log(num_classes)) < 0.5 * math.log(num_classes)


# ------------------------------------------------------------------------------------------
# Tiny-ImageNet-200 folder source.


def test_tiny_imagenet_source_reads_labels_in_sorted_wnid_order(tmp_path):
    wnids = _write_tiny_imagenet(str(tmp_path), per_class=2, val=10)
    train_src = tiny_imagenet.TinyImageNetSource(str(tmp_path), "train")
    assert len(train_src) == 400
    order = sorted(wnids)
    for index in (0, 1, 199, 200, 399):  # classes interleaved: image k of every class, then k + 1
        example = train_src[index]
        assert example["image"].shape == (64, 64, 3) and example["image"].dtype == np.uint8
        assert example["label"] == index % 200
        assert os.path.basename(train_src.files[index]) == f"{order[index % 200]}_{index // 200}.JPEG"
    first_half = tiny_imagenet.TinyImageNetSource(str(tmp_path), "train[:50%]")
    assert len(first_half) == 200 and sorted(first_half.labels.tolist()) == list(range(200))  # class-balanced
    val = tiny_imagenet.TinyImageNetSource(str(tmp_path), "validation")
    assert len(val) == 10
    for k in range(10):
        example = val[k]
        assert example["image"].shape == (64, 64, 3)  # grayscale file → RGB
        np.testing.assert_array_equal(example["image"][..., 0], example["image"][..., 2])
        assert example["label"] == order.index(wnids[(7 * k) % 200])
    assert len(tiny_imagenet.TinyImageNetSource(str(tmp_path), "val[2:5]")) == 3


def test_tiny_imagenet_errors(tmp_path):
    missing = r"no Tiny-ImageNet-200 folder there \(wnids.txt missing\); see docs/data.md"
    with pytest.raises(FileNotFoundError, match=missing):
        tiny_imagenet.TinyImageNetSource(str(tmp_path / "nowhere"), "train")
    with pytest.raises(FileNotFoundError, match=r"config.dataset.data_dir is not set; it must point to the unpacked"):
        tiny_imagenet.TinyImageNetSource(None, "train")
    with pytest.raises(ValueError, match=r"tiny_imagenet split 'test' is unknown; allowed: 'train', 'val'"):
        tiny_imagenet.TinyImageNetSource(str(tmp_path), "test")
    assert tiny_imagenet.parse_split("train[10%:]") == ("train", 10_000, None)
    assert tiny_imagenet.parse_split("val[:1000]", total=10_000) == ("val", None, 1000)


def test_variable_size_images_without_aug_are_resized_and_cropped(monkeypatch):
    """ImageNet at 224 with aug=None: the stored images have every size, so train and eval
    both go through resize + centre crop (normalizing alone could not stack a batch)."""
    import tensorflow_datasets as tfds

    c = _tiny(_module("vitb_skipless").get_config())
    c.input.aug, c.input.image_size = None, None
    assert c.input.batch_size in (8, 16)  # _tiny's batch (16 where the recipe mixes: 2 rows a device)
    with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES, policy=tfds.testing.MockPolicy.USE_CODE):
        monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: True)
        train = next(inputs.train_iterator(c, 0, 0, 1))
        batches, n = inputs.eval_iterator(c, 0, 1)
        evaluation = next(batches)
        other, _ = inputs.eval_iterator(c, 0, 1, split="train")
        from_train = next(other)
    assert n == MOCK_EXAMPLES
    for batch, size in ((train, c.input.batch_size), (evaluation, c.input.eval_batch_size),
                        (from_train, c.input.eval_batch_size)):
        assert batch["image"].shape == (size, 224, 224, 3) and np.all(np.isfinite(batch["image"]))


def test_config_args_round_trip_and_sibling_recipes_agree():
    from skipless_jax import config_args

    values = config_args.parse("skip_sab=False,eps=0.5,tg=none", skip_sab=True, eps=0.95, tg="dct", seed=0)
    assert values == dict(skip_sab=False, eps=0.5, tg="none", seed=0)
    assert config_args.parse(config_args.to_arg(values), skip_sab=True, eps=0.95, tg="dct", seed=0) == values
    assert _module("dino_vits_baseline").get_config("skip_sab=False,skip_ffn=False,init=skipless").to_dict() == (
        _module("dino_vits_skipless").get_config().to_dict()
    )
    assert _module("cifar100_vit_tiny").get_config().dataset.name == "cifar100"


# Configs of the former ViT-B baseline file configs/vitb_i1k_300ep.py, by its args, as that file
# resolved them; the baseline is now configs/vitb_skipless.py with VITB_BASELINE's args in front.
VITB_BASELINE_CONFIGS = os.path.join(ROOT, "tests", "configs", "vitb_i1k_300ep_configs.json")
VITB_BASELINE = "skip_sab=True,skip_ffn=True,init=default,opt=adamw"


def test_vitb_baseline_is_vitb_skipless_with_args():
    import json

    with open(VITB_BASELINE_CONFIGS) as f:
        before = json.load(f)
    assert len(before) == 8
    module = _module("vitb_skipless")
    for arg, saved in before.items():
        config = module.get_config(",".join(filter(None, (VITB_BASELINE, arg))))
        assert json.loads(config.to_json()) == saved, arg


@pytest.mark.slow
def test_dino_vits_dense_evaluations_run_on_its_checkpoint(tmp_path, monkeypatch):
    """configs/dino_vits_skipless.py:dense=all on a (tiny) trained checkpoint through the evaluate
    command's function, every dataset read from generated folders in the documented layout: each
    of the 8 entries opens its splits under the one root, and one entry of each protocol (linear,
    multi-scale, TokenCut) runs (the 8 are the same 3 programs on other folders; each folder's
    reader is tested in tests/test_dense_data.py)."""
    import tensorflow_datasets as tfds
    from dense_folders import dense_root

    from skipless_jax import config_blocks, evaluate
    from skipless_jax.data import dense_sources

    root = dense_root(str(tmp_path / "dense"))
    c = _tiny(_module("dino_vits_skipless").get_config())
    dense = _tiny(_module("dino_vits_skipless").get_config(f"dense=all,dense_root={root}"))
    for config in (c, dense):
        config.model.depth = 2  # the `ms` probes read the last 2 blocks here (below), 4 in the recipe
    # The training only makes the checkpoint, and the recipe's other evaluators (kNN, linear probe,
    # minival) are tested by test_config_trains_one_step_and_evaluates_on_mock_data: here, only
    # the dense ones.
    c.evals = ml_collections.ConfigDict()
    assert sorted(k for k in dense.evals if k in config_blocks.DENSE_EVALS) == sorted(config_blocks.DENSE_EVALS)
    for name in config_blocks.DENSE_EVALS:
        entry = dense.evals[name]
        splits = [entry.split] + ([entry.train_split] if entry.get("train_split") else [])
        assert entry.data_dir == root and all(len(dense_sources.get_source(entry.dataset, s, root)) for s in splits)
    run = ("voc_ms", "ade_lin", "coco20k_tokencut")
    dense.evals = ml_collections.ConfigDict({k: v for k, v in dense.evals.items() if k in run})
    for entry in dense.evals.values():
        if entry.type == "linear_segmentation":
            entry.update(crop_size=32, steps=2, warmup=1, **({"blocks": 2} if entry.protocol == "ms" else {}))
    workdir = str(tmp_path / "workdir")
    with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES, policy=tfds.testing.MockPolicy.USE_CODE):
        monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: True)
        trainers.get("dino").train_and_evaluate(c, workdir, devices=one_device())
        metrics = evaluate.evaluate(workdir, dense, devices=one_device())
    for name in run:
        kind = config_blocks.DENSE_EVALS[name][0]
        for metric in (("miou", "pixel_accuracy") if kind == "linear_segmentation" else ("corloc",)):
            assert 0.0 <= metrics[f"{name}_{metric}"] <= 1.0, (name, metric)
    with pytest.raises(ValueError, match=r"^config arg dense='voc': 'voc' is unknown; allowed: 'none', 'all'"):
        _module("dino_vits_skipless").get_config("dense=voc")


# ------------------------------------------------------------------------------------------
# The quickstart's miniature knobs (lr, tokens, label_smoothing, self_share, val).

# Configs of configs/quickstart.py as the commit before its knobs resolved them (the `table1`,
# `depth`, skip-ablation and `tg_eps` grids' runs are of these kinds): runs of those grids resume
# only while their config trains the same thing (pretrained.check_saved_config).
QUICKSTART_BEFORE_KNOBS = os.path.join(ROOT, "tests", "configs", "quickstart_configs.json")


# Runtime fields added or changed after the snapshot: the trace's HLO switch, its default length.
ADDED_RUNTIME_FIELDS = {"profile_hlo": False, "profile_steps": 3}
# Model fields added after it as None, the family's default (what the snapshot's runs trained with).
ADDED_MODEL_FIELDS = {"gelu": None}


def test_quickstart_without_its_knobs_trains_as_before():
    import json

    from skipless_jax import pretrained

    with open(QUICKSTART_BEFORE_KNOBS) as f:
        before = json.load(f)
    module = _module("quickstart")
    assert len(before) == 5
    for arg, saved in before.items():
        config = module.get_config(arg or None)
        assert pretrained.config_differences(saved, config.to_dict()) == [], arg
        # the runtime fields too, with those added since, which change nothing trained
        model = {**saved["model"], **ADDED_MODEL_FIELDS}
        assert json.loads(config.to_json()) == {**saved, **ADDED_RUNTIME_FIELDS, "model": model}, arg
    c = module.get_config()
    assert (c.optimizer.lr, module.get_config("opt=adamw").optimizer.lr) == (3e-3, 1e-3)
    assert (c.model.patch_size, c.input.image_size, c.label_smoothing) == (2, None, 0.0)
    assert (c.dataset.train_split, c.dataset.eval_split, c.get("evals")) == ("train", "test", None)
    assert "init_self_share" not in c.model and "crop_pct" not in c.input
    # The knobs at their default values are the same config.
    same = module.get_config("opt=adamw,lr=1e-3,tokens=16,label_smoothing=0,val=False")
    assert same.to_dict() == module.get_config("opt=adamw").to_dict()


def test_quickstart_knobs_resolve_and_bad_values_are_one_line_errors():
    from skipless_jax import validate
    from skipless_jax.data import transforms

    module = _module("quickstart")
    c = module.get_config("opt=adamw,lr=3e-4,label_smoothing=0.1,self_share=0.76")
    assert (c.optimizer.lr, c.label_smoothing, c.model.init_self_share) == (3e-4, 0.1, 0.76)
    validate.validate_config(c)

    # 64 tokens: the digit upsampled bicubically to 16×16 (PIL on the 8×8 image), 2×2 patches.
    c = module.get_config("tokens=64")
    assert (inputs.image_size(c) // c.model.patch_size) ** 2 == 64 and c.input.crop_pct == 1.0
    _, evaluate = inputs.image_transforms(c, on_device=True)
    digit = sources.get_source("digits", "train")[5]["image"]
    want = np.asarray(Image.fromarray(digit[..., 0]).resize((16, 16), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(evaluate(digit), want[..., None])
    assert transforms.resize_shorter_side(np.zeros((4, 6, 3), np.uint8), 8).shape == (8, 12, 3)

    # val=True: train on the first 90 % of train, validate on the rest (disjoint, the whole split).
    c = module.get_config("val=True")
    train, val = (sources.get_source("digits", s) for s in (c.dataset.train_split, c.evals.val.split))
    full = sources.get_source("digits", "train")
    assert (len(train), len(val)) == (1293, 144) and len(train) + len(val) == len(full) == 1437
    np.testing.assert_array_equal(val[0]["image"], full[1293]["image"])
    assert dict(c.evals.test) == {"type": "classification"}
    assert _total_steps(c) == math.ceil(40 * 1293 / 64)

    for arg, match in [("tokens=32", r"config arg tokens=32 is not allowed; allowed: 16 \| 64"),
                       ("lr=fast", r"config arg lr='fast' must be a number"),
                       ("self_share=x", r"config arg self_share='x' must be a number"),
                       ("val=maybe", r"config arg val='maybe' must be True or False")]:
        with pytest.raises(ValueError, match=match):
            module.get_config(arg)
    for arg, match in [("lr=-1", r"config.optimizer.lr=-1.0 must be a finite number > 0"),
                       ("label_smoothing=1", r"config.label_smoothing=1.0 must be in \[0, 1\)"),
                       ("self_share=1.5", r"config.model.init_self_share=1.5 must be a number in \(0, 1\)")]:
        with pytest.raises(ValueError, match=match):
            validate.validate_config(module.get_config(arg))


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_quickstart_init_source_and_pf_change_only_their_fields():
    """init_source=fork sets the fork's init settings (config_blocks.MAE_FORK_INIT) and nothing else;
    pf sets the refresh frequency of SOAP or shampoo_ec and nothing else; their defaults are the
    config without them; a bad value is a one-line error."""
    from skipless_jax import config_blocks, validate

    module = _module("quickstart")
    for base in ("", "opt=adamw,depth=8", "opt=shampoo_ec,init=default,val=True"):
        plain = module.get_config(base or None).to_dict()
        same = module.get_config(",".join(filter(None, (base, "init_source=paper,pf=None"))))
        assert same.to_dict() == plain, base
        fork = _leaves(module.get_config(",".join(filter(None, (base, "init_source=fork")))).to_dict())
        changed = {k: v for k, v in fork.items() if _leaves(plain).get(k, "absent") != v}
        assert changed == {f"model.{k}": v for k, v in config_blocks.MAE_FORK_INIT.items()
                           if config_blocks.VITB_SUPERVISED_INIT.get(k) != v}, base
        assert changed == {"model.init_c": 1.0, "model.init_qk_dist": "uniform", "model.init_vo": "fork",
                           "model.init_mlp": "default"}
    for opt, own in (("soap", 10), ("shampoo_ec", 100)):
        plain = _leaves(module.get_config(f"opt={opt}").to_dict())
        assert plain["optimizer.precondition_frequency"] == own
        c = module.get_config(f"opt={opt},pf=7")
        assert _leaves(c.to_dict()) == {**plain, "optimizer.precondition_frequency": 7}
        validate.validate_config(c)
    validate.validate_config(module.get_config("opt=shampoo_ec,init_source=fork,pf=10,lr=1.5e-3,val=True"))
    # shampoo_ec's factors as at ViT-B with 8192: no weight matrix merged (8192 would merge the
    # 64×128 MLP kernels into 8192×8192 factors), every 1-D parameter (at most 3 × width) one factor
    assert module.get_config("opt=shampoo_ec").optimizer.max_preconditioner_dim == 192 < 64 * 128
    for arg, match in [("init_source=mae", r"config arg init_source='mae' is not allowed; allowed: paper \| fork"),
                       ("opt=adamw,pf=10", r"config arg pf='10' applies to opt=soap \| shampoo_ec only, "
                                           r"not opt='adamw'"),
                       ("pf=2.5", r"config arg pf='2.5' must be an integer >= 1"),
                       ("pf=0", r"config arg pf='0' must be an integer >= 1")]:
        with pytest.raises(ValueError, match=f"^{match}$"):
            module.get_config(arg)


def test_config_blocks_and_step_counts_leave_their_arguments_as_they_are():
    """imagenet_recipe sets bfloat16 on its own copy of the model config; train_steps returns the
    warm-up steps (for the optimizer) instead of writing them into the config."""
    from skipless_jax import config_blocks
    from skipless_jax.trainers import common

    from util import tiny_config

    model = config_blocks.family_model("convmixer", {}, drop_path=0.0)
    c = config_blocks.imagenet_recipe(dict(seed=0, opt="adamw", epochs=300), model, warmup_epochs=5, grad_clip=1.0)
    assert (model.dtype, c.model.dtype) == ("float32", "bfloat16")
    config = tiny_config(**{"total_steps": None, "total_epochs": 2, "schedule.warmup_steps": None,
                            "schedule.warmup_epochs": 1})
    before = config.to_json()
    assert common.train_steps(config, 44.9) == (90, 45)
    assert config.to_json() == before

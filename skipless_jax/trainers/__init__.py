"""Trainers by `config.trainer`: one `Trainer` record each, the only list of them (`REGISTRY`).

Each trainer is one flat module on `trainers/common.py` that ends with `TRAINER = Trainer(...)`;
no trainer imports another. Every tool on a run (main, evaluate, export, analyze, perf,
validate) reads the record `of_config(config)` (or `get(name)`) and never a trainer's name, so
a fifth trainer is one module and one line of `REGISTRY`. The record's fields are required: a
trainer that lacks one fails at its import (`Trainer.__post_init__`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

REGISTRY = {
    "supervised": "skipless_jax.trainers.supervised",
    "dino": "skipless_jax.trainers.dino",
    "mae": "skipless_jax.trainers.mae",
    "lm": "skipless_jax.trainers.lm",
}
DEFAULT = "supervised"  # a config without `trainer`

INPUTS = ("images", "tokens")


@dataclasses.dataclass(frozen=True)
class Trainer:
    """What every caller of a trainer uses (shapes of the callables in each field's comment).

    `inputs` 'tokens' (not images) requires `export_forward`, `export_examples` and `analysis`;
    'images' requires them None (the tools' image paths)."""

    name: str
    check_config: Callable[..., None]  # (config, num_devices=None): every one-line error, before compiling
    train_and_evaluate: Callable[..., dict]  # (config, workdir, devices=None, allow_config_change=False)
    evaluation: Callable[..., tuple]  # (config, mesh, model=None, picture_dir=None) -> (context, entries)
    check_evaluators: Callable[[Any], None]  # (config): what `evaluate` runs, one-line errors
    build_evaluators: Callable[[Any, Any], list]  # (config, context) -> the evaluators `evaluate` runs
    evaluator_names: Callable[[Any], list]  # (config) -> their names, what `evaluate --only` chooses from
    flops_per_example: Callable[[Any], tuple[float, float]]  # (config) -> (model FLOPs, Token Graying FLOPs)
    example_unit: Callable[[Any], tuple[str, int]]  # (config) -> (what an example feeds, how many): batch spec
    epoch_steps: Mapping[str, Any]  # keyword arguments of data.inputs.steps_per_epoch: how it counts an epoch
    inputs: str  # 'images' or 'tokens'
    build_model: Callable[[Any], Any] | None  # (config) -> the trained module; None: models.build of config.model
    backbone_key: str | None  # the state entry whose 'backbone' the tools analyse (DINO's teacher); None: params
    classifier: bool  # its params are config.model's classifier (timm's --reverse, model.init_self_share)
    with_quantize: Callable[[Any, str], Any] | None  # (config, formats) -> config for `evaluate --quantize`
    export_forward: Callable[..., tuple] | None  # (config, context, params) -> (fn, model.json fields)
    export_examples: Callable[[Any, int], dict] | None  # (config, count) -> examples.npz's arrays
    analysis: Callable[..., dict] | None  # (config, workdir, weights, num_windows) -> analyze's inputs
    initial_state: Callable[[Any], Callable]  # (config) -> (rng -> its fresh train state, a flax.struct dataclass)

    def __post_init__(self) -> None:
        if self.name not in REGISTRY:
            raise TypeError(f"Trainer name={self.name!r} is not in trainers.REGISTRY {sorted(REGISTRY)}")
        if self.inputs not in INPUTS:
            raise TypeError(f"Trainer {self.name!r}: inputs={self.inputs!r}; allowed: {INPUTS}")
        own = ("export_forward", "export_examples", "analysis")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            optional = str(f.type).endswith("| None")
            if f.type.startswith("Callable") and not (callable(value) or (optional and value is None)):
                raise TypeError(f"Trainer {self.name!r}: field {f.name} must be callable, got {value!r}")
            if f.name in own and (value is None) == (self.inputs == "tokens"):
                raise TypeError(f"Trainer {self.name!r}: field {f.name} is required for inputs='tokens' "
                                f"and None for 'images', got {value!r} with inputs={self.inputs!r}")
        if not isinstance(self.epoch_steps, Mapping) or not isinstance(self.classifier, bool):
            raise TypeError(f"Trainer {self.name!r}: epoch_steps must be a mapping and classifier a bool")

    @property
    def own_inputs(self) -> bool:
        """Whether its examples are not images (its own `export_forward`, `export_examples`, `analysis`)."""
        return self.inputs != "images"


def get(name: str) -> Trainer:
    """The record of `config.trainer=name`; one-line ValueError for an unknown name."""
    if name not in REGISTRY:
        raise ValueError(f"config.trainer={name!r} is unknown; allowed: {sorted(REGISTRY)}")
    record = importlib.import_module(REGISTRY[name]).TRAINER
    if not isinstance(record, Trainer) or record.name != name:
        raise TypeError(f"{REGISTRY[name]}.TRAINER is not the Trainer record named {name!r}")
    return record


def name_of(config: Any) -> str:
    """`config.trainer`, the default where unset."""
    return config.get("trainer") or DEFAULT


def of_config(config: Any) -> Trainer:
    """The record of `config.trainer` (default 'supervised')."""
    return get(name_of(config))


def image_trainer(name: str, check_config: Callable[..., None], train_and_evaluate: Callable[..., dict],
                  evaluation: Callable[..., tuple], evaluator_types: tuple[str, ...],
                  flops_per_example: Callable[[Any], tuple[float, float]], *,
                  initial_state: Callable[[Any], Callable], classifier: bool = False,
                  epoch_steps: Mapping[str, Any] | None = None, build_model: Callable[[Any], Any] | None = None,
                  backbone_key: str | None = None) -> Trainer:
    """The record of a trainer on images: its evaluators those of `config.evals` of
    `evaluator_types`, an example one image, no export or analysis of its own."""
    return Trainer(name, check_config, train_and_evaluate, evaluation, *image_evaluators(evaluator_types),
                   evaluator_names=config_evals_names,
                   flops_per_example=flops_per_example, example_unit=one_image, epoch_steps=epoch_steps or {},
                   inputs="images", build_model=build_model, backbone_key=backbone_key, classifier=classifier,
                   with_quantize=None, export_forward=None, export_examples=None, analysis=None,
                   initial_state=initial_state)


def image_evaluators(types: tuple[str, ...]) -> tuple[Callable, Callable]:
    """(check_evaluators, build_evaluators) of a trainer that evaluates `config.evals` (evaluators/)
    of the given `types`."""

    def check(config: Any) -> None:
        from skipless_jax import evaluators

        evaluators.check_config(config, types)

    def build(config: Any, ctx: Any) -> list:
        from skipless_jax import evaluators

        return evaluators.build(config, ctx)

    return check, build


def config_evals_names(config: Any) -> list[str]:
    """The names of `config.evals`' entries (without it, the default classification's)."""
    from skipless_jax import evaluators

    return list(evaluators.entries(config))


def image_geometry(config: Any) -> tuple[int, int, int]:
    """(image size, channels, the dataset's classes) of an image trainer's example."""
    from skipless_jax.data import inputs, sources

    info = sources.dataset_info(config.dataset.name)
    return inputs.image_size(config), info.image_shape[-1], info.num_classes


def one_image(config: Any) -> tuple[str, int]:
    """An image trainer's example unit: one image."""
    return "img", 1

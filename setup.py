"""skipless_jax: Vision Transformers with and without residual connections, in JAX/Flax."""

import pathlib

from setuptools import find_packages, setup

setup(
    name="skipless_jax",
    version="0.1.0",
    description="Train and analyse skipless Vision Transformers (Always Skip Attention; Cutting the Skip).",
    long_description=pathlib.Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["skipless_jax", "skipless_jax.*"]),
    python_requires=">=3.11",
    # Compatible ranges; requirements.txt pins the exact tested set.
    install_requires=[
        "absl-py>=2.1",
        "chex>=0.1.90",
        "clu>=0.0.12",
        "flax>=0.12,<0.13",
        "grain>=0.2.12",
        "jax>=0.10,<0.11",
        "matplotlib>=3.8",
        "ml_collections>=1.0",
        "numpy>=2.0",
        "optax>=0.2.6",
        "orbax-checkpoint>=0.12,<0.13",
        "pillow>=10",
        "scikit-learn>=1.4",
        "scipy>=1.12",
        "tensorboard>=2.16",
        "tensorflow-cpu>=2.18; sys_platform == 'linux'",
        "tensorflow>=2.18; sys_platform != 'linux'",
        "tensorflow-datasets>=4.9.7",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.5"],
        # optional: timm weight import (timm_convert.py); tested pins in requirements-timm.txt
        "timm": ["torch", "torchvision", "timm", "safetensors"],
        # optional: hosted tracking (config.wandb.project; trainers/wandb_writer.py)
        "wandb": ["wandb"],
        # optional: a SentencePiece tokenizer for the lm trainer (config.dataset.tokenizer; data/text.py)
        "text": ["sentencepiece"],
    },
)

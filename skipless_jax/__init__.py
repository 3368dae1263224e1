"""skipless_jax: training Vision Transformers with and without residual connections."""

__version__ = "0.1.0"

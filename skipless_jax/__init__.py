"""skipless_jax: training Vision Transformers with and without residual connections."""

import os

# XLA:CPU's concurrency-optimized scheduler can deadlock on programs with several small
# factorizations (the skipless init's SVDs, SOAP's eigh/QR). XLA reads XLA_FLAGS when its CPU
# backend starts, so importing any skipless_jax module before the first JAX computation suffices.
if "xla_cpu_enable_concurrency_optimized_scheduler" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    ).strip()

__version__ = "0.1.0"

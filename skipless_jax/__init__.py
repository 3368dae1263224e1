"""skipless_jax: training Vision Transformers with and without residual connections."""

import logging
import os

from absl import logging as absl_logging

# XLA:CPU's concurrency-optimized scheduler can deadlock on programs with several small
# factorizations (the skipless init's SVDs, SOAP's eigh/QR). XLA reads XLA_FLAGS when its CPU
# backend starts, so importing any skipless_jax module before the first JAX computation suffices.
if "xla_cpu_enable_concurrency_optimized_scheduler" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    ).strip()



class _DropOrbaxImportNotice(logging.Filter):
    """orbax registers its jax.Array handler under a second name when imported and says so in a
    WARNING ('Type handler registry type ... overriding jax.Array'), before any command has set
    up its console: nothing is wrong, so every command drops that record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Type handler registry type ")


absl_logging.get_absl_logger().addFilter(_DropOrbaxImportNotice())  # absl's own logger class

__version__ = "0.1.0"

"""skipless_jax: training Vision Transformers with and without residual connections."""

import logging
import os

# One BLAS thread unless the user chose otherwise: numpy's and XLA:CPU's LAPACK calls (the
# skipless init's SVDs, SOAP's eigh/QR) run on OpenBLAS, whose own thread pool oversubscribes a
# loaded CPU (a quickstart run took 5x as long) and changes the rounding (another accuracy per
# seed). Set here, before anything imports numpy: `python -m skipless_jax.X` imports this first.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
for _name in BLAS_THREAD_VARIABLES:
    os.environ.setdefault(_name, "1")

from absl import logging as absl_logging  # noqa: E402

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

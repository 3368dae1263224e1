r"""configs/dino_digits.py shrunk to seconds, for tests that run the DINO trainer in subprocesses.

    python -m skipless_jax.main --config=tests/configs/tiny_dino.py --workdir=DIR --config.total_steps=6

Width 32, depth 1, 2 heads, a 32-wide head, batch 16, no local crops, no evaluation, and
`total_steps` (not epochs) so that the command line can set it.
"""

import importlib.util
import os

import ml_collections

_DINO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs", "dino_digits.py")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location("configs_dino_digits", _DINO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(arg)
    c.model.update(dict(width=32, mlp_dim=64, num_heads=2, depth=1))
    c.dino.update(dict(out_dim=32, hidden_dim=32, bottleneck_dim=16))
    c.input.batch_size = 16
    c.input.multicrop.num_local = 0
    c.total_epochs = None
    c.total_steps = 12
    c.schedule.warmup_epochs = None
    c.schedule.warmup_steps = 0
    c.evals = ml_collections.ConfigDict()
    c.eval_at_start = False
    c.log_every_steps = 4
    c.checkpoint_every_steps = 0
    c.profile_steps = 0  # no profiler trace (about a second a run): --config.profile_steps=3 turns it on
    return c

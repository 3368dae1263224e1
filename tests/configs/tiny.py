r"""The quickstart shrunk to seconds, for tests that run the CLI in subprocesses.

    python -m skipless_jax.main --config=tests/configs/tiny.py --workdir=DIR \
        --config.mesh.fsdp=2 --config.total_steps=6 --config.checkpoint_every_steps=2

Width 32, depth 1, 2 heads, batch 32, and `total_steps` (not epochs) so that the command line
can set it. Args: `fsdp` (the same as `--config.mesh.fsdp=N`: the mesh is {data: -1, fsdp: N};
kept for the commands that use it) and the quickstart's (seed, depth, skip_sab, ...).
"""

import importlib.util
import os

import ml_collections

_QUICKSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs", "quickstart.py")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    items = [item for item in (arg or "").split(",") if item]
    fsdp = [int(item.partition("=")[2]) for item in items if item.startswith("fsdp=")]
    rest = ",".join(item for item in items if not item.startswith("fsdp="))
    spec = importlib.util.spec_from_file_location("configs_quickstart", _QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("skip_sab=True,skip_ffn=True,init=default,opt=adamw," + rest)
    c.model.width, c.model.mlp_dim, c.model.num_heads = 32, 64, 2
    if "depth=" not in rest:
        c.model.depth = 1
    c.mesh.fsdp = fsdp[-1] if fsdp else 1
    c.total_epochs = None
    c.total_steps = 12
    c.schedule.warmup_epochs = None
    c.schedule.warmup_steps = 2
    c.input.batch_size = 32
    c.log_every_steps = 4
    c.checkpoint_every_steps = 0
    c.profile_steps = 0  # no profiler trace (about a second a run): --config.profile_steps=3 turns it on
    return c

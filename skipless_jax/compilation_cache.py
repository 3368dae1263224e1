"""JAX's persistent compilation cache for every entry point (main, evaluate, analyze).

A compiled program is written to disk and read back by later processes that compile the same
program (same HLO, flags, devices and JAX version), so a resumed run, a relaunch after
preemption or an `evaluate` job after training skips the compiles it has already paid for
(ViT-B's train step, one TokenCut program per padded image size, ...).

Where (first that applies):
- `config.compilation_cache_dir`: a folder, or '' to switch the cache off;
- the `JAX_COMPILATION_CACHE_DIR` environment variable (what the tests and launchers set);
- `$XDG_CACHE_HOME/skipless_jax/xla`, default `~/.cache/skipless_jax/xla`.
Programs that compile in less than `MIN_COMPILE_SECS` are not written (reading them back costs
about what compiling them does); `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` overrides that.
On a multi-host run every host reads and writes the folder it names (a local folder per host,
or one shared file system).
"""

from __future__ import annotations

import os
from typing import Any

import jax

MIN_COMPILE_SECS = 1.0
_ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
_ENV_MIN_SECS = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def default_dir() -> str:
    """`$XDG_CACHE_HOME/skipless_jax/xla` (XDG_CACHE_HOME defaults to ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "skipless_jax", "xla")


def cache_dir(config: Any = None) -> str:
    """The folder the cache uses for `config` (a ConfigDict or mapping, or None); '' = off."""
    value = None if config is None else config.get("compilation_cache_dir")
    if value is not None:
        if not isinstance(value, str):
            raise ValueError(f"config.compilation_cache_dir={value!r} must be a folder path, or '' to switch "
                             "the compilation cache off")
        return os.path.expanduser(value)
    return os.environ.get(_ENV_DIR) or default_dir()


def setup(config: Any = None) -> str:
    """Points JAX's persistent compilation cache at `cache_dir(config)` (call once at startup,
    before anything compiles); returns the folder ('' when switched off)."""
    path = cache_dir(config)
    if not path:
        jax.config.update("jax_enable_compilation_cache", False)
        return ""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    if _ENV_MIN_SECS not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    return path

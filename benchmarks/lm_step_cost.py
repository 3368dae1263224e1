r"""CPU-seconds and wall-clock seconds of one lm training step of a config (its trainer's own
compiled step on one device, random windows), for a study's cost estimate.

    OPENBLAS_NUM_THREADS=1 python benchmarks/lm_step_cost.py --config=configs/lm_skipless_study.py \
        --args="attention_shape=sas,opt=adamw" --args="skips=True,opt=adamw" --steps=10

Each `--args` is one config; the step runs once to compile, twice to warm up, then `--steps`
times; the process's user + system CPU time over those steps (`resource.getrusage`) and their
wall-clock, each divided by `--steps`, are printed with the load average (the machine's other
jobs share its cores: the wall-clock is theirs too, the CPU time mostly not).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import time

import jax
import scaling  # benchmarks/scaling.py: the trainers' own steps (this script's folder is on sys.path)


def load_config(path: str, arg: str):
    spec = importlib.util.spec_from_file_location("study_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def step_cost(config, steps: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per step of `config`'s lm step on one device."""
    program = scaling.lm_program(config, {"data": 1}, jax.devices()[:1])
    state, batch = program.init(), program.batch(scaling.random_batch(program))
    for _ in range(3):  # compile, then warm up
        state, metrics = program.run(state, batch)
    jax.block_until_ready(metrics)
    cpu, wall = cpu_seconds(), time.perf_counter()
    for _ in range(steps):
        state, metrics = program.run(state, batch)
    jax.block_until_ready(metrics)
    return (cpu_seconds() - cpu) / steps, (time.perf_counter() - wall) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--args", action="append", default=[])
    parser.add_argument("--steps", type=int, default=10)
    flags = parser.parse_args()
    for arg in flags.args or [""]:
        cpu, wall = step_cost(load_config(flags.config, arg), flags.steps)
        print(f"{arg or '(defaults)'}: {cpu:.3f} CPU-s/step, {wall:.3f} s/step wall-clock, "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()

r"""ViT-B/16 at 224 on this CPU: compile time and XLA memory of the supervised trainer's own step,
unrolled vs `config.model.scan`, without vs with `config.model.remat`, AdamW vs SOAP.

    OPENBLAS_NUM_THREADS=1 python benchmarks/large_model.py [--batch=8] [--out=benchmarks/results/large_model.json]

Every row compiles `supervised.make_train_step` (the function the trainer jits) for one device
from abstract shapes (nothing is allocated) and reads `compile()` wall time and
`memory_analysis()` (arguments, temporaries). Ratios are against the first row of the same run
(default the unrolled AdamW step; `--rows='AdamW, scan|SOAP, scan'` picks rows). Compile times
depend on the machine's load; the memory figures do not.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROWS = {
    "AdamW, unrolled": dict(opt="adamw"),
    "AdamW, scan": dict(opt="adamw", scan=True),
    "AdamW, unrolled, remat=full": dict(opt="adamw", remat="full"),
    "AdamW, scan, remat=full": dict(opt="adamw", scan=True, remat="full"),
    "AdamW, scan, remat=dots": dict(opt="adamw", scan=True, remat="dots"),
    "SOAP, unrolled": dict(opt="soap"),
    "SOAP, scan": dict(opt="soap", scan=True),
}


def vitb_config(opt: str = "adamw", **model_fields: Any):
    """The ViT-B/16 baseline (configs/vitb_skipless.py with both skips and the default init; 224,
    float32 here) with `opt` and model fields."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("configs_vitb", os.path.join(ROOT, "configs", "vitb_skipless.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(f"skip_sab=True,skip_ffn=True,init=default,opt={opt}")
    config.model.update({"dtype": "float32", **model_fields})
    config.schedule.warmup_steps = 10
    return config


def compiled_vitb_step(batch: int, opt: str = "adamw", **model_fields: Any):
    """(compiled supervised train step of ViT-B/16 at 224 for one device, compile seconds)."""
    from skipless_jax import models
    from skipless_jax.optim import build_optimizer
    from skipless_jax.trainers import common, nonfinite, supervised

    config = vitb_config(opt, **model_fields)
    model = models.build(config.model, 1000)
    tx, schedule = build_optimizer(config, 1000)

    def init_state(rng):
        params = models.init_variables(config.model, model, rng, jnp.zeros((1, 224, 224, 3)))["params"]
        return common.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng,
                                 nonfinite=nonfinite.init_nonfinite())

    state = jax.eval_shape(init_state, jax.random.PRNGKey(0))
    batch_shapes = {"image": jax.ShapeDtypeStruct((batch, 224, 224, 3), jnp.float32),
                    "label": jax.ShapeDtypeStruct((batch, 1000), jnp.float32)}
    lowered = jax.jit(supervised.make_train_step(model, tx, schedule, config), donate_argnums=0).lower(
        state, batch_shapes)
    start = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "large_model.json"))
    parser.add_argument("--rows", default="", help="'|'-separated row names (default all); the first is the baseline")
    args = parser.parse_args()
    names = args.rows.split("|") if args.rows else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"--rows: {unknown[0]!r} is unknown; allowed: {list(ROWS)}")
    rows = {}
    for name in names:
        fields = ROWS[name]
        compiled, seconds = compiled_vitb_step(args.batch, **fields)
        memory = compiled.memory_analysis()
        rows[name] = dict(compile_s=round(seconds, 2), argument_mib=round(memory.argument_size_in_bytes / 2**20, 1),
                          temp_mib=round(memory.temp_size_in_bytes / 2**20, 1))
        print(name, rows[name], flush=True)
    base_name = names[0]
    base = rows[base_name]
    print(f"\n| step (ViT-B/16, 224, batch {args.batch}) | compile s | × {base_name} | temp MiB | × | args MiB |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        r["compile_ratio"] = round(r["compile_s"] / base["compile_s"], 3)
        r["temp_ratio"] = round(r["temp_mib"] / base["temp_mib"], 3)
        print(f"| {name} | {r['compile_s']} | {r['compile_ratio']} | {r['temp_mib']} | {r['temp_ratio']} | "
              f"{r['argument_mib']} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(batch=args.batch, backend=jax.default_backend(), baseline=base_name, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""The Fashion-MNIST study's pre-registered pilot and claims (configs/fashion_vit.py, issue #53):
the pilot runs each of the 11 cells at 5 lrs, 2 seeds, on the validation split; every claim's
cells are pilot cells, judged on the study's runs (pilot=False, 5 epochs) only."""

from __future__ import annotations

import os
from collections import defaultdict

from skipless_jax import claims, report, sweep

from util import ROOT

CONFIG = os.path.join(ROOT, "configs", "fashion_vit.py")


def _runs(module, *grids: str) -> list[dict[str, str]]:
    names = {r.name for grid in grids for r in sweep.expand(CONFIG, grid, module)}
    return [report.run_args(n) for n in names]


def test_the_pilot_runs_every_cell_at_five_lrs_and_two_seeds_on_the_validation_split():
    module = sweep.load_config_module(CONFIG)
    runs = _runs(module, "pilot")
    assert len(runs) == 110
    assert {(r["val"], r["pilot"], r["epochs"], r["depth"]) for r in runs} == {("True", "True", "3", "8")}
    cells = defaultdict(lambda: defaultdict(set))
    for r in runs:
        cells[tuple((k, v) for k, v in r.items() if k not in ("lr", "seed"))][float(r["lr"])].add(r["seed"])
    assert len(cells) == 11
    for cell, grid in cells.items():
        values = sorted(grid)
        assert len(values) == 5 and values[-1] / values[0] >= 80, (cell, values)  # 4 steps of about 3×
        assert all(seeds == {"0", "1"} for seeds in grid.values()), cell
        config = module.get_config(",".join(f"{k}={v}" for k, v in cell) + f",lr={values[0]}")
        assert config.dataset.train_split == "train[:10000]" and config.total_epochs == 3


def test_every_claim_cell_is_a_pilot_cell_judged_on_the_study_runs_only():
    module = sweep.load_config_module(CONFIG)
    pilot = _runs(module, "pilot")
    defaults = report.config_defaults(module)
    study = claims.from_module(module, path=CONFIG)
    assert [c.name for c in study] == ["sab_skip_matters_more", "convmixer_skip_costs_little",
                                       "init_beats_default_adamw", "init_soap_matches_skips",
                                       "init_shampoo_ec_matches_skips", "soap_beats_adamw_init",
                                       "soap_beats_adamw_default"]
    # A study run of every pilot cell: the pilot's args but pilot=False, epochs=5, 5 seeds at one lr.
    table = []
    for r in {tuple((k, v) for k, v in r.items() if k not in ("lr", "seed", "pilot", "epochs")) for r in pilot}:
        for seed in range(5):
            args = {**dict(r), "lr": "1e-3", "epochs": "5", "seed": str(seed)}
            table.append(dict(run=",".join(f"{k}={v}" for k, v in args.items()), **args, val_accuracy=0.9,
                              test_accuracy=0.9, train_loss=0.1))
    pilots = [dict(run=",".join(f"{k}={v}" for k, v in r.items()), **r, val_accuracy=0.5, test_accuracy=0.5,
                   train_loss=0.1) for r in pilot]
    rows = claims.judge(study, table + pilots, num_classes=10, natural_key=report.natural_key, defaults=defaults)
    assert {(r["claim"], r["setting"]) for r in rows} == {(c.name, "depth=8") for c in study}
    assert all((r["n_a"], r["n_b"], r["mean_a"], r["mean_b"]) == (5, 5, 0.9, 0.9) for r in rows)  # no pilot run
    margins = {c.name: c.margin for c in study}
    assert margins["init_soap_matches_skips"] == margins["convmixer_skip_costs_little"] == 0.01

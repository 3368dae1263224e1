"""The Fashion-MNIST study's pre-registered grids and claims (configs/fashion_vit.py, issue #53):
every claim's cells are runs of the grids, each cell has a 3-value lr grid at every depth with 5
seeds, every run chooses on the validation split, and the pilot widens every grid."""

from __future__ import annotations

import os
from collections import defaultdict

from skipless_jax import claims, report, sweep

from util import ROOT

CONFIG = os.path.join(ROOT, "configs", "fashion_vit.py")


def _runs(module, *grids: str) -> list[dict[str, str]]:
    names = {r.name for grid in grids for r in sweep.expand(CONFIG, grid, module)}
    return [report.run_args(n) for n in names]


def test_every_claim_cell_has_a_3_value_lr_grid_of_5_seeds_at_each_depth():
    """Each claim, judged as `report --claims` judges it (the config's arg defaults fill the args a
    folder leaves out), finds 5 runs per cell at each depth, chosen from a 3-value lr grid."""
    module = sweep.load_config_module(CONFIG)
    runs = _runs(module, "table1", "cutting", "cutting_depth12")
    assert all(r["val"] == "True" for r in runs)
    defaults = report.config_defaults(module)
    study = claims.from_module(module, path=CONFIG)
    table1 = ["sab_skip_matters_more", "convmixer_skip_costs_little"]
    assert [c.name for c in study] == [*table1, "init_beats_default_adamw", "init_soap_matches_skips",
                                       "init_shampoo_ec_matches_skips", "soap_beats_adamw_init",
                                       "soap_beats_adamw_default"]
    for claim in study:
        assert (claim.select, claim.select_by, claim.metric, claim.per) == ("lr", "val_accuracy", "test_accuracy",
                                                                            ("depth",))
        for cell in (claim.a, claim.b):
            lrs = defaultdict(lambda: defaultdict(set))
            for r in runs:
                if all(r.get(k, defaults.get(k)) == v for k, v in cell.items()):
                    lrs[r["depth"]][float(r["lr"])].add(r["seed"])
            assert lrs, (claim.name, cell)
            for depth, grid in lrs.items():
                values = sorted(grid)
                assert len(values) == 3 and values[-1] / values[0] >= 9, (claim.name, cell, depth, values)
                assert all(len(seeds) == 5 for seeds in grid.values()), (claim.name, cell, depth)
    table = [dict(run=",".join(f"{k}={v}" for k, v in r.items()), **r, val_accuracy=0.9, test_accuracy=0.9,
                  train_loss=0.1) for r in runs]
    rows = claims.judge(study, table, num_classes=10, natural_key=report.natural_key, defaults=defaults)
    assert {(r["claim"], r["setting"]) for r in rows} == (
        {(c.name, "depth=8") for c in study} | {(c.name, "depth=12") for c in study if c.name not in table1})
    assert all((r["n_a"], r["n_b"]) == (5, 5) for r in rows)
    margins = {c.name: c.margin for c in study}
    assert margins["init_soap_matches_skips"] == margins["convmixer_skip_costs_little"] == 0.01


def test_the_pilot_widens_each_cell_grid_by_one_value_on_each_side():
    module = sweep.load_config_module(CONFIG)
    study, pilot = defaultdict(set), defaultdict(set)
    for grids, table in ((("table1", "cutting"), study), (("pilot",), pilot)):
        for r in _runs(module, *grids):
            cell = tuple(sorted((k, v) for k, v in r.items() if k not in ("lr", "seed", "pilot", "epochs")))
            table[cell].add(r["lr"])
    for cell, lrs in pilot.items():
        inner = sorted(map(float, study[cell]))
        outer = sorted(map(float, lrs))
        assert len(outer) == 5 and outer[1:4] == inner, (cell, outer, inner)
    assert {c for c in study if ("depth", "8") in c} == set(pilot)

"""Claims as code (skipless_jax/claims.py) and `report --claims`: the rows, the Holm family, the
verdicts, runs that did not train or failed, and the quickstart's claims against its grids."""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import math
import os

import numpy as np
import pytest
from scipy import stats as ss

from skipless_jax import claims, report, stats, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
CHANCE = math.log(10)


def _run(opt: str, depth: int, seed: int, acc: float | None, loss: float = 0.01) -> dict:
    run = f"opt={opt},depth={depth},seed={seed}"
    row = {"run": run, "opt": opt, "depth": str(depth), "seed": str(seed)}
    if acc is None:
        row["status"] = claims.FAILED
    else:
        row.update(test_accuracy=acc, train_loss=loss)
    return row


def _table():
    """depth 8: soap clearly above adamw; depth 12: no difference; depth 16: soap clearly below;
    depth 24: one adamw run only."""
    rng = np.random.default_rng(0)
    table = []
    for depth, soap, adamw in ((8, 0.95, 0.80), (12, 0.90, 0.90), (16, 0.30, 0.90)):
        for seed in range(5):
            table.append(_run("soap", depth, seed, soap + rng.normal(0, 0.01)))
            table.append(_run("adamw", depth, seed, adamw + rng.normal(0, 0.01)))
    table.append(_run("adamw", 24, 0, 0.5))
    return table


SOAP_BEATS_ADAMW = claims.Claim("soap_beats_adamw", a={"opt": "soap"}, b={"opt": "adamw"}, per=("depth",))


def test_rows_tests_and_verdicts():
    table = _table()
    rows = claims.judge([SOAP_BEATS_ADAMW], table, num_classes=10, natural_key=report.natural_key)
    assert [r["setting"] for r in rows] == ["depth=8", "depth=12", "depth=16", "depth=24"]
    assert [r["verdict"] for r in rows] == ["holds", "not shown", "reversed", "untested"]
    tested = rows[:3]
    decided = []
    for r in tested:
        depth = r["setting"].split("=")[1]
        a = [x["test_accuracy"] for x in table if x["opt"] == "soap" and x["depth"] == depth]
        b = [x["test_accuracy"] for x in table if x["opt"] == "adamw" and x["depth"] == depth]
        c = stats.compare(a, b)
        assert (r["n_a"], r["n_b"]) == (5, 5)
        assert r["mean_a"] == pytest.approx(np.mean(a)) and r["std_b"] == pytest.approx(np.std(b, ddof=1))
        assert (r["p_welch"], r["p_permutation"], r["p_mannwhitney"]) == (c.p_welch, c.p_permutation, c.p_mannwhitney)
        decided.append(max(c.p_welch, c.p_permutation))
    assert [r["p_holm"] for r in tested] == pytest.approx(stats.holm(decided))  # the family: the tested rows
    assert rows[3]["n_a"] == 0 and rows[3]["trained_b"] == "1/1" and "p_holm" not in rows[3]


def test_the_holm_family_is_the_claims_field():
    """Claims that name one family share Holm's adjustment; others are their own family."""
    table = _table()
    other = claims.Claim("adamw_beats_soap", a={"opt": "adamw"}, b={"opt": "soap"}, per=("depth",))
    apart = claims.judge([SOAP_BEATS_ADAMW, other], table, num_classes=10)
    assert {r["family"] for r in apart} == {"soap_beats_adamw", "adamw_beats_soap"}
    mine = [r for r in apart if r["claim"] == "soap_beats_adamw" and "_p" in r]
    assert [r["p_holm"] for r in mine] == pytest.approx(stats.holm([r["_p"] for r in mine]))
    assert all(r["family_size"] == 3 for r in mine)
    shared = dataclasses.replace(other, family="soap_beats_adamw")
    joint = claims.judge([SOAP_BEATS_ADAMW, shared], table, num_classes=10)
    tested = [r for r in joint if "_p" in r]
    assert [r["p_holm"] for r in tested] == pytest.approx(stats.holm([r["_p"] for r in tested]))
    assert all(r["family_size"] == 6 for r in tested)


def _two_claims_config(tmp_path) -> str:
    config = tmp_path / "two.py"
    config.write_text(
        "KW = dict(per=('depth',), trained_below=1.0)\n"
        "CLAIMS = {'soap_beats_adamw': dict(a={'opt': 'soap'}, b={'opt': 'adamw'}, **KW),\n"
        "          'adamw_beats_soap': dict(a={'opt': 'adamw'}, b={'opt': 'soap'}, **KW)}\n"
        "GRIDS = {'deep': 'opt=soap,adamw depth=16 seed=0,1,2,3,4'}\n"
        "def get_config(arg=None):\n"
        "    import ml_collections\n"
        "    from skipless_jax import config_args\n"
        "    a = config_args.parse(arg, opt='soap', depth=8, seed=0)\n"
        "    return ml_collections.ConfigDict(dict(seed=a['seed']))\n")
    return str(config)


def test_a_claim_reads_the_same_printed_alone_with_others_or_under_a_grid(tmp_path, capsys):
    """The family is fixed by the claim: its rows' p_holm and verdicts do not depend on which
    claims or rows one `report --claims` call prints."""
    path, config = _write_csv(tmp_path, _table()), _two_claims_config(tmp_path)

    def rows(*extra):
        assert report.main([path, "--format=csv", *extra]) == 0
        return {(r["claim"], r["setting"]): (r["p_holm"], r["verdict"])
                for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}

    alone = rows(f"--claims={config}:soap_beats_adamw")
    together = rows(f"--claims={config}")
    grid = rows(f"--claims={config}:soap_beats_adamw", f"--config={config}", "--grid=deep")
    assert len(alone) == 4 and len(together) == 8 and list(grid) == [("soap_beats_adamw", "depth=16")]
    assert all(together[k] == v for k, v in alone.items())
    assert grid[("soap_beats_adamw", "depth=16")] == alone[("soap_beats_adamw", "depth=16")] \
        == (alone[("soap_beats_adamw", "depth=16")][0], "reversed")
    assert report.main([path, f"--claims={config}:soap_beats_adamw"]) == 0
    md = capsys.readouterr().out
    assert "p_holm is Holm's adjustment of max(p_welch, p_perm) within each claim's family (every tested row of " \
           "it over these runs, printed or not): `soap_beats_adamw` 3 rows." in md


def test_failed_runs_are_listed_left_out_and_counted_as_not_trained(capsys, tmp_path):
    table = [r for r in _table() if r["depth"] == "8"]
    table[0] = _run("soap", 8, 0, None)  # failed: no final metrics
    table[2] = _run("soap", 8, 1, 0.11, loss=2.30)  # finished without training: loss ≈ ln 10
    rows = claims.judge([SOAP_BEATS_ADAMW], table, num_classes=10)
    r = rows[0]
    assert (r["n_a"], r["trained_a"], r["left_out"]) == (4, "3/5", 1)
    assert r["failed_runs"] == "opt=soap,depth=8,seed=0"
    counted = claims.judge([SOAP_BEATS_ADAMW], table, num_classes=10, failed_as=0.1)[0]
    assert (counted["n_a"], counted["left_out"], counted["failed_runs"]) == (5, 0, "opt=soap,depth=8,seed=0")
    assert "1 run(s) without final metrics (failed, non-finite or unfinished), counted as 0.1: " \
           "`opt=soap,depth=8,seed=0`." in claims.markdown([counted], [SOAP_BEATS_ADAMW], 0.05, 0.1)
    soap = [x["test_accuracy"] for x in table[1:] if x["opt"] == "soap"]
    assert counted["mean_a"] == pytest.approx(np.mean([0.1, *soap]))
    assert claims.judge([claims.Claim("x", a={"opt": "soap"}, b={"opt": "adamw"}, trained_below=0.005)],
                        table, num_classes=None)[0]["trained_a"] == "0/5"
    text = claims.markdown(rows, [SOAP_BEATS_ADAMW], 0.05, None)
    assert "1 run(s) without final metrics (failed, non-finite or unfinished), left out of the tests: " \
           "`opt=soap,depth=8,seed=0`." in text


def test_a_margin_makes_a_non_inferiority_test():
    """A is 0.5 points below B: not 'greater', but within a 1-point margin (H1: μa > μb − 0.01)."""
    rng = np.random.default_rng(1)
    table = [_run(opt, 8, s, base + rng.normal(0, 0.001))
             for s in range(5) for opt, base in (("soap", 0.955), ("adamw", 0.96))]
    plain = claims.judge([SOAP_BEATS_ADAMW], table, num_classes=10)[0]
    margin = claims.Claim("ni", a={"opt": "soap"}, b={"opt": "adamw"}, margin=0.01)
    within = claims.judge([margin], table, num_classes=10)[0]
    assert plain["verdict"] == "reversed" and within["verdict"] == "holds"
    assert within["gap"] == pytest.approx(plain["gap"])  # the gap and interval are without the margin
    c = stats.compare([r["test_accuracy"] for r in table if r["opt"] == "soap"],
                      [r["test_accuracy"] for r in table if r["opt"] == "adamw"], margin=0.01)
    assert within["p_welch"] == c.p_welch


def test_runs_that_differ_in_a_per_arg_are_never_pooled():
    table = _table()
    extra = [dict(_run("soap", 8, s, 0.2), lr="0.1", run=f"opt=soap,depth=8,lr=0.1,seed={s}") for s in range(5)]
    claim = claims.Claim("c", a={"opt": "soap"}, b={"opt": "adamw"}, per=("depth", "lr"))
    rows = claims.judge([claim], table + extra, num_classes=10, natural_key=report.natural_key)
    assert [r["setting"] for r in rows][:2] == ["depth=8", "depth=8,lr=0.1"]
    assert rows[0]["n_a"] == 5 and rows[1]["n_b"] == 0


@pytest.mark.parametrize("spec,message", [
    (dict(a={"opt": "soap"}, b={"opt": "adamw"}, alternative="bigger"), "alternative='bigger'"),
    (dict(a={}, b={"opt": "adamw"}), "cell a must be a non-empty dict"),
    (dict(a={"opt": "soap"}, b={"opt": "adamw"}, margin=-1.0), "margin=-1.0 must be"),
])
def test_bad_claims_are_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        claims.Claim("bad", **spec)
    assert "\n" not in str(err.value)


def _write_csv(tmp_path, table) -> str:
    path = str(tmp_path / "runs.csv")
    with open(path, "w", newline="") as f:
        f.write(report.format_table(table, "csv"))
    return path


def test_report_claims_cli_from_a_csv(tmp_path, capsys):
    config = tmp_path / "config.py"
    config.write_text(
        "import ml_collections\n"
        "CLAIMS = {'soap_beats_adamw': dict(a={'opt': 'soap'}, b={'opt': 'adamw'}, per=('depth',)),\n"
        "          'adamw_beats_soap': dict(a={'opt': 'adamw'}, b={'opt': 'soap'}, per=('depth',))}\n"
        "def get_config(arg=None):\n"
        "    c = ml_collections.ConfigDict(); c.dataset = ml_collections.ConfigDict(dict(name='digits')); return c\n")
    path = _write_csv(tmp_path, _table())
    assert report.main([path, f"--claims={config}:soap_beats_adamw", "--format=csv"]) == 0
    out = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["verdict"] for r in out] == ["holds", "not shown", "reversed", "untested"]
    assert list(out[0]) == list(claims.PUBLIC)
    assert report.main([path, f"--claims={config}"]) == 0  # both claims: one family of 6 tested rows
    md = capsys.readouterr().out
    assert md.count("| soap_beats_adamw |") == 4 and "`soap_beats_adamw` 3 rows, `adamw_beats_soap` 3 rows." in md
    for argv, message in [
        ([path, f"--claims={config}:nope"], "--claims: 'nope' is not a claim of"),
        ([path, f"--claims={QUICKSTART}:init_beats_default_adamw", "--mean_over=seed"], "--claims is its own table"),
        ([path, f"--claims={tmp_path / 'missing.py'}"], "no such config file"),
    ]:
        assert report.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_report_claims_reads_a_sweep_root_with_failed_runs(tmp_path, capsys):
    """A folder the sweep started without final metrics is a failed run of its cell."""
    for r in _table():
        folder = tmp_path / "root" / r["run"]
        folder.mkdir(parents=True)
        (folder / "sweep_run.json").write_text("{}")
        if r["run"] != "opt=soap,depth=8,seed=3":
            (folder / "final_metrics.json").write_text(json.dumps({k: r[k] for k in ("test_accuracy", "train_loss")}))
    assert report.main([str(tmp_path / "root"), f"--claims={QUICKSTART}:init_beats_default_adamw"]) == 0
    md = capsys.readouterr().out  # the config's defaults: skip_sab=False, init=skipless, so cell A matches
    assert "| init_beats_default_adamw | depth=8 | 5 | 0 |" in md
    assert "- `init_beats_default_adamw`: cell B matches no run: init=default matches none of the 31 runs." in md
    config = tmp_path / "c.py"
    config.write_text("CLAIMS = {'s': dict(a={'opt': 'soap'}, b={'opt': 'adamw'}, per=('depth',),\n"
                      "                    trained_below=1.0)}\n")
    assert report.main([str(tmp_path / "root"), f"--claims={config}", "--format=csv"]) == 0
    first = next(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert (first["n_a"], first["trained_a"], first["left_out"]) == ("4", "4/5", "1")
    assert first["failed_runs"] == "opt=soap,depth=8,seed=3"

    # --failed_as counts the failed run as that value (still named); --alpha moves the verdict line
    root = str(tmp_path / "root")
    assert report.main([root, f"--claims={config}", "--failed_as=0.1", "--alpha=0.01"]) == 0
    md = capsys.readouterr().out
    assert "Verdicts at α = 0.01" in md
    assert "counted as 0.1: `opt=soap,depth=8,seed=3`." in md
    row = md.splitlines()[2].split(" | ")
    assert (row[2], row[3]) == ("5", "5")  # n_a counts the failed run as 0.1
    for bad, message in (("--alpha=1.5", "--alpha=1.5 must be in (0, 1)"), ("--failed_as=x", "--failed_as")):
        assert report.main([root, f"--claims={config}", bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_the_quickstart_claims_name_cells_of_its_grids():
    """Every cell of every quickstart claim is a set of runs of the quickstart's named grids."""
    module = sweep.load_config_module(QUICKSTART)
    runs = _grid_runs(module, "table1", "skip_ablation", "depth", "claims")
    qs = claims.from_module(module, path=QUICKSTART)
    assert [c.name for c in qs] == ["init_beats_default_adamw", "init_soap_matches_skips", "soap_beats_adamw_init",
                                   "soap_beats_adamw_default", "sab_skip_matters_more",
                                   "init_trains_more_often", "init_beats_default_adamw_best_lr",
                                   "init_shampoo_ec_matches_skips_pf100", "init_shampoo_ec_matches_skips_pf10",
                                   "init_soap_matches_skips_best_lr"]
    assert all(c.family == c.name for c in qs[:7])  # the claims before the fork recipe's: each its own family
    for c in qs[:7]:
        for cell in (c.a, c.b):
            matching = [r for r in runs if all(r.get(k) == v for k, v in cell.items())]
            assert len(matching) >= 5, (c.name, cell)
    assert next(c for c in qs if c.name == "init_soap_matches_skips").margin == 0.01


def _grid_runs(module, *grids: str, metrics=None) -> list[dict]:
    """report's rows of the runs of the quickstart's `grids` (their folder args), with the
    final metrics `metrics(args)` (none: args only)."""
    names = {r.name for g in grids for r in sweep.expand(QUICKSTART, g, module)}
    runs = [{"run": n, **report.run_args(n)} for n in sorted(names)]
    for r in runs:
        r.update(metrics(r) if metrics else {})
    return runs


def test_the_fork_recipe_claims_name_their_grids_runs_and_choose_among_four_lrs():
    """Each cell of the fork recipe's claims, at depths 8 and 12, is 5 seeds at each of at least 4
    lrs of the `fork_recipe` grid; judged with report's defaults and lr choice, the shampoo_ec
    family has the 4 rows (2 depths × 2 refresh frequencies) and SOAP's its 2, each lr chosen
    on validation (here: peaked at the grid's second value, so interior)."""
    module = sweep.load_config_module(QUICKSTART)
    spec = report.load_claims(f"{QUICKSTART}:init_shampoo_ec_matches_skips_pf100,"
                              "init_shampoo_ec_matches_skips_pf10,init_soap_matches_skips_best_lr")
    assert {c.family for c in spec.judged} == {"init_shampoo_ec_matches_skips", "init_soap_matches_skips_best_lr"}
    assert [c.name for c in spec.judged] == [c.name for c in spec.printed]  # nothing else in their families
    value = report.select_value(spec)
    runs = _grid_runs(module, "fork_recipe")
    for c in spec.printed:
        assert (c.margin, c.select, c.per) == (0.01, "lr", ("depth", "tokens", "label_smoothing", "self_share"))
        for cell in (c.a, c.b):
            for depth in ("8", "12"):
                members = [r for r in runs if r["depth"] == depth and claims._matches(r, cell, spec.defaults)]
                lrs = sorted({value(r, c) for r in members})
                assert len(lrs) >= 4 and len(members) == 5 * len(lrs), (c.name, cell, depth, lrs)
                assert {r["seed"] for r in members} == set("01234")

    def metrics(r):
        second = value(r, spec.printed[0]) in (1.5e-3, 1e-3)  # the second lr of each cell's grid
        return dict(test_accuracy=0.9 + 0.05 * second + 0.001 * int(r["seed"]), val_accuracy=0.8 + 0.1 * second,
                    train_loss=0.1)

    table = _grid_runs(module, "fork_recipe", metrics=metrics)
    rows, notes = report.judge_claims(spec, table, 0.05, None, None)
    assert notes == []
    assert [(r["claim"], r["setting"]) for r in rows] == [(c.name, f"depth={d}") for c in spec.printed
                                                          for d in (8, 12)]
    assert [r["family_size"] for r in rows] == [4, 4, 4, 4, 2, 2]
    assert all((r["n_a"], r["n_b"], r["interior_a"], r["interior_b"]) == (5, 5, True, True) for r in rows)


def test_bimodal_seeds_has_seeds_5_to_9_of_every_committed_cell_that_trained_sometimes():
    """The `bimodal_seeds` grid is seeds 5-9 of exactly the committed cells whose trained count
    k/n (final train loss below ½ ln 10, claims.py's rule) is strictly between 0 and n, in the
    folders their seeds 0-4 have; the failure-rate claim covers each of its AdamW cells."""
    cells: dict[tuple, list[float]] = {}
    for name in ("quickstart_runs.csv", "claims_runs.csv"):
        with open(os.path.join(ROOT, "docs", "figures", name)) as f:
            for row in csv.DictReader(f):
                args = report.run_args(row["run"])
                assert args.pop("seed") in set("01234")
                cells.setdefault(tuple(args.items()), []).append(float(row["train_loss"]))
    bimodal = {cell for cell, losses in cells.items() if 0 < sum(x < CHANCE / 2 for x in losses) < len(losses)}
    module = sweep.load_config_module(QUICKSTART)
    grid: dict[tuple, set[str]] = {}
    for r in _grid_runs(module, "bimodal_seeds"):
        del r["run"]
        seed = r.pop("seed")
        grid.setdefault(tuple(r.items()), set()).add(seed)
    assert set(grid) == bimodal and len(bimodal) == 6
    assert all(seeds == set("56789") for seeds in grid.values())
    fisher = next(c for c in claims.from_module(module) if c.name == "init_trains_more_often")
    defaults = report.config_defaults(module)
    adamw = [dict(cell) for cell in bimodal if dict(cell)["opt"] == "adamw"]
    assert len(adamw) == 5 and all(any(claims._matches(r, getattr(fisher, c), defaults) for c in "ab")
                                   for r in adamw)


def test_the_forest_plot_draws_each_tested_row(tmp_path, capsys):
    path = _write_csv(tmp_path, _table())
    config = tmp_path / "c.py"
    config.write_text("CLAIMS = {'s': dict(a={'opt': 'soap'}, b={'opt': 'adamw'}, per=('depth',),\n"
                      "                    trained_below=1.0)}\n")
    png = tmp_path / "forest.png"
    assert report.main([path, f"--claims={config}", f"--plot={png}"]) == 0
    from PIL import Image

    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[1] > 100
    with pytest.raises(ValueError, match="no claim row has two cells"):
        claims.plot([r for r in claims.judge([SOAP_BEATS_ADAMW], _table(), num_classes=10) if "gap" not in r],
                    str(tmp_path / "x.png"))


def _sweep_root(root, base: str, grid: dict[str, list[str]], value) -> None:
    """Run folders as `sweep --config=configs/quickstart.py:BASE --grid=GRID` names them, each with
    its sweep_run.json and final metrics from `value(args)` (test accuracy, train loss), untrained."""
    for combo in itertools.product(*([(k, v) for v in vs] for k, vs in grid.items())):
        name = ",".join(f"{k}={v}" for k, v in combo)
        folder = root / name
        folder.mkdir(parents=True)
        spec = f"configs/quickstart.py:{','.join(filter(None, (base, name)))}"
        (folder / "sweep_run.json").write_text(json.dumps({"config": spec, "overrides": []}))
        accuracy, loss = value(dict(combo))
        (folder / "final_metrics.json").write_text(json.dumps({"test_accuracy": accuracy, "train_loss": loss,
                                                               "step": 10}))


def test_report_claims_judges_a_users_sweep_by_its_recorded_args_and_the_config_defaults(tmp_path, capsys):
    """`sweep --config=configs/quickstart.py:epochs=1,depth=8 --grid='opt=adamw,soap seed=0,1,2'`:
    the folders carry opt and seed only; skip_sab, skip_ffn and init come from the config's
    defaults, depth from the sweep record, so SOAP > AdamW with the skipless init is judged."""
    root = tmp_path / "root"
    rng = np.random.default_rng(0)
    _sweep_root(root, "epochs=1,depth=8", {"opt": ["adamw", "soap"], "seed": ["0", "1", "2"]},
                lambda a: ((0.95 if a["opt"] == "soap" else 0.80) + rng.normal(0, 0.01), 0.01))
    recorded = report.record_args(str(root / "opt=soap,seed=1"))
    assert recorded == {"epochs": "1", "depth": "8", "opt": "soap", "seed": "1"}
    assert report.main([str(root), f"--claims={QUICKSTART}", "--format=csv"]) == 0
    captured = capsys.readouterr()
    out = list(csv.DictReader(io.StringIO(captured.out)))
    assert [(r["claim"], r["setting"], r["n_a"], r["n_b"]) for r in out] == [
        ("init_beats_default_adamw", "depth=8", "3", "0"), ("init_soap_matches_skips", "depth=8", "3", "0"),
        ("soap_beats_adamw_init", "depth=8", "3", "3"), ("init_trains_more_often", "depth=8", "3", "0")]
    judged = out[2]
    assert judged["verdict"] == "holds" and float(judged["p_holm"]) == pytest.approx(0.05)  # 1 of 20 splits
    assert report.main([str(root), f"--claims={QUICKSTART}", "--format=csv", "--metrics=test_accuracy,train_loss"]) == 0
    assert capsys.readouterr().out == captured.out  # --metrics keeps the recorded args
    err = captured.err
    assert "report: `init_beats_default_adamw`: cell B matches no run: init=default matches none of the 6 runs." in err
    assert "`soap_beats_adamw_default`: cell A matches no run: init=default matches none" in err
    assert ("`sab_skip_matters_more`: cell A matches no run: skip_sab=True, init=default match none of the 6 runs."
            in err)
    assert report.main([str(root), f"--claims={QUICKSTART}"]) == 0
    md = capsys.readouterr().out
    legend = [line for line in md.splitlines() if line.startswith("- `")]
    judged_claims = {line.split("`")[1] for line in legend if " A = " in line}
    assert judged_claims == {"init_beats_default_adamw", "init_soap_matches_skips", "soap_beats_adamw_init",
                             "init_trains_more_often"}
    # claims with no row get no footnote, only the line that says which filter matched nothing
    assert not any(line.startswith("- `soap_beats_adamw_default`: Cutting") for line in legend)


def test_trained_more_often_is_fishers_exact_test_on_the_trained_counts():
    table = []
    for depth, k_soap, k_adamw in ((8, 5, 0), (12, 4, 1)):
        for seed in range(5):
            table.append(_run("soap", depth, seed, 0.9, loss=0.01 if seed < k_soap else 2.3))
            table.append(_run("adamw", depth, seed, 0.9, loss=0.01 if seed < k_adamw else 2.3))
    table[-1] = _run("adamw", 12, 4, None)  # a run without final metrics: not trained
    claim = claims.Claim("trains_more", a={"opt": "soap"}, b={"opt": "adamw"}, per=("depth",), kind="trained")
    rows = claims.judge([claim], table, num_classes=10, natural_key=report.natural_key)
    assert [(r["trained_a"], r["trained_b"]) for r in rows] == [("5/5", "0/5"), ("4/5", "1/5")]
    fisher = [ss.fisher_exact([[5, 0], [0, 5]], alternative="greater").pvalue,
              ss.fisher_exact([[4, 1], [1, 4]], alternative="greater").pvalue]
    assert [r["p_fisher"] for r in rows] == pytest.approx(fisher, abs=1e-12)
    assert [r["p_holm"] for r in rows] == pytest.approx(stats.holm(fisher))
    assert [r["verdict"] for r in rows] == ["holds", "not shown"]  # 2/252 ≤ 0.05; 4 of 5 against 1 of 5: p 0.10
    assert rows[0]["mean_a"] == 1.0 and rows[1]["gap"] == pytest.approx(0.6)
    reverse = claims.judge([dataclasses.replace(claim, a=claim.b, b=claim.a)], table, num_classes=10,
                           natural_key=report.natural_key)
    assert [r["verdict"] for r in reverse] == ["reversed", "not shown"]
    md = claims.markdown(rows, [claim], 0.05, None)
    assert "| p_fisher |" in md and "runs trained (k/n), Fisher's exact test, H1 A > B" in md
    assert "- 0 runs without final metrics left out.\n- 1 run(s) without final metrics counted as not trained " \
           "in the trained-count tests: `opt=adamw,depth=12,seed=4`." in md


def _lr_config(tmp_path) -> str:
    config = tmp_path / "lr.py"
    config.write_text(
        "import ml_collections\n"
        "from skipless_jax import config_args\n"
        "CLAIMS = {'best_lr': dict(a={'init': 'skipless', 'val': 'True'}, b={'init': 'default', 'val': 'True'},\n"
        "                          per=('depth',), select='lr', select_field='optimizer.lr', trained_below=1.0)}\n"
        "def get_config(arg=None):\n"
        "    a = config_args.parse(arg, init='skipless', depth=8, lr=None, val=False, seed=0)\n"
        "    lr = config_args.optional_number(a, 'lr')\n"
        "    return ml_collections.ConfigDict(dict(optimizer=dict(lr=1e-3 if lr is None else lr)))\n")
    return str(config)


def test_each_cell_chooses_its_lr_on_validation_and_is_judged_on_test(tmp_path, capsys):
    """Cell A is best on validation at the recipe's lr (unset: 1e-3 from the config), B at 3e-4,
    the end of its grid; on test B would be best at 2e-3, which validation does not choose."""
    rng = np.random.default_rng(2)
    means = {("skipless", "3e-4"): (0.80, 0.80), ("skipless", ""): (0.90, 0.88), ("skipless", "2e-3"): (0.85, 0.86),
             ("default", "3e-4"): (0.79, 0.76), ("default", ""): (0.70, 0.70), ("default", "2e-3"): (0.10, 0.90)}
    table = []
    for (init, lr), (val, test) in means.items():
        for seed in range(5):
            run = ",".join(filter(None, (f"init={init}", f"lr={lr}" if lr else "", "val=True", f"seed={seed}")))
            table.append({"run": run, **report.run_args(run), "val_accuracy": val + rng.normal(0, 0.005),
                          "test_accuracy": test + rng.normal(0, 0.005), "train_loss": 0.01})
    path = _write_csv(tmp_path, table)
    assert report.main([path, f"--claims={_lr_config(tmp_path)}", "--format=csv"]) == 0
    row = next(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert (float(row["chosen_a"]), row["interior_a"], float(row["chosen_b"]), row["interior_b"]) == \
           (1e-3, "True", 3e-4, "False")
    a = [r["test_accuracy"] for r in table if r["init"] == "skipless" and "lr" not in r]
    b = [r["test_accuracy"] for r in table if r["init"] == "default" and r.get("lr") == "3e-4"]
    c = stats.compare(a, b)
    assert (float(row["p_welch"]), float(row["p_permutation"]), int(row["n_a"])) == (c.p_welch, c.p_permutation, 5)
    assert report.main([path, f"--claims={_lr_config(tmp_path)}"]) == 0
    md = capsys.readouterr().out
    assert "| A lr=0.001; B lr=0.0003, not interior |" in md
    assert "each cell's lr chosen by the largest mean val_accuracy" in md
    two = [r for r in table if r.get("lr") != "2e-3"]  # a grid of 2 values has no interior
    rows = claims.judge(claims.from_module(sweep.load_config_module(_lr_config(tmp_path))), two,
                        defaults={"lr": "1e-3"})
    assert (rows[0]["chosen_a"], rows[0]["interior_a"]) == (1e-3, False)
    with pytest.raises(ValueError, match=r"claim 'best_lr': run 'init=skipless,val=True,seed=0' has lr='None', "
                                         "not a number"):
        claims.judge(claims.from_module(sweep.load_config_module(_lr_config(tmp_path))), two, defaults={"lr": "None"})


@pytest.mark.parametrize("spec,message", [
    (dict(kind="rate"), "kind='rate'; allowed: mean, trained, steps"),
    (dict(metric="val_kurtosis_layer_*"), "a metric pattern .* takes reduce= max | min"),
    (dict(reduce="max"), "metric='test_accuracy' with reduce='max'"),
    (dict(kind="steps"), "kind='steps' needs target_step > 0"),
    (dict(kind="steps", target_step=4, reach="under"), "reach='under'"),
    (dict(kind="steps", target_step=4, minus="x"), "kind='steps' reads one metric's curve"),
    (dict(target_step=4), "target_step=4 is for kind='steps'"),
    (dict(kind="trained", margin=0.01), "kind='trained' .* takes no margin or select"),
    (dict(select="depth", per=("depth",)), "select='depth' is also in per"),
])
def test_bad_new_fields_are_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        claims.Claim("bad", a={"opt": "soap"}, b={"opt": "adamw"}, **spec)
    assert "\n" not in str(err.value)


def test_an_empty_filter_matches_runs_that_do_not_give_the_arg_whatever_its_default():
    table = [dict(_run("adamw", 8, s, 0.9), model="convmixer", run=f"model=convmixer,opt=adamw,seed={s}")
             for s in range(2)] + [_run("adamw", 8, s, 0.8) for s in range(2)]
    claim = claims.Claim("c", a={"model": "convmixer"}, b={"model": ""}, trained_below=1.0)
    row = claims.judge([claim], table, defaults={"model": "vit"})[0]
    assert (row["n_a"], row["n_b"], row["mean_b"]) == (2, 2, pytest.approx(0.8))
    vit = claims.Claim("v", a={"model": "vit"}, b={"model": "convmixer"}, trained_below=1.0)
    assert claims.judge([vit], table, defaults={"model": "vit"})[0]["n_a"] == 2  # the default fills in


def _lm_run(arm: str, seed: int, curve: list[float], **final) -> dict:
    """An LM run whose val_bits_per_byte was recorded at steps 100, 200, ... (`curve`)."""
    row = {"run": f"arm={arm},seed={seed}", "arm": arm, "seed": str(seed), "train_loss": 1.0, **final}
    row.update({f"val_bits_per_byte@{100 * (i + 1)}": v for i, v in enumerate(curve)})
    return row


def test_derived_values_are_a_difference_or_a_reduction_of_the_runs_final_metrics():
    rng = np.random.default_rng(1)
    table = []
    for arm, gap, kurt in (("skips", 0.30, 9.0), ("none", 0.05, 1.0)):
        for seed in range(4):
            layers = {f"val_kurtosis_layer_{i}": float(kurt * rng.uniform(0.2, 1.0)) for i in range(6)}
            base = 2.0 + rng.normal(0, 0.02)
            table.append(_lm_run(arm, seed, [], val_bits_per_byte=base, val_int4_bits_per_byte=base + gap
                                 + rng.normal(0, 0.01), **layers))
    loss = claims.Claim("int4", a={"arm": "skips"}, b={"arm": "none"}, metric="val_int4_bits_per_byte",
                        minus="val_bits_per_byte", trained_below=2.0)
    kurtosis = claims.Claim("kurt", a={"arm": "skips"}, b={"arm": "none"}, metric="val_kurtosis_layer_*",
                            reduce="max", trained_below=2.0)
    for claim, expected in (
        (loss, {a: [r["val_int4_bits_per_byte"] - r["val_bits_per_byte"] for r in table if r["arm"] == a]
                for a in ("skips", "none")}),
        (kurtosis, {a: [max(v for k, v in r.items() if k.startswith("val_kurtosis_layer_")) for r in table
                        if r["arm"] == a] for a in ("skips", "none")}),
    ):
        (row,) = claims.judge([claim], table)
        assert row["_values_a"] == expected["skips"] and row["_values_b"] == expected["none"]
        assert row["verdict"] == "holds"
    short = [dict(r) for r in table]
    del short[0]["val_int4_bits_per_byte"]
    (row,) = claims.judge([loss], short)
    assert row["n_a"] == 3 and row["failed_runs"] == "arm=skips,seed=0"


def test_steps_to_target_is_the_first_crossing_of_cell_as_mean_at_the_target_step():
    baseline = [[3.0, 2.6, 2.4, 2.3, 2.2, 2.1], [3.1, 2.7, 2.5, 2.3, 2.2, 2.1], [3.0, 2.5, 2.45, 2.3, 2.2, 2.0]]
    slow = [[3.5, 3.2, 3.0, 2.8, 2.6, 2.5], [3.4, 3.1, 2.9, 2.7, 2.55, 2.4], [3.6, 3.3, 3.1, 3.0, 2.9, 2.8]]
    table = [_lm_run("skips", s, c) for s, c in enumerate(baseline)]
    table += [_lm_run("none", s, c) for s, c in enumerate(slow)]
    claim = claims.Claim("steps", a={"arm": "skips"}, b={"arm": "none"}, kind="steps", metric="val_bits_per_byte",
                         target_step=200, margin=math.log2(3), trained_below=2.0)
    (row,) = claims.judge([claim], table)
    target = np.mean([c[1] for c in baseline], dtype=np.float64)  # 2.6
    assert row["target"] == pytest.approx(target, abs=1e-12)

    def first(c):  # an independent restatement: steps 100, 200, ...; never reached: 2 × the last step
        hits = [100 * (i + 1) for i, v in enumerate(c) if v <= target]
        return math.log2(hits[0] if hits else 2 * 100 * len(c))

    assert row["_values_a"] == [first(c) for c in baseline] == [math.log2(s) for s in (200, 300, 200)]
    assert row["_values_b"] == [first(c) for c in slow] == [math.log2(s) for s in (500, 500, 1200)]
    assert row["gap"] == pytest.approx(np.mean(row["_values_a"]) - np.mean(row["_values_b"]))
    assert row["verdict"] == "not shown"  # 3× the steps is not shown: one run never reaches the target
    md = claims.markdown([row], [claim], 0.05, None)
    assert "log2 of the steps until val_bits_per_byte is below the target, A's mean at step 200 (all 2.6;" in md


def test_report_history_keeps_the_curves_a_committed_csv_needs(tmp_path, capsys):
    for arm, start in (("skips", 2.0), ("none", 3.0)):
        for seed in range(2):
            folder = tmp_path / "root" / f"arm={arm},seed={seed}"
            folder.mkdir(parents=True)
            (folder / "final_metrics.json").write_text(json.dumps({"val_bits_per_byte": start - 0.5, "train_loss": 1}))
            (folder / "history.jsonl").write_text("".join(
                json.dumps({"step": step, "train_loss": 1.0}) + "\n" + json.dumps(
                    {"step": step, "val_bits_per_byte": start - step / 1000 - seed / 100}) + "\n"
                for step in (100, 200, 300)))
    assert report.main([str(tmp_path / "root"), "--format=csv", "--history=val_bits_per_byte"]) == 0
    out = capsys.readouterr().out
    (tmp_path / "runs.csv").write_text(out)
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(out))}
    assert float(rows["arm=skips,seed=1"]["val_bits_per_byte@200"]) == pytest.approx(2.0 - 0.2 - 0.01)
    assert "train_loss@100" not in rows["arm=skips,seed=1"]
    config = tmp_path / "config.py"
    config.write_text(
        "import math, ml_collections\n"
        "CLAIMS = {'steps': dict(a={'arm': 'skips'}, b={'arm': 'none'}, kind='steps', metric='val_bits_per_byte',"
        " target_step=100, margin=math.log2(5), trained_below=2.0)}\n"
        "def get_config(arg=None):\n"
        "    c = ml_collections.ConfigDict(); c.dataset = ml_collections.ConfigDict(dict(name='stdlib')); return c\n")
    outputs = []
    for src in (str(tmp_path / "root"), str(tmp_path / "runs.csv")):  # the folders' curves, or the CSV's
        assert report.main([src, f"--claims={config}", "--format=csv"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "steps" in outputs[0]

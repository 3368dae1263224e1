"""Claims as code (skipless_jax/claims.py) and `report --claims`: the rows, the Holm family, the
verdicts, runs that did not train or failed, and the quickstart's claims against its grids."""

from __future__ import annotations

import csv
import io
import json
import math
import os

import numpy as np
import pytest

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


def test_the_holm_family_is_the_rows_printed_together():
    table = _table()
    alone = claims.judge([SOAP_BEATS_ADAMW], [r for r in table if r["depth"] == "8"], num_classes=10)
    together = claims.judge([SOAP_BEATS_ADAMW], table, num_classes=10)
    assert alone[0]["p_holm"] == max(alone[0]["p_welch"], alone[0]["p_permutation"])  # a family of one
    assert together[0]["p_holm"] >= alone[0]["p_holm"]


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
    assert md.count("| soap_beats_adamw |") == 4 and "Holm over the 6 tested rows" in md
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
    assert "| init_beats_default_adamw |" not in capsys.readouterr().out  # no run matches its cells
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
    names = set()
    for grid in ("table1", "skip_ablation", "depth"):
        names |= {r.name for r in sweep.expand(QUICKSTART, grid, module)}
    runs = [report.run_args(n) for n in names]
    qs = claims.from_module(module, path=QUICKSTART)
    assert [c.name for c in qs] == ["init_beats_default_adamw", "init_soap_matches_skips", "soap_beats_adamw_init",
                                   "soap_beats_adamw_default", "sab_skip_matters_more"]
    for c in qs:
        for cell in (c.a, c.b):
            matching = [r for r in runs if all(r.get(k) == v for k, v in cell.items())]
            assert len(matching) >= 5, (c.name, cell)
    assert next(c for c in qs if c.name == "init_soap_matches_skips").margin == 0.01


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

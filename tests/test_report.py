"""python -m skipless_jax.report: rows equal to the runs' files, means and sample stds against
numpy, one-line errors, and the curves of history.jsonl."""

from __future__ import annotations

import csv
import io
import json
import os

import numpy as np
import pytest

from skipless_jax import report


def make_runs(root: str) -> dict[str, dict]:
    """Runs named like the sweep's, with random final metrics and a history each."""
    rng = np.random.default_rng(0)
    finals = {}
    for opt in ("adamw", "soap"):
        for seed in range(3):
            run = os.path.join("depth=8", f"opt={opt},seed={seed}")
            os.makedirs(os.path.join(root, run))
            final = {"test_accuracy": float(rng.uniform()), "train_loss": float(rng.uniform()), "step": 10}
            with open(os.path.join(root, run, "final_metrics.json"), "w") as f:
                json.dump(final, f)
            with open(os.path.join(root, run, "history.jsonl"), "w") as f:
                for step in (5, 10):
                    f.write(json.dumps({"step": step, "train_loss": float(rng.uniform(0.1, 1))}) + "\n")
            finals[run] = final
    os.makedirs(os.path.join(root, "unfinished=1"))  # no final metrics: not a run
    return finals


def test_rows_equal_the_files(tmp_path, capsys):
    finals = make_runs(str(tmp_path))
    assert report.main([str(tmp_path), "--format=csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["run"] for r in table] == sorted(finals)
    for r in table:
        opt, seed = r["run"].split("/")[1].replace("opt=", "").split(",seed=")
        assert (r["depth"], r["opt"], r["seed"]) == ("8", opt, seed)
        assert {k: float(r[k]) for k in finals[r["run"]]} == finals[r["run"]]  # csv floats are exact


def test_mean_over_seed_against_numpy(tmp_path, capsys):
    finals = make_runs(str(tmp_path))
    assert report.main([str(tmp_path), "--format=csv", "--mean_over=seed", "--metrics=test_accuracy"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert list(table[0]) == ["depth", "opt", "test_accuracy_mean", "test_accuracy_std", "test_accuracy_n", "runs"]
    for r in table:
        acc = np.array([v["test_accuracy"] for k, v in finals.items() if f"opt={r['opt']}," in k], np.float64)
        assert int(r["test_accuracy_n"]) == int(r["runs"]) == 3
        np.testing.assert_allclose(float(r["test_accuracy_mean"]), acc.mean(), rtol=1e-15)
        np.testing.assert_allclose(float(r["test_accuracy_std"]), acc.std(ddof=1), rtol=1e-14)
    one = report.mean_over([{"run": "seed=0", "seed": "0", "x": 1.0}], "seed", ["seed"])
    assert one[0]["x_n"] == one[0]["runs"] == 1 and one[0]["x_mean"] == 1.0 and np.isnan(one[0]["x_std"])


def test_mean_over_counts_each_metrics_values_and_failed_runs(tmp_path, capsys):
    """`<m>_n` counts the runs that have m; a run the sweep started without final metrics (failed,
    stopped non-finite) stays in `runs` and in the per-run table, with its status."""
    finals = make_runs(str(tmp_path))
    del finals["depth=8/opt=soap,seed=1"]["test_accuracy"]
    with open(tmp_path / "depth=8/opt=soap,seed=1/final_metrics.json", "w") as f:
        json.dump(finals["depth=8/opt=soap,seed=1"], f)
    os.remove(tmp_path / "depth=8/opt=soap,seed=2/final_metrics.json")
    (tmp_path / "depth=8/opt=soap,seed=2/sweep_run.json").write_text("{}")
    assert report.main([str(tmp_path), "--format=csv", "--mean_over=seed"]) == 0
    soap = [r for r in csv.DictReader(io.StringIO(capsys.readouterr().out)) if r["opt"] == "soap"][0]
    assert (soap["test_accuracy_n"], soap["train_loss_n"], soap["runs"]) == ("1", "2", "3")
    assert report.main([str(tmp_path), "--format=csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    failed = [r for r in table if r["status"]]
    assert [(r["run"], r["status"]) for r in failed] == [("depth=8/opt=soap,seed=2", "no final metrics")]


def test_a_csv_is_read_back_as_the_runs(tmp_path, capsys):
    """report of the CSV it wrote gives the same tables as report of the folders."""
    make_runs(str(tmp_path / "root"))
    assert report.main([str(tmp_path / "root"), "--format=csv"]) == 0
    (tmp_path / "runs.csv").write_text(capsys.readouterr().out)
    for extra in ([], ["--mean_over=seed"], ["--mean_over=seed", "--metrics=train_loss"]):
        assert report.main([str(tmp_path / "root"), "--format=csv", *extra]) == 0
        from_folders = capsys.readouterr().out
        assert report.main([str(tmp_path / "runs.csv"), "--format=csv", *extra]) == 0
        assert capsys.readouterr().out == from_folders


def test_markdown_and_errors(tmp_path, capsys):
    make_runs(str(tmp_path))
    assert report.main([str(tmp_path), "--mean_over=seed", "--metrics=test_accuracy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| depth | opt | test_accuracy_mean | test_accuracy_std | test_accuracy_n | runs |"
    assert len(lines) == 4
    for argv, message in [
        ([str(tmp_path), "--mean_over=lr"], "--mean_over=lr: run 'depth=8/opt=adamw,seed=0' has no arg lr"),
        ([str(tmp_path / "missing")], "is not a directory"),
        ([str(tmp_path), "--grid=table1"], "--grid=NAME and --config=PATH go together"),
        ([str(tmp_path / "unfinished=1")], "no run (a folder with final_metrics.json)"),
    ]:
        assert report.main(argv) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report.main([str(tmp_path), "--format=tsv"])
    assert "--format='tsv' is unknown; allowed: md, csv" in capsys.readouterr().err


def test_plot_draws_every_history(tmp_path, capsys):
    make_runs(str(tmp_path / "runs"))
    png = str(tmp_path / "curves.png")
    assert report.main([str(tmp_path / "runs"), "--mean_over=seed", f"--plot={png}"]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert report.main([str(tmp_path / "runs"), f"--plot={png}", "--plot_metric=nope"]) == 2
    assert "no run's history.jsonl has 'nope'" in capsys.readouterr().err


def test_rows_are_in_natural_order(tmp_path, capsys):
    for depth in (24, 8, 12):
        os.makedirs(tmp_path / f"depth={depth}")
        (tmp_path / f"depth={depth}" / "final_metrics.json").write_text(json.dumps({"test_accuracy": depth / 100}))
    assert report.main([str(tmp_path), "--format=csv"]) == 0
    assert [r["depth"] for r in csv.DictReader(io.StringIO(capsys.readouterr().out))] == ["8", "12", "24"]
    assert sorted(["a=10.5", "a=9", "a=10", "b"], key=report.natural_key) == ["a=9", "a=10", "a=10.5", "b"]


def test_final_metric_against_an_arg_is_the_group_means_and_stds(tmp_path, capsys):
    rng = np.random.default_rng(1)
    finals = {}
    for opt in ("adamw", "soap"):
        for depth in (8, 12, 24):
            for seed in range(3 if depth != 24 else 1):
                run = f"opt={opt},depth={depth},seed={seed}"
                os.makedirs(tmp_path / "runs" / run)
                finals[run] = float(rng.uniform())
                (tmp_path / "runs" / run / "final_metrics.json").write_text(json.dumps({"test_accuracy": finals[run]}))
    table, _ = report.rows([str(tmp_path / "runs")])
    drawn = report.plot_final(table, str(tmp_path / "a.png"), "test_accuracy", "depth", ["opt", "depth"])
    assert sorted(drawn) == ["opt=adamw", "opt=soap"]
    for label, (xs, means, stds) in drawn.items():
        assert xs == [8.0, 12.0, 24.0]
        for depth, mean, std in zip(xs, means, stds):
            ys = np.array([v for k, v in finals.items() if k.startswith(f"{label},depth={int(depth)},")])
            np.testing.assert_allclose(mean, ys.mean(), rtol=1e-14)
            np.testing.assert_allclose(std, ys.std(ddof=1) if len(ys) > 1 else 0.0, rtol=1e-13, atol=1e-15)
    png = str(tmp_path / "depth.png")
    args = [str(tmp_path / "runs"), "--mean_over=seed", f"--plot={png}", "--plot_metric=test_accuracy"]
    assert report.main([*args, "--plot_x=depth"]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert report.main([*args, "--plot_x=width"]) == 2
    assert capsys.readouterr().err == "error: --plot_x=width is not an arg of the runs; allowed: opt, depth, seed\n"
    assert report.main([str(tmp_path / "runs"), "--plot_x=depth"]) == 2
    assert capsys.readouterr().err == "error: --plot_x=depth needs --plot=FILE.png\n"
    assert report.main([*args, "--plot_x=opt"]) == 2
    assert "--plot_x=opt: run 'opt=adamw,depth=8,seed=0' has no numeric arg opt" in capsys.readouterr().err

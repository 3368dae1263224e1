"""The tables of docs/results/*.md made by `report` equal what their commands print now, from the
per-run CSVs committed under docs/figures/: a verdict in the docs is recomputed from data."""

from __future__ import annotations

import os

import pytest

from skipless_jax import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")  # one page per study


def _blocks():
    blocks = []
    for name in sorted(os.listdir(RESULTS)):
        with open(os.path.join(RESULTS, name)) as f:
            blocks += report.doc_blocks(f.read())
    return blocks


def test_the_verdict_tables_are_there():
    claims = [args for args, _ in _blocks() if any(a.startswith("--claims=") for a in args)]
    assert len(claims) >= 3  # Table 1, the depth study, the skip ablation
    for args, _ in _blocks():  # every table is computed from committed files, never from /tmp
        sources = [a for a in args if not a.startswith("--")]
        assert sources and all(s.startswith("docs/figures/") and s.endswith(".csv") for s in sources), args


@pytest.mark.parametrize("args,body", _blocks(), ids=lambda x: " ".join(x)[:80] if isinstance(x, list) else "")
def test_each_table_equals_its_command(args, body, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert report.render(args) == body


def test_a_block_is_rewritten_from_its_command(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    csv_path = tmp_path / "runs.csv"
    csv_path.write_text("run,seed,test_accuracy\nseed=0,0,0.5\nseed=1,1,0.7\n")
    doc = tmp_path / "doc.md"
    doc.write_text(f"text\n<!-- report: {csv_path} --mean_over=seed -->\nstale\n<!-- /report -->\nmore\n")
    assert report.refresh(str(doc)) == (1, 1)
    text = doc.read_text()
    assert "stale" not in text and "| 0.6 | 0.1414 | 2 | 2 |" in text and text.endswith("<!-- /report -->\nmore\n")
    assert report.render([str(csv_path), "--mean_over=seed"]) in text


def test_refresh_counts_the_tables_that_changed(tmp_path, monkeypatch, capsys):
    """Nothing changed: '0 of 2', and the file is not written; one stale block: '1 of 2'."""
    monkeypatch.chdir(ROOT)
    csv_path = tmp_path / "runs.csv"
    csv_path.write_text("run,seed,test_accuracy\nseed=0,0,0.5\nseed=1,1,0.7\n")
    block = f"<!-- report: {csv_path} --mean_over=seed -->\n"
    body = report.render([str(csv_path), "--mean_over=seed"])
    doc = tmp_path / "doc.md"
    doc.write_text(f"{block}{body}<!-- /report -->\n{block}{body}<!-- /report -->\n")
    os.utime(doc, (0, 0))
    assert report.main([f"--refresh={doc}"]) == 0
    assert capsys.readouterr().out == f"report: 0 of 2 table(s) of {doc} changed (each rewritten from its command)\n"
    assert os.stat(doc).st_mtime == 0  # not written
    doc.write_text(f"{block}stale\n<!-- /report -->\n{block}{body}<!-- /report -->\n")
    assert report.refresh(str(doc)) == (1, 2)
    assert doc.read_text().count(body) == 2


def test_refresh_of_a_folder_rewrites_each_page(tmp_path, monkeypatch, capsys):
    """`--refresh=DIR`: every .md file of the folder, one line each, in name order."""
    monkeypatch.chdir(ROOT)
    csv_path = tmp_path / "runs.csv"
    csv_path.write_text("run,seed,test_accuracy\nseed=0,0,0.5\nseed=1,1,0.7\n")
    pages = tmp_path / "pages"
    pages.mkdir()
    for name in ("b.md", "a.md"):
        (pages / name).write_text(f"<!-- report: {csv_path} --mean_over=seed -->\nstale\n<!-- /report -->\n")
    (pages / "notes.txt").write_text("stale")
    assert report.main([f"--refresh={pages}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" of ")[2].split(" changed")[0] for line in out] == [str(pages / "a.md"), str(pages / "b.md")]
    assert all(line.startswith("report: 1 of 1 table(s)") for line in out)
    assert "stale" not in (pages / "a.md").read_text() and (pages / "notes.txt").read_text() == "stale"

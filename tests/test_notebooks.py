"""The notebooks in examples/ run top to bottom on the embedded digits (CPU, tiny configs) with
nbclient and an ipykernel (requirements-test.txt pins both); each checks its own numbers in
`assert` cells and shows its pictures (each cell that shows one has it in its outputs). The test
runs them with SKIPLESS_EXAMPLES_QUICK=1 (a few training steps each, every cell as written) on one
CPU device, as a user's kernel has."""

import os

import pytest

from tests.subprocess_runs import XLA_TEST_FLAGS
from tests.util import ROOT

NOTEBOOKS = ("signal_propagation", "dino_features", "mae_reconstructions")


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, monkeypatch):
    why = "needs the notebook packages of requirements-test.txt"
    nbclient = pytest.importorskip("nbclient", reason=why)
    nbformat = pytest.importorskip("nbformat", reason=why)
    pytest.importorskip("ipykernel", reason=why)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # the kernel inherits this environment
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # One device (not the pytest process's 8 fake ones), with the tests' compile-time flags.
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=1 {XLA_TEST_FLAGS}")
    monkeypatch.setenv("SKIPLESS_EXAMPLES_QUICK", "1")  # a few training steps (the notebooks' QUICK)
    monkeypatch.setenv("SKIPLESS_EXAMPLES_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(os.path.join(ROOT, "examples", f"{name}.ipynb"), as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": os.path.join(ROOT, "examples")}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook shows no picture"
    # Each cell that shows a figure (pyplot's, or a PNG the library wrote) has it in its outputs:
    # no library switches the notebook's inline backend off.
    for i, cell in enumerate(nb.cells):
        shows = cell.source.count("plt.show()") + cell.source.count("display(Image(")
        if cell.cell_type == "code" and shows:
            pngs = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
            assert pngs, f"cell {i} of {name} shows a figure that is not in its outputs:\n{cell.source[:300]}"

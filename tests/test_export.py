"""`python -m skipless_jax.export` (skipless_jax/export.py): the exported evaluation forward of a
tiny trained run, loaded in a process that never imports skipless_jax, classifies the exported
eval examples exactly as the run's final evaluation did, at any batch size; one-line errors.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from skipless_jax import export
from skipless_jax.trainers import supervised
from tests.util import tiny_config

# jax alone: the artifact's loader, as a server without this package would write it.
_LOADER = """
import json, sys
import jax, numpy as np
assert "skipless_jax" not in sys.modules
folder, sizes = sys.argv[1], json.loads(sys.argv[2])
exported = jax.export.deserialize(bytearray(open(folder + "/model.jax", "rb").read()))
examples = np.load(folder + "/examples.npz")
images, labels = examples["images"], examples["labels"]
out = {}
for size in sizes:  # batches of `size` (the last one shorter): the batch axis is symbolic
    logits = np.concatenate([np.asarray(exported.call(images[i:i + size])) for i in range(0, len(images), size)])
    out[str(size)] = {"correct": int((logits.argmax(-1) == labels).sum()), "shape": list(logits.shape)}
out["skipless_jax_imported"] = "skipless_jax" in sys.modules
print(json.dumps(out))
"""


def open_text(*path: str) -> str:
    with open(os.path.join(*path)) as f:
        return f.read()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The quickstart shrunk, 60 steps, with a model EMA and remat (the export drops remat)."""
    workdir = str(tmp_path_factory.mktemp("export_run"))
    config = tiny_config(total_steps=60)
    config.model_ema.decay = 0.9
    config.model.remat = "full"
    metrics = supervised.train_and_evaluate(config, workdir, devices=jax.devices()[:1])  # its checkpoint as on 8
    return workdir, metrics


def _served(folder, tmp_path, sizes="[360]"):
    """The loader's result on DIR/export (a process with jax alone)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    result = subprocess.run([sys.executable, "-c", _LOADER, folder, sizes], env=environ, cwd=str(tmp_path),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_exported_model_reproduces_the_final_test_accuracy_without_skipless_jax(trained, tmp_path):
    workdir, metrics = trained
    meta = export.export(workdir, "all")
    folder = os.path.join(workdir, "export")
    saved = json.loads(open_text(folder, "model.json"))
    assert saved["image_size"] == 8 and saved["channels"] == 1 and saved["mean"] == [0.5] and saved["std"] == [0.5]
    assert saved["num_classes"] == 10 and saved["output"] == "logits" and saved["step"] == 60
    assert saved["config"]["model"]["depth"] == 1 and meta["examples"] == 360
    with np.load(os.path.join(folder, "examples.npz")) as f:
        assert f["images"].dtype == np.uint8 and f["images"].shape == (360, 8, 8, 1)
        assert sorted(np.unique(f["labels"])) == list(range(10))
    out = _served(folder, tmp_path, "[360, 7]")
    assert not out["skipless_jax_imported"]
    final = json.loads(open_text(workdir, "final_metrics.json"))["test_accuracy"]
    assert 0.2 < final < 1.0  # the run learned something, not every class right
    for size in ("360", "7"):
        assert out[size]["shape"] == [360, 10]
        assert out[size]["correct"] == round(final * 360), (out, final)


@pytest.mark.slow
def test_a_number_of_examples_takes_the_first_ones(trained):
    workdir, _ = trained
    images, labels = export.eval_examples(workdir, 5)
    all_images, all_labels = export.eval_examples(workdir, -1)
    np.testing.assert_array_equal(images, all_images[:5])
    np.testing.assert_array_equal(labels, all_labels[:5])


@pytest.mark.slow
def test_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"--examples='some' must be a positive number of examples or 'all'"):
        export.parse_examples("some")
    with pytest.raises(ValueError, match=r"--examples='0' must be"):
        export.export(str(tmp_path), "0")  # checked before the workdir is read
    with pytest.raises(ValueError, match=r"has no checkpoint with a saved config"):
        export.export(str(tmp_path), "all")
    with pytest.raises(ValueError, match=r"--platforms='cpu,gpu': \['gpu'\]; allowed: cpu, cuda, rocm, tpu"):
        export.parse_platforms("cpu,gpu")
    result = subprocess.run([sys.executable, "-m", "skipless_jax.export", f"--workdir={tmp_path}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        f"error: --workdir={str(tmp_path)!r} has no checkpoint with a saved config")


@pytest.mark.slow
def test_the_model_ema_evaluates_exports_and_converts_as_the_run_logged_it(trained, tmp_path):
    from skipless_jax import analyze, checkpoint, evaluate, timm_convert

    workdir, metrics = trained
    logged = json.loads(open_text(workdir, "final_metrics.json"))
    state = checkpoint.load_raw(workdir)[1]
    head, ema_head = state["params"]["head"]["kernel"], state["ema"]["params"]["head"]["kernel"]
    assert np.abs(head - ema_head).max() > 1e-3  # two different models
    # evaluate --params=ema: the run's ema_test_accuracy, exactly, under the run's name.
    results = evaluate.evaluate(workdir, params="ema")
    assert results["ema_test_accuracy"] == logged["ema_test_accuracy"] and "test_accuracy" not in results
    assert json.loads(open_text(workdir, "evaluation_ema.json"))["ema_test_accuracy"] == logged["ema_test_accuracy"]
    # The exported EMA artifact, served by jax alone: the same count of correct test images.
    meta = export.export(workdir, "all", params="ema")
    assert json.loads(open_text(workdir, "export", "model.json"))["params"] == meta["params"] == "ema"
    out = _served(os.path.join(workdir, "export"), tmp_path)
    assert out["360"]["correct"] == round(logged["ema_test_accuracy"] * 360), (out, logged)
    # timm_convert --reverse and analyze read the same EMA weights.
    _, _, params, _ = timm_convert.read_checkpoint(workdir, "ema")
    np.testing.assert_array_equal(params["head"]["kernel"], ema_head)
    config = analyze.config_of_workdir(None, workdir)
    model, shape = analyze.build(config)
    analysed, step, source = analyze.load_params(model, config, shape, workdir, "ema")
    assert (step, source) == (60, "checkpoint (model EMA)")
    np.testing.assert_array_equal(np.asarray(analysed["head"]["kernel"]), ema_head)


def _cudnn_copy(workdir, folder):
    """The trained run's weights in a checkpoint whose saved config names cuDNN attention and
    remat (a GPU run's config), without an EMA."""
    from skipless_jax import checkpoint, timm_convert

    saved = checkpoint.saved_config(workdir)
    saved["model"].update(attention_impl="cudnn", remat="full")
    state = checkpoint.load_raw(workdir)[1]
    timm_convert.save_state(folder, {"step": state["step"], "params": state["params"]}, json.dumps(saved))
    return folder


@pytest.mark.slow
def test_a_cudnn_remat_run_exports_with_xla_attention_and_reproduces_its_accuracy(trained, tmp_path):
    workdir, _ = trained
    folder = _cudnn_copy(workdir, str(tmp_path / "gpu_run"))
    meta = export.export(folder, "all")  # cpu, cuda and tpu, on this CPU host
    assert meta["built_with"] == {"attention_impl": "xla", "remat": None,
                                  "trained_with": {"attention_impl": "cudnn", "remat": "full"}}
    assert json.loads(open_text(folder, "export", "model.json"))["built_with"] == meta["built_with"]
    out = _served(os.path.join(folder, "export"), tmp_path)
    final = json.loads(open_text(workdir, "final_metrics.json"))["test_accuracy"]
    assert out["360"]["correct"] == round(final * 360), (out, final)
    with pytest.raises(ValueError, match=r"^--params=ema: the checkpoint at .*gpu_run' keeps no model EMA .*; "
                                         r"use --params=model$"):
        export.export(folder, params="ema")
    for module in ("skipless_jax.export", "skipless_jax.evaluate"):  # the CLIs' flag: the same one line
        result = subprocess.run([sys.executable, "-m", module, f"--workdir={folder}", "--params=ema"],
                                capture_output=True, text=True, timeout=300)
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 2 and last.startswith(f"error: --params=ema: the checkpoint at {folder!r} keeps "
                                                          "no model EMA"), (module, result.stderr[-2000:])


@pytest.mark.slow
def test_bfloat16_weights_and_one_line_export_failures(trained, monkeypatch):
    import jax

    workdir, _ = trained
    f32 = export.export(workdir, "all", platforms=("cpu",))
    f32_size = os.path.getsize(os.path.join(workdir, "export", "model.jax"))
    bf16 = export.export(workdir, platforms=("cpu",), weights_dtype="bfloat16")
    assert bf16["weights_dtype"] == "bfloat16" and 2 * bf16["weights_bytes"] == f32["weights_bytes"]
    folder = os.path.join(workdir, "export")
    assert os.path.getsize(os.path.join(folder, "model.jax")) < f32_size - 0.4 * f32["weights_bytes"]
    with open(os.path.join(folder, "model.jax"), "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    with np.load(os.path.join(folder, "examples.npz")) as f:
        images, labels = f["images"], f["labels"]
    correct = int((np.asarray(exported.call(images)).argmax(-1) == labels).sum())
    final = json.loads(open_text(workdir, "final_metrics.json"))["test_accuracy"]
    assert abs(correct - round(final * 360)) <= 3, (correct, final)  # bf16 weights: near the run's accuracy
    with pytest.raises(ValueError, match=r"^--weights_dtype='float16' is unknown; allowed: float32, bfloat16$"):
        export.export(workdir, weights_dtype="float16")
    # Over the flatbuffer limit: refused before anything is lowered or written.
    monkeypatch.setattr(export, "MAX_ARTIFACT_BYTES", f32["weights_bytes"] - 1)
    os.remove(os.path.join(folder, "model.jax"))
    with pytest.raises(ValueError, match=r"^the weights take .* GB, over the .* a jax.export artifact can hold "
                                         r"\(one flatbuffer\); --weights_dtype=bfloat16 halves the weights; otherwise "
                                         r"serve the checkpoint's orbax weights .* beside the artifact"):
        export.export(workdir)
    assert not os.path.exists(os.path.join(folder, "model.jax"))
    monkeypatch.undo()

    def fails(*args, **kwargs):
        raise RuntimeError("cuDNN is not detected.\nsecond line")

    monkeypatch.setattr(jax.export, "export", fails)
    with pytest.raises(ValueError, match=r"^lowering the forward of .* for cpu failed: RuntimeError: cuDNN is not "
                                         r"detected\.$"):
        export.export(workdir, platforms=("cpu",))

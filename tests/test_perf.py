"""Runs that measure themselves: the perf/* fields of the train records (model FLOPs, XLA's cost
analysis of the compiled step, the timing window), the peak table, the profiler trace of a
default run, and the fit check."""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

from skipless_jax import evaluators
from skipless_jax.data import inputs, multicrop
from skipless_jax.trainers import devices, perf, profiler, supervised
from skipless_jax.trainers.workdir import resumed_core_hours, truncate_history

from util import load_config, tiny_config

DEVICES = 2


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny supervised run on 2 devices, with the compiled step and its cost captured."""
    workdir = str(tmp_path_factory.mktemp("perf"))
    captured = {}
    compile_for = perf.compile_for

    def capture(*args, **kwargs):
        compiled, cost = compile_for(*args, **kwargs)
        captured.update(compiled=compiled, cost=cost)
        return compiled, cost

    # Two blocks: the scanned variant of test_model_flops_... compiles one of them.
    config = tiny_config("depth=2", peak_tflops=0.5, profile_steps=None)  # the default trace (tests' configs: none)
    perf.compile_for = capture
    try:
        final = supervised.train_and_evaluate(config, workdir, devices=jax.devices()[:DEVICES])
    finally:
        perf.compile_for = compile_for
    history = [json.loads(line) for line in Path(workdir, "history.jsonl").read_text().splitlines()]
    return workdir, config, final, captured, [h for h in history if "perf/img_per_sec" in h]


@pytest.mark.slow
def test_perf_fields_agree_with_each_other_and_the_cost_analysis(tiny_run):
    _, config, final, captured, records = tiny_run
    assert [r["step"] for r in records] == [4, 8, 12] and final["step"] == 12
    cost = captured["cost"]
    analysis = captured["compiled"].cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    assert cost.flops == analysis["flops"] > 0 and cost.devices == DEVICES
    model_flops = perf.model_flops_per_example(config)[0]
    for i, r in enumerate(records):
        steps_per_sec = r["perf/img_per_sec"] / config.input.batch_size
        np.testing.assert_allclose(r["perf/img_per_sec_per_device"], r["perf/img_per_sec"] / DEVICES, rtol=1e-12)
        np.testing.assert_allclose(r["perf/tflops_per_device"], model_flops * r["perf/img_per_sec"] / DEVICES / 1e12,
                                   rtol=1e-12)
        np.testing.assert_allclose(r["perf/xla_tflops_per_device"], cost.flops * steps_per_sec / 1e12, rtol=1e-12)
        np.testing.assert_allclose(r["perf/mfu"], r["perf/tflops_per_device"] / 0.5, rtol=1e-12)
        assert r["perf/core_hours_total"] >= r["perf/core_hours"] > 0
        if i:  # a whole period in the window: its training hours are its 4 steps at its rate, × devices
            np.testing.assert_allclose(r["perf/core_hours"] - records[i - 1]["perf/core_hours"],
                                       4 * DEVICES / steps_per_sec / 3600, rtol=1e-6)


def test_default_run_leaves_a_trace(tiny_run):
    workdir = tiny_run[0]
    assert glob.glob(os.path.join(workdir, "plugins", "profile", "*", "*.xplane.pb"))


@pytest.mark.slow
def test_the_trace_starts_and_stops_with_no_save_in_flight(tmp_path, monkeypatch):
    """XLA's profiler can segfault collecting a trace while orbax's save threads copy arrays (a
    two-process run crashed so): the trainer waits for its async saves before it starts and
    before it stops the trace (after steps 2 and 2 + the traced steps), and still saves during them."""
    from skipless_jax import checkpoint

    events, managers = [], []
    make_manager, real_start, real_stop = checkpoint.manager, jax.profiler.start_trace, jax.profiler.stop_trace

    def manager(*args, **kwargs):
        mngr = make_manager(*args, **kwargs)
        save, wait, saving = mngr.save, mngr.wait_until_finished, []

        def save_step(step, *args, **kwargs):
            events.append(("save", step))
            saving.append(step)  # orbax's save waits for the previous one: not the trainer's wait
            try:
                return save(step, *args, **kwargs)
            finally:
                saving.pop()

        def wait_for_all():
            if not saving:
                events.append(("wait",))
            return wait()

        mngr.save, mngr.wait_until_finished = save_step, wait_for_all
        managers.append(mngr)
        return mngr

    def traced(name, real):
        def call(*args, **kwargs):
            events.append((name, managers[-1].is_saving_in_progress()))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(checkpoint, "manager", manager)
    monkeypatch.setattr(jax.profiler, "start_trace", traced("start", real_start))
    monkeypatch.setattr(jax.profiler, "stop_trace", traced("stop", real_stop))
    config = tiny_config(total_steps=8, checkpoint_every_steps=1, profile_steps=None)  # the default trace
    supervised.train_and_evaluate(config, str(tmp_path), devices=jax.devices()[:DEVICES])
    trace = [i for i, e in enumerate(events) if e[0] in ("start", "stop")]
    assert [events[i] for i in trace] == [("start", False), ("stop", False)], events
    saves = [i for i, e in enumerate(events) if e[0] == "save"]
    traced_saves = list(range(2, 2 + profiler.DEFAULT_PROFILE_STEPS))  # the saves during the traced steps
    assert [events[i][1] for i in saves if trace[0] < i < trace[1]] == traced_saves, events
    for i in trace:  # the last save before each is waited for in between
        last_save = max(s for s in saves if s < i)
        assert ("wait",) in events[last_save:i], events
    assert glob.glob(os.path.join(str(tmp_path), "plugins", "profile", "*", "*.xplane.pb"))


def test_meter_window_excludes_paused_time_and_the_first_steps():
    now = [100.0]
    cost = perf.StepCost(flops=2e12, argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0, devices=4)
    meter = perf.Meter(cost, 256, ml_collections.ConfigDict(dict(peak_tflops=8.0)), first_step=10,
                       core_hours=1.0, core_hours_total=2.0, flops_per_example=1e10, clock=lambda: now[0])
    for step, t in ((11, 150.0), (12, 152.0)):  # the first 2 steps (compilation, the pipeline): outside the window
        now[0] = t
        meter.step_done(step)
    assert meter.fields(12) == {"perf/core_hours": 1.0 + 4 * 52 / 3600, "perf/core_hours_total": 2.0 + 4 * 52 / 3600}
    now[0] = 157.0  # steps 13-20 trained in 5 s, then an evaluation of 5 s (nested uses count once)
    with meter.excluded(), meter.excluded():
        now[0] = 162.0
    fields = meter.fields(30, now=172.0)  # steps 13-30: 18 steps in 15 s of training
    assert fields == pytest.approx({
        "perf/img_per_sec": 18 * 256 / 15, "perf/img_per_sec_per_device": 18 * 256 / 15 / 4,
        "perf/tflops_per_device": 1e10 * 18 * 256 / 15 / 4 / 1e12, "perf/xla_tflops_per_device": 2e12 * 18 / 15 / 1e12,
        "perf/mfu": 1e10 * 18 * 256 / 15 / 4 / 1e12 / 8.0,
        "perf/core_hours": 1.0 + 4 * (72 - 5) / 3600, "perf/core_hours_total": 2.0 + 4 * 72 / 3600,
    }, rel=1e-12)
    assert "perf/mfu" not in perf.Meter(cost, 1, ml_collections.ConfigDict(), 0, flops_per_example=1.0).fields(1)


def test_meter_counts_token_graying_apart():
    config = tiny_config(**{"model.token_graying": "svd"})
    model, tg = perf.model_flops_per_example(config)
    assert model == perf.model_flops_per_example(tiny_config())[0] and tg > 0
    now = [0.0]
    cost = perf.StepCost(flops=1.0, argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0, devices=2)
    meter = perf.Meter(cost, 32, config, first_step=0, clock=lambda: now[0])
    meter.step_done(2)
    fields = meter.fields(4, now=2.0)  # 2 steps of 32 images in 2 s
    assert fields["perf/tflops_per_device"] == pytest.approx(model * 32 / 2 / 1e12, rel=1e-12)
    assert fields["perf/tg_tflops_per_device"] == pytest.approx(tg * 32 / 2 / 1e12, rel=1e-12)


class FakeDevice:
    def __init__(self, kind: str):
        self.device_kind = kind


def test_peak_table_matches_exact_device_kinds(monkeypatch):
    """The datasheets' dense bf16 peaks by the device_kind strings JAX reports."""
    kinds = {
        "NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756, "NVIDIA H100 NVL": 835, "NVIDIA H200": 989,
        "NVIDIA H200 NVL": 835, "NVIDIA A100-SXM4-80GB": 312, "NVIDIA A100-SXM4-40GB": 312,
        "NVIDIA A100 80GB PCIe": 312, "NVIDIA A100-PCIE-40GB": 312, "NVIDIA B200": 2250, "NVIDIA H800": 989,
        "NVIDIA H800 PCIe": 756,
        "NVIDIA L40S": 362, "TPU v3": 61.5, "TPU v4": 275, "TPU v5 lite": 197, "TPU v5": 459, "TPU v5p": 459,
        "TPU v6 lite": 918,
        # not listed: no MFU (a substring match gave "NVIDIA H100 80GB HBM3e" or a TPU v4 lite a peak)
        "cpu": None, "NVIDIA H100 80GB HBM3e": None, "TPU v4 lite": None, "NVIDIA GeForce RTX 4090": None,
    }
    lines = []
    monkeypatch.setattr(devices.logging, "info", lambda fmt, *args: lines.append(fmt % args))
    none = ml_collections.ConfigDict()
    assert {k: devices.peak_tflops(none, FakeDevice(k)) for k in kinds} == kinds
    unknown = [k for k, v in kinds.items() if v is None]
    assert len(lines) == len(unknown)
    for kind, line in zip(unknown, lines):
        assert repr(kind) in line and "--config.peak_tflops" in line
    assert devices.peak_tflops(ml_collections.ConfigDict(dict(peak_tflops=100.0)), FakeDevice("cpu")) == 100.0


def matmul_flops_by_hand(config: ml_collections.ConfigDict) -> float:
    """The tiny ViT's training FLOPs per image, counted here from its config and not with
    models/flops.py: 2 FLOPs per multiply-add of every matmul, the backward twice the forward.
    8×8×1 digits, 2×2 patches: n = 16 tokens (gap pool, no class token), d = 32, MLP 64, depth 2,
    10 classes. Patch embedding 2·16·4·32 = 4,096; a block's Q, K, V, O 4·2·16·32² = 131,072,
    QKᵀ and PV 2·2·16²·32 = 32,768, MLP 2·2·16·32·64 = 131,072 (294,912); head 2·32·10 = 640."""
    m, classes = config.model, 10
    n, p, channels = (8 // m.patch_size) ** 2, m.patch_size, 1
    d, mlp = m.width, m.mlp_dim
    block = 4 * (2 * n * d * d) + 2 * (2 * n * n * d) + 2 * (2 * n * d * mlp)
    forward = 2 * n * (p * p * channels) * d + m.depth * block + 2 * d * classes
    return 3.0 * forward


@pytest.mark.slow
def test_model_flops_are_the_same_with_accumulation_scan_and_remat(tiny_run, tmp_path):
    """Short quickstart runs with the same global batch: the meter's model FLOPs per example
    (perf/tflops_per_device / perf/img_per_sec_per_device) agree within 1 % whether the step
    accumulates 2 micro-batches, scans the encoder or rematerialises its blocks; XLA's count of
    the compiled step (a scan body once) does not."""
    variants = {"accumulated": {"grad_accum_steps": 2}, "scanned": {"model.scan": True},
                "remat": {"model.remat": "full"}}
    records = {"plain": tiny_run[-1][-1]}  # the same tiny quickstart, unrolled, on 2 devices
    for name, overrides in variants.items():
        supervised.train_and_evaluate(tiny_config("depth=2", total_steps=4, **overrides), str(tmp_path / name),
                                      devices=jax.devices()[:DEVICES])
        records[name] = [json.loads(line) for line in (tmp_path / name / "history.jsonl").read_text().splitlines()
                         if "perf/img_per_sec" in line][-1]
    per_example = {k: r["perf/tflops_per_device"] / r["perf/img_per_sec_per_device"] * 1e12 for k, r in records.items()}
    xla = {k: r["perf/xla_tflops_per_device"] / r["perf/img_per_sec_per_device"] * 1e12 for k, r in records.items()}
    expected = matmul_flops_by_hand(tiny_config("depth=2"))
    assert expected == 3 * (4_096 + 2 * 294_912 + 640)  # the count below, by hand: 1,783,680
    assert per_example == pytest.approx(dict.fromkeys(records, expected), rel=0.01)
    # the old count: the scanned encoder's 2 blocks and the 2 micro-batches are counted once
    assert xla["scanned"] < 0.8 * xla["plain"] and xla["accumulated"] < 0.7 * xla["plain"]


@pytest.mark.slow
def test_evaluation_time_is_not_training_time(tmp_path, monkeypatch):
    """An evaluation that sleeps (a test double of the evaluators) leaves the training-only
    img/s: each record's img/s × its period's training time is its 4 steps' images, and the
    sleeps are in the excluded time (core_hours_total − core_hours), not the training time."""
    sleep, run_all, slept = 0.3, evaluators.run_all, []

    def slow_run_all(*args, **kwargs):
        results = list(run_all(*args, **kwargs))
        if results:  # an evaluation was due
            time.sleep(sleep)
            slept.append(args[3] if len(args) > 3 else kwargs.get("step"))
        yield from results

    monkeypatch.setattr(evaluators, "run_all", slow_run_all)
    config = tiny_config(eval_every_steps=4)
    supervised.train_and_evaluate(config, str(tmp_path), devices=jax.devices()[:DEVICES])
    records = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()
               if "perf/img_per_sec" in line]
    assert [r["step"] for r in records] == [4, 8, 12] and slept == [4, 8, 12]
    for before, r in zip(records, records[1:]):  # periods 5-8 and 9-12, each after an evaluation
        training_s = (r["perf/core_hours"] - before["perf/core_hours"]) * 3600 / DEVICES
        excluded_s = (r["perf/core_hours_total"] - r["perf/core_hours"]
                      - before["perf/core_hours_total"] + before["perf/core_hours"]) * 3600 / DEVICES
        assert excluded_s >= sleep
        np.testing.assert_allclose(r["perf/img_per_sec"] * training_s, 4 * config.input.batch_size, rtol=1e-6)


def test_fit_check_refuses_an_oversized_step_in_one_line():
    cost = perf.StepCost(flops=1e9, argument_bytes=3 << 30, output_bytes=3 << 30, alias_bytes=2 << 30,
                         temp_bytes=1 << 30, devices=8)
    config = tiny_config()
    line = devices.fit_check(cost, config, limit=5 << 30)  # exactly fits: 3 + 3 − 2 + 1 GiB
    assert line.endswith("device memory limit 5.00 GiB")
    assert devices._gib(3 << 20) == "3.00 MiB" and devices._gib(1536) == "1.50 KiB" and devices._gib(12) == "12 B"
    assert line.startswith("Train step per device: arguments 3.00 GiB, outputs 3.00 GiB (2.00 GiB donated), "
                           "temporaries 1.00 GiB, 0.001 TFLOP")
    with pytest.raises(ValueError) as err:
        devices.fit_check(cost, config, limit=(5 << 30) - 1)
    message = str(err.value)
    assert "\n" not in message and f"needs 5.00 GiB per device ({5 << 30} bytes)" in message
    for knob in ("config.input.batch_size=32", "config.grad_accum_steps", "config.model.remat", "config.mesh.fsdp"):
        assert knob in message


@pytest.mark.slow
def test_trainer_stops_before_the_loop_when_the_step_does_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "memory_limit", lambda device: 1024)  # a simulated 1 KiB device
    # the fit check comes before the input pipeline is created: it must never be
    monkeypatch.setattr(inputs, "train_iterator", lambda *args, **kwargs: pytest.fail("input pipeline created"))
    with pytest.raises(devices.DoesNotFit, match=r"the train step needs .* but the device has 1.00 KiB \(1024 bytes\)"):
        supervised.train_and_evaluate(tiny_config(), str(tmp_path), devices=jax.devices()[:1])
    assert not os.path.exists(tmp_path / "history.jsonl")  # no step ran


@pytest.mark.slow
def test_core_hours_continue_across_a_resume(tiny_run, tmp_path):
    workdir, config, _, _, records = tiny_run
    resumed = str(tmp_path / "resumed")
    shutil.copytree(workdir, resumed)
    longer = tiny_config("depth=2", peak_tflops=0.5, total_steps=16, checkpoint_every_steps=0)
    supervised.train_and_evaluate(longer, resumed, devices=jax.devices()[:DEVICES], allow_config_change=True)
    history = [json.loads(line) for line in Path(resumed, "history.jsonl").read_text().splitlines()]
    after = [h for h in history if "perf/img_per_sec" in h]
    assert [r["step"] for r in after] == [4, 8, 12, 16] and after[:3] == records
    steps_per_sec = after[3]["perf/img_per_sec"] / config.input.batch_size
    # step 12's count, then at least the window's 2 steps (15-16) × devices / (steps/s); the total too
    for key in ("perf/core_hours", "perf/core_hours_total"):
        assert after[3][key] >= records[-1][key] + 2 * DEVICES / steps_per_sec / 3600 * (1 - 1e-9)


def test_resumed_core_hours_is_the_last_record_kept(tmp_path):
    path = tmp_path / "history.jsonl"
    assert resumed_core_hours(path) == 0.0
    lines = [{"step": 4, "train_loss": 1.0, "perf/core_hours": 0.25}, {"step": 5, "test_accuracy": 0.5},
             {"step": 8, "train_loss": 0.5, "perf/core_hours": 0.75}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    truncate_history(path, 6)  # resumed at a checkpoint of step 6
    assert resumed_core_hours(path) == 0.25
    cost = perf.StepCost(flops=1.0, argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0, devices=4)
    meter = perf.Meter(cost, 8, ml_collections.ConfigDict(), first_step=6, core_hours=0.25, flops_per_example=1.0,
                       clock=lambda: 100.0)
    assert meter.fields(8, now=190.0)["perf/core_hours"] == 0.25 + 4 * 90 / 3600


def test_missing_wandb_with_a_project_is_a_config_error(monkeypatch):
    config = tiny_config(**{"wandb.project": "skipless-test"})
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ValueError) as err:
        supervised.check_config(config, num_devices=1)
    message = str(err.value)
    assert "\n" not in message and message.startswith("config.wandb.project='skipless-test' needs the wandb package")
    assert "pip install -e .[wandb]" in message
    supervised.check_config(tiny_config(), num_devices=1)  # no project: wandb is not needed


@pytest.mark.parametrize("name", ["quickstart", "dino_digits", "dino_digit_scenes", "mae_digits_pretrain"])
def test_train_batch_spec_is_the_first_real_batch(name):
    """The fit check's abstract batch, from the config alone, against the pipeline's first batch:
    one process, and each of two processes' halves of the global batch."""
    config = load_config(name)
    config.input.num_workers = 0
    dino = config.get("trainer") == "dino"
    spec = (multicrop if dino else inputs).train_batch_spec(config, on_device=True)
    for count in (1, 2):
        iterator = (multicrop if dino else inputs).train_iterator(config, 3, count - 1, count, on_device=True)
        first = next(iterator)
        iterator.close()
        real = {k: ((v.shape[0] * count, *v.shape[1:]), v.dtype) for k, v in first.items()}
        assert spec == real, (name, count)
    assert spec["label"][0] == (config.input.batch_size, 10)

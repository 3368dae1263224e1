"""python -m skipless_jax.sweep: grid expansion and naming, named grids, resumability (a fake
trainer command counts its calls), the failure summary and exit status, the slurm/tpu
scripts, and one real tiny run whose re-run trains nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skipless_jax import sweep

import subprocess_runs

CONFIG = textwrap.dedent('''
    import ml_collections
    from skipless_jax import config_args

    GRIDS = {"pair": "mode=ok seed=0,1", "union": ["lr=0.1 seed=0,1", "lr=0.2,0.1 seed=1"]}

    def get_config(arg=None):
        a = config_args.parse(arg, seed=0, lr=0.1, mode="ok", base="x")
        return ml_collections.ConfigDict(a)
''')

# Stands in for `python -m skipless_jax.main`: appends its command to <workdir>/calls; mode=fail
# exits 3 with a message, mode=preempt exits 75 on its first call, else writes final metrics.
FAKE_TRAINER = textwrap.dedent('''
    import json, os, sys
    flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    workdir = flags["workdir"]
    args = dict(item.split("=") for item in flags["config"].partition(":")[2].split(","))
    with open(os.path.join(workdir, "calls"), "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    calls = len(open(os.path.join(workdir, "calls")).readlines())
    if args.get("mode") == "fail":
        print("error: the loss is not finite at step 3")
        sys.exit(3)
    if args.get("mode") == "preempt" and calls == 1:
        sys.exit(75)
    json.dump({"step": 10, "seed": int(args["seed"])}, open(os.path.join(workdir, "final_metrics.json"), "w"))
''')


@pytest.fixture
def setup(tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text(CONFIG)
    fake = tmp_path / "fake_trainer.py"
    fake.write_text(FAKE_TRAINER)
    return str(config), [sys.executable, str(fake)], str(tmp_path / "root")


def calls(root: str, name: str) -> list[list[str]]:
    path = os.path.join(root, name, "calls")
    return [json.loads(line) for line in Path(path).read_text().splitlines()] if os.path.exists(path) else []


def test_parse_grid_is_the_product_first_axis_slowest():
    assert sweep.parse_grid("a=1,2 b=x,y") == [
        [("a", "1"), ("b", "x")], [("a", "1"), ("b", "y")], [("a", "2"), ("b", "x")], [("a", "2"), ("b", "y")]
    ]
    for bad, words in [("a=1 a=2", "twice"), ("a", "name=value"), ("a=", "name=value"), ("", "no axes")]:
        with pytest.raises(ValueError, match=words):
            sweep.parse_grid(bad)


def test_expand_names_runs_by_their_args_and_adds_them_to_the_config_args(setup):
    config, _, _ = setup
    runs = sweep.expand(f"{config}:base=y", "seed=0,1 lr=0.5")
    assert runs == [
        sweep.SweepRun("seed=0,lr=0.5", f"{config}:base=y,seed=0,lr=0.5"),
        sweep.SweepRun("seed=1,lr=0.5", f"{config}:base=y,seed=1,lr=0.5"),
    ]
    # A named grid; a list is the union, a combination met twice is one run.
    assert [r.name for r in sweep.expand(config, "union")] == ["lr=0.1,seed=0", "lr=0.1,seed=1", "lr=0.2,seed=1"]
    assert [r.name for r in sweep.expand(config, "pair")] == ["mode=ok,seed=0", "mode=ok,seed=1"]
    with pytest.raises(ValueError, match=r"--grid='nope' is not a grid of .*named grids: \['pair', 'union'\]"):
        sweep.expand(config, "nope")
    with pytest.raises(ValueError, match=r"run depth=4: config arg 'depth=4' is unknown; allowed: seed="):
        sweep.expand(config, "depth=4")
    # Characters that cannot be in a folder name become _.
    assert sweep.expand(config, "mode=a/b")[0].name == "mode=a_b"


def test_a_scripts_runs_train_through_the_sweep_and_collect_reads_the_finished_ones(setup):
    """experiments/*.py: one run per row of args (`one_run`, named as `expand` names them, checked
    by the config), trained by `run_local`, their results read back from the folders (`collect`)."""
    config, trainer, root = setup
    run = sweep.one_run(f"{config}:base=y", "lr=0.5,seed=1")
    assert run == sweep.expand(f"{config}:base=y", "lr=0.5 seed=1")[0] == sweep.SweepRun(
        "lr=0.5,seed=1", f"{config}:base=y,lr=0.5,seed=1")
    for bad, words in [("depth=4", "run depth=4: config arg 'depth=4' is unknown"), ("", "needs args")]:
        with pytest.raises(ValueError, match=words):
            sweep.one_run(config, bad)
    runs = {"row a|seed=0": sweep.one_run(config, "seed=0"), "row b|seed=1": sweep.one_run(config, "mode=fail,seed=1")}
    runs["nested|seed=2"] = sweep.one_run(config, "seed=2")._replace(name="part=x/seed=2")  # a folder per part
    assert sweep.run_local(list(runs.values()), root, ["--config.x=1"], trainer=trainer, devices=("cpu", [])) == 1
    record = lambda workdir, metrics: {"seed": metrics["seed"], "folder": os.path.relpath(workdir, root)}
    assert sweep.collect(runs, root, ["--config.x=1"], record) == {
        "row a|seed=0": {"seed": 0, "folder": "seed=0"}, "nested|seed=2": {"seed": 2, "folder": "part=x/seed=2"}}
    assert sweep.collect(runs, root, [], record) == {}  # finished under other overrides: not these runs


def test_claims_grid_expands_and_shares_the_other_grids_folders():
    """`claims`: 225 runs, 70 of them Table 1's and the depth grid's runs under their own folder
    names (trained once under one root), 155 new: 20 with skips at depths 12-16, 90 of the
    learning-rate study, 15 at 64 tokens, 30 with label smoothing (configs/quickstart.py)."""
    runs = sweep.expand("configs/quickstart.py", "claims")
    names = [r.name for r in runs]
    assert len(names) == len(set(names)) == 225
    others = {r.name for g in ("table1", "depth") for r in sweep.expand("configs/quickstart.py", g)}
    new = [n for n in names if n not in others]
    assert len(new) == 155
    count = lambda part: sum(part in n for n in new)
    assert (count("val=True"), count("tokens=64"), count("label_smoothing=0.1")) == (90, 15, 30)
    assert count("self_share=0.76") == 5 and count("lr=") == 60 and count("lr=1e-3") == 0
    with_skips = [n for n in new if n.startswith("skip_sab=True") and n.count("=") == 6]
    assert len(with_skips) == 20 and {n.split(",")[4] for n in with_skips} == {"depth=12", "depth=16"}
    # Shared runs keep the other grids' names; new axes sit between depth and seed.
    assert "skip_sab=False,skip_ffn=False,init=skipless,opt=soap,depth=16,seed=3" in names
    for name in names:
        keys = [item.split("=")[0] for item in name.split(",")]
        assert keys[:5] == ["skip_sab", "skip_ffn", "init", "opt", "depth"] and keys[-1] == "seed", name
    assert "skip_sab=False,skip_ffn=False,init=skipless,opt=adamw,depth=8,tokens=64,self_share=0.76,seed=4" in names


def test_papers_grids_are_named_grids():
    sizes = {"table1": 30, "skip_ablation": 50, "tg_eps": 15, "depth": 80, "bf16": 6, "claims": 225}
    for name, size in sizes.items():
        runs = sweep.expand("configs/quickstart.py", name)
        assert len(runs) == size, name
    table1 = {r.name for r in sweep.expand("configs/quickstart.py", "table1")}
    assert "skip_sab=False,skip_ffn=False,init=skipless,opt=soap,depth=8,seed=2" in table1
    # The three grids of docs/results.md share one root: a run they share has one folder.
    ablation = {r.name for r in sweep.expand("configs/quickstart.py", "skip_ablation")}
    depth = {r.name for r in sweep.expand("configs/quickstart.py", "depth")}
    assert len(table1 & ablation) == 15 and len(table1 & depth) == 20 and len(table1 | ablation | depth) == 125
    assert len(sweep.expand("configs/families_digits.py", "families")) == 24


def test_local_resumes_skips_finished_and_summarizes_failures(setup, capsys):
    config, fake, root = setup
    runs = sweep.expand(config, "mode=ok,preempt,fail seed=0")
    overrides = ["--config.lr=0.3"]
    assert sweep.run_local(runs, root, overrides, workers=2, trainer=fake) == 1
    out = capsys.readouterr().out
    assert "3 runs: 1 trained, 0 already finished, 1 preempted, 1 failed" in out
    assert "FAILED mode=fail,seed=0 (exit 3): error: the loss is not finite at step 3" in out
    assert "preempted mode=preempt,seed=0: rerun the same command to resume" in out
    ok = calls(root, "mode=ok,seed=0")
    assert ok == [[f"--config={config}:mode=ok,seed=0", f"--workdir={root}/mode=ok,seed=0", "--config.lr=0.3"]]

    # Rerun: the finished run is not started again, the preempted one resumes and finishes.
    assert sweep.run_local(runs, root, overrides, workers=2, trainer=fake) == 1
    assert "3 runs: 1 trained, 1 already finished, 0 preempted, 1 failed" in capsys.readouterr().out
    assert (len(calls(root, "mode=ok,seed=0")), len(calls(root, "mode=preempt,seed=0"))) == (1, 2)

    # Only finished runs left: nothing is trained.
    done = [r for r in runs if "fail" not in r.name]
    assert sweep.run_local(done, root, overrides, trainer=fake) == 0
    assert "2 runs: 0 trained, 2 already finished" in capsys.readouterr().out
    # Other overrides are another command: the trainer decides (resume or a config error).
    assert sweep.run_local(done[:1], root, ["--config.lr=0.4"], trainer=fake) == 0
    assert len(calls(root, "mode=ok,seed=0")) == 2


def test_preempted_only_exits_75(setup):
    config, fake, root = setup
    assert sweep.run_local(sweep.expand(config, "mode=preempt seed=0"), root, trainer=fake) == 75
    assert sweep.run_local(sweep.expand(config, "mode=preempt seed=0"), root, trainer=fake) == 0


def test_slurm_and_tpu_scripts_list_the_unfinished_runs(setup):
    config, _, root = setup
    runs = sweep.expand(config, "seed=0,1,2")
    path = sweep.write_slurm(runs, root, ["--config.lr=0.3"])
    text = Path(path).read_text()
    assert "#SBATCH --array=0-2" in text and "launch/slurm_multinode.sh" in text
    subprocess.run(["bash", "-n", path], check=True)
    # Task 1 of the array runs run 1 through the launcher (its --dry-run prints the srun line).
    script = text.replace("exec ", "exec env SLURM_JOB_NUM_NODES=1 SLURM_JOB_NODELIST=n1 ").replace(
        "-- --config", "--dry-run -- --config")
    fake_bin = os.path.join(root, "bin")
    os.makedirs(fake_bin)
    with open(os.path.join(fake_bin, "scontrol"), "w") as f:
        f.write("#!/bin/sh\necho n1\n")
    os.chmod(os.path.join(fake_bin, "scontrol"), 0o755)
    env = dict(os.environ, SLURM_ARRAY_TASK_ID="1", SLURM_JOB_ID="7", PATH=fake_bin + os.pathsep + os.environ["PATH"])
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert f"--config={config}:seed=1" in out and f"--workdir={root}/seed=1" in out and "--config.lr=0.3" in out

    text = Path(sweep.write_tpu(runs[1:], root, [])).read_text()
    assert text.count("launch/tpu_vm.sh run") == 2 and f"--workdir {root}/seed=2 --run-name seed=2" in text


@pytest.mark.slow
def test_cli_errors_are_one_line(setup):
    config, _, root = setup
    cmd = [sys.executable, "-m", "skipless_jax.sweep", f"--config={config}", f"--root={root}"]
    for extra, message in [
        (["--grid=nope"], "error: --grid='nope' is not a grid"),
        (["--grid=seed=0", "--launcher=k8s"], "--launcher='k8s' is unknown; allowed: local, slurm, tpu"),
        (["--grid=seed=0", "--model.depth=2"], "overrides are written --config.a.b=value"),
    ]:
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, cwd=subprocess_runs.ROOT)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not os.path.exists(root)


@pytest.mark.slow
def test_real_tiny_run_then_rerun_trains_nothing(tmp_path, tmp_path_factory):
    root = str(tmp_path / "root")
    environ = subprocess_runs.env(1, cache_dir=os.environ.get("JAX_COMPILATION_CACHE_DIR"))
    cmd = [sys.executable, "-m", "skipless_jax.sweep", f"--config={subprocess_runs.TINY}", "--grid=seed=3",
           f"--root={root}", "--config.total_steps=4"]
    first = subprocess.run(cmd, env=environ, cwd=subprocess_runs.ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "1 runs: 1 trained, 0 already finished, 0 preempted, 0 failed" in first.stdout
    final = json.loads(Path(os.path.join(root, "seed=3", "final_metrics.json")).read_text())
    assert final["step"] == 4
    log = Path(os.path.join(root, "seed=3", "train.log")).read_text()
    second = subprocess.run(cmd, env=environ, cwd=subprocess_runs.ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "1 already finished, 0 to train" in second.stdout
    assert Path(os.path.join(root, "seed=3", "train.log")).read_text() == log  # no process started


def test_worker_envs_split_the_devices_disjointly():
    assert sweep.worker_envs("cpu", [], 3) == [{}, {}, {}]
    gpu = sweep.worker_envs("gpu", ["0", "1", "2", "3", "4", "5"], 3)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu] == ["0,1", "2,3", "4,5"]
    assert sweep.worker_envs("gpu", ["4", "5"], 1) == [{"CUDA_VISIBLE_DEVICES": "4,5"}]
    with pytest.raises(ValueError, match=r"^--workers=3 does not divide the 4 GPU devices of this host "
                                         r"\(0,1,2,3\); allowed: a divisor of 4$"):
        sweep.worker_envs("gpu", ["0", "1", "2", "3"], 3)
    tpu = sweep.worker_envs("tpu", [str(i) for i in range(8)], 4)  # a v5e/v6e-8 host: 2 chips each
    assert [e["TPU_VISIBLE_CHIPS"] for e in tpu] == ["0,1", "2,3", "4,5", "6,7"]
    assert {e["TPU_CHIPS_PER_PROCESS_BOUNDS"] for e in tpu} == {"1,2,1"}
    assert {e["TPU_PROCESS_BOUNDS"] for e in tpu} == {"1,1,1"}
    ports = [e["TPU_PROCESS_PORT"] for e in tpu]
    assert len(set(ports)) == 4 and [e["TPU_PROCESS_ADDRESSES"] for e in tpu] == [f"localhost:{p}" for p in ports]
    chips = [c for e in tpu for c in e["TPU_VISIBLE_CHIPS"].split(",")]
    assert sorted(chips, key=int) == [str(i) for i in range(8)]  # every chip once
    assert [e["TPU_CHIPS_PER_PROCESS_BOUNDS"] for e in sweep.worker_envs("tpu", list("0123"), 4)] == ["1,1,1"] * 4
    assert sweep.worker_envs("tpu", list("0123"), 1) == [{}]
    with pytest.raises(ValueError, match=r"^--workers=2 gives each worker 3 of the 6 TPU chips; a TPU worker takes "
                                         r"1, 2 or 4 chips: allowed --workers: 6, 3, or 1 \(the whole host\)$"):
        sweep.worker_envs("tpu", list("012345"), 2)
    with pytest.raises(ValueError, match=r"^platform 'rocm' is unknown"):
        sweep.worker_envs("rocm", ["0"], 1)


@pytest.mark.slow  # two Python processes that import the sweep (and with it jax)
def test_probe_devices_reads_the_host_without_jax(tmp_path):
    assert sweep.probe_devices({"JAX_PLATFORMS": "cpu"}) == ("cpu", [])
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text('#!/bin/sh\nfor i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 (UUID: x)"; done\n')
    (fake_bin / "nvidia-smi").chmod(0o755)
    code = ("import json; from skipless_jax import sweep; from jax._src import xla_bridge; "
            "print(json.dumps([sweep.probe_devices(), xla_bridge.backends_are_initialized()]))")
    for visible, ids in ((None, ["0", "1", "2", "3"]), ("2,3", ["2", "3"])):
        environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")}
        environ["PATH"] = f"{fake_bin}{os.pathsep}{environ['PATH']}"
        if visible:
            environ["CUDA_VISIBLE_DEVICES"] = visible
        out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == [["gpu", ids], False]  # no JAX backend started in the sweep's process


# Records what a worker sees of the accelerators: its share of the fake host's devices.
SHARE_TRAINER = textwrap.dedent('''
    import json, os, sys, time
    flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    seen = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS")}
    time.sleep(0.5)  # the other worker starts meanwhile
    json.dump(seen, open(os.path.join(flags["workdir"], "seen.json"), "w"))
    json.dump({"step": 1}, open(os.path.join(flags["workdir"], "final_metrics.json"), "w"))
''')


@pytest.mark.parametrize("platform,name", [("gpu", "CUDA_VISIBLE_DEVICES"), ("tpu", "TPU_VISIBLE_CHIPS")])
def test_each_worker_of_a_sweep_gets_its_own_device_share(setup, tmp_path, capsys, platform, name):
    config, _, root = setup
    fake = tmp_path / "share_trainer.py"
    fake.write_text(SHARE_TRAINER)
    runs = sweep.expand(config, "seed=0,1,2,3")
    devices = (platform, ["0", "1", "2", "3"])
    assert sweep.run_local(runs, root, workers=2, trainer=[sys.executable, str(fake)], devices=devices) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(f"4 to train; {platform}: 2 workers, {name}=0,1 | 2,3"), first
    seen = [json.loads(Path(root, r.name, "seen.json").read_text())[name] for r in runs]
    # Runs 0 and 1 start together, on the two shares; 2 and 3 take the shares their finished runs freed.
    assert sorted(seen[:2]) == ["0,1", "2,3"] and sorted(seen[2:]) == ["0,1", "2,3"], seen
    # A W that does not divide the devices: refused before anything starts.
    with pytest.raises(ValueError, match="--workers=3 does not divide the 4"):
        sweep.run_local(runs, str(tmp_path / "other"), workers=3, trainer=[sys.executable, str(fake)], devices=devices)
    assert not os.path.exists(tmp_path / "other")

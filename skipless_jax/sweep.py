r"""A grid of training runs: `python -m skipless_jax.sweep`.

    python -m skipless_jax.sweep --config=configs/quickstart.py:depth=8 --grid="opt=adamw,soap seed=0,1,2" \
        --root=/tmp/sweep [--workers=2] [--launcher=local|slurm|tpu] [--submit] [--config.x=y ...]
    python -m skipless_jax.sweep --config=configs/quickstart.py --grid=table1 --root=/tmp/table1

A grid is axes separated by spaces, `name=v1,v2,...` each; every combination of the axes (the
product, first axis slowest) adds its `name=value` args to the config's own `:args` (later
args win) and is one run, in its own folder under --root named by the combination's args, e.g.
`opt=adamw,seed=0`. A grid without `=` is a *named grid*: the config file's module-level
`GRIDS` dict maps a name to one grid string or a list of them (the union of their runs, for
grids that are not one product, e.g. Table 1's three variants). `--config.*` flags pass to
every run. Every run's args are checked against the config before anything starts.

Launchers:
- local (default): `python -m skipless_jax.main` per run, --workers at a time, output in
  `<run>/train.log`. Each worker gets its own share of the host's accelerators
  (`worker_envs`: disjoint `CUDA_VISIBLE_DEVICES` on GPU, disjoint chips on TPU), found without
  initializing them in the sweep's process (`probe_devices`: nvidia-smi, /dev/accel*); the
  first line says which. Resumable: a run that finished under the same command (a
  `final_metrics.json`, which a trainer writes only at its last step, and the same command in
  `<run>/sweep_run.json`) is skipped without starting a process; a preempted one (exit 75)
  resumes from its checkpoint when the sweep is rerun; a re-run of a finished sweep trains
  nothing. SIGTERM to the sweep is passed on to its runs (they save and exit 75); so is Ctrl-C
  (SIGINT to the process group: the runs save and exit 130, counted resumable), after which the
  sweep waits for them, prints its summary and exits 130; a second Ctrl-C stops them at once.
- slurm: writes `<root>/sweep_slurm.sh`, an sbatch array job of the unfinished runs; task i
  runs launch/slurm_multinode.sh for run i inside its allocation. `--submit` submits it.
- tpu: writes `<root>/sweep_tpu.sh`, one `launch/tpu_vm.sh run` per unfinished run on the
  slice $TPU_NAME in $TPU_ZONE (create and install it first; docs/launch.md); --root should be
  a bucket (gs://...) that every worker sees.

Exit status: 0 every run finished; 130 interrupted by Ctrl-C; 1 a run failed (a summary names each with its exit status
and the last line of its log), or another sweep holds --root (local: one sweep per root, and
each run's main holds its workdir; skipless_jax/workdir_lock.py); 75 a run was preempted (rerun
the same command); 2 bad usage, or a --root that cannot be written (read-only, a file in its place;
one line; a full disk: 1).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from skipless_jax import cli, workdir_lock
from skipless_jax.trainers.outcome import EXIT_INTERRUPTED, EXIT_PREEMPTED, FINAL_METRICS, RUN_RECORD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG = "train.log"
TRAINER = (sys.executable, "-m", "skipless_jax.main")
LAUNCHERS = ("local", "slurm", "tpu")
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789=,.-_+")


class SweepRun(NamedTuple):
    name: str  # its folder under the root: the grid's args, e.g. "opt=adamw,seed=0"
    config: str  # --config of this run: PATH:args (the config's own args, then the grid's)


def parse_grid(grid: str) -> list[list[tuple[str, str]]]:
    """'a=1,2 b=x' -> [[('a', '1'), ('b', 'x')], [('a', '2'), ('b', 'x')]] (first axis slowest)."""
    axes: list[list[tuple[str, str]]] = []
    names: list[str] = []
    for axis in grid.split():
        name, sep, values = axis.partition("=")
        items = values.split(",")
        if not sep or not name or not values:
            raise ValueError(f"grid axis {axis!r} must be name=value[,value...]; grid {grid!r}")
        if "" in items:
            raise ValueError(f"grid axis {axis!r} has an empty value (',,' or a ',' at an end); grid {grid!r}")
        if name in names:
            raise ValueError(f"grid axis {name!r} appears twice in grid {grid!r}")
        names.append(name)
        axes.append([(name, v) for v in items])
    if not axes:
        raise ValueError(f"grid {grid!r} has no axes; write them as 'name=v1,v2 other=w1,w2'")
    return [list(combo) for combo in itertools.product(*axes)]


def load_config_module(path: str) -> Any:
    if not os.path.isfile(path):
        raise ValueError(f"--config={path}: no such config file")
    spec = importlib.util.spec_from_file_location(f"sweep_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def named_grids(module: Any) -> dict[str, list[str]]:
    """The config module's `GRIDS` as {name: [grid string, ...]}."""
    grids = getattr(module, "GRIDS", {})
    return {name: [g] if isinstance(g, str) else list(g) for name, g in grids.items()}


def expand(config: str, grid: str, module: Any | None = None) -> list[SweepRun]:
    """The runs of `grid` (a grid string or a name in the config's GRIDS) on `config` (PATH[:args]).

    Every run's args are checked by the config's get_config (unknown names, bad values: a
    one-line ValueError naming the run), and two combinations with the same args are one run.
    """
    path, _, base = config.partition(":")
    module = load_config_module(path) if module is None else module
    if "=" in grid:
        grids = [grid]
    else:
        available = named_grids(module)
        if grid not in available:
            raise ValueError(f"--grid={grid!r} is not a grid of {path}; named grids: {sorted(available) or 'none'}")
        grids = available[grid]
    runs: dict[str, SweepRun] = {}
    for g in grids:
        for combo in parse_grid(g):
            args = ",".join(f"{k}={v}" for k, v in combo)
            name = "".join(c if c in _SAFE else "_" for c in args)
            spec = f"{path}:{','.join(filter(None, (base, args)))}"
            if name in runs:
                if runs[name].config != spec:  # two args that the folder name cannot tell apart
                    raise ValueError(f"runs {runs[name].config.partition(':')[2]!r} and {spec.partition(':')[2]!r} "
                                     f"would share the folder {name!r}; give them values that differ in "
                                     "letters, digits or =,.-_+")
                continue
            try:
                module.get_config(spec.partition(":")[2])
            except ValueError as err:
                raise ValueError(f"run {name}: {err}") from None
            runs[name] = SweepRun(name, spec)
    return list(runs.values())


def one_run(config: str, args: str = "", module: Any | None = None) -> SweepRun:
    """The run of `config` (PATH[:args]) with the extra `args` ('a=1,b=x'), named and checked as
    `expand` names and checks a grid's runs (a script's list of runs that are not one product)."""
    items = [a for a in args.split(",") if a]
    if not items:
        raise ValueError(f"a run of {config} needs args: they name its folder")
    return expand(config, " ".join(items), module)[0]


def collect(
    runs: Mapping[str, SweepRun],
    root: str,
    overrides: Sequence[str],
    record: Callable[[str, dict[str, Any]], dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """{key: record(workdir, final metrics)} of the `runs` ({key: run}) that finished under `root`
    with these overrides (`is_finished`), in the order of `runs`: the results of a script's grid,
    read from its run folders after `run_local` (the others are left out)."""
    out = {}
    for key, run in runs.items():
        workdir = os.path.join(root, run.name)
        if is_finished(workdir, run, overrides):
            with open(os.path.join(workdir, FINAL_METRICS)) as f:
                out[key] = record(workdir, json.load(f))
    return out


def train_and_collect(
    runs: Mapping[str, SweepRun],
    root: str,
    overrides: Sequence[str],
    workers: int,
    record: Callable[[str, dict[str, Any]], dict[str, Any]],
    path: str,
) -> tuple[dict[str, dict[str, Any]], int]:
    """A script's grid ({key: run}): `train` the unfinished runs under `root`, then `collect` the
    finished ones and write them as JSON to `path`; (the results, the sweep's exit status)."""
    status = train(list(runs.values()), root, overrides, workers)
    results = collect(runs, root, overrides, record)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    return results, status


def run_record(run: SweepRun, overrides: Sequence[str]) -> dict[str, Any]:
    return {"config": run.config, "overrides": list(overrides)}


def is_finished(workdir: str, run: SweepRun, overrides: Sequence[str]) -> bool:
    """Whether `workdir` holds this run finished: final metrics (a trainer writes them only at its
    last step) from the same command; otherwise the trainer decides (resume, or a config error)."""
    try:
        with open(os.path.join(workdir, RUN_RECORD)) as f:
            same = json.load(f) == run_record(run, overrides)
        with open(os.path.join(workdir, FINAL_METRICS)) as f:
            return same and isinstance(json.load(f).get("step"), int)
    except (OSError, ValueError, AttributeError):
        return False


def train_command(run: SweepRun, workdir: str, overrides: Sequence[str], trainer: Sequence[str] = TRAINER) -> list[str]:
    return [*trainer, f"--config={run.config}", f"--workdir={workdir}", *overrides]


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f.read()[-20000:].splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}  # chips of one worker -> TPU_CHIPS_PER_PROCESS_BOUNDS
TPU_BASE_PORT = 8476  # the TPU runtime's default port; worker i takes TPU_BASE_PORT + i


def worker_envs(platform: str, device_ids: Sequence[str], workers: int) -> list[dict[str, str]]:
    """The environment variables of each of `workers` runs sharing this host's `device_ids`.

    "cpu": nothing to split (empty dicts). "gpu": disjoint, equal `CUDA_VISIBLE_DEVICES` shares
    in the order given. "tpu": disjoint chips through the TPU runtime's per-process variables
    (`TPU_VISIBLE_CHIPS` with its older name `TPU_VISIBLE_DEVICES`, `TPU_CHIPS_PER_PROCESS_BOUNDS`
    for 1, 2 or 4 chips, `TPU_PROCESS_BOUNDS=1,1,1`: each worker a one-process slice of its own,
    and its own runtime port). A `workers` that does not divide the devices, or a TPU share of
    another size than 1, 2 or 4 chips, is a one-line ValueError.
    """
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"platform {platform!r} is unknown; allowed: cpu, gpu, tpu")
    if workers < 1:
        raise ValueError(f"--workers={workers} must be >= 1")
    if platform == "cpu":
        return [{} for _ in range(workers)]
    ids = [str(d) for d in device_ids]
    if not ids or len(ids) % workers:
        raise ValueError(f"--workers={workers} does not divide the {len(ids)} {platform.upper()} devices of this "
                         f"host ({','.join(ids) or 'none'}); allowed: a divisor of {len(ids)}")
    size = len(ids) // workers
    shares = [ids[i * size:(i + 1) * size] for i in range(workers)]
    if platform == "gpu":
        return [{"CUDA_VISIBLE_DEVICES": ",".join(share)} for share in shares]
    if workers == 1:
        return [{}]  # the whole host: the runtime's own defaults
    if size not in TPU_CHIP_BOUNDS:
        raise ValueError(f"--workers={workers} gives each worker {size} of the {len(ids)} TPU chips; a TPU worker "
                         f"takes 1, 2 or 4 chips: allowed --workers: "
                         f"{', '.join(str(len(ids) // n) for n in TPU_CHIP_BOUNDS if len(ids) % n == 0)}, "
                         "or 1 (the whole host)")
    envs = []
    for i, share in enumerate(shares):
        port = str(TPU_BASE_PORT + i)
        envs.append({
            "TPU_VISIBLE_CHIPS": ",".join(share), "TPU_VISIBLE_DEVICES": ",".join(share),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": TPU_CHIP_BOUNDS[size], "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": port, "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
            "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}", "TPU_MESH_CONTROLLER_PORT": port,
        })
    return envs


def probe_devices(environ: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """(platform, device ids) of this host, without initializing an accelerator in this process:
    `JAX_PLATFORMS=cpu` is the CPU; else the GPUs `nvidia-smi -L` lists (those of
    `CUDA_VISIBLE_DEVICES` where it is set), else the TPU chips /dev/accel<N> (/dev/vfio/<N> on
    newer TPU VMs), else the CPU."""
    environ = os.environ if environ is None else environ
    if environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        return "cpu", []
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        gpus = [str(i) for i, line in enumerate(listed.stdout.splitlines()) if line.startswith("GPU ")]
    except (OSError, subprocess.SubprocessError):
        gpus = []
    if gpus:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        return "gpu", [d.strip() for d in visible.split(",") if d.strip()] if visible else gpus
    chips = _numbered("/dev", "accel")
    if not chips and importlib.util.find_spec("libtpu") is not None:  # newer TPU VMs: VFIO groups
        chips = _numbered("/dev/vfio", "")
    if chips:
        return "tpu", chips
    return "cpu", []


def _numbered(folder: str, prefix: str) -> list[str]:
    """The N of the entries `<prefix>N` of `folder`, ascending ([] when it cannot be read)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [str(n) for n in sorted(int(m.group(1)) for m in (re.fullmatch(prefix + r"(\d+)", x) for x in names) if m)]


def describe_shares(platform: str, envs: Sequence[dict[str, str]]) -> str:
    """'gpu: 2 workers, CUDA_VISIBLE_DEVICES=0,1 | 2,3' (what each worker sees), or 'cpu'."""
    name = {"gpu": "CUDA_VISIBLE_DEVICES", "tpu": "TPU_VISIBLE_CHIPS"}.get(platform)
    if name is None or not any(envs):
        return f"{platform}: {len(envs)} worker{'s' if len(envs) > 1 else ''}, every device visible to each"
    return f"{platform}: {len(envs)} worker{'s' if len(envs) > 1 else ''}, {name}={' | '.join(e[name] for e in envs)}"


def run_local(
    runs: Sequence[SweepRun],
    root: str,
    overrides: Sequence[str] = (),
    workers: int = 1,
    trainer: Sequence[str] = TRAINER,
    devices: tuple[str, Sequence[str]] | None = None,
) -> int:
    """Trains the unfinished runs, `workers` at a time, each worker on its own device share
    (`worker_envs`); prints a summary; returns the exit status.

    `trainer`: the command that trains one run; `devices`: (platform, device ids), default
    `probe_devices()` (tests inject a fake trainer and a fake platform).
    """
    platform, device_ids = probe_devices() if devices is None else devices
    envs = worker_envs(platform, device_ids, workers)  # a ValueError before anything starts
    todo = [r for r in runs if not is_finished(os.path.join(root, r.name), r, overrides)]
    skipped = len(runs) - len(todo)
    print(f"sweep: {len(runs)} runs under {root}: {skipped} already finished, {len(todo)} to train; "
          f"{describe_shares(platform, envs)}", flush=True)
    active: list[tuple[SweepRun, subprocess.Popen]] = []
    slots: dict[int, int] = {}  # pid of a running worker -> its share in `envs`
    outcome: dict[str, int] = {}
    stopping = []

    def forward(signum, frame):  # the runs save their step and exit 75; start no others
        stopping.append(signum)
        for _, proc in active:
            proc.send_signal(signal.SIGTERM)

    def interrupt(signum, frame):  # Ctrl-C: a preemption (the runs save and exit 130 or 75); again: at once
        if signal.SIGINT in stopping:
            print("sweep: interrupted again: stopping the runs now, without saving (exit status 130)", flush=True)
            for _, proc in active:
                proc.kill()
            for _, proc in active:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)  # reaped: no zombie left behind
            workdir_lock.release_held()
            os._exit(EXIT_INTERRUPTED)
        print("sweep: Ctrl-C: the runs save their step and stop (Ctrl-C again stops them at once)", flush=True)
        forward(signum, frame)

    previous = signal.signal(signal.SIGTERM, forward)
    previous_int = signal.signal(signal.SIGINT, interrupt)
    try:
        queue = list(todo)
        while queue or active:
            while queue and len(active) < workers and not stopping:
                run = queue.pop(0)
                workdir = os.path.join(root, run.name)
                os.makedirs(workdir, exist_ok=True)
                with open(os.path.join(workdir, RUN_RECORD), "w") as f:
                    json.dump(run_record(run, overrides), f)
                with open(os.path.join(workdir, LOG), "ab") as log:
                    cmd = train_command(run, workdir, overrides, trainer)
                    log.write(f"# {shlex.join(cmd)}\n".encode())
                    log.flush()
                    slot = min(set(range(workers)) - set(slots.values()))
                    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                            env={**os.environ, **envs[slot]})
                    slots[proc.pid] = slot
                    active.append((run, proc))
                print(f"sweep: started {run.name}", flush=True)
            if stopping and queue:
                outcome.update({r.name: EXIT_PREEMPTED for r in queue})
                queue = []
            time.sleep(0.05)
            for item in [a for a in active if a[1].poll() is not None]:
                active.remove(item)
                run, proc = item
                slots.pop(proc.pid)
                # A run stopped by the signal before its handler was set is resumable too.
                stopped = bool(stopping) and proc.returncode in (-signal.SIGINT, -signal.SIGTERM)
                outcome[run.name] = EXIT_PREEMPTED if stopped else proc.returncode
                print(f"sweep: {run.name} exited {proc.returncode}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    status = summarize(runs, root, outcome, skipped)
    if signal.SIGINT in stopping:
        print("sweep: interrupted (Ctrl-C): rerun the same command to resume (exit status 130)", flush=True)
        return EXIT_INTERRUPTED
    return status


def train(runs: Sequence[SweepRun], root: str, overrides: Sequence[str] = (), workers: int = 1) -> int:
    """`run_local` on this host's devices under `root`'s lock, as `python -m skipless_jax.sweep`
    trains (a script's runs too): its exit status; 2 (one line) for a `workers` that does not
    divide the devices, 1 while another sweep holds `root`."""
    try:
        devices = probe_devices()
        worker_envs(*devices, workers)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    try:  # one sweep per root (each run's main locks its own workdir too)
        workdir_lock.acquire(root, "--root")
    except workdir_lock.WorkdirBusy as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    try:
        return run_local(runs, root, overrides, workers, devices=devices)
    finally:
        workdir_lock.release(root)


def overrides_of(parser: argparse.ArgumentParser, rest: Sequence[str]) -> list[str]:
    """The `--config.a.b=value` overrides among a parser's unknown args (`parse_known_args`);
    anything else is the parser's usage error."""
    bad = [a for a in rest if not (a.startswith("--config.") and "=" in a)]
    if bad:
        parser.error(f"unexpected argument {bad[0]!r}; overrides are written --config.a.b=value")
    return list(rest)


def summarize(runs: Sequence[SweepRun], root: str, outcome: dict[str, int], skipped: int) -> int:
    """One line of counts, then one line per run that did not finish; the sweep's exit status."""
    failed = {n: c for n, c in outcome.items() if c not in (0, EXIT_PREEMPTED, EXIT_INTERRUPTED)}
    preempted = [n for n, c in outcome.items() if c in (EXIT_PREEMPTED, EXIT_INTERRUPTED)]  # both resumable
    trained = sum(c == 0 for c in outcome.values())
    print(f"sweep: {len(runs)} runs: {trained} trained, {skipped} already finished, "
          f"{len(preempted)} preempted, {len(failed)} failed", flush=True)
    for name in preempted:
        print(f"sweep: preempted {name}: rerun the same command to resume", flush=True)
    for name, code in failed.items():
        print(f"sweep: FAILED {name} (exit {code}): {_last_line(os.path.join(root, name, LOG))}", flush=True)
    return 1 if failed else EXIT_PREEMPTED if preempted else 0


def _bash_array(words: Sequence[str]) -> str:
    return "(" + " ".join(shlex.quote(w) for w in words) + ")"


def write_slurm(runs: Sequence[SweepRun], root: str, overrides: Sequence[str]) -> str:
    """`<root>/sweep_slurm.sh`: an sbatch array job, task i = launch/slurm_multinode.sh for run i.

    The #SBATCH lines are defaults that sbatch's own flags override
    (e.g. `sbatch --nodes=4 --gpus-per-node=8 --partition=gpu <root>/sweep_slurm.sh`).
    """
    path = os.path.join(root, "sweep_slurm.sh")
    launcher = os.path.join(ROOT, "launch", "slurm_multinode.sh")
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --array=0-{len(runs) - 1}",
        "#SBATCH --job-name=skipless_sweep --nodes=1 --ntasks-per-node=1 --exclusive",
        f"#SBATCH --output={root}/slurm-%A_%a.out --open-mode=append --signal=TERM@300 --requeue",
        f"# Written by python -m skipless_jax.sweep: {len(runs)} unfinished runs of {root}.",
        "set -euo pipefail",
        f"runs={_bash_array([r.name for r in runs])}",
        f"configs={_bash_array([r.config for r in runs])}",
        "i=${SLURM_ARRAY_TASK_ID:?submit with sbatch (an array job)}",
        f"cd {shlex.quote(ROOT)}",
        f'exec {shlex.quote(launcher)} --config "${{configs[$i]}}" --workdir {shlex.quote(root)}/"${{runs[$i]}}" '
        f"-- {' '.join(shlex.quote(o) for o in overrides)}".rstrip(),
    ]
    _write_script(path, lines)
    return path


def write_tpu(runs: Sequence[SweepRun], root: str, overrides: Sequence[str]) -> str:
    """`<root>/sweep_tpu.sh`: the unfinished runs one after another on one Cloud TPU slice."""
    path = os.path.join(root, "sweep_tpu.sh")
    launcher = shlex.quote(os.path.join(ROOT, "launch", "tpu_vm.sh"))
    lines = [
        "#!/usr/bin/env bash",
        f"# Written by python -m skipless_jax.sweep: {len(runs)} unfinished runs of {root}, one at a time on",
        "# the slice $TPU_NAME in $TPU_ZONE, made first with:",
        f"#   {launcher} create install --name $TPU_NAME --zone $TPU_ZONE --accelerator-type T --bucket gs://B",
        "# A preempted run (exit 75) resumes when this script is run again.",
        "set -uo pipefail",
        ': "${TPU_NAME:?set TPU_NAME}" "${TPU_ZONE:?set TPU_ZONE}"',
        "status=0",
    ]
    for run in runs:
        cmd = [
            "run", "--name", "$TPU_NAME", "--zone", "$TPU_ZONE", "--config", run.config,
            "--workdir", f"{root}/{run.name}", "--run-name", run.name, "--", *overrides,
        ]
        words = " ".join(f'"{w}"' if w.startswith("$") else shlex.quote(w) for w in cmd)
        lines.append(f"{launcher} {words} || status=$?")
    lines.append('exit "$status"')
    _write_script(path, lines)
    return path


def _write_script(path: str, lines: list[str]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o755)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m skipless_jax.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="PATH[:args], as for skipless_jax.main")
    parser.add_argument("--grid", required=True, help="'a=1,2 b=x,y' or the name of one of the config's GRIDS")
    parser.add_argument("--root", required=True, help="one folder per run goes under it")
    parser.add_argument("--workers", type=int, default=1, help="local: runs at a time")
    parser.add_argument("--launcher", default="local", help="local | slurm | tpu")
    parser.add_argument("--submit", action="store_true", help="slurm: submit the array job with sbatch")
    args, rest = parser.parse_known_args(argv)
    rest = overrides_of(parser, rest)
    if args.launcher not in LAUNCHERS:
        parser.error(f"--launcher={args.launcher!r} is unknown; allowed: {', '.join(LAUNCHERS)}")
    if args.workers < 1:
        parser.error(f"--workers={args.workers} must be >= 1")
    return args, rest


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        runs = expand(args.config, args.grid)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    root = os.path.abspath(args.root) if "://" not in args.root else args.root.rstrip("/")
    cli.check_writable("--root", root)  # a read-only root or a file in its place: one line, exit status 2
    with cli.writing("--root", root):
        return launch(args, runs, root, overrides)


def launch(args: argparse.Namespace, runs: Sequence[SweepRun], root: str, overrides: Sequence[str]) -> int:
    """The runs by `args.launcher`: trained here, or written as a script (and submitted)."""
    if args.launcher == "local":
        return train(runs, root, overrides, args.workers)
    todo = [r for r in runs if not is_finished(os.path.join(root, r.name), r, overrides)]
    if not todo:
        print(f"sweep: all {len(runs)} runs under {root} already finished", flush=True)
        return 0
    if args.launcher == "tpu":
        print(f"sweep: wrote {write_tpu(todo, root, overrides)} ({len(todo)} runs)", flush=True)
        return 0
    script = write_slurm(todo, root, overrides)
    print(f"sweep: wrote {script} ({len(todo)} runs as an array job)", flush=True)
    return subprocess.call(["sbatch", script]) if args.submit else 0


if __name__ == "__main__":
    sys.exit(main())

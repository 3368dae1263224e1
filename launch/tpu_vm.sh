#!/usr/bin/env bash
# Cloud TPU VMs, from your machine: create a VM or pod slice, install this checkout on every
# worker, train one config on all workers at once, fetch the per-worker logs, delete the VM.
#
#   launch/tpu_vm.sh STEP... --name NAME --zone ZONE [options] [-- TRAINER_FLAGS...]
#
# Steps run in the order given; a failed step skips the rest except `delete`, so
# `create install run delete` never leaves a slice running (and billing) behind.
#   create   gcloud compute tpus tpu-vm create (--accelerator-type; --version has a default)
#   install  copy this checkout (git-tracked and untracked-but-not-ignored files) or clone --repo
#            at --ref on every worker, then build ~/skipless_venv with uv: requirements.txt,
#            the package (-e .) and jax[tpu] of the same jax version
#   run      on every worker at once (--worker=all): launch/tpu_worker.sh run, which stops stale
#            TPU processes and trains; output streams here prefixed by "[worker ID]".
#            --detach leaves it running without this ssh session (use it for long jobs).
#   logs     copy each worker's log to --log-dir (default launch_logs/RUN): one file per worker
#   stop     kill whatever holds the TPU chips on every worker
#   delete   delete the VM (the bucket, with checkpoints and logs, stays)
#
# The workdir defaults to gs://BUCKET/skipless_jax/RUN and TFDS_DATA_DIR to
# gs://BUCKET/tensorflow_datasets; RUN defaults to the config's name with its arguments.
# Rerunning `run` with the same RUN resumes from the workdir's last checkpoint. Exit status: 0, or
# the first failed step's; 75 when `run` was preempted (the trainers saved their step).
#
#   launch/tpu_vm.sh create install run delete --name vit-v4 --zone us-central2-b \
#       --accelerator-type v4-32 --bucket gs://my-bucket --config configs/quickstart.py \
#       -- --config.seed=1
#
# The DINO configs' dense evaluations run after training as their own job on one node (not
# inside the training job): launch/gpu_node.sh's header and docs/dino.md give the command.
# docs/launch.md: set-up, where outputs land, resuming, and what the common failures mean.
set -euo pipefail

readonly PROG=tpu_vm.sh
readonly EXIT_PREEMPTED=75  # the trainer's status after it saved on SIGTERM or a preemption notice
readonly USAGE="usage: $PROG STEP... (create|install|run|logs|stop|delete) --name NAME --zone ZONE \
[--project P] [--accelerator-type T] [--version V] [--spot] [--bucket gs://B] [--config CFG] \
[--workdir DIR] [--run-name RUN] [--env VAR=VALUE]... [--detach] [--repo URL] [--ref REF] \
[--python-version 3.11] [--log-dir DIR] [--dry-run] [-- TRAINER_FLAGS...]"
# Paths on the workers: the ~ is expanded by the worker's shell, not here.
# shellcheck disable=SC2088
readonly REMOTE_REPO='~/skipless_jax' REMOTE_VENV='~/skipless_venv' REMOTE_TARBALL=skipless_jax.tgz

usage_error() {  # one line, exit 2: the shell convention for bad usage
  echo "$PROG: error: $1 (see $PROG --help)" >&2
  exit 2
}

show_help() {  # the usage line, then this file's header comment
  echo "$USAGE"
  sed -n '2,/^set -euo pipefail/s/^# \{0,1\}//p' "$0"
}

quote() {  # print a command so that a shell reads it back as the same words
  local word line=''
  for word in "$@"; do
    if [[ -n $word && $word != *[!A-Za-z0-9_@%+=:,./-]* ]]; then
      line+=" $word"
    else
      line+=" '${word//\'/\'\\\'\'}'"  # a ' inside becomes '\''
    fi
  done
  printf '%s\n' "${line# }"
}

run() {  # print the command; run it unless --dry-run
  quote "$@"
  ((dry_run)) || "$@"
}

# Hosts (= jax processes) in a slice. v2/v3/v4/v5p count TensorCores, 8 per 4-chip host;
# v5litepod/v6e count chips: up to 8 on one host, 4 per host in larger slices.
workers_for() {
  local family=${1%-*} size=${1##*-}
  case $family in
    v2|v3|v4|v5p) echo $(((size + 7) / 8)) ;;
    v5litepod|v6e) if ((size <= 8)); then echo 1; else echo $((size / 4)); fi ;;
  esac
}

default_version() {  # the runtime image Google documents for each TPU generation
  case ${1%-*} in
    v2|v3|v4) echo tpu-ubuntu2204-base ;;
    v5litepod) echo v2-alpha-tpuv5-lite ;;
    v5p) echo v2-alpha-tpuv5 ;;
    v6e) echo v2-alpha-tpuv6e ;;
  esac
}

steps=()
name='' zone='' project='' accelerator_type='' version='' spot=0 bucket='' config='' workdir=''
run_name='' detach=0 repo='' ref='' python_version=3.11 log_dir='' dry_run=0
worker_env=() trainer_flags=()
while (($#)); do
  case $1 in
    --) shift; trainer_flags=("$@"); break ;;
    --dry-run) dry_run=1; shift; continue ;;
    --spot) spot=1; shift; continue ;;
    --detach) detach=1; shift; continue ;;
    -h|--help) show_help; exit 0 ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
    create|install|run|logs|stop|delete) steps+=("$1"); shift; continue ;;
    -*) ;;
    *) usage_error "unknown step '$1' (allowed: create, install, run, logs, stop, delete)" ;;
  esac
  if (($# < 2)) || [[ $2 == --* ]]; then usage_error "$1 needs a value"; fi
  case $1 in
    --name) name=$2 ;;
    --zone) zone=$2 ;;
    --project) project=$2 ;;
    --accelerator-type) accelerator_type=$2 ;;
    --version) version=$2 ;;
    --bucket) bucket=${2%/} ;;
    --config) config=$2 ;;
    --workdir) workdir=${2%/} ;;
    --run-name) run_name=$2 ;;
    --env) [[ $2 == [A-Za-z_]*=* ]] || usage_error "--env needs VAR=VALUE, got '$2'"; worker_env+=("$2") ;;
    --repo) repo=$2 ;;
    --ref) ref=$2 ;;
    --python-version) python_version=$2 ;;
    --log-dir) log_dir=$2 ;;
    *) usage_error "unknown option $1" ;;
  esac
  shift 2
done

has_step() {
  local step
  for step in ${steps[@]+"${steps[@]}"}; do [[ $step == "$1" ]] && return 0; done
  return 1
}

# Everything is checked before the first step, so a typo cannot leave a half-made slice.
((${#steps[@]})) || usage_error "missing step (create, install, run, logs, stop or delete)"
[[ -n $name ]] || usage_error "missing required --name"
[[ -n $zone ]] || usage_error "missing required --zone"
if [[ -n $accelerator_type ]]; then
  [[ $accelerator_type =~ ^(v2|v3|v4|v5p|v5litepod|v6e)-[1-9][0-9]*$ ]] ||
    usage_error "unknown accelerator type '$accelerator_type' (allowed: v2-N, v3-N, v4-N, v5p-N, v5litepod-N, v6e-N)"
fi
if has_step create; then
  [[ -n $accelerator_type ]] || usage_error "missing required --accelerator-type for create"
  version=${version:-$(default_version "$accelerator_type")}
fi
[[ -z $bucket || $bucket == gs://* ]] || bucket="gs://$bucket"
if [[ -z $run_name ]]; then
  if [[ -n $workdir ]]; then
    run_name=${workdir##*/}
  elif [[ -n $config ]]; then
    # configs/vit.py:variant=B/16 -> vit-variant=B_16: one workdir per config and arguments.
    run_name=${config%%:*}
    run_name=${run_name##*/}
    run_name=${run_name%.py}
    [[ $config != *:* ]] || run_name+="-${config#*:}"
    run_name=${run_name//[^A-Za-z0-9._=-]/_}
  fi
fi
if has_step run; then
  [[ -n $config ]] || usage_error "missing required --config for run"
  [[ -n $workdir || -n $bucket ]] || usage_error "missing required --bucket (or --workdir) for run"
  workdir=${workdir:-$bucket/skipless_jax/$run_name}
  if ((detach)) && has_step delete; then
    usage_error "--detach with delete would delete the VM under the running job"
  fi
fi
if has_step logs; then
  [[ -n $run_name ]] || usage_error "missing required --run-name (or --config/--workdir) for logs"
  log_dir=${log_dir:-launch_logs/$run_name}
fi
[[ -z $repo || -n $ref ]] || ref=main

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=("--zone=$zone")
[[ -z $project ]] || where+=("--project=$project")

on_all_workers() {  # $1: a POSIX sh command line, run by each worker's login shell
  run "${gcloud_tpu[@]}" ssh "$name" --worker=all "${where[@]}" "--command=$1"
}

step_create() {
  local create=("${gcloud_tpu[@]}" create "$name" "${where[@]}" "--accelerator-type=$accelerator_type"
    "--version=$version")
  if ((spot)); then create+=(--spot); fi
  echo "# $accelerator_type: $(workers_for "$accelerator_type") worker(s)"
  run "${create[@]}"
}

step_install() {
  # shellcheck disable=SC2088  # expanded on the worker
  local fetch uv="~/.local/bin/uv" py="$REMOTE_VENV/bin/python"
  if [[ -n $repo ]]; then
    fetch="rm -rf $REMOTE_REPO && git clone --quiet $(quote "$repo") $REMOTE_REPO"
    fetch+=" && git -C $REMOTE_REPO checkout --quiet $(quote "$ref")"
  else
    local root tarball="${TMPDIR:-/tmp}/skipless_jax-$name.tgz"
    root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel 2>/dev/null) ||
      usage_error "install copies a git checkout; this is not one (use --repo URL)"
    local list=(git -C "$root" ls-files -z --cached --others --exclude-standard)
    local pack=(tar -C "$root" --null -T - -czf "$tarball")
    echo "$(quote "${list[@]}") | $(quote "${pack[@]}")"
    ((dry_run)) || "${list[@]}" | "${pack[@]}"
    run "${gcloud_tpu[@]}" scp "$tarball" "$name:$REMOTE_TARBALL" --worker=all "${where[@]}"
    ((dry_run)) || rm -f "$tarball"
    fetch="rm -rf $REMOTE_REPO && mkdir -p $REMOTE_REPO && tar -xzf $REMOTE_TARBALL -C $REMOTE_REPO"
  fi
  # TPU images ship Python 3.10; jax needs a newer one, which uv downloads.
  on_all_workers "$fetch && cd $REMOTE_REPO \
&& { test -x $uv || curl -LsSf https://astral.sh/uv/install.sh | sh; } \
&& rm -rf $REMOTE_VENV && $uv venv --quiet --python $(quote "$python_version") $REMOTE_VENV \
&& $uv pip install --quiet --python $py -r requirements.txt -e . \
&& $uv pip install --quiet --python $py \"jax[tpu]==\$($py -c 'import jax; print(jax.__version__)')\""
}

step_run() {
  if [[ -n $accelerator_type ]]; then
    echo "# $accelerator_type: $(workers_for "$accelerator_type") worker(s), one jax process each"
  fi
  if [[ $workdir != gs://* ]]; then
    echo "$PROG: warning: workdir $workdir is not in a bucket; a multi-host slice needs gs:// for checkpoints" >&2
  fi
  local worker=(bash launch/tpu_worker.sh run "--config=$config" "--workdir=$workdir" "--run-name=$run_name")
  [[ -z $bucket ]] || worker+=("--tfds-data-dir=$bucket/tensorflow_datasets")
  worker+=(-- ${trainer_flags[@]+"${trainer_flags[@]}"})
  if ((${#worker_env[@]})); then worker=(env "${worker_env[@]}" "${worker[@]}"); fi
  if ((detach)); then
    # nohup: the job outlives this ssh session; its log is kept by tpu_worker.sh.
    on_all_workers "cd $REMOTE_REPO && nohup $(quote "${worker[@]}") >/dev/null 2>&1 </dev/null &"
  else
    on_all_workers "cd $REMOTE_REPO && $(quote "${worker[@]}")"
  fi
}

step_logs() {
  ((dry_run)) || mkdir -p "$log_dir"
  # --output-directory writes one file per worker: LOG_DIR/0.log, LOG_DIR/1.log, ...
  run "${gcloud_tpu[@]}" ssh "$name" --worker=all "${where[@]}" \
    "--command=cat ~/skipless_logs/$(quote "$run_name")/worker-*.log" "--output-directory=$log_dir"
}

step_stop() {
  on_all_workers "cd $REMOTE_REPO && bash launch/tpu_worker.sh stop"
}

step_delete() {
  run "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet
}

echo "# TPU $name in $zone${config:+; config=$config workdir=$workdir}"
failed=0
for step in "${steps[@]}"; do
  if ((failed)) && [[ $step != delete ]]; then
    echo "# skipped: $step" >&2
    continue
  fi
  # A subshell outside any ||, so that set -e still stops the step at its first failing command.
  status=0
  (set -e; case $step in
    create) step_create ;; install) step_install ;; run) step_run ;;
    logs) step_logs ;; stop) step_stop ;; delete) step_delete ;;
  esac) || status=$?
  if ((status == EXIT_PREEMPTED)) && [[ $step == run ]]; then
    failed=$status  # the trainers saved their step; the slice may be gone (spot): create install run
    echo "$PROG: step 'run' preempted (status $status, checkpoint saved): rerun 'run' (after 'create install' if the VM was reclaimed) to resume" >&2
  elif ((status)); then
    failed=$status
    echo "$PROG: step '$step' failed (status $status)" >&2
  fi
done
exit "$failed"

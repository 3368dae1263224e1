#!/usr/bin/env bash
# Runs on every worker of a Cloud TPU VM (launch/tpu_vm.sh starts it on all of them at once).
#
#   tpu_worker.sh stop    kill the processes that hold this worker's TPU chips
#   tpu_worker.sh run --config CFG --workdir DIR [--run-name NAME] [--tfds-data-dir DIR] \
#       [--python PY] [-- TRAINER_FLAGS...]
#
# `run` stops stale processes first (a TPU chip serves one process; a leftover trainer from a
# killed ssh session makes the next start fail with "TPU in use"), then trains with the same
# command line on every worker. On a slice of several workers it sets JAX_COORDINATOR_ADDRESS
# (worker 0, port 8482 as in jax's own TPU detection), JAX_NUM_PROCESSES (the workers) and
# JAX_PROCESS_ID (this worker), read from the VM's metadata server, or from TPU_WORKER_HOSTNAMES
# and TPU_WORKER_ID where those are set (GKE sets them; tests set them too).
# The log is kept in ~/skipless_logs/RUN/worker-ID.log, copied to WORKDIR/launch_logs/ when
# the trainer exits, and streamed to stdout with a "[worker ID]" prefix.
# Exit status: the trainer's: 0 finished, 75 preempted (it saved its step: run again to resume).
#
# Settings that matter (pass them with --env on tpu_vm.sh, or export them here):
#   LIBTPU_INIT_ARGS      XLA TPU compiler flags, e.g. --xla_tpu_enable_latency_hiding_scheduler=true
#   TPU_STDERR_LOG_LEVEL  0 prints libtpu's own log to stderr (debugging a start that hangs)
set -euo pipefail

readonly PROG=tpu_worker.sh
readonly EXIT_PREEMPTED=75  # the trainer's status after it saved on SIGTERM or a preemption notice
readonly USAGE="usage: $PROG stop | run --config CFG --workdir DIR [--run-name NAME] \
[--tfds-data-dir DIR] [--python PY] [--dry-run] [-- TRAINER_FLAGS...]"

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

metadata() {  # $1: a key of this VM's instance attributes
  curl -sf -H 'Metadata-Flavor: Google' \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}

stop_stale() {
  local devices pids
  # /dev/accel* on TPU v2-v4, /dev/vfio/N on v5e, v5p and v6e.
  devices=$(compgen -G '/dev/accel*'; compgen -G '/dev/vfio/[0-9]*') || true
  if [[ -n $devices ]]; then
    # shellcheck disable=SC2086  # one device path per word
    pids=$(sudo lsof -t $devices 2>/dev/null | sort -u | tr '\n' ' ') || true
    # shellcheck disable=SC2086  # one pid per word
    [[ -z ${pids// /} ]] || run sudo kill -9 $pids
  fi
  run sudo rm -f /tmp/libtpu_lockfile  # left behind by a killed process; blocks the next start
}

command=${1:-}
case $command in
  -h|--help) show_help; exit 0 ;;
  stop|run) shift ;;
  '') usage_error "missing command (stop or run)" ;;
  *) usage_error "unknown command '$command' (allowed: stop, run)" ;;
esac

config='' workdir='' run_name='' tfds_data_dir='' python=${PYTHON:-$HOME/skipless_venv/bin/python}
dry_run=0 trainer_flags=()
while (($#)); do
  case $1 in
    --) shift; trainer_flags=("$@"); break ;;
    --dry-run) dry_run=1; shift; continue ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
  esac
  if (($# < 2)) || [[ $2 == --* ]]; then usage_error "$1 needs a value"; fi
  case $1 in
    --config) config=$2 ;;
    --workdir) workdir=$2 ;;
    --run-name) run_name=$2 ;;
    --tfds-data-dir) tfds_data_dir=$2 ;;
    --python) python=$2 ;;
    *) usage_error "unknown option $1" ;;
  esac
  shift 2
done

if [[ $command == stop ]]; then
  stop_stale
  exit 0
fi

[[ -n $config ]] || usage_error "missing required --config"
[[ -n $workdir ]] || usage_error "missing required --workdir"
run_name=${run_name:-${workdir##*/}}
id=${TPU_WORKER_ID:-} endpoints=${TPU_WORKER_HOSTNAMES:-}
[[ -n $id ]] || id=$(metadata agent-worker-number) ||
  usage_error "cannot read agent-worker-number from the metadata server (not a TPU VM? set TPU_WORKER_ID)"
[[ -n $endpoints ]] || endpoints=$(metadata worker-network-endpoints) ||
  usage_error "cannot read worker-network-endpoints from the metadata server (set TPU_WORKER_HOSTNAMES)"
[[ $id =~ ^[0-9]+$ ]] || usage_error "worker id must be a non-negative integer, got '$id'"
IFS=, read -r -a workers <<<"$endpoints"
coordinator=${workers[0]}
coordinator=${coordinator##*:}  # entries are HOST, or NAME:ID:IP in older images
log="$HOME/skipless_logs/$run_name/worker-$id.log"

stop_stale
train_env=(JAX_PLATFORMS=tpu)  # fail at start instead of falling back to CPU when the TPU is busy
if ((${#workers[@]} > 1)); then
  train_env+=("JAX_COORDINATOR_ADDRESS=$coordinator:8482" "JAX_NUM_PROCESSES=${#workers[@]}"
    "JAX_PROCESS_ID=$id")
fi
[[ -z $tfds_data_dir ]] || train_env+=("TFDS_DATA_DIR=$tfds_data_dir")
train=(env "${train_env[@]}" "$python" -m skipless_jax.main "--config=$config" "--workdir=$workdir"
  ${trainer_flags[@]+"${trainer_flags[@]}"})
echo "$(quote "${train[@]}")  # log: $log"
if [[ $workdir == gs://* ]]; then
  keep=(gcloud storage cp "$log" "$workdir/launch_logs/worker-$id.log")
else
  keep=(cp "$log" "$workdir/launch_logs/worker-$id.log")
fi
if ((dry_run)); then
  quote "${keep[@]}"
  exit 0
fi

mkdir -p "${log%/*}"
status=0
"${train[@]}" 2>&1 | tee -a "$log" | sed -u "s/^/[worker $id] /" || status=$?
[[ $workdir == gs://* ]] || mkdir -p "$workdir/launch_logs"
quote "${keep[@]}"
"${keep[@]}" || echo "$PROG: could not copy the log to $workdir/launch_logs (kept in $log)" >&2
if ((status == EXIT_PREEMPTED)); then
  echo "$PROG: worker $id preempted (checkpoint saved in $workdir): run again to resume (exit status $EXIT_PREEMPTED)" >&2
fi
exit "$status"

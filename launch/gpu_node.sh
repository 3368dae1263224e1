#!/usr/bin/env bash
# Train one config on one machine.
#
# Default: one process that drives every local GPU (jax sees them all as local devices).
# --num-processes N: N local processes joined through jax.distributed on 127.0.0.1, each with
# its share of the GPUs: the code path of an N-node job, rehearsed on one machine. With
# --platform cpu it runs anywhere (each process gets --cpu-devices fake CPU devices, collectives
# over gloo), which is how the tests exercise the multi-process trainer.
#
#   launch/gpu_node.sh --config configs/quickstart.py --workdir /data/runs/qs
#   launch/gpu_node.sh --config 'configs/quickstart.py:skip_sab=False' --workdir /data/runs/qs \
#       -- --config.seed=1
#   launch/gpu_node.sh --platform cpu --num-processes 2 --config configs/quickstart.py \
#       --workdir /tmp/qs2 --dry-run
#
# The dense evaluations of the DINO configs are a second command, on the finished workdir, on
# one machine (docs/dino.md; each named evaluator writes WORKDIR/eval/<name>.json):
#   python -m skipless_jax.evaluate --workdir /data/runs/dino \
#       --config 'configs/dino_vits_skipless.py:dense=all,dense_root=/data/dense' \
#       --only voc_lin,voc_ms,ade_lin,ade_ms,cocostuff_lin,voc07_tokencut,voc12_tokencut,coco20k_tokencut
#
# docs/launch.md: set-up, where outputs land, resuming, and what the common failures mean.
#
# Settings that matter on GPUs (export them before calling; what you set is kept):
#   XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true
#       lets XLA overlap collectives with compute; added here on GPU unless XLA_FLAGS names it.
#   XLA_PYTHON_CLIENT_MEM_FRACTION=.90   JAX preallocates 75% of each GPU by default.
#   XLA_PYTHON_CLIENT_PREALLOCATE=false  allocate on demand (slower; for sharing a GPU or debugging).
#   NCCL_DEBUG=INFO                      print NCCL's transport choice when a collective hangs.
#   NCCL_P2P_DISABLE=1                   only if the GPUs hang in their first all-reduce (broken P2P).
# Per-process logs go to --log-dir (default WORKDIR/launch_logs) and stream here as "[pI] line".
# When a process fails, or on Ctrl-C, the others get SIGTERM (they checkpoint and stop), then
# SIGKILL after --grace seconds (default 60).
# Exit status: 0 the run finished; 75 preempted (a trainer exited 75 after saving its step, or
# this script got SIGTERM): rerun the same command to resume, e.g. in a retry loop
#   until launch/gpu_node.sh ...; do (($? == 75)) || break; done
# 130 Ctrl-C; otherwise the first failing process's status (2: bad usage of this script).
set -euo pipefail

readonly PROG=gpu_node.sh
readonly EXIT_PREEMPTED=75  # the trainer's status after it saved on SIGTERM or a preemption notice
readonly USAGE="usage: $PROG --config CFG --workdir DIR [--platform gpu|cpu] [--num-processes N] \
[--num-gpus G] [--cpu-devices K] [--port PORT] [--grace SECONDS] [--log-dir DIR] [--python PY] [--dry-run] \
[-- TRAINER_FLAGS...]"

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
      line+=" '${word//\'/\'\\\'\'}'"
    fi
  done
  printf '%s\n' "${line# }"
}

# A process that exited but was not yet reaped still answers `kill -0`: look at its state.
alive() {
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $state != Z* ]]
}

config='' workdir='' platform=gpu num_processes=1 num_gpus='' cpu_devices=1 port=12355
log_dir='' grace=60 python=${PYTHON:-python3} dry_run=0
trainer_flags=()
while (($#)); do
  case $1 in
    --) shift; trainer_flags=("$@"); break ;;
    --dry-run) dry_run=1; shift; continue ;;
    -h|--help) show_help; exit 0 ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
  esac
  if (($# < 2)) || [[ $2 == --* ]]; then usage_error "$1 needs a value"; fi
  case $1 in
    --config) config=$2 ;;
    --workdir) workdir=$2 ;;
    --platform) platform=$2 ;;
    --num-processes) num_processes=$2 ;;
    --num-gpus) num_gpus=$2 ;;
    --cpu-devices) cpu_devices=$2 ;;
    --port) port=$2 ;;
    --grace) grace=$2 ;;
    --log-dir) log_dir=$2 ;;
    --python) python=$2 ;;
    *) usage_error "unknown option $1" ;;
  esac
  shift 2
done

[[ -n $config ]] || usage_error "missing required --config"
[[ -n $workdir ]] || usage_error "missing required --workdir"
[[ $platform == gpu || $platform == cpu ]] ||
  usage_error "unknown accelerator type --platform '$platform' (allowed: gpu, cpu)"
[[ $num_processes =~ ^[1-9][0-9]*$ ]] || usage_error "--num-processes must be a positive integer, got '$num_processes'"
[[ $cpu_devices =~ ^[1-9][0-9]*$ ]] || usage_error "--cpu-devices must be a positive integer, got '$cpu_devices'"
[[ $grace =~ ^[0-9]+$ ]] || usage_error "--grace must be a number of seconds, got '$grace'"
if ! [[ $port =~ ^[0-9]+$ ]] || ((port < 1 || port > 65535)); then
  usage_error "--port must be in 1..65535, got '$port'"
fi
if [[ -z $log_dir ]]; then
  # Logs beside the checkpoints, unless the workdir is a bucket that tee cannot write to.
  if [[ $workdir == *://* ]]; then log_dir="launch_logs/${workdir##*/}"; else log_dir="$workdir/launch_logs"; fi
fi

common_env=()
if [[ $platform == gpu ]]; then
  xla_flags=${XLA_FLAGS:-}
  [[ $xla_flags == *xla_gpu_enable_latency_hiding_scheduler* ]] ||
    xla_flags="${xla_flags:+$xla_flags }--xla_gpu_enable_latency_hiding_scheduler=true"
  common_env+=(JAX_PLATFORMS=cuda "XLA_FLAGS=$xla_flags")
  if ((num_processes > 1)); then
    if [[ -z $num_gpus ]]; then
      command -v nvidia-smi >/dev/null || usage_error "--num-gpus is needed when nvidia-smi is not installed"
      num_gpus=$(nvidia-smi -L | grep -c '^GPU')
    fi
    if ! [[ $num_gpus =~ ^[1-9][0-9]*$ ]] || ((num_gpus % num_processes)); then
      usage_error "--num-gpus ($num_gpus) must be a positive multiple of --num-processes ($num_processes)"
    fi
  fi
else
  common_env+=(JAX_PLATFORMS=cpu "JAX_NUM_CPU_DEVICES=$cpu_devices")
fi
if ((num_processes > 1)); then
  # Same variables a multi-node job sets; the trainer reads them as the jax.distributed flags.
  common_env+=("JAX_COORDINATOR_ADDRESS=127.0.0.1:$port" "JAX_NUM_PROCESSES=$num_processes")
fi

# Sets `cmd` to process $1's command line.
process_command() {
  local i=$1 proc_env=() per
  if ((num_processes > 1)); then
    proc_env+=("JAX_PROCESS_ID=$i")
    if [[ $platform == gpu ]]; then
      per=$((num_gpus / num_processes))
      # JAX_LOCAL_DEVICE_IDS rather than CUDA_VISIBLE_DEVICES: NCCL still sees every GPU for P2P.
      proc_env+=("JAX_LOCAL_DEVICE_IDS=$(seq -s, $((i * per)) $((i * per + per - 1)))")
    fi
  fi
  cmd=(env "${common_env[@]}" ${proc_env[@]+"${proc_env[@]}"} "$python" -m skipless_jax.main
    "--config=$config" "--workdir=$workdir" ${trainer_flags[@]+"${trainer_flags[@]}"})
}

echo "# $num_processes process(es) on $platform; config=$config workdir=$workdir logs=$log_dir"
for ((i = 0; i < num_processes; i++)); do
  process_command "$i"
  echo "$(quote "${cmd[@]}")  # log: $log_dir/process-$i.log"
done
((dry_run)) && exit 0

mkdir -p "$log_dir"
pids=() stop_since='' status='' interrupted='' preempted=0
# SIGTERM first: the trainer saves a checkpoint and stops at its next step. Whatever still runs
# after --grace seconds (e.g. blocked in a collective with a dead peer) gets SIGKILL.
stop_all() {
  stop_since=${stop_since:-$SECONDS}
  if ((${#pids[@]})); then kill -TERM "${pids[@]}" 2>/dev/null || true; fi
}
# Ctrl-C ends the run (130); SIGTERM to this script is a preemption: the trainers save, exit 75.
trap 'echo "$PROG: interrupted; sending SIGTERM to the trainers" >&2; interrupted=${interrupted:-130}; stop_all' INT
trap 'echo "$PROG: terminated; sending SIGTERM to the trainers" >&2; interrupted=${interrupted:-$EXIT_PREEMPTED}; stop_all' TERM
for ((i = 0; i < num_processes; i++)); do
  [[ -n $stop_since ]] && break  # Ctrl-C or SIGTERM while starting: start no more (the rest got SIGTERM)
  process_command "$i"
  "${cmd[@]}" > >(tee "$log_dir/process-$i.log" | sed -u "s/^/[p$i] /") 2>&1 &
  pids[i]=$!
done
# A Ctrl-C or SIGTERM between a start and its `pids[i]=$!` missed that process: stop it now too.
if [[ -n $stop_since ]]; then stop_all; fi

while ((${#pids[@]})); do
  for i in "${!pids[@]}"; do
    alive "${pids[i]}" && continue
    rc=0
    wait "${pids[i]}" || rc=$?
    unset 'pids[i]'
    if ((rc == EXIT_PREEMPTED)); then
      # Saved and stopped on a preemption notice or SIGTERM; the peers got it too, or get it now.
      if ((!preempted)) && [[ -z $interrupted ]]; then
        echo "$PROG: process $i was preempted (checkpoint saved); stopping the others" >&2
      fi
      preempted=1
      stop_all
    elif ((rc != 0)) && [[ -z $status ]] && ! { [[ -n $stop_since ]] && ((rc > 128)); }; then
      # (A process that died of the SIGTERM or SIGKILL sent here was stopped, not failed.)
      status=$rc
      # The survivors would block in their next collective until the heartbeat timeout.
      echo "$PROG: process $i exited with status $rc (log: $log_dir/process-$i.log); stopping the others" >&2
      stop_all
    fi
  done
  if [[ -n $stop_since ]] && ((SECONDS - stop_since > grace && ${#pids[@]})); then
    kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  sleep 1
done
wait  # let the log pipes drain
final=${status:-${interrupted:-0}}
if [[ -z $status && -z $interrupted ]] && ((preempted)); then final=$EXIT_PREEMPTED; fi
if ((final == EXIT_PREEMPTED)); then
  echo "$PROG: preempted; the trainers saved a checkpoint in $workdir: rerun the same command to resume (exit status $EXIT_PREEMPTED)" >&2
fi
exit "$final"

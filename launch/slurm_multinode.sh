#!/usr/bin/env bash
# Train one config on several GPU nodes under SLURM: one process per node drives all of that
# node's GPUs; process 0 runs on the first node of the allocation and is the coordinator.
#
# From a login node the script submits itself with sbatch; inside an allocation (the sbatch job,
# or an salloc shell) it starts one process per node with srun:
#   launch/slurm_multinode.sh --nodes 4 --gpus-per-node 8 --partition gpu --time 24:00:00 \
#       --config configs/quickstart.py --workdir /shared/runs/qs -- --config.seed=1
#   salloc --nodes 2 --gpus-per-node 8 --exclusive
#   launch/slurm_multinode.sh --config configs/quickstart.py --workdir /shared/runs/qs
#
# The DINO configs' dense evaluations run after training as their own job on one node (not
# inside the training job): launch/gpu_node.sh's header and docs/dino.md give the command.
# docs/launch.md: set-up, where outputs land, resuming, and what the common failures mean.
#
# Every process gets JAX_COORDINATOR_ADDRESS=<first node of SLURM_JOB_NODELIST>:PORT,
# JAX_NUM_PROCESSES=<nodes> and JAX_PROCESS_ID=$SLURM_PROCID, which the trainer hands to
# jax.distributed.initialize. The workdir must be on a filesystem that every node sees.
# Per-process logs: LOG_DIR/process-I.log (default WORKDIR/launch_logs); the job's own output,
# with each line labelled by process, is LOG_DIR/JOBNAME-JOBID.out.
#
# Preemption: sbatch sends SIGTERM 5 minutes before the time limit; the trainers save their step
# and exit 75. The job then requeues itself (scontrol requeue; submitted with --requeue) and
# resumes from that checkpoint, at most --max-requeues times (default 10; 0: never); a job that
# is not requeued exits 75: submit the same command again to resume. Exit status: 0 the run
# finished, 75 preempted, 2 bad usage, otherwise the failing task's status.
#
# Settings that matter (export them before calling; sbatch and srun pass your environment on):
#   XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true
#       overlap collectives with compute; added here unless XLA_FLAGS already names it.
#   XLA_PYTHON_CLIENT_MEM_FRACTION=.90   JAX preallocates 75% of each GPU by default.
#   NCCL_SOCKET_IFNAME=ib0 (or eth0, ...) the interface NCCL bootstraps on; set it when NCCL
#                                        picks docker0 or lo and the first collective hangs.
#   NCCL_IB_HCA=mlx5                     which InfiniBand adapters to use; NCCL_IB_DISABLE=1
#                                        falls back to TCP sockets (works, but slow).
#   NCCL_DEBUG=INFO                      print the transports NCCL chose; read it first on a hang.
set -euo pipefail

readonly PROG=slurm_multinode.sh
readonly USAGE="usage: $PROG --config CFG --workdir DIR [--nodes N] [--gpus-per-node G] \
[--partition P] [--account A] [--time T] [--job-name J] [--cpus-per-task C] [--sbatch-arg ARG]... \
[--port PORT] [--log-dir DIR] [--max-requeues N] [--python PY] [--dry-run] [-- TRAINER_FLAGS...]"
readonly EXIT_PREEMPTED=75  # the trainer's status after it saved on SIGTERM or a preemption notice

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

run() {  # print the command; run it unless --dry-run
  quote "$@"
  ((dry_run)) || "$@"
}

positive_int() {  # $1 name, $2 value
  [[ $2 =~ ^[1-9][0-9]*$ ]] || usage_error "$1 must be a positive integer, got '$2'"
}

config='' workdir='' nodes='' gpus_per_node='' partition='' account='' time_limit=''
job_name=skipless_jax cpus_per_task='' port='' log_dir='' python=${PYTHON:-python3} dry_run=0
max_requeues=10
sbatch_args=() trainer_flags=()
while (($#)); do
  case $1 in
    --) shift; trainer_flags=("$@"); break ;;
    --dry-run) dry_run=1; shift; continue ;;
    -h|--help) show_help; exit 0 ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
  esac
  # A value never starts with --, except what is handed to sbatch as it is.
  if (($# < 2)) || [[ $2 == --* && $1 != --sbatch-arg ]]; then usage_error "$1 needs a value"; fi
  case $1 in
    --config) config=$2 ;;
    --workdir) workdir=$2 ;;
    --nodes) nodes=$2 ;;
    --gpus-per-node) gpus_per_node=$2 ;;
    --partition) partition=$2 ;;
    --account) account=$2 ;;
    --time) time_limit=$2 ;;
    --job-name) job_name=$2 ;;
    --cpus-per-task) cpus_per_task=$2 ;;
    --sbatch-arg) sbatch_args+=("$2") ;;
    --port) port=$2 ;;
    --log-dir) log_dir=$2 ;;
    --max-requeues) max_requeues=$2 ;;
    --python) python=$2 ;;
    *) usage_error "unknown option $1" ;;
  esac
  shift 2
done

[[ -n $config ]] || usage_error "missing required --config"
[[ -n $workdir ]] || usage_error "missing required --workdir"
[[ -z $nodes ]] || positive_int --nodes "$nodes"
[[ -z $gpus_per_node ]] || positive_int --gpus-per-node "$gpus_per_node"
[[ -z $cpus_per_task ]] || positive_int --cpus-per-task "$cpus_per_task"
[[ $max_requeues =~ ^[0-9]+$ ]] || usage_error "--max-requeues must be a non-negative integer, got '$max_requeues'"
if [[ -n $port ]] && { ! [[ $port =~ ^[0-9]+$ ]] || ((port < 1 || port > 65535)); }; then
  usage_error "--port must be in 1..65535, got '$port'"
fi
[[ -n $log_dir ]] || log_dir="$workdir/launch_logs"

if [[ -z ${SLURM_JOB_ID:-} ]]; then
  # Outside an allocation: submit this same script; in the job it takes the branch below.
  [[ -n $nodes ]] || usage_error "missing required --nodes (outside an allocation)"
  script=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  # SIGTERM 5 min before the time limit: the trainer checkpoints and exits 75, and the job
  # requeues itself (--requeue allows it; --open-mode=append keeps the output of every attempt).
  submit=(sbatch "--nodes=$nodes" --ntasks-per-node=1 --exclusive "--job-name=$job_name"
    "--output=$log_dir/%x-%j.out" "--chdir=$PWD" --signal=TERM@300 --requeue --open-mode=append)
  [[ -z $gpus_per_node ]] || submit+=("--gpus-per-node=$gpus_per_node")
  [[ -z $cpus_per_task ]] || submit+=("--cpus-per-task=$cpus_per_task")
  [[ -z $partition ]] || submit+=("--partition=$partition")
  [[ -z $account ]] || submit+=("--account=$account")
  [[ -z $time_limit ]] || submit+=("--time=$time_limit")
  submit+=(${sbatch_args[@]+"${sbatch_args[@]}"} "$script" --nodes "$nodes" --config "$config"
    --workdir "$workdir" --log-dir "$log_dir" --max-requeues "$max_requeues" --python "$python")
  [[ -z $port ]] || submit+=(--port "$port")
  submit+=(-- ${trainer_flags[@]+"${trainer_flags[@]}"})
  ((dry_run)) || mkdir -p "$log_dir"  # sbatch does not create the directory of --output
  run "${submit[@]}"
  exit 0
fi

# Inside an allocation: one process per node, the first node coordinates.
allocated=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}
[[ -n $allocated ]] || usage_error "SLURM_JOB_ID is set but SLURM_JOB_NUM_NODES is not: not a SLURM job?"
if [[ -n $nodes && $nodes != "$allocated" ]]; then
  usage_error "--nodes $nodes but the allocation has $allocated nodes"
fi
[[ -n ${SLURM_JOB_NODELIST:-} ]] || usage_error "SLURM_JOB_NODELIST is not set"
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
coordinator_host=${hosts%%$'\n'*}
# Same port rule as jax's own SLURM detection: the ephemeral range, distinct per job.
port=${port:-$((SLURM_JOB_ID % 4096 + 61440))}

xla_flags=${XLA_FLAGS:-}
[[ $xla_flags == *xla_gpu_enable_latency_hiding_scheduler* ]] ||
  xla_flags="${xla_flags:+$xla_flags }--xla_gpu_enable_latency_hiding_scheduler=true"
step=(env JAX_PLATFORMS=cuda "XLA_FLAGS=$xla_flags" "JAX_COORDINATOR_ADDRESS=$coordinator_host:$port"
  "JAX_NUM_PROCESSES=$allocated" "SKIPLESS_LOG_DIR=$log_dir"
  srun "--nodes=$allocated" "--ntasks=$allocated" --ntasks-per-node=1 --kill-on-bad-exit=1 --label)
# srun no longer inherits the job's --cpus-per-task (SLURM >= 22.05): pass it on explicitly.
[[ -z ${SLURM_CPUS_PER_TASK:-} ]] || step+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
# Inside each task: its rank becomes the jax process id, and its output is also kept per process.
# shellcheck disable=SC2016  # expanded by the task's shell, not here
# Each task also leaves its exit status in process-I.status: srun reports the highest status, or
# the signal of a task it killed, so the tasks' own statuses tell whether all of them stopped
# preempted (75) rather than failed.
task='set -o pipefail; export JAX_PROCESS_ID=$SLURM_PROCID; "$@" 2>&1 | tee "$SKIPLESS_LOG_DIR/process-$SLURM_PROCID.log"; '
# shellcheck disable=SC2016
task+='rc=$?; echo "$rc" > "$SKIPLESS_LOG_DIR/process-$SLURM_PROCID.status"; exit "$rc"'
step+=(bash -c "$task" skipless_task "$python" -m skipless_jax.main "--config=$config"
  "--workdir=$workdir" ${trainer_flags[@]+"${trainer_flags[@]}"})
echo "# $allocated process(es), one per node; coordinator $coordinator_host:$port; logs $log_dir"
echo "# exit status $EXIT_PREEMPTED (preempted, checkpoint saved): scontrol requeue $SLURM_JOB_ID, at most $max_requeues times"
if ((dry_run)); then
  run "${step[@]}"
  exit 0
fi
mkdir -p "$log_dir"
rm -f "$log_dir"/process-*.status
status=0
run "${step[@]}" || status=$?
preempted=0
if ((status == EXIT_PREEMPTED)); then
  preempted=1
elif ((status != 0)); then
  codes=$(cat "$log_dir"/process-*.status 2>/dev/null | sort -u) || true
  # Some task exited 75 and none failed otherwise (the rest were killed by srun --kill-on-bad-exit).
  if grep -qx "$EXIT_PREEMPTED" <<<"$codes" && ! grep -qvxE "0|$EXIT_PREEMPTED" <<<"$codes"; then preempted=1; fi
fi
if ((preempted)); then
  restarts=${SLURM_RESTART_COUNT:-0}
  if ((restarts >= max_requeues)); then
    echo "$PROG: preempted (checkpoint saved); not requeued after $restarts of --max-requeues $max_requeues: submit the same command again to resume" >&2
  elif scontrol requeue "$SLURM_JOB_ID"; then
    echo "$PROG: preempted (checkpoint saved); job $SLURM_JOB_ID requeued (restart $((restarts + 1)) of at most $max_requeues): it resumes from the checkpoint" >&2
  else
    echo "$PROG: preempted (checkpoint saved); scontrol could not requeue job $SLURM_JOB_ID (an salloc shell, or not --requeue): submit the same command again to resume" >&2
  fi
  exit "$EXIT_PREEMPTED"
fi
exit "$status"

#!/usr/bin/env bash
# Runs ksjax on a GPU cluster, one process per host owning all of that host's GPUs, under SLURM
# or over plain ssh.
#
#   experiments/launch_gpu_cluster.sh ACTION --scheduler slurm|ssh [options] [-- ksjax.main flags]
#
# Actions:
#   install  (ssh) copy this checkout (git HEAD) to every host and pip-install it with jax[cuda12]
#            (under SLURM, install once on the shared filesystem instead)
#   start    slurm: submit one job (--hosts_count nodes, one task per node) that srun-s ksjax.main;
#            ssh: start ksjax.main on every host in the background (one log and pid file each)
#   logs     stream the logs (slurm: the job's output file; ssh: every host's, lines prefixed by
#            the host); Ctrl-C stops the stream, not the run
#   stop     slurm: scancel the job; ssh: end the run on every host by the pid it wrote
#
# Options:
#   --scheduler slurm|ssh       (required)
#   --config FILE               ksjax config, relative to the repository (for start)
#   --gpus_per_host N           GPUs on each host (default 8)
#   --python PYTHON             interpreter (slurm: the one with ksjax installed; ssh: the one
#                               the venv is made from) (default python3)
#   --dry_run                   print every command, run none
# SLURM:
#   --hosts_count N             nodes (required for start)
#   --partition P, --account A, --time HH:MM:SS   passed to sbatch when given
#   --job JOBID                 the job to follow or stop (default: the last one started here)
# ssh:
#   --hosts h0,h1,...           the hosts; h0 runs the coordinator (required)
#   --port PORT                 the coordinator's port on h0 (default 12355)
#
# The coordinator: under SLURM, jax.distributed.initialize() reads it from SLURM's environment
# (the first node of the job; process id SLURM_PROCID, count SLURM_NTASKS), and the job sets
# JAX_LOCAL_DEVICE_IDS so that each process keeps all of its host's GPUs. Over ssh the script
# sets KSJAX_COORDINATOR_ADDRESS, KSJAX_NUM_PROCESSES and KSJAX_PROCESS_ID for each host, which
# ksjax.distributed reads. Everything after `--` goes to ksjax.main; the workdir must be a
# directory every host sees (Orbax writes each checkpoint from all hosts together).

set -euo pipefail

# shellcheck source=experiments/launch_common.sh
source "$(dirname "$0")/launch_common.sh"

ACTION=${1:-}
[[ -z "$ACTION" || "$ACTION" == -h || "$ACTION" == --help ]] && usage
shift

SCHEDULER=""
CONFIG=""
GPUS=8
PYTHON=python3
DRY_RUN=0
HOSTS_COUNT=""
SBATCH_EXTRA=()
JOB=""
HOSTS=""
PORT=12355
MAIN_ARGS=()

while [[ $# -gt 0 ]]; do
  if [[ "$1" == --?*=* ]]; then  # --option=value is --option value
    set -- "${1%%=*}" "${1#*=}" "${@:2}"
  fi
  case "$1" in
    --scheduler) SCHEDULER=${2:?--scheduler needs a value}; shift 2 ;;
    --config) CONFIG=${2:?--config needs a value}; shift 2 ;;
    --gpus_per_host) GPUS=${2:?--gpus_per_host needs a value}; shift 2 ;;
    --python) PYTHON=${2:?--python needs a value}; shift 2 ;;
    --dry_run) DRY_RUN=1; shift ;;
    --hosts_count) HOSTS_COUNT=${2:?--hosts_count needs a value}; shift 2 ;;
    --partition) SBATCH_EXTRA+=(--partition="${2:?--partition needs a value}"); shift 2 ;;
    --account) SBATCH_EXTRA+=(--account="${2:?--account needs a value}"); shift 2 ;;
    --time) SBATCH_EXTRA+=(--time="${2:?--time needs a value}"); shift 2 ;;
    --job) JOB=${2:?--job needs a value}; shift 2 ;;
    --hosts) HOSTS=${2:?--hosts needs a value}; shift 2 ;;
    --port) PORT=${2:?--port needs a value}; shift 2 ;;
    --) shift; MAIN_ARGS=("$@"); break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || die "--gpus_per_host=$GPUS is not accepted; expected a count >= 1"
DEVICE_IDS=$(seq -s, 0 $((GPUS - 1)))
REPO=$(cd "$(dirname "$0")/.." && pwd)
JOB_FILE="$REPO/.ksjax-slurm-job"
REMOTE_SRC=ksjax
REMOTE_VENV=ksjax-venv
REMOTE_LOG=ksjax.log
REMOTE_PID=ksjax.pid

main_command() {  # python -m ksjax.main with the config and the flags after --
  [[ -n "$CONFIG" ]] || die "--config is required to start a run"
  quote_all "$1" -m ksjax.main --config="$CONFIG" ${MAIN_ARGS[@]+"${MAIN_ARGS[@]}"}
}

# ------------------------------------------------------------------------------------------
# SLURM
# ------------------------------------------------------------------------------------------

slurm_job() {
  if [[ -n "$JOB" ]]; then
    echo "$JOB"
  elif [[ -f "$JOB_FILE" ]]; then
    cat "$JOB_FILE"
  elif [[ "$DRY_RUN" == 1 ]]; then
    echo JOBID
  else
    die "no job: give --job JOBID (none was started from this checkout)"
  fi
}

slurm_start() {
  [[ "$HOSTS_COUNT" =~ ^[1-9][0-9]*$ ]] || die "--hosts_count is required: the number of nodes"
  local main
  main=$(main_command "$PYTHON")
  local submit=(sbatch --parsable --job-name=ksjax --nodes="$HOSTS_COUNT" --ntasks-per-node=1
                --gpus-per-node="$GPUS" --chdir="$REPO" --output="$REPO/ksjax-%j.log"
                ${SBATCH_EXTRA[@]+"${SBATCH_EXTRA[@]}"}
                --wrap="JAX_LOCAL_DEVICE_IDS=$DEVICE_IDS srun $main")
  if [[ "$DRY_RUN" == 1 ]]; then
    run "${submit[@]}"
  else
    local job
    job=$("${submit[@]}")
    echo "$job" > "$JOB_FILE"
    echo "launch_gpu_cluster: submitted job $job; output in $REPO/ksjax-$job.log"
  fi
}

# ------------------------------------------------------------------------------------------
# ssh
# ------------------------------------------------------------------------------------------

host_list() {
  [[ -n "$HOSTS" ]] || die "--hosts h0,h1,... is required with --scheduler ssh"
  local -a hosts
  IFS=, read -r -a hosts <<< "$HOSTS"
  printf '%s\n' "${hosts[@]}"
}

ssh_install() {
  local tarball="${TMPDIR:-/tmp}/ksjax-gpu.tar.gz" host
  run git -C "$REPO" archive --format=tar.gz --output="$tarball" HEAD
  while read -r host; do
    run scp "$tarball" "$host:ksjax.tar.gz"
    run ssh -n "$host" "rm -rf $REMOTE_SRC && mkdir $REMOTE_SRC && tar -xzf ksjax.tar.gz -C \
$REMOTE_SRC && $(quote "$PYTHON") -m venv $REMOTE_VENV && $REMOTE_VENV/bin/pip install -q \
--upgrade pip && $REMOTE_VENV/bin/pip install -q 'jax[cuda12]' && $REMOTE_VENV/bin/pip install \
-q ./$REMOTE_SRC"
  done < <(host_list)
}

ssh_start() {
  local -a hosts
  mapfile -t hosts < <(host_list)
  local main coordinator="${hosts[0]}:$PORT" i
  main=$(main_command "../$REMOTE_VENV/bin/python")
  for i in "${!hosts[@]}"; do
    run ssh -n "${hosts[$i]}" "cd $REMOTE_SRC && KSJAX_COORDINATOR_ADDRESS=$coordinator \
KSJAX_NUM_PROCESSES=${#hosts[@]} KSJAX_PROCESS_ID=$i nohup $main > ../$REMOTE_LOG 2>&1 \
< /dev/null & echo \$! > ../$REMOTE_PID"
  done
}

ssh_logs() {
  local host
  while read -r host; do
    run ssh -n "$host" "tail -n +1 -F $REMOTE_LOG | sed -u 's/^/[$host] /'" &
  done < <(host_list)
  wait
}

ssh_stop() {
  local host
  while read -r host; do
    run ssh -n "$host" "if [ -f $REMOTE_PID ]; then kill \$(cat $REMOTE_PID) 2>/dev/null; \
rm -f $REMOTE_PID; fi"
  done < <(host_list)
}

case "$SCHEDULER:$ACTION" in
  slurm:start) slurm_start ;;
  slurm:logs) run tail -n +1 -F "$REPO/ksjax-$(slurm_job).log" ;;
  slurm:stop) run scancel "$(slurm_job)" ;;
  slurm:install) die "under SLURM install once on the shared filesystem: $PYTHON -m pip install \
'jax[cuda12]' $REPO" ;;
  ssh:install) ssh_install ;;
  ssh:start) ssh_start ;;
  ssh:logs) ssh_logs ;;
  ssh:stop) ssh_stop ;;
  slurm:* | ssh:*) die "unknown action $ACTION; expected install, start, logs or stop" ;;
  *) die "--scheduler=$SCHEDULER is not accepted; expected slurm or ssh" ;;
esac

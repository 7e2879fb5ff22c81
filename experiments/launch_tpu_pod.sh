#!/usr/bin/env bash
# Runs ksjax on a Cloud TPU VM pod slice: create (or reuse) the slice, install ksjax on every
# worker, start `python -m ksjax.main` on all workers at once, stream their logs, stop, delete.
#
#   experiments/launch_tpu_pod.sh ACTION [options] [-- ksjax.main flags]
#
# Actions:
#   up       create the slice unless one of that name exists (then it is reused)
#   install  copy this checkout (git HEAD) to every worker and pip-install it with jax[tpu]
#   start    start the run on every worker (in the background; one log and pid file per worker)
#   logs     stream every worker's log, each line prefixed by the worker's host name (Ctrl-C
#            stops the stream, not the run)
#   stop     end the run on every worker (by the pid it wrote)
#   down     delete the slice
#   launch   up, install, start, logs
#
# Options (or the environment variable in brackets):
#   --name NAME                 slice name [TPU_NAME]                     (required)
#   --zone ZONE                 [TPU_ZONE]                                (required)
#   --project PROJECT           [TPU_PROJECT]; default: gcloud's configured project
#   --accelerator_type TYPE     e.g. v5p-128, v4-64, v5litepod-256 [TPU_TYPE] (for up)
#   --version VERSION           TPU software version, e.g. v2-alpha-tpuv5 [TPU_VERSION] (for up)
#   --spot                      create a Spot slice
#   --config FILE               ksjax config, relative to the repository (for start)
#   --jax_version VERSION       pin jax[tpu]==VERSION on the workers (default: the newest)
#   --python PYTHON             the workers' interpreter for the venv (default python3; jax
#                               needs Python >= 3.11, so pick a software version that has it)
#   --dry_run                   print every command, run none
#
# Everything after `--` goes to ksjax.main, e.g. `-- --config.workdir=/mnt/runs/r1`. The workdir
# must be one directory that every worker sees (a Filestore/NFS mount or a gcsfuse-mounted
# bucket): Orbax writes each checkpoint from all hosts together. On TPU, each worker's
# `jax.distributed.initialize()` finds the slice by itself (ksjax.distributed).

set -euo pipefail

# shellcheck source=experiments/launch_common.sh
source "$(dirname "$0")/launch_common.sh"

ACTION=${1:-}
[[ -z "$ACTION" || "$ACTION" == -h || "$ACTION" == --help ]] && usage
shift

NAME=${TPU_NAME:-}
ZONE=${TPU_ZONE:-}
PROJECT=${TPU_PROJECT:-}
ACCELERATOR=${TPU_TYPE:-}
VERSION=${TPU_VERSION:-}
SPOT=0
CONFIG=""
JAX_VERSION=""
PYTHON=python3
DRY_RUN=0
MAIN_ARGS=()

while [[ $# -gt 0 ]]; do
  if [[ "$1" == --?*=* ]]; then  # --option=value is --option value
    set -- "${1%%=*}" "${1#*=}" "${@:2}"
  fi
  case "$1" in
    --name) NAME=${2:?--name needs a value}; shift 2 ;;
    --zone) ZONE=${2:?--zone needs a value}; shift 2 ;;
    --project) PROJECT=${2:?--project needs a value}; shift 2 ;;
    --accelerator_type) ACCELERATOR=${2:?--accelerator_type needs a value}; shift 2 ;;
    --version) VERSION=${2:?--version needs a value}; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --config) CONFIG=${2:?--config needs a value}; shift 2 ;;
    --jax_version) JAX_VERSION=${2:?--jax_version needs a value}; shift 2 ;;
    --python) PYTHON=${2:?--python needs a value}; shift 2 ;;
    --dry_run) DRY_RUN=1; shift ;;
    --) shift; MAIN_ARGS=("$@"); break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[[ -n "$NAME" ]] || die "--name (or TPU_NAME) is required"
[[ -n "$ZONE" ]] || die "--zone (or TPU_ZONE) is required"

REPO=$(cd "$(dirname "$0")/.." && pwd)
TARBALL="${TMPDIR:-/tmp}/ksjax-$NAME.tar.gz"
# Paths on the workers, relative to the login user's home directory.
REMOTE_SRC=ksjax
REMOTE_VENV=ksjax-venv
REMOTE_LOG=ksjax.log
REMOTE_PID=ksjax.pid

TPU=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && WHERE+=(--project="$PROJECT")

on_all_workers() {
  run "${TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all --command="$1"
}

up() {
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "# reused if this succeeds:"
    run "${TPU[@]}" describe "$NAME" "${WHERE[@]}"
    echo "# else created:"
  elif "${TPU[@]}" describe "$NAME" "${WHERE[@]}" >/dev/null 2>&1; then
    echo "launch_tpu_pod: reusing $NAME"
    return
  fi
  [[ -n "$ACCELERATOR" ]] || die "--accelerator_type (or TPU_TYPE) is required to create $NAME"
  [[ -n "$VERSION" ]] || die "--version (or TPU_VERSION) is required to create $NAME"
  local create=("${TPU[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type="$ACCELERATOR"
                --version="$VERSION")
  [[ "$SPOT" == 1 ]] && create+=(--spot)
  run "${create[@]}"
}

install() {
  run git -C "$REPO" archive --format=tar.gz --output="$TARBALL" HEAD
  run "${TPU[@]}" scp "$TARBALL" "$NAME:ksjax.tar.gz" "${WHERE[@]}" --worker=all
  local jax="jax[tpu]${JAX_VERSION:+==$JAX_VERSION}"
  on_all_workers "rm -rf $REMOTE_SRC && mkdir $REMOTE_SRC && tar -xzf ksjax.tar.gz -C $REMOTE_SRC \
&& $(quote "$PYTHON") -m venv $REMOTE_VENV && $REMOTE_VENV/bin/pip install -q --upgrade pip \
&& $REMOTE_VENV/bin/pip install -q $(quote "$jax") && $REMOTE_VENV/bin/pip install -q ./$REMOTE_SRC"
}

start() {
  [[ -n "$CONFIG" ]] || die "--config is required to start a run"
  local main
  main=$(quote_all "../$REMOTE_VENV/bin/python" -m ksjax.main --config="$CONFIG" \
         ${MAIN_ARGS[@]+"${MAIN_ARGS[@]}"})
  on_all_workers "cd $REMOTE_SRC && nohup $main > ../$REMOTE_LOG 2>&1 < /dev/null & \
echo \$! > ../$REMOTE_PID"
}

logs() {
  on_all_workers "tail -n +1 -F $REMOTE_LOG | sed -u \"s/^/[\$(hostname)] /\""
}

stop() {
  on_all_workers "if [ -f $REMOTE_PID ]; then kill \$(cat $REMOTE_PID) 2>/dev/null; \
rm -f $REMOTE_PID; fi"
}

down() {
  run "${TPU[@]}" delete "$NAME" "${WHERE[@]}" --quiet
}

case "$ACTION" in
  up) up ;;
  install) install ;;
  start) start ;;
  logs) logs ;;
  stop) stop ;;
  down) down ;;
  launch) up; install; start; logs ;;
  *) die "unknown action $ACTION; expected up, install, start, logs, stop, down or launch" ;;
esac

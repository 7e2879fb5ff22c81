#!/usr/bin/env bash
# Starts the regime map's runner, or resumes it after any stop (experiments/regime_map.py):
#
#   experiments/regime_map_runner.sh <clone directory> [commit] [-- regime_map.py arguments]
#
# run from the main checkout's root. The clone (made here if missing, outside the checkout) is
# checked out at the map's commit: the one given, else the one its published runs were made at
# (experiments/results/regime_map/provenance.json). It gets a virtual environment of its own
# (the README's install line) and runs the map with one worker at the lowest priority, mirroring
# each finished pair into this checkout's experiments/results/regime_map and committing it here.
# Arguments after `--` go to regime_map.py: `-- --cells=k8,level4` runs those cells first (the
# order runs are made in is not part of the map's design; every cell is run in the end).
# Prints the runner's pid; its log is <clone>/regime_map.log.
set -euo pipefail
usage="usage: experiments/regime_map_runner.sh <clone directory> [commit] [-- arguments]"
clone=${1:?$usage}
shift
commit=
if [ $# -gt 0 ] && [ "$1" != "--" ]; then commit=$1; shift; fi
if [ $# -gt 0 ]; then [ "$1" = "--" ] || { echo "$usage" >&2; exit 2; }; shift; fi
main=$(git rev-parse --show-toplevel)
out="$main/experiments/results/regime_map"
commit=${commit:-$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['commit'])" \
                   "$out/provenance.json")}
[ -d "$clone/.git" ] || git clone -q "$main" "$clone"
git -C "$clone" fetch -q origin
git -C "$clone" checkout -q "$commit"
[ -x "$clone/.venv/bin/python" ] || (cd "$clone" && python3 -m venv .venv \
                                     && .venv/bin/pip install -q -e .)
cd "$clone"
setsid nohup nice -n 19 .venv/bin/python experiments/regime_map.py --workers=1 \
    --mirror="$out" --commit "$@" >> regime_map.log 2>&1 < /dev/null &
pid=$!
echo "$pid" > regime_map.pid
# With autogroup scheduling, nice ranks a process only within its session (docs/results.md, the
# decisive study): lower the runner's whole session so that it yields to everyone else's work.
# Only once setsid has made the runner's session (before, the write would lower this shell's).
for _ in $(seq 50); do [ "$(ps -o sid= -p "$pid" | tr -d ' ')" = "$pid" ] && break; sleep 0.2; done
[ -w "/proc/$pid/autogroup" ] && echo 19 > "/proc/$pid/autogroup" || true
echo "regime map runner: pid $pid at $(git rev-parse --short HEAD) in $clone (log: $clone/regime_map.log)"

# shellcheck shell=bash
# Helpers shared by the launch scripts (sourced, not run): printing or running commands.

# die MESSAGE: prints "PROGRAM: MESSAGE" to stderr and exits with status 2.
die() {
  echo "$(basename "$0" .sh): $*" >&2
  exit 2
}

# quote ARG: ARG quoted like Python's shlex.quote, so printed commands paste back into a shell.
quote() {
  local s=$1
  if [[ -z "$s" ]]; then
    printf "''"
  elif [[ "$s" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\"\'\"\'}"
  fi
}

# quote_all ARG...: the arguments quoted and joined by spaces (Python's shlex.join).
quote_all() {
  local out="" arg
  for arg in "$@"; do
    out+="${out:+ }$(quote "$arg")"
  done
  printf '%s' "$out"
}

# run COMMAND...: runs it, or when DRY_RUN=1 prints it (one line, quoted) instead.
run() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    quote_all "$@"
    echo
  else
    "$@"
  fi
}

# usage: prints the script's header comment (from line 2 to the first blank line) and exits 2.
usage() {
  sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

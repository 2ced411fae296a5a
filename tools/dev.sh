#!/usr/bin/env bash
# One entry point for a fresh machine: creates or reuses a venv per torch version, installs the
# project from its own files (torch pinned by constraints/torch-X.Y.txt), then runs what was asked.
#   tools/dev.sh main [args]   the main job: accel-graph demo (the bundled decoder served from graphs)
#   tools/dev.sh test [args]   the test suite (pytest) on every torch leg, one venv each
#   tools/dev.sh run CMD...    any command inside the venv of the first leg
# Legs: ACCEL_GRAPH_TORCH_LEGS="2.13 2.14" by default (the CPU build of 2.13.0 and the CUDA build of
# 2.14.1, which runs on the CPU); set it to one version to use one venv, e.g. for `main` or `run`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
legs=${ACCEL_GRAPH_TORCH_LEGS:-"2.13 2.14"}
first_leg=${legs%% *}

venv_of() {  # the venv folder of one leg: .venv stays the first leg's, as before the matrix
  if [ "$1" = "2.13" ]; then echo "$root/.venv"; else echo "$root/.venv-$1"; fi
}

ensure_venv() {  # create/refresh the venv of leg $1; reinstall only when its inputs changed
  local leg=$1 venv constraints want stamp
  venv=$(venv_of "$leg")
  constraints="constraints/torch-$leg.txt"
  if [ ! -f "$constraints" ]; then
    echo "tools/dev.sh: no $constraints: legs are $(ls constraints | sed -n 's/^torch-\(.*\)\.txt$/\1/p' | tr '\n' ' ')" >&2
    exit 2
  fi
  stamp="$venv/.accel-graph-installed"
  want=$(cat pyproject.toml setup.py "$constraints" accel_graph/allocator/core/_build.py \
         accel_graph/allocator/core/*.c accel_graph/allocator/core/*.h 2>/dev/null | sha256sum | cut -d' ' -f1)
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "tools/dev.sh: installing the torch $leg leg into ${venv#"$root"/} ..." >&2
    "$venv/bin/python" -m pip install -q -c "$constraints" setuptools wheel cffi torch
    "$venv/bin/python" -m pip install -q -c "$constraints" --no-build-isolation -e '.[test]'
    echo "$want" > "$stamp"
  fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  main)
    ensure_venv "$first_leg"
    export PATH="$(venv_of "$first_leg")/bin:$PATH"
    exec accel-graph demo "$@" ;;
  run)
    ensure_venv "$first_leg"
    export PATH="$(venv_of "$first_leg")/bin:$PATH"
    exec "$@" ;;
  test)
    # Every leg runs the whole suite except the long soak/fuzz tests (marker "slow"), which run
    # on the first leg only: they exercise our own state machines, not torch's version.
    status=0
    summary=""
    for leg in $legs; do
      ensure_venv "$leg"
      extra=()
      [ "$leg" != "$first_leg" ] && extra=(-m "not slow")
      echo "=== torch $leg leg: $("$(venv_of "$leg")/bin/python" -c 'import torch; print(torch.__version__)') ===" >&2
      t0=$(date +%s)
      rc=0
      "$(venv_of "$leg")/bin/python" -m pytest -q "${extra[@]}" "$@" || rc=$?
      summary+="torch $leg leg: exit $rc in $(( $(date +%s) - t0 )) s"$'\n'
      [ "$rc" -ne 0 ] && status=$rc
    done
    printf '%s' "$summary" >&2
    exit "$status" ;;
  *) echo "usage: tools/dev.sh main|test|run CMD..." >&2; exit 2 ;;
esac

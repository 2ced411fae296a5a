#!/usr/bin/env bash
# One entry point for a fresh machine: creates or reuses .venv, installs the project from its own
# files (torch pinned to the 2.13.0 CPU build by constraints/ci.txt), then runs what was asked.
#   tools/dev.sh main [args]   the main job: accel-graph demo (the bundled decoder served from graphs)
#   tools/dev.sh test [args]   the test suite (pytest)
#   tools/dev.sh run CMD...    any command inside the venv
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv="$root/.venv"
stamp="$venv/.accel-graph-installed"
# Reinstall only when something that shapes the install changed (idempotent and quick otherwise).
want=$(cat pyproject.toml setup.py constraints/ci.txt accel_graph/allocator/core/_build.py \
       accel_graph/allocator/core/*.c accel_graph/allocator/core/*.h 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install -q -c constraints/ci.txt setuptools wheel cffi torch==2.13.0
  "$venv/bin/python" -m pip install -q -c constraints/ci.txt --no-build-isolation -e '.[test]'
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  main) exec accel-graph demo "$@" ;;
  test) exec python -m pytest -q "$@" ;;
  run)  exec "$@" ;;
  *) echo "usage: tools/dev.sh main|test|run CMD..." >&2; exit 2 ;;
esac

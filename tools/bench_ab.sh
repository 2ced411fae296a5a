#!/usr/bin/env bash
# Interleaved before/after benchmarks of two trees (old, new, old, new, ... in one sitting), for
# refactors that must not change performance (issues 12 and 25). Each tree needs its own venv at
# TREE/.venv (for example a `git worktree` of the old commit with `pip install -e .`).
#   OLD=/path/to/old NEW=/path/to/new OUTD=out bash tools/bench_ab.sh
#   python tools/bench_ab_summary.py out     # the tables, and out/summary.json
set -uo pipefail
OLD=${OLD:?set OLD to the tree before}
NEW=${NEW:-$(pwd)}
OUTD=${OUTD:-bench-ab}
ROUNDS=${ROUNDS:-5}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
run() {  # tree tag name cmd...
  local tree=$1 tag=$2 name=$3; shift 3
  (cd "$tree" && PATH="$tree/.venv/bin:$PATH" nice -n -10 "$@" --json "$OUTD/${name}_${tag}.json" \
     > "$OUTD/${name}_${tag}.log" 2>&1) || echo "FAILED $name $tag"
}
date -u; uptime
for i in $(seq 1 "$ROUNDS"); do
  for pair in "old:$OLD" "new:$NEW"; do
    tag=${pair%%:*}; tree=${pair#*:}
    run "$tree" "${tag}_$i" bench accel-graph bench
    run "$tree" "${tag}_$i" alloc python tools/bench_allocator.py --runs 5
    [ "$i" -le 3 ] && run "$tree" "${tag}_$i" cap python tools/bench_capture.py
    [ "$i" -le 3 ] && run "$tree" "${tag}_$i" replay python tools/bench_replay.py --repeat 3
    [ "$i" -le 2 ] && run "$tree" "${tag}_$i" cli python tools/bench_alloc_cli.py
    echo "round $i $tag done $(date -u +%T)"
  done
done
date -u; uptime

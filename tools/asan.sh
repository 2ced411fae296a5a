#!/usr/bin/env bash
# Check the allocator's C core with AddressSanitizer and UndefinedBehaviorSanitizer (not in CI).
#
#   tools/asan.sh [pytest args]     default: tests/allocator tests/fuzz
#
# Copies the working tree (tracked and untracked, not ignored files) into a throwaway directory,
# builds the C core (_core, cffi) and the DLPack extension (_dlpack) there with
# -fsanitize=address,undefined, and runs pytest from that copy with the project's interpreter
# (.venv, or $PYTHON: it needs torch, cffi, pytest and hypothesis). The project's own build and
# .venv are not touched. python itself is not instrumented, so libasan must come first in the
# process: it is LD_PRELOADed, with libstdc++ (torch's C++ exceptions need the real one loaded
# before ASan's interceptors). Any ASan or UBSan report stops the run and fails it.
#
# Environment: PYTHON (interpreter), CC (compiler, default gcc), ASAN_KEEP=1 (keep the directory,
# printed at the end), ASAN_OPTIONS / UBSAN_OPTIONS (override the defaults below).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
cc=${CC:-gcc}
if [ ! -x "$python" ]; then
  echo "asan.sh: no interpreter at $python: run tools/dev.sh once, or set PYTHON" >&2
  exit 2
fi
libasan=$(realpath "$($cc -print-file-name=libasan.so)")
libstdcxx=$(realpath "$($cc -print-file-name=libstdc++.so.6)")
for lib in "$libasan" "$libstdcxx"; do
  if [ ! -f "$lib" ]; then
    echo "asan.sh: $cc has no $(basename "$lib") (install the compiler's sanitizer runtime)" >&2
    exit 2
  fi
done

work=$(mktemp -d "${TMPDIR:-/tmp}/accel-graph-asan.XXXXXX")
if [ "${ASAN_KEEP:-0}" = 1 ]; then
  trap 'echo "asan.sh: kept $work"' EXIT
else
  trap 'rm -rf "$work"' EXIT
fi

start=$(date +%s)
# the working tree as it is now, without build outputs (*.so are ignored files)
(cd "$root" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -C "$work" -xf -

# -O1 and frame pointers for readable stacks; the cffi build's own -O2 comes later and wins,
# which is fine: ASan and UBSan work at any level.
san="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g"
echo "asan.sh: building the C core with $san in $work"
(cd "$work" && CC=$cc CFLAGS="$san" LDFLAGS="$san" \
  "$python" setup.py -q build_ext --inplace >"$work/build.log" 2>&1) || {
  cat "$work/build.log" >&2
  echo "asan.sh: build failed" >&2
  exit 1
}

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export PYTHONPATH=$work
export LD_PRELOAD="$libasan $libstdcxx"
cd "$work"
# the run must use the instrumented copy, not the project's build
"$python" - <<'EOF'
import os
import accel_graph.allocator.core._core as core

path = os.path.realpath(core.__file__)
assert path.startswith(os.path.realpath(os.environ["PYTHONPATH"])), path
maps = open("/proc/self/maps").read()
assert "libasan" in maps, "libasan is not loaded"
print("asan.sh: instrumented core:", path)
EOF
if [ $# -eq 0 ]; then
  set -- tests/allocator tests/fuzz
fi
echo "asan.sh: pytest $*"
rc=0
"$python" -m pytest -q -p no:cacheprovider "$@" || rc=$?
echo "asan.sh: pytest exit $rc after $(($(date +%s) - start)) s (build included)"
exit $rc

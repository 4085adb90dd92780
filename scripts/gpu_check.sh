#!/usr/bin/env bash
# GPU check: for a machine with a CUDA GPU, nvcc and its own torch, and no package registry.
# Needs nvcc, cmake, scikit-build-core, pybind11 and pytest installed there. Builds lumen_core
# offline against what is installed (no build isolation, no dependency resolution; the UCX
# module only where the libucx-cu13 wheel and OpenSSL's headers are there, which the
# streamer's CUDA tests need), runs every `cuda`-marked test of every area and every
# bench/*.py that takes --device cuda, and prints a short table. Exit status: non-zero if
# anything failed.
#
#   scripts/gpu_check.sh            # uses `python3` (override: PYTHON=/path/to/python)
#   OUT=/some/dir scripts/gpu_check.sh   # also keeps logs and JSON there
#   WHEELS=/dir/of/wheels scripts/gpu_check.sh   # e.g. the libucx-cu13 wheel, brought along:
#                                   # unpacked into a scratch folder put on PYTHONPATH
#   LUMEN_CUDA_ARCHS=90 scripts/gpu_check.sh     # one architecture: half the build time
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export LUMEN_CUDA=ON LUMEN_UCX=${LUMEN_UCX:-AUTO} LUMEN_CUDA_ARCHS=${LUMEN_CUDA_ARCHS:-80;90}
export PIP_NO_INDEX=1
if [ -n "${WHEELS:-}" ]; then
  site=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-deps --no-compile --target "$site" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

declare -a names=() results=()
failed=0
record() { names+=("$1"); results+=("$2"); case "$2" in ok*) ;; *) failed=1 ;; esac; }
summary() {
  echo
  echo "== summary"
  for i in "${!names[@]}"; do printf '%-24s %s\n' "${names[$i]}" "${results[$i]}"; done
  echo "logs: $OUT"
}

echo "== build (LUMEN_CUDA=ON, LUMEN_UCX=${LUMEN_UCX}, archs ${LUMEN_CUDA_ARCHS})"
if "$PYTHON" -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1; then
  record "build" "ok"
else
  tail -40 "$OUT/build.log"
  record "build" "FAILED (see $OUT/build.log)"
  summary
  exit 1
fi
if "$PYTHON" -c "import lumen_core as l; print('BUILD_INFO', l.BUILD_INFO); assert l.HAS_CUDA, 'no CUDA device seen'"; then
  record "import, HAS_CUDA" "ok"
else
  record "import, HAS_CUDA" "FAILED"
fi

# Only the files that hold `cuda` tests: the rest may import what this machine lacks (its
# grpcio can be older than the gateway stubs need).
mapfile -t cuda_files < <(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | sort)
echo "== pytest -m cuda (${#cuda_files[@]} files)"
"$PYTHON" -m pytest "${cuda_files[@]}" -m cuda -q -p no:cacheprovider --timeout 120 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
if [ "${PIPESTATUS[0]}" -eq 0 ]; then result=ok; else result=FAILED; fi
record "pytest -m cuda" "$result: $(tail -1 "$OUT/pytest_cuda.log")"

# Every bench script that takes --device cuda (gather_bw.py, verify_draft.py, ...).
for bench in bench/*.py; do
  grep -q -- '"--device"' "$bench" || continue
  name=$(basename "$bench" .py)
  echo "== $bench --device cuda"
  if timeout 900 "$PYTHON" "$bench" --device cuda --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"; then
    record "bench $name" "ok ($OUT/$name.json)"
  else
    record "bench $name" "FAILED (see $OUT/$name.log)"
  fi
done

summary
exit $failed

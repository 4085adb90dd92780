#!/usr/bin/env bash
# GPU check: for a machine with a CUDA GPU, nvcc and its own torch, and no package registry.
# Needs nvcc, cmake, scikit-build-core, pybind11 and pytest installed there. Builds lumen_core
# offline against what is installed (no build isolation, no dependency resolution; the UCX
# module only where the libucx-cu13 wheel and OpenSSL's headers are there, which the
# streamer's CUDA tests need), then runs, each under its own timeout and all within a budget
# (GPU_CHECK_BUDGET_S, 480 s by default, for a 15-minute device lease that includes the
# machine's start):
#   bench/verify_draft.py --device cuda       verify_draft_ms rows (B, k, V; host wall, CUDA events)
#   bench/stream_vs_decode.py --device cuda   64 and 256 requests, and a 4,096-token restore
#   the same, restore of 32,768 tokens        (one request count, a short stream)
#   pytest -m cuda                            every `cuda` test of every area
#   bench/gather_bw.py --device cuda --quick
# and writes ONE JSON list of rows to $OUT/gpu_check.json: every bench row (with `bench`), the
# issue-25 metrics (`verify_draft_ms` with B, k, V; `stream_p50_ratio` with requests;
# `restore_vs_h2d` with tokens) and a `check` row per step. The steps run in that order, so a
# slow machine loses the least wanted ones. Exit status: non-zero if anything failed.
#
#   scripts/gpu_check.sh            # uses `python3` (override: PYTHON=/path/to/python)
#   OUT=/some/dir scripts/gpu_check.sh   # also keeps logs and JSON there
#   WHEELS=/dir/of/wheels scripts/gpu_check.sh   # e.g. the libucx-cu13 wheel, brought along:
#                                   # unpacked into a scratch folder put on PYTHONPATH
#   LUMEN_CUDA_ARCHS="80;90" scripts/gpu_check.sh  # default 90 (H100/H200): half the build
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh     # no GPU: no build, no `cuda` tests, benches on
#                                   # the CPU in their quick forms, the same JSON assembly
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
mkdir -p "$OUT"
export LUMEN_CUDA=ON LUMEN_UCX=${LUMEN_UCX:-AUTO} LUMEN_CUDA_ARCHS=${LUMEN_CUDA_ARCHS:-90}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export PIP_NO_INDEX=1
if [ -n "${WHEELS:-}" ]; then
  site=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-deps --no-compile --target "$site" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$DRY_RUN" = 1 ]; then
  device=cpu
  verify_args=(--hot-path-only --calls 3 --threads 2)
  stream_args=(--quick)
  restore_args=(--quick --requests 16 --restore-tokens 512)
  gather_args=(--quick --reps 1 --threads 1)
else
  device=cuda
  verify_args=()
  stream_args=(--requests 64 256)
  restore_args=(--requests 64 --repeats 1 --steps 10 --restore-tokens 32768)
  gather_args=(--quick)
fi

declare -a names=() results=()
failed=0
: >"$OUT/checks.tsv"
record() {
  names+=("$1")
  results+=("$2")
  printf '%s\t%s\n' "$1" "$2" >>"$OUT/checks.tsv"
  case "$2" in ok* | skipped*) ;; *) failed=1 ;; esac
}
summary() {
  echo
  echo "== summary ($SECONDS s)"
  for i in "${!names[@]}"; do printf '%-28s %s\n' "${names[$i]}" "${results[$i]}"; done
  echo "logs: $OUT"
}

# step NAME TIMEOUT_S CMD...: runs CMD under min(TIMEOUT_S, what is left of the budget), logs to
# $OUT/NAME.log, records ok / FAILED / TIMED OUT, or NOT RUN (a failure) when under 20 s are left.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 20 ]; then
    record "$name" "NOT RUN (budget of ${BUDGET_S} s spent)"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit} s): $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -15 "$OUT/$name.log"
  case $rc in
    0) record "$name" "ok" ;;
    124) record "$name" "TIMED OUT after ${limit} s (see $OUT/$name.log)" ;;
    *) record "$name" "FAILED rc=$rc (see $OUT/$name.log)" ;;
  esac
}

if [ "$DRY_RUN" = 1 ]; then
  record "build" "skipped (dry run: the installed lumen_core)"
else
  echo "== build (LUMEN_CUDA=ON, LUMEN_UCX=${LUMEN_UCX}, archs ${LUMEN_CUDA_ARCHS})"
  if "$PYTHON" -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1; then
    record "build" "ok ($SECONDS s)"
  else
    tail -40 "$OUT/build.log"
    record "build" "FAILED (see $OUT/build.log)"
    summary
    exit 1
  fi
  step import_has_cuda 60 "$PYTHON" -c \
    "import lumen_core as l; print('BUILD_INFO', l.BUILD_INFO); assert l.HAS_CUDA, 'no CUDA device seen'"
fi

step verify_draft 150 "$PYTHON" bench/verify_draft.py --device "$device" "${verify_args[@]}" \
  --json "$OUT/verify_draft.json"
step stream_vs_decode 150 "$PYTHON" bench/stream_vs_decode.py --device "$device" "${stream_args[@]}" \
  --json "$OUT/stream_vs_decode.json"
step restore_32k 120 "$PYTHON" bench/stream_vs_decode.py --device "$device" "${restore_args[@]}" \
  --json "$OUT/restore_32k.json"
if [ "$DRY_RUN" = 1 ]; then
  record "pytest_cuda" "skipped (dry run)"
else
  # Only the files that hold `cuda` tests: the rest may import what this machine lacks (its
  # grpcio can be older than the gateway stubs need).
  mapfile -t cuda_files < <(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | sort)
  per_test=()  # pytest-timeout, where installed: one hung test does not take the whole step
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 120)
  step pytest_cuda 240 "$PYTHON" -m pytest "${cuda_files[@]}" -m cuda -q -p no:cacheprovider "${per_test[@]}"
fi
step gather_bw 90 "$PYTHON" bench/gather_bw.py --device "$device" "${gather_args[@]}" \
  --json "$OUT/gather_bw.json"

# One JSON list: every bench row tagged with its bench, the issue-25 metrics, a row per step.
if "$PYTHON" - "$OUT" "$device" >"$OUT/assemble.log" 2>&1 <<'PY'; then
import json
import re
import sys
from pathlib import Path

out, device = Path(sys.argv[1]), sys.argv[2]
# bench_restore's baseline: a pinned host-to-device copy on a GPU, a memcpy on the CPU.
baseline = "pinned_h2d" if device == "cuda" else "memcpy"
rows = []
for name in ("verify_draft", "stream_vs_decode", "restore_32k", "gather_bw"):
    path = out / f"{name}.json"
    if not path.exists():
        continue
    for row in json.loads(path.read_text()):
        rows.append({"bench": name, **row})
        metric, case = row.get("metric"), str(row.get("case", ""))
        if metric == "step_latency_p50_ratio" and name == "stream_vs_decode":
            requests = int(re.match(r"(\d+) requests", case).group(1))
            rows.append(
                {"bench": name, "metric": "stream_p50_ratio", "requests": requests, "device": device, "value": row["ratio"]}
            )
        if metric == "restore_vs_memcpy":
            tokens = int(re.match(r"(\d+) tokens", case).group(1))
            rows.append(
                {
                    "bench": name,
                    "metric": "restore_vs_h2d",
                    "tokens": tokens,
                    "device": device,
                    "baseline": baseline,
                    "gb_per_s": row["value"],
                    "value": row["ratio"],
                }
            )
for line in (out / "checks.tsv").read_text().splitlines():
    name, result = line.split("\t", 1)
    rows.append({"metric": "check", "name": name, "result": result})
(out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
wanted = ("verify_draft_ms", "stream_p50_ratio", "restore_vs_h2d")
for row in rows:
    if row.get("metric") in wanted:
        print(json.dumps(row))
PY
  cat "$OUT/assemble.log"
  record "json" "ok ($OUT/gpu_check.json)"
else
  cat "$OUT/assemble.log"
  record "json" "FAILED (see $OUT/assemble.log)"
fi

summary
exit $failed

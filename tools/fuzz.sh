#!/usr/bin/env bash
# Builds the libFuzzer targets under fuzz/ with clang++ (ASan + UBSan) in
# build-fuzz/ and runs each for SECONDS (default 60) from its seed corpus
# fuzz/corpus/<target>/. New inputs go to build-fuzz/corpus/<target>/, crash
# reproducers to build-fuzz/artifacts/. Prints the executions per target and
# fails if any target crashed.
#
#   bash tools/fuzz.sh [SECONDS] [TARGET...]      e.g. bash tools/fuzz.sh 20 config idx
#   GOSSIP_FUZZ_RUNS=1000000 bash tools/fuzz.sh 3600   stop each target after that many executions
#   build-fuzz/fuzz/fuzz_config CRASH_FILE         replays one input
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
# libFuzzer reads a non-number as 0, which means no limit at all.
if ! [[ $seconds =~ ^[1-9][0-9]*$ ]]; then
  echo "tools/fuzz.sh: SECONDS must be a positive integer, got '$seconds' (usage: bash tools/fuzz.sh [SECONDS] [TARGET...])" >&2
  exit 2
fi
bash tools/setup.sh fuzz
dir=build-fuzz
if [ ! -f $dir/build.ninja ]; then
  CXX=clang++ CC=clang meson setup $dir --buildtype=debugoptimized -Dfuzz=enabled \
    -Db_sanitize=address,undefined -Db_lundef=false \
    -Dcuda=disabled -Ducx=disabled -Ddpdk=disabled -Dexamples=disabled -Dbench=disabled -Dtests=disabled
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=()
  for d in fuzz/corpus/*/; do targets+=("$(basename "$d")"); done
fi
ninja -C $dir "${targets[@]/#/fuzz/fuzz_}"

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
mkdir -p $dir/artifacts
status=0
report=()
for t in "${targets[@]}"; do
  mkdir -p $dir/corpus/$t
  log=$dir/fuzz-$t.log
  echo "== fuzz_$t for $seconds s${GOSSIP_FUZZ_RUNS:+ or $GOSSIP_FUZZ_RUNS executions}"
  rc=0
  opts=()
  [ -f fuzz/$t.dict ] && opts+=(-dict=fuzz/$t.dict)
  [ -n "${GOSSIP_FUZZ_RUNS:-}" ] && opts+=(-runs="$GOSSIP_FUZZ_RUNS")
  $dir/fuzz/fuzz_$t "${opts[@]}" -max_total_time="$seconds" -timeout=25 -print_final_stats=1 \
    -artifact_prefix=$dir/artifacts/$t- $dir/corpus/$t fuzz/corpus/$t >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  if [ "$rc" -ne 0 ]; then
    status=1
    grep -E "ERROR|runtime error|SUMMARY|Test unit written" "$log" | head -20 || true
    report+=("$(printf '%-20s %12s %10s  CRASHED (rc %d, see %s)' "$t" "${execs:-?}" "${rate:-?}" "$rc" "$log")")
  else
    report+=("$(printf '%-20s %12s %10s  0 crashes' "$t" "${execs:-?}" "${rate:-?}")")
  fi
done
printf '%-20s %12s %10s\n' target executions exec/s
printf '%s\n' "${report[@]}"
exit $status

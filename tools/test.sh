#!/usr/bin/env bash
# Sets up, builds, and runs every test suite; suites that cannot run here skip.
#
#   bash tools/test.sh [MESON TEST ARGS]             release build in build/, every suite
#   bash tools/test.sh --sanitize [MESON TEST ARGS]  AddressSanitizer + UBSan build in build-asan/, every suite
#   bash tools/test.sh --tsan [MESON TEST ARGS]      ThreadSanitizer build in build-tsan/: engine, loopback, ucx tests
#
# Sanitizer builds leave out CUDA (nvcc does not take -fsanitize) and stop at
# the first report: any report fails the test that triggered it.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# --sanitize / --tsan anywhere among the arguments; the rest go to meson test.
mode=release
args=()
for a in "$@"; do
  case "$a" in
    --sanitize | --tsan)
      want=asan
      [ "$a" = --tsan ] && want=tsan
      if [ "$mode" != release ] && [ "$mode" != "$want" ]; then
        echo "test.sh: --sanitize and --tsan are two builds; give one of them" >&2
        exit 2
      fi
      mode=$want ;;
    *) args+=("$a") ;;
  esac
done
set -- ${args[@]+"${args[@]}"}

if [ "$mode" = release ]; then
  bash tools/build.sh
  exec meson test -C build --print-errorlogs "$@"
fi

bash tools/setup.sh
# Reports name third-party frames only through these files, each entry with its reason.
supp=$root/tools/sanitizers
# UCX replaces malloc/mmap through its own hooks (to invalidate memory
# registrations); under a sanitizer that owns the allocator those hooks are
# both unneeded here (no registration cache on tcp/posix/self) and a source of
# false reports, so they are off.
export UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none
# Every report also goes to a file under DIR/sanitizer-logs/: a switch or a
# rank started by a test script may have its stderr swallowed, so after the
# suites any file there fails the run.
run_suites() {  # DIR MESON-TEST-ARGS...
  local dir=$1 rc=0
  shift
  meson test -C "$dir" --print-errorlogs "$@" || rc=$?
  if compgen -G "$root/$dir/sanitizer-logs/*" >/dev/null; then
    echo "test.sh: sanitizer reports (from $root/$dir/sanitizer-logs):" >&2
    head -n 60 "$root/$dir"/sanitizer-logs/* >&2
    rc=1
  fi
  return $rc
}
logs_of() { rm -rf "$root/$1/sanitizer-logs"; mkdir -p "$root/$1/sanitizer-logs"; echo "$root/$1/sanitizer-logs"; }

if [ "$mode" = asan ]; then
  dir=build-asan
  if [ ! -f $dir/build.ninja ]; then
    # -O1 and line tables only: the usual sanitizer settings, and half the
    # compile time of -O2 -g on the Eigen-heavy files.
    meson setup $dir --buildtype=plain -Dcpp_args="-O1 -g1 -fno-omit-frame-pointer" -Dcuda=disabled \
      -Db_sanitize=address,undefined -Db_lundef=false
  fi
  ninja -C $dir
  logs=$(logs_of $dir)
  export ASAN_OPTIONS="detect_leaks=1:strict_string_checks=1:log_path=$logs/asan"
  export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp:log_path=$logs/ubsan"
  # The sanitizers slow everything down about 3x: give every timeout that much.
  run_suites $dir --timeout-multiplier 3 "$@"
  exit
fi

dir=build-tsan
if [ ! -f $dir/build.ninja ]; then
  meson setup $dir --buildtype=plain -Dcpp_args="-O1 -g1" -Dcuda=disabled -Ddpdk=disabled \
    -Dexamples=disabled -Dbench=disabled -Db_sanitize=thread -Db_lundef=false
fi
# By default the three suites with threads of their own; with arguments
# (test names, or meson test options that may widen the selection) meson
# test decides, so everything is built.
if [ $# -gt 0 ]; then
  tests=()
  ninja -C $dir
else
  tests=(engine loopback ucx)
  ninja -C $dir tests/test_engine tests/test_loopback tests/test_ucx
fi
logs=$(logs_of $dir)
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp:log_path=$logs/tsan"
run_suites $dir --timeout-multiplier 4 --no-rebuild "${tests[@]}" "$@"

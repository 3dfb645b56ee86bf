#!/usr/bin/env bash
# A cheap check of bench/torch/run.sh's argument handling: bad arguments exit 2
# with a message, --check-args validates the build and exits before anything
# that needs root (namespaces, tc). Not part of `meson test` (it is a bench).
#   bash bench/torch/check_args.sh [BUILD]
set -uo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$SRC/build}
RUN=$SRC/bench/torch/run.sh
fail=0
expect() {  # RC MESSAGE-REGEX ARGS...
  local want=$1 re=$2; shift 2
  local out rc
  out=$(bash "$RUN" "$@" 2>&1); rc=$?
  if [[ $rc != "$want" ]] || ! grep -Eq -- "$re" <<<"$out"; then
    echo "FAIL: run.sh $* → rc $rc (want $want), output:"; echo "$out" | sed 's/^/  /'; fail=1
  else
    echo "ok: run.sh $* → rc $rc"
  fi
}
expect 2 "unknown option --bogus" "$BUILD" --bogus
expect 2 "--rate takes a number > 0" "$BUILD" --rate 0
expect 2 "--rate takes a number > 0" "$BUILD" --rate fast
expect 2 "--rate below 0.01 Mbit/s" "$BUILD" --rate 0.0000001
expect 2 "--epochs takes an integer in 1..9999" "$BUILD" --epochs 99999999999999999999
expect 2 "--seeds takes an integer" "$BUILD" --seeds 0
expect 2 "--epochs takes an integer" "$BUILD" --epochs x
expect 2 "--momentum takes" "$BUILD" --momentum global
expect 2 "--out takes a directory" "$BUILD" --out
expect 2 "--set takes section.key=value" "$BUILD" --set codec
expect 2 "--set takes section.key=value" "$BUILD" --set "codec.name=int 8"
expect 2 "--set train.epochs=5: \[train\] keys are not used here.*--epochs, --train-limit" "$BUILD" --set train.epochs=5
expect 2 "each of 4 workers has only 31 samples, fewer than one batch of 32" "$BUILD" --train-limit 127
expect 2 "shards of 64 and 63 samples make 2 and 1 batches" "$BUILD" --train-limit 255
expect 2 "Fashion-MNIST has 60000 training images" "$BUILD" --train-limit 60001
expect 1 "Python module is missing" /nonexistent --check-args
if compgen -G "$BUILD/python/gossip*.so" >/dev/null; then
  expect 0 "quick — 4 ranks.*1 seed.*250 Mbit/s" "$BUILD" --quick --rate 250 --check-args --out /tmp/unused
  expect 0 "gossip config: --set codec.name=int8 --set policy.name=periodic" "$BUILD" --check-args --set codec.name=int8 --set policy.name=periodic
  expect 1 "unknown codec 'bogus'" "$BUILD" --check-args --set codec.name=bogus
  expect 0 "gossip config: --set codec.name=\"int8\"" "$BUILD" --check-args --set 'codec.name="int8"'
  expect 1 "--set value '\[0,' is not one valid TOML value" "$BUILD" --check-args --set 'topology.edges=[0,'
  expect 1 "the default run's gossip config: .*unknown key 'evry' for policy 'periodic'" "$BUILD" --check-args --set policy.name=periodic --set policy.evry=2
  expect 1 "--out /etc/passwd: is a file" "$BUILD" --check-args --out /etc/passwd
  expect 0 "train_limit 128, " "$BUILD" --check-args --train-limit 128 --out /tmp/unused
fi
exit $fail

#!/usr/bin/env bash
# One short epoch of the example on a slice of Fashion-MNIST; checks its JSON.
set -euo pipefail
exe=$1 src=$2
source "$src/tests/data_or_skip.sh"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$exe" --config "$src/examples/01_fashion_mnist/fashion_mnist.toml" --epochs 1 --set train.train_limit=4000 \
  --set transport.bandwidth_gbps=0 --json "$out/run.json"
/usr/bin/python3 - "$out/run.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert 0.5 < r["accuracy"] <= 1, r["accuracy"]          # one epoch on 4000 samples is well above chance
assert len(r["ranks"]) == 4 and r["bytes_sent"] == sum(x["bytes_sent"] for x in r["ranks"])
assert r["bytes_sent"] > 0 and r["messages"] > 0
print("example smoke: accuracy", r["accuracy"], "bytes", r["bytes_sent"])
PY
# Bad input: an unknown policy is refused with the known names.
if "$exe" --policy sometimes --epochs 1 2>"$out/err"; then echo "unknown policy was accepted" >&2; exit 1; fi
grep -q "unknown policy 'sometimes'; known policies: periodic, drift" "$out/err"
# A bad [policy] key is refused before the report's header and the data load.
if "$exe" --set policy.threshold=-1 --epochs 1 >"$out/stdout" 2>"$out/err"; then echo "policy.threshold = -1 was accepted" >&2; exit 1; fi
grep -q "key 'threshold' of policy 'consensus' must be" "$out/err"
if [ -s "$out/stdout" ]; then echo "the report began before the bad key was refused:" >&2; cat "$out/stdout" >&2; exit 1; fi
# The same for the other kinds of bad input, each refused before the header with
# the key (or flag) named: [transport] keys, the report's path, a loopback config
# in a process started as one of several ranks.
after_header() {  # expected-message args…: refused, maybe after the report's header
  local want=$1; shift
  if "$exe" --epochs 1 "$@" >"$out/stdout" 2>"$out/err"; then echo "accepted: $*" >&2; exit 1; fi
  grep -qF -- "$want" "$out/err" || { echo "for $*: expected '$want', got:" >&2; cat "$out/err" >&2; exit 1; }
}
refused() {  # expected-message args…: refused before the header
  after_header "$@"
  shift
  if [ -s "$out/stdout" ]; then echo "the report began before '$*' was refused:" >&2; cat "$out/stdout" >&2; exit 1; fi
}
refused "--set transport.bandwith_gbps=1: unknown key 'bandwith_gbps' for transport 'loopback' (did you mean 'bandwidth_gbps'?)" \
  --set transport.bandwith_gbps=1
refused "--set transport.latency_us=-5: key 'latency_us' of transport 'loopback' must be in [0, 1e7] microseconds" --set transport.latency_us=-5
refused "--bandwidth-gbps 1e-12: key 'bandwidth_gbps' of transport 'loopback' must be 0 (not emulated) or in [0.001, 1e6]" \
  --bandwidth-gbps 1e-12
refused "unknown transport 'tcp'; known transports: loopback, ucx, switch" --set transport.name=tcp
refused "--json /nonexistent-dir/run.json: cannot write the report there" --json /nonexistent-dir/run.json
# Every worker's report paths, not worker 0's alone.
mkdir -p "$out/per-rank/0"
refused "the directory $out/per-rank/1 does not exist or is not writable" --workers 2 --set "engine.stats=\"$out/per-rank/{rank}/stats.json\""
refused "--set train.lr=inf: key 'lr' must be a number > 0 that a float holds" --set train.lr=inf
refused "protocol 'switch-aggregate' needs transport 'switch'" --protocol switch-aggregate
refused "--set policy.name=sometimes: unknown policy 'sometimes'" --set policy.name=sometimes
refused "--set bench.seed=2: unknown key 'seed' for [bench] (did you mean 'seeds'?)" --set bench.seed=2
refused "--set engine.finish_rounds=2: this program evaluates the ranks' exact push-sum average" --set engine.finish_rounds=2
refused "--bandwidth-gbps: -1 is outside the range: give a number >= 0" --bandwidth-gbps -1
refused "--set policy.name=drift and --policy both set policy.name; give one of them" --policy periodic --set policy.name=drift
refused "--set train.epochs=2 and --epochs both set train.epochs" --set train.epochs=2
refused "--set train.epo chs=2: unknown key 'epo chs' for [train]" --set "train.epo chs=2"
refused "--set codec.block=64: [codec] name = \"auto\" sends uncompressed here (workers as threads), so [codec] block would change nothing" \
  --set codec.block=64
refused "--policy drift: [train] average_every = 4 trains by local SGD's schedule and does not use the [policy]" --set train.average_every=4 \
  --policy drift
# From the data on (a file's content, the run's length): the report's header may be out.
after_header "the directory '$out/none' was given (as [train] data_dir, or to load_fashion_mnist)" --set "train.data_dir=\"$out/none\""
after_header "warmup_steps = 1000 is longer than the whole run (1 epochs of 31 steps = 31 steps)" --set train.train_limit=4000 \
  --set train.warmup_steps=1000
# Test images of another size than the training ones: refused once loaded, not read past their end.
mkdir "$out/mixed"
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz; do
  ln -s "${GOSSIP_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}/$f" "$out/mixed/$f"
done
/usr/bin/python3 - "$out/mixed" <<'PY'
import gzip, struct, sys
n = 10
gzip.open(sys.argv[1] + "/t10k-images-idx3-ubyte.gz", "wb").write(struct.pack(">IIII", 0x803, n, 14, 14) + bytes(n * 196))
gzip.open(sys.argv[1] + "/t10k-labels-idx1-ubyte.gz", "wb").write(struct.pack(">II", 0x801, n) + bytes(n))
PY
if GOSSIP_FASHION_MNIST_DIR="$out/mixed" "$exe" --epochs 1 --set train.train_limit=1000 >/dev/null 2>"$out/err"; then
  echo "test images of another size were accepted" >&2; exit 1
fi
grep -qF "$out/mixed: the training images are 28x28 and the test images 14x14" "$out/err" \
  || { echo "mixed sizes: expected the size error, got:" >&2; cat "$out/err" >&2; exit 1; }
# A data directory set by hand and wrong is named as the variable that set it.
if GOSSIP_FASHION_MNIST_DIR="$out/none" "$exe" --epochs 1 >/dev/null 2>"$out/err"; then echo "a missing data directory was accepted" >&2; exit 1; fi
grep -qF "GOSSIP_FASHION_MNIST_DIR is set to '$out/none': point it at the directory of the IDX files" "$out/err" \
  || { echo "missing data: expected the variable named, got:" >&2; cat "$out/err" >&2; exit 1; }
GOSSIP_RANK=0 GOSSIP_WORLD_SIZE=2 refused "transport 'loopback' runs every worker as a thread of one process, but this process is one of GOSSIP_WORLD_SIZE=2 ranks"
# The same for the switch transport, where this program has it.
switch_set=(--set transport.name=switch --set topology.name=switch --set protocol.name=switch-aggregate)
if GOSSIP_RANK=0 GOSSIP_WORLD_SIZE=2 "$exe" --epochs 1 "${switch_set[@]}" >/dev/null 2>"$out/err"; then
  echo "the switch transport under GOSSIP_WORLD_SIZE=2 was accepted" >&2; exit 1
fi
if ! grep -qF "'switch' was not built into this program" "$out/err"; then
  GOSSIP_RANK=0 GOSSIP_WORLD_SIZE=2 refused "this program runs every worker of transport 'switch' as a thread of one process, but this process is one of GOSSIP_WORLD_SIZE=2 ranks" "${switch_set[@]}"
fi
# A report that cannot be written (a full disk) is an error, not exit 0.
if [ -w /dev/full ]; then
  if "$exe" --epochs 1 --set train.train_limit=2000 --set transport.bandwidth_gbps=0 >/dev/full 2>"$out/err"; then
    echo "a report written to /dev/full exited 0" >&2; exit 1
  fi
  grep -qF "error: writing the report to standard output failed (No space left on device)" "$out/err" \
    || { echo "/dev/full: expected the write error, got:" >&2; cat "$out/err" >&2; exit 1; }
fi
# A worker thread that cannot be started (a low memory or thread limit) is an
# error that says what to do, not an abort. Sanitizer builds reserve far more
# address space than any such limit allows: not there. (ldd's whole output
# first: grep -q in a pipe under pipefail would fail ldd with SIGPIPE.)
if ! grep -qE 'lib(asan|tsan)' <<<"$(ldd "$exe" 2>/dev/null)"; then
  if (ulimit -v 400000 && exec "$exe" --epochs 1 --workers 48 --set topology.name=complete --set train.train_limit=2000 \
      --set transport.bandwidth_gbps=0 >/dev/null 2>"$out/err"); then
    echo "48 workers under ulimit -v 400000 ran: the limit no longer bites, raise the worker count" >&2; exit 1
  fi
  grep -qE "error: cannot start the thread of worker [0-9]+ of 48: .*lower \[train\] workers" "$out/err" \
    || { echo "thread limit: expected the start error, got:" >&2; cat "$out/err" >&2; exit 1; }
fi

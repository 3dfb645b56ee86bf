#!/usr/bin/env bash
# One short epoch of the libtorch CNN example on a slice of Fashion-MNIST (16000 samples); checks its JSON.
#   smoke.sh EXE SOURCE_ROOT          (exit 77 with the reason when EXE is "-": not built)
set -euo pipefail
exe=$1 src=$2
[[ $exe != - ]] || { echo "SKIP: the libtorch example was not built: ${3:-libtorch not found}"; exit 77; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
timeout --kill-after=5 280 "$exe" --config "$src/examples/03_libtorch_cnn/libtorch_cnn.toml" --epochs 1 --set train.train_limit=16000 \
  --set transport.bandwidth_gbps=0 --json "$out/run.json"
/usr/bin/python3 - "$out/run.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert 0.5 < r["accuracy"] <= 1, r["accuracy"]          # 125 steps per worker: well above chance (0.1)
assert len(r["ranks"]) == 4 and r["bytes_sent"] == sum(x["bytes_sent"] for x in r["ranks"])
assert r["bytes_sent"] > 0 and r["messages"] > 0
names = [t["name"] for t in r["ranks"][0]["tensors"]]
assert names == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], names
print("libtorch example smoke: accuracy", r["accuracy"], "bytes", r["bytes_sent"])
PY
# A [train] hidden list longer than the CNN's one fully connected layer is
# refused before the report's header, naming the key.
if "$exe" --set 'train.hidden=[64, 32]' --epochs 1 >"$out/stdout" 2>"$out/err"; then echo "hidden = [64, 32] was accepted" >&2; exit 1; fi
grep -qF -- "--set train.hidden=[64, 32]: key 'hidden' must hold one width for the CNN" "$out/err" || { cat "$out/err" >&2; exit 1; }
if [ -s "$out/stdout" ]; then echo "the report began before the bad key was refused:" >&2; cat "$out/stdout" >&2; exit 1; fi

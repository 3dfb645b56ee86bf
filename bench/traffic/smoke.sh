#!/usr/bin/env bash
# bench/traffic on a slice of the data: checks the JSON schema, the roles and
# the equal-bytes rule; a second run on Dirichlet shards with 8 workers; with
# a third argument "ucx", a run over processes (gossip-run) as well.
set -euo pipefail
exe=$1 src=$2 ucx=${3:-}
source "$src/tests/data_or_skip.sh"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$exe" --quick --seeds 2 --out "$out" --set train.train_limit=3000 --set bench.quick_epochs=1 --set transport.bandwidth_gbps=0
/usr/bin/python3 - "$out/traffic.json" <<'PY'
import json, statistics, sys
d = json.load(open(sys.argv[1]))
for k in ("dataset", "workers", "runs", "summary", "equal_traffic_period", "local_sgd_every", "diloco_every", "average_rounds"):
    assert k in d, k
# What the command set, and the engine settings it ran with, defaults included.
assert d["overrides"] == ["train.train_limit=3000", "bench.quick_epochs=1", "transport.bandwidth_gbps=0"], d["overrides"]
assert d["engine"]["same_step_merge"] is False and d["engine"]["max_lead"] == 4, d["engine"]
roles = [r["role"] for r in d["runs"]]
assert roles[:6] == ["never", "periodic-1", "adaptive"] * 2, roles
for role in ("equal-traffic", "local-sgd", "diloco"):
    assert roles.count(role) >= 2, (role, roles)
for r in d["runs"]:
    for k in ("policy", "options", "seed", "bytes_sent", "messages", "accuracy", "local_accuracy_mean", "wall_s"):
        assert k in r, k
    assert 0 <= r["accuracy"] <= 1 and 0 <= r["local_accuracy_mean"] <= 1
by = lambda role: [r for r in d["runs"] if r["role"] == role and r.get("eligible", True)]
assert all(r["bytes_sent"] == 0 for r in by("never"))
mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
p1, ad = mean(by("periodic-1"), "bytes_sent"), mean(by("adaptive"), "bytes_sent")
assert p1 > ad > 0
s = d["summary"]
for k in ("traffic_reduction", "accuracy_delta_pt", "accuracy_delta_sigma_pt", "equal_traffic_accuracy_delta_pt",
          "equal_traffic_delta_sigma_pt", "equal_traffic_best", "baselines", "time_reduction"):
    assert k in s, k
assert abs(s["traffic_reduction"] - (1 - ad / p1)) < 1e-9
# Every eligible baseline sent no more bytes than the adaptive run; the best is the most accurate of them.
elig = {b: v for b, v in s["baselines"].items() if v["eligible"]}
assert elig and all(mean(by(b), "bytes_sent") <= ad for b in elig)
assert elig[s["equal_traffic_best"]]["accuracy"] == max(v["accuracy"] for v in elig.values())  # ties: either
best = s["equal_traffic_best"]
diff = [100 * (a["accuracy"] - b["accuracy"]) for a, b in zip(by("adaptive"), by(best))]
assert abs(s["equal_traffic_accuracy_delta_pt"] - statistics.mean(diff)) < 1e-9
assert abs(s["equal_traffic_delta_sigma_pt"] - statistics.stdev(diff)) < 1e-9
diff = [100 * (a["accuracy"] - b["accuracy"]) for a, b in zip(by("adaptive"), by("periodic-1"))]
assert abs(s["accuracy_delta_pt"] - statistics.mean(diff)) < 1e-9
assert abs(s["accuracy_delta_sigma_pt"] - statistics.stdev(diff)) < 1e-9
print("bench smoke:", {k: v for k, v in s.items() if k != "baselines"})
PY
"$exe" --quick --seeds 1 --out "$out/dirichlet" --set train.train_limit=3000 --set bench.quick_epochs=1 --set transport.bandwidth_gbps=0 \
  --set train.workers=8 --set train.partition=dirichlet --set baseline.roles=local-sgd,diloco
/usr/bin/python3 - "$out/dirichlet/traffic.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["partition"] == "dirichlet" and d["dirichlet_alpha"] == 0.1 and d["workers"] == 8
assert [r["role"] for r in d["runs"]][:3] == ["never", "periodic-1", "adaptive"]
assert {"local-sgd", "diloco"} <= {r["role"] for r in d["runs"]}
assert d["summary"]["accuracy_delta_sigma_pt"] is None  # one seed
print("bench smoke (dirichlet):", d["summary"]["equal_traffic_best"], d["summary"]["equal_traffic_accuracy_delta_pt"])
PY
# Keys each run sets itself are refused, not silently replaced.
if "$exe" --quick --seeds 1 --out "$out/refused" --set train.outer_lr=0.5 2>"$out/err"; then echo "train.outer_lr was accepted" >&2; exit 1; fi
grep -qF -- "--set train.outer_lr=0.5: bench/traffic sets train.outer_lr per run" "$out/err" \
  || { echo "train.outer_lr: expected the refusal, got:" >&2; cat "$out/err" >&2; exit 1; }
# A bad key of the adaptive run's policy is refused before any run (the
# controls run first, and used to train before it was seen).
if "$exe" --quick --seeds 1 --out "$out/badkey" --set policy.threshold=-1 >"$out/stdout" 2>"$out/err"; then
  echo "policy.threshold = -1 was accepted" >&2; exit 1
fi
grep -qF -- "--set policy.threshold=-1: key 'threshold' of policy 'consensus' must be" "$out/err" \
  || { echo "policy.threshold=-1: expected the refusal, got:" >&2; cat "$out/err" >&2; exit 1; }
if grep -q "periodic-1" "$out/stdout"; then echo "a run trained before the bad policy key was refused:" >&2; cat "$out/stdout" >&2; exit 1; fi
# Over processes: the controls get the whole of their own policy, not the
# adaptive run's --set policy keys (a periodic control would refuse max_interval).
if [ "$ucx" = ucx ]; then
  UCX_NET_DEVICES=lo "$exe" --quick --seeds 1 --out "$out/ucx" --set transport.name=ucx --set train.train_limit=2000 \
    --set bench.quick_epochs=1 --set policy.max_interval=50 --set baseline.roles=equal-traffic
  /usr/bin/python3 - "$out/ucx/traffic.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
roles = {r["role"]: r for r in d["runs"]}
assert {"never", "periodic-1", "adaptive", "equal-traffic"} <= set(roles), list(roles)
assert roles["adaptive"]["options"].get("max_interval") == 50, roles["adaptive"]
assert "max_interval" not in roles["equal-traffic"]["options"], roles["equal-traffic"]
print("bench smoke (ucx):", {k: roles[k]["accuracy"] for k in roles})
PY
fi

#!/usr/bin/env python3
"""bench/cuda: the GPU example (examples/02_fashion_mnist_cuda) over seeds.

For each case (partition and worker count) and seed it trains four times with
the example's config: the default policy, a fixed period that sends no more
bytes than the default did (every ceil(steps / sends) steps), periodic every
step, and no communication. It prints a table of mean ± σ over seeds and
writes OUT/cuda.json. --set goes to every run, policy.* keys to the default
run only (the others set their own policy), and train.classes_per_worker or
train.dirichlet_alpha to the cases of their partition only.

    bench/cuda/run.py --exe build/lib/cuda/fashion_mnist_cuda [--seeds 3] [--out DIR]

Exits 77 when the example finds no usable CUDA GPU. Workers are threads over
the loopback transport with the config's emulated link (1 Gbit/s per worker,
50 µs): loopback runs synchronous rounds, so a send stalls its receivers
until it has crossed the link (README, "GPU").
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from results import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOT = os.path.dirname(os.path.dirname(HERE))
CASES = {"iid4": ["--partition", "iid", "-n", "4"], "label8": ["--partition", "by_label", "-n", "8"]}
# [train] keys of one partition: given to the cases of that partition only (the example refuses them for another).
PARTITION_KEYS = {"train.classes_per_worker": "by_label", "train.dirichlet_alpha": "dirichlet"}


def key_of(assignment):
    return assignment.split("=", 1)[0].strip()


def sets_for(case, sets):
    partition = CASES[case][CASES[case].index("--partition") + 1]
    return [s for s in sets if PARTITION_KEYS.get(key_of(s), partition) == partition]
KEYS = ("accuracy", "local_accuracy_mean", "bytes_sent", "messages", "sends", "steps", "train_seconds", "device")


def run(exe, config, seed, args, sets, timeout):
    with tempfile.TemporaryDirectory(prefix="gossip-bench-cuda-") as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [exe, "--config", config, "--seed", str(seed), *args, *[a for s in sets for a in ("--set", s)], "--json", out]
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            sys.exit(f"bench/cuda: {' '.join(cmd)} did not finish within {timeout} s")
        if p.returncode == 77:
            print(p.stdout.strip())
            sys.exit(77)
        if p.returncode != 0:
            sys.exit(f"bench/cuda: {' '.join(cmd)} failed with status {p.returncode}:\n{p.stdout}")
        with open(out) as f:
            r = json.load(f)
    return {k: r.get(k) for k in KEYS}


def mean_sd(xs):
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exe", default=os.path.join(SOURCE_ROOT, "build", "lib", "cuda", "fashion_mnist_cuda"),
                    help="the GPU example (default: build/lib/cuda/fashion_mnist_cuda)")
    ap.add_argument("--config", default=os.path.join(SOURCE_ROOT, "examples", "01_fashion_mnist", "fashion_mnist.toml"),
                    help="the example's config (default: examples/01_fashion_mnist/fashion_mnist.toml)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per case (default: 3)")
    ap.add_argument("--cases", default="iid4,label8", help=f"comma-separated, of {', '.join(CASES)} (default: iid4,label8)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="passed to every run, policy.* to the default run only (repeatable)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per training run (default: 600)")
    ap.add_argument("--out", default=".", help="directory for cuda.json (default: the current one)")
    a = ap.parse_args()
    if not os.access(a.exe, os.X_OK):
        sys.exit(f"bench/cuda: {a.exe} is not an executable; build with CUDA (meson setup -Dcuda=enabled) or pass --exe")
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    if not cases:
        sys.exit(f"bench/cuda: --cases '{a.cases}' names no case; choose among {', '.join(CASES)}")
    for c in cases:
        if c not in CASES:
            sys.exit(f"bench/cuda: unknown case '{c}' in --cases; choose among {', '.join(CASES)}")
    if a.seeds < 1:
        sys.exit("bench/cuda: --seeds must be >= 1")
    # --out: a directory this run can create or write, checked before any training.
    if not a.out:
        sys.exit("bench/cuda: --out needs a directory, not ''")
    probe = a.out
    while not os.path.exists(probe):
        probe = os.path.dirname(os.path.abspath(probe))
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        sys.exit(f"bench/cuda: --out {a.out}: is a file, not a directory")
    if not os.access(probe, os.W_OK):
        sys.exit(f"bench/cuda: --out {a.out}: {probe} is not writable")
    # The control runs set their own policy: policy.* keys shape the default run only.
    control_sets = [s for s in a.sets if not key_of(s).startswith("policy.")]

    runs, summary = [], {}
    for case in cases:
        rows = {"default": [], "equal_bytes": [], "periodic-1": [], "never": []}
        for seed in range(1, a.seeds + 1):
            base = CASES[case]
            d = run(a.exe, a.config, seed, base, sets_for(case, a.sets), a.timeout)
            every = max(1, math.ceil(d["steps"] / max(d["sends"], 1)))
            plan = [("default", d, []),
                    ("equal_bytes", None, ["--policy", "periodic", "--set", f"policy.every={every}"]),
                    ("periodic-1", None, ["--policy", "periodic"]),
                    ("never", None, ["--policy", "never"])]
            for role, r, extra in plan:
                if r is None:
                    r = run(a.exe, a.config, seed, base + extra, sets_for(case, control_sets), a.timeout)
                r.update(case=case, seed=seed, role=role, args=base + extra)
                if role == "equal_bytes":
                    r["every"] = every
                rows[role].append(r)
                runs.append(r)
                print(f"{case:7s} seed {seed}  {role:12s} {100 * r['accuracy']:6.2f} %  {r['bytes_sent'] / 1e6:9.1f} MB  "
                      f"{r['train_seconds']:6.2f} s", flush=True)
        s = {}
        for role, rs in rows.items():
            acc = mean_sd([100 * r["accuracy"] for r in rs])
            s[role] = {"accuracy_pct": acc[0], "accuracy_sd_pt": acc[1],
                       "bytes_sent": statistics.fmean(r["bytes_sent"] for r in rs),
                       "train_seconds": statistics.fmean(r["train_seconds"] for r in rs)}
        def delta(other):
            return mean_sd([100 * (x["accuracy"] - y["accuracy"]) for x, y in zip(rows["default"], rows[other])])
        de, dp = delta("equal_bytes"), delta("periodic-1")
        s["equal_traffic_accuracy_delta_pt"], s["equal_traffic_delta_sigma_pt"] = de
        s["accuracy_delta_pt"], s["accuracy_delta_sigma_pt"] = dp
        s["traffic_reduction"] = 1 - s["default"]["bytes_sent"] / s["periodic-1"]["bytes_sent"]
        s["time_ratio_periodic1_over_default"] = s["periodic-1"]["train_seconds"] / s["default"]["train_seconds"]
        summary[case] = s

    device = (runs[0]["device"] if runs else None) or "the host (the report names no device)"
    print(f"\nbench/cuda: {a.seeds} seed(s) on {device}; mean ± σ over seeds; deltas are per-seed differences")
    print(f"{'case':7s} {'run':12s} {'accuracy':>16s} {'MB sent':>10s} {'train s':>8s}")
    for case, s in summary.items():
        for role in ("default", "equal_bytes", "periodic-1", "never"):
            r = s[role]
            print(f"{case:7s} {role:12s} {r['accuracy_pct']:8.2f} ± {r['accuracy_sd_pt']:4.2f} % {r['bytes_sent'] / 1e6:10.1f} "
                  f"{r['train_seconds']:8.2f}")
        print(f"{case:7s} default − equal bytes {s['equal_traffic_accuracy_delta_pt']:+.2f} ± {s['equal_traffic_delta_sigma_pt']:.2f} pt; "
              f"− periodic-1 {s['accuracy_delta_pt']:+.2f} ± {s['accuracy_delta_sigma_pt']:.2f} pt at "
              f"{100 * s['traffic_reduction']:.1f} % fewer bytes, {s['time_ratio_periodic1_over_default']:.2f}x less training time")
    path = os.path.join(a.out, "cuda.json")
    write_json(path, {"device": device, "seeds": a.seeds, "config": a.config, "set": a.sets, "summary": summary, "runs": runs}, "bench/cuda")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Draws the non-iid instruments of runs side by side: consensus distance,
sends per window (all workers and the most/least active worker), push-sum
weight range, and the learning rate, against the training step.

    plot_diagnosis.py traffic.json out.png            # runs of bench/traffic that carry a timeline
    plot_diagnosis.py a.json b.json ... out.png       # reports of the example (--json), one run each
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def runs_of(path):
    with open(path) as f:
        j = json.load(f)
    if "runs" in j:  # bench/traffic: the first seed's run of each role that has a timeline
        seen = set()
        for r in j["runs"]:
            if r.get("timeline") and r["role"] not in seen:
                seen.add(r["role"])
                label = r["role"] if r["role"] != "adaptive" else "adaptive (" + r["policy"] + ")"
                yield label, r["timeline"], r.get("accuracy"), r.get("bytes_sent")
    elif j.get("timeline"):
        yield path.rsplit("/", 1)[-1].removesuffix(".json"), j["timeline"], j.get("accuracy"), j.get("bytes_sent")


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    runs = [r for p in argv[1:-1] for r in runs_of(p)]
    if not runs:
        sys.exit("plot_diagnosis.py: no run with a timeline (run with [train] probe_every > 0, workers as threads)")
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    for label, tl, acc, sent in runs:
        steps = [p["step"] for p in tl]
        name = label if acc is None else f"{label}: {100 * acc:.1f} %, {sent / 1e6:.0f} MB"
        (line,) = ax[0][0].semilogy(steps, [max(p["consensus"], 1e-9) for p in tl], label=name)
        window = [b - a for a, b in zip([0] + steps[:-1], steps)]
        totals = [sum(p["sends"]) for p in tl]
        per_step = [(b - a) / w / len(p["sends"]) for a, b, w, p in zip([0] + totals[:-1], totals, window, tl)]
        ax[0][1].plot(steps, per_step, color=line.get_color(), label=name)
        ax[1][0].fill_between(steps, [p["weight_min"] for p in tl], [p["weight_max"] for p in tl], color=line.get_color(), alpha=0.25)
        ax[1][0].plot(steps, [p["weight_min"] for p in tl], color=line.get_color(), lw=0.8)
        ax[1][0].plot(steps, [p["weight_max"] for p in tl], color=line.get_color(), lw=0.8, label=name)
        final = tl[-1]["sends"]
        ax[1][1].plot(range(len(final)), sorted(final), marker="o", color=line.get_color(), label=name)
    ax[0][0].set_title("consensus distance  mean ‖z_i − x̄‖² / ‖x̄‖² (exact)")
    ax[0][1].set_title("sends per worker and step (window between probes)")
    ax[1][0].set_title("push-sum weight range (min..max over workers)")
    ax[1][1].set_title("sends per worker over the run (sorted)")
    ax[1][1].set_xlabel("worker (sorted by sends)")
    for a in (ax[0][0], ax[0][1], ax[1][0]):
        a.set_xlabel("step")
    lr = [(p["step"], p["lr"]) for p in runs[0][1]]
    twin = ax[0][1].twinx()
    twin.plot([s for s, _ in lr], [v for _, v in lr], color="grey", ls=":", label="lr")
    twin.set_ylabel("learning rate (dotted)")
    for a in ax.flat:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(argv[-1], dpi=110)


if __name__ == "__main__":
    main(sys.argv)

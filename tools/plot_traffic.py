#!/usr/bin/python3
"""Plot accuracy against bytes sent from bench/traffic's JSON.

usage: plot_traffic.py results/traffic.json results/traffic.png
Runs under Debian's /usr/bin/python3 with python3-matplotlib.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    styles = {"never": ("tab:gray", "x"), "periodic-1": ("tab:red", "o"), "adaptive": ("tab:green", "*"),
              "equal-traffic": ("tab:blue", "s")}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for role, (color, marker) in styles.items():
        runs = [r for r in doc["runs"] if r.get("role") == role]
        if not runs:
            continue
        # never sends zero bytes: draw it at the left edge of the log axis
        xs = [max(r["bytes_sent"], 1e6) / 1e6 for r in runs]
        ys = [100 * r["accuracy"] for r in runs]
        label = role if role != "equal-traffic" else f"periodic every {doc.get('equal_traffic_period')} (equal traffic)"
        if role == "adaptive":
            label = f"adaptive ({runs[0]['policy']})"
        ax.scatter(xs, ys, c=color, marker=marker, s=60, label=label)
    s = doc["summary"]
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent by all workers (MB, log scale; never drawn at 1 MB)")
    ax.set_ylabel("test accuracy of the average model (%)")
    ax.set_title(f"Fashion-MNIST, {doc['workers']} workers: traffic -{100 * s['traffic_reduction']:.1f} %, "
                 f"accuracy {s['accuracy_delta_pt']:+.2f} pt")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())

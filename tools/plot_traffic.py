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
              "equal-traffic": ("tab:blue", "s"), "local-sgd": ("tab:purple", "D"), "diloco": ("tab:orange", "^"),
              "periodic-qgm": ("tab:cyan", "P"), "staggered-qgm": ("tab:olive", "v")}
    s = doc["summary"]
    baselines = s.get("baselines", {})
    # A run that sent nothing (never) is drawn a decade below the smallest
    # run that sent something, on the log axis; every other one where it is.
    sent = [r["bytes_sent"] for r in doc["runs"] if r["bytes_sent"] > 0]
    zero_at = (min(sent) if sent else 1e6) / 10
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for role in list(styles) + sorted({r.get("role") for r in doc["runs"]} - set(styles)):
        color, marker = styles.get(role, ("black", "."))
        runs = [r for r in doc["runs"] if r.get("role") == role]
        if not runs:
            continue
        b = baselines.get(role, {})
        label = role
        if role == "adaptive":
            label = f"adaptive ({runs[0]['policy']})"
        elif role == "equal-traffic":
            label = f"periodic every {b.get('every', doc.get('equal_traffic_period'))} (equal traffic)"
        elif role in ("local-sgd", "diloco"):
            label = f"{role}: average every {b.get('every')} steps, {b.get('rounds', doc.get('average_rounds'))} rounds"
            if role == "diloco" and "diloco" in doc:
                label += f", outer lr {doc['diloco']['outer_lr']} / mom. {doc['diloco']['outer_momentum']}"
        if role == s.get("equal_traffic_best"):
            label += " [best equal-bytes]"
        for eligible in (True, False):
            part = [r for r in runs if r.get("eligible", True) == eligible]
            if not part:
                continue
            xs = [(r["bytes_sent"] or zero_at) / 1e6 for r in part]
            ys = [100 * r["accuracy"] for r in part]
            if eligible:
                ax.scatter(xs, ys, c=color, marker=marker, s=60, label=label)
            else:  # overshot the adaptive run's bytes, or never exchanged: shown hollow, not compared
                why = "period longer than the run: never exchanges" if b.get("never_exchanges") else "overshoot"
                ax.scatter(xs, ys, facecolors="none", edgecolors=color, marker=marker, s=60, label=f"{role} ({why})")
    ax.set_xscale("log")
    ax.set_xlabel(f"bytes sent by all workers (MB, log scale; zero drawn at {zero_at / 1e6:.3g} MB)")
    ax.set_ylabel("test accuracy of the average model (%)")
    delta = s.get("equal_traffic_accuracy_delta_pt")
    sub = f", vs best equal-bytes {delta:+.2f} pt" if delta is not None else ""
    part = doc.get("partition", "iid")
    ax.set_title(f"Fashion-MNIST, {doc['workers']} workers, {part}: traffic -{100 * s['traffic_reduction']:.1f} %, "
                 f"accuracy {s['accuracy_delta_pt']:+.2f} pt{sub}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())

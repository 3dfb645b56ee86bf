# bench/torch/run.sh's evaluation: the ranks' average model at every kept
# point of every run, on the Fashion-MNIST test set; writes torch.json and
# torch.png and prints the table.
import argparse
import glob
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from results import write_json  # noqa: E402
from worker import CNN, load_split  # noqa: E402

METHODS = ["ddp", "periodic", "default", "none"]
LABELS = {"ddp": "torch DDP (gloo), every step", "periodic": "libgossip periodic every 1",
          "default": "libgossip defaults", "none": "no communication"}


def mean_sd(v):
    v = [x for x in v if x is not None]
    if not v:
        return {"mean": None, "sd": None, "n": 0}
    return {"mean": round(statistics.fmean(v), 4), "sd": round(statistics.stdev(v), 4) if len(v) > 1 else 0.0, "n": len(v)}


def main():
    ap = argparse.ArgumentParser()
    for k in ("runs", "out", "data", "load", "bridge-net", "link-mbit"):
        ap.add_argument("--" + k, required=True)
    for k in ("seeds", "quick", "train-limit", "epochs", "netem"):
        ap.add_argument("--" + k, type=int, required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--momentum", required=True)
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="the gossip runs' --set keys (recorded)")
    a = ap.parse_args()

    torch.set_num_threads(2)
    xt, yt = load_split(a.data, "t10k")
    model = CNN()
    shapes = [(n, p.shape, p.numel()) for n, p in model.named_parameters()]

    def accuracy(flat):
        off = 0
        with torch.no_grad():
            for (_, _, n), p in zip(shapes, model.parameters()):
                p.copy_(flat[off:off + n].view_as(p))
                off += n
            correct = 0
            for i in range(0, len(yt), 2000):
                correct += (model(xt[i:i + 2000]).argmax(1) == yt[i:i + 2000]).sum().item()
        return correct / len(yt)

    runs = {}
    for m in METHODS:
        for s in range(1, a.seeds + 1):
            files = sorted(glob.glob(os.path.join(a.runs, f"{m}-s{s}", "rank*.pt")))
            if len(files) != 4:
                sys.exit(f"bench/torch: {m} seed {s}: {len(files)} rank files, expected 4")
            ranks = [torch.load(f) for f in files]
            for f, r in zip(files, ranks):
                if r["steps"] < 1:
                    sys.exit(f"bench/torch: {m} seed {s}: {f} trained {r['steps']} steps: its shard holds fewer samples than "
                             "one batch of 32 (give --train-limit 128 or more, 0: all)")
            points = []
            for k in range(len(ranks[0]["snaps"])):
                sn = [r["snaps"][k] for r in ranks]
                wsum = sum(x["weight"] for x in sn)
                avg = sum(x["weight"] * x["params"] for x in sn) / wsum
                pt = {"step": sn[0]["step"], "time_s": round(max(x["time_s"] for x in sn), 3),
                      "bytes_sent": sum(x["tx_bytes"] for x in sn), "gossip_bytes_sent": sum(x["gossip_bytes"] for x in sn),
                      "accuracy": accuracy(avg)}
                if m == "none":
                    pt["rank0_accuracy"] = accuracy(sn[0]["params"])
                points.append(pt)
            steps = ranks[0]["steps"]
            runs.setdefault(m, {})[s] = {
                "steps": steps, "train_s": round(max(r["train_s"] for r in ranks), 2),
                "ms_per_step": round(1000 * max(r["train_s"] for r in ranks) / steps, 1),
                "final_accuracy": points[-1]["accuracy"], "bytes_sent": points[-1]["bytes_sent"],
                "gossip_stats_rank0": ranks[0]["stats"], "points": points}
            print(f"    {m} seed {s}: final accuracy {100 * points[-1]['accuracy']:.2f} %, "
                  f"{runs[m][s]['ms_per_step']} ms/step, {points[-1]['bytes_sent'] / 1e6:.1f} MB", flush=True)

    def first_time(points, target, key="accuracy"):
        for p in points:
            if p[key] >= target:
                return p["time_s"], p["step"]
        return None, None

    per_seed = []
    for s in range(1, a.seeds + 1):
        ddp = runs["ddp"][s]
        target = ddp["final_accuracy"] - 0.005
        row = {"seed": s, "target_accuracy": round(target, 4)}
        t_ddp, step_ddp = first_time(ddp["points"], target)
        row["ddp_time_to_target_s"] = t_ddp
        for m in ("periodic", "default", "none"):
            t, _ = first_time(runs[m][s]["points"], target)
            row[f"{m}_time_to_target_s"] = t
            row[f"{m}_speedup_vs_ddp"] = round(t_ddp / t, 3) if t else None
            row[f"{m}_final_accuracy_delta_vs_ddp_pt"] = round(100 * (runs[m][s]["final_accuracy"] - ddp["final_accuracy"]), 2)
            # At the run's own final accuracy: how much sooner than DDP it got there (when DDP does).
            level = runs[m][s]["final_accuracy"]
            t_own, _ = first_time(runs[m][s]["points"], level)
            t_ddp_level, _ = first_time(ddp["points"], level)
            row[f"{m}_speedup_vs_ddp_at_own_final_accuracy"] = round(t_ddp_level / t_own, 3) if t_ddp_level and t_own else None
        t0, _ = first_time(runs["none"][s]["points"], target, "rank0_accuracy")
        row["none_rank0_time_to_target_s"] = t0
        t_def = row["default_time_to_target_s"]
        row["default_vs_nocomm_time_ratio"] = round(t_def / row["none_time_to_target_s"], 3) if t_def and row["none_time_to_target_s"] else None
        # The ideal: DDP's steps to the target at the no-communication step time.
        ideal = step_ddp * runs["none"][s]["ms_per_step"] / 1000 if step_ddp else None
        row["ideal_time_to_target_s"] = round(ideal, 2) if ideal else None
        row["default_vs_ideal_time_ratio"] = round(t_def / ideal, 3) if t_def and ideal else None
        per_seed.append(row)

    summary = {
        "target": "DDP's final test accuracy - 0.5 pt, per seed; time to target: the first kept point at which the ranks' average model reaches it",
        "time_to_target_speedup_vs_ddp": {m: mean_sd([r[f"{m}_speedup_vs_ddp"] for r in per_seed]) for m in ("periodic", "default", "none")},
        "final_accuracy_delta_vs_ddp_pt": {m: mean_sd([r[f"{m}_final_accuracy_delta_vs_ddp_pt"] for r in per_seed]) for m in ("periodic", "default", "none")},
        "speedup_vs_ddp_at_own_final_accuracy": {m: mean_sd([r[f"{m}_speedup_vs_ddp_at_own_final_accuracy"] for r in per_seed]) for m in ("periodic", "default", "none")},
        "default_vs_nocomm_time_to_target_ratio": mean_sd([r["default_vs_nocomm_time_ratio"] for r in per_seed]),
        "default_vs_ideal_time_to_target_ratio": mean_sd([r["default_vs_ideal_time_ratio"] for r in per_seed]),
        "final_accuracy": {m: mean_sd([runs[m][s]["final_accuracy"] for s in runs[m]]) for m in METHODS},
        "ms_per_step": {m: mean_sd([runs[m][s]["ms_per_step"] for s in runs[m]]) for m in METHODS},
        "bytes_sent": {m: mean_sd([runs[m][s]["bytes_sent"] for s in runs[m]]) for m in METHODS},
        "reached_target": {m: sum(1 for r in per_seed if r[f"{m}_time_to_target_s"] is not None) for m in ("periodic", "default", "none")},
        "seeds": a.seeds,
        "goal": "default reaches the target >= 3x sooner than DDP and ends >= DDP - 0.5 pt (iid, 4 workers, 3 seeds)",
    }
    sp, dl = summary["time_to_target_speedup_vs_ddp"]["default"], summary["final_accuracy_delta_vs_ddp_pt"]["default"]
    summary["goal_met"] = bool(sp["mean"] is not None and sp["n"] == a.seeds and sp["mean"] >= 3 and dl["mean"] >= -0.5)

    link_mbit = None if a.link_mbit == "null" else float(a.link_mbit)
    doc = {
        "bench": "torch",
        "mode": "quick" if a.quick else "full",
        "quick_note": "quick: 12000 training samples (3000 per rank), 2 epochs, 1 seed unless --seeds; full: 60000 samples, 2 epochs, 3 seeds" if a.quick else None,
        "setup": {
            "world": 4, "launcher": "one torchrun (static rendezvous, store on the bridge address), --no_python, each rank started through `ip netns exec` into its own namespace",
            "model": "CNN of examples/03_libtorch_cnn: conv5x5(16)-pool-conv5x5(32)-pool-fc128-fc10, %d parameters" % sum(n for _, _, n in shapes),
            "data": "Fashion-MNIST (%s), iid shards; test: the 10000 test images" % a.data,
            "train_limit": a.train_limit, "epochs": a.epochs, "batch_per_rank": 32, "optimizer": "SGD lr 0.05 momentum 0.9, lr x0.1 at 50 % and x0.01 at 75 % of the steps",
            "methods": {m: LABELS[m] for m in METHODS},
            "gossip_configs": {"periodic": {"policy": {"name": "periodic", "every": 1}}, "default": {}},
            "gossip_momentum": a.momentum,
            "gossip_config_set": a.sets,
            "gossip_notes": "UCX over TCP (UCX_TLS=tcp, UCX_NET_DEVICES=eth0); " + {"auto": "optimizer= registered, [engine] momentum = auto (local over UCX)",
                                "quasi-global": "optimizer= registered, [engine] momentum = quasi-global",
                                "local": "optimizer's momentum kept local (no optimizer=)"}[a.momentum] + "; eng.finish() counted in the training time",
            "time": "training time: the slowest rank's sum of step times (forward, backward, optimizer, eng.step, finish); start-up and evaluation excluded",
            "bytes": "bytes_sent: the 4 ranks' eth0 tx_bytes (IP and TCP headers included); gossip_bytes_sent: the engine's own count",
        },
        "network": {
            "emulated": "rate limit only" if not (a.delay_ms and a.netem) else "rate limit and delay",
            "topology": f"bridge in the root namespace ({a.bridge_net}), one veth per rank namespace",
            "rate_mbit_per_link": a.rate, "qdisc": "tbf rate %gmbit burst 64kb latency 50ms on both ends of each veth (each direction)" % a.rate,
            "delay_ms": a.delay_ms if (a.delay_ms and a.netem) else 0,
            "latency_note": "netem present: delay %g ms per direction" % a.delay_ms if a.netem and a.delay_ms else
                            ("no netem in this kernel: no latency emulated" if not a.netem else "no latency requested"),
            "netem_available": bool(a.netem),
            "measured_tcp_stream_mbit": link_mbit,
        },
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": a.load, "torch": torch.__version__},
        "summary": summary,
        "per_seed": per_seed,
        "runs": {m: {str(s): r for s, r in v.items()} for m, v in runs.items()},
    }
    write_json(os.path.join(a.out, "torch.json"), doc, "bench/torch")

    def fmt(x, spec, unit=""):
        if x is None or x["mean"] is None:
            return "not reached"
        return f"{x['mean']:{spec}}{unit} ± {x['sd']:{spec}}"

    def ttt_cell(tt):
        return fmt(tt, ".1f") if tt["n"] == a.seeds else f"{fmt(tt, '.1f')} ({tt['n']}/{a.seeds})"

    print(f"\nbench/torch ({doc['mode']}, {a.seeds} seed(s), 4 ranks, {a.rate:g} Mbit/s per link, load {a.load}):")
    print(f"{'run':<30} {'final acc %':>14} {'ms/step':>8} {'MB sent':>9} {'time to target s':>17} {'speedup vs DDP':>16} {'Δacc vs DDP pt':>15}")
    for m in METHODS:
        fa = summary["final_accuracy"][m]
        tt = mean_sd([r[f"{m}_time_to_target_s"] for r in per_seed])
        sp = summary["time_to_target_speedup_vs_ddp"].get(m)
        dl = summary["final_accuracy_delta_vs_ddp_pt"].get(m)
        print(f"{LABELS[m]:<30} {100 * fa['mean']:>8.2f} ± {100 * fa['sd']:.2f} {summary['ms_per_step'][m]['mean']:>8.0f} "
              f"{summary['bytes_sent'][m]['mean'] / 1e6:>9.1f} {ttt_cell(tt):>17} "
              f"{fmt(sp, '.2f') if sp else '1 (baseline)':>16} {fmt(dl, '+.2f') if dl else '0':>15}")
    print("speedup vs DDP to each run's own final accuracy: " + ", ".join(
        f"{m} {fmt(summary['speedup_vs_ddp_at_own_final_accuracy'][m], '.2f')}" for m in ("periodic", "default", "none")))
    print(f"default / no-communication time to target: {fmt(summary['default_vs_nocomm_time_to_target_ratio'], '.2f')}"
          f"  (no-communication average model reached it in {summary['reached_target']['none']}/{a.seeds} seeds)")
    print(f"default / ideal (DDP's steps at the no-communication step time): {fmt(summary['default_vs_ideal_time_to_target_ratio'], '.2f')}")
    print(f"goal (default ≥ 3x sooner, ≥ DDP − 0.5 pt): {'met' if summary['goal_met'] else 'not met'}")
    print(f"wrote {os.path.join(a.out, 'torch.json')}")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench/torch: matplotlib is missing for /usr/bin/python3 (apt-get install python3-matplotlib): torch.png skipped")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"ddp": "tab:blue", "periodic": "tab:orange", "default": "tab:green", "none": "tab:gray"}
    for m in METHODS:
        for s, r in runs[m].items():
            kw = dict(color=colors[m], alpha=1.0 if s == 1 else 0.45, marker="o", ms=3, lw=1.5 if s == 1 else 1,
                      label=LABELS[m] if s == 1 else None)
            axes[0].plot([p["time_s"] for p in r["points"]], [100 * p["accuracy"] for p in r["points"]], **kw)
            if m != "none":  # it sends nothing: no place on a log axis
                axes[1].plot([max(p["bytes_sent"], 1) / 1e6 for p in r["points"][1:]], [100 * p["accuracy"] for p in r["points"][1:]], **kw)
    tgt = statistics.fmean(r["target_accuracy"] for r in per_seed) * 100
    top = max(100 * p["accuracy"] for v in runs.values() for r in v.values() for p in r["points"])
    for ax in axes:
        ax.axhline(tgt, color="k", ls=":", lw=1, label="target (DDP final − 0.5 pt)")
        ax.set_ylabel("test accuracy of the ranks' average model (%)")
        ax.set_ylim(max(0, tgt - 25), top + 2)
        ax.grid(alpha=0.3)
    axes[0].set_xlabel("training time (s, slowest rank)")
    axes[1].set_xlabel("bytes sent by the 4 ranks (MB, eth0)")
    axes[1].set_xscale("log")
    axes[1].text(0.02, 0.02, "no communication: 0 bytes (not shown)", transform=axes[1].transAxes, fontsize=8)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"bench/torch: 4 ranks, {a.rate:g} Mbit/s per link (tbf), {doc['mode']}, {a.seeds} seed(s)")
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "torch.png"), dpi=110)
    print(f"wrote {os.path.join(a.out, 'torch.png')}")


if __name__ == "__main__":
    main()

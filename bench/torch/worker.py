# One rank of a bench/torch run (bench/torch/run.sh starts 4 under torchrun,
# each inside its own network namespace). Trains the CNN of
# examples/03_libtorch_cnn on this rank's iid shard of Fashion-MNIST with
#   ddp       torch DistributedDataParallel (gloo): gradients all-reduced every step
#   periodic  libgossip, policy periodic every = 1 (push-sum, default codec)
#   default   libgossip with the config's defaults (config = {})
# --set section.key=value (repeatable) goes into both gossip runs' config
# (policy.* only into the default run's: periodic keeps its policy).
#   none      no communication at all (each rank alone: the speed limit)
# At evaluation points it keeps a copy of its parameters (and push-sum weight),
# the training time so far and the bytes its eth0 has sent; at the end it saves
# them to OUT/rank<R>.pt. The parent evaluates the ranks' average model later,
# so evaluation never runs inside the timed loop.
import argparse
import gzip
import os
import re
import time
import tomllib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class CNN(nn.Module):
    """examples/03_libtorch_cnn/cnn.hpp: conv 5x5 (16) → pool → conv 5x5 (32) → pool → fc hidden → fc 10."""

    def __init__(self, hidden=128):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_split(data_dir, prefix, limit=0):
    x = load_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
    y = load_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
    if limit:
        x, y = x[:limit], y[:limit]
    x = (torch.from_numpy(x.astype(np.float32)) / 255.0 - 0.2860) / 0.3530
    return x.unsqueeze(1), torch.from_numpy(y.astype(np.int64))


def lr_at(step, total, base):
    """examples' "step" schedule: x0.1 at 50 % and x0.01 at 75 % of training."""
    if step >= 0.75 * total:
        return base * 0.01
    if step >= 0.5 * total:
        return base * 0.1
    return base


def tx_bytes(dev):
    try:
        with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return -1


def config_value(text):
    """A --set value as the C++ programs' --set reads it: one TOML value (a number,
    true/false, a quoted string, an array or inline table), else a bare word as a string."""
    try:
        parsed = tomllib.loads("v = " + text)
        if len(parsed) == 1:
            return parsed["v"]
    except tomllib.TOMLDecodeError:
        pass
    if not text or re.fullmatch(r"[0-9+\-._eE]+", text) or text[0] in "[{\"'" or "\n" in text:
        raise SystemExit(f"worker: --set value '{text}' is not one valid TOML value (a string with such characters goes in single quotes)")
    return text


def apply_sets(cfg, sets):
    for item in sets:
        key, eq, value = item.partition("=")
        path = key.split(".")
        if not eq or len(path) != 2 or not all(path):
            raise SystemExit(f"worker: --set takes section.key=value (e.g. codec.name=int8), not '{item}'")
        cfg.setdefault(path[0], {})[path[1]] = config_value(value)
    return cfg


def gossip_config(method, sets, momentum_mode):
    """The config of a gossip run (method periodic or default) with the --set keys."""
    cfg = {"policy": {"name": "periodic", "every": 1}} if method == "periodic" else {}
    cfg = apply_sets(cfg, [x for x in sets if not (method == "periodic" and x.startswith("policy."))])
    if momentum_mode == "quasi-global":
        cfg.setdefault("engine", {})["momentum"] = "quasi-global"
    return cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-config", type=int, metavar="WORLD",
                    help="check both gossip runs' configs for WORLD ranks with gossip.check_config and exit (run.sh does, before any run)")
    ap.add_argument("--method", choices=["ddp", "periodic", "default", "none"])
    ap.add_argument("--momentum-mode", "--momentum", dest="momentum_mode", default="auto", choices=["auto", "quasi-global", "local"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--train-limit", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--beta", type=float, default=0.9, help="SGD momentum")
    ap.add_argument("--evals", type=int, default=12, help="evaluation points besides step 0")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--dev", default="eth0")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config key for the gossip runs (section.key=value, e.g. codec.name=int8)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.check_config is not None:
        import gossip
        for method in ("periodic", "default"):
            try:
                gossip.check_config(gossip_config(method, a.sets, a.momentum_mode), world=a.check_config)
            except gossip.ConfigError as e:
                raise SystemExit(f"worker: the {method} run's gossip config: {e}")
        return
    if a.method is None or a.out is None:
        ap.error("--method and --out are required (or --check-config WORLD)")

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    x, y = load_split(a.data, "train", a.train_limit)
    # iid: one permutation (the same on every rank), rank r takes every world-th sample
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(a.seed))
    shard = perm[rank::world]
    x, y = x[shard], y[shard]
    steps_per_epoch = len(y) // a.batch
    total = steps_per_epoch * a.epochs
    eval_at = sorted({round(total * k / a.evals) for k in range(1, a.evals + 1)})

    torch.manual_seed(a.seed)  # the same initial model on every rank
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.beta)
    eng = None
    net = model
    if a.method == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        net = nn.parallel.DistributedDataParallel(model)
        dist.barrier()
    elif a.method in ("periodic", "default"):
        import gossip
        cfg = gossip_config(a.method, a.sets, a.momentum_mode)
        if a.momentum_mode != "local":
            # optimizer=, as README's PyTorch script has it: [engine] momentum decides (auto: local over UCX)
            eng = gossip.Engine(model.named_parameters(), optimizer=opt, config=cfg)
        else:
            eng = gossip.Engine(model.named_parameters(), config=cfg)

    snaps = []
    train_s = 0.0
    bytes0 = tx_bytes(a.dev)

    def snapshot(step):
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        snaps.append({"step": step, "time_s": train_s, "tx_bytes": tx_bytes(a.dev) - bytes0,
                      "gossip_bytes": eng.stats().get("bytes_sent", 0) if eng else 0,
                      "weight": eng.weight if eng else 1.0, "params": flat})

    snapshot(0)
    g = torch.Generator().manual_seed(a.seed * 1000 + rank)
    step = 0
    t_start = time.perf_counter()
    for epoch in range(a.epochs):
        order = torch.randperm(len(y), generator=g)
        for b in range(steps_per_epoch):
            t0 = time.perf_counter()
            idx = order[b * a.batch:(b + 1) * a.batch]
            lr = lr_at(step, total, a.lr)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = F.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if eng is not None:
                eng.step(lr=lr, loss=loss.item())
            step += 1
            train_s += time.perf_counter() - t0
            if step in eval_at and step != total:
                snapshot(step)
    t0 = time.perf_counter()
    if eng is not None:
        eng.finish()  # final averaging rounds: part of the run's time
    train_s += time.perf_counter() - t0
    snapshot(total)
    wall = time.perf_counter() - t_start
    stats = eng.stats() if eng is not None else {}
    torch.save({"rank": rank, "world": world, "method": a.method, "seed": a.seed, "steps": total,
                "steps_per_epoch": steps_per_epoch, "wall_s": wall, "train_s": train_s, "snaps": snaps,
                "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool)) or k == "merge_age"}},
               os.path.join(a.out, f"rank{rank}.pt"))
    if a.method == "ddp":
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:  # the ranks' stdout is not line-buffered together: one line, from rank 0
        print(f"rank {rank} {a.method}: {total} steps, {train_s:.1f} s training "
              f"({1000 * train_s / max(total, 1):.0f} ms/step), {snaps[-1]['tx_bytes']} bytes out of {a.dev}", flush=True)


if __name__ == "__main__":
    main()

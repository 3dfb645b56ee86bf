# One rank of a test run under torchrun (tests/python/test_torch.py starts it).
#
#   torch_worker.py average OUT_DIR STEPS [DEVICE] [CODEC]
#                                           rank-seeded tensors on DEVICE (default cpu; "cuda": the GPU of
#                                           LOCAL_RANK), periodic gossip with [codec] name = CODEC (default
#                                           auto), no local updates; saves the final tensors (on the CPU),
#                                           weight and stats to OUT_DIR/rank<R>.pt
#   torch_worker.py train OUT_DIR STEPS [MOMENTUM]
#                                           SGD with momentum on rank-shifted data, optimizer= given and
#                                           [engine] momentum = MOMENTUM (default quasi-global)
#   torch_worker.py drop OUT_DIR STEPS      rank 1 drops its engine without finish(); rank 0 steps on and finishes
#   torch_worker.py interrupt OUT_DIR SECONDS
#                                           rank 0 gets SIGINT while its finish() waits on rank 1, silent for SECONDS
#   torch_worker.py config PATH             builds an Engine from the config file PATH and exits
import os
import signal
import sys
import threading
import time
import warnings

import torch

import gossip


def initial_tensors(rank):
    """Each rank's starting values; the test recomputes them to form the plain average."""
    g = torch.Generator().manual_seed(1000 + rank)
    return {"w": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g) + rank}


class FailedStep(RuntimeError):
    pass


def main():
    mode = sys.argv[1]
    rank = int(os.environ["RANK"])
    if mode == "config":
        gossip.Engine({"w": torch.zeros(4)}, config=sys.argv[2]).finish()
        return
    if mode == "twice":  # Engines one after another in one process
        wa, wc = torch.full((8,), float(rank)), torch.full((8,), 20.0 + rank)
        a = gossip.Engine({"w": wa})
        try:  # a notebook cell run again before the first finished
            gossip.Engine({"w": torch.zeros(8)})
            print(f"rank {rank}: a second Engine was built")
        except gossip.ConfigError as e:
            print(f"rank {rank}: refused: {e}")
        for _ in range(3):
            a.step(lr=0.1)
        a.finish()
        c = gossip.Engine({"w": wc})  # `a` finished: its rendezvous is free, though `a` is still referenced
        c.step(lr=0.1)
        c.finish()
        print(f"rank {rank}: stats after finish: steps {a.stats()['steps']} {c.steps} weight {a.weight > 0}")
        # Rank 1 leaves a `with` block by an exception; its next Engine waits
        # until rank 0 (which finishes 1.5 s later) has left that store.
        every_step = {"policy": {"name": "periodic", "every": 1}}
        if rank == 1:
            try:
                with gossip.Engine({"w": torch.zeros(8)}, config=every_step) as d:
                    deadline = time.monotonic() + 20
                    while d.stats()["messages_received"] == 0:  # rank 0 has connected to it
                        assert time.monotonic() < deadline, "rank 1 heard nothing from rank 0 in 20 s"
                        d.step(lr=0.1)
                        time.sleep(0.01)
                    raise FailedStep("a failed training step")
            except FailedStep:  # only the deliberate failure: an error of the engine's own fails the test
                pass
            t0 = time.monotonic()
            e = gossip.Engine({"w": torch.zeros(8)})
            print(f"rank 1: built after {time.monotonic() - t0:.2f} s")
        else:
            d = gossip.Engine({"w": torch.zeros(8)}, config=every_step)
            d.step(lr=0.1)
            time.sleep(1.5)
            d.finish()
            e = gossip.Engine({"w": torch.zeros(8)})
        e.step(lr=0.1)
        e.finish()
        # Each engine mixed its own model only: values stay in their own range.
        print(f"rank {rank}: a {wa.min():.3f}..{wa.max():.3f} c {wc.min():.3f}..{wc.max():.3f}", flush=True)
        return
    if mode == "shape":  # the same count, transposed on rank 1
        try:
            gossip.Engine({"w": torch.zeros((2, 5) if rank == 0 else (5, 2))}).finish()
        except gossip.LayoutError as e:
            print(f"rank {rank}: gossip.LayoutError, a ConfigError: {isinstance(e, gossip.ConfigError)}", flush=True)
            raise
        return
    out_dir, steps = sys.argv[2], int(sys.argv[3])
    if mode == "average":
        device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cpu")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
            torch.cuda.set_device(device)
        params = {k: torch.nn.Parameter(v.to(device)) for k, v in initial_tensors(rank).items()}
        codec = sys.argv[5] if len(sys.argv) > 5 else "auto"
        eng = gossip.Engine(params.items(), config={"policy": {"name": "periodic", "every": 1}, "codec": {"name": codec}})
        for _ in range(steps):
            eng.step(lr=0.1)
            time.sleep(0.01)  # the ranks' steps overlap in time, as training steps would
        eng.finish()
        torch.save({"tensors": {k: v.detach().cpu() for k, v in params.items()}, "weight": eng.weight, "stats": eng.stats()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    elif mode == "train":
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.8)
        # wait_when_busy: every due send goes out. Skipping sends whose buffer is
        # still on the wire lets one rank send far more than the other, and
        # push-sum then hands it almost all the weight (measured: 0.002 vs
        # 1.998), so the average follows that rank's data instead of both.
        # max_lead: with equal sends, a rank that runs steps ahead of the other
        # halves its weight at each send before the other's share arrives
        # (measured without it: 0.000 vs 2.000 in some runs, and the bias
        # then lands anywhere in 0.3 … 0.65); 2 steps bounds that.
        eng = gossip.Engine(model.named_parameters(), optimizer=opt,
                            config={"policy": {"name": "periodic", "every": 2},
                                    "engine": {"wait_when_busy": True, "max_lead": 2,
                                               "momentum": sys.argv[4] if len(sys.argv) > 4 else "quasi-global"}})
        buffers = [opt.state[p]["momentum_buffer"].data_ptr() for p in model.parameters()]
        data = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(16, 8, generator=data)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) + rank)
            opt.zero_grad()
            loss.backward()
            opt.step()
            eng.step(lr=0.05, loss=loss.item())
        eng.finish()
        same = buffers == [opt.state[p]["momentum_buffer"].data_ptr() for p in model.parameters()]
        torch.save({"bias": model.bias.detach().clone(), "weight": eng.weight, "stats": eng.stats(), "same_buffers": same},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    elif mode in ("drop", "drop0", "die"):
        # One rank leaves; the other trains on and finishes. "drop": rank 1
        # drops its engine without finish(); "drop0": rank 0 does, which also
        # ends the rendezvous it serves. "die": rank 1 exits without a word (no
        # finish(), no destructor); rank 0 finds it dead, and its finish() does
        # not wait for it.
        leaver = 0 if mode == "drop0" else 1
        eng = gossip.Engine({"w": torch.full((8,), float(rank))},
                            config={"policy": {"name": "periodic", "every": 1}, "engine": {"timeout_s": 4.0 if mode == "die" else 20.0}})
        for _ in range(5):
            eng.step(lr=0.1)
        if rank == leaver and mode != "die":
            time.sleep(0.5)
            del eng
            time.sleep(3)  # alive, but gone from the gossip
            return
        if rank == leaver:
            deadline = time.monotonic() + 20
            while eng.stats()["messages_received"] == 0:  # rank 0 has connected to it
                if time.monotonic() > deadline:
                    sys.exit("rank 1 heard nothing from rank 0 in 20 s")
                eng.poll()
                time.sleep(0.01)
            os._exit(0)
        if mode != "die":
            time.sleep(1)
        t0 = time.monotonic()
        for _ in range(steps):
            eng.step(lr=0.1)
        eng.finish()
        torch.save({"stats": eng.stats(), "seconds": time.monotonic() - t0}, os.path.join(out_dir, f"rank{rank}.pt"))
    elif mode == "fork":
        # Rank 0 forks a process that exits normally (its interpreter shuts
        # down, and the Engine it inherited with it): the parent's engine,
        # and rank 1's, must not notice.
        eng = gossip.Engine({"w": torch.full((8,), float(rank))}, config={"policy": {"name": "periodic", "every": 1}})
        for _ in range(5):
            eng.step(lr=0.1)
        if rank == 0:
            child = os.fork()
            if child == 0:
                try:
                    eng.step(lr=0.1)
                    code = 3  # the parent's engine must be refused here
                except gossip.Error as e:
                    code = 0 if "forked from the one that built the Engine" in str(e) else 4
                sys.exit(code)
            _, status = os.waitpid(child, 0)
            if status != 0:
                sys.exit(f"the forked child ended with status {status}")
        for _ in range(5):
            eng.step(lr=0.1)
        eng.finish()
        torch.save({"stats": eng.stats()}, os.path.join(out_dir, f"rank{rank}.pt"))
    elif mode == "interrupt":
        # Rank 0's finish() waits on rank 1, which neither steps nor finishes;
        # a SIGINT (Ctrl-C) one second in must end that wait at once.
        eng = gossip.Engine({"w": torch.full((8,), float(rank))},
                            config={"policy": {"name": "periodic", "every": 1}, "engine": {"timeout_s": 20.0}})
        if rank == 1:
            time.sleep(steps)  # alive and connected, but silent
            return
        for _ in range(3):
            eng.step(lr=0.1)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            eng.finish()
            outcome = "finished"
        except KeyboardInterrupt:
            outcome = "interrupted"
        torch.save({"outcome": outcome, "seconds": time.monotonic() - t0}, os.path.join(out_dir, f"rank{rank}.pt"))
    elif mode == "refinish":
        # Rank 0's finish() is interrupted (SIGINT) while it waits on rank 1,
        # which is late; rank 0 calls finish() again. The second call must not
        # send the final rounds again: rank 0's message count is published by
        # then, and rank 1 would leave with the extra messages unmerged.
        w = torch.full((8,), float(rank))
        eng = gossip.Engine({"w": w}, config={"policy": {"name": "periodic", "every": 1}, "engine": {"timeout_s": 20.0}})
        for _ in range(10):
            eng.step(lr=0.1)
        outcome = "finished"
        if rank == 1:
            time.sleep(steps)
        else:
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
            try:
                eng.finish()
            except KeyboardInterrupt:
                outcome = "interrupted"
        eng.finish()
        torch.save({"outcome": outcome, "weight": eng.weight, "stats": eng.stats()}, os.path.join(out_dir, f"rank{rank}.pt"))
    elif mode == "late":
        # Rank 1 reaches finish() after rank 0's finish() timed out and rank 0
        # exited: rank 1's finish() returns with a warning instead of raising
        # at the finish barrier that rank 0 no longer serves.
        eng = gossip.Engine({"w": torch.full((8,), float(rank))}, config={"policy": {"name": "periodic", "every": 1}})
        for _ in range(5):
            eng.step(lr=0.1)
        if rank == 0:
            try:
                eng.finish()
                outcome = "finished"
            except gossip.TimeoutError:
                outcome = "timed out"
            torch.save({"outcome": outcome}, os.path.join(out_dir, f"rank{rank}.pt"))
            return
        time.sleep(steps)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng.finish()
        torch.save({"outcome": "finished", "warnings": [str(w.message) for w in caught]}, os.path.join(out_dir, f"rank{rank}.pt"))
    else:
        sys.exit(f"torch_worker.py: unknown mode '{mode}'")


if __name__ == "__main__":
    main()

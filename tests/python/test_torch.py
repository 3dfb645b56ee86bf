"""The Python module with PyTorch: torchrun runs of 2 and 4 processes over UCX
on this machine, checked against plain torch; errors; stats; README's script.

Run by tests/test_python.sh (meson test python), which skips when torch or the
module is absent. Every run is bounded: torchrun by a subprocess timeout, each
network wait by the engine's timeout (GOSSIP_TIMEOUT_S).
"""
import os
import pathlib
import random
import re
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import gossip

HERE = pathlib.Path(__file__).resolve().parent
SOURCE_ROOT = HERE.parent.parent
WORKER = HERE / "torch_worker.py"
RUN_TIMEOUT_S = 150


def free_port_pair():
    """A port P with P + 1 also free: torchrun's store takes P, the gossip rendezvous P + 1.

    Below the kernel's ephemeral range: a port from that range that is free now
    may become the local port of some outgoing connection (the store's
    clients, another test's) before rank 0 listens on it."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10002, low - 1))
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free TCP ports on 127.0.0.1")


# torch 1.13 under Python 3.11 cannot parse the default --redirects/--tee of 0
# (enum.Flag no longer iterates over its zero member): redirect stderr (2) to
# files and tee it back, which leaves stdout as it is.
TORCHRUN_STD = ["--redirects", "2", "--tee", "2"]


def torchrun(nproc, *args):
    """Runs `args` under torchrun with `nproc` local ranks; returns (exit status, output)."""
    log_dir = tempfile.mkdtemp(prefix="gossip-torchrun-")
    try:
        return torchrun_logging_to(log_dir, nproc, *args)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def torchrun_logging_to(log_dir, nproc, *args):
    env = dict(os.environ)
    env.update(UCX_NET_DEVICES="lo", OMP_NUM_THREADS="1", GOSSIP_TIMEOUT_S=env.get("GOSSIP_TIMEOUT_S", "30"))
    # Unbuffered, print() writes a line and its newline separately, and ranks' lines interleave.
    for var in ("GOSSIP_RANK", "GOSSIP_WORLD_SIZE", "GOSSIP_MASTER_ADDR", "GOSSIP_MASTER_PORT", "PYTHONUNBUFFERED"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port_pair()), "--max_restarts", "0",
           "--monitor_interval", "0.2", *TORCHRUN_STD, "--log_dir", log_dir, *map(str, args)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {RUN_TIMEOUT_S} s: {' '.join(cmd)}\n{out}")
    return proc.returncode, out


@pytest.fixture
def one_rank(monkeypatch):
    """This process as rank 0 of 1 (no peers: the loopback transport)."""
    for var in ("GOSSIP_RANK", "GOSSIP_WORLD_SIZE", "GOSSIP_MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")


def initial_tensors(world):
    """Every rank's initial tensors, as torch_worker.py makes them."""
    sys.path.insert(0, str(HERE))
    try:
        from torch_worker import initial_tensors as of_rank
    finally:
        sys.path.pop(0)
    return [of_rank(r) for r in range(world)]


CUDA_SKIP = ("the module was built without CUDA" if not gossip.has_cuda
             else "no usable CUDA GPU for torch (torch.cuda.is_available() is False)" if not torch.cuda.is_available()
             else f"no usable CUDA GPU for libgossip_cuda: {gossip.cuda_unavailable_reason()}" if gossip.cuda_unavailable_reason()
             else None)
needs_cuda = pytest.mark.skipif(CUDA_SKIP is not None, reason=CUDA_SKIP or "")


@pytest.mark.parametrize("world,device,codec", [(2, "cpu", "none"), (4, "cpu", "none"), (4, "cpu", "auto"),
                                                pytest.param(2, "cuda", "none", marks=needs_cuda),
                                                pytest.param(2, "cuda", "auto", marks=needs_cuda)])
def test_average_matches_plain_torch(world, device, codec, tmp_path):
    steps = 30
    status, out = torchrun(world, WORKER, "average", tmp_path, steps, device, codec)
    assert status == 0, out
    # auto (the default codec): int8 over UCX for host tensors, none for device ones.
    codec_used = "int8" if codec == "auto" and device == "cpu" else "none"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    initial = initial_tensors(world)
    expected = {k: torch.stack([t[k] for t in initial]).mean(0) for k in initial[0]}  # the plain average
    total = sum(r["weight"] for r in ranks)
    assert total == pytest.approx(world, abs=1e-6), "push-sum mass is conserved once every rank has drained"
    for name, mean in expected.items():
        # Push-sum's estimate of the average, sum(w_i x_i) / sum(w_i): exact once drained without a codec;
        # with int8 a receiver merges the sender's x̂, which error feedback keeps within a rounding step of x.
        estimate = sum(r["weight"] * r["tensors"][name] for r in ranks) / total
        spread = max((t[name] - mean).abs().max().item() for t in initial)
        tolerance = 1e-5 if codec_used == "none" else 0.01 * spread
        torch.testing.assert_close(estimate, mean, atol=tolerance, rtol=1e-5 if codec_used == "none" else 0)
        for r in ranks:
            # Every rank ends near the average: gossip rounds shrink the initial spread by orders of magnitude.
            assert (r["tensors"][name] - mean).abs().max().item() < 0.05 * spread, f"rank {r['stats']['rank']} tensor {name}"

    for rank, r in enumerate(ranks):
        s = r["stats"]
        assert (s["rank"], s["world"]) == (rank, world)
        assert (s["policy"], s["topology"], s["protocol"], s["transport"], s["momentum"]) == ("periodic", "exponential", "push-sum", "ucx", "local")
        assert s["steps"] >= steps
        # Every step fires; a firing whose send buffers are all still on the wire is counted as busy.
        assert s["sends"] + s["send_busy"] >= steps and s["sends"] >= steps // 2
        assert s["decisions"]["period"] >= steps
        assert s["bytes_sent"] > 0 and s["messages_sent"] >= s["sends"]
        assert s["messages_received"] > 0 and s["dead_peers"] == []
        assert [t["name"] for t in s["tensors"]] == ["w", "b"]
        assert all(t["bytes_sent"] > 0 for t in s["tensors"])
        assert s["peers"] and all(0 <= p["rank"] < world and p["rank"] != rank for p in s["peers"])
        assert s["weight"] == pytest.approx(r["weight"])
        assert s["device"] == ("cuda" if device == "cuda" else "host"), s["device"]
        assert s["codec"] == codec_used
        if codec_used == "int8":  # a byte a value and a scale; b's 7 values cost more with their segment header than in fp32
            assert s["tensors"][0]["bytes_sent"] < s["tensors"][0]["bytes_raw"], s["tensors"]
        else:
            assert s["bytes_sent"] == s["bytes_raw"]


def test_momentum_auto_stays_local_over_processes(tmp_path):
    # [engine] momentum = "auto" (the default): quasi-global only where ranks run in lockstep.
    status, out = torchrun(2, WORKER, "train", tmp_path, 60, "auto")
    assert status == 0, out
    for r in range(2):
        s = torch.load(tmp_path / f"rank{r}.pt")["stats"]
        assert (s["momentum"], s["transport"]) == ("local", "ucx")


def test_training_with_quasi_global_momentum(tmp_path):
    status, out = torchrun(2, WORKER, "train", tmp_path, 200, "quasi-global")
    assert status == 0, out
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert r["stats"]["momentum"] == "quasi-global"
        assert r["same_buffers"], "the optimizer kept the momentum buffers the engine was given"
    # Rank r's data alone: bias r; all data: the mean, 0.5. Push-sum weights
    # that collapse onto one rank put it near 0 or 1; with both ranks' say
    # it lands near 0.5 (0.65 measured once with the whole suite running
    # beside it, so the band is ±0.2).
    bias = sum(r["weight"] * r["bias"] for r in ranks) / sum(r["weight"] for r in ranks)
    assert bias.item() == pytest.approx(0.5, abs=0.2)


def readme_snippet(path):
    readme = (SOURCE_ROOT / "README.md").read_text()
    m = re.search(r"<!-- snippet: " + re.escape(path) + r" -->\n```python\n(.*?)```\n", readme, re.S)
    assert m, f"README.md has no `<!-- snippet: {path} -->` followed by a ```python block"
    return m.group(1)


def test_readme_script_runs_as_written(tmp_path):
    path = "examples/00_training_loop/pytorch.py"
    text = readme_snippet(path)
    assert text == (SOURCE_ROOT / path).read_text(), f"README.md's snippet differs from {path}; copy the file into README"
    script = tmp_path / "pytorch.py"
    script.write_text(text)
    status, out = torchrun(4, script)
    assert status == 0, out
    lines = re.findall(r"rank (\d): b = (-?[0-9.]+) \(its data alone: \d, all data: 1.5\), w = ([0-9.]+), (\d+) sends of (\d+) steps, "
                       r"(\d+) bytes sent", out)
    assert sorted(int(l[0]) for l in lines) == [0, 1, 2, 3], out
    for rank, b, w, sends, steps, sent in lines:
        assert 0 < int(sends) <= int(steps) and int(sent) > 0, out
    # Push-sum conserves mass: the weights sum to the world size once every rank has drained.
    assert sum(float(w) for _, _, w, *_ in lines) == pytest.approx(4, abs=0.01), out
    # The average model's intercept lies between the ranks' own (0 and 3); how close
    # it comes to 1.5 depends on the timing of the sends.
    average = sum(float(w) * float(b) for _, b, w, *_ in lines) / 4
    assert 0 < average < 3, out


def test_a_rank_that_drops_its_engine_without_finish_holds_no_one(tmp_path):
    # Its transport says goodbye without the drain handshake: rank 0 counts it
    # as failed at once, neither stalls on it (max_lead) nor times out on sends
    # to it, and its finish() does not wait for it at the finish barrier.
    status, out = torchrun(2, WORKER, "drop", tmp_path, 10)
    assert status == 0, out
    r0 = torch.load(tmp_path / "rank0.pt")
    assert r0["stats"]["dead_peers"] == [1], out
    assert r0["seconds"] < 10, (r0["seconds"], out)  # the engine's timeout is 20 s
    assert "left before its drain handshake" in out, out


def test_finish_after_rank_0_dropped_its_engine(tmp_path):
    # Rank 0 serves the rendezvous; once it is found dead, rank 1's finish()
    # has no barrier to pass.
    status, out = torchrun(2, WORKER, "drop0", tmp_path, 10)
    assert status == 0, out
    r1 = torch.load(tmp_path / "rank1.pt")
    assert r1["stats"]["dead_peers"] == [0], out


def test_a_forked_child_leaves_the_engine_to_its_parent(tmp_path):
    status, out = torchrun(2, WORKER, "fork", tmp_path, 0)
    assert status == 0, out
    for r in (0, 1):
        assert torch.load(tmp_path / f"rank{r}.pt")["stats"]["dead_peers"] == [], out


def test_finish_after_a_peer_died_does_not_wait_for_it(tmp_path):
    status, out = torchrun(2, WORKER, "die", tmp_path, 20)
    assert status == 0, out
    r0 = torch.load(tmp_path / "rank0.pt")
    assert r0["stats"]["dead_peers"] == [1], out
    assert r0["seconds"] < 12, (r0["seconds"], out)  # a timeout of 4 s to find it dead, none at the finish barrier


def test_ctrl_c_ends_a_wait_on_a_peer(tmp_path):
    # finish() waits on a silent peer with the GIL released: SIGINT must raise
    # KeyboardInterrupt out of it at once, not after the engine's 20 s timeout.
    status, out = torchrun(2, WORKER, "interrupt", tmp_path, 8)
    assert status == 0, out
    r0 = torch.load(tmp_path / "rank0.pt")
    assert r0["outcome"] == "interrupted", (r0, out)
    assert r0["seconds"] < 5, (r0, out)


def test_finish_called_again_after_an_interrupt_loses_no_weight(tmp_path):
    status, out = torchrun(2, WORKER, "refinish", tmp_path, 3)
    assert status == 0, out
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["outcome"] == "interrupted", (r0, out)
    assert r0["stats"]["dead_peers"] == [] and r1["stats"]["dead_peers"] == [], out
    assert abs(r0["weight"] + r1["weight"] - 2.0) < 1e-9, (r0["weight"], r1["weight"], out)


def test_finish_after_rank_0_timed_out_and_exited_warns_and_returns(tmp_path, monkeypatch):
    monkeypatch.setenv("GOSSIP_TIMEOUT_S", "3")  # rank 0's finish() gives up on rank 1 after 3 s
    status, out = torchrun(2, WORKER, "late", tmp_path, 5)
    assert status == 0, out
    assert torch.load(tmp_path / "rank0.pt")["outcome"] == "timed out", out
    r1 = torch.load(tmp_path / "rank1.pt")
    assert any("rank 0 exited before every rank was through" in w for w in r1["warnings"]), (r1, out)


def test_world_size_disagreeing_with_config(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[policy]\nname = "periodic"\n\n[train]\nworkers = 4\n')
    status, out = torchrun(2, WORKER, "config", cfg)
    assert status != 0
    assert f"{cfg} [train]: workers = 4 but the world has 2 ranks" in out, out


def test_one_engine_over_the_network_at_a_time(tmp_path):
    status, out = torchrun(2, WORKER, "twice")
    assert status == 0, out
    assert out.count("another Engine of this process has not finished and still holds the rendezvous") == 2, out
    assert len(re.findall(r"stats after finish: steps \d+ \d+ weight True", out)) == 2, out
    waited = re.findall(r"rank 1: built after (\S+) s", out)
    assert len(waited) == 1 and float(waited[0]) > 1.0, out  # it did not take rank 0's old store for the new one
    # (Numbers only: the two ranks' lines may meet on the shared stdout without a newline between them.)
    num = r"(-?\d+\.\d+)"
    ranges = re.findall(rf"rank \d: a {num}\.\.{num} c {num}\.\.{num}", out)
    assert len(ranges) == 2, out
    for r in ranges:
        lo_a, hi_a, lo_c, hi_c = map(float, r)
        assert 0 <= lo_a and hi_a <= 1 and 20 <= lo_c and hi_c <= 21, out


def test_a_weight_of_another_shape_on_a_peer_is_refused(tmp_path):
    # 2x5 against 5x2: equal counts, but averaging them would mix unrelated values.
    status, out = torchrun(2, WORKER, "shape")
    assert status != 0
    assert "tensor #0 'w' is a matrix of 2 rows x 5 columns here but a matrix of 5 rows x 2 columns there" in out, out
    assert "gossip.LayoutError, a ConfigError: True" in out, out


def test_errors_name_the_parameter(one_rank):
    with pytest.raises(ValueError, match=r"parameter 'fc\.weight' is not contiguous"):
        gossip.Engine([("fc.weight", torch.zeros(4, 3).t())])
    with pytest.raises(TypeError, match=r"parameter 'fc\.bias' is torch\.float64; the engine exchanges torch\.float32"):
        gossip.Engine([("fc.weight", torch.zeros(4)), ("fc.bias", torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(TypeError, match=r"parameter 'x' is a list, not a torch tensor"):
        gossip.Engine([("x", [1.0, 2.0])])
    with pytest.raises(ValueError, match=r"parameter 'layer\\ud800\.weight' has a name that UTF-8 cannot encode"):
        gossip.Engine([("layer\ud800.weight", torch.zeros(4))])
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"optimizer= takes torch\.optim\.SGD"):
        gossip.Engine(model.named_parameters(), optimizer=torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match=r"nesterov=True"):
        gossip.Engine(model.named_parameters(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True))
    # RMSprop has a momentum too; a buffer it did not make would break its first step.
    with pytest.raises(ValueError, match=r"optimizer= takes torch\.optim\.SGD .*got a RMSprop"):
        gossip.Engine(model.named_parameters(), optimizer=torch.optim.RMSprop(model.parameters(), momentum=0.9))
    # An Engine() that fails leaves the optimizer as it was.
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(gossip.ConfigError, match=r"workers"):
        gossip.Engine(model.named_parameters(), optimizer=sgd, config={"train": {"workers": 4}})
    assert all("momentum_buffer" not in sgd.state[p] for p in model.parameters())


def test_device_errors_name_the_parameter(one_rank):
    with pytest.raises(ValueError, match=r"parameter 'fc\.bias' is on device 'meta'; this (build of the )?module takes CPU"):
        gossip.Engine([("fc.weight", torch.zeros(4)), ("fc.bias", torch.empty(3, device="meta"))])


@needs_cuda
def test_cuda_model_steps_on_its_device(one_rank):
    model = torch.nn.Linear(8, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(32, 8, device="cuda")
    with gossip.Engine(model.named_parameters(), optimizer=opt, config={"policy": {"name": "periodic", "every": 2}}) as eng:
        for _ in range(6):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            eng.step(lr=0.05, loss=loss.item())
    s = eng.stats()
    # One rank over loopback merges in lockstep: under "auto" the drift kernel makes the momentum quasi-global.
    assert (s["device"], s["momentum"], s["steps"]) == ("cuda", "quasi-global", 6)
    assert model.weight.is_cuda and torch.isfinite(model.weight).all()
    assert opt.state[model.weight]["momentum_buffer"].is_cuda
    with pytest.raises(ValueError, match=r"parameter 'bias' is on device 'cpu' but parameter 'weight' is on 'cuda:0'"):
        gossip.Engine([("weight", model.weight), ("bias", torch.zeros(4))])
    with gossip.Engine(model.named_parameters(), optimizer=opt, config={"engine": {"momentum": "local"}}) as eng:
        eng.step(lr=0.05)
    assert eng.stats()["momentum"] == "local"


@needs_cuda
def test_cuda_quasi_global_momentum_matches_the_cpu(one_rank):
    """The drift kernel's momentum update against the host pass: the same model, data and steps on the GPU and the CPU."""
    finals = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(3)
        model = torch.nn.Linear(16, 8).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(64, 16).to(device), torch.randn(64, 8).to(device)
        with gossip.Engine(model.named_parameters(), optimizer=opt,
                           config={"policy": {"name": "periodic", "every": 3}, "engine": {"momentum": "quasi-global"}}) as eng:
            for _ in range(20):
                loss = (model(x) - y).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                eng.step(lr=0.1)
        assert eng.stats()["momentum"] == "quasi-global"
        finals[device] = ([p.detach().cpu() for p in model.parameters()],
                          [opt.state[p]["momentum_buffer"].detach().cpu() for p in model.parameters()])
    for cpu, gpu in zip(finals["cpu"][0] + finals["cpu"][1], finals["cuda"][0] + finals["cuda"][1]):
        assert torch.allclose(cpu, gpu, rtol=1e-3, atol=1e-4), (cpu - gpu).abs().max()


def test_storage_reallocated_after_registration(one_rank):
    model = torch.nn.Linear(3, 2)
    eng = gossip.Engine(model.named_parameters())
    eng.step(lr=0.1)
    with torch.no_grad():
        model.weight.add_(1.0)  # in place: fine
    eng.step(lr=0.1)
    model.weight.data = torch.zeros(2, 3)  # new storage
    with pytest.raises(gossip.Error, match=r"storage of parameter 'weight' was reallocated after registration"):
        eng.step(lr=0.1)


def test_a_parameter_resized_in_place_is_refused(one_rank):
    model = torch.nn.Linear(3, 2)
    eng = gossip.Engine(model.named_parameters())
    eng.step(lr=0.1)
    model.bias.requires_grad_(False)  # frozen: torch resizes it in place (one that requires grad it refuses to)
    before = model.bias.data_ptr()
    model.bias.resize_(1)  # fewer values, same storage
    assert model.bias.data_ptr() == before
    with pytest.raises(gossip.Error, match=r"parameter 'bias' was resized after registration \(1 values, registered 2\)"):
        eng.step(lr=0.1)


def test_a_learning_rate_that_is_negative_or_not_finite_is_refused(one_rank):
    model = torch.nn.Linear(3, 2)
    with gossip.Engine(model.named_parameters()) as eng:
        for lr in (-0.1, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=r"gossip.Engine.step: lr=.*finite, >= 0; 0 or leaving it out: not known"):
                eng.step(lr=lr)
        assert eng.stats()["steps"] == 0
        eng.step()  # lr not known: fine


def test_a_model_gone_nan_is_refused_before_it_is_sent(one_rank):
    model = torch.nn.Linear(3, 2)
    eng = gossip.Engine(model.named_parameters())
    eng.step(lr=0.1)
    with torch.no_grad():
        model.bias[1] = float("nan")
    with pytest.raises(gossip.Error, match=r"rank 0\): at step 1, tensor \"bias\" holds NaN or infinite values"):
        eng.step(lr=0.1)


def test_momentum_buffer_replaced(one_rank):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eng = gossip.Engine(model.named_parameters(), optimizer=opt)
    assert eng.stats()["momentum"] == "quasi-global"
    opt.state[model.bias]["momentum_buffer"] = torch.zeros(2)
    with pytest.raises(gossip.Error, match=r"momentum buffer of parameter 'bias' was replaced"):
        eng.step(lr=0.1)
    with pytest.raises(ValueError, match=r"needs the step's learning rate"):
        gossip.Engine(model.named_parameters(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)).step()


def test_momentum_buffers_replaced_by_load_state_dict(one_rank):
    # load_state_dict replaces optimizer.state (a new dict, copied buffers): the engine must notice.
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eng = gossip.Engine(model.named_parameters(), optimizer=opt)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    eng.step(lr=0.1)
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(gossip.Error, match=r"momentum buffer of parameter '(weight|bias)' was replaced"):
        eng.step(lr=0.1)


def test_config_errors_name_the_source(one_rank, tmp_path):
    with pytest.raises(gossip.ConfigError, match=r"config dict \[policy\]: unknown key 'evry' for policy 'periodic' \(did you mean 'every'\?\)"):
        gossip.Engine({"w": torch.zeros(2)}, config={"policy": {"name": "periodic", "evry": 2}})
    with pytest.raises(gossip.ConfigError, match=r"config dict \[policy\]: unknown key 'max interval' for policy 'consensus' \(did you mean 'max_interval'\?\)"):
        gossip.Engine({"w": torch.zeros(2)}, config={"policy": {"max interval": 1}})
    with pytest.raises(gossip.ConfigError, match=r"config dict: \['engine'\]\['max_lead'\] = 10+ does not fit a 64-bit integer"):
        gossip.Engine({"w": torch.zeros(2)}, config={"engine": {"max_lead": 10**30}})
    with pytest.raises(gossip.ConfigError, match=r"cannot open the config file"):
        gossip.Engine({"w": torch.zeros(2)}, config=tmp_path / "missing.toml")
    with pytest.raises(gossip.ConfigError, match=r"is a directory, not a config file"):
        gossip.Engine({"w": torch.zeros(2)}, config=tmp_path)
    cfg = tmp_path / "run.toml"
    cfg.write_text("[policy]\nname = \"periodic\"\nevery = 3\n[engine]\nmomentum_beta = 0.5\n")
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"momentum_beta = 0.5 but the optimizer's momentum is 0.9"):
        gossip.Engine(model.named_parameters(), config=cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def test_check_config_needs_no_model_or_peers(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "GOSSIP_RANK", "GOSSIP_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert gossip.check_config({"codec": {"name": "int8"}, "train": {"workers": 4}}, world=4) is None
    cfg = tmp_path / "run.toml"
    cfg.write_text("[policy]\nname = \"periodic\"\nevery = 0\n")
    with pytest.raises(gossip.ConfigError, match=r"run.toml \[policy\]: key 'every'"):
        gossip.check_config(cfg, world=2)
    with pytest.raises(gossip.ConfigError, match=r"config dict \[codec\]: unknown codec 'bogus'"):
        gossip.check_config({"codec": {"name": "bogus"}}, world=2)
    with pytest.raises(gossip.ConfigError, match=r"transport 'switch' is not available from Python"):
        gossip.check_config({"transport": {"name": "switch"}}, world=2)
    with pytest.raises(gossip.ConfigError, match=r"workers = 4 but the world has 2 ranks"):
        gossip.check_config({"train": {"workers": 4}}, world=2)
    with pytest.raises(gossip.ConfigError, match=r"give world= \(the number of ranks\), or run it under torchrun"):
        gossip.check_config({})
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(gossip.ConfigError, match=r"workers = 4 but the world has 3 ranks \(RANK/WORLD_SIZE, this is rank 1\)"):
        gossip.check_config({"train": {"workers": 4}})
    with pytest.raises(ValueError, match=r"world = 0"):
        gossip.check_config({}, world=0)
    # What the engine refuses against its transport (UCX between processes) and in combination.
    with pytest.raises(gossip.ConfigError, match=r"same_step_merge = true needs a transport whose ranks run in lockstep .*transport 'ucx'"):
        gossip.check_config({"engine": {"same_step_merge": True}}, world=2)
    assert gossip.check_config({"engine": {"same_step_merge": True}}, world=1) is None
    # The report paths, as every rank's engine checks them.
    with pytest.raises(gossip.ConfigError, match=r"every one of the 4 ranks would write this one file; put \{rank\} in the path"):
        gossip.check_config({"engine": {"stats": "stats.json"}}, world=4)
    with pytest.raises(gossip.ConfigError, match=r"stats = 'a\{rank\}' and trace = 'a\{rank\}' name the same file"):
        gossip.check_config({"engine": {"stats": "a{rank}", "trace": "a{rank}"}}, world=2)
    # Every rank's directory, not rank 0's alone.
    (tmp_path / "out" / "0").mkdir(parents=True)
    (tmp_path / "out" / "1").mkdir()
    per_rank = {"engine": {"stats": str(tmp_path / "out" / "{rank}" / "stats.json")}}
    assert gossip.check_config(per_rank, world=2) is None
    with pytest.raises(gossip.ConfigError, match=r"the directory .*/out/2 does not exist or is not writable"):
        gossip.check_config(per_rank, world=3)
    # Settings that only push-sum would use.
    with pytest.raises(gossip.ConfigError, match=r"in_flight_makeup = true applies to protocol 'push-sum' .* not to 'pairwise'"):
        gossip.check_config({"protocol": {"name": "pairwise"}, "engine": {"in_flight_makeup": True}}, world=2)
    # Left unset, the transport between processes is UCX, and the messages say so.
    with pytest.raises(gossip.ConfigError, match=r"needs transport 'switch' .* name is 'ucx'"):
        gossip.check_config({"protocol": {"name": "switch-aggregate"}}, world=2)
    with pytest.raises(gossip.ConfigError, match=r"numerator_steps = true counts every optimizer step in full already; set in_flight_makeup"):
        gossip.check_config({"engine": {"numerator_steps": True, "in_flight_makeup": True}}, world=2)
    # The topology against the world size, as the engine builds it.
    with pytest.raises(gossip.ConfigError, match=r"the edges leave rank\(s\) 3 unconnected to rank 0 in a world of 4"):
        gossip.check_config({"topology": {"name": "edges", "edges": [[0, 1], [1, 2]]}}, world=4)
    with pytest.raises(gossip.ConfigError, match=r"edge \[1, 5\] is invalid for a world of 4 ranks"):
        gossip.check_config({"topology": {"name": "edges", "edges": [[0, 1], [1, 5]]}}, world=4)
    with pytest.raises(gossip.ConfigError, match=r"key 'edges' must list pairs of ranks"):
        gossip.check_config({"topology": {"name": "edges"}}, world=4)
    assert gossip.check_config({"topology": {"name": "edges", "edges": [[0, 1], [1, 2], [2, 3]]}}, world=4) is None


def test_misuse_that_would_give_wrong_results_is_refused(one_rank):
    # Momentum groups stepping with different learning rates: one lr rebuilds every buffer.
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.1}, {"params": m[1].parameters(), "lr": 0.001}], lr=0.1, momentum=0.9)
    eng = gossip.Engine(m.named_parameters(), optimizer=opt, config={"engine": {"momentum": "quasi-global"}})
    with pytest.raises(ValueError, match=r"lr=0.1 but optimizer param_groups\[1\] has lr=0.001"):
        eng.step(lr=0.1)
    opt.param_groups[1]["lr"] = 0.1  # a scheduler that keeps them equal is fine
    eng.step(lr=0.1)
    eng.finish()
    # The same parameter twice would be merged twice at every exchange.
    p = torch.zeros(4)
    with pytest.raises(gossip.Error, match=r"tensor 'b' shares memory with tensor 'a'"):
        gossip.Engine([("a", p), ("b", p)])
    # finish() is idempotent, also inside `with` and after the model moved on.
    lin = torch.nn.Linear(4, 3)
    with gossip.Engine(lin.named_parameters()) as e:
        e.step()
        e.finish()
        lin.weight.data = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"rounds=-5"):
        gossip.Engine(torch.nn.Linear(2, 2).named_parameters()).finish(rounds=-5)


def scheduled_steps(m, opt, sched, eng, steps):
    """The usual order: optimizer.step(); scheduler.step(); eng.step(lr=the lr the optimizer used)."""
    for _ in range(steps):
        m(torch.randn(8, 4)).square().mean().backward()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        opt.zero_grad()
        sched.step()
        eng.step(lr=lr)


def test_a_scheduler_stepped_before_the_engine_is_the_usual_order(one_rank):
    # optimizer.step(); scheduler.step(); eng.step(lr=the lr the optimizer used): the group already holds the next lr.
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    eng = gossip.Engine(m.named_parameters(), optimizer=opt, config={"engine": {"momentum": "quasi-global"}})
    scheduled_steps(m, opt, sched, eng, 5)
    with pytest.raises(ValueError, match=r"lr=0.3 but optimizer param_groups\[0\] has lr=0.025 \(and had lr=0.025 when the last step"):
        eng.step(lr=0.3)
    eng.finish()


def test_a_scheduler_that_changes_momentum_is_refused(one_rank):
    # OneCycleLR cycles SGD's momentum by default: the engine rebuilds the buffers with one β.
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    eng = gossip.Engine(m.named_parameters(), optimizer=opt, config={"engine": {"momentum": "quasi-global"}})
    with pytest.raises(ValueError, match=r"param_groups\[0\] has momentum=0\.9\d* \(and had momentum=0\.9\d* when the last step\(\) "
                       r"returned\) but the engine rebuilds the momentum buffers with the momentum it was built with, 0\.95.*"
                       r"cycle_momentum=False\) needs \[engine\] momentum = \"local\""):
        scheduled_steps(m, opt, sched, eng, 5)
    eng.finish()
    # With cycle_momentum=False, or local momentum, it trains.
    for cycle, momentum in ((False, "quasi-global"), (True, "local")):
        m = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20, cycle_momentum=cycle)
        with gossip.Engine(m.named_parameters(), optimizer=opt, config={"engine": {"momentum": momentum}}) as eng:
            scheduled_steps(m, opt, sched, eng, 5)
            eng.finish()


def test_inputs_that_are_not_what_the_engine_takes_are_named(one_rank):
    with pytest.raises(TypeError, match=r"config= takes the path of a TOML file .* got a int"):
        gossip.Engine([("w", torch.zeros(4))], config=5)
    with pytest.raises(gossip.ConfigError, match=r"^/nonexistent/gossip.toml: cannot open"):
        gossip.Engine([("w", torch.zeros(4))], config=b"/nonexistent/gossip.toml")
    with pytest.raises(gossip.ConfigError, match=r"\['policy'\]\['x'\] holds lists nested more than two deep"):
        gossip.check_config({"policy": {"x": [[[1]]]}}, world=2)
    with pytest.raises(gossip.ConfigError, match=r"\['policy'\]\['name'\] is not text that UTF-8 can encode"):
        gossip.check_config({"policy": {"name": "\ud800"}}, world=2)
    with pytest.raises(gossip.ConfigError, match=r"\['policy'\]\['name'\] holds a NUL character"):
        gossip.check_config({"policy": {"name": "nev\x00er"}}, world=2)
    with pytest.raises(gossip.ConfigError, match=r"unknown policy 'nev\x7fer'"):
        gossip.check_config({"policy": {"name": "nev\x7fer"}}, world=2)
    with pytest.raises(ValueError, match=r"world = 1000000000; give a world size in 1..1048576"):
        gossip.check_config({}, world=10**9)
    with pytest.raises(TypeError, match=r"parameter 's' has layout torch.sparse_coo"):
        gossip.Engine([("s", torch.zeros(4).to_sparse())])
    with pytest.raises(ValueError, match=r"parameter 'weight' is not initialized yet"):
        gossip.Engine(torch.nn.LazyLinear(2).named_parameters())
    other = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"optimizer= steps none of the registered tensors"):
        gossip.Engine(torch.nn.Linear(3, 2).state_dict(), optimizer=other)
    bare = gossip.Engine.__new__(gossip.Engine)  # no __init__: no engine behind it
    for use in (bare.stats, lambda: bare.step(lr=0.1), bare.finish, lambda: bare.weight, lambda: bare.rank, bare.__enter__):
        with pytest.raises(TypeError, match=r"made by Engine.__new__ without __init__"):
            use()
    with pytest.raises(TypeError, match=r"called on a int, not on a gossip.Engine"):
        gossip.Engine.stats(3)


def test_a_daemon_thread_waiting_in_the_engine_lets_the_process_exit(tmp_path):
    # Rank 1 never comes: the daemon thread waits in the engine's rendezvous while the interpreter exits.
    script = tmp_path / "daemon.py"
    script.write_text("import threading, time, torch, gossip\n"
                      "threading.Thread(target=lambda: gossip.Engine([('w', torch.zeros(4))]), daemon=True).start()\n"
                      "time.sleep(1)\nprint('main exits', flush=True)\n")
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_pair()),
               GOSSIP_TIMEOUT_S="30")
    for var in ("GOSSIP_RANK", "GOSSIP_WORLD_SIZE", "GOSSIP_MASTER_PORT"):
        env.pop(var, None)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "main exits" in r.stdout


def test_a_thread_reading_stats_never_fails_a_step(one_rank):
    import threading
    eng = gossip.Engine([("w", torch.zeros(1000))], config={"policy": {"name": "periodic", "every": 1}})
    stop = threading.Event()
    reads = [0, 0]  # served, refused while a step ran

    def reader():
        while not stop.is_set():
            try:
                eng.stats()
                reads[0] += 1
            except gossip.Error as e:
                assert "in use by another thread" in str(e)
                reads[1] += 1

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(3000):
            eng.step(lr=0.1)  # never refused because of the reader
    finally:
        stop.set()
        t.join()
    assert reads[0] > 0
    eng.finish()


def test_timeout_error_is_also_the_builtin_one():
    assert issubclass(gossip.TimeoutError, TimeoutError) and issubclass(gossip.TimeoutError, gossip.Error)


def test_a_with_block_left_by_an_exception_waits_for_a_thread_inside_step(one_rank):
    import threading
    errors = []
    stop = threading.Event()

    def train(eng):
        while not stop.is_set():
            try:
                eng.step(lr=0.1)
            except gossip.Error as e:
                errors.append(str(e))
                return

    with pytest.raises(RuntimeError, match="the user's error"):
        with gossip.Engine([("w", torch.ones(1_000_000))], config={"policy": {"name": "periodic", "every": 1}}) as eng:
            t = threading.Thread(target=train, args=(eng,))
            t.start()
            time.sleep(0.3)
            raise RuntimeError("the user's error")
    stop.set()
    t.join()
    assert errors and "left its peers when its `with` block ended by an exception" in errors[0], errors


def test_config_dict_takes_numbers_of_numpy_and_torch(one_rank):
    import numpy as np
    gossip.check_config({"policy": {"name": "periodic", "every": np.int64(3)}, "engine": {"timeout_s": np.float32(5)}}, world=1)
    gossip.check_config({"policy": {"name": "periodic", "every": torch.tensor(2)}}, world=1)
    with pytest.raises(gossip.ConfigError, match=r"\['policy'\]\['every'\] is a Tensor"):
        gossip.check_config({"policy": {"name": "periodic", "every": torch.ones(3)}}, world=1)


def test_optimizer_groups_of_unregistered_parameters_are_theirs_alone(one_rank):
    # Only the backbone is gossiped: the head's group may have its own lr and momentum.
    backbone, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt = torch.optim.SGD([{"params": backbone.parameters(), "lr": 0.01},
                           {"params": head.parameters(), "lr": 0.1, "momentum": 0.5}], momentum=0.9)
    eng = gossip.Engine(backbone.named_parameters(), optimizer=opt, config={"engine": {"momentum": "quasi-global"}})
    head(backbone(torch.randn(8, 4))).square().mean().backward()
    opt.step()
    eng.step(lr=0.01)
    eng.finish()


def test_local_momentum_lets_the_optimizer_replace_its_buffers(one_rank):
    # A checkpoint's load_state_dict: the engine never touches local buffers.
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eng = gossip.Engine(model.named_parameters(), optimizer=opt, config={"engine": {"momentum": "local"}})
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    eng.step(lr=0.1)
    opt.load_state_dict(opt.state_dict())
    opt.step()
    eng.step(lr=0.1)
    eng.finish()


def test_one_rank_step_and_stats(one_rank):
    model = torch.nn.Linear(3, 2)
    with gossip.Engine(model.named_parameters(), config={"policy": {"name": "periodic", "every": 2}}) as eng:
        results = [eng.step(lr=0.1, loss=1.0) for _ in range(4)]
    assert results[0].reason == "not_due" and results[1].reason == "period"
    s = eng.stats()
    assert (s["rank"], s["world"], s["steps"], s["policy"]) == (0, 1, 4, "periodic")
    assert [t["name"] for t in s["tensors"]] == ["weight", "bias"] == eng.names
    with pytest.raises(gossip.Error, match=r"finish\(\) was called"):
        eng.step(lr=0.1)


def test_lowrank_codec_takes_conv_and_linear_weights(one_rank):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    cfg = {"policy": {"name": "periodic", "every": 1}, "codec": {"name": "lowrank", "rank": 2}}
    with gossip.Engine(model.named_parameters(), config=cfg) as eng:
        for _ in range(3):
            eng.step(lr=0.1)
    assert eng.stats()["codec"] == "lowrank"


def test_policies_lists_components():
    names = [p["name"] for p in gossip.policies()]
    assert {"consensus", "periodic", "drift", "never"} <= set(names)
    periodic = next(p for p in gossip.policies() if p["name"] == "periodic")
    assert "every" in [o["key"] for o in periodic["options"]]
    c = gossip.components()
    assert {"exponential", "ring"} <= {t["name"] for t in c["topology"]}
    assert "push-sum" in {p["name"] for p in c["protocol"]}
    assert {"none", "int8", "topk", "lowrank"} <= {k["name"] for k in c["codec"]}
    assert "timeout_s" in {o["key"] for o in c["engine"]}
    # Defaults come as the values a config dict takes, so they can be copied into one.
    assert {o["key"]: o["default"] for o in periodic["options"]} == {"every": 1, "stagger": False}
    engine = {o["key"]: o["default"] for o in c["engine"]}
    assert engine["momentum"] == "auto" and engine["timeout_s"] == 60.0
    gossip.check_config({"engine": {k: engine[k] for k in ("momentum", "timeout_s", "max_lead")}}, world=1)

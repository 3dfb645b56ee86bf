#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "test_support.hpp"

using namespace gossip;
using gossip::test::run_ranks;
using gossip::test::spec_of;
using gossip::test::toy_model;

namespace {
// Every rank trains a toy "model" by a rank-dependent pull and gossips with the given policy.
struct run_result {
  std::vector<std::vector<float>> models;
  std::vector<engine_stats> stats;
};

run_result run(int world, int steps, const std::function<any_policy(int)>& policy, link_emulation link = {}, std::string topo = "exponential") {
  loopback_fabric fabric(world, link);
  run_result out;
  out.models.resize(world);
  out.stats.resize(world);
  run_ranks(world, [&](int r) {
    toy_model m({100, 37}, 1);
    engine e(m.view, r, world, spec_of(policy(r), topo), fabric.endpoint(r));
    for (int s = 0; s < steps; ++s) {
      for (auto& t : m.tensors)
        for (std::size_t i = 0; i < t.size(); ++i) t[i] += 0.01f * static_cast<float>((r + 1) * ((i % 7) + 1)) * (s % 3 == 0 ? 1 : -0.5f);
      e.step({.lr = 0.1});
    }
    e.finish(0);
    out.models[r] = m.flat();
    out.stats[r] = e.stats();
  });
  return out;
}
}  // namespace

TEST_CASE("loopback is deterministic: two runs give bit-identical models and counters") {
  auto policy = [](int r) { return any_policy(policies::drift{.threshold = 0.002 * (r + 1)}, "drift"); };
  const auto a = run(4, 60, policy);
  const auto b = run(4, 60, policy);
  for (int r = 0; r < 4; ++r) {
    CHECK(a.models[r] == b.models[r]);
    CHECK(a.stats[r].sends == b.stats[r].sends);
    CHECK(a.stats[r].bytes_sent == b.stats[r].bytes_sent);
  }
  CHECK(a.stats[0].sends > 0);
  CHECK(a.stats[0].skips > 0);
}

TEST_CASE("a message posted at step s is merged at step s + 1, and every byte is counted") {
  const int world = 2;
  loopback_fabric fabric(world);
  std::vector<std::vector<std::size_t>> merged(world);
  std::vector<engine_stats> stats(world);
  run_ranks(world, [&](int r) {
    toy_model m({10, 5}, 1);
    engine e(m.view, r, world, spec_of(any_policy(policies::periodic{.every = 3}, "periodic"), "ring"), fabric.endpoint(r));
    for (int s = 0; s < 9; ++s) merged[r].push_back(e.step().merged);
    e.finish(0);
    stats[r] = e.stats();
  });
  // periodic every 3 fires at steps 2, 5, 8 (steps_since_send counts the current step).
  for (int r = 0; r < world; ++r) {
    CHECK(merged[r] == std::vector<std::size_t>{0, 0, 0, 1, 0, 0, 1, 0, 0});
    CHECK(stats[r].sends == 3);
    const std::uint64_t msg = sizeof(wire_header) + 15 * sizeof(float);
    CHECK(stats[r].bytes_sent == 3 * msg);
    CHECK(stats[r].messages_sent == 3);
    CHECK(stats[r].bytes_received == 3 * msg);
    REQUIRE(stats[r].peers.size() == 1);
    CHECK(stats[r].peers[0].bytes_sent == 3 * msg);
    CHECK(stats[r].tensors[0].bytes_sent == 3 * 10 * sizeof(float));
  }
}

TEST_CASE("link emulation makes a round take at least bytes / bandwidth") {
  // 4000 floats ≈ 16 KB per message at 0.01 Gbit/s ≈ 12.8 ms per message.
  const int world = 2, steps = 10;
  loopback_fabric fabric(world, {.bandwidth_gbps = 0.01, .latency_us = 100});
  std::vector<double> seconds(world);
  run_ranks(world, [&](int r) {
    toy_model m({4000}, 1);
    engine e(m.view, r, world, spec_of(any_policy(policies::periodic{}, "periodic"), "ring"), fabric.endpoint(r));
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; ++s) e.step();
    e.finish(0);
    seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  const double per_msg = (sizeof(wire_header) + 4000.0 * 4) * 8 / 0.01e9;
  // Steps 1..9 each wait for the previous step's message: a lower bound, not a timing target.
  CHECK(seconds[0] >= 0.95 * (steps - 1) * per_msg);
  CHECK(seconds[1] >= 0.95 * (steps - 1) * per_msg);
}

TEST_CASE("a killed rank is reported dead and the others finish") {
  const int world = 4;
  loopback_fabric fabric(world);
  std::vector<engine_stats> stats(world);
  std::vector<double> final_weight(world);
  run_ranks(world, [&](int r) {
    toy_model m({50}, 1);
    engine e(m.view, r, world, spec_of(any_policy(policies::periodic{}, "periodic"), "complete", "push-sum", 10), fabric.endpoint(r));
    for (int s = 0; s < 40; ++s) {
      if (r == 2 && s == 15) {
        fabric.kill(2);  // this rank "crashes": it stops stepping
        return;
      }
      e.step();
    }
    e.finish(0);
    stats[r] = e.stats();
  });
  for (int r : {0, 1, 3}) {
    INFO("rank ", r);
    CHECK(stats[r].steps == 40);
    CHECK(stats[r].dead_peers == std::vector<int>{2});
    bool saw = false;
    for (const auto& p : stats[r].peers)
      if (p.rank == 2) saw = p.dead;
    CHECK(saw);
  }
}

TEST_CASE("a model that turns NaN or infinite is refused before it is sent, naming the rank, the step and the tensor") {
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    INFO("bad value ", bad);
    const int world = 2;
    loopback_fabric fabric(world);
    std::vector<std::vector<float>> models(world);
    std::vector<engine_stats> stats(world);
    run_ranks(world, [&](int r) {
      toy_model m({50, 20}, 1);
      engine e(m.view, r, world, spec_of(any_policy(policies::periodic{}, "periodic"), "complete", "push-sum", 10), fabric.endpoint(r));
      for (int s = 0; s < 12; ++s) {
        if (r == 1 && s == 5) {
          m.tensors[1][7] = bad;
          CHECK_THROWS_WITH_AS(e.step(), "engine (rank 1): at step 5, tensor \"t1\" holds NaN or infinite values (or values beyond about 1e19); "
                                         "sent on, they would spoil every peer's model, so the engine stops before it sends (what peers "
                                         "sent was merged first, in the same pass: a model restored from before this step loses that share "
                                         "of the push-sum mass); lower the learning rate, clip the gradients, or skip the optimizer step "
                                         "when the loss is not finite",
                               gossip::error);
          stats[r] = e.stats();
          fabric.kill(1);  // the training loop ends here, as a process would
          return;
        }
        e.step();
      }
      e.finish(0);
      models[r] = m.flat();
      stats[r] = e.stats();
    });
    CHECK(stats[1].steps == 5);  // the refused step did not count, and nothing left with it
    CHECK(stats[1].sends == 5);
    for (const float v : models[0]) REQUIRE(std::isfinite(v));
    CHECK(stats[0].dead_peers == std::vector<int>{1});
  }
}

namespace {
// Loopback, except that when the test arms it, it reports a rank found dead
// earlier once more, as a transport does that has since read that rank's own
// record of what it merged (received::settled): a correction to the shares
// handed back at the first report.
struct settling_transport : gossip::test::loopback_forward {
  double* armed = nullptr;  // the correction to report next (0: none)
  int dead = -1;
  std::size_t dead_peers(std::span<received> o) {
    std::size_t n = t.dead_peers(o);
    for (std::size_t i = 0; i < n; ++i) dead = o[i].sender;
    if (*armed != 0 && dead >= 0 && n < o.size()) {
      o[n++] = received{.sender = dead, .weight = std::exchange(*armed, 0.0), .settled = true};
    }
    return n;
  }
};
static_assert(gossip::transport<settling_transport>);
}  // namespace

TEST_CASE("a later settled report of a dead rank corrects the shares handed back, either way, and clears what was unconfirmed") {
  const int world = 2;
  loopback_fabric fabric(world);
  run_ranks(world, [&](int r) {
    toy_model m({32}, 1);
    double armed = 0;
    engine e(m.view, r, world, spec_of(any_policy(policies::periodic{}, "periodic"), "complete", "push-sum", 10),
             settling_transport{{fabric.endpoint(r)}, &armed});
    for (int s = 0; s < 4; ++s) e.step();
    if (r == 1) {
      fabric.kill(1);
      return;
    }
    for (int s = 0; s < 50 && e.stats().dead.empty(); ++s) e.step();
    REQUIRE(e.stats().dead.size() == 1);
    const auto first = e.stats().dead[0];
    const double w0 = e.stats().weight, lost0 = e.stats().lost_weight;
    armed = 0.25;  // a share that completed here never reached rank 1's model
    e.step();
    CHECK(e.stats().weight == doctest::Approx(w0 + 0.25).epsilon(1e-12));
    CHECK(e.stats().dead[0].weight_refunded == doctest::Approx(first.weight_refunded + 0.25).epsilon(1e-12));
    CHECK(e.stats().dead[0].weight_unconfirmed == 0);
    CHECK(e.stats().lost_weight == doctest::Approx(lost0 - first.weight_unconfirmed).epsilon(1e-12));
    armed = -0.125;  // one handed back as failed had landed there
    e.step();
    CHECK(e.stats().weight == doctest::Approx(w0 + 0.125).epsilon(1e-12));
    CHECK(e.stats().dead[0].weight_refunded == doctest::Approx(first.weight_refunded + 0.125).epsilon(1e-12));
    CHECK(e.stats().dead.size() == 1);
    CHECK(e.stats().dead_peers == std::vector<int>{1});
    e.finish(0);
  });
}

TEST_CASE("mismatched layouts are refused on both sides, naming the first differing tensor") {
  const int world = 2;
  loopback_fabric fabric(world);
  std::vector<std::string> messages(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      toy_model m({10, r == 0 ? std::size_t{5} : std::size_t{6}}, 1);
      try {
        engine e(m.view, r, world, spec_of(any_policy(policies::periodic{}, "periodic"), "ring", "push-sum", 5), fabric.endpoint(r));
      } catch (const layout_error& ex) {
        messages[r] = ex.what();
      }
    });
  for (auto& t : threads) t.join();
  CHECK(messages[0].find("tensor #1 't1' has 5 elements here but 6 there") != std::string::npos);
  CHECK(messages[0].find("rank 0 does not match rank 1") != std::string::npos);
  CHECK(messages[1].find("tensor #1 't1' has 6 elements here but 5 there") != std::string::npos);
}

TEST_CASE("a peer that never attaches is a timeout naming it, not a hang") {
  loopback_fabric fabric(2);
  toy_model m({10}, 1);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, spec_of(any_policy(policies::periodic{}, "periodic"), "ring", "push-sum", 0.3), fabric.endpoint(0)),
                       doctest::Contains("waiting for rank 1 to attach"), timeout_error);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
}

TEST_CASE("link emulation is bounded: a delay the engine's timeout cannot cut short is refused") {
  for (const link_emulation bad : {link_emulation{.bandwidth_gbps = 1e-12}, link_emulation{.bandwidth_gbps = -1},
                                   link_emulation{.bandwidth_gbps = std::numeric_limits<double>::quiet_NaN()},
                                   link_emulation{.latency_us = 1e12}, link_emulation{.latency_us = std::numeric_limits<double>::infinity()}})
    CHECK_THROWS_AS(loopback_fabric(2, bad), config_error);
  CHECK_NOTHROW(loopback_fabric(2, {.bandwidth_gbps = 0.001, .latency_us = 1e7}));
  // Within range, but a latency longer than the engine's timeout: refused when the engine attaches.
  {
    loopback_fabric slow(2, {.latency_us = 6e6});
    toy_model m({16}, 1);
    CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, spec_of(any_policy(policies::periodic{}, "periodic"), "ring", "push-sum", 5), slow.endpoint(0)),
                         doctest::Contains("the emulated latency (6000000 µs) is longer than the engine's timeout (5 s"), config_error);
  }
  // Within range, but one message of this model outlasts the engine's timeout on the wire: its post is refused.
  {
    loopback_fabric slow(2, {.bandwidth_gbps = 0.001});
    std::vector<std::string> messages(2);
    run_ranks(2, [&](int r) {
      toy_model m({1 << 20}, 1);  // 4 MiB: 34 s at 1 Mbit/s
      engine e(m.view, r, 2, spec_of(any_policy(policies::periodic{.every = 1}, "periodic"), "ring", "push-sum", 5), slow.endpoint(r));
      try {
        e.step({.lr = 0.1});
      } catch (const config_error& ex) {
        messages[static_cast<std::size_t>(r)] = ex.what();
      }
    });
    // (A rank whose peer refused first and left may find it gone instead.)
    CHECK((!messages[0].empty() || !messages[1].empty()));
    for (const auto& m : messages)
      if (!m.empty())
        CHECK_MESSAGE(m.find("would spend 33.6 s on the emulated link (0.001 Gbit/s, 0 µs), longer than the engine's timeout (5 s") != std::string::npos,
                      m);
  }
  auto cfg = config::parse("[transport]\nbandwidth_gbps = 2.5\n", "run.toml");
  CHECK(link_emulation::from(cfg.transport).bandwidth_gbps == 2.5);
  cfg.apply_override("transport.latency_us=-3");
  CHECK_THROWS_WITH_AS(link_emulation::from(cfg.transport), doctest::Contains("--set transport.latency_us=-3: key 'latency_us'"), config_error);
  cfg.apply_override("transport.name=ucx");
  CHECK_THROWS_WITH_AS(link_emulation::from(cfg.transport), doctest::Contains("transport 'ucx' was configured"), config_error);
}

TEST_CASE("ranks built from different gossip settings refuse to connect") {
  loopback_fabric fabric(2);
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int r) {
    toy_model m({10}, 1);
    auto s = spec_of(any_policy(policies::periodic{}, "periodic"), "ring", "push-sum", 5);
    s.config_fingerprint = 100 + static_cast<std::uint64_t>(r);
    try {
      engine e(m.view, r, 2, std::move(s), fabric.endpoint(r));
    } catch (const config_error& ex) {
      messages[r] = ex.what();
    }
  });
  CHECK(messages[0].find("rank 0 and rank 1 were built from different gossip settings (fingerprints") != std::string::npos);
  CHECK(messages[1].find("rank 1 and rank 0 were built from different gossip settings (fingerprints") != std::string::npos);
}

TEST_CASE("ranks built from different configs are told which setting differs") {
  loopback_fabric fabric(2);
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int r) {
    toy_model m({10}, 1);
    const auto cfg = config::parse(fmt::format("[topology]\nname = \"ring\"\n[codec]\nname = \"int8\"\nblock = {}\n", r == 0 ? 256 : 128),
                                   fmt::format("rank{}.toml", r));
    auto s = spec_of(any_policy(policies::periodic{}, "periodic"), "ring", "push-sum", 5);
    s.config_settings = cfg.shared_settings();
    s.config_fingerprint = cfg.fingerprint();
    try {
      engine e(m.view, r, 2, std::move(s), fabric.endpoint(r));
    } catch (const config_error& ex) {
      messages[r] = ex.what();
    }
  });
  CHECK(messages[0].find("(codec.block is 256 here but 128 on rank 1)") != std::string::npos);
  CHECK(messages[1].find("(codec.block is 128 here but 256 on rank 0)") != std::string::npos);
}

TEST_CASE("ranks whose config texts name different codecs are told of the setting, not of the codec it resolved to") {
  loopback_fabric fabric(2);
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int r) {
    toy_model m({10}, 1);
    const auto cfg = config::parse(r == 0 ? "[topology]\nname = \"ring\"\n" : "[topology]\nname = \"ring\"\n[codec]\nname = \"int8\"\n", "run.toml");
    auto s = spec_of(any_policy(policies::periodic{}, "periodic"), "ring", "push-sum", 5);
    s.config_settings = cfg.shared_settings();
    s.config_fingerprint = cfg.fingerprint();
    s.codec = cfg.codec;
    try {
      engine e(m.view, r, 2, std::move(s), fabric.endpoint(r));
    } catch (const config_error& ex) {
      messages[r] = ex.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(messages[r]);
    CHECK(messages[r].find(r == 0 ? "(codec.name is not set here but \"int8\" on rank 1)" : "(codec.name is \"int8\" here but not set on rank 0)") !=
          std::string::npos);
    CHECK(messages[r].find("max_lead") == std::string::npos);
  }
}

TEST_CASE("ranks whose codecs resolve differently refuse to connect, with the same config text") {
  // [codec] name = "auto" resolves on each rank from settings of its own
  // (max_lead, a device model): the codec in use is compared, not only the text.
  loopback_fabric fabric(2);
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int r) {
    toy_model m({10}, 1);
    const auto cfg = config::parse("[topology]\nname = \"ring\"\n", "run.toml");
    auto s = spec_of(any_policy(policies::periodic{}, "periodic"), "ring", "push-sum", 5);
    s.config_settings = cfg.shared_settings();
    s.config_fingerprint = cfg.fingerprint();
    if (r == 1) s.codec.name = "int8";  // what auto gives a rank over a network
    try {
      engine e(m.view, r, 2, std::move(s), fabric.endpoint(r));
    } catch (const config_error& ex) {
      messages[r] = ex.what();
    }
  });
  CHECK(messages[0].find("rank 0 and rank 1 would encode their messages differently (codec.in_use is \"none (from auto)\" here but \"int8\" "
                         "on rank 1)") != std::string::npos);
  CHECK(messages[1].find("(codec.in_use is \"int8\" here but \"none (from auto)\" on rank 0)") != std::string::npos);
  CHECK(messages[1].find("GOSSIP_MAX_LEAD") != std::string::npos);
}

TEST_CASE("a peer whose engine failed to build is dead to the others, not a topology error") {
  // Rank 0 gives up waiting for rank 1 (a short timeout) and its engine throws
  // after it attached; rank 1, built later, must find it departed, not read
  // its freed inbox (found by review under ASan: a heap-use-after-free and a
  // "does not expect messages" error).
  loopback_fabric fabric(2);
  std::string error0, error1;
  int steps1 = 0;
  run_ranks(2, [&](int r) {
    toy_model m({16}, 1);
    try {
      if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      engine e(m.view, r, 2, spec_of(any_policy(policies::periodic{}, "periodic"), "ring", "push-sum", r == 0 ? 0.05 : 5), fabric.endpoint(r));
      for (int s = 0; s < 5; ++s, steps1 += r) e.step();
      e.finish(0);
    } catch (const std::exception& ex) {
      (r == 0 ? error0 : error1) = ex.what();
    }
  });
  CHECK(error0.find("waiting for rank 1 to attach") != std::string::npos);
  CHECK(error1.empty());
  CHECK(steps1 == 5);
}

TEST_CASE("one endpoint attached by two engines at once is refused") {
  loopback_fabric fabric(2);
  toy_model a({8}, 1), b({8}, 1);
  std::string message;
  run_ranks(2, [&](int r) {
    try {
      if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      engine e((r == 0 ? a : b).view, 0, 2, spec_of(any_policy(policies::periodic{}, "periodic"), "ring", "push-sum", r == 0 ? 1.0 : 5),
               fabric.endpoint(0));
    } catch (const config_error& ex) {
      message = ex.what();
    } catch (const timeout_error&) {
    }
  });
  CHECK(message.find("rank 0 is attached twice") != std::string::npos);
}

TEST_CASE("an engine refused before it attached leaves the rank to the engine that owns it") {
  // Rank 0's second engine on its endpoint is refused; the first goes on
  // gossiping with rank 1 as if nothing had happened.
  loopback_fabric fabric(2);
  std::vector<engine_stats> stats(2);
  std::string refused;
  run_ranks(2, [&](int r) {
    toy_model m({16}, 1);
    engine e(m.view, r, 2, spec_of(any_policy(policies::periodic{}, "periodic"), "ring"), fabric.endpoint(r));
    if (r == 0) {
      toy_model again({16}, 1);
      try {
        engine twice(again.view, 0, 2, spec_of(any_policy(policies::periodic{}, "periodic"), "ring"), fabric.endpoint(0));
      } catch (const config_error& ex) {
        refused = ex.what();
      }
    }
    for (int s = 0; s < 10; ++s) e.step();
    e.finish(0);
    stats[static_cast<std::size_t>(r)] = e.stats();
  });
  CHECK(refused.find("rank 0 is attached twice") != std::string::npos);
  for (const auto& s : stats) {
    CHECK(s.messages_received >= 10);
    CHECK(s.dead_peers.empty());
    CHECK(s.dropped == 0);
  }
}

TEST_CASE("a send that fails after reaching some of its targets counts what it delivered in the totals as per peer") {
  // Rank 0 sends to 1 and 2; rank 2 stalls past the timeout, so a post of
  // rank 0 to rank 2 fails after its post to rank 1 of the same step went through.
  const int world = 3;
  auto spec = spec_of(any_policy(policies::periodic{}, "periodic"), "edges", "push-sum", 0.5);
  spec.topology.opts.set("edges", int_list{0, 1, 0, 2, 1, 0, 2, 1});
  spec.topology.opts.set("directed", true);
  loopback_fabric fabric(world);
  std::uint64_t bytes = 0, messages = 0, peer_bytes = 0, peer_messages = 0, tensor_bytes = 0;
  bool threw = false;
  run_ranks(world, [&](int r) {
    toy_model m({4, 3}, 1);
    engine e(m.view, r, world, spec, fabric.endpoint(r));
    try {
      for (int s = 0; s < 10; ++s) {
        e.step();
        if (r == 2 && s == 3) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      }
    } catch (const error&) {
      threw = threw || r == 0;
    }
    if (r != 0) return;
    const auto& st = e.stats();
    bytes = st.bytes_sent, messages = st.messages_sent;
    for (const auto& p : st.peers) peer_bytes += p.bytes_sent, peer_messages += p.messages_sent;
    for (const auto& t : st.tensors) tensor_bytes += t.bytes_sent;
  });
  CHECK(threw);
  CHECK(messages == peer_messages);
  CHECK(bytes == peer_bytes);
  CHECK(tensor_bytes == messages * 7 * sizeof(float));
}

TEST_CASE("a send that times out gives its shares back, and the engine takes no more steps") {
  // Directed ring 0 -> 1 -> 2 -> 0: rank 1 stalls past the timeout at step 5,
  // so rank 0's post of step 6 (which waits for rank 1 to merge step 5) fails.
  const int world = 3;
  auto spec = spec_of(any_policy(policies::periodic{}, "periodic"), "edges", "push-sum", 0.5);
  spec.topology.opts.set("edges", int_list{0, 1, 1, 2, 2, 0});
  spec.topology.opts.set("directed", true);
  loopback_fabric fabric(world);
  double weight_before = 0, weight_after = 0;
  std::string first, again;
  run_ranks(world, [&](int r) {
    toy_model m({4}, 1);
    engine e(m.view, r, world, spec, fabric.endpoint(r));
    try {
      for (int s = 0; s < 12; ++s) {
        if (r == 1 && s == 5) std::this_thread::sleep_for(std::chrono::milliseconds(1200));
        if (r == 0) weight_before = e.weight();
        e.step();
      }
      e.finish(0);
    } catch (const timeout_error& ex) {
      if (r != 0) return;  // the others find their peers gone or late
      first = ex.what();
      weight_after = e.weight();
      try {
        e.step();
      } catch (const error& ex2) {
        again = ex2.what();
      }
    } catch (const error&) {
    }
  });
  CHECK(first.find("to merge step") != std::string::npos);
  // The step merged rank 2's share, then its own share to rank 1 never left
  // and came back: more weight than before the step, not half of it.
  CHECK(weight_after > weight_before);
  CHECK(again.find("its send of step") != std::string::npos);
}

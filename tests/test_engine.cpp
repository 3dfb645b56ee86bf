#include <sys/mman.h>

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <new>
#include <numeric>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "count_allocations.hpp"
#include "test_support.hpp"

using namespace gossip;
using gossip::test::run_ranks;
using gossip::test::spec_of;
using gossip::test::toy_model;


TEST_CASE("engine.step() allocates nothing, for every shipped policy and protocol, merging at the next step (made up, with numerator steps or not) or the same one") {
  for (const auto& entry : policy_registry().entries())
    for (const char* proto : {"push-sum", "pairwise", "stale-copy"})
      for (const int mode : {0, 1, 2, 3}) {
        const bool same_step = mode == 2, makeup = mode == 1, numerator = mode == 3;
        if ((makeup || numerator) && std::string_view(proto) != "push-sum") continue;  // refused (push-sum only)
        const int world = 4;
        loopback_fabric fabric(world);
        std::vector<std::size_t> allocations(world);
        run_ranks(world, [&](int r) {
          toy_model m({300, 20}, 1);
          auto spec = spec_of(policy_registry().make(entry.name, options("test")), "exponential", proto);
          spec.settings.trace_path = "unused-{rank}";  // trace buffer on, never written (finish() is not called)
          spec.settings.same_step_merge = same_step;
          spec.settings.in_flight_makeup = makeup;
          spec.settings.numerator_steps = numerator;
          engine e(m.view, r, world, std::move(spec), fabric.endpoint(r));
          t_counting = true;
          for (int s = 0; s < 200; ++s) {
            for (auto& v : m.tensors[0]) v += 0.001f * static_cast<float>(r + 1);
            e.step({.lr = 0.1 / (1 + s / 50), .loss = 2.0 / (1 + s)});
          }
          t_counting = false;
          allocations[r] = t_allocations;
          t_allocations = 0;
          e.flush();
        });
        for (int r = 0; r < world; ++r) {
          INFO("policy ", entry.name, " protocol ", proto, " same_step_merge ", same_step, " in_flight_makeup ", makeup, " numerator_steps ",
               numerator, " rank ", r);
          CHECK(allocations[r] == 0);
        }
      }
}

TEST_CASE("the trace records every send and every trace_skips_every-th skip") {
  loopback_fabric fabric(2);
  std::vector<std::size_t> sends(2), skips(2);
  std::vector<engine_stats> stats(2);
  run_ranks(2, [&](int r) {
    toy_model m({16}, 1);
    auto spec = spec_of(any_policy(policies::periodic{.every = 2}, "periodic"), "exponential");
    spec.settings.trace_path = "unused-{rank}";  // recorded, never written (finish() is not called)
    spec.settings.trace_skips_every = 2;
    engine e(m.view, r, 2, std::move(spec), fabric.endpoint(r));
    for (int s = 0; s < 60; ++s) e.step();
    for (const auto& ev : e.trace()) ++(ev.sent ? sends : skips)[static_cast<std::size_t>(r)];
    stats[static_cast<std::size_t>(r)] = e.stats();
    e.flush();
  });
  for (std::size_t r = 0; r < 2; ++r) {
    // About 30 skips (a send the loopback inbox refused counts as one): the
    // first and every second after it, where by step number it was all or none.
    CHECK(stats[r].skips >= 30);
    CHECK(sends[r] == stats[r].sends);
    CHECK(skips[r] == (stats[r].skips + 1) / 2);
  }
}

TEST_CASE("after a send x̂ equals x, so the drift restarts from zero") {
  loopback_fabric fabric(2);
  run_ranks(2, [&](int r) {
    toy_model m({64}, 1);
    engine e(m.view, r, 2, spec_of(any_policy(policies::periodic{.every = 4}, "periodic"), "ring", "pairwise"), fabric.endpoint(r));
    for (int s = 0; s < 8; ++s) {
      m.tensors[0][0] += 1.0f;
      const auto res = e.step();
      if (res.sent) CHECK(std::equal(m.tensors[0].begin(), m.tensors[0].end(), e.snapshot().begin()));
    }
    e.finish(0);
  });
}

TEST_CASE("push-sum over the engine: finish() reaches the exact average on an exponential graph") {
  const int world = 8;
  loopback_fabric fabric(world);
  std::vector<std::vector<float>> models(world);
  std::vector<double> weights(world);
  run_ranks(world, [&](int r) {
    std::vector<float> x(16, static_cast<float>(r));
    model_view v;
    v.add("x", x);
    engine e(v, r, world, spec_of(any_policy(policies::never{}, "never"), "exponential"), fabric.endpoint(r));
    for (int s = 0; s < 5; ++s) e.step();
    e.finish(3);  // log2(8) rounds of a butterfly average everything
    models[r] = x;
    weights[r] = e.weight();
  });
  for (int r = 0; r < world; ++r) {
    CHECK(weights[r] == 1.0);
    for (float v : models[r]) CHECK(v == doctest::Approx(3.5).epsilon(1e-6));
  }
}

TEST_CASE("stats: a model started at zero (x̂ = 0, relative drift infinite) leaves the drift's max and mean finite") {
  loopback_fabric fabric(2);
  run_ranks(2, [&](int r) {
    std::vector<float> x(8, 0.0f);
    model_view v;
    v.add("x", x);
    engine e(v, r, 2, spec_of(any_policy(policies::periodic{}, "periodic"), "ring"), fabric.endpoint(r));
    for (int s = 0; s < 4; ++s) {
      for (auto& a : x) a += 1.0f + static_cast<float>(r);
      e.step();
    }
    const auto& st = e.stats();
    CHECK(std::isfinite(st.relative_drift_max));
    CHECK(st.relative_drift_at_send_count == st.sends - 1);  // the first send's drift, from x̂ = 0, is infinite
    CHECK(st.to_json().find("null") == std::string::npos);
    e.finish(0);
  });
}

TEST_CASE("a model too large for the machine's memory is refused before anything is allocated for it") {
  const std::uint64_t physical = gossip::detail::physical_memory_bytes();
  REQUIRE(physical > 0);
  // Half the machine's memory in address space only (never touched): with the
  // engine's send buffer and two receive slots it would need twice the machine.
  const std::size_t n = static_cast<std::size_t>(physical / sizeof(float) / 2 + 1);
  void* p = ::mmap(nullptr, n * sizeof(float), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  REQUIRE(p != MAP_FAILED);
  model_view v;
  v.add("w", std::span<float>(static_cast<float*>(p), n));
  loopback_fabric fabric(2);
  CHECK_THROWS_WITH_AS(engine(v, 0, 2, spec_of(any_policy(policies::never{}, "never"), "ring"), fabric.endpoint(0)),
                       doctest::Contains("GiB of memory, so the process would be killed at some later step"), config_error);
  ::munmap(p, n * sizeof(float));
}

TEST_CASE("a rank whose model turned NaN restores it and its momentum from a checkpoint and trains on (quasi-global momentum too)") {
  for (bool with_momentum : {false, true}) {
    CAPTURE(with_momentum);
    loopback_fabric fabric(2);
    std::vector<int> errors(2, 0);
    std::vector<bool> finite(2, false);
    run_ranks(2, [&](int r) {
      std::vector<float> w(8, static_cast<float>(r)), v(8, 0.0f);
      model_view m;
      m.add("w", w);
      if (with_momentum) m.momentum("w", v);
      engine_spec spec;  // the default policy; momentum auto: quasi-global over loopback
      spec.settings.timeout = std::chrono::duration<double>(10.0);
      engine e(m, r, 2, std::move(spec), fabric.endpoint(r));
      std::vector<float> ckw = w, ckv = v;
      for (int t = 0; t < 20; ++t) {
        for (std::size_t i = 0; i < w.size(); ++i) {
          v[i] = 0.9f * v[i] + 0.01f * (r ? 1.0f : -1.0f);
          w[i] -= 0.1f * v[i];
        }
        if (r == 0 && t == 5) w[0] = std::numeric_limits<float>::quiet_NaN();
        try {
          e.step({.lr = 0.1});
          ckw = w;
          ckv = v;
        } catch (const gossip::error&) {
          ++errors[static_cast<std::size_t>(r)];
          w = ckw;
          v = ckv;
        }
      }
      finite[static_cast<std::size_t>(r)] = std::all_of(w.begin(), w.end(), [](float a) { return std::isfinite(a); }) &&
                                            std::all_of(v.begin(), v.end(), [](float a) { return std::isfinite(a); });
      e.finish(0);
    });
    CHECK(errors[0] == 1);  // the bad step only: the engine's own state did not keep the NaN
    CHECK(errors[1] == 0);
    CHECK(finite[0]);
    CHECK(finite[1]);
  }
}

TEST_CASE("loopback: an engine destroyed without finish() (an error unwound past it) is a dead peer, not a departed one") {
  loopback_fabric fabric(2);
  std::vector<int> dead_seen(2, -1);
  std::atomic<bool> destroyed{false};
  run_ranks(2, [&](int r) {
    std::vector<float> x(4, static_cast<float>(r));
    model_view v;
    v.add("x", x);
    std::optional<engine> e(std::in_place, v, r, 2, spec_of(any_policy(policies::periodic{}, "periodic"), "ring"), fabric.endpoint(r));
    for (int s = 0; s < 3; ++s) e->step();
    if (r == 1) {
      e.reset();  // no finish(): as if step() had thrown
      destroyed = true;
      return;
    }
    // Rank 0 steps on once rank 1's engine is gone (else its steps may all
    // come before, and find nothing).
    const auto t0 = std::chrono::steady_clock::now();
    while (!destroyed && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    for (int s = 0; s < 3; ++s) e->step();
    dead_seen[0] = static_cast<int>(e->stats().dead_peers.size());
    e->finish(0);
  });
  CHECK(destroyed);
  CHECK(dead_seen[0] == 1);
}

TEST_CASE("push-sum: finish(0) merges the last step's messages, so no mass is lost over loopback") {
  const int world = 4;
  loopback_fabric fabric(world);
  std::vector<double> weights(world), mass(world);
  run_ranks(world, [&](int r) {
    std::vector<float> x(4, static_cast<float>(r));
    model_view v;
    v.add("x", x);
    engine e(v, r, world, spec_of(any_policy(policies::periodic{}, "periodic"), "exponential"), fabric.endpoint(r));
    for (int s = 0; s < 5; ++s) e.step();
    e.finish(0);
    weights[r] = e.weight();
    mass[r] = e.weight() * x[0];
  });
  CHECK(std::accumulate(weights.begin(), weights.end(), 0.0) == doctest::Approx(world).epsilon(1e-12));
  CHECK(std::accumulate(mass.begin(), mass.end(), 0.0) == doctest::Approx(0 + 1 + 2 + 3).epsilon(1e-6));
}

TEST_CASE("push-sum over loopback: a rank that leaves steps ahead of its source, or without finish(), gives back the shares it never merged") {
  // Rank 1 stops after 3 steps while rank 0 goes on to 20: rank 0's message of
  // rank 1's last step (and of the next) sits in rank 1's inbox unmerged. Its
  // weight comes back to rank 0, when rank 1 finished and when it was
  // destroyed without finish() (then rank 1's own weight is what is lost).
  for (const bool finishes : {true, false}) {
    CAPTURE(finishes);
    loopback_fabric fabric(2);
    std::vector<double> weights(2), mass(2);
    std::vector<engine_stats> stats(2);
    run_ranks(2, [&](int r) {
      std::vector<float> x(4, static_cast<float>(r));
      model_view v;
      v.add("x", x);
      engine e(v, r, 2, spec_of(any_policy(policies::periodic{}, "periodic"), "ring"), fabric.endpoint(r));
      for (int s = 0; s < (r == 0 ? 20 : 3); ++s) e.step();
      if (r == 1 && !finishes) {
        weights[r] = e.weight();  // lost with the rank
        mass[r] = e.weight() * x[0];
        return;
      }
      e.finish(0);
      weights[r] = e.weight();
      mass[r] = e.weight() * x[0];
      stats[r] = e.stats();
    });
    CHECK(weights[0] + weights[1] == doctest::Approx(2.0).epsilon(1e-12));
    CHECK(mass[0] + mass[1] == doctest::Approx(1.0).epsilon(1e-6));
    CHECK(stats[0].lost_weight == 0.0);
    CHECK(stats[0].dead_peers == (finishes ? std::vector<int>{} : std::vector<int>{1}));
  }
}

TEST_CASE("push-sum over loopback: mass is exact when ranks finish after different numbers of steps") {
  // No training: Σ w·z must stay Σ z(0) = 1 + 2 + 3 + 4. A rank that
  // finishes early takes what its sources sent after its last step with it
  // (merged as it leaves), rather than handing the shares back to senders
  // whose models have moved since.
  const int world = 4;
  for (const std::vector<int>& steps : {std::vector<int>{0, 10, 10, 10}, std::vector<int>{2, 10, 4, 10}, std::vector<int>{10, 10, 10, 1}})
    for (const std::uint64_t every : {1, 2}) {
    CAPTURE(steps);
    CAPTURE(every);
    for (int repeat = 0; repeat < 3; ++repeat) {
      loopback_fabric fabric(world);
      std::vector<double> weights(world), mass(world);
      std::vector<double> lost(world);
      run_ranks(world, [&](int r) {
        std::vector<float> x(4, static_cast<float>(r + 1));
        model_view v;
        v.add("x", x);
        engine e(v, r, world, spec_of(any_policy(policies::periodic{.every = every}, "periodic"), "exponential"), fabric.endpoint(r));
        for (int s = 0; s < steps[static_cast<std::size_t>(r)]; ++s) e.step();
        e.finish();
        weights[r] = e.weight();
        mass[r] = e.weight() * x[0];
        lost[r] = e.stats().lost_weight;
      });
      CHECK(std::accumulate(weights.begin(), weights.end(), 0.0) == doctest::Approx(world).epsilon(1e-12));
      CHECK(std::accumulate(mass.begin(), mass.end(), 0.0) == doctest::Approx(1 + 2 + 3 + 4).epsilon(1e-6));
      CHECK(std::accumulate(lost.begin(), lost.end(), 0.0) == 0.0);
    }
    }
}

TEST_CASE("engine: same_step_merge and in_flight_makeup count every optimizer step of a push-sum sender in full") {
  // Every rank adds 1 to its model before each step, as an optimizer step
  // would, and gossips at every step. Merged at the next step, each share is
  // in flight during the increment after its send, which then counts at the
  // halved weight: the average grows by 1 at the first step and by ½ at each
  // later one. Merged within the step (same_step_merge), or made up at the
  // next step (in_flight_makeup: z ← z + (w_sent/w)·(z − x̂) before the merge),
  // every increment counts in full. The codecs: int8 (the make-up fused into
  // the merge and the drift pass, from the uncompressed x̂) and topk keeping
  // every value (drift measured from the x̂ a target holds, so the make-up
  // is its own pass).
  const int world = 8, steps = 10;
  enum class mode { neither, makeup, same_step, numerator };
  for (const mode m : {mode::neither, mode::makeup, mode::same_step, mode::numerator}) {
    for (const char* codec : {"none", "int8", "topk"}) {
      if (m == mode::same_step && std::string(codec) != "none") continue;
      loopback_fabric fabric(world);
      std::vector<double> weighted(world), weights(world);
      std::vector<int> weight_off(world);
      run_ranks(world, [&](int r) {
        std::vector<float> x(300, static_cast<float>(r));
        model_view v;
        v.add("x", x);
        auto spec = spec_of(any_policy(policies::periodic{.every = 1}, "periodic"), "exponential");
        spec.settings.same_step_merge = m == mode::same_step;
        spec.settings.in_flight_makeup = m == mode::makeup;
        spec.settings.numerator_steps = m == mode::numerator;
        spec.codec.name = codec;
        if (std::string(codec) == "topk") spec.codec.opts.set("ratio", 1.0);
        engine e(v, r, world, std::move(spec), fabric.endpoint(r));
        for (int s = 0; s < steps; ++s) {
          for (auto& value : x) value += 1.0f;
          e.step();
          if (e.weight() != (m == mode::same_step ? 1.0 : 0.5)) ++weight_off[r];
        }
        // Lockstep: each share missed one optimizer step, or none within the step.
        const std::uint64_t merged = m == mode::same_step ? steps : steps - 1;
        CHECK(e.stats().merge_age == (m == mode::same_step ? std::array<std::uint64_t, 5>{merged, 0, 0, 0, 0}
                                                           : std::array<std::uint64_t, 5>{0, merged, 0, 0, 0}));
        e.finish(3);
        weighted[r] = e.weight() * x[0];
        weights[r] = e.weight();
      });
      const double average = std::accumulate(weighted.begin(), weighted.end(), 0.0) / std::accumulate(weights.begin(), weights.end(), 0.0);
      INFO("mode ", static_cast<int>(m), " codec ", codec);
      CHECK(std::accumulate(weights.begin(), weights.end(), 0.0) == doctest::Approx(world));
      // int8 rounds each share's values to 1/254 of its block's largest (at most 13.5 here).
      const double tolerance = std::string(codec) == "int8" ? 0.03 : 1e-5;
      CHECK(std::abs(average - (3.5 + (m != mode::neither ? steps : 1 + 0.5 * (steps - 1)))) < tolerance);
      for (int r = 0; r < world; ++r) CHECK(weight_off[r] == 0);
    }
  }
}

TEST_CASE("engine: numerator_steps counts every optimizer step in full whatever the weights and however long a share is in flight") {
  // Ranks send at periods of their own (1, 2 or 3 steps), so a share waits
  // for merging, and weights wander below ½ and above 1. Each rank adds 1 to
  // its model before each step, at the weight w the last step left it: the
  // step adds w to its push-sum numerator, and with numerator_steps 1 (2w
  // below w = ½). After finish() nothing is in flight, and the ranks'
  // numerators must sum to their start plus exactly that.
  const int world = 6, steps = 12;
  for (const bool numerator : {false, true}) {
    loopback_fabric fabric(world);
    std::vector<double> weighted(world), weights(world), counted(world);
    std::vector<double> wmin(world, 1e9), wmax(world, 0);
    run_ranks(world, [&](int r) {
      std::vector<float> x(200, static_cast<float>(r));
      model_view v;
      v.add("x", x);
      auto spec = spec_of(any_policy(policies::periodic{.every = static_cast<std::uint64_t>(1 + r % 3)}, "periodic"), "exponential");
      spec.settings.numerator_steps = numerator;
      engine e(v, r, world, std::move(spec), fabric.endpoint(r));
      double w = 1;  // the weight the next optimizer step runs at
      for (int s = 0; s < steps; ++s) {
        for (auto& value : x) value += 1.0f;
        counted[r] += numerator ? std::min(1.0, 2 * w) : w;
        e.step();
        w = e.weight();
        wmin[r] = std::min(wmin[r], w);
        wmax[r] = std::max(wmax[r], w);
      }
      e.finish(3);  // no optimizer step in between: nothing more to count
      weighted[r] = e.weight() * x[0];
      weights[r] = e.weight();
    });
    INFO("numerator_steps ", numerator);
    CHECK(std::accumulate(weights.begin(), weights.end(), 0.0) == doctest::Approx(world));
    CHECK(*std::min_element(wmin.begin(), wmin.end()) < 0.5);  // the weights did wander
    CHECK(*std::max_element(wmax.begin(), wmax.end()) > 1.0);
    const double sum = std::accumulate(weighted.begin(), weighted.end(), 0.0);
    const double start = world * (world - 1) / 2.0;
    CHECK(sum == doctest::Approx(start + std::accumulate(counted.begin(), counted.end(), 0.0)).epsilon(1e-6));
  }
  // Not with the settings that count the steps another way.
  loopback_fabric fabric(2);
  toy_model m({4}, 1);
  for (const char* other : {"in_flight_makeup", "same_step_merge"}) {
    auto spec = spec_of(any_policy(policies::periodic{.every = 1}, "periodic"));
    spec.settings.numerator_steps = true;
    (std::string(other) == "in_flight_makeup" ? spec.settings.in_flight_makeup : spec.settings.same_step_merge) = true;
    CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, spec, fabric.endpoint(0)),
                         doctest::Contains(fmt::format("[engine] numerator_steps = true counts every optimizer step in full already; set {} to false",
                                                       other)
                                               .c_str()),
                         config_error);
  }
  const auto cfg = config::parse("[engine]\nnumerator_steps = true\n", "numerator.toml");
  CHECK(engine_spec::from(cfg).settings.numerator_steps);
  // Only push-sum hands weight on with a send: with another protocol either setting is refused, not ignored.
  for (const char* key : {"numerator_steps", "in_flight_makeup"})
    for (const char* proto : {"pairwise", "stale-copy"}) {
      auto spec = spec_of(any_policy(policies::periodic{.every = 1}, "periodic"), "exponential", proto);
      (std::string(key) == "numerator_steps" ? spec.settings.numerator_steps : spec.settings.in_flight_makeup) = true;
      CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, spec, fabric.endpoint(0)),
                           doctest::Contains(fmt::format("[engine] {} = true applies to protocol 'push-sum'", key).c_str()), config_error);
    }
  // Stats and trace in one file would overwrite each other.
  auto spec = spec_of(any_policy(policies::periodic{.every = 1}, "periodic"));
  spec.settings.stats_path = spec.settings.trace_path = "out-{rank}.json";
  CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, spec, fabric.endpoint(0)),
                       doctest::Contains("stats = 'out-{rank}.json' and trace = 'out-{rank}.json' name the same file"), config_error);
  // Spelt differently, the same file: compared after {rank}, "." and ".." are resolved.
  spec.settings.trace_path = "./out-{rank}.json";
  CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, spec, fabric.endpoint(0)), doctest::Contains("name the same file"), config_error);
  CHECK(same_output_file("y-{rank}.json", "./y-{rank}.json", 3));
  CHECK(same_output_file("y-{rank}.json", "y-3.json", 3));
  CHECK_FALSE(same_output_file("y-{rank}.json", "y-3.json", 4));
  CHECK_FALSE(same_output_file("", "", 0));
}

TEST_CASE("engine: numerator_steps with quasi-global momentum keeps the momentum of the optimizer's step, not of the corrected one") {
  // Rank 0 sends at every step and hears nothing back (rank 1 never sends):
  // its weight falls below ½ and each step counts twice in z. Momentum rebuilt
  // from z's displacement would carry the factor 2 into the next step, which
  // is doubled again, and grow without bound (0.9·2 > 1); divided by it, it
  // stays the optimizer's: with a constant gradient of 1, at most 1/(1 − β) = 10.
  loopback_fabric fabric(2);
  std::vector<float> buffer_end(2);
  run_ranks(2, [&](int r) {
    toy_model m({16}, 1);
    std::vector<float> buf(16, 0.0f);
    m.view.momentum("t0", buf);
    auto spec = r == 0 ? spec_of(any_policy(policies::periodic{.every = 1}, "periodic"), "ring", "push-sum")
                       : spec_of(any_policy(policies::never{}, "never"), "ring", "push-sum");
    spec.settings.numerator_steps = true;
    spec.settings.momentum = engine_settings::momentum_mode::quasi_global;
    engine e(m.view, r, 2, std::move(spec), fabric.endpoint(r));
    const float lr = 0.01f, beta = 0.9f;
    for (int s = 0; s < 60; ++s) {
      for (std::size_t i = 0; i < 16; ++i) {  // SGD with momentum, gradient 1
        buf[i] = beta * buf[i] + 1.0f;
        m.tensors[0][i] -= lr * buf[i];
      }
      e.step({.lr = lr});
    }
    buffer_end[static_cast<std::size_t>(r)] = buf[0];
    if (r == 0) CHECK(e.weight() < 0.5);
    e.finish(0);
  });
  CHECK(std::abs(buffer_end[0]) < 10.5f);
  CHECK(std::abs(buffer_end[0]) > 2.0f);  // and it did build up (towards 10, over about 100 steps)
}

TEST_CASE("engine: same_step_merge over a transport that is not lockstep is refused, naming the transport") {
  // The loopback endpoint, claiming to deliver as UCX does (at any time).
  struct asynchronous : gossip::test::loopback_forward {
    transport_capabilities capabilities() const {
      auto c = t.capabilities();
      c.copies_on_post = false;
      c.deterministic = false;
      c.name = "async-test";
      return c;
    }
  };
  loopback_fabric fabric(2);
  toy_model m({4}, 1);
  auto spec = spec_of(any_policy(policies::periodic{.every = 1}, "periodic"));
  spec.settings.same_step_merge = true;
  CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, spec, asynchronous{{fabric.endpoint(0)}}),
                       doctest::Contains("[engine] same_step_merge = true needs a transport whose ranks run in lockstep (loopback); "
                                         "transport 'async-test'"),
                       config_error);
  // And from a config file, as a user sets it.
  const auto cfg = config::parse("[engine]\nsame_step_merge = true\n", "same-step.toml");
  CHECK(engine_spec::from(cfg).settings.same_step_merge);
}

TEST_CASE("an engine built from a config file reports its components, stats and trace") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / fmt::format("gossip-engine-{}", ::getpid());
  fs::create_directories(dir);
  const auto cfg_path = (dir / "run.toml").string();
  {
    std::ofstream f(cfg_path);
    f << "[policy]\nname = \"drift\"\nthreshold = 0.05\nmax_interval = 10\n"
         "[topology]\nname = \"ring\"\n[protocol]\nname = \"push-sum\"\n"
         "[engine]\ntimeout_s = 20\ntrace = \""
      << (dir / "trace-{rank}.json").string() << "\"\nstats = \"" << (dir / "stats-{rank}.json").string() << "\"\n";
  }
  const auto cfg = config::load(cfg_path);
  const int world = 3;
  loopback_fabric fabric(world);
  run_ranks(world, [&](int r) {
    toy_model m({128}, 1);
    engine e(m.view, r, world, cfg, fabric.endpoint(r));
    for (int s = 0; s < 50; ++s) {
      m.tensors[0][static_cast<std::size_t>(s) % 128] += 0.5f;
      e.step({.lr = 0.1});
    }
    e.finish();
  });
  for (int r = 0; r < world; ++r) {
    std::ifstream sf(dir / fmt::format("stats-{}.json", r));
    REQUIRE(sf.good());
    const auto j = nlohmann::json::parse(sf);
    CHECK(j["policy"] == "drift");
    CHECK(j["topology"] == "ring");
    CHECK(j["protocol"] == "push-sum");
    CHECK(j["transport"] == "loopback");
    CHECK(j["steps"].get<int>() == 50);
    CHECK(j["finish_rounds"].get<int>() == 4);  // 2·⌈log2 3⌉, counted apart from the training's steps and sends
    CHECK(j["decisions"]["finish"].get<int>() == 4);
    CHECK(j["sends"].get<int>() + j["skips"].get<int>() == j["steps"].get<int>());
    CHECK(j["sends"].get<int>() >= 50 / 10);  // max_interval forces at least this many
    std::ifstream tf(dir / fmt::format("trace-{}.json", r));
    REQUIRE(tf.good());
    const auto t = nlohmann::json::parse(tf);
    CHECK(t["traceEvents"].size() == 1 + j["steps"].get<std::size_t>() + j["finish_rounds"].get<std::size_t>());
    // Times are on the wall clock (µs since the Unix epoch), so that the ranks' files line up.
    CHECK(t["otherData"]["rank"] == r);
    const double start = t["otherData"]["start_unix_us"].get<double>();
    const double now = std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
    CHECK(start > now - 600e6);
    CHECK(start <= now);
    // Each decision says what came of it: a send is "sent", a skip the policy chose "not_fired".
    for (const auto& ev : t["traceEvents"]) {
      if (ev["ph"] == "M") continue;
      CHECK(ev["args"]["outcome"] == (ev["name"] == "send" ? "sent" : "not_fired"));
      CHECK(ev["ts"].get<double>() >= start);
      CHECK(ev["ts"].get<double>() <= now);
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("engine construction errors are clear") {
  loopback_fabric fabric(2);
  toy_model m({4}, 1);
  CHECK_THROWS_WITH_AS(engine(m.view, 2, 2, spec_of(any_policy(policies::never{}, "never")), fabric.endpoint(0)),
                       doctest::Contains("rank 2 is outside the world of 2 ranks"), config_error);
  engine_spec no_policy;
  no_policy.policy = any_policy{};
  CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, no_policy, fabric.endpoint(0)), doctest::Contains("no policy was given"), config_error);
  CHECK(engine_spec{}.policy.name() == "consensus");
  model_view empty;
  CHECK_THROWS_WITH_AS(engine(empty, 0, 2, spec_of(any_policy(policies::never{}, "never")), fabric.endpoint(0)),
                       doctest::Contains("the model has no tensors"), config_error);
  std::vector<float> unsized;
  model_view hollow;
  hollow.add("w", unsized);
  CHECK_THROWS_WITH_AS(engine(hollow, 0, 2, spec_of(any_policy(policies::never{}, "never")), fabric.endpoint(0)),
                       doctest::Contains("the model's 1 tensor(s) hold no values"), config_error);
  // The switch's protocol over a transport that delivers messages would merge
  // them as sums: refused, as engine_spec::from refuses it in a config.
  auto summed = spec_of(any_policy(policies::never{}, "never"));
  summed.protocol.name = "switch-aggregate";
  CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, summed, fabric.endpoint(0)),
                       "engine (rank 0): protocol 'switch-aggregate' sums in the network and needs transport 'switch', not 'loopback'; over "
                       "'loopback' use push-sum, pairwise or stale-copy",
                       config_error);
  {  // A rank's endpoint serves one engine: its peers counted the first one out when it left.
    loopback_fabric once(1);
    {
      engine first(m.view, 0, 1, spec_of(any_policy(policies::never{}, "never")), once.endpoint(0));
      first.finish();
    }
    CHECK_THROWS_WITH_AS(engine(m.view, 0, 1, spec_of(any_policy(policies::never{}, "never")), once.endpoint(0)),
                         doctest::Contains("a loopback_fabric serves one run: build a new fabric"), config_error);
  }
  std::vector<float> x(4);
  model_view dev;
  dev.add("w", x, memory_kind::cuda);
  CHECK_THROWS_WITH_AS(engine(dev, 0, 2, spec_of(any_policy(policies::never{}, "never")), fabric.endpoint(0)),
                       doctest::Contains("tensor 'w' lives in device memory"), config_error);
  // Output paths are checked when the engine is built, not after the run in finish().
  auto one_file = spec_of(any_policy(policies::never{}, "never"));
  one_file.settings.stats_path = "stats.json";
  CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, one_file, fabric.endpoint(0)),
                       doctest::Contains("[engine] stats = \"stats.json\": every one of the 2 ranks would write this one file; put {rank} in the path"),
                       config_error);
  auto no_dir = spec_of(any_policy(policies::never{}, "never"));
  no_dir.settings.trace_path = "/nonexistent-dir/trace-{rank}.json";
  CHECK_THROWS_WITH_AS(engine(m.view, 0, 2, no_dir, fabric.endpoint(0)),
                       doctest::Contains("[engine] trace = \"/nonexistent-dir/trace-{rank}.json\": the directory /nonexistent-dir does not exist"),
                       config_error);
  auto a_dir = spec_of(any_policy(policies::never{}, "never"));
  a_dir.settings.stats_path = "/tmp";
  CHECK_THROWS_WITH_AS(engine(m.view, 0, 1, a_dir, fabric.endpoint(0)), doctest::Contains("[engine] stats = \"/tmp\": /tmp is a directory"),
                       config_error);
}

TEST_CASE("stats: sends per window fold pairwise when the run outgrows the reserved windows") {
  engine_stats st;
  st.sends_per_window.reserve(send_window_capacity);
  st.send_window_steps = 16;
  for (std::uint64_t t = 0; t < 16 * send_window_capacity; t += 2) st.count_send_window(t);  // 8 sends per window
  CHECK(st.sends_per_window.size() == send_window_capacity);
  CHECK(st.send_window_steps == 16);
  st.count_send_window(16 * send_window_capacity);  // one window too far: windows double
  CHECK(st.send_window_steps == 32);
  CHECK(st.sends_per_window.size() == send_window_capacity / 2 + 1);
  CHECK(st.sends_per_window.front() == 16);
  CHECK(st.sends_per_window.back() == 1);
  std::uint64_t total = 0;
  for (auto n : st.sends_per_window) total += n;
  CHECK(total == 8 * send_window_capacity + 1);
  CHECK(st.sends_per_window.capacity() == send_window_capacity);  // no reallocation
}

TEST_CASE("engine: the consensus estimate follows the received models, and stats report the instruments") {
  const int world = 4;
  loopback_fabric fabric(world);
  std::vector<double> estimate(world), exact(world);
  std::vector<std::string> json(world);
  run_ranks(world, [&](int r) {
    toy_model m({64}, 1);
    for (auto& v : m.tensors[0]) v = 1.0f + 0.1f * static_cast<float>(r);  // models 0.1 apart per rank
    engine e(m.view, r, world, spec_of(any_policy(policies::periodic{.every = 1}, "periodic"), "complete", "push-sum"), fabric.endpoint(r));
    CHECK(std::isnan(e.consensus()));
    e.step({.lr = 0.1});
    e.step({.lr = 0.2});
    estimate[r] = e.consensus();
    json[r] = e.stats().to_json();
    e.finish(0);
  });
  for (int r = 0; r < world; ++r) {
    INFO("rank ", r);
    CHECK(estimate[r] > 0);
    CHECK(estimate[r] < 0.05);  // models start 0.1..0.3 apart around 1.15: relative distance² of order 0.01
    const auto j = nlohmann::json::parse(json[r]);
    CHECK(j["lr_mean_at_send"].get<double>() == doctest::Approx(0.15));
    CHECK(j["sends_per_window"]["sends"][0] == 2);
    CHECK(j["consensus_estimate"]["steps"] == 1);
    CHECK(j["weight_range"][0].get<double>() > 0);
  }
}

TEST_CASE("stats JSON: a tensor name that is not UTF-8 is written with U+FFFD, not thrown at finish()") {
  engine_stats st;
  st.tensors.push_back(tensor_stats{.name = "w\xe9ight"});
  const auto j = nlohmann::json::parse(st.to_json());
  CHECK(j["tensors"][0]["name"] == "w\xef\xbf\xbdight");
}

namespace {
// Periodic every 2 over a ring with [engine] momentum = mode, as a config would give it.
engine_spec momentum_spec(const char* mode, const char* protocol) {
  auto spec = spec_of(any_policy(policies::periodic{.every = 2}, "periodic"), "ring", protocol);
  options o("test [engine]");
  o.set("momentum", std::string(mode));
  spec.settings = engine_settings::from(o.resolved(engine_option_specs(), "test [engine]"));
  return spec;
}
}  // namespace

TEST_CASE("engine: registered momentum buffers become quasi-global (model displacement, gossip included), or stay local") {
  // auto: quasi-global over loopback, whose ranks run in lockstep (local over
  // asynchronous transports: tests/python/test_torch.py checks UCX).
  for (const char* mode : {"quasi-global", "local", "auto"}) {
    const std::string want = std::string(mode) == "auto" ? "quasi-global" : mode;
    const int world = 2;
    loopback_fabric fabric(world);
    std::vector<std::vector<float>> buffers(world), expected(world);
    std::vector<std::string> reported(world);
    run_ranks(world, [&](int r) {
      toy_model m({40, 7}, 3 + r);
      std::vector<float> v(47, 0.0f);
      m.view.momentum("t0", std::span<float>(v).first(40)).momentum("t1", std::span<float>(v).subspan(40));
      auto spec = momentum_spec(mode, "push-sum");
      engine e(m.view, r, world, std::move(spec), fabric.endpoint(r));
      std::vector<float> prev = m.flat(), mhat(47, 0.0f);
      for (int t = 0; t < 6; ++t) {
        const float lr = t < 3 ? 0.1f : 0.01f;
        for (std::size_t k = 0; k < 40; ++k) m.tensors[0][k] -= lr * (v[k] + 0.5f);  // an optimizer step using the buffer
        e.step({.lr = lr});                                                             // merges at odd steps
        const auto now = m.flat();
        for (std::size_t k = 0; k < 47; ++k) mhat[k] = 0.9f * mhat[k] + 0.1f * (prev[k] - now[k]) / lr;
        prev = now;
      }
      buffers[r] = v;
      expected[r] = mhat;
      reported[r] = e.stats().momentum;
      e.finish(0);
    });
    for (int r = 0; r < world; ++r) {
      INFO(mode, " rank ", r);
      CHECK(reported[r] == want);
      for (std::size_t k = 0; k < 47; ++k)
        if (want == "quasi-global")
          CHECK(buffers[r][k] == doctest::Approx(expected[r][k]).epsilon(1e-4));
        else
          CHECK(buffers[r][k] == 0.0f);
    }
    // The merges moved t1 (no local updates) only through gossip: its quasi-global momentum is not zero.
    if (want == "quasi-global") CHECK(std::abs(buffers[0][45]) > 0);
  }
  // auto under stale-copy: local (its pull towards the peers' last copies would be carried on as if it were the gradient's).
  for (const char* mode : {"auto", "quasi-global"}) {
    const int world = 2;
    loopback_fabric fabric(world);
    std::vector<std::string> reported(world);
    run_ranks(world, [&](int r) {
      toy_model m({40, 7}, 3 + r);
      std::vector<float> v(47, 0.0f);
      m.view.momentum("t0", std::span<float>(v).first(40)).momentum("t1", std::span<float>(v).subspan(40));
      auto spec = momentum_spec(mode, "stale-copy");
      engine e(m.view, r, world, std::move(spec), fabric.endpoint(r));
      e.step({.lr = 0.1});
      reported[r] = e.stats().momentum;
      e.finish(0);
    });
    for (int r = 0; r < world; ++r) CHECK(reported[r] == (std::string(mode) == "auto" ? "local" : "quasi-global"));
  }
}

TEST_CASE("engine: settings filled in code are checked against the config's ranges when the engine is built") {
  const auto refused = [](auto&& edit, const char* message) {
    loopback_fabric fabric(1);
    toy_model m({8}, 3);
    auto spec = spec_of(any_policy(policies::periodic{}, "periodic"), "ring", "push-sum");
    edit(spec.settings);
    CHECK_THROWS_WITH_AS(engine(m.view, 0, 1, std::move(spec), fabric.endpoint(0)), doctest::Contains(message), config_error);
  };
  refused([](engine_settings& s) { s.trace_skips_every = 0; },
          "engine_settings::trace_skips_every must be >= 1, got 0 (the config key [engine] trace_skips_every)");
  refused([](engine_settings& s) { s.send_buffers = 17; }, "engine_settings::send_buffers must be in 1..16, got 17");
  refused([](engine_settings& s) { s.timeout = std::chrono::duration<double>(0); },
          "engine_settings::timeout must be > 0 and at most 31536000 seconds (a year), got 0 (the config key [engine] timeout_s)");
  refused([](engine_settings& s) { s.momentum_beta = 1.0f; }, "engine_settings::momentum_beta must be in [0, 1), got 1");
  refused([](engine_settings& s) { s.finish_rounds = -2; }, "engine_settings::finish_rounds must be >= 0, or -1 for automatic, got -2");
  // The config's keys, the same ranges.
  options o("test [engine]");
  o.set("momentum_beta", 1.0);
  CHECK_THROWS_WITH_AS(engine_settings::from(o.resolved(engine_option_specs(), "test [engine]")),
                       "test [engine]: key 'momentum_beta' must be in [0, 1), got 1", config_error);
}

TEST_CASE("engine: a step without its learning rate is refused when momentum is quasi-global, accepted when local") {
  for (const char* mode : {"quasi-global", "local"}) {
    loopback_fabric fabric(1);
    toy_model m({8}, 3);
    std::vector<float> v(8, 0.0f);
    m.view.momentum("t0", v);
    engine e(m.view, 0, 1, momentum_spec(mode, "push-sum"), fabric.endpoint(0));
    INFO(mode);
    if (std::string(mode) == "local") {
      // Without quasi-global momentum lr only informs the policies: 0 is "not
      // known", a negative or non-finite one is refused before anything happens.
      for (const double lr : {-0.1, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()})
        CHECK_THROWS_WITH_AS(e.step({.lr = lr}), doctest::Contains("pass the learning rate the optimizer used"), gossip::error);
      CHECK(e.stats().steps == 0);
      CHECK_NOTHROW(e.step({}));
    } else {
      for (const double lr : {0.0, -0.1, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()})
        CHECK_THROWS_WITH_AS(e.step({.lr = lr}), doctest::Contains("but the engine keeps quasi-global momentum"), gossip::error);
      CHECK(e.stats().steps == 0);  // refused before anything happened
      CHECK_NOTHROW(e.step({.lr = 0.1}));
    }
    e.finish(0);
  }
}

namespace {
// One rank over loopback with a registered momentum buffer and [engine] `key` = `value`; its stats.
engine_stats one_rank_with_momentum(any_policy policy, const char* key, const char* value) {
  loopback_fabric fabric(1);
  toy_model m({8}, 3);
  std::vector<float> v(8, 0.0f);
  m.view.momentum("t0", v);
  auto spec = spec_of(std::move(policy), "ring", "push-sum");
  options o("test [engine]");
  o.set(key, std::string(value));
  spec.settings = engine_settings::from(o.resolved(engine_option_specs(), "test [engine]"));
  engine e(m.view, 0, 1, std::move(spec), fabric.endpoint(0));
  engine_stats stats = e.stats();
  e.finish(0);
  return stats;
}
}  // namespace

TEST_CASE("engine: momentum = auto keeps local momentum for a policy that sends at every step, even in lockstep") {
  static_assert(policy_fixed_period(policies::periodic{.every = 3}) == 3 && policy_fixed_period(policies::consensus{}) == 0);
  struct want_t {
    std::uint64_t every;
    const char* setting;
    const char* reported;
  };
  for (const auto& w : {want_t{1, "auto", "local"}, want_t{2, "auto", "quasi-global"}, want_t{1, "quasi-global", "quasi-global"}}) {
    INFO("every ", w.every, " momentum ", w.setting);
    CHECK(one_rank_with_momentum(any_policy(policies::periodic{.every = w.every}, "periodic"), "momentum", w.setting).momentum ==
          w.reported);
  }
}

TEST_CASE("engine: momentum_merge auto carries merges on in full for a closed-loop policy, spread for a fixed schedule") {
  static_assert(policy_closed_loop<policies::consensus>() && !policy_closed_loop<policies::periodic>());
  struct want_t {
    const char* setting;
    bool consensus;
    const char* reported;
  };
  for (const auto& w : {want_t{"auto", true, "full"}, want_t{"auto", false, "spread"}, want_t{"full", false, "full"},
                        want_t{"spread", true, "spread"}}) {
    INFO(w.setting, w.consensus ? " consensus" : " periodic");
    auto p = w.consensus ? any_policy(policies::consensus{}, "consensus") : any_policy(policies::periodic{.every = 20}, "periodic");
    CHECK(one_rank_with_momentum(std::move(p), "momentum_merge", w.setting).momentum_merge == w.reported);
  }
  options lead("test [engine]");
  lead.set("max_lead", std::int64_t{-1});
  CHECK_THROWS_WITH_AS(engine_settings::from(lead.resolved(engine_option_specs(), "test [engine]")),
                       "test [engine]: key 'max_lead' must be in 0..2^40 (0: off), got -1", config_error);
  options bad("test [engine]");
  bad.set("momentum_merge", std::string("half"));
  CHECK_THROWS_WITH_AS(engine_settings::from(bad.resolved(engine_option_specs(), "test [engine]")),
                       "test [engine]: key 'momentum_merge' must be \"auto\", \"full\" or \"spread\", got \"half\"", config_error);
  options wrong("test [engine]");
  wrong.set("momentum", std::string("global"));
  CHECK_THROWS_WITH_AS(engine_settings::from(wrong.resolved(engine_option_specs(), "test [engine]")),
                       "test [engine]: key 'momentum' must be \"auto\", \"quasi-global\" or \"local\", got \"global\"", config_error);
}

TEST_CASE("model_view::momentum names the tensor it cannot match") {
  std::vector<float> w(4), v(3);
  model_view m;
  m.add("w", w);
  CHECK_THROWS_WITH_AS(m.momentum("w", v), "model_view: momentum buffer of tensor 'w' has 3 elements but the tensor has 4", error);
  CHECK_THROWS_WITH_AS(m.momentum("b", v), doctest::Contains("no tensor has that name"), error);
}

TEST_CASE("model_view refuses a name with a control character and memory not aligned to its values") {
  std::vector<float> w(4);
  model_view m;
  CHECK_THROWS_WITH_AS(m.add(std::string("w\0a", 3), w), doctest::Contains("named 'w\\x00a', with a control character"), error);
  alignas(float) std::byte raw[5 * sizeof(float)]{};
  CHECK_THROWS_WITH_AS(m.add(tensor_view{"odd", raw + 1, 4, dtype::f32, memory_kind::host}), doctest::Contains("not aligned to its 4-byte values"),
                       error);
  CHECK(m.size() == 0);
}

TEST_CASE("finish() tries both output files, and writes the one that failed when called again") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / fmt::format("gossip-finish-{}", ::getpid());
  fs::create_directories(dir);
  auto spec = spec_of(any_policy(policies::periodic{}, "periodic"), "ring");
  spec.settings.stats_path = (dir / "stats.json").string();
  spec.settings.trace_path = (dir / "trace.json").string();
  loopback_fabric fabric(1);
  toy_model m({4}, 1);
  engine e(m.view, 0, 1, spec, fabric.endpoint(0));
  e.step();
  fs::create_directories(dir / "stats.json");  // the stats path turns into a directory before finish()
  CHECK_THROWS_WITH_AS(e.finish(), doctest::Contains("cannot write the stats report"), error);
  CHECK(fs::is_regular_file(dir / "trace.json"));  // written all the same
  fs::remove(dir / "stats.json");
  e.finish();
  CHECK(fs::is_regular_file(dir / "stats.json"));
  fs::remove_all(dir);
}

TEST_CASE("finish() reports a short output file that the disk refused (the write shows only when the file is closed)") {
  if (!std::filesystem::exists("/dev/full")) return;  // Linux: every write fails with ENOSPC
  auto spec = spec_of(any_policy(policies::periodic{}, "periodic"), "ring");
  spec.settings.trace_path = "/dev/full";
  spec.settings.trace_capacity = 0;  // a few bytes: the stream's buffer holds them until it is closed
  loopback_fabric fabric(1);
  toy_model m({4}, 1);
  engine e(m.view, 0, 1, spec, fabric.endpoint(0));
  e.step();
  CHECK_THROWS_WITH_AS(e.finish(), doctest::Contains("writing the trace to '/dev/full' failed"), error);
}

#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "gossip/gossip.hpp"

using namespace gossip;

namespace {
protocol make(const std::string& name, std::span<const int> sources, std::size_t n) {
  auto p = protocol_registry().make(name, options("test [protocol]"));
  p.prepare(sources, n);
  return p;
}
}  // namespace

TEST_CASE("push-sum conserves mass under arbitrary skip patterns, messages in flight included") {
  const int world = 5;
  const std::size_t n = 64;
  std::mt19937_64 rng(7);
  std::vector<topology> topo;
  std::vector<protocol> proto;
  std::vector<std::vector<float>> x(world, std::vector<float>(n));
  for (int r = 0; r < world; ++r) {
    options o("test");
    o.set("seed", std::int64_t{3});
    topo.push_back(topology_registry().make("random", o, r, world));
    proto.push_back(make("push-sum", topo.back().sources(), n));
    for (auto& v : x[r]) v = static_cast<float>(static_cast<int>(rng() % 200) - 100);
  }
  auto mass = [&](const std::vector<std::vector<received>>& in_flight) {
    double w = 0, wx = 0;
    for (int r = 0; r < world; ++r) {
      w += proto[r].weight();
      for (float v : x[r]) wx += proto[r].weight() * v;
      for (const auto& m : in_flight[r]) {
        w += m.weight;
        for (std::size_t i = 0; i < n; ++i) wx += m.weight * m.data[i];
      }
    }
    return std::pair{w, wx};
  };
  const auto [w0, wx0] = mass(std::vector<std::vector<received>>(world));
  CHECK(w0 == world);
  std::vector<std::vector<std::vector<float>>> store(2, std::vector<std::vector<float>>(world));
  std::vector<std::vector<received>> flight(world);
  for (std::uint64_t round = 0; round < 400; ++round) {
    // Deliver what was posted last round, then (maybe) send: a skip pattern drawn at random.
    for (int r = 0; r < world; ++r) {
      tensor_slot s{x[r].data(), n, 0};
      proto[r].merge({&s, 1}, flight[r], x[r].data());
    }
    std::vector<std::vector<received>> next(world);
    auto& buf = store[round % 2];
    for (int r = 0; r < world; ++r) {
      if (rng() % 100 < 35) continue;  // 35 % of sends skipped
      buf[r] = x[r];
      const auto peers = topo[r].peers(round);
      const double w = proto[r].on_send(peers, topo[r].self_weight());
      for (const auto& p : peers) next[p.rank].push_back({r, round, w, buf[r].data(), n});
    }
    flight = std::move(next);
    const auto [w, wx] = mass(flight);
    REQUIRE(w == doctest::Approx(w0).epsilon(1e-12));
    REQUIRE(wx == doctest::Approx(wx0).epsilon(1e-5));
  }
}

TEST_CASE("push-sum refund keeps the mass of an undelivered share") {
  std::vector<int> src{1};
  auto p = make("push-sum", src, 1);
  peer to{1, 0.5};
  const double share = p.on_send({&to, 1}, 0.5);
  CHECK(share == 0.5);
  CHECK(p.weight() == 0.5);
  p.refund(share);
  CHECK(p.weight() == 1.0);
}

TEST_CASE("pairwise averages with each received model") {
  std::vector<int> src{1, 2};
  auto p = make("pairwise", src, 3);
  std::vector<float> x{0, 0, 0}, a{3, 6, 9}, b{6, 3, 0};
  tensor_slot s{x.data(), 3, 0};
  received m1{1, 0, 0.5, a.data(), 3}, m2{2, 0, 0.5, b.data(), 3};
  std::vector<received> msgs{m1};
  p.merge({&s, 1}, msgs, x.data());
  CHECK(x == std::vector<float>{1.5f, 3, 4.5f});
  x = {0, 0, 0};
  msgs = {m1, m2};
  p.merge({&s, 1}, msgs, x.data());
  CHECK(x[0] == doctest::Approx(3.0));
  CHECK(x[1] == doctest::Approx(3.0));
  CHECK(x[2] == doctest::Approx(3.0));
}

TEST_CASE("stale-copy keeps mixing with a neighbour that went silent, and forgets a dead one") {
  std::vector<int> src{1, 2};
  auto p = make("stale-copy", src, 1);
  std::vector<float> x{0}, snap{0}, a{4}, b{8};
  tensor_slot s{x.data(), 1, 0};
  std::vector<received> first{{1, 0, 0, a.data(), 1}};
  p.merge({&s, 1}, first, snap.data());
  CHECK(x[0] == doctest::Approx(2.0));  // γ/(1+1)·(4 − 0)
  // Rank 1 stays silent; rank 2 speaks: both copies count.
  std::vector<received> second{{2, 1, 0, b.data(), 1}};
  x[0] = 0;
  p.merge({&s, 1}, second, snap.data());
  CHECK(x[0] == doctest::Approx((4.0 + 8.0) / 3.0));
  p.forget(2);
  x[0] = 0;
  std::vector<received> third{{1, 2, 0, a.data(), 1}};
  p.merge({&s, 1}, third, snap.data());
  CHECK(x[0] == doctest::Approx(2.0));
}

TEST_CASE("stale-copy gamma is checked") {
  options o("run.toml [protocol]");
  o.set("gamma", 1.5);
  CHECK_THROWS_WITH_AS(protocol_registry().make("stale-copy", o), doctest::Contains("key 'gamma' must be in (0, 1]"), config_error);
  CHECK_THROWS_WITH_AS(protocol_registry().make("gossip", options("run.toml [protocol]")),
                       doctest::Contains("known protocols: push-sum, pairwise, stale-copy"), config_error);
}

TEST_CASE("a merge measures how far each received model was from the local one, in the same pass") {
  // 37 elements: a vector part and a scalar tail.
  std::vector<float> x(37), m(37);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.5f, m[i] = 1.0f - static_cast<float>(i);
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < x.size(); ++i) diff += (double(m[i]) - x[i]) * (double(m[i]) - x[i]), ref += double(x[i]) * x[i];
  const std::vector<float> x0 = x;
  std::vector<int> src{1};
  auto p = make("push-sum", src, 1);
  tensor_slot s{x.data(), x.size(), 0};
  received msg{1, 0, 3.0, m.data(), m.size()};  // weight 3 against our 1: z ← z + 3/4·(m − z)
  const auto sums = p.merge({&s, 1}, {&msg, 1}, x.data());
  CHECK(sums.models == 1);
  CHECK(sums.diff_sq == doctest::Approx(diff).epsilon(1e-6));
  CHECK(sums.ref_sq == doctest::Approx(ref).epsilon(1e-6));
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(x[i] == doctest::Approx(x0[i] + 0.75 * (m[i] - x0[i])));
  CHECK(p.weight() == 4.0);
  // Nothing received: nothing measured.
  CHECK(p.merge({&s, 1}, {}, x.data()).models == 0);
}

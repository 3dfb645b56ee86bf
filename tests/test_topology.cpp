#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "gossip/gossip.hpp"

using namespace gossip;

namespace {
const std::vector<std::string> names = {"ring", "exponential", "random", "complete", "edges"};

topology make(const std::string& name, int rank, int world) {
  options o("test [topology]");
  if (name == "edges") {  // a ring written out as an edge list
    int_list e;
    for (int i = 0; i < world && world > 1; ++i) {
      if (world == 2 && i == 1) break;
      e.push_back(i);
      e.push_back((i + 1) % world);
    }
    o.set("edges", e);
  }
  return topology_registry().make(name, o, rank, world);
}
}  // namespace

TEST_CASE("mixing weights sum to one and peers are never self") {
  for (const auto& name : names)
    for (int world : {2, 3, 4, 5, 8}) {
      for (int rank = 0; rank < world; ++rank) {
        auto t = make(name, rank, world);
        for (std::uint64_t round = 0; round < 40; ++round) {
          const auto peers = t.peers(round);
          REQUIRE(!peers.empty());
          double sum = t.self_weight();
          std::set<int> seen;
          for (const auto& p : peers) {
            CHECK(p.rank != rank);
            CHECK(p.rank >= 0);
            CHECK(p.rank < world);
            CHECK(seen.insert(p.rank).second);
            sum += p.weight;
          }
          CHECK(sum == doctest::Approx(1.0).epsilon(1e-12));
        }
      }
    }
}

TEST_CASE("sources and destinations are exactly the ranks that ever target us and that we target") {
  for (const auto& name : names)
    for (int world : {2, 3, 5, 8}) {
      std::vector<std::set<int>> in(static_cast<std::size_t>(world));
      for (int j = 0; j < world; ++j) {
        auto t = make(name, j, world);
        std::set<int> out;
        for (std::uint64_t round = 0; round < 4096; ++round)
          for (const auto& p : t.peers(round)) {
            in[static_cast<std::size_t>(p.rank)].insert(j);
            out.insert(p.rank);
          }
        CHECK(std::set<int>(t.destinations().begin(), t.destinations().end()) == out);
      }
      for (int i = 0; i < world; ++i) {
        auto t = make(name, i, world);
        const std::set<int> declared(t.sources().begin(), t.sources().end());
        INFO(name, " world ", world, " rank ", i);
        CHECK(declared == in[static_cast<std::size_t>(i)]);
      }
    }
}

TEST_CASE("exponential hops 1, 2, 4, … and random is the same on every rank for a seed") {
  auto t = make("exponential", 0, 8);
  CHECK(t.peers(0)[0].rank == 1);
  CHECK(t.peers(1)[0].rank == 2);
  CHECK(t.peers(2)[0].rank == 4);
  CHECK(t.peers(3)[0].rank == 1);
  auto a = make("random", 2, 7), b = make("random", 2, 7);
  int differs_from_first = 0;
  const int first = a.peers(0)[0].rank;
  for (std::uint64_t r = 0; r < 200; ++r) {
    CHECK(a.peers(r)[0].rank == b.peers(r)[0].rank);
    differs_from_first += a.peers(r)[0].rank != first;
  }
  CHECK(differs_from_first > 50);  // actually random, not a fixed peer
}

TEST_CASE("a dead peer is removed and the weights renormalised") {
  auto t = make("complete", 0, 5);
  t.mark_dead(3);
  for (std::uint64_t r = 0; r < 5; ++r) {
    const auto p = t.peers(r);
    REQUIRE(p.size() == 3);
    for (const auto& q : p) {
      CHECK(q.rank != 3);
      CHECK(q.weight == doctest::Approx(0.25));
    }
    CHECK(t.self_weight() == doctest::Approx(0.25));
  }
  // A one-peer topology whose peer died falls back to the next live
  // destination: a rank it is connected to (rank 0 of 8 sends to 1, 2 and 4).
  auto e = make("exponential", 0, 8);
  e.mark_dead(1);
  e.mark_dead(2);
  CHECK(e.peers(0)[0].rank == 4);
  CHECK(e.peers(0)[0].weight == doctest::Approx(0.5));
  for (std::uint64_t r = 0; r < 6; ++r) {
    REQUIRE(e.peers(r).size() == 1);
    CHECK(e.peers(r)[0].rank == 4);
  }
  // Rank 0 of 4 sends to 1 and 2 only; with 2 dead its stand-in is 1, never 3
  // (a source of rank 0, which does not expect messages from it).
  auto f = make("exponential", 0, 4);
  f.mark_dead(2);
  CHECK(f.peers(1)[0].rank == 1);
  f.mark_dead(1);
  CHECK(f.peers(0).empty());
  CHECK(f.peers(1).empty());
  CHECK(f.self_weight() == doctest::Approx(1.0));
  // Ring of 3 with one neighbour dead keeps the other.
  auto g = make("ring", 0, 3);
  g.mark_dead(1);
  REQUIRE(g.peers(0).size() == 1);
  CHECK(g.peers(0)[0].rank == 2);
  CHECK(g.self_weight() + g.peers(0)[0].weight == doctest::Approx(1.0));
}

TEST_CASE("every topology reaches consensus with push-sum") {
  for (const auto& name : names) {
    const int world = 6;
    std::vector<topology> topo;
    std::vector<protocol> proto;
    std::vector<std::vector<float>> x(world, std::vector<float>(4));
    double mean0 = 0;
    for (int r = 0; r < world; ++r) {
      topo.push_back(make(name, r, world));
      proto.push_back(protocol_registry().make("push-sum", options("test")));
      proto.back().prepare(topo.back().sources(), 4);
      for (int k = 0; k < 4; ++k) x[r][k] = static_cast<float>(r * 10 + k);
      mean0 += x[r][0];
    }
    mean0 /= world;
    for (std::uint64_t round = 0; round < 300; ++round) {
      std::vector<std::vector<float>> payload(x);
      std::vector<std::vector<received>> inbound(world);
      for (int r = 0; r < world; ++r) {
        const auto peers = topo[r].peers(round);
        const double w = proto[r].on_send(peers, topo[r].self_weight());
        for (const auto& p : peers) inbound[p.rank].push_back({r, round, w, payload[r].data(), 4});
      }
      for (int r = 0; r < world; ++r) {
        tensor_slot s{x[r].data(), 4, 0};
        proto[r].merge({&s, 1}, inbound[r], payload[r].data());
      }
    }
    for (int r = 0; r < world; ++r) {
      INFO(name, " rank ", r);
      CHECK(x[r][0] == doctest::Approx(mean0).epsilon(1e-4));
    }
  }
}

TEST_CASE("bad topology settings are refused with the key named") {
  CHECK_THROWS_WITH_AS(topology_registry().make("torus", options("run.toml [topology]"), 0, 4),
                       doctest::Contains("unknown topology 'torus'; known topologies: ring, exponential, random, complete, edges"),
                       config_error);
  options none("run.toml [topology]");  // no edges: only a world of one, like every other topology
  none.set("edges", int_list{});
  CHECK(topology_registry().make("edges", none, 0, 1).peers(0).empty());
  CHECK_THROWS_WITH_AS(topology_registry().make("edges", none, 0, 2), doctest::Contains("key 'edges' must list pairs of ranks"), config_error);
  options bad("run.toml [topology]");
  bad.set("edges", int_list{0, 1, 1, 9});
  CHECK_THROWS_WITH_AS(topology_registry().make("edges", bad, 0, 4), doctest::Contains("edge [1, 9] is invalid"), config_error);
  options wide("run.toml [topology]");  // found by fuzz/fuzz_config: 2^32 was read as rank 0
  wide.set("edges", int_list{std::int64_t{1} << 32, 1});
  CHECK_THROWS_WITH_AS(topology_registry().make("edges", wide, 0, 4), doctest::Contains("edge [4294967296, 1] is invalid"), config_error);
  options odd("run.toml [topology]");
  options apart("run.toml [topology]");
  apart.set("edges", int_list{0, 1, 2, 3});
  CHECK_THROWS_WITH_AS(topology_registry().make("edges", apart, 0, 4),
                       doctest::Contains("run.toml [topology]: the edges leave rank(s) 2, 3 unconnected to rank 0 in a world of 4"), config_error);
  CHECK_THROWS_WITH_AS(topology_registry().make("edges", apart, 0, 5), doctest::Contains("rank(s) 2, 3, 4 unconnected"), config_error);
  options one_way("run.toml [topology]");  // a directed chain joins every rank, but rank 0 never hears the others
  one_way.set("edges", int_list{0, 1, 1, 2});
  one_way.set("directed", true);
  CHECK_THROWS_WITH_AS((void)topology_registry().make("edges", one_way, 2, 3),
                       "run.toml [topology]: the directed edges do not carry every rank's model to every other: nothing from rank(s) 1, 2 ever "
                       "reaches rank 0; those models could never mix. Add edges so that a path leads from each rank to each other (e.g. a "
                       "directed ring: [[0, 1], [1, 2], …, [2, 0]])",
                       config_error);
  options star("run.toml [topology]");  // rank 0 sends to all, hears none
  star.set("edges", int_list{0, 1, 0, 2, 0, 3, 2, 0});
  star.set("directed", true);
  CHECK_THROWS_WITH_AS((void)topology_registry().make("edges", star, 0, 4), doctest::Contains("nothing from rank(s) 1, 3 ever reaches rank 0"),
                       config_error);
  options into("run.toml [topology]");  // every rank sends to 0, which sends to 1 only
  into.set("edges", int_list{1, 0, 2, 0, 0, 1});
  into.set("directed", true);
  CHECK_THROWS_WITH_AS((void)topology_registry().make("edges", into, 0, 3), doctest::Contains("nothing from rank 0 ever reaches rank(s) 2"),
                       config_error);
  options ring("run.toml [topology]");  // a directed ring: strongly connected
  ring.set("edges", int_list{0, 1, 1, 2, 2, 0});
  ring.set("directed", true);
  CHECK_NOTHROW((void)topology_registry().make("edges", ring, 1, 3));
  odd.set("edges", int_list{0, 1, 2});
  CHECK_THROWS_WITH_AS(topology_registry().make("edges", odd, 0, 4), doctest::Contains("key 'edges' must list pairs"), config_error);
  CHECK_THROWS_AS(topology_registry().make("ring", options("x"), 4, 4), config_error);
}

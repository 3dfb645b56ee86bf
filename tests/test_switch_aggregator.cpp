// The switch's aggregation logic without DPDK or sockets: sync all-reduce
// with loss and duplicates, async exactly-once, validation of every field.
#include <doctest/doctest.h>

#include <bit>
#include <map>
#include <optional>
#include <random>
#include <vector>

#include "transports/switch/aggregator.hpp"

using namespace gossip::sw;

namespace {

std::vector<std::byte> make_packet(packet_header h, const std::vector<float>& v) {
  h.elements = static_cast<std::uint16_t>(v.size());
  std::vector<std::byte> p(packet_bytes(v.size()));
  std::memcpy(p.data(), &h, sizeof h);
  if (!v.empty()) std::memcpy(p.data() + sizeof h, v.data(), v.size() * sizeof(float));  // an empty vector's data() may be null
  return p;
}

struct reply_log {
  std::vector<std::pair<std::uint16_t, std::vector<std::byte>>> all;
  auto sink() {
    return [this](std::uint16_t w, std::span<const std::byte> r) { all.emplace_back(w, std::vector<std::byte>(r.begin(), r.end())); };
  }
};

packet_header header_of(std::span<const std::byte> p) {
  packet_header h;
  std::memcpy(&h, p.data(), sizeof h);
  return h;
}
std::vector<float> values_of(std::span<const std::byte> p) {
  const auto h = header_of(p);
  std::vector<float> v(h.elements);
  std::memcpy(v.data(), p.data() + sizeof h, v.size() * sizeof(float));
  return v;
}

// A one-value share of worker w to slot 0 of group 1, set `set`.
std::vector<std::byte> one_value_share(std::uint16_t w, std::uint8_t set, std::uint32_t chunk, float v, std::uint32_t session = 0) {
  return make_packet(packet_header{.type = packet_type::sync_contribution, .flags = set, .group = 1, .worker = w, .slot = 0, .chunk = chunk,
                                   .sequence = 1, .session = session},
                     {v});
}

// Simulates `members` SwitchML workers over a lossy channel against one
// aggregator; returns each worker's result.
std::vector<std::vector<float>> simulate_sync(int members, std::size_t n, std::uint16_t chunk, std::uint16_t slots, double loss,
                                              std::uint64_t seed, int ops, aggregator_stats* stats_out = nullptr) {
  aggregator agg({group_config{.id = 7, .mode = group_mode::sync, .members = static_cast<std::uint16_t>(members), .chunk = chunk, .slots = slots}});
  drop_injector lose(loss, seed);
  std::mt19937_64 rng(seed);
  struct worker {
    std::vector<float> in, out;
    std::vector<std::uint8_t> ver;
    std::vector<std::int64_t> flight;  // chunk in flight per slot, -1 none
    std::size_t done = 0;
  };
  std::vector<worker> ws(static_cast<std::size_t>(members));
  std::vector<std::vector<float>> results;
  for (auto& w : ws) w.ver.assign(slots, 0);
  const std::size_t chunks = (n + chunk - 1) / chunk;
  for (int op = 1; op <= ops; ++op) {
    for (int r = 0; r < members; ++r) {
      auto& w = ws[static_cast<std::size_t>(r)];
      w.in.resize(n);
      for (std::size_t i = 0; i < n; ++i) w.in[i] = static_cast<float>((i * 7 + static_cast<std::size_t>(r) * 13 + static_cast<std::size_t>(op)) % 101);
      w.out.assign(n, -1);
      w.flight.assign(slots, -1);
      w.done = 0;
      for (std::size_t s = 0; s < slots && s < chunks; ++s) w.flight[s] = static_cast<std::int64_t>(s);
    }
    // Each round every worker (re)sends all its in-flight packets (a timeout
    // each round), in a random worker order; replies may be lost too.
    std::vector<std::pair<std::uint16_t, std::vector<std::byte>>> wire;
    for (int round = 0; round < 100000; ++round) {
      bool all_done = true;
      for (auto& w : ws) all_done = all_done && w.done == chunks;
      if (all_done) break;
      std::vector<int> order(static_cast<std::size_t>(members));
      for (int r = 0; r < members; ++r) order[static_cast<std::size_t>(r)] = r;
      std::shuffle(order.begin(), order.end(), rng);
      for (int r : order) {
        auto& w = ws[static_cast<std::size_t>(r)];
        for (std::size_t s = 0; s < slots; ++s) {
          if (w.flight[s] < 0) continue;
          const auto c = static_cast<std::size_t>(w.flight[s]);
          const std::size_t len = std::min<std::size_t>(chunk, n - c * chunk);
          packet_header h{.type = packet_type::sync_contribution, .flags = w.ver[s], .group = 7, .worker = static_cast<std::uint16_t>(r),
                          .slot = static_cast<std::uint16_t>(s), .chunk = static_cast<std::uint32_t>(c), .sequence = static_cast<std::uint32_t>(op)};
          const auto p = make_packet(h, std::vector<float>(w.in.begin() + static_cast<std::ptrdiff_t>(c * chunk),
                                                           w.in.begin() + static_cast<std::ptrdiff_t>(c * chunk + len)));
          if (lose.drop()) continue;
          agg.handle(p, [&](std::uint16_t to, std::span<const std::byte> rep) {
            if (!lose.drop()) wire.emplace_back(to, std::vector<std::byte>(rep.begin(), rep.end()));
          });
        }
      }
      for (auto& [to, rep] : wire) {
        auto& w = ws[to];
        const auto h = header_of(rep);
        if (h.type == packet_type::sync_pending) {  // its set still waits: it names the members it holds, the worker among them
          REQUIRE(rep.size() == pending_bytes);
          std::uint64_t holders = 0;
          std::memcpy(&holders, rep.data() + sizeof h, sizeof holders);
          REQUIRE(((holders >> to) & 1u) == 1u);
          REQUIRE(h.count == static_cast<std::uint32_t>(std::popcount(holders)));
          continue;
        }
        REQUIRE(h.type == packet_type::sync_result);
        const std::size_t s = h.slot;
        if (h.sequence != static_cast<std::uint64_t>(op) || w.flight[s] != static_cast<std::int64_t>(h.chunk) || h.flags != w.ver[s]) continue;
        const auto v = values_of(rep);
        std::copy(v.begin(), v.end(), w.out.begin() + static_cast<std::ptrdiff_t>(h.chunk) * chunk);
        ++w.done;
        w.ver[s] ^= 1;
        const std::size_t next = h.chunk + slots;
        w.flight[s] = next < chunks ? static_cast<std::int64_t>(next) : -1;
      }
      wire.clear();
    }
    results.clear();
    for (auto& w : ws) {
      REQUIRE(w.done == chunks);
      results.push_back(w.out);
    }
    // Check against the reference sum (integers: exact in float).
    for (std::size_t i = 0; i < n; ++i) {
      float ref = 0;
      for (auto& w : ws) ref += w.in[i];
      for (auto& w : ws) REQUIRE(w.out[i] == ref);
    }
  }
  if (stats_out) *stats_out = agg.stats();
  return results;
}

}  // namespace

TEST_CASE("group_config parses and rejects with the key named") {
  const auto g = group_config::parse("id=3,mode=async,members=4,chunk=128,elements=1000");
  CHECK(g.id == 3);
  CHECK(g.mode == group_mode::async);
  CHECK(g.members == 4);
  CHECK(g.chunk == 128);
  CHECK(g.chunks() == 8);
  CHECK(g.chunk_length(7) == 1000 - 7 * 128);
  CHECK(g.idle_s == 60);
  CHECK(group_config::parse("id=3,mode=async,members=4,elements=10,idle_s=0").idle_s == 0);
  CHECK_THROWS_WITH_AS(group_config::parse("id=1,idle_s=90000"), doctest::Contains("key 'idle_s' must be in 0..86400"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_config::parse("id=1,mode=async,members=2"), doctest::Contains("elements"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_config::parse("id=1,members=65"), doctest::Contains("members"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_config::parse("id=1,members=1"), doctest::Contains("members=1 has no one to aggregate with"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_config::parse("id=1,members=0"), doctest::Contains("key 'members' must be in 2..64, got 0"), std::invalid_argument);
  // The message quotes the whole --group text, whichever item is wrong.
  CHECK_THROWS_WITH_AS(group_config::parse("id=1,modes=async,members=2"), doctest::Contains("group 'id=1,modes=async,members=2': unknown key 'modes'"),
                       std::invalid_argument);
  // An aggregate larger than the machine is refused before it is allocated.
  CHECK_THROWS_WITH_AS(aggregator({group_config::parse("id=1,mode=async,members=64,elements=4294967296")}),
                       doctest::Contains("GiB of memory; check elements= and members="), std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_config::parse("id=1,chunk=400"), doctest::Contains("chunk"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_config::parse("id=1,colour=red"), doctest::Contains("colour"), std::invalid_argument);
  // An empty --group (a shell variable left unset) is not a group of defaults.
  CHECK_THROWS_WITH_AS(group_config::parse(""), doctest::Contains("group '': is empty"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_config::parse("  "), doctest::Contains("is empty"), std::invalid_argument);
  CHECK_THROWS_AS(aggregator({group_config{.id = 1}, group_config{.id = 1}}), std::invalid_argument);
  // A key given twice is refused (the last one used to win), and idle_s on a sync group, where it does nothing.
  CHECK_THROWS_WITH_AS(group_config::parse("id=1,members=2,members=3"), doctest::Contains("key 'members' is given twice"), std::invalid_argument);
  // An empty item, in the middle or at the end, is refused alike.
  for (const char* spec : {"id=1,,members=2", "id=1,members=2,"})
    CHECK_THROWS_WITH_AS(group_config::parse(spec), doctest::Contains("item '' is not key=value"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(group_config::parse("id=1,mode=sync,idle_s=5"), doctest::Contains("key 'idle_s' applies to async groups only"),
                       std::invalid_argument);
}

TEST_CASE("sync all-reduce equals the reference sum, lossless") {
  for (int members : {1, 2, 3, 4})
    for (std::size_t n : {std::size_t{1}, std::size_t{256}, std::size_t{1000}, std::size_t{40000}}) {
      CAPTURE(members);
      CAPTURE(n);
      aggregator_stats st;
      simulate_sync(members, n, 256, 16, 0.0, 1, 3, &st);
      CHECK(st.dropped() == 0);
      CHECK(st.aggregations_completed == 3 * ((n + 255) / 256));
    }
}

TEST_CASE("sync all-reduce is exact under 1 % and 10 % loss of contributions and results") {
  for (double loss : {0.01, 0.10})
    for (int members : {2, 4}) {
      CAPTURE(loss);
      CAPTURE(members);
      aggregator_stats st;
      simulate_sync(members, 20000, 256, 8, loss, 42, 4, &st);
      CHECK(st.results_resent > 0);
      CHECK(st.drops[static_cast<std::size_t>(drop_reason::slot_conflict)] == 0);
    }
}

TEST_CASE("sync duplicate to a completed slot returns the stored result to that worker only") {
  aggregator agg({group_config{.id = 1, .mode = group_mode::sync, .members = 2, .chunk = 4, .slots = 2}});
  reply_log log;
  packet_header h{.type = packet_type::sync_contribution, .group = 1, .worker = 0, .slot = 1, .chunk = 1, .sequence = 1};
  const auto a = make_packet(h, {1, 2, 3, 4});
  h.worker = 1;
  const auto b = make_packet(h, {10, 20, 30, 40});
  CHECK(agg.handle(a, log.sink()) == drop_reason::accepted);
  CHECK(log.all.empty());
  CHECK(agg.handle(a, log.sink()) == drop_reason::accepted);  // duplicate, in progress: answered sync_pending, to its sender only
  REQUIRE(log.all.size() == 1);
  {
    CHECK(log.all[0].first == 0);
    const auto& p = log.all[0].second;
    REQUIRE(p.size() == pending_bytes);
    const auto r = header_of(p);
    CHECK(r.type == packet_type::sync_pending);
    CHECK((r.group == 1 && r.worker == 0 && r.slot == 1 && r.chunk == 1 && r.sequence == 1 && r.flags == 0 && r.elements == 0));
    CHECK(r.count == 1);  // the members whose share the set holds: worker 0 alone
    std::uint64_t holders = 0;
    std::memcpy(&holders, p.data() + sizeof r, sizeof holders);
    CHECK(holders == 0b01);
  }
  CHECK(agg.stats().pending_answered == 1);
  log.all.clear();
  CHECK(agg.handle(b, log.sink()) == drop_reason::accepted);
  REQUIRE(log.all.size() == 2);
  CHECK(values_of(log.all[0].second) == std::vector<float>{11, 22, 33, 44});
  CHECK(header_of(log.all[1].second).worker == 1);
  log.all.clear();
  CHECK(agg.handle(b, log.sink()) == drop_reason::accepted);
  REQUIRE(log.all.size() == 1);
  CHECK(log.all[0].first == 1);
  CHECK(values_of(log.all[0].second) == std::vector<float>{11, 22, 33, 44});
  CHECK(agg.stats().aggregations_completed == 1);
  CHECK(agg.stats().results_resent == 1);
  CHECK(agg.stats().retransmissions_seen == 2);
  // Another chunk on the busy shadow set of the same slot is a conflict.
  h.worker = 0;
  h.flags = 1;
  h.chunk = 3;
  CHECK(agg.handle(make_packet(h, {1, 1, 1, 1}), log.sink()) == drop_reason::accepted);
  h.worker = 1;
  h.chunk = 5;
  CHECK(agg.handle(make_packet(h, {1, 1, 1, 1}), log.sink()) == drop_reason::slot_conflict);
  // An older chunk there is a late retransmission of a result already given: counted, ignored, unanswered.
  const auto seen = agg.stats().retransmissions_seen;
  log.all.clear();
  h.chunk = 1;
  CHECK(agg.handle(make_packet(h, {1, 1, 1, 1}), log.sink()) == drop_reason::accepted);
  CHECK(log.all.empty());
  CHECK(agg.stats().retransmissions_seen == seen + 1);
  h.chunk = 3;  // the slot's own chunk still completes
  CHECK(agg.handle(make_packet(h, {1, 1, 1, 1}), log.sink()) == drop_reason::accepted);
  CHECK(log.all.size() == 2);
}

TEST_CASE("sync: sync_pending answers only a share of the set's own chunk and all-reduce") {
  aggregator agg({group_config{.id = 1, .mode = group_mode::sync, .members = 3, .chunk = 4, .slots = 2}});
  reply_log log;
  packet_header h{.type = packet_type::sync_contribution, .group = 1, .worker = 0, .slot = 1, .chunk = 1, .sequence = 1};
  CHECK(agg.handle(make_packet(h, {1, 2, 3, 4}), log.sink()) == drop_reason::accepted);
  h.worker = 2;
  CHECK(agg.handle(make_packet(h, {1, 2, 3, 4}), log.sink()) == drop_reason::accepted);
  CHECK(log.all.empty());
  // Worker 0's next all-reduce on the same slot and set (its caller went on
  // after a timeout): the set holds its older share, so nothing is said of it.
  h.worker = 0;
  h.sequence = 2;
  CHECK(agg.handle(make_packet(h, {1, 2, 3, 4}), log.sink()) == drop_reason::accepted);
  CHECK(log.all.empty());
  // Its own share again: members 0 and 2 are held, member 1 is awaited.
  h.sequence = 1;
  CHECK(agg.handle(make_packet(h, {1, 2, 3, 4}), log.sink()) == drop_reason::accepted);
  REQUIRE(log.all.size() == 1);
  std::uint64_t holders = 0;
  std::memcpy(&holders, log.all[0].second.data() + sizeof(packet_header), sizeof holders);
  CHECK(holders == 0b101);
  CHECK(header_of(log.all[0].second).count == 2);
  CHECK(agg.stats().pending_answered == 1);
}

TEST_CASE("sync: a late copy of a share whose result the worker had changes nothing, however the slot's sets stand") {
  // One slot, three members: chunk 0 on set 0 completes, then worker 0 goes on
  // to chunk 1 on set 1 and a late copy of its chunk 0 arrives.
  aggregator agg({group_config{.id = 1, .mode = group_mode::sync, .members = 3, .chunk = 1, .slots = 1}});
  reply_log log;
  const auto share = [](std::uint16_t w, std::uint8_t set, std::uint32_t chunk, float v) { return one_value_share(w, set, chunk, v); };
  const auto a0 = share(0, 0, 0, 1);
  CHECK(agg.handle(a0, log.sink()) == drop_reason::accepted);
  CHECK(agg.handle(share(1, 0, 0, 2), log.sink()) == drop_reason::accepted);
  CHECK(agg.handle(share(2, 0, 0, 4), log.sink()) == drop_reason::accepted);
  REQUIRE(log.all.size() == 3);
  CHECK(values_of(log.all[0].second) == std::vector<float>{7});
  const auto a1 = share(0, 1, 1, 10);
  CHECK(agg.handle(a1, log.sink()) == drop_reason::accepted);
  log.all.clear();
  CHECK(agg.handle(a0, log.sink()) == drop_reason::accepted);  // the late copy: answered with chunk 0's result, nothing restarted
  REQUIRE(log.all.size() == 1);
  CHECK((log.all[0].first == 0 && header_of(log.all[0].second).chunk == 0 && values_of(log.all[0].second) == std::vector<float>{7}));
  log.all.clear();
  CHECK(agg.handle(a1, log.sink()) == drop_reason::accepted);  // worker 0 retransmits chunk 1: still counted once
  CHECK(log.all.empty());  // a share of one value gets no sync_pending: the answer would be larger than it
  CHECK(agg.handle(share(1, 1, 1, 20), log.sink()) == drop_reason::accepted);
  CHECK(log.all.empty());  // worker 2 has not given its share of chunk 1
  CHECK(agg.handle(share(2, 1, 1, 40), log.sink()) == drop_reason::accepted);
  REQUIRE(log.all.size() == 3);
  for (const auto& [w, r] : log.all) CHECK(values_of(r) == std::vector<float>{70});
  // The slot goes on: chunk 2 on set 0 completes with everyone's share.
  log.all.clear();
  for (std::uint16_t w = 0; w < 3; ++w) CHECK(agg.handle(share(w, 0, 2, static_cast<float>(w + 1)), log.sink()) == drop_reason::accepted);
  REQUIRE(log.all.size() == 3);
  CHECK(values_of(log.all[0].second) == std::vector<float>{6});
  // A new job on the group (new sessions, sequences from 1 again) meets sets
  // completed by the old one at the same sequence and chunk: they start again.
  const auto share2 = [](std::uint16_t w, std::uint8_t set, std::uint32_t chunk, float v) { return one_value_share(w, set, chunk, v, 2); };
  for (std::uint32_t chunk = 0; chunk < 3; ++chunk) {
    log.all.clear();
    for (std::uint16_t w = 0; w < 3; ++w)
      CHECK(agg.handle(share2(w, static_cast<std::uint8_t>(chunk % 2), chunk, static_cast<float>(10 * chunk + w)), log.sink()) ==
            drop_reason::accepted);
    REQUIRE(log.all.size() == 3);
    CHECK(values_of(log.all[0].second) == std::vector<float>{static_cast<float>(30 * chunk + 3)});
  }
  CHECK(agg.stats().drops[static_cast<std::size_t>(drop_reason::slot_conflict)] == 0);
}

TEST_CASE("sync: a share to one set while the other still waits with the worker's share is refused, and that share counted once") {
  // No client does this (a worker gives a set a share only once it holds the
  // other set's result); a crafted packet must not take worker 0's share of
  // chunk 0 out of set 0's bitmap, or its retransmission would add it again.
  aggregator agg({group_config{.id = 1, .mode = group_mode::sync, .members = 3, .chunk = 1, .slots = 1}});
  reply_log log;
  const auto share = [](std::uint16_t w, std::uint8_t set, std::uint32_t chunk, float v) { return one_value_share(w, set, chunk, v); };
  CHECK(agg.handle(share(0, 0, 0, 1), log.sink()) == drop_reason::accepted);
  CHECK(agg.handle(share(0, 1, 1, 10), log.sink()) == drop_reason::slot_conflict);
  CHECK(agg.handle(share(0, 0, 0, 1), log.sink()) == drop_reason::accepted);  // a retransmission: not added again
  CHECK(agg.stats().retransmissions_seen == 1);
  CHECK(agg.handle(share(1, 0, 0, 2), log.sink()) == drop_reason::accepted);
  CHECK(agg.handle(share(2, 0, 0, 4), log.sink()) == drop_reason::accepted);
  REQUIRE(log.all.size() == 3);
  for (const auto& [w, r] : log.all) CHECK(values_of(r) == std::vector<float>{7});
  // Once set 0 is complete, the same share of chunk 1 is the worker's next one.
  log.all.clear();
  CHECK(agg.handle(share(0, 1, 1, 10), log.sink()) == drop_reason::accepted);
  CHECK(agg.handle(share(1, 1, 1, 20), log.sink()) == drop_reason::accepted);
  CHECK(agg.handle(share(2, 1, 1, 40), log.sink()) == drop_reason::accepted);
  REQUIRE(log.all.size() == 3);
  CHECK(values_of(log.all[0].second) == std::vector<float>{70});
}

TEST_CASE("async applies each delta exactly once under duplication and loss") {
  const std::uint64_t n = 1000;
  aggregator agg({group_config{.id = 2, .mode = group_mode::async, .members = 3, .chunk = 256, .elements = n}});
  std::mt19937_64 rng(5);
  drop_injector lose(0.2, 9);
  std::vector<std::vector<double>> model(3, std::vector<double>(n, 0.0));  // what each worker sent in total
  for (std::uint32_t seq = 1; seq <= 20; ++seq)
    for (std::uint16_t w = 0; w < 3; ++w) {
      std::vector<float> delta(n);
      for (auto& d : delta) d = static_cast<float>(static_cast<int>(rng() % 9) - 4);
      for (std::uint32_t c = 0; c < 4; ++c) {
        const std::size_t len = std::min<std::uint64_t>(256, n - c * 256);
        packet_header h{.type = packet_type::async_delta, .group = 2, .worker = w, .chunk = c, .sequence = seq};
        const auto p = make_packet(h, std::vector<float>(delta.begin() + c * 256, delta.begin() + static_cast<std::ptrdiff_t>(c * 256 + len)));
        // Retransmit until a reply gets through, sometimes duplicating on purpose.
        bool acked = false;
        while (!acked) {
          if (lose.drop()) continue;
          agg.handle(p, [&](std::uint16_t to, std::span<const std::byte> r) {
            CHECK(to == w);
            CHECK(header_of(r).sequence == seq);
            if (!lose.drop()) acked = true;
          });
        }
        if (rng() % 3 == 0) agg.handle(p, [](std::uint16_t, std::span<const std::byte>) {});
        for (std::size_t i = 0; i < len; ++i) model[w][c * 256 + i] += delta[c * 256 + i];
      }
    }
  const auto s = agg.async_sum(2);
  for (std::size_t i = 0; i < n; ++i) CHECK(s[i] == static_cast<float>(model[0][i] + model[1][i] + model[2][i]));
  CHECK(agg.stats().deltas_applied == 20 * 3 * 4);
  CHECK(agg.stats().retransmissions_seen > 0);
  // A delta from the future is refused.
  packet_header h{.type = packet_type::async_delta, .group = 2, .worker = 0, .chunk = 0, .sequence = 30};
  CHECK(agg.handle(make_packet(h, std::vector<float>(256, 1.0f)), [](auto, auto) {}) == drop_reason::sequence_gap);
}

TEST_CASE("async reply is S over the members that joined") {
  aggregator agg({group_config{.id = 2, .mode = group_mode::async, .members = 4, .chunk = 2, .elements = 2}});
  std::vector<float> got;
  auto sink = [&](std::uint16_t, std::span<const std::byte> r) { got = values_of(std::vector<std::byte>(r.begin(), r.end())); };
  packet_header h{.type = packet_type::async_delta, .group = 2, .worker = 0, .chunk = 0, .sequence = 1};
  agg.handle(make_packet(h, {2, 4}), sink);
  CHECK(got == std::vector<float>{2, 4});
  h.worker = 1;
  agg.handle(make_packet(h, {4, 8}), sink);
  CHECK(got == std::vector<float>{3, 6});
  h.sequence = 2;
  agg.handle(make_packet(h, {2, 2}), sink);  // worker 1 moved: S = {8, 14}
  CHECK(got == std::vector<float>{4, 7});
}

TEST_CASE("async sessions: a group is reused run after run, each delta applied once, S holds only joined members") {
  aggregator agg({group_config{.id = 2, .mode = group_mode::async, .members = 3, .chunk = 4, .elements = 6}});
  std::vector<float> got;
  auto sink = [&](std::uint16_t, std::span<const std::byte> r) { got = values_of(std::vector<std::byte>(r.begin(), r.end())); };
  auto delta = [&](std::uint16_t w, std::uint32_t session, std::uint32_t seq, float v) {
    for (std::uint32_t c = 0; c < 2; ++c) {
      packet_header h{.type = packet_type::async_delta, .group = 2, .worker = w, .chunk = c, .sequence = seq, .session = session};
      CHECK(agg.handle(make_packet(h, std::vector<float>(c == 0 ? 4 : 2, v)), sink) == drop_reason::accepted);
    }
  };
  auto leave = [&](std::uint16_t w, std::uint32_t session) {
    packet_header h{.type = packet_type::async_leave, .group = 2, .worker = w, .session = session};
    std::vector<std::byte> p(sizeof h);
    std::memcpy(p.data(), &h, sizeof h);
    reply_log log;
    CHECK(agg.handle(p, log.sink()) == drop_reason::accepted);
    REQUIRE(log.all.size() == 1);  // always answered: a lost answer is retransmitted
    CHECK(header_of(log.all[0].second).type == packet_type::async_reply);
    CHECK(header_of(log.all[0].second).elements == 0);
    CHECK(log.all[0].second.size() == sizeof(packet_header));
  };
  // Run 1: three members, sessions 11..13, two deltas each.
  for (std::uint16_t w = 0; w < 3; ++w) delta(w, 11 + w, 1, 3.0f * (w + 1));
  for (std::uint16_t w = 0; w < 3; ++w) delta(w, 11 + w, 2, 3.0f);
  CHECK(got == std::vector<float>{9, 9});  // S = 3+6+9 + 9 = 27, over 3
  CHECK(agg.async_joined(2) == 3);
  // Everyone leaves; the leave is idempotent. S is empty again, exactly.
  for (std::uint16_t w = 0; w < 3; ++w) leave(w, 11 + w);
  leave(0, 11);
  CHECK(agg.async_joined(2) == 0);
  for (float v : agg.async_sum(2)) CHECK(v == 0.0f);
  // A late retransmission of a session that left is not applied.
  packet_header late{.type = packet_type::async_delta, .group = 2, .worker = 1, .chunk = 0, .sequence = 1, .session = 12};
  CHECK(agg.handle(make_packet(late, std::vector<float>(4, 100.0f)), sink) == drop_reason::stale_session);
  // Run 2: new sessions, sequence numbers from 1 again — applied, not taken as duplicates.
  const auto applied = agg.stats().deltas_applied;
  delta(0, 21, 1, 2.0f);
  CHECK(got == std::vector<float>{2, 2});
  delta(1, 22, 1, 4.0f);
  CHECK(got == std::vector<float>{3, 3});
  CHECK(agg.stats().deltas_applied == applied + 4);
  // A new session must start at sequence 1.
  late = {.type = packet_type::async_delta, .group = 2, .worker = 2, .chunk = 0, .sequence = 2, .session = 23};
  CHECK(agg.handle(make_packet(late, std::vector<float>(4, 1.0f)), sink) == drop_reason::stale_session);
  // Worker 1 dies without leaving and comes back as session 32: its old part (4) is replaced.
  delta(1, 32, 1, 10.0f);
  CHECK(got == std::vector<float>{6, 6});  // (2 + 10) / 2
  CHECK(agg.async_joined(2) == 2);
  const auto s = agg.async_sum(2);
  for (float v : s) CHECK(v == 12.0f);
  // Leaving with a session that is not the current one changes nothing.
  leave(1, 22);
  CHECK(agg.async_joined(2) == 2);
  leave(1, 32);
  leave(0, 21);
  for (float v : agg.async_sum(2)) CHECK(v == 0.0f);
}

TEST_CASE("async: a switch that holds no session of a member asks it to rejoin, and applies nothing of the old session") {
  const group_config g{.id = 2, .mode = group_mode::async, .members = 2, .chunk = 4, .elements = 4};
  aggregator agg({g});  // as just restarted: members 0 and 1 were joined at the switch before
  packet_header h{.type = packet_type::async_delta, .group = 2, .worker = 1, .chunk = 0, .sequence = 7, .session = 41};
  reply_log log;
  CHECK(agg.handle(make_packet(h, std::vector<float>(4, 3.0f)), log.sink()) == drop_reason::unknown_session);
  REQUIRE(log.all.size() == 1);
  CHECK(log.all[0].first == 1);
  const auto r = header_of(log.all[0].second);
  CHECK(r.type == packet_type::async_rejoin);
  CHECK(r.elements == 0);
  CHECK(log.all[0].second.size() == sizeof(packet_header));
  CHECK((r.session == 41 && r.sequence == 7 && r.chunk == 0 && r.worker == 1));
  for (float v : agg.async_sum(2)) CHECK(v == 0.0f);
  CHECK(agg.async_joined(2) == 0);
  // The member joins again as a new session with everything it had sent.
  h.sequence = 1, h.session = 42;
  log.all.clear();
  CHECK(agg.handle(make_packet(h, std::vector<float>(4, 5.0f)), log.sink()) == drop_reason::accepted);
  for (float v : agg.async_sum(2)) CHECK(v == 5.0f);
  // A late packet of the old session is now stale, and not answered.
  h.sequence = 8, h.session = 41;
  log.all.clear();
  CHECK(agg.handle(make_packet(h, std::vector<float>(4, 3.0f)), log.sink()) == drop_reason::stale_session);
  CHECK(log.all.empty());
  // A member that left is not asked to rejoin by a late packet either.
  h.sequence = 1, h.session = 42;
  packet_header leave{.type = packet_type::async_leave, .group = 2, .worker = 1, .session = 42};
  std::vector<std::byte> lp(sizeof leave);
  std::memcpy(lp.data(), &leave, sizeof leave);
  CHECK(agg.handle(lp, log.sink()) == drop_reason::accepted);
  log.all.clear();
  h.sequence = 2;
  CHECK(agg.handle(make_packet(h, std::vector<float>(4, 3.0f)), log.sink()) == drop_reason::stale_session);
  CHECK(log.all.empty());
}

TEST_CASE("async: a switch restarted during a member's first delta asks it to join again once it is past that delta") {
  // The old switch applied chunk 0 of the first delta and then restarted: this
  // one gets chunk 1 of that delta (a join, sequence 1) and then the second
  // delta, whose chunk 0 it has never seen.
  const group_config g{.id = 2, .mode = group_mode::async, .members = 1, .chunk = 2, .elements = 4};
  aggregator agg({g});
  reply_log log;
  packet_header h{.type = packet_type::async_delta, .group = 2, .worker = 0, .chunk = 1, .sequence = 1, .session = 5};
  CHECK(agg.handle(make_packet(h, {1, 1}), log.sink()) == drop_reason::accepted);
  h.sequence = 2;
  CHECK(agg.handle(make_packet(h, {1, 1}), log.sink()) == drop_reason::accepted);  // chunk 1: its second delta
  h.chunk = 0;
  log.all.clear();
  CHECK(agg.handle(make_packet(h, {1, 1}), log.sink()) == drop_reason::unknown_session);  // chunk 0: the first delta is lost here
  REQUIRE(log.all.size() == 1);
  const auto r = header_of(log.all[0].second);
  CHECK((r.type == packet_type::async_rejoin && r.session == 5 && r.sequence == 2 && r.chunk == 0));
  // The member joins again with everything it sent (2 per value): S is exact.
  h.session = 6, h.sequence = 1;
  for (std::uint32_t c : {0u, 1u}) {
    h.chunk = c;
    CHECK(agg.handle(make_packet(h, {2, 2}), log.sink()) == drop_reason::accepted);
  }
  for (float v : agg.async_sum(2)) CHECK(v == 2.0f);
}

TEST_CASE("async: a late copy of a session that left, or was evicted, never takes the member from its current session") {
  aggregator agg({group_config{.id = 2, .mode = group_mode::async, .members = 2, .chunk = 2, .elements = 2, .idle_s = 10}});
  reply_log log;
  const auto delta = [](std::uint16_t w, std::uint32_t session, std::uint32_t seq, float v) {
    return make_packet(packet_header{.type = packet_type::async_delta, .group = 2, .worker = w, .chunk = 0, .sequence = seq, .session = session},
                       {v, v});
  };
  const auto leave = [](std::uint16_t w, std::uint32_t session) {
    const packet_header l{.type = packet_type::async_leave, .group = 2, .worker = w, .session = session};
    std::vector<std::byte> p(sizeof l);
    std::memcpy(p.data(), &l, sizeof l);
    return p;
  };
  agg.advance(0);
  CHECK(agg.handle(delta(1, 900, 1, 6), log.sink()) == drop_reason::accepted);
  const auto first = delta(0, 100, 1, 3);
  CHECK(agg.handle(first, log.sink()) == drop_reason::accepted);
  CHECK(agg.handle(leave(0, 100), log.sink()) == drop_reason::accepted);
  CHECK(agg.handle(delta(0, 200, 1, 6), log.sink()) == drop_reason::accepted);
  for (float v : agg.async_sum(2)) CHECK(v == 12.0f);
  agg.advance(5);
  CHECK(agg.handle(first, log.sink()) == drop_reason::stale_session);  // session 100 left: a late copy
  for (float v : agg.async_sum(2)) CHECK(v == 12.0f);
  CHECK(agg.handle(delta(0, 200, 2, 1), log.sink()) == drop_reason::accepted);  // the current session goes on
  // Worker 1 is evicted (silent past idle_s), joins again as 901; a late copy of 900 is stale too.
  agg.advance(12);
  CHECK(agg.handle(delta(0, 200, 3, 1), log.sink()) == drop_reason::accepted);
  agg.advance(16);
  CHECK(agg.handle(delta(1, 900, 2, 1), log.sink()) == drop_reason::evicted);
  CHECK(agg.handle(delta(1, 901, 1, 7), log.sink()) == drop_reason::accepted);
  CHECK(agg.handle(delta(1, 900, 1, 6), log.sink()) == drop_reason::stale_session);
  for (float v : agg.async_sum(2)) CHECK(v == 15.0f);  // 6 + 1 + 1 (worker 0) and 7 (worker 1)
  CHECK(agg.stats().drops[static_cast<std::size_t>(drop_reason::session_conflict)] == 0);
}

TEST_CASE("async: a member silent past idle_s is evicted from S; its session is asked to rejoin, and S is exact again") {
  aggregator agg({group_config{.id = 2, .mode = group_mode::async, .members = 2, .chunk = 4, .elements = 6, .idle_s = 10},
                  group_config{.id = 3, .mode = group_mode::async, .members = 2, .chunk = 4, .elements = 4, .idle_s = 0}});
  reply_log log;
  auto delta = [&](std::uint16_t group, std::uint16_t worker, std::uint32_t session, std::uint32_t sequence, float value) {
    drop_reason why = drop_reason::accepted;
    for (std::uint32_t c = 0; c < (group == 2 ? 2u : 1u); ++c) {
      const packet_header h{.type = packet_type::async_delta, .group = group, .worker = worker, .chunk = c, .sequence = sequence, .session = session};
      const auto w = agg.handle(make_packet(h, std::vector<float>(c == 0 ? 4 : 2, value)), log.sink());
      if (w != drop_reason::accepted) why = w;
    }
    return why;
  };
  agg.advance(1);
  CHECK(delta(2, 0, 100, 1, 1.0f) == drop_reason::accepted);
  CHECK(delta(2, 1, 200, 1, 2.0f) == drop_reason::accepted);
  CHECK(delta(3, 0, 300, 1, 4.0f) == drop_reason::accepted);  // idle_s = 0: never evicted
  agg.advance(9);
  CHECK(delta(2, 0, 100, 2, 1.0f) == drop_reason::accepted);  // member 0 heard at 9, member 1 last at 1
  agg.advance(11);
  CHECK(agg.stats().evictions == 0);  // 10 s since member 1, not more
  agg.advance(11.5);
  CHECK(agg.stats().evictions == 1);
  CHECK(agg.async_joined(2) == 1);
  for (float v : agg.async_sum(2)) CHECK(v == 2.0f);  // member 0's part only
  CHECK(agg.async_joined(3) == 1);
  // Member 0's replies now average over itself alone.
  log.all.clear();
  CHECK(delta(2, 0, 100, 3, 0.0f) == drop_reason::accepted);
  REQUIRE(log.all.size() == 2);
  CHECK(header_of(log.all[0].second).count == 1);
  CHECK(values_of(log.all[0].second) == std::vector<float>(4, 2.0f));
  // The evicted session's next delta is not applied; it is asked to rejoin.
  log.all.clear();
  CHECK(delta(2, 1, 200, 2, 7.0f) == drop_reason::evicted);
  REQUIRE(log.all.size() == 2);
  CHECK(header_of(log.all[0].second).type == packet_type::async_rejoin);
  for (float v : agg.async_sum(2)) CHECK(v == 2.0f);
  // It joins again as a new session with everything it had sent: S is exact.
  CHECK(delta(2, 1, 201, 1, 9.0f) == drop_reason::accepted);
  for (float v : agg.async_sum(2)) CHECK(v == 11.0f);
  CHECK(agg.async_joined(2) == 2);
  // A late packet of the evicted session is now stale.
  log.all.clear();
  CHECK(delta(2, 1, 200, 3, 1.0f) == drop_reason::stale_session);
  CHECK(log.all.empty());
  agg.advance(1000);  // both silent now, and the idle_s = 0 group keeps its member
  CHECK(agg.async_joined(2) == 0);
  for (float v : agg.async_sum(2)) CHECK(v == 0.0f);
  CHECK(agg.async_joined(3) == 1);
  CHECK(agg.stats().evictions == 3);
}

TEST_CASE("two jobs on one group: a displaced session that speaks again after the grace is refused, and so is the member's current one") {
  for (const bool sync : {true, false}) {
    CAPTURE(sync);
    aggregator agg({group_config{.id = 1, .mode = sync ? group_mode::sync : group_mode::async, .members = 2, .chunk = 2, .slots = 4,
                                 .elements = sync ? 0u : 2u, .idle_s = 0}});
    reply_log log;
    auto send = [&](std::uint16_t worker, std::uint32_t session, std::uint32_t sequence) {
      const packet_header h{.type = sync ? packet_type::sync_contribution : packet_type::async_delta, .group = 1, .worker = worker,
                            .slot = 0, .chunk = 0, .sequence = sequence, .session = session};
      return agg.handle(make_packet(h, {1.0f, 1.0f}), log.sink());
    };
    agg.advance(10);
    // Job A (sessions 10, 11) runs; job B (20, 21) starts on the same group.
    CHECK(send(0, 10, 1) == drop_reason::accepted);
    CHECK(send(1, 11, 1) == drop_reason::accepted);
    CHECK(send(0, 20, sync ? 2 : 1) == drop_reason::accepted);  // takes worker 0 from job A
    // Within the grace job A's worker 0 is a late packet of a gone process.
    agg.advance(10.5);
    CHECK(send(0, 10, 2) == drop_reason::stale_session);
    // After it, it is alive: both are refused, once for the current one.
    agg.advance(11.5);
    CHECK(send(0, 10, 2) == drop_reason::session_conflict);
    CHECK(send(0, 20, 2) == drop_reason::session_conflict);
    packet_header read, r;
    const auto again = make_packet({.type = sync ? packet_type::sync_contribution : packet_type::async_delta, .group = 1, .worker = 0,
                                    .sequence = 2, .session = 10}, {1.0f, 1.0f});
    REQUIRE(agg.validate(again, read) == drop_reason::accepted);
    REQUIRE(agg.refusal(read, drop_reason::session_conflict, r));
    CHECK((r.type == packet_type::refused && r.session == 10 && r.worker == 0));
    CHECK(agg.stats().drops[static_cast<std::size_t>(drop_reason::session_conflict)] == 2);
    // A new run on the group (new sessions, the old ones silent) is not taken for a conflict.
    agg.advance(100);
    CHECK(send(0, 30, 1) == drop_reason::accepted);
    CHECK(send(1, 31, 1) == drop_reason::accepted);
    agg.advance(200);
    CHECK(send(0, 30, 2) == drop_reason::accepted);
  }
}

TEST_CASE("sync sessions: a restarted group is exact after a finished run and after a run cut off mid-all-reduce") {
  aggregator agg({group_config{.id = 1, .mode = group_mode::sync, .members = 2, .chunk = 2, .slots = 1}});
  reply_log log;
  auto contribute = [&](std::uint16_t w, std::uint32_t session, std::uint32_t seq, std::uint8_t set, float v) {
    packet_header h{.type = packet_type::sync_contribution, .flags = set, .group = 1, .worker = w, .slot = 0, .chunk = 0, .sequence = seq,
                    .session = session};
    return agg.handle(make_packet(h, {v, v}), log.sink());
  };
  // Run 1: one all-reduce (sequence 1, set 0) completes.
  contribute(0, 1, 1, 0, 1.0f);
  contribute(1, 2, 1, 0, 2.0f);
  REQUIRE(log.all.size() == 2);
  CHECK(values_of(log.all[0].second) == std::vector<float>{3, 3});
  // Run 2 repeats sequence 1 on set 0: without sessions it would be taken as a
  // retransmission and get run 1's result.
  log.all.clear();
  CHECK(contribute(0, 3, 1, 0, 5.0f) == drop_reason::accepted);
  CHECK(log.all.empty());
  // Run 2 is cut off: worker 1 never contributes. Run 3 starts over.
  log.all.clear();
  CHECK(contribute(0, 5, 1, 0, 7.0f) == drop_reason::accepted);
  CHECK(contribute(1, 6, 1, 0, 8.0f) == drop_reason::accepted);
  REQUIRE(log.all.size() == 2);
  CHECK(values_of(log.all[1].second) == std::vector<float>{15, 15});
  // Each member's result carries that member's session, not the last contributor's.
  CHECK(log.all[0].first == 0);
  CHECK(header_of(log.all[0].second).session == 5);
  CHECK(header_of(log.all[1].second).session == 6);
  CHECK(agg.stats().drops[static_cast<std::size_t>(drop_reason::slot_conflict)] == 0);
}

TEST_CASE("validation: every field, every length; never reads past the datagram") {
  aggregator agg({group_config{.id = 1, .mode = group_mode::sync, .members = 2, .chunk = 8, .slots = 4},
                  group_config{.id = 2, .mode = group_mode::async, .members = 2, .chunk = 8, .elements = 20}});
  const packet_header good{.type = packet_type::sync_contribution, .group = 1, .worker = 1, .slot = 1, .chunk = 5, .sequence = 1};
  const std::vector<float> v(8, 1.0f);
  auto check = [&](packet_header h, std::size_t elements, drop_reason want, std::ptrdiff_t trim = 0) {
    auto p = make_packet(h, std::vector<float>(elements, 1.0f));
    p.resize(static_cast<std::size_t>(static_cast<std::ptrdiff_t>(p.size()) + trim));
    // Exactly sized heap copies let the address sanitizer catch an overread.
    std::vector<std::byte> exact(p.begin(), p.end());
    CHECK(agg.handle(exact, [](auto, auto) {}) == want);
  };
  auto h = good;
  check(h, 8, drop_reason::accepted);
  check(h, 8, drop_reason::too_short, -static_cast<std::ptrdiff_t>(packet_bytes(8)) + 31);
  check(h, 8, drop_reason::bad_length, -1);
  check(h, 8, drop_reason::bad_length, +4);
  h.magic = 0x12345678;
  check(h, 8, drop_reason::bad_magic);
  h = good;
  h.version = 9;
  check(h, 8, drop_reason::bad_version);
  // Another version's header may be shorter than this one's: its first 8
  // bytes tell the version; fewer than those are too short.
  check(h, 8, drop_reason::bad_version, -static_cast<std::ptrdiff_t>(packet_bytes(8)) + 16);
  check(h, 8, drop_reason::bad_version, -static_cast<std::ptrdiff_t>(packet_bytes(8)) + 8);
  check(h, 8, drop_reason::too_short, -static_cast<std::ptrdiff_t>(packet_bytes(8)) + 7);
  h.magic = 0x12345678;
  check(h, 8, drop_reason::too_short, -static_cast<std::ptrdiff_t>(packet_bytes(8)) + 16);
  h = good;
  h.type = packet_type::sync_result;
  check(h, 8, drop_reason::bad_type);
  h = good;
  h.group = 9;
  check(h, 8, drop_reason::unknown_group);
  h = good;
  h.worker = 2;
  check(h, 8, drop_reason::bad_worker);
  h = good;
  h.count = 3;  // the worker's run has 3 members, the group 2 (0, as in `good`: not checked)
  check(h, 8, drop_reason::bad_worker);
  h = good;
  check(h, 9, drop_reason::bad_elements);
  h = good;
  h.slot = 2;
  check(h, 8, drop_reason::bad_slot);
  h = good;
  h.slot = 4;
  h.chunk = 4;
  check(h, 8, drop_reason::bad_slot);
  h = good;
  h.type = packet_type::async_delta;
  check(h, 8, drop_reason::wrong_mode);
  h = good;
  h.group = 2;
  h.type = packet_type::async_delta;
  h.slot = 0;
  h.chunk = 3;
  check(h, 8, drop_reason::bad_chunk);
  h.chunk = 2;
  check(h, 8, drop_reason::bad_elements);  // the last chunk holds 4
  check(h, 4, drop_reason::accepted);
  h.sequence = 0;
  check(h, 4, drop_reason::sequence_gap);
  h.type = packet_type::async_leave;
  h.chunk = 0;
  check(h, 0, drop_reason::accepted);
  check(h, 1, drop_reason::bad_elements);
  h.chunk = 1;
  check(h, 0, drop_reason::bad_chunk);
  h.chunk = 0;
  h.group = 1;
  check(h, 0, drop_reason::wrong_mode);
  // Forged element count larger than the datagram.
  h = good;
  auto p = make_packet(h, v);
  h.elements = 8;
  p.resize(sizeof h + 4);
  std::vector<std::byte> exact(p.begin(), p.end());
  CHECK(agg.handle(exact, [](auto, auto) {}) == drop_reason::bad_length);
  CHECK(agg.stats().dropped() == 24);
}

TEST_CASE("refusals: a packet at odds with its group is answered with the reason and the group's view, no other drop") {
  aggregator agg({group_config{.id = 1, .mode = group_mode::sync, .members = 2, .chunk = 8, .slots = 4},
                  group_config{.id = 2, .mode = group_mode::async, .members = 3, .chunk = 8, .elements = 20}});
  const packet_header good{.type = packet_type::sync_contribution, .group = 1, .worker = 1, .slot = 1, .chunk = 5, .sequence = 1,
                           .session = 42};
  auto refusal_of = [&](packet_header h, std::size_t elements, drop_reason want) {
    const auto p = make_packet(h, std::vector<float>(elements, 1.0f));
    packet_header read, r;
    REQUIRE(agg.validate(p, read) == want);
    return agg.refusal(read, want, r) ? std::optional<packet_header>(r) : std::nullopt;
  };
  auto h = good;
  h.group = 9;
  auto r = refusal_of(h, 8, drop_reason::unknown_group);
  REQUIRE(r);
  CHECK((r->type == packet_type::refused && r->flags == static_cast<std::uint8_t>(drop_reason::unknown_group) && r->group == 9 &&
         r->worker == 1 && r->chunk == 5 && r->session == 42));
  CHECK((r->reserved == 0 && r->count == 0 && r->elements == 0 && r->slot == 0 && r->sequence == 0));  // no such group: no view
  CHECK(refusal_of(good, 8, drop_reason::accepted) == std::nullopt);
  h = good;
  h.worker = 2;
  r = refusal_of(h, 8, drop_reason::bad_worker);
  REQUIRE(r);
  CHECK((r->worker == 2 && r->reserved == 1 && r->count == 2 && r->elements == 8 && r->slot == 4 && r->sequence == 0));
  h = good;
  h.type = packet_type::async_delta;
  h.slot = 0;
  r = refusal_of(h, 8, drop_reason::wrong_mode);
  REQUIRE(r);
  CHECK(r->flags == static_cast<std::uint8_t>(drop_reason::wrong_mode));
  h.group = 2;
  h.chunk = 2;  // the last chunk holds 4 values
  r = refusal_of(h, 8, drop_reason::bad_elements);
  REQUIRE(r);
  CHECK((r->reserved == 2 && r->count == 3 && r->elements == 8 && r->slot == 0 && r->sequence == 20 && r->chunk == 2));
  h.chunk = 0;
  h.sequence = 0;  // a delta from the future of no sequence: the sender's state, not the group's
  CHECK(refusal_of(h, 8, drop_reason::sequence_gap) == std::nullopt);
  h = good;
  h.magic = 0;
  CHECK(refusal_of(h, 8, drop_reason::bad_magic) == std::nullopt);
  // Another version of the format: refused with nothing echoed but the
  // reason, the rest of its header being perhaps laid out otherwise ...
  h = good;
  h.version = 1;
  r = refusal_of(h, 8, drop_reason::bad_version);
  REQUIRE(r);
  CHECK((r->magic == packet_header::magic_value && r->version == packet_header::version_value && r->type == packet_type::refused &&
         r->flags == static_cast<std::uint8_t>(drop_reason::bad_version)));
  CHECK((r->reserved == 0 && r->group == 0 && r->worker == 0 && r->slot == 0 && r->elements == 0 && r->chunk == 0 && r->count == 0 &&
         r->sequence == 0 && r->session == 0));
  // ... and its refusals are not answered: no ping-pong between switches of two versions.
  h = packet_header{.type = packet_type::refused, .flags = static_cast<std::uint8_t>(drop_reason::bad_version)};
  h.version = 3;
  CHECK(refusal_of(h, 0, drop_reason::bad_version) == std::nullopt);
  // A refusal sent to a switch is dropped there, unanswered: no ping-pong between two switches.
  h = good;
  h.group = 9;
  r = refusal_of(h, 8, drop_reason::unknown_group);
  REQUIRE(r);
  const auto back = make_packet(*r, {});
  packet_header read, again;
  CHECK(agg.validate(back, read) == drop_reason::bad_type);
  CHECK_FALSE(agg.refusal(read, drop_reason::bad_type, again));
  for (std::size_t i = 0; i < drop_reason_count; ++i) {  // exactly the drops that say the group or the version disagrees, or is another job's
    const auto why = static_cast<drop_reason>(i);
    CAPTURE(to_string(why));
    const bool group_mismatch = why == drop_reason::unknown_group || why == drop_reason::bad_worker || why == drop_reason::bad_elements ||
                                why == drop_reason::bad_length || why == drop_reason::bad_chunk || why == drop_reason::bad_slot ||
                                why == drop_reason::wrong_mode || why == drop_reason::session_conflict || why == drop_reason::bad_version;
    CHECK(refusable(why) == group_mismatch);
  }
}

TEST_CASE("drop injector hits its rate") {
  drop_injector d(0.1, 3);
  int n = 0;
  for (int i = 0; i < 100000; ++i) n += d.drop();
  CHECK(n > 9000);
  CHECK(n < 11000);
  CHECK_FALSE(drop_injector(0.0).drop());
}

// The engine through the switch transport: sync (periodic policy) and async
// (adaptive policy) against the switch's aggregation code served over kernel
// UDP on 127.0.0.1, with and without injected loss.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <barrier>
#include <map>
#include <mutex>
#include <numeric>
#include <regex>
#include <functional>
#include <thread>

#include "gossip/gossip.hpp"
#include "test_support.hpp"
#include "transports/switch/aggregator.hpp"
#include "transports/switch/switch.hpp"

namespace {

// A UDP socket on 127.0.0.1 at a free port, which `port` receives.
int loopback_udp_socket(std::uint16_t& port) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  port = ntohs(a.sin_port);
  return fd;
}

// A minimal gossip-switch-udp inside the test: one thread, one socket.
class udp_aggregator {
 public:
  udp_aggregator(std::vector<gossip::sw::group_config> groups, double drop = 0) : m_groups(groups), m_agg(std::move(groups)), m_drop(drop, 11) {
    m_fd = loopback_udp_socket(m_port);
    m_thread = std::thread([this] { serve(); });
  }
  ~udp_aggregator() {
    m_stop = true;
    m_thread.join();
    ::close(m_fd);
  }
  std::uint16_t port() const { return m_port; }
  gossip::sw::aggregator_stats stats() {
    m_stop = true;
    if (m_thread.joinable()) m_thread.join();
    m_thread = std::thread([] {});
    return m_agg.stats();
  }
  std::vector<float> sum(std::uint16_t group) {
    stats();
    const auto s = m_agg.async_sum(group);
    return {s.begin(), s.end()};
  }
  /// As a switch killed and started again on the same port: no group state,
  /// no worker addresses.
  void restart() {
    std::lock_guard lock(m_mutex);
    m_agg = gossip::sw::aggregator(m_groups);
    m_peers.clear();
    ++m_restarts;
  }
  /// As restart(), serving `groups` from now on.
  void restart(std::vector<gossip::sw::group_config> groups) {
    {
      std::lock_guard lock(m_mutex);
      m_groups = std::move(groups);
    }
    restart();
  }
  /// Packets the current aggregator (since the last restart) dropped for `why`.
  std::uint64_t live_drops(gossip::sw::drop_reason why) {
    std::lock_guard lock(m_mutex);
    return m_agg.stats().drops[static_cast<std::size_t>(why)];
  }
  /// S and the members joined, read while serving.
  std::pair<std::vector<float>, int> live_sum(std::uint16_t group) {
    std::lock_guard lock(m_mutex);
    const auto s = m_agg.async_sum(group);
    return {{s.begin(), s.end()}, m_agg.async_joined(group)};
  }

 private:
  void serve() {
    std::vector<std::byte> buf(2048);
    auto& peers = m_peers;
    while (!m_stop) {
      pollfd p{m_fd, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      sockaddr_in from{};
      socklen_t fl = sizeof from;
      const auto n = ::recvfrom(m_fd, buf.data(), buf.size(), 0, reinterpret_cast<sockaddr*>(&from), &fl);
      if (n <= 0) continue;
      if (m_drop.drop()) continue;
      gossip::sw::packet_header h;
      const std::span<const std::byte> pkt(buf.data(), static_cast<std::size_t>(n));
      std::lock_guard lock(m_mutex);
      m_agg.advance(std::chrono::duration<double>(std::chrono::steady_clock::now() - m_start).count());  // as gossip-switch-udp
      if (m_agg.validate(pkt, h) == gossip::sw::drop_reason::accepted) peers[std::uint32_t{h.group} << 16 | h.worker] = from;
      const auto why = m_agg.handle(pkt, [&](std::uint16_t w, std::span<const std::byte> r) {
        if (m_drop.drop()) return;
        const auto it = peers.find(std::uint32_t{h.group} << 16 | w);
        if (it != peers.end()) ::sendto(m_fd, r.data(), r.size(), 0, reinterpret_cast<const sockaddr*>(&it->second), sizeof it->second);
      });
      if (gossip::sw::packet_header r; m_agg.refusal(h, why, r)) ::sendto(m_fd, &r, sizeof r, 0, reinterpret_cast<const sockaddr*>(&from), sizeof from);
    }
  }
  std::mutex m_mutex;
  std::vector<gossip::sw::group_config> m_groups;
  gossip::sw::aggregator m_agg;
  std::map<std::uint32_t, sockaddr_in> m_peers;
  int m_restarts = 0;
  gossip::sw::drop_injector m_drop;
  int m_fd = -1;
  std::uint16_t m_port = 0;
  std::atomic<bool> m_stop{false};
  std::chrono::steady_clock::time_point m_start = std::chrono::steady_clock::now();
  std::thread m_thread;
};

// Rank r's starting model in the async tests: values 4r + (i mod 3).
std::vector<float> async_model(int r, std::size_t n) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(4 * r + static_cast<int>(i % 3));
  return x;
}

// Every member joined, and the switch's S (live, read while serving) is the
// sum of what every member last sent (its x̂): a delta applied twice or
// never, or one left over from an earlier session, would break this.
void check_sum_of_sent(const std::pair<std::vector<float>, int>& live, const std::vector<std::vector<float>>& hats) {
  CHECK(live.second == static_cast<int>(hats.size()));
  for (std::size_t i = 0; i < live.first.size(); ++i) {
    double ref = 0;
    for (const auto& h : hats) ref += h[i];
    REQUIRE(live.first[i] == doctest::Approx(ref).epsilon(1e-5));
  }
}

gossip::config switch_config(const std::string& policy, std::uint16_t port, const std::string& mode = "auto") {
  auto cfg = gossip::config::parse(fmt::format(R"(
[policy]
name = "{}"
[topology]
name = "switch"
[protocol]
name = "switch-aggregate"
mode = "{}"
[transport]
name = "switch"
address = "127.0.0.1"
port = {}
group = 1
chunk = 64
window = 16
rto_ms = 2
timeout_s = 20
[engine]
timeout_s = 20
)", policy, mode, port), "test");
  return cfg;
}

}  // namespace

TEST_CASE("periodic policy through the switch: every step is an exact all-reduce (sync mode)") {
  for (double drop : {0.0, 0.10}) {
    CAPTURE(drop);
    const int world = 3;
    const std::size_t n = 1000;
    udp_aggregator agg({gossip::sw::group_config{.id = 1, .mode = gossip::sw::group_mode::sync, .members = world, .chunk = 64, .slots = 16}}, drop);
    const auto cfg = switch_config("periodic", agg.port());
    std::vector<std::vector<float>> finals(world);
    for (int run = 0; run < 2; ++run)  // the second run reuses the group (new sessions)
    gossip::test::run_ranks(world, [&](int r) {
      std::vector<float> x(n);
      for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>((i + 3 * static_cast<std::size_t>(r)) % 17) * 3.0f;  // sums divisible by 3
      gossip::model_view view;
      view.add("w", x);
      gossip::engine e(view, r, world, cfg, gossip::make_switch_transport(cfg, r, world));
      CHECK(e.stats().transport == std::string("switch"));
      CHECK(e.stats().codec == "none");  // the default (auto): the switch sums fp32
      auto res = e.step();  // sends x
      CHECK(res.sent);
      res = e.step();  // merges the mean: no local change, so x == mean exactly
      CHECK(res.merged == 1);
      for (std::size_t i = 0; i < n; ++i) {
        float ref = 0;
        for (int k = 0; k < world; ++k) ref += static_cast<float>((i + 3 * static_cast<std::size_t>(k)) % 17) * 3.0f;
        REQUIRE(x[i] == ref / world);
      }
      for (int s = 0; s < 5; ++s) e.step();
      e.finish(0);
      finals[static_cast<std::size_t>(r)] = x;
    });
    for (int r = 1; r < world; ++r) CHECK(finals[static_cast<std::size_t>(r)] == finals[0]);
    const auto st = agg.stats();
    CHECK(st.dropped() == 0);
    if (drop > 0) CHECK(st.retransmissions_seen > 0);
  }
}

TEST_CASE("adaptive policy through the switch: every delta applied exactly once, models reach consensus (async mode)") {
  // drift (tiny threshold) fires whenever the model moved; without local
  // training a member whose average stopped changing stops sending, and so
  // stops pulling: consensus is checked with a policy that always sends.
  for (const bool adaptive : {true, false})
  for (double drop : {0.0, 0.10}) {
    CAPTURE(drop);
    CAPTURE(adaptive);
    const int world = 4;
    const std::size_t n = 300;
    udp_aggregator agg({gossip::sw::group_config{.id = 1, .mode = gossip::sw::group_mode::async, .members = world, .chunk = 64, .elements = n}}, drop);
    auto cfg = adaptive ? switch_config("drift", agg.port()) : switch_config("periodic", agg.port(), "async");
    if (adaptive) cfg.apply_override("policy.threshold=1e-9");
    else cfg.apply_override("transport.mode=\"async\"");
    std::vector<std::vector<float>> finals(world), hats(world);
    // Two runs on the same group: the second one's sequence numbers restart
    // at 1 in new sessions, after the first run's members left.
    for (int run = 0; run < 2; ++run) {
      CAPTURE(run);
      std::pair<std::vector<float>, int> live;
      std::barrier all_sent(world);
      gossip::test::run_ranks(world, [&](int r) {
        auto x = async_model(r, n);
        gossip::model_view view;
        view.add("w", x);
        gossip::engine e(view, r, world, cfg, gossip::make_switch_transport(cfg, r, world));
        for (int s = 0; s < 80; ++s) {
          e.step();
          e.flush();
          if (s % 4 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        all_sent.arrive_and_wait();
        if (r == 0) live = agg.live_sum(1);
        all_sent.arrive_and_wait();
        e.finish(0);
        finals[static_cast<std::size_t>(r)] = x;
        hats[static_cast<std::size_t>(r)].assign(e.snapshot().begin(), e.snapshot().end());
      });
      check_sum_of_sent(live, hats);  // exactly once, nothing left of the previous run
      // After every member left, S is empty, exactly.
      const auto after = agg.live_sum(1);
      CHECK(after.second == 0);
      for (float v : after.first) REQUIRE(v == 0.0f);
    }
    const auto st = agg.stats();
    CHECK(st.drops[static_cast<std::size_t>(gossip::sw::drop_reason::sequence_gap)] == 0);
    CHECK(st.drops[static_cast<std::size_t>(gossip::sw::drop_reason::stale_session)] == 0);
    CHECK(st.deltas_applied > 0);
    if (drop > 0) CHECK(st.retransmissions_seen > 0);
    // Consensus: every member ends near the others, inside the initial range.
    for (std::size_t i = 0; i < n && !adaptive; ++i) {
      float lo = finals[0][i], hi = finals[0][i];
      for (int r = 1; r < world; ++r) {
        lo = std::min(lo, finals[static_cast<std::size_t>(r)][i]);
        hi = std::max(hi, finals[static_cast<std::size_t>(r)][i]);
      }
      CHECK(hi - lo < 0.05f);  // from a spread of 14
      CHECK(lo >= 0.0f);
      CHECK(hi <= 14.0f);
    }
  }
}

TEST_CASE("async mode survives a switch restart: every member rejoins with what it had sent, S is exact again") {
  const int world = 4;
  const std::size_t n = 300;
  udp_aggregator agg({gossip::sw::group_config{.id = 1, .mode = gossip::sw::group_mode::async, .members = world, .chunk = 64, .elements = n}});
  auto cfg = switch_config("periodic", agg.port(), "async");
  cfg.apply_override("transport.mode=\"async\"");
  std::vector<std::vector<float>> hats(world);
  std::vector<std::uint64_t> rejoins(world);
  std::pair<std::vector<float>, int> live;
  std::barrier sync(world);
  gossip::test::run_ranks(world, [&](int r) {
    auto x = async_model(r, n);
    gossip::model_view view;
    view.add("w", x);
    gossip::engine e(view, r, world, cfg, gossip::make_switch_transport(cfg, r, world));
    for (int s = 0; s < 60; ++s) {
      if (s == 20) {
        sync.arrive_and_wait();
        if (r == 0) agg.restart();  // every member has sent 20 deltas: each one's next is answered async_rejoin
        sync.arrive_and_wait();
      }
      for (std::size_t i = 0; i < n; i += 7) x[i] += 0.25f * static_cast<float>(r + 1);  // local progress to send
      e.step();
      e.flush();
    }
    sync.arrive_and_wait();
    if (r == 0) live = agg.live_sum(1);
    sync.arrive_and_wait();
    rejoins[static_cast<std::size_t>(r)] = e.stats().transport_rejoins;
    hats[static_cast<std::size_t>(r)].assign(e.snapshot().begin(), e.snapshot().end());
    e.finish(0);
  });
  CHECK(agg.live_drops(gossip::sw::drop_reason::unknown_session) >= world);
  for (int r = 0; r < world; ++r) CHECK(rejoins[static_cast<std::size_t>(r)] == 1);
  check_sum_of_sent(live, hats);  // the restarted switch's S is exact again
}

TEST_CASE("async mode: a member silent past the group's idle_s is evicted, then rejoins with what it had sent; S is exact again") {
  const int world = 2;
  const std::size_t n = 300;
  udp_aggregator agg(
      {gossip::sw::group_config{.id = 1, .mode = gossip::sw::group_mode::async, .members = world, .chunk = 64, .elements = n, .idle_s = 1}});
  auto cfg = switch_config("periodic", agg.port(), "async");
  cfg.apply_override("transport.mode=\"async\"");
  std::vector<std::vector<float>> hats(world);
  std::vector<std::uint64_t> rejoins(world);
  std::pair<std::vector<float>, int> during, live;
  std::barrier sync(world);
  gossip::test::run_ranks(world, [&](int r) {
    auto x = async_model(r, n);
    gossip::model_view view;
    view.add("w", x);
    gossip::engine e(view, r, world, cfg, gossip::make_switch_transport(cfg, r, world));
    auto step = [&] {
      for (std::size_t i = 0; i < n; i += 7) x[i] += 0.25f * static_cast<float>(r + 1);
      e.step();
      e.flush();
    };
    for (int s = 0; s < 10; ++s) step();
    sync.arrive_and_wait();
    if (r == 0) {  // rank 1 is silent; rank 0 trains on until the switch has evicted it
      const auto start = std::chrono::steady_clock::now();
      while (agg.live_sum(1).second == world &&
             std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
        step();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      during = agg.live_sum(1);
    }
    sync.arrive_and_wait();
    for (int s = 0; s < 10; ++s) step();  // rank 1's first delta is answered async_rejoin
    sync.arrive_and_wait();
    if (r == 0) live = agg.live_sum(1);
    sync.arrive_and_wait();
    rejoins[static_cast<std::size_t>(r)] = e.stats().transport_rejoins;
    hats[static_cast<std::size_t>(r)].assign(e.snapshot().begin(), e.snapshot().end());
    e.finish(0);
  });
  CHECK(during.second == 1);  // rank 0 alone
  CHECK(agg.live_drops(gossip::sw::drop_reason::evicted) >= 1);
  CHECK(rejoins == std::vector<std::uint64_t>{0, 1});
  check_sum_of_sent(live, hats);
}

TEST_CASE("momentum = auto through the switch: quasi-global for the sync all-reduce, local for the async aggregate") {
  // Every member merges a sync all-reduce at the step after it posted (ranks
  // in lockstep, as over loopback); async replies land at any point of a
  // member's progress.
  for (const bool sync : {true, false}) {
    CAPTURE(sync);
    const int world = 2;
    const std::size_t n = 64;
    gossip::sw::group_config g{.id = 1, .mode = sync ? gossip::sw::group_mode::sync : gossip::sw::group_mode::async, .members = world, .chunk = 64};
    if (sync) g.slots = 16;
    else g.elements = n;
    udp_aggregator agg({g});
    const auto cfg = switch_config(sync ? "periodic" : "drift", agg.port());
    std::vector<std::string> reported(world);
    gossip::test::run_ranks(world, [&](int r) {
      std::vector<float> x(n, static_cast<float>(r)), v(n, 0.0f);
      gossip::model_view view;
      view.add("w", x).momentum("w", v);
      gossip::engine e(view, r, world, cfg, gossip::make_switch_transport(cfg, r, world));
      for (int s = 0; s < 4; ++s) {
        for (auto& xi : x) xi -= 0.1f;
        e.step({.lr = 0.1});
      }
      reported[static_cast<std::size_t>(r)] = e.stats().momentum;
      e.finish(0);
    });
    for (int r = 0; r < world; ++r) CHECK(reported[static_cast<std::size_t>(r)] == (sync ? "quasi-global" : "local"));
  }
}

TEST_CASE("consensus through the switch: sync all-reduce rounds at the same steps on every member, paced by the group's drift") {
  // Each member pulls its model towards its own optimum (a skewed shard); the
  // all-reduce carries each member's relative drift² at the round, so every
  // member reads the same group mean and computes the same next round.
  const int world = 3;
  const std::size_t n = 500;
  const int steps = 120;
  udp_aggregator agg({gossip::sw::group_config{.id = 1, .mode = gossip::sw::group_mode::sync, .members = world, .chunk = 64, .slots = 16}});
  auto cfg = switch_config("consensus", agg.port());
  cfg.apply_override("policy.threshold=0.05");
  CHECK(gossip::switch_mode("auto", "consensus") == "sync");
  std::vector<std::vector<int>> rounds(world);
  std::vector<std::vector<double>> drift_sq(world);  // each member's own relative drift² at its rounds
  std::vector<double> group(world);
  std::vector<std::vector<float>> finals(world);
  gossip::test::run_ranks(world, [&](int r) {
    std::vector<float> x(n, 1.0f);
    gossip::model_view view;
    view.add("w", x);
    gossip::engine e(view, r, world, cfg, gossip::make_switch_transport(cfg, r, world));
    for (int s = 0; s < steps; ++s) {
      const double lr = s < 80 ? 0.02 : 0.002;
      for (std::size_t i = 0; i < n; ++i) x[i] += static_cast<float>(lr) * (static_cast<float>(r + 1 + (i % 5)) - x[i]);
      const auto res = e.step({.lr = lr});
      if (res.sent) {
        rounds[static_cast<std::size_t>(r)].push_back(s);
        drift_sq[static_cast<std::size_t>(r)].push_back(res.relative_drift * res.relative_drift);
      }
    }
    e.step({.lr = 0.002});  // merges the last round if it was at the last step
    group[static_cast<std::size_t>(r)] = e.group_drift_sq();
    e.finish(0);
    finals[static_cast<std::size_t>(r)] = x;
  });
  for (int r = 1; r < world; ++r) CHECK(rounds[static_cast<std::size_t>(r)] == rounds[0]);
  CAPTURE(fmt::format("{}", fmt::join(rounds[0], " ")));
  CHECK(rounds[0].size() >= 6);
  CHECK(rounds[0].size() <= static_cast<std::size_t>(steps) / 3);
  CHECK(rounds[0].front() == 0);
  // The group figure every member read is the mean of the members' drift² at the last round.
  double mean = 0;
  for (int r = 0; r < world; ++r) mean += drift_sq[static_cast<std::size_t>(r)].back() / world;
  for (int r = 0; r < world; ++r) CHECK(group[static_cast<std::size_t>(r)] == doctest::Approx(mean).epsilon(1e-5));
  // Rounds keep the members together, whose optima lie 1 and 2 apart.
  for (int r = 1; r < world; ++r)
    for (std::size_t i = 0; i < n; i += 7) CHECK(std::abs(finals[static_cast<std::size_t>(r)][i] - finals[0][i]) < 0.1f);
  CHECK(agg.stats().dropped() == 0);
}

TEST_CASE("a switch whose group disagrees with the workers refuses their packets: they stop at once with what differs") {
  using gossip::sw::group_config, gossip::sw::group_mode;
  struct mismatch {
    group_config group;
    const char* set;       // override of the workers' config
    const char* expected;  // in the error
  };
  const std::vector<mismatch> cases = {
      {{.id = 1, .mode = group_mode::sync, .members = 2, .chunk = 64, .slots = 16}, "transport.group=5",
       "refused the packets of worker 0 (group 5; unknown_group): it serves no group 5; start the switch with a --group id=5"},
      {{.id = 1, .mode = group_mode::sync, .members = 2, .chunk = 32, .slots = 16}, "transport.rto_ms=2",
       "(group 1; bad_elements): its group 1 is sync, with 2 members, chunk 32, 16 slots and a model of any size; this worker is worker 0 of "
       "2, sync mode, chunk 64, window 16, a model of 1000 floats (chunk 0 refused)"},
      {{.id = 1, .mode = group_mode::async, .members = 2, .chunk = 64, .elements = 1000}, "transport.rto_ms=2",
       "(group 1; wrong_mode): its group 1 is async, with 2 members, chunk 64 and a model of 1000 floats; this worker is worker 0 of 2, "
       "sync mode"},
      {{.id = 1, .mode = group_mode::sync, .members = 2, .chunk = 64, .slots = 8}, "transport.rto_ms=2", "(group 1; bad_slot)"},  // chunk 8 on slot 8
      // More members than the run has ranks: every round would wait for the missing ones.
      {{.id = 1, .mode = group_mode::sync, .members = 4, .chunk = 64, .slots = 16}, "transport.rto_ms=2",
       "(group 1; bad_worker): its group 1 is sync, with 4 members, chunk 64, 16 slots and a model of any size; this worker is worker 0 of 2, "
       "sync mode, chunk 64, window 16, a model of 1000 floats: the group needs as many members as the run has ranks"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.set);
    udp_aggregator agg({c.group});
    auto cfg = switch_config("periodic", agg.port());
    cfg.apply_override(c.set);
    const auto start = std::chrono::steady_clock::now();
    // Both members: a round's small all-reduce may pass where the model's
    // packets (another chunk, slot or length) are refused.
    gossip::test::run_ranks(2, [&](int r) {
      std::vector<float> x(1000, 1.0f);
      gossip::model_view view;
      view.add("w", x);
      gossip::engine e(view, r, 2, cfg, gossip::make_switch_transport(cfg, r, 2));
      // The refusal comes back at the first send; the next step rethrows it.
      CHECK_THROWS_WITH_AS(
          for (int s = 0; s < 100; ++s) {
            e.step();
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          },
          doctest::Contains(r == 0 ? c.expected : std::regex_replace(c.expected, std::regex("worker 0"), "worker 1").c_str()),
          gossip::config_error);
    });
    // Long before the transport's 20 s timeout.
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  }
}

TEST_CASE("a switch of another wire version: the workers stop at once with both versions named") {
  // What a switch of version 3 answers every packet of this version with
  // (packet.hpp): a refusal, laid out alike in bytes 0-7 in every version.
  for (const bool refusal : {true, false}) {
    CAPTURE(refusal);
    std::uint16_t port = 0;
    const int fd = loopback_udp_socket(port);
    std::atomic<bool> stop{false};
    std::atomic<int> answered{0};
    std::thread sw([&] {
      std::vector<std::byte> buf(2048);
      while (!stop) {
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 20) <= 0) continue;
        sockaddr_in from{};
        socklen_t fl = sizeof from;
        if (::recvfrom(fd, buf.data(), buf.size(), 0, reinterpret_cast<sockaddr*>(&from), &fl) < 8) continue;
        // A refusal of bad_version, or (a switch that does not refuse) its own reply type.
        gossip::sw::packet_header r{.type = refusal ? gossip::sw::packet_type::refused : gossip::sw::packet_type::sync_result};
        r.version = 3;
        r.flags = refusal ? static_cast<std::uint8_t>(gossip::sw::drop_reason::bad_version) : 0;
        ::sendto(fd, &r, sizeof r, 0, reinterpret_cast<const sockaddr*>(&from), sizeof from);
        ++answered;
      }
    });
    auto cfg = switch_config("periodic", port);
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> x(1000, 1.0f);
    gossip::model_view view;
    view.add("w", x);
    const std::string expected = fmt::format("speaks version 3 of the switch wire format and worker 0 (group 1) version {}{}",
                                             gossip::sw::packet_header::version_value,
                                             refusal ? "; it refused this worker's packets (bad_version)" : "");
    CHECK_THROWS_WITH_AS(
        {
          gossip::engine e(view, 0, 2, cfg, gossip::make_switch_transport(cfg, 0, 2));
          for (int s = 0; s < 100; ++s) {
            e.step();
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        },
        doctest::Contains(expected.c_str()), gossip::config_error);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));  // long before the 20 s timeout
    stop = true;
    sw.join();
    ::close(fd);
    CHECK(answered > 0);
  }
}

TEST_CASE("two jobs on one sync group: the switch refuses both instead of mixing their sums") {
  udp_aggregator agg({gossip::sw::group_config{.id = 1, .mode = gossip::sw::group_mode::sync, .members = 2, .chunk = 64, .slots = 16}});
  auto cfg = switch_config("periodic", agg.port());
  cfg.apply_override("transport.timeout_s=5");
  std::vector<std::string> errors(4);
  std::barrier start(4);
  const auto t0 = std::chrono::steady_clock::now();
  gossip::test::run_ranks(4, [&](int r) {  // job r / 2, rank r % 2
    std::vector<float> x(1000, static_cast<float>(r / 2));
    gossip::model_view view;
    view.add("w", x);
    gossip::engine e(view, r % 2, 2, cfg, gossip::make_switch_transport(cfg, r % 2, 2));
    start.arrive_and_wait();
    try {
      for (int s = 0; s < 2000; ++s) {
        e.step();
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    } catch (const gossip::config_error& err) {
      errors[static_cast<std::size_t>(r)] = std::string("config_error: ") + err.what();
    } catch (const gossip::timeout_error& err) {
      errors[static_cast<std::size_t>(r)] = std::string("timeout_error: ") + err.what();
    }
  });
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(15));
  for (int job = 0; job < 2; ++job) {  // each job stops, at least one of its ranks with the reason
    CAPTURE(job);
    const auto& a = errors[static_cast<std::size_t>(2 * job)];
    const auto& b = errors[static_cast<std::size_t>(2 * job + 1)];
    CAPTURE(a);
    CAPTURE(b);
    CHECK((!a.empty() && !b.empty()));
    const char* reason = "(group 1; session_conflict): another session holds worker";
    CHECK((a.find(reason) != std::string::npos || b.find(reason) != std::string::npos));
  }
  CHECK(agg.live_drops(gossip::sw::drop_reason::session_conflict) >= 2);
}

TEST_CASE("a sync all-reduce that a member never joins times out naming the chunk, the member and what the worker sent and heard") {
  udp_aggregator agg({gossip::sw::group_config{.id = 1, .mode = gossip::sw::group_mode::sync, .members = 2, .chunk = 64, .slots = 16}});
  auto cfg = switch_config("periodic", agg.port());
  cfg.apply_override("transport.timeout_s=0.5");
  gossip::test::run_ranks(1, [&](int) {
    std::vector<float> x(1000, 1.0f);
    gossip::model_view view;
    view.add("w", x);
    gossip::engine e(view, 0, 2, cfg, gossip::make_switch_transport(cfg, 0, 2));
    std::string what;
    try {
      for (int s = 0; s < 300; ++s) {
        e.step();
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } catch (const gossip::timeout_error& err) {
      what = err.what();
    }
    CAPTURE(what);
    // A round starts with its small all-reduce (1 + 12 values a member: one chunk).
    CHECK(what.find("(group 1, worker 0 of 2, sync mode): chunk 0 of 1 unanswered (") != std::string::npos);
    CHECK(what.find("every member of a sync group must also have the same [transport] chunk and post at the same steps") != std::string::npos);
    // Each retransmission was answered sync_pending: the switch held rank 0's share and waited for rank 1's.
    CHECK(what.find("the switch holds the shares of member(s) 0 of chunk 0 and waits for member(s) 1 (its last answer, ") != std::string::npos);
    unsigned long long sent = 0, resent = 0, received = 0, stale = 1, malformed = 1;
    const auto at = what.find("unanswered (");
    REQUIRE(at != std::string::npos);
    REQUIRE(std::sscanf(what.c_str() + at, "unanswered (%llu packets sent, %llu of them retransmissions; %llu received, %llu of them stale and "
                                           "%llu malformed)", &sent, &resent, &received, &stale, &malformed) == 5);
    CHECK(resent > 0);
    CHECK(sent == 1 + resent);  // the chunk once, then retransmissions
    CHECK((received > 0 && received <= resent && stale == 0 && malformed == 0));  // the switch's sync_pending answers
    // The stats of the failed run count them too.
    CHECK(e.stats().transport_dropped == resent);
  });
  CHECK(agg.stats().accepted() > 1);  // the retransmissions reached it
  CHECK(agg.stats().pending_answered > 0);
}

TEST_CASE("sync: a member that stops mid-run is named in the others' timeout, as the switch saw it") {
  // Three ranks in lockstep rounds; rank 2 stops stepping after 5 steps (as a
  // process that died would), and ranks 0 and 1 time out in the next round,
  // told that the switch holds their shares and waits for member 2's.
  udp_aggregator agg({gossip::sw::group_config{.id = 1, .mode = gossip::sw::group_mode::sync, .members = 3, .chunk = 64, .slots = 16}});
  auto cfg = switch_config("periodic", agg.port());
  cfg.apply_override("transport.timeout_s=4");
  std::array<std::string, 3> what;
  std::array<int, 3> steps{};
  std::atomic<int> failed{0};
  std::barrier ready(3);
  gossip::test::run_ranks(3, [&](int r) {
    std::vector<float> x(500, static_cast<float>(r));
    gossip::model_view view;
    view.add("w", x);
    gossip::engine e(view, r, 3, cfg, gossip::make_switch_transport(cfg, r, 3));
    ready.arrive_and_wait();  // a slow start is no death
    try {
      for (int s = 0; s < (r == 2 ? 5 : 200); ++s, ++steps[static_cast<std::size_t>(r)]) e.step();
    } catch (const gossip::timeout_error& err) {
      what[static_cast<std::size_t>(r)] = err.what();
    }
    if (r != 2) {
      ++failed;
      return;
    }
    // Rank 2 holds its transport open, silent, until the others gave up.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (failed.load() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  });
  CHECK(what[2].empty());
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CAPTURE(what[static_cast<std::size_t>(r)]);
    CHECK(steps[static_cast<std::size_t>(r)] >= 5);
    CHECK(steps[static_cast<std::size_t>(r)] < 200);
    CHECK(what[static_cast<std::size_t>(r)].find(fmt::format("(group 1, worker {} of 3, sync mode)", r)) != std::string::npos);
    CHECK(what[static_cast<std::size_t>(r)].find("the switch holds the shares of member(s) 0, 1 of chunk ") != std::string::npos);
    CHECK(what[static_cast<std::size_t>(r)].find("and waits for member(s) 2 (its last answer, ") != std::string::npos);
  }
  CHECK(agg.stats().pending_answered > 0);
}

TEST_CASE("an engine that stops mid-run (an error unwound past it) gives up its operation at the switch at once") {
  // transport.timeout_s bounds one all-reduce or delta: 30 s here. A rank
  // whose training loop throws must not wait that long in the destructor.
  using clock = std::chrono::steady_clock;
  auto run = [](gossip::config cfg) {
    cfg.apply_override("transport.timeout_s=30");
    cfg.apply_override("engine.timeout_s=30");
    std::vector<float> x(1000, 1.0f);
    gossip::model_view view;
    view.add("w", x);
    auto e = std::make_unique<gossip::engine>(view, 0, 2, cfg, gossip::make_switch_transport(cfg, 0, 2));
    e->step();  // posts an operation nobody answers: the other member never runs, or no switch listens
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto t0 = clock::now();
    e.reset();  // without finish(): abandon
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  SUBCASE("sync: an all-reduce the other member never joins") {
    udp_aggregator agg({gossip::sw::group_config{.id = 1, .mode = gossip::sw::group_mode::sync, .members = 2, .chunk = 64, .slots = 16}});
    const double s = run(switch_config("periodic", agg.port()));
    CAPTURE(s);
    CHECK(s < 5.0);
    CHECK(agg.stats().accepted() >= 1);  // it did reach the switch
  }
  SUBCASE("async: a delta no switch answers (the leave after it is bounded by 5 s)") {
    std::uint16_t port = 0;
    const int fd = loopback_udp_socket(port);  // bound, never read: a switch that does not answer
    auto cfg = switch_config("drift", port);
    const double s = run(cfg);
    ::close(fd);
    CAPTURE(s);
    CHECK(s < 10.0);
  }
}

TEST_CASE("switch transport refuses a config that does not pair with it") {
  auto cfg = switch_config("periodic", 47999);
  cfg.apply_override("protocol.name=\"push-sum\"");
  CHECK_THROWS_WITH_AS(gossip::make_switch_transport(cfg, 0, 2), doctest::Contains("switch-aggregate"), gossip::config_error);
  auto c2 = switch_config("periodic", 47999);
  CHECK_THROWS_WITH_AS(gossip::make_switch_transport(c2, 0, 1), doctest::Contains("2..64"), gossip::config_error);
  // An address that is not IPv4 is refused with the key and where it was set.
  auto c3 = switch_config("periodic", 47999);
  c3.apply_override("transport.address=\"switch.local\"");
  CHECK_THROWS_WITH_AS(gossip::make_switch_transport(c3, 0, 2),
                       "--set transport.address=\"switch.local\": key 'address' must be an IPv4 address such as 10.77.0.1 (the switch "
                       "protocol runs over IPv4), got 'switch.local'",
                       gossip::config_error);
  auto c4 = switch_config("periodic", 47999);
  c4.apply_override("transport.bind=\"::1\"");
  CHECK_THROWS_WITH_AS(gossip::make_switch_transport(c4, 0, 2), doctest::Contains("key 'bind' must be an IPv4 address"), gossip::config_error);
  CHECK(gossip::switch_mode("auto", "periodic") == "sync");
  CHECK(gossip::switch_mode("auto", "drift-lr") == "async");
  CHECK(gossip::switch_mode("auto", "consensus") == "sync");
  CHECK(gossip::switch_mode("sync", "drift") == "sync");
  CHECK(gossip::switch_mode("auto", "periodic", /*staggered=*/true) == "async");
  // Timeouts past what a clock deadline holds.
  auto c5 = switch_config("periodic", 47999);
  c5.apply_override("transport.timeout_s=1e10");
  CHECK_THROWS_WITH_AS(gossip::make_switch_transport(c5, 0, 2), doctest::Contains("key 'timeout_s' must be a number > 0 and at most 31536000 (a year)"),
                       gossip::config_error);
  // Both group keys are checked, whichever the mode uses.
  auto c6 = switch_config("periodic", 47999);  // sync
  c6.apply_override("transport.async_group=70000");
  CHECK_THROWS_WITH_AS(gossip::make_switch_transport(c6, 0, 2), doctest::Contains("key 'async_group' must be in -1..65535, got 70000"),
                       gossip::config_error);
}

TEST_CASE("a sync group fixed to the model's size: the workers stop at the round's small all-reduce, told to drop elements=") {
  using gossip::sw::group_config, gossip::sw::group_mode;
  udp_aggregator agg({group_config{.id = 1, .mode = group_mode::sync, .members = 2, .chunk = 64, .slots = 16, .elements = 1000}});
  const auto cfg = switch_config("periodic", agg.port());
  const auto start = std::chrono::steady_clock::now();
  gossip::test::run_ranks(2, [&](int r) {
    std::vector<float> x(1000, static_cast<float>(r));
    gossip::model_view view;
    view.add("w", x);
    gossip::engine e(view, r, 2, cfg, gossip::make_switch_transport(cfg, r, 2));
    CHECK_THROWS_WITH_AS(
        for (int s = 0; s < 100; ++s) e.step(),
        doctest::Contains("takes all-reduces of any size (each round adds a small all-reduce of the members' drift, steps and model "
                          "sizes): start it without elements= (or with elements=0)"),
        gossip::config_error);
  });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

TEST_CASE("mode sync with a policy that decides on each member alone is refused: its all-reduces would never pair up") {
  for (const char* policy : {"drift", "budget", "adacomm"}) {
    CAPTURE(policy);
    auto cfg = switch_config(policy, 47999);
    cfg.apply_override("transport.mode=\"sync\"");
    CHECK_THROWS_WITH_AS((void)gossip::engine_spec::from(cfg),
                         doctest::Contains(fmt::format("--set transport.mode=\"sync\": mode 'sync' needs every member to send at the same "
                                                       "steps, but policy '{}' decides on each member from its own drift or loss", policy)
                                               .c_str()),
                         gossip::config_error);
    auto automatic = switch_config(policy, 47999);
    CHECK(gossip::engine_spec::from(automatic).protocol.opts.string("mode") == "async");
  }
}

TEST_CASE("the switch mode may be named in [transport] or [protocol]: the other follows; both named and different is refused") {
  for (const char* section : {"transport", "protocol"}) {
    CAPTURE(section);
    auto cfg = switch_config("periodic", 47999);  // [protocol] mode = "auto"
    cfg.apply_override(fmt::format("{}.mode=\"async\"", section));
    CHECK(gossip::engine_spec::from(cfg).protocol.opts.string("mode") == "async");
    CHECK_NOTHROW(gossip::make_switch_transport(cfg, 0, 2));
  }
  for (const char* section : {"transport", "protocol"}) {  // a misspelt mode is not taken for auto
    auto typo = switch_config("periodic", 47999);
    typo.apply_override(fmt::format("{}.mode=\"aync\"", section));
    const auto message = fmt::format("--set {}.mode=\"aync\": key 'mode' must be auto, sync or async, got 'aync'", section);
    CHECK_THROWS_WITH_AS((void)gossip::engine_spec::from(typo), message.c_str(), gossip::config_error);
    CHECK_THROWS_WITH_AS(gossip::make_switch_transport(typo, 0, 2), message.c_str(), gossip::config_error);
  }
  auto cfg = switch_config("periodic", 47999, "sync");
  cfg.apply_override("transport.mode=\"async\"");
  CHECK_THROWS_WITH_AS(gossip::make_switch_transport(cfg, 0, 2),
                       "--set transport.mode=\"async\" and test [protocol]: [transport] mode 'async' and [protocol] mode 'sync' disagree; set both to the "
                       "same, or set one only (the other follows it)",
                       gossip::config_error);
}

TEST_CASE("sync: members that differ in model, chunk or steps stop at the first round that shows it, told which rank, before any model is mixed") {
  using gossip::sw::group_config, gossip::sw::group_mode;
  // Each member's error, and whether its model was left as it was.
  auto run = [](const std::function<void(int, gossip::config&, std::vector<std::vector<float>>&)>& shape, int steps) {
    udp_aggregator agg({group_config{.id = 1, .mode = group_mode::sync, .members = 2, .chunk = 64, .slots = 16}});
    std::vector<std::string> what(2);
    std::vector<char> untouched(2);  // (not vector<bool>: both ranks write at once)
    const auto start = std::chrono::steady_clock::now();
    gossip::test::run_ranks(2, [&](int r) {
      auto cfg = switch_config("periodic", agg.port());
      std::vector<std::vector<float>> tensors{std::vector<float>(1000)};
      shape(r, cfg, tensors);
      gossip::model_view view;
      for (std::size_t t = 0; t < tensors.size(); ++t) {
        std::iota(tensors[t].begin(), tensors[t].end(), static_cast<float>(1000 * r));
        view.add(fmt::format("t{}", t), tensors[t]);
      }
      const auto before = tensors;
      gossip::engine e(view, r, 2, cfg, gossip::make_switch_transport(cfg, r, 2));
      try {
        for (int s = 0; s < steps; ++s) e.step();
        e.finish(0);
      } catch (const gossip::config_error& err) {
        what[static_cast<std::size_t>(r)] = err.what();
      }
      untouched[static_cast<std::size_t>(r)] = tensors == before;
    });
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));  // at once, not after timeout_s (20 s)
    return std::pair{what, untouched};
  };
  SUBCASE("model size") {
    const auto [what, untouched] = run([](int r, gossip::config&, auto& t) { t[0].resize(r == 0 ? 1000 : 1010); }, 5);
    CHECK(what[0].find("switch transport (rank 0): rank 1's model has 1010 float32 values, this rank's 1000 (group 1 of the switch at "
                       "127.0.0.1:") != std::string::npos);
    CHECK(what[1].find("rank 0's model has 1000 float32 values, this rank's 1010") != std::string::npos);
    CHECK((untouched[0] && untouched[1]));
  }
  SUBCASE("tensors") {
    const auto [what, untouched] = run([](int r, gossip::config&, auto& t) {
      if (r == 1) t = {std::vector<float>(400), std::vector<float>(600)};
    }, 5);
    for (const auto& w : what) CHECK(w.find("'s model has the same 1000 float32 values as this rank's in other tensors") != std::string::npos);
    CHECK((untouched[0] && untouched[1]));
  }
  SUBCASE("chunk") {
    const auto [what, untouched] = run([](int r, gossip::config& cfg, auto&) {
      if (r == 1) cfg.apply_override("transport.chunk=32");
    }, 5);
    CHECK(what[0].find("rank 1 sends 32 values a packet, this rank 64") != std::string::npos);
    CHECK(what[1].find("give every member the same [transport] chunk") != std::string::npos);
    CHECK((untouched[0] && untouched[1]));
  }
  SUBCASE("period") {
    const auto [what, untouched] = run([](int r, gossip::config& cfg, auto&) {
      cfg.apply_override(r == 0 ? "policy.every=2" : "policy.every=3");
    }, 40);
    for (const auto& w : what) {
      CAPTURE(w);
      CHECK(w.find("posted this all-reduce at step") != std::string::npos);
      CHECK(w.find("every member must post at the same steps") != std::string::npos);
    }
  }
}

TEST_CASE("sync: members that trained different numbers of steps pair the rounds finish() forces") {
  udp_aggregator agg({gossip::sw::group_config{.id = 1, .mode = gossip::sw::group_mode::sync, .members = 2, .chunk = 64, .slots = 16}});
  auto cfg = switch_config("periodic", agg.port());
  cfg.apply_override("policy.every=10");
  std::vector<std::vector<float>> finals(2);
  gossip::test::run_ranks(2, [&](int r) {
    std::vector<float> x(300, static_cast<float>(3 * r));
    gossip::model_view view;
    view.add("w", x);
    gossip::engine e(view, r, 2, cfg, gossip::make_switch_transport(cfg, r, 2));
    for (int s = 0; s < (r == 0 ? 12 : 15); ++s) e.step();  // the same rounds (steps 0 and 10), then 2 and 5 steps more
    e.finish(2);
    finals[static_cast<std::size_t>(r)] = x;
  });
  CHECK(finals[0] == finals[1]);
  CHECK(finals[0][0] == 1.5f);
}

TEST_CASE("async: a rank whose operation failed still leaves the group, and its engine's destruction never throws") {
  using gossip::sw::group_config, gossip::sw::group_mode;
  SUBCASE("a refused delta: the chunks applied before the refusal leave S with the member") {
    // The group holds 512 floats; this member's 500 end mid-chunk: chunks 0..6
    // of its first delta are applied, chunk 7 is refused.
    udp_aggregator agg({group_config{.id = 1, .mode = group_mode::async, .members = 2, .chunk = 64, .elements = 512}});
    auto cfg = switch_config("periodic", agg.port(), "async");  // a delta every step
    gossip::test::run_ranks(1, [&](int) {
      std::vector<float> x(500, 10.0f);
      gossip::model_view view;
      view.add("w", x);
      {
        gossip::engine e(view, 1, 2, cfg, gossip::make_switch_transport(cfg, 1, 2));
        // Steps until the refusal is rethrown (bounded: 10 s; the transport's timeout is 20 s).
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        CHECK_THROWS_AS(
            while (std::chrono::steady_clock::now() < until) {
              e.step();
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
            },
            gossip::config_error);
        CHECK(agg.live_sum(1).second == 1);
      }  // destroyed: leaves
      const auto [sum, joined] = agg.live_sum(1);
      CHECK(joined == 0);
      for (float v : sum) REQUIRE(v == 0.0f);
    });
  }
  SUBCASE("a leave the switch refuses (it serves other groups now): finish() says so, the destructor does not throw") {
    for (bool finish : {true, false}) {
      CAPTURE(finish);
      udp_aggregator agg({group_config{.id = 1, .mode = group_mode::async, .members = 2, .chunk = 64, .elements = 256}});
      const auto cfg = switch_config("periodic", agg.port(), "async");
      gossip::test::run_ranks(1, [&](int) {
        std::vector<float> x(256, 1.0f);
        gossip::model_view view;
        view.add("w", x);
        gossip::engine e(view, 0, 2, cfg, gossip::make_switch_transport(cfg, 0, 2));
        e.step();
        e.flush();
        agg.restart({group_config{.id = 2, .mode = group_mode::async, .members = 2, .chunk = 64, .elements = 256}});
        if (finish) CHECK_THROWS_WITH_AS(e.finish(0), doctest::Contains("it serves no group 1"), gossip::config_error);
      });  // without finish(): ~engine abandons, and the refused leave is not thrown out of it
    }
  }
}

TEST_CASE("a switch transport moved over an attached one stops the attached one's thread first") {
  auto cfg = switch_config("periodic", 47999);
  auto t = gossip::make_switch_transport(cfg, 0, 2);
  const std::vector<int> sources{1};
  gossip::inbox in(sources, 4, 4096);
  gossip::transport_setup s;
  s.rank = 0;
  s.world = 2;
  s.inbox = &in;
  s.sources = sources;
  s.targets = sources;
  s.layout.push_back(gossip::layout_entry{});
  s.layout.back().count = 100;
  t.attach(s);
  t = gossip::make_switch_transport(cfg, 0, 2);  // terminate() if the running thread were dropped
  CHECK(t.counters().bytes_sent == 0);
}

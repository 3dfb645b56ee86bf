#pragma once
/// The loopback transport: ranks as threads of one process.
///
///     gossip::loopback_fabric fabric(4, {.bandwidth_gbps = 1.0, .latency_us = 50});
///     // in thread r:
///     gossip::engine e(model, r, 4, cfg, fabric.endpoint(r));
///
/// It is deterministic: a message posted by rank j at its step s is merged by
/// the receiver at exactly its step s + 1, whatever the thread timing. To keep
/// that promise the receiver waits (bounded) until each of its sources has
/// finished step s, and a sender waits until the receiver has freed the inbox
/// slot it is about to fill — synchronous rounds, as in D-PSGD.
///
/// With link emulation, each rank has one NIC of `bandwidth_gbps` that
/// serialises its sends; a message becomes visible `latency_us` after its last
/// byte left, and the receiver waits for it. Communication time is then paid
/// on the training threads exactly as on a real network of that speed, so
/// experiments can model a 1 Gbit/s commodity cluster on one machine.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gossip/config.hpp"
#include "gossip/error.hpp"
#include "gossip/transport.hpp"
#include "gossip/wait.hpp"

namespace gossip {

struct link_emulation {
  double bandwidth_gbps = 0;  ///< 0: unlimited, else at least 0.001 (1 Mbit/s)
  double latency_us = 0;      ///< at most 1e7 (10 s)

  /// A message's emulated delay is waited out whatever the engine's timeout,
  /// so the settings are bounded: a config_error naming `where` (for each
  /// key, as `where(key)` gives it) otherwise. attach() refuses a latency
  /// longer than the engine's timeout, and post() a message whose wire time
  /// alone exceeds it (config_error, thrown out of the engine's step: the
  /// run cannot go on as configured, and its peers see this rank leave).
  template <class Where>
  void check(const Where& where) const {
    if (!(bandwidth_gbps == 0 || (bandwidth_gbps >= 1e-3 && bandwidth_gbps <= 1e6)))
      throw config_error(fmt::format("{}: key 'bandwidth_gbps' of transport 'loopback' must be 0 (not emulated) or in [0.001, 1e6] Gbit/s, "
                                     "got {}",
                                     where("bandwidth_gbps"), bandwidth_gbps));
    if (!(latency_us >= 0 && latency_us <= 1e7))
      throw config_error(fmt::format("{}: key 'latency_us' of transport 'loopback' must be in [0, 1e7] microseconds (0: not emulated), got {}",
                                     where("latency_us"), latency_us));
  }
  /// From a config's [transport] with name "loopback": keys checked against
  /// loopback_option_specs() (environment overrides included), ranges as check().
  static link_emulation from(const component_config& transport) {
    if (transport.name != "loopback")
      throw config_error(fmt::format("{}: transport '{}' was configured, but this program runs its ranks as threads over the loopback "
                                     "transport; set name = \"loopback\" or leave [transport] out",
                                     transport.opts.where("name"), transport.name));
    const auto o = transport.opts.resolved(loopback_option_specs(), "transport 'loopback'");
    const link_emulation link{.bandwidth_gbps = o.real("bandwidth_gbps"), .latency_us = o.real("latency_us")};
    link.check([&](std::string_view key) { return o.where(key); });
    return link;
  }
};

namespace detail {

struct loopback_rank {
  std::atomic<std::int64_t> posted{-1};  // last step whose sends are all posted
  std::atomic<std::int64_t> merged{-1};  // last step whose inbound messages were merged
  std::atomic<bool> claimed{false};      // an engine's transport owns this rank (attach() got past its checks)
  std::atomic<bool> attached{false};
  std::atomic<bool> departed{false};     // left, or killed
  std::atomic<bool> killed{false};
  // 0 running, 1 settling, 2 settled: a departed rank has stopped its
  // writers and filled `unmerged`, and its peers report it then.
  std::atomic<int> phase{0};
  std::vector<double> unmerged;          // by source rank: weight of its messages left in the inbox when this rank left
  std::atomic<int> writers{0};
  gossip::inbox* in = nullptr;
  model_layout layout;
  std::uint64_t config_fingerprint = 0;
  std::string config_settings;
  std::uint64_t model_fingerprint = 0;
  std::atomic<std::uint64_t> bytes_received{0}, messages_received{0};
};

struct loopback_shared {
  explicit loopback_shared(int world, link_emulation l) : ranks(static_cast<std::size_t>(world)), link(l) {
    for (auto& r : ranks) r.unmerged.assign(static_cast<std::size_t>(world), 0.0);
  }
  std::vector<loopback_rank> ranks;
  link_emulation link;
};

}  // namespace detail

class loopback_transport {
 public:
  loopback_transport(std::shared_ptr<detail::loopback_shared> shared, int rank) : m_shared(std::move(shared)), m_rank(rank) {}
  loopback_transport(loopback_transport&& o) noexcept { *this = std::move(o); }
  loopback_transport& operator=(loopback_transport&& o) noexcept {
    if (this != &o) {
      depart();
      m_shared = std::move(o.m_shared);
      m_rank = o.m_rank;
      m_owner = std::exchange(o.m_owner, false);
      m_setup = std::move(o.m_setup);
      m_neighbours = std::move(o.m_neighbours);
      m_reported = std::move(o.m_reported);
      m_nic_free = o.m_nic_free;
      m_counters = o.m_counters;
    }
    return *this;
  }
  ~loopback_transport() { depart(); }

  void attach(const transport_setup& s) {
    GOSSIP_ASSERT(s.inbox != nullptr, "loopback: attach without an inbox");
    const int world = static_cast<int>(m_shared->ranks.size());
    if (s.world != world)
      throw config_error(fmt::format("loopback: rank {} was built for a world of {} ranks but the fabric has {}", s.rank, s.world, world));
    if (s.rank != m_rank)
      throw config_error(fmt::format("loopback: endpoint of rank {} attached as rank {}", m_rank, s.rank));
    auto& me = self();
    // Its peers have seen this rank leave and count it out for good.
    if (me.departed.load())
      throw config_error(fmt::format("loopback: rank {}'s endpoint belonged to an engine that has left (it finished, failed or was "
                                     "destroyed), and its peers count it out; a loopback_fabric serves one run: build a new fabric, "
                                     "and new engines on every rank, to train again",
                                     m_rank));
    // Latency alone longer than the timeout fails every message: said now, not at the first send.
    if (m_shared->link.latency_us * 1e-6 > s.timeout.count())
      throw config_error(fmt::format("loopback (rank {}): the emulated latency ({} µs) is longer than the engine's timeout ({} s, [engine] "
                                     "timeout_s); lower latency_us or raise timeout_s",
                                     s.rank, m_shared->link.latency_us, s.timeout.count()));
    // Claimed once checks no peer needs have passed: an engine refused
    // before here (or one given another rank's endpoint) leaves the rank to
    // the engine that owns it, or free for one built again.
    if (bool free = false; !me.claimed.compare_exchange_strong(free, true))
      throw config_error(fmt::format("loopback: rank {} is attached twice (two engines on one endpoint of a loopback_fabric); give each "
                                     "engine its own rank's endpoint",
                                     m_rank));
    m_owner = true;
    m_setup = s;
    me.in = s.inbox;
    me.layout = s.layout;
    me.config_fingerprint = s.config_fingerprint;
    me.config_settings = s.config_settings;
    me.model_fingerprint = me.killed.load() ? 0 : s.model_fingerprint;  // killed before attaching: neighbours may have skipped it
    me.attached.store(true, std::memory_order_release);

    m_neighbours = s.sources;
    for (int t : s.targets)
      if (std::find(m_neighbours.begin(), m_neighbours.end(), t) == m_neighbours.end()) m_neighbours.push_back(t);
    std::sort(m_neighbours.begin(), m_neighbours.end());
    m_reported.assign(m_shared->ranks.size(), 0);

    // Connect: wait for every neighbour, then compare layouts and configs.
    for (int j : m_neighbours) {
      auto& p = peer(j);
      detail::wait_for([&] { return p.attached.load(std::memory_order_acquire) || p.departed.load(); }, s.timeout,
                       [&] { return fmt::format("rank {} to attach to the loopback fabric (rank {} connecting)", j, m_rank); });
      if (p.departed.load() && !p.attached.load()) continue;
      // Layout and fingerprint are copies in the fabric: valid after the peer left.
      check_layouts(me.layout, m_rank, p.layout, j);
      if (p.config_fingerprint != me.config_fingerprint)
        throw settings_mismatch(fmt::format("rank {}", m_rank), fmt::format("rank {}", j), me.config_fingerprint, p.config_fingerprint,
                                me.config_settings, p.config_settings);
      if (std::find(s.targets.begin(), s.targets.end(), j) == s.targets.end()) continue;
      // The peer's inbox is read as a writer would: a peer that departs (its
      // engine failed to build, or it left) frees it only once its depart()
      // has seen no writer. A departed peer is dead to this rank, not checked.
      p.writers.fetch_add(1);
      struct reader_scope {
        std::atomic<int>& n;
        ~reader_scope() { n.fetch_sub(1); }
      } reading{p.writers};
      if (!p.departed.load() && p.in->index_of(m_rank) < 0)
        throw config_error(fmt::format("rank {} may send to rank {}, but rank {} does not expect messages from it; "
                                       "every rank must use the same topology", m_rank, j, j));
    }
  }

  post_status post(int to, std::span<const std::byte> msg, std::uint64_t step) {
    auto& p = peer(to);
    if (p.departed.load()) {
      ++m_counters.dropped;
      return post_status::peer_dead;
    }
    // The slot for `step` last held the message of step − 2, which the peer
    // merges at its step − 1: wait until it has.
    const auto need = static_cast<std::int64_t>(step) - 1;
    detail::wait_for([&] { return p.merged.load(std::memory_order_acquire) >= need || p.departed.load(); }, m_setup.timeout,
                     [&] { return fmt::format("rank {} to merge step {} before rank {} can send to it", to, need, m_rank); });
    // Counted as a writer until this function returns, also when a check
    // below throws: the peer's leave() waits for its writers to finish.
    p.writers.fetch_add(1);
    struct writer_scope {
      std::atomic<int>& n;
      ~writer_scope() { n.fetch_sub(1); }
    } writing{p.writers};
    if (p.departed.load()) {
      ++m_counters.dropped;
      return post_status::peer_dead;
    }
    const int idx = p.in->index_of(m_rank);
    GOSSIP_ASSERT(idx >= 0, "rank {} is not a source of rank {}", m_rank, to);
    GOSSIP_ASSERT(msg.size() <= p.in->message_bytes(), "message of {} bytes exceeds the inbox slot of {}", msg.size(), p.in->message_bytes());
    auto& slot = p.in->at(static_cast<std::size_t>(idx), step);
    GOSSIP_ASSERT(slot.state.load(std::memory_order_acquire) == inbox::empty, "rank {} inbox slot for rank {} still full at step {}", to, m_rank, step);
    // The emulated delay is waited out whatever the engine's timeout: a
    // message longer on the wire than any wait may last is refused, not sent.
    if (const auto& link = m_shared->link; link.bandwidth_gbps > 0 || link.latency_us > 0) {
      const double wire_s =
          (link.bandwidth_gbps > 0 ? static_cast<double>(msg.size()) * 8.0 / (link.bandwidth_gbps * 1e9) : 0.0) + link.latency_us * 1e-6;
      if (wire_s > m_setup.timeout.count())
        throw config_error(fmt::format("loopback (rank {}): a message of {} bytes would spend {:.1f} s on the emulated link ({} Gbit/s, {} µs), "
                                       "longer than the engine's timeout ({} s, [engine] timeout_s); raise bandwidth_gbps, lower latency_us "
                                       "or raise timeout_s",
                                       m_rank, msg.size(), wire_s, link.bandwidth_gbps, link.latency_us, m_setup.timeout.count()));
    }
    std::memcpy(slot.data, msg.data(), msg.size());
    slot.bytes = msg.size();
    slot.ready_at = arrival(msg.size());
    slot.state.store(inbox::full, std::memory_order_release);
    p.bytes_received.fetch_add(msg.size(), std::memory_order_relaxed);
    p.messages_received.fetch_add(1, std::memory_order_relaxed);
    m_counters.bytes_sent += msg.size();
    ++m_counters.messages_sent;
    return post_status::ok;
  }

  std::size_t collect(std::uint64_t step, std::span<received> out) {
    if (step == 0) return 0;
    const std::uint64_t from = step - 1;
    auto* in = self().in;
    std::size_t n = 0;
    for (std::size_t i = 0; i < in->sources().size(); ++i) {
      const int j = in->sources()[i];
      auto& p = peer(j);
      detail::wait_for(
          [&] { return p.posted.load(std::memory_order_acquire) >= static_cast<std::int64_t>(from) || p.departed.load(); },
          m_setup.timeout, [&] { return fmt::format("rank {} to finish step {} (rank {} merges it at step {})", j, from, m_rank, step); });
      auto& slot = in->at(i, from);
      if (slot.state.load(std::memory_order_acquire) != inbox::full) continue;
      wire_header h;
      std::memcpy(&h, slot.data, sizeof h);
      GOSSIP_ASSERT(h.step == from && h.sender == j, "rank {} inbox slot from rank {} holds step {} of rank {}, expected step {}", m_rank, j, h.step, h.sender, from);
      if (slot.ready_at > std::chrono::steady_clock::now()) std::this_thread::sleep_until(slot.ready_at);
      GOSSIP_ASSERT(n < out.size(), "collect: output span too small");
      out[n++] = received{j, h.step, h.weight, reinterpret_cast<const float*>(slot.data + sizeof(wire_header)),
                          h.payload_bytes / sizeof(float)};
    }
    return n;
  }

  void release(std::uint64_t step) {
    auto& me = self();
    if (step > 0)
      for (std::size_t i = 0; i < me.in->sources().size(); ++i) me.in->at(i, step - 1).state.store(inbox::empty, std::memory_order_release);
    me.merged.store(static_cast<std::int64_t>(step), std::memory_order_release);
  }

  void end_step(std::uint64_t step) { self().posted.store(static_cast<std::int64_t>(step), std::memory_order_release); }
  bool busy(const std::byte*) const noexcept { return false; }
  void flush(std::chrono::duration<double>) noexcept {}
  /// Graceful departure: first wait (bounded) until every live source has
  /// posted our last step, so what they send us is delivered — and counted —
  /// the same way whatever the thread timing; then stop being waited for.
  void leave() {
    if (!m_shared || !m_owner) return;
    auto& me = self();
    if (me.in && !me.departed.load()) wait_for_sources(me.posted.load());
    depart(true);
  }

  /// Before leave(): stops being written to (a later post to this rank is
  /// refused, and its sender keeps its share) after the same bounded wait as
  /// leave(), and hands the engine the messages still in its inbox, at most
  /// out.size() per call, emptying their slots: merged here, their push-sum
  /// mass leaves with this rank rather than going back to the senders at
  /// whatever their models have become since (which would not be exact).
  std::size_t leftovers(std::span<received> out) {
    if (!m_shared || !m_owner || !self().in) return 0;
    auto& me = self();
    if (!me.departed.load()) {
      wait_for_sources(me.posted.load());
      me.departed.store(true);
      while (me.writers.load() != 0) std::this_thread::yield();
    }
    std::size_t n = 0;
    for (std::size_t i = 0; i < me.in->sources().size() && n < out.size(); ++i)
      for (std::size_t k = 0; k < me.in->depth() && n < out.size(); ++k) {
        auto& slot = me.in->at(i, k);
        if (slot.state.load(std::memory_order_acquire) != inbox::full) continue;
        slot.state.store(inbox::empty, std::memory_order_release);
        if (slot.bytes < sizeof(wire_header)) continue;
        wire_header h;
        std::memcpy(&h, slot.data, sizeof h);
        if (slot.ready_at > std::chrono::steady_clock::now()) std::this_thread::sleep_until(slot.ready_at);
        out[n++] = received{me.in->sources()[i], h.step, h.weight, reinterpret_cast<const float*>(slot.data + sizeof(wire_header)),
                            h.payload_bytes / sizeof(float)};
      }
    return n;
  }

  /// The engine goes without finish() (an error, or destroyed early): its
  /// peers count this rank failed, as fabric.kill() makes them, not departed.
  /// Either way the messages of its sources left unmerged in its inbox give
  /// their push-sum weight back to those sources (dead_peers()).
  void abandon() noexcept {
    if (!m_shared || !m_owner) return;
    if (!self().departed.load()) self().killed.store(true);
    depart(true);
  }

  transport_capabilities capabilities() const noexcept {
    return {.deterministic = true, .copies_on_post = true, .emulates_network = m_shared->link.bandwidth_gbps > 0 || m_shared->link.latency_us > 0,
            .name = "loopback"};
  }

  std::size_t dead_peers(std::span<received> out) {
    std::size_t n = 0;
    for (int j : m_neighbours) {
      auto& p = peer(j);
      if (m_reported[static_cast<std::size_t>(j)] || !p.departed.load(std::memory_order_acquire) || p.phase.load(std::memory_order_acquire) != 2)
        continue;
      if (n == out.size()) break;
      m_reported[static_cast<std::size_t>(j)] = 1;
      // The weight of this rank's messages that it never merged comes back
      // (a rank killed by fabric.kill() gives none back). A rank that left
      // on its own (not killed) finished normally: departed, not a failure.
      out[n++] = received{.sender = j, .weight = p.unmerged[static_cast<std::size_t>(m_rank)], .departed = !p.killed.load(std::memory_order_acquire)};
    }
    return n;
  }

  transport_counters counters() const noexcept {
    transport_counters c = m_counters;
    if (m_shared) {
      const auto& me = m_shared->ranks[static_cast<std::size_t>(m_rank)];
      c.bytes_received = me.bytes_received.load();
      c.messages_received = me.messages_received.load();
    }
    return c;
  }

  /// The model fingerprint neighbour `j` attached with (0: none, or it never attached).
  std::uint64_t peer_model(int j) const noexcept {
    if (!m_shared || j < 0 || j >= static_cast<int>(m_shared->ranks.size())) return 0;
    const auto& p = m_shared->ranks[static_cast<std::size_t>(j)];
    return p.attached.load(std::memory_order_acquire) ? p.model_fingerprint : 0;
  }

 private:
  detail::loopback_rank& self() noexcept { return m_shared->ranks[static_cast<std::size_t>(m_rank)]; }
  detail::loopback_rank& peer(int j) noexcept { return m_shared->ranks[static_cast<std::size_t>(j)]; }

  // Bounded: until every live source has posted step `last`.
  void wait_for_sources(std::int64_t last) {
    for (int j : self().in->sources()) {
      auto& p = peer(j);
      try {
        detail::wait_for([&] { return p.posted.load(std::memory_order_acquire) >= last || p.departed.load(); }, m_setup.timeout,
                         [&] { return fmt::format("rank {} to finish step {} before rank {} leaves", j, last, m_rank); });
      } catch (const timeout_error&) {
        return;  // leaving anyway; the peer will see us gone
      }
    }
  }

  std::chrono::steady_clock::time_point arrival(std::size_t bytes) noexcept {
    const auto now = std::chrono::steady_clock::now();
    const auto& link = m_shared->link;
    if (link.bandwidth_gbps <= 0 && link.latency_us <= 0) return now;
    const auto start = std::max(now, m_nic_free);
    const double wire_s = link.bandwidth_gbps > 0 ? static_cast<double>(bytes) * 8.0 / (link.bandwidth_gbps * 1e9) : 0.0;
    m_nic_free = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(wire_s));
    return m_nic_free + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(link.latency_us * 1e-6));
  }

  // Peers stop waiting for us; wait out any writer still copying into our inbox,
  // since the inbox belongs to an engine that is about to go away.
  // Stops being written to. With `give_back` (leave(), abandon(): the
  // engine's inbox is still there) it first sums, per source, the weight of
  // the messages left in the inbox unmerged; then peers may report it.
  void depart(bool give_back = false) noexcept {
    if (!m_shared || !m_owner) return;  // the rank is another engine's, or nobody's yet
    auto& me = self();
    me.departed.store(true);
    while (me.writers.load() != 0) std::this_thread::yield();
    if (int running = 0; !me.phase.compare_exchange_strong(running, 1)) return;  // settled already (or by fabric.kill())
    if (give_back && me.in)
      for (std::size_t i = 0; i < me.in->sources().size(); ++i)
        for (std::size_t k = 0; k < me.in->depth(); ++k)
          if (auto& slot = me.in->at(i, k); slot.state.load(std::memory_order_acquire) == inbox::full && slot.bytes >= sizeof(wire_header)) {
            wire_header h;
            std::memcpy(&h, slot.data, sizeof h);
            if (std::isfinite(h.weight) && h.weight > 0) me.unmerged[static_cast<std::size_t>(me.in->sources()[i])] += h.weight;
          }
    me.phase.store(2, std::memory_order_release);
  }

  std::shared_ptr<detail::loopback_shared> m_shared;
  int m_rank = 0;
  bool m_owner = false;  // this endpoint's attach() claimed the rank
  transport_setup m_setup;
  std::vector<int> m_neighbours;
  std::vector<char> m_reported;
  std::chrono::steady_clock::time_point m_nic_free{};
  transport_counters m_counters;
};
static_assert(transport<loopback_transport>);

/// N ranks in one process; hands out one endpoint per rank.
class loopback_fabric {
 public:
  explicit loopback_fabric(int world, link_emulation link = {}) {
    if (world < 1) throw config_error(fmt::format("loopback_fabric: world size must be >= 1, got {}", world));
    link.check([](std::string_view) { return std::string("loopback_fabric"); });
    m_shared = std::make_shared<detail::loopback_shared>(world, link);
  }
  loopback_transport endpoint(int rank) const {
    if (rank < 0 || rank >= world()) throw config_error(fmt::format("loopback_fabric: rank {} is outside the world of {}", rank, world()));
    return {m_shared, rank};
  }
  /// Simulates the crash of `rank`: its peers stop waiting for it, drop what
  /// they would send it, and report it through dead_peers().
  void kill(int rank) {
    auto& r = m_shared->ranks.at(static_cast<std::size_t>(rank));
    r.killed.store(true);
    r.departed.store(true);
    // A crash gives nothing back; a rank settling on its own finishes first.
    if (int running = 0; !r.phase.compare_exchange_strong(running, 2)) return;
  }
  int world() const noexcept { return static_cast<int>(m_shared->ranks.size()); }
  const link_emulation& link() const noexcept { return m_shared->link; }

 private:
  std::shared_ptr<detail::loopback_shared> m_shared;
};

}  // namespace gossip

#pragma once
/// The switch transport: the client side of gossip-switch (or of its kernel-UDP
/// twin gossip-switch-udp), over kernel UDP sockets.
///
///     # run.toml
///     [policy]
///     name = "drift"              # → async mode; "periodic" and "consensus" → sync mode
///     [topology]
///     name = "switch"
///     [protocol]
///     name = "switch-aggregate"
///     [transport]
///     name = "switch"
///     address = "10.77.0.1"
///     group = 1
///
///     auto cfg = gossip::config::load("run.toml");
///     gossip::engine e(model, rank, world, cfg, gossip::make_switch_transport(cfg, rank, world));
///
/// Every rank is member `rank` of switch group `group`, which must be
/// configured on the switch with `members = world` — in async mode also with
/// `elements` = the model's float32 count. `sync_group` / `async_group` pick a
/// group per mode instead, so one config serves periodic and adaptive runs
/// (bench/traffic runs both against one switch).
///
/// Runs reuse groups: each transport is a new session of its member at the
/// switch (see transports/switch/aggregator.hpp). In async mode leave() (the
/// engine's finish) takes this member's model out of the switch's S, so the
/// next run starts from an empty aggregate; a rank that dies without leaving
/// is replaced when its id joins again. If the switch is restarted during an
/// async run, each member's next delta is answered async_rejoin and the
/// member joins again with everything it had sent (rejoins() counts it); the
/// run goes on. A sync all-reduce cut by a restart cannot be completed (the
/// switch lost the partial sums some members already moved past) and fails
/// after timeout_s with an error naming the switch.
///
/// post() queues the send buffer for a progress thread and returns; the
/// buffer stays busy() until every chunk is answered (async: every buffer,
/// until the reply was merged too — one delta in flight per member). The thread runs one
/// operation at a time: sync — an all-reduce of the model, whose mean lands in
/// the engine's inbox; async — S += delta at the switch, whose reply S/n
/// lands there. collect() returns completed replies (sender −1: the switch).
/// In sync mode collect(step) first waits (bounded) for the all-reduce posted
/// at step − 1, so a periodic run mixes at the same steps on every rank; in
/// async mode it never waits. A sync round is two all-reduces. The first is
/// small: the members' values from their message headers (the engine's
/// relative drift² at the send), whose group mean the reply carries as its
/// weight (signal::group_drift_sq: the pace a shared schedule follows), and
/// what the members must share: each one's step, model size, tensor layout
/// and chunk. A member whose model or chunk differs from this rank's, or
/// that posted at another step (the all-reduces of a group pair up in
/// order: a period that differs would mix models of different steps), stops
/// the run on every member with an error naming it, before any model is
/// mixed (the rounds finish() forces are not held to the step). The second
/// all-reduce is the model. Errors of the thread (a timeout naming the
/// switch and group) are rethrown by the next post() or collect().
#include <arpa/inet.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <system_error>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "gossip/config.hpp"
#include "gossip/error.hpp"
#include "gossip/protocol.hpp"
#include "gossip/topology.hpp"
#include "gossip/transport.hpp"
#include "gossip/wait.hpp"
#include "client.hpp"

namespace gossip {

/// [transport] settings for name = "switch".
inline const std::vector<option_spec>& switch_option_specs() {
  static const std::vector<option_spec> specs = {
      {"address", std::string("127.0.0.1"), "IPv4 address of gossip-switch (or gossip-switch-udp)", "GOSSIP_SWITCH_ADDRESS"},
      {"port", std::int64_t{sw::default_port}, "its UDP port (1..65535)", "GOSSIP_SWITCH_PORT"},
      {"group", std::int64_t{1}, "aggregation group id (configured on the switch with members = world)", "GOSSIP_SWITCH_GROUP"},
      {"sync_group", std::int64_t{-1}, "group for sync mode (-1: group)"},
      {"async_group", std::int64_t{-1}, "group for async mode, configured with elements = the model's size (-1: group)"},
      {"mode", std::string("auto"), "sync, async, or auto (periodic and consensus: sync; others: async)"},
      {"chunk", std::int64_t{sw::default_chunk}, fmt::format("float32 values per packet (the group's chunk; 1..{})", sw::max_chunk)},
      {"window", std::int64_t{128}, "packets in flight (sync: the group's slots; 1..4096)"},
      {"rto_ms", 5.0, "first retransmission timeout in milliseconds (doubles up to 200, or stays at rto_ms when larger)"},
      {"timeout_s", 30.0, "bound on one operation before the run fails"},
      {"bind", std::string("0.0.0.0"), "local IPv4 address to send from"},
  };
  return specs;
}

class switch_transport {
 public:
  struct settings {
    sw::client_config client;
    bool sync = false;
  };

  explicit switch_transport(settings s) : m_state(std::make_unique<state>()) { m_state->cfg = std::move(s); }
  switch_transport(switch_transport&&) noexcept = default;
  switch_transport& operator=(switch_transport&& o) noexcept {
    if (this != &o) {
      stop(/*cancel=*/true);  // as the destructor: a running thread is never dropped
      m_state = std::move(o.m_state);
    }
    return *this;
  }
  ~switch_transport() { stop(/*cancel=*/true); }

  void attach(const transport_setup& s) {
    auto& st = *m_state;
    if (!s.inbox || s.inbox->sources().empty())
      throw config_error(fmt::format("switch transport (rank {}): a group needs at least 2 members; use [topology] name = \"switch\"", s.rank));
    std::size_t elements = 0;
    for (const auto& t : s.layout) elements += t.count;
    st.elements = elements;
    st.world = s.world;
    st.rank = s.rank;
    st.inbox = s.inbox;
    // The client's own bound ([transport] timeout_s) gives the better
    // diagnosis (what it sent and heard): the engine's waits outlast it.
    st.timeout = std::max(s.timeout, std::chrono::duration<double>(st.cfg.client.timeout_s + 1.0));
    st.cfg.client.worker = static_cast<std::uint16_t>(s.rank);
    st.cfg.client.members = static_cast<std::uint16_t>(s.world);
    st.cfg.client.cancel = &st.cancel;
    st.cfg.client.mixed_sizes = st.cfg.sync;
    st.cfg.client.model_elements = elements;
    st.layout_fingerprint = s.layout_fingerprint;
    if (st.cfg.sync) {
      st.check.assign(1 + check_fields * static_cast<std::size_t>(s.world), 0.0f);
      st.check_sum.assign(st.check.size(), 0.0f);
    }
    st.client = std::make_unique<sw::client>(st.cfg.client);
    try {
      st.thread = std::thread([p = m_state.get()] { p->run(); });
    } catch (const std::system_error& e) {
      throw transport_error(fmt::format("switch transport (rank {}): cannot start its worker thread: {}; the process's thread or "
                                        "memory limit (ulimit -u, ulimit -v) is too low",
                                        s.rank, e.what()));
    }
  }

  post_status post(int, std::span<const std::byte> msg, std::uint64_t step) {
    auto& st = *m_state;
    st.rethrow();
    const auto head = st.head.load(std::memory_order_relaxed);
    if (head - st.tail.load(std::memory_order_acquire) == st.jobs.size()) return post_status::busy;
    wire_header h;
    std::memcpy(&h, msg.data(), sizeof h);
    GOSSIP_ASSERT(h.payload_bytes == st.elements * sizeof(float), "switch transport: payload of {} bytes, model of {} values", h.payload_bytes,
                  st.elements);
    st.jobs[head % st.jobs.size()] = {msg.data(), reinterpret_cast<const float*>(msg.data() + sizeof h), step};
    st.head.store(head + 1, std::memory_order_release);
    st.last_post_step = static_cast<std::int64_t>(step);
    st.last_post_op = head + 1;
    st.bytes_posted += msg.size();
    ++st.messages_posted;
    return post_status::ok;
  }

  std::size_t collect(std::uint64_t step, std::span<received> out) {
    auto& st = *m_state;
    if (st.cfg.sync && st.last_post_step >= 0 && static_cast<std::uint64_t>(st.last_post_step) + 1 == step) {
      const auto want = st.last_post_op;
      detail::wait_for([&] { return st.done.load(std::memory_order_acquire) >= want || st.failed.load(); }, st.timeout, [&] {
        return fmt::format(
            "the switch at {}:{} to finish the all-reduce of step {} (group {}, rank {} of {}); every member must post at the same "
            "steps: the same period, or for consensus the same learning rate reported to step() on every member",
            st.cfg.client.address, st.cfg.client.port, st.last_post_step, st.cfg.client.group, st.rank, st.world);
      });
    }
    st.rethrow();
    const auto done = st.done.load(std::memory_order_acquire);
    std::size_t n = 0;
    for (auto op = st.collected; op < done && n < out.size(); ++op) {
      auto& slot = st.inbox->at(0, op);
      if (slot.state.load(std::memory_order_acquire) != inbox::full) break;
      wire_header h;
      std::memcpy(&h, slot.data, sizeof h);
      out[n++] = received{-1, h.step, h.weight, reinterpret_cast<const float*>(slot.data + sizeof h), st.elements};
      st.to_release = op + 1;
    }
    return n;
  }

  void release(std::uint64_t) {
    auto& st = *m_state;
    for (; st.collected < st.to_release; ++st.collected) st.inbox->at(0, st.collected).state.store(inbox::empty, std::memory_order_release);
  }

  void end_step(std::uint64_t) noexcept {}

  bool busy(const std::byte* buffer) const noexcept {
    const auto& st = *m_state;
    const auto head = st.head.load(std::memory_order_relaxed);
    // Async: one delta in flight, and its reply merged before the next delta
    // is cut — every buffer is busy until then. The merge z += γ(m − x̂) is
    // right only with the x̂ of the send that m answers; a second delta sent
    // meanwhile would move x̂ and make the merge drop local progress.
    if (!st.cfg.sync) return st.tail.load(std::memory_order_acquire) != head || st.collected < st.done.load(std::memory_order_acquire);
    for (auto i = st.tail.load(std::memory_order_acquire); i < head; ++i)
      if (st.jobs[i % st.jobs.size()].buffer == buffer) return true;
    return false;
  }

  void flush(std::chrono::duration<double> timeout) {
    auto& st = *m_state;
    // (At least as long as the client's own bound, as collect's wait: its diagnosis says more.)
    detail::wait_for([&] { return st.tail.load() == st.head.load() || st.failed.load(); }, std::max(timeout, st.timeout), [&] {
      return fmt::format("the switch at {}:{} to answer rank {}'s last operation (group {})", st.cfg.client.address, st.cfg.client.port,
                         st.rank, st.cfg.client.group);
    });
    st.rethrow();
  }

  /// Stops the progress thread; in async mode also leaves the group (bounded
  /// by min(timeout_s, 5 s); best effort: if the switch does not answer, the
  /// member's part stays in S until this rank joins again).
  void leave() { leave(/*cancel=*/false); }

  /// As leave(), for a rank that stops mid-run (the engine unwinds an
  /// error): an all-reduce or delta under way is given up at once instead
  /// of waiting for the switch up to [transport] timeout_s.
  void abandon() { leave(/*cancel=*/true); }

  transport_capabilities capabilities() const noexcept {
    return {.deterministic = false, .copies_on_post = false, .emulates_network = false, .aggregates = true, .name = "switch"};
  }
  std::size_t dead_peers(std::span<received>) noexcept { return 0; }

  transport_counters counters() const noexcept {
    const auto& st = *m_state;
    transport_counters c;
    c.bytes_sent = st.wire_bytes_sent.load(std::memory_order_relaxed);
    c.messages_sent = st.messages_posted;
    c.bytes_received = st.wire_bytes_received.load(std::memory_order_relaxed);
    c.messages_received = st.done.load(std::memory_order_relaxed);
    c.dropped = st.retransmits.load(std::memory_order_relaxed);
    c.rejoins = st.rejoins.load(std::memory_order_relaxed);
    return c;
  }

  /// Packets sent again after a timeout, so far.
  std::uint64_t retransmits() const noexcept { return m_state->retransmits.load(); }
  /// Times a restarted switch asked this member to join again (async), so far.
  std::uint64_t rejoins() const noexcept { return m_state->rejoins.load(); }

 private:
  struct job {
    const std::byte* buffer = nullptr;
    const float* payload = nullptr;
    std::uint64_t step = 0;
  };
  // Sync: each member's part of a round's first all-reduce, at 1 + rank *
  // check_fields (element 0 sums the members' drift²): its step (3 pieces),
  // 1 in a round finish() forced, its model's float count (3), its layout
  // fingerprint (4) and its chunk (1). Every piece is an integer below 2^16
  // and the other members add zeros to it: exact in float32.
  static constexpr std::size_t check_fields = 12;

  static void put_pieces(float*& at, std::uint64_t v, int pieces) noexcept {
    for (int i = 0; i < pieces; ++i) *at++ = static_cast<float>((v >> (16 * i)) & 0xffffu);
  }
  static std::uint64_t get_pieces(const float*& at, int pieces) noexcept {
    std::uint64_t v = 0;
    for (int i = 0; i < pieces; ++i, ++at) {
      const float f = *at;  // from the switch: anything but a piece reads as 0xffff
      v |= (f >= 0.0f && f < 65536.0f ? static_cast<std::uint64_t>(f) : 0xffffu) << (16 * i);
    }
    return v;
  }

  struct state {
    settings cfg;
    std::unique_ptr<sw::client> client;
    std::thread thread;
    gossip::inbox* inbox = nullptr;
    std::size_t elements = 0;
    std::uint64_t layout_fingerprint = 0;
    std::vector<float> check, check_sum;  // sync: a round's first all-reduce (check_fields)
    int rank = 0, world = 1;
    std::chrono::duration<double> timeout{60.0};
    std::array<job, 4> jobs{};
    std::atomic<std::uint64_t> head{0}, tail{0}, done{0};
    std::atomic<bool> stop{false}, failed{false};
    std::atomic<bool> cancel{false};  // the client's call under way gives up (abandon, destruction)
    bool left = false;
    std::exception_ptr error;
    std::atomic<std::uint64_t> wire_bytes_sent{0}, wire_bytes_received{0}, retransmits{0}, rejoins{0};
    // Engine thread only.
    std::int64_t last_post_step = -1;
    std::uint64_t last_post_op = 0, collected = 0, to_release = 0, bytes_posted = 0, messages_posted = 0;

    void rethrow() {
      if (failed.load(std::memory_order_acquire) && error) std::rethrow_exception(error);
    }

    // The client's counters, for counters() (the thread while it runs, else
    // the engine's once the thread is gone).
    void publish_counters() noexcept {
      const auto& c = client->counters();
      wire_bytes_sent.store(c.bytes_sent, std::memory_order_relaxed);
      wire_bytes_received.store(c.bytes_received, std::memory_order_relaxed);
      retransmits.store(c.retransmits, std::memory_order_relaxed);
      rejoins.store(c.rejoins, std::memory_order_relaxed);
    }

    // Sync: this member's part of the round's first all-reduce.
    void fill_check(const wire_header& posted) noexcept {
      std::fill(check.begin(), check.end(), 0.0f);
      check[0] = std::isfinite(posted.weight) ? static_cast<float>(posted.weight) : 0.0f;
      float* at = check.data() + 1 + check_fields * static_cast<std::size_t>(rank);
      put_pieces(at, posted.step, 3);
      *at++ = (posted.flags & wire_header::finish_round) ? 1.0f : 0.0f;
      put_pieces(at, elements, 3);
      put_pieces(at, layout_fingerprint, 4);
      *at++ = static_cast<float>(cfg.client.chunk);
    }

    // Sync: every member shares this one's model and chunk and posted at its
    // step; else an error naming the first that does not.
    void check_members(const wire_header& posted) const {
      const bool finishing = posted.flags & wire_header::finish_round;
      // (Formatted only for an error: this runs every round.)
      const auto where = [&] { return fmt::format("group {} of the switch at {}:{}", cfg.client.group, cfg.client.address, cfg.client.port); };
      for (int m = 0; m < world; ++m) {
        if (m == rank) continue;
        const float* at = check_sum.data() + 1 + check_fields * static_cast<std::size_t>(m);
        const auto step = get_pieces(at, 3);
        const bool their_finishing = *at++ != 0.0f;
        const auto their_elements = get_pieces(at, 3);
        const auto their_layout = get_pieces(at, 4);
        const auto their_chunk = get_pieces(at, 1);
        if (their_elements != elements)
          throw config_error(fmt::format("switch transport (rank {}): rank {}'s model has {} float32 values, this rank's {} ({}); every "
                                         "member must train the same model",
                                         rank, m, their_elements, elements, where()));
        if (their_layout != layout_fingerprint)
          throw config_error(fmt::format("switch transport (rank {}): rank {}'s model has the same {} float32 values as this rank's in other "
                                         "tensors (names, shapes or order differ) ({}); every member must train the same model",
                                         rank, m, elements, where()));
        if (their_chunk != cfg.client.chunk)
          throw config_error(fmt::format("switch transport (rank {}): rank {} sends {} values a packet, this rank {} ({}); give every "
                                         "member the same [transport] chunk",
                                         rank, m, their_chunk, cfg.client.chunk, where()));
        if (!finishing && !their_finishing && step != (posted.step & 0xffff'ffff'ffffu))
          throw config_error(fmt::format(
              "switch transport (rank {}): rank {} posted this all-reduce at step {}, this rank at step {} ({}); the all-reduces of a "
              "sync group pair up in order, so every member must post at the same steps: the same [policy] settings (its period), or "
              "for consensus the same learning rate reported to step() on every member",
              rank, m, step, posted.step, where()));
      }
    }

    void run() noexcept {
      try {
        for (std::uint64_t op = 0;; ++op) {
          // Next job, or stop when asked and nothing is queued.
          for (unsigned i = 0; tail.load(std::memory_order_relaxed) == head.load(std::memory_order_acquire); ++i) {
            if (stop.load(std::memory_order_acquire)) return;
            if (i < 64) std::this_thread::yield();
            else std::this_thread::sleep_for(std::chrono::microseconds(i < 1024 ? 20 : 200));
          }
          const job j = jobs[op % jobs.size()];
          auto& slot = inbox->at(0, op);
          // The engine frees a slot within a step or two; bounded anyway.
          detail::wait_for([&] { return slot.state.load(std::memory_order_acquire) == inbox::empty || stop.load(); }, timeout,
                           [&] { return fmt::format("rank {} to merge the switch's reply {} before the next one", rank, op - 1); });
          if (stop.load() && slot.state.load() != inbox::empty) return;
          auto* out = reinterpret_cast<float*>(slot.data + sizeof(wire_header));
          const std::span<const float> in(j.payload, elements);
          double group_value = 1.0;
          if (cfg.sync) {
            // First the members' values from their headers (the engine's
            // drift² at this send; every member gets the same bytes back, so
            // the same group mean) and what they must share, checked before
            // any model is mixed; then the model.
            wire_header posted;
            std::memcpy(&posted, j.buffer, sizeof posted);
            fill_check(posted);
            client->allreduce(check, check_sum);
            check_members(posted);
            group_value = static_cast<double>(check_sum[0]) / static_cast<double>(world);
            client->allreduce(in, {out, elements});
            const float inv_n = 1.0f / static_cast<float>(world);
            for (std::size_t i = 0; i < elements; ++i) out[i] *= inv_n;
          } else {
            client->push_delta(in, {out, elements});
          }
          wire_header h;
          h.sender = -1;
          h.step = j.step;
          h.weight = group_value;
          h.payload_bytes = elements * sizeof(float);
          std::memcpy(slot.data, &h, sizeof h);
          slot.bytes = sizeof h + h.payload_bytes;
          slot.state.store(inbox::full, std::memory_order_release);
          publish_counters();
          done.store(op + 1, std::memory_order_release);
          tail.store(op + 1, std::memory_order_release);
        }
      } catch (const sw::cancelled&) {
        // Given up at abandon() or destruction: nobody waits for it.
        publish_counters();
      } catch (const timeout_error& e) {
        publish_counters();  // what was sent and resent in vain is in the stats too
        // The client's own (not the wait for the engine to merge): a sync
        // round no member answers may also be members that do not pair up.
        const bool pairing = cfg.sync && std::string_view(e.what()).find("waiting for the switch") != std::string_view::npos;
        error = std::current_exception();
        if (pairing) try {
            error = std::make_exception_ptr(timeout_error(fmt::format(
                "{}; every member of a sync group must also have the same [transport] chunk and post at the same steps", e.what())));
          } catch (...) {  // no memory for the longer message: the client's own stands
          }
        failed.store(true, std::memory_order_release);
      } catch (...) {
        publish_counters();
        error = std::current_exception();
        failed.store(true, std::memory_order_release);
      }
    }
  };

  // Async: also after the thread failed (a timeout, a refusal of a later
  // delta), or the switch would keep this member's part in S and the others
  // would go on pulling towards it until the group's idle_s. `cancel`
  // (abandon, which the engine's destructor calls) never throws: a refused
  // leave is one more error of a rank that is going away with one already.
  void leave(bool cancel) {
    if (!m_state) return;
    stop(cancel);
    auto& st = *m_state;
    if (st.cfg.sync || !st.client || st.left) return;
    st.left = true;
    st.cancel.store(false);  // the thread is gone; the leave below is bounded on its own
    try {
      st.client->leave(std::min(st.cfg.client.timeout_s, 5.0));
    } catch (const timeout_error&) {
    } catch (const std::exception&) {
      st.publish_counters();
      if (!cancel) throw;
    }
    st.publish_counters();
  }

  // Stops the thread once the jobs queued are done, or with `cancel` at once
  // (the operation under way is given up).
  void stop(bool cancel = false) noexcept {
    if (!m_state) return;
    if (cancel) m_state->cancel.store(true, std::memory_order_release);
    m_state->stop.store(true);
    if (m_state->thread.joinable()) m_state->thread.join();
  }

  std::unique_ptr<state> m_state;
};
static_assert(transport<switch_transport>);

/// Adds the `switch` topology (every member of the group, every round) to the
/// topology registry, once; make_switch_transport() calls it, so a config
/// naming it works wherever the switch transport is built in.
///
///     gossip::register_switch_topology();
inline void register_switch_topology() {
  static std::once_flag once;
  std::call_once(once, [] {
    topology_registry().add({"switch", "every member of the switch group (for the switch-aggregate protocol)", {},
                             [](const options&, int rank, int world) { return topology(topologies::complete(rank, world), rank, world, "switch"); }});
  });
}

/// Builds the switch transport of `rank` from a config's [transport] section
/// (name = "switch"); the mode follows the policy as switch_mode() says.
inline switch_transport make_switch_transport(const config& cfg, int /*rank*/, int world) {
  register_switch_topology();
  if (cfg.transport.name != "switch")
    throw config_error(fmt::format("{} [transport]: name is '{}', expected 'switch'", cfg.source, cfg.transport.name));
  if (cfg.protocol.name != "switch-aggregate")
    throw config_error(fmt::format("{}: transport 'switch' needs [protocol] name = \"switch-aggregate\" (got '{}')", cfg.transport.opts.where("name"),
                                   cfg.protocol.name));
  if (cfg.topology.name != "switch")
    throw config_error(fmt::format("{}: transport 'switch' needs [topology] name = \"switch\" (got '{}')", cfg.transport.opts.where("name"),
                                   cfg.topology.name));
  if (world < 2 || world > 64)
    throw config_error(fmt::format("{}: a switch group has 2..64 members, got a world of {} ranks; run 2 to 64 workers (the example: "
                                   "[train] workers, -n), or another transport",
                                   cfg.source, world));
  const auto o = cfg.transport.opts.resolved(switch_option_specs(), "transport 'switch'");
  // Either section may name the mode; the other follows it.
  const std::string mode = switch_mode(requested_switch_mode(cfg).mode, cfg.policy.name, staggered_policy(cfg.policy));
  auto in_range = [&](const char* key, std::int64_t lo, std::int64_t hi) {
    const auto v = o.integer(key);
    if (v < lo || v > hi) throw config_error(fmt::format("{}: key '{}' must be in {}..{}, got {}", o.where(key), key, lo, hi, v));
    return v;
  };
  switch_transport::settings s;
  s.sync = mode == "sync";
  s.client.address = o.string("address");
  s.client.port = static_cast<std::uint16_t>(in_range("port", 1, 65535));
  s.client.group = static_cast<std::uint16_t>(in_range("group", 0, 65535));
  // Both are checked, whichever the mode uses.
  const auto sync_group = in_range("sync_group", -1, 65535), async_group = in_range("async_group", -1, 65535);
  if (const auto g = s.sync ? sync_group : async_group; g >= 0) s.client.group = static_cast<std::uint16_t>(g);
  s.client.chunk = static_cast<std::uint16_t>(in_range("chunk", 1, sw::max_chunk));
  s.client.window = static_cast<std::uint16_t>(in_range("window", 1, 4096));
  s.client.rto_s = o.real("rto_ms") / 1000;
  s.client.rto_max_s = std::max(s.client.rto_max_s, s.client.rto_s);  // backing off never shortens the first timeout
  s.client.timeout_s = o.real("timeout_s");
  s.client.bind_address = o.string("bind");
  for (const char* key : {"address", "bind"})
    if (in_addr a{}; ::inet_pton(AF_INET, o.string(key).c_str(), &a) != 1)
      throw config_error(fmt::format("{}: key '{}' must be an IPv4 address such as 10.77.0.1 (the switch protocol runs over IPv4), got '{}'",
                                     o.where(key), key, o.string(key)));
  // At most a day for a retransmission and a year for the timeout (in the keys' units): a clock deadline further out overflows.
  for (const auto& [key, most, what] : {std::tuple{"rto_ms", 86400e3, "a day"}, std::tuple{"timeout_s", 31536000.0, "a year"}})
    if (const double v = o.real(key); !(v > 0) || !std::isfinite(v) || v > most)
      throw config_error(fmt::format("{}: key '{}' must be a number > 0 and at most {} ({}), got {}", o.where(key), key, most, what, v));
  return switch_transport(std::move(s));
}

}  // namespace gossip

#pragma once
/// The worker side of the switch protocol over kernel UDP sockets
/// (sendmmsg/recvmmsg batches, poll with timeouts, retransmission with
/// exponential backoff). Used by the switch transport, the tests and
/// bench/switch.
///
///     gossip::sw::client c({.address = "10.77.0.1", .group = 1, .worker = rank, .members = 4});
///     c.allreduce(x, sum);           // sync group: sum = Σ over members of x
///     c.push_delta(d, average);      // async group: S += d, average = S / joined
///     c.leave();                     // async group: take this member's part out of S
///
/// Each client is one session of its member (a random id in every packet):
/// a new client for the same worker id rejoins the group, and the switch
/// drops what the previous session of that member contributed (see
/// aggregator.hpp). leave() ends the session; a later push_delta() starts a
/// new one.
///
/// The client keeps the sum of its applied deltas (its part of S; one model
/// of floats, allocated by the first push_delta()). When a switch that was
/// restarted answers async_rejoin, push_delta() joins again as a new session
/// whose first delta is that part plus the current delta, so the new switch's
/// S holds exactly what this member had sent (counters().rejoins).
///
/// The calls block until every chunk is answered, or throw
/// gossip::timeout_error after `timeout_s` naming the group, worker, chunk and
/// switch address — in sync mode also, once the switch answered a
/// retransmission with sync_pending, the members whose share it was still
/// waiting for (a rank that died mid-round is named). Chunks are pipelined:
/// `window` packets in flight (at most the switch's slots per set in sync
/// mode).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <atomic>
#include <span>
#include <string>
#include <utility>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gossip/error.hpp"
#include "packet.hpp"

namespace gossip::sw {

struct client_config {
  std::string address = "127.0.0.1";  ///< the switch's IPv4 address
  std::uint16_t port = default_port;
  std::string bind_address = "0.0.0.0";
  std::uint16_t bind_port = 0;        ///< 0: any
  std::uint16_t group = 1;
  std::uint16_t worker = 0;
  std::uint16_t members = 1;
  std::uint16_t chunk = default_chunk;
  std::uint16_t window = 128;         ///< sync: must equal the group's slots
  double rto_s = 0.005;               ///< first retransmission timeout
  double rto_max_s = 0.2;
  double timeout_s = 30;              ///< bound on one call
  std::uint32_t session = 0;          ///< 0: draw a random one
  /// When set: a call under way checks it at least every 50 ms and, once it
  /// reads true, gives up with sw::cancelled (its owner is shutting down).
  const std::atomic<bool>* cancel = nullptr;
  /// Sync: the caller all-reduces vectors of more than one size on the group
  /// (the switch transport: each round's check, then the model), so a group
  /// fixed to one model size (elements=) cannot serve it; a refusal says so.
  bool mixed_sizes = false;
  /// The model's size in floats, which a refusal's message names (0: the
  /// size of the all-reduce or delta refused).
  std::uint64_t model_elements = 0;
};

/// A call given up because client_config::cancel was set; what it had sent
/// may have been applied in part.
class cancelled : public transport_error {
 public:
  using transport_error::transport_error;
};

struct client_counters {
  std::uint64_t packets_sent = 0, packets_received = 0, bytes_sent = 0, bytes_received = 0;
  std::uint64_t retransmits = 0;  ///< packets sent again after a timeout
  std::uint64_t stale = 0;        ///< replies for chunks already answered (duplicates)
  std::uint64_t malformed = 0;    ///< replies that failed validation
  std::uint64_t rejoins = 0;      ///< async: times a restarted switch asked this member to join again
};

namespace detail {

/// A slot of the window: the chunk it carries while active, and when it is
/// sent again.
struct flight {
  bool active = false;
  std::uint32_t chunk = 0;
  std::chrono::steady_clock::time_point due{};
  double rto = 0;
  bool sent = false;  ///< the kernel took one copy of it: a later one is a retransmission
};

// Throws config_error when the datagram is the switch's refusal of one of
// this session's packets (packet.hpp): the switch and this worker disagree
// on the group, and every retransmission would be dropped as well. `mode`
// and `elements` (0: a leave) describe what this worker sent; `cfg` and
// `session` are the client's. Reads no byte past the `len` of the datagram.
inline void check_refusal(const std::byte* p, std::size_t len, const client_config& cfg, std::uint32_t session, std::string_view mode,
                          std::uint64_t elements) {
  packet_header r;
  // The socket is connected: whatever arrives is the switch's. Bytes 0–7
  // are laid out alike in every version (packet.hpp).
  if (len >= 8) {
    std::uint32_t magic = 0;
    std::memcpy(&magic, p, sizeof magic);
    const auto version = static_cast<std::uint8_t>(p[4]);
    if (magic == packet_header::magic_value && version != packet_header::version_value)
      throw config_error(fmt::format(
          "switch at {}:{} speaks version {} of the switch wire format and worker {} (group {}) version {}{}: run the switch "
          "(gossip-switch or gossip-switch-udp) and the workers from the same libgossip release",
          cfg.address, cfg.port, version, cfg.worker, cfg.group, packet_header::version_value,
          static_cast<packet_type>(p[5]) == packet_type::refused ? "; it refused this worker's packets (bad_version)" : ""));
  }
  if (len != sizeof r || !read_header(p, len, r) || r.magic != packet_header::magic_value ||
      r.version != packet_header::version_value || r.type != packet_type::refused || r.group != cfg.group ||
      r.worker != cfg.worker || r.session != session)
    return;
  const auto why = static_cast<drop_reason>(r.flags);
  const std::string_view their_mode = r.reserved == 1 ? "sync" : "async";
  const std::string group = fmt::format(
      "its group {} is {}, with {} members, chunk {}{} and a model of {}", r.group, their_mode, r.count, r.elements,
      r.reserved == 1 ? fmt::format(", {} slots", r.slot) : std::string(), r.sequence == 0 ? std::string("any size") : fmt::format("{} floats", r.sequence));
  const std::string mine = fmt::format("this worker is worker {} of {}, {} mode, chunk {}, window {}{}", cfg.worker, cfg.members, mode,
                                       cfg.chunk, cfg.window,
                                       elements ? fmt::format(", a model of {} floats", cfg.model_elements ? cfg.model_elements : elements)
                                                : std::string());
  std::string what;
  switch (why) {
    case drop_reason::unknown_group:
      what = fmt::format("it serves no group {}; start the switch with a --group id={},… for this run, or set the workers' group "
                         "([transport] group) to one it serves", r.group, r.group);
      break;
    case drop_reason::bad_worker:
      what = fmt::format("{}; {}: the group needs as many members as the run has ranks", group, mine);
      break;
    case drop_reason::wrong_mode:
      what = fmt::format("{}; {}: set the switch group's mode and the workers' ([transport] mode) alike", group, mine);
      break;
    case drop_reason::session_conflict:
      what = fmt::format("another session holds worker {} of group {} at the same time (another job on this group?), and the switch "
                         "cannot tell their contributions apart: give each job its own group ([transport] group; the switch serves "
                         "several with one --group each), and restart this one",
                         cfg.worker, cfg.group);
      break;
    default:  // bad_elements, bad_length, bad_chunk, bad_slot
      if (cfg.mixed_sizes && r.reserved == 1 && r.sequence != 0) {
        // The switch transport's rounds are a small all-reduce (the members' drift and what they must share) and the model's.
        what = fmt::format("{}; {} (chunk {} refused): a sync group the switch transport gossips through takes all-reduces of "
                           "any size (each round adds a small all-reduce of the members' drift, steps and model sizes): start it "
                           "without elements= (or with elements=0)",
                           group, mine, r.chunk);
        break;
      }
      what = fmt::format("{}; {} (chunk {} refused): set the workers' chunk and window ([transport] chunk, window) to the group's "
                         "chunk and slots, and the group's elements to the model's size",
                         group, mine, r.chunk);
      break;
  }
  throw config_error(fmt::format("switch at {}:{} refused the packets of worker {} (group {}; {}): {}", cfg.address, cfg.port,
                                 cfg.worker, cfg.group, to_string(why), what));
}

/// What one datagram received while client::run() waits is.
enum class datagram_kind {
  reply,      ///< the answer to a chunk in flight: its floats go to out[offset, offset + h.elements)
  rejoin,     ///< async_rejoin for this session and operation: the switch holds nothing of this member
  pending,    ///< sync_pending for a chunk in flight: `holders` are the members whose share the switch holds
  stale,      ///< a well-formed answer to something else (an earlier chunk, operation or session)
  malformed,  ///< not an answer of this group and worker of the type awaited, or of the wrong length
};

/// What run() awaits: an operation of `n` floats in `chunks` chunks of
/// `chunk` (the last may be shorter), with `flights` (the window) and, sync,
/// the shadow bit `ver` of each of its slots.
struct awaited {
  bool sync = false;
  std::uint16_t group = 0, worker = 0, chunk = 1;
  std::uint32_t session = 0;
  std::uint64_t sequence = 0, n = 0, chunks = 0;
  std::span<const flight> flights;
  std::span<const std::uint8_t> ver;
};

struct classified {
  datagram_kind kind = datagram_kind::malformed;
  packet_header h;          ///< the datagram's header (unless too short)
  std::size_t slot = 0;     ///< reply, pending: the slot of the window it answers
  std::uint64_t offset = 0; ///< reply: where its chunk starts in the model
  std::uint64_t holders = 0;///< pending: bit i set when the switch holds member i's share of the chunk
};

// Whether `h` answers a chunk of this sync operation and session that is in
// flight on its slot under the slot's current set (`slot`: that slot).
inline bool in_flight_sync(const packet_header& h, const awaited& w, std::size_t& slot) noexcept {
  if (h.sequence != static_cast<std::uint32_t>(w.sequence) || h.session != w.session || h.chunk >= w.chunks) return false;
  slot = h.chunk % w.flights.size();
  return h.slot == slot && w.flights[slot].active && w.flights[slot].chunk == h.chunk && h.flags == w.ver[slot];
}

/// Classifies a datagram of `len` bytes. A reply fits the datagram
/// (len == packet_bytes(h.elements)) and the model (offset + h.elements <= n),
/// and answers an active slot of the window.
inline classified classify_reply(const std::byte* p, std::size_t len, const awaited& w) noexcept {
  classified c;
  packet_header& h = c.h;
  if (!w.sync && read_header(p, len, h) && h.magic == packet_header::magic_value && h.version == packet_header::version_value &&
      h.type == packet_type::async_rejoin) {
    // Else one for an earlier session or operation.
    c.kind = len == sizeof h && h.group == w.group && h.worker == w.worker && h.session == w.session &&
                     h.sequence == static_cast<std::uint32_t>(w.sequence)
                 ? datagram_kind::rejoin
                 : datagram_kind::stale;
    return c;
  }
  if (w.sync && read_header(p, len, h) && h.magic == packet_header::magic_value && h.version == packet_header::version_value &&
      h.type == packet_type::sync_pending) {
    if (len != pending_bytes || h.group != w.group || h.worker != w.worker || h.elements != 0) {
      c.kind = datagram_kind::malformed;
      return c;
    }
    // Else one for an earlier chunk, operation or session.
    std::size_t slot = 0;
    const bool match = in_flight_sync(h, w, slot);
    c.kind = match ? datagram_kind::pending : datagram_kind::stale;
    if (match) {
      c.slot = slot;
      std::memcpy(&c.holders, p + sizeof h, sizeof c.holders);
    }
    return c;
  }
  const auto want = w.sync ? packet_type::sync_result : packet_type::async_reply;
  if (!read_header(p, len, h) || h.magic != packet_header::magic_value || h.version != packet_header::version_value ||
      h.type != want || h.group != w.group || h.worker != w.worker || h.elements == 0 || h.elements > w.chunk ||
      len != packet_bytes(h.elements)) {
    c.kind = datagram_kind::malformed;
    return c;
  }
  std::size_t slot = 0;
  bool match = false;
  if (w.sync) {
    match = in_flight_sync(h, w, slot);
  } else if (h.sequence == static_cast<std::uint32_t>(w.sequence) && h.session == w.session && h.chunk < w.chunks) {
    for (slot = 0; slot < w.flights.size(); ++slot)
      if (w.flights[slot].active && w.flights[slot].chunk == h.chunk) {
        match = true;
        break;
      }
  }
  const std::uint64_t off = static_cast<std::uint64_t>(h.chunk) * w.chunk;
  if (!match || h.elements != std::min<std::uint64_t>(w.chunk, w.n - off)) {
    c.kind = datagram_kind::stale;
    return c;
  }
  c.kind = datagram_kind::reply;
  c.slot = slot;
  c.offset = off;
  return c;
}

/// The members 0..members-1 whose bit in `bits` is `set`, as "0, 2, 3"
/// ("none" when there are none).
inline std::string members_text(std::uint64_t bits, std::uint16_t members, bool set) {
  std::string s;
  for (std::uint16_t i = 0; i < members && i < 64; ++i)
    if (((bits >> i) & 1u) == set) s += fmt::format("{}{}", s.empty() ? "" : ", ", i);
  return s.empty() ? "none" : s;
}

/// True when a datagram of `len` bytes answers the leave of `session`
/// (worker `worker` of group `group`).
inline bool leave_answered(const std::byte* p, std::size_t len, std::uint16_t group, std::uint16_t worker, std::uint32_t session) noexcept {
  packet_header r;
  return read_header(p, len, r) && r.magic == packet_header::magic_value && r.version == packet_header::version_value &&
         r.type == packet_type::async_reply && r.elements == 0 && len == sizeof r && r.session == session && r.worker == worker &&
         r.group == group;
}

}  // namespace detail

class client {
 public:
  explicit client(client_config cfg) : m_cfg(std::move(cfg)) {
    if (m_cfg.chunk < 1 || m_cfg.chunk > max_chunk)
      throw config_error(fmt::format("switch client: chunk must be in 1..{}, got {}", max_chunk, m_cfg.chunk));
    if (m_cfg.window < 1) throw config_error("switch client: window must be >= 1");
    if (m_cfg.members < 1 || m_cfg.members > 64 || m_cfg.worker >= m_cfg.members)
      throw config_error(fmt::format("switch client: worker {} is outside a group of {} members (1..64)", m_cfg.worker, m_cfg.members));
    m_fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (m_fd < 0) throw transport_error(fmt::format("switch client: socket(): {}", std::strerror(errno)));
    const int buf = 8 << 20;
    // FORCE variants need root; the plain ones are capped by net.core.*mem_max.
    if (::setsockopt(m_fd, SOL_SOCKET, SO_RCVBUFFORCE, &buf, sizeof buf) != 0) ::setsockopt(m_fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    if (::setsockopt(m_fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof buf) != 0) ::setsockopt(m_fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    sockaddr_in local{};
    local.sin_family = AF_INET;
    local.sin_port = htons(m_cfg.bind_port);
    if (::inet_pton(AF_INET, m_cfg.bind_address.c_str(), &local.sin_addr) != 1)
      throw config_error(fmt::format("switch client: bind address '{}' is not an IPv4 address", m_cfg.bind_address));
    if (::bind(m_fd, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0)
      throw transport_error(fmt::format("switch client (worker {}): bind {}:{} ([transport] bind): {}{}", m_cfg.worker, m_cfg.bind_address,
                                        m_cfg.bind_port, std::strerror(errno),
                                        errno == EADDRNOTAVAIL ? "; no interface of this machine has that address: set [transport] bind to "
                                                                 "one it has, or to 0.0.0.0"
                                                               : ""));
    sockaddr_in remote{};
    remote.sin_family = AF_INET;
    remote.sin_port = htons(m_cfg.port);
    if (::inet_pton(AF_INET, m_cfg.address.c_str(), &remote.sin_addr) != 1)
      throw config_error(fmt::format("switch client: switch address '{}' is not an IPv4 address", m_cfg.address));
    if (::connect(m_fd, reinterpret_cast<sockaddr*>(&remote), sizeof remote) != 0)
      throw transport_error(fmt::format("switch client (worker {}): connect {}:{}: {}", m_cfg.worker, m_cfg.address, m_cfg.port, std::strerror(errno)));
    m_session = m_cfg.session ? m_cfg.session : new_session();
    m_ver.assign(m_cfg.window, 0);
    m_flight.resize(m_cfg.window);
    m_tx.resize(batch * max_packet_bytes);
    m_rx.resize(batch * (max_packet_bytes + 64));
  }
  client(const client&) = delete;
  client& operator=(const client&) = delete;
  client(client&& o) noexcept { *this = std::move(o); }
  client& operator=(client&& o) noexcept {
    if (this != &o) {
      close();
      m_cfg = std::move(o.m_cfg);
      m_fd = std::exchange(o.m_fd, -1);
      m_ver = std::move(o.m_ver);
      m_flight = std::move(o.m_flight);
      m_tx = std::move(o.m_tx);
      m_rx = std::move(o.m_rx);
      m_part = std::move(o.m_part);
      m_rejoin = std::move(o.m_rejoin);
      m_sync_ops = o.m_sync_ops;
      m_async_seq = o.m_async_seq;
      m_session = o.m_session;
      m_counters = o.m_counters;
    }
    return *this;
  }
  ~client() { close(); }

  /// Sync group: out = Σ over members of `in` (in and out may alias).
  void allreduce(std::span<const float> in, std::span<float> out) {
    GOSSIP_ASSERT(in.size() == out.size(), "allreduce: in has {} values, out {}", in.size(), out.size());
    ++m_sync_ops;
    run(packet_type::sync_contribution, in, out, m_sync_ops);
  }

  /// Async group: S += delta (exactly once), average = S / joined per chunk.
  /// If the switch lost this member's session (it restarted), joins again as
  /// a new session with everything sent so far, `delta` included.
  void push_delta(std::span<const float> delta, std::span<float> average) {
    GOSSIP_ASSERT(delta.size() == average.size(), "push_delta: delta has {} values, average {}", delta.size(), average.size());
    const std::size_t n = delta.size();
    if (m_part.size() != n) m_part.assign(n, 0.0f);  // first push: this member holds nothing in S yet
    std::vector<float> copy;  // a rejoin reads `delta` after replies were written to `average`
    if (delta.data() == average.data() && n > 0) {
      copy.assign(delta.begin(), delta.end());
      delta = copy;
    }
    ++m_async_seq;
    if (!run(packet_type::async_delta, delta, average, m_async_seq)) {
      for (std::size_t i = 0; i < n; ++i) m_part[i] += delta[i];  // as the switch adds it: the same float sums
      return;
    }
    // The switch answered async_rejoin: it holds nothing of this member. Join
    // as a new session whose first delta is the whole part; a switch that
    // restarts again meanwhile asks again (bounded).
    m_rejoin.resize(n);
    for (std::size_t i = 0; i < n; ++i) m_rejoin[i] = m_part[i] + delta[i];
    for (int attempt = 0;; ++attempt) {
      if (attempt == 8)
        throw transport_error(fmt::format("switch client (group {}, worker {}): the switch at {}:{} asked this member to join again {} times in a row; "
                                          "is more than one switch serving that address?",
                                          m_cfg.group, m_cfg.worker, m_cfg.address, m_cfg.port, attempt));
      ++m_counters.rejoins;
      m_session = new_session();
      m_async_seq = 1;
      if (!run(packet_type::async_delta, m_rejoin, average, m_async_seq)) break;
    }
    m_part.swap(m_rejoin);
  }

  /// Async group: ends this session; the switch takes this member's part out
  /// of S. Retransmits until answered, at most `timeout_s` (0: the config's);
  /// throws gossip::timeout_error naming the switch. A later push_delta()
  /// joins again as a new session (its first delta must be the whole model).
  void leave(double timeout_s = 0) {
    using clock = std::chrono::steady_clock;
    if (timeout_s <= 0) timeout_s = m_cfg.timeout_s;
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
    packet_header h;
    h.type = packet_type::async_leave;
    h.group = m_cfg.group;
    h.worker = m_cfg.worker;
    h.session = m_session;
    double rto = m_cfg.rto_s;
    for (bool answered = false; !answered;) {
      check_cancel("its leave");
      if (clock::now() > deadline)
        throw timeout_error(fmt::format("timed out after {:.1f} s waiting for the switch at {}:{} to answer the leave of worker {} (group {})",
                                        timeout_s, m_cfg.address, m_cfg.port, m_cfg.worker, m_cfg.group));
      if (::send(m_fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h)) {
        ++m_counters.packets_sent;
        m_counters.bytes_sent += sizeof h;
      }
      pollfd pfd{m_fd, POLLIN, 0};
      if (::poll(&pfd, 1, poll_ms(std::max(1, static_cast<int>(rto * 1000)))) > 0) {
        std::array<std::byte, max_packet_bytes + 64> buf;
        for (ssize_t len; (len = ::recv(m_fd, buf.data(), buf.size(), MSG_DONTWAIT)) > 0;) {
          ++m_counters.packets_received;
          m_counters.bytes_received += static_cast<std::uint64_t>(len);
          check_refusal(buf.data(), static_cast<std::size_t>(len), "async", 0);
          if (detail::leave_answered(buf.data(), static_cast<std::size_t>(len), m_cfg.group, m_cfg.worker, m_session))
            answered = true;
          else
            ++m_counters.stale;
        }
      }
      rto = std::min(rto * 2, m_cfg.rto_max_s);
    }
    m_session = new_session();
    m_async_seq = 0;
    std::fill(m_part.begin(), m_part.end(), 0.0f);  // the switch took this member's part out of S
  }

  /// This session's id (in every packet).
  std::uint32_t session() const noexcept { return m_session; }

  const client_counters& counters() const noexcept { return m_counters; }
  const client_config& config() const noexcept { return m_cfg; }

 private:
  static constexpr std::size_t batch = 32;
  using flight = detail::flight;

  static std::uint32_t new_session() {
    std::random_device rd;
    const auto t = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    const std::uint32_t s = rd() ^ static_cast<std::uint32_t>(t ^ (t >> 32));
    return s ? s : 1;
  }

  void check_cancel(std::string_view what) const {
    if (m_cfg.cancel && m_cfg.cancel->load(std::memory_order_acquire))
      throw cancelled(fmt::format("switch client (group {}, worker {}): {} was given up: the transport is shutting down", m_cfg.group,
                                  m_cfg.worker, what));
  }
  // A poll's timeout, bounded so that a cancel is seen within 50 ms.
  int poll_ms(int ms) const noexcept { return m_cfg.cancel ? std::min(ms, 50) : ms; }

  void close() noexcept {
    if (m_fd >= 0) ::close(m_fd);
    m_fd = -1;
  }

  void check_refusal(const std::byte* p, std::size_t len, std::string_view mode, std::uint64_t elements) const {
    detail::check_refusal(p, len, m_cfg, m_session, mode, elements);
  }

  // One operation over every chunk; true when the switch answered
  // async_rejoin (async only: it holds no session of this member), after
  // which nothing of this operation counts.
  bool run(packet_type type, std::span<const float> in, std::span<float> out, std::uint64_t sequence) {
    using clock = std::chrono::steady_clock;
    const bool sync = type == packet_type::sync_contribution;
    const std::uint64_t n = in.size();
    const std::uint64_t chunks = (n + m_cfg.chunk - 1) / m_cfg.chunk;
    if (chunks > 0xffffffffull) throw config_error("switch client: model too large for 32-bit chunk indices");
    // `in` may alias `out`; results land in `out` chunk by chunk, so keep a copy
    // of what is still to be sent only when they alias.
    std::vector<float> copy;
    if (in.data() == out.data() && n > 0) {
      copy.assign(in.begin(), in.end());
      in = copy;
    }
    const auto start = clock::now();
    const auto deadline = start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(m_cfg.timeout_s));
    std::uint64_t next = 0, done = 0;
    for (auto& f : m_flight) f.active = false;
    std::size_t pending = 0;
    std::array<mmsghdr, batch> msgs{};
    std::array<iovec, batch> iovs{};
    std::array<std::size_t, batch> queued_slot{};  // queued entry k carries the chunk of this slot of the window

    auto flush = [&] {
      std::size_t sent = 0;
      while (sent < pending) {
        const int r = ::sendmmsg(m_fd, msgs.data() + sent, static_cast<unsigned>(pending - sent), 0);
        if (r < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == ENOBUFS || errno == ECONNREFUSED) {
            // Socket buffer full or an ICMP error from an earlier send: what was
            // not sent is resent on its timeout.
            break;
          }
          throw transport_error(fmt::format("switch client (group {}, worker {}): sendmmsg to {}:{}: {}", m_cfg.group, m_cfg.worker,
                                            m_cfg.address, m_cfg.port, std::strerror(errno)));
        }
        // Counted once the kernel took them: a packet a full socket buffer
        // or an ICMP error kept back is no packet sent.
        for (std::size_t k = sent; k < sent + static_cast<std::size_t>(r); ++k) {
          ++m_counters.packets_sent;
          m_counters.bytes_sent += iovs[k].iov_len;
          auto& f = m_flight[queued_slot[k]];
          if (f.sent) ++m_counters.retransmits;  // a copy the kernel had taken before
          f.sent = true;
        }
        sent += static_cast<std::size_t>(r);
      }
      pending = 0;
    };
    auto queue = [&](std::size_t slot, std::uint32_t chunk) {
      if (pending == batch) flush();
      const std::uint64_t off = static_cast<std::uint64_t>(chunk) * m_cfg.chunk;
      const auto len = static_cast<std::uint16_t>(std::min<std::uint64_t>(m_cfg.chunk, n - off));
      packet_header h;
      h.type = type;
      h.flags = sync ? m_ver[slot] : 0;
      h.group = m_cfg.group;
      h.worker = m_cfg.worker;
      h.slot = sync ? static_cast<std::uint16_t>(slot) : 0;
      h.elements = len;
      h.chunk = chunk;
      h.sequence = static_cast<std::uint32_t>(sequence);
      h.session = m_session;
      h.count = m_cfg.members;  // checked against the group's members
      std::byte* p = m_tx.data() + pending * max_packet_bytes;
      std::memcpy(p, &h, sizeof h);
      std::memcpy(p + sizeof h, in.data() + off, len * sizeof(float));
      iovs[pending] = {p, packet_bytes(len)};
      msgs[pending].msg_hdr = msghdr{};
      msgs[pending].msg_hdr.msg_iov = &iovs[pending];
      msgs[pending].msg_hdr.msg_iovlen = 1;
      queued_slot[pending] = slot;
      ++pending;
    };
    auto launch = [&](std::size_t slot, std::uint32_t chunk, clock::time_point now) {
      auto& f = m_flight[slot];
      f = {true, chunk, now + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(m_cfg.rto_s)), m_cfg.rto_s};
      queue(slot, chunk);
    };

    // Sync: chunk c always uses slot c % window. Async: any free slot.
    auto now = clock::now();
    for (std::size_t s = 0; s < m_flight.size() && next < chunks; ++s) launch(s, static_cast<std::uint32_t>(next++), now);
    flush();

    std::array<mmsghdr, batch> rmsgs{};
    std::array<iovec, batch> riovs{};
    const std::size_t rstride = max_packet_bytes + 64;
    const detail::awaited awaiting{.sync = sync,
                                   .group = m_cfg.group,
                                   .worker = m_cfg.worker,
                                   .chunk = m_cfg.chunk,
                                   .session = m_session,
                                   .sequence = sequence,
                                   .n = n,
                                   .chunks = chunks,
                                   .flights = m_flight,
                                   .ver = m_ver};
    bool rejoin = false;
    // Sync: the switch's last sync_pending answer (which members it held a
    // share of for a chunk of this operation), for the timeout's error.
    struct {
      bool seen = false;
      std::uint32_t chunk = 0;
      std::uint64_t holders = 0;
      clock::time_point at{};
    } last_pending;
    while (done < chunks && !rejoin) {
      check_cancel(sync ? "an all-reduce" : "a delta");
      // Earliest retransmission due decides how long to sleep.
      auto due = deadline;
      for (const auto& f : m_flight)
        if (f.active) due = std::min(due, f.due);
      now = clock::now();
      // Rounded up: a retransmission due in under a millisecond is slept for, not spun on.
      const int wait_ms = due > now ? static_cast<int>((std::chrono::duration_cast<std::chrono::microseconds>(due - now).count() + 999) / 1000) : 0;
      pollfd pfd{m_fd, POLLIN, 0};
      const int pr = ::poll(&pfd, 1, poll_ms(wait_ms));
      if (pr < 0 && errno != EINTR) throw transport_error(fmt::format("switch client: poll: {}", std::strerror(errno)));
      for (;;) {
        for (std::size_t i = 0; i < batch; ++i) {
          riovs[i] = {m_rx.data() + i * rstride, rstride};
          rmsgs[i].msg_hdr = msghdr{};
          rmsgs[i].msg_hdr.msg_iov = &riovs[i];
          rmsgs[i].msg_hdr.msg_iovlen = 1;
        }
        const int r = ::recvmmsg(m_fd, rmsgs.data(), batch, MSG_DONTWAIT, nullptr);
        if (r <= 0) break;
        now = clock::now();
        for (int i = 0; i < r; ++i) {
          const std::byte* p = m_rx.data() + static_cast<std::size_t>(i) * rstride;
          const std::size_t len = rmsgs[static_cast<std::size_t>(i)].msg_len;
          ++m_counters.packets_received;
          m_counters.bytes_received += len;
          check_refusal(p, len, sync ? "sync" : "async", n);
          const auto c = detail::classify_reply(p, len, awaiting);
          if (c.kind == detail::datagram_kind::rejoin) {
            rejoin = true;
            continue;
          }
          if (c.kind == detail::datagram_kind::pending) {
            last_pending = {true, c.h.chunk, c.holders, now};  // the retransmission timer runs on: a result may still be lost
            continue;
          }
          if (c.kind == detail::datagram_kind::malformed) {
            ++m_counters.malformed;
            continue;
          }
          if (c.kind == detail::datagram_kind::stale) {
            ++m_counters.stale;  // a duplicate, or one for an earlier session or operation
            continue;
          }
          const packet_header& h = c.h;
          const std::size_t slot = c.slot;
          const std::uint64_t off = c.offset;
          std::memcpy(out.data() + off, p + sizeof(packet_header), h.elements * sizeof(float));
          m_flight[slot].active = false;
          ++done;
          if (sync) {
            m_ver[slot] ^= 1;
            const std::uint64_t c = h.chunk + m_flight.size();
            if (c < chunks) launch(slot, static_cast<std::uint32_t>(c), now);
          } else if (next < chunks) {
            launch(slot, static_cast<std::uint32_t>(next++), now);
          }
        }
        flush();
        if (static_cast<std::size_t>(r) < batch) break;
      }
      if (rejoin) break;
      now = clock::now();
      if (done < chunks && now > deadline) {
        std::uint64_t waiting = chunks;
        for (const auto& f : m_flight)
          if (f.active) waiting = std::min<std::uint64_t>(waiting, f.chunk);
        // The switch's last word on a chunk still unanswered (an earlier
        // chunk's says nothing about this one).
        const auto& at_slot = m_flight[last_pending.chunk % m_flight.size()];
        const bool still = last_pending.seen && at_slot.active && at_slot.chunk == last_pending.chunk;
        const std::string why =
            still
                ? fmt::format("the switch holds the shares of member(s) {} of chunk {} and waits for member(s) {} (its last answer, {:.1f} s "
                              "before): did they stop, die, or post at other steps (or did the switch restart after they sent theirs)?",
                              detail::members_text(last_pending.holders, m_cfg.members, true), last_pending.chunk,
                              detail::members_text(last_pending.holders, m_cfg.members, false),
                              std::chrono::duration<double>(now - last_pending.at).count())
                : fmt::format("is gossip-switch running with this group and all {} members? (its --stats-json counts what it dropped, "
                              "by reason)",
                              m_cfg.members);
        throw timeout_error(fmt::format(
            "timed out after {:.1f} s waiting for the switch at {}:{} (group {}, worker {} of {}, {} mode): chunk {} of {} unanswered "
            "({} packets sent, {} of them retransmissions; {} received, {} of them stale and {} malformed); {}",
            m_cfg.timeout_s, m_cfg.address, m_cfg.port, m_cfg.group, m_cfg.worker, m_cfg.members, sync ? "sync" : "async", waiting, chunks,
            m_counters.packets_sent, m_counters.retransmits, m_counters.packets_received, m_counters.stale, m_counters.malformed, why));
      }
      for (std::size_t s = 0; s < m_flight.size(); ++s) {
        auto& f = m_flight[s];
        if (!f.active || f.due > now) continue;
        f.rto = std::min(f.rto * 2, m_cfg.rto_max_s);
        f.due = now + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(f.rto));
        queue(s, f.chunk);
      }
      flush();
    }
    return rejoin;
  }

  client_config m_cfg;
  int m_fd = -1;
  std::vector<std::uint8_t> m_ver;   // sync: shadow bit each slot uses next
  std::vector<flight> m_flight;
  std::vector<std::byte> m_tx, m_rx;
  std::vector<float> m_part;    // async: Σ of this session's applied deltas (this member's part of S)
  std::vector<float> m_rejoin;  // async: the first delta of a rejoin (allocated at the first one)
  std::uint64_t m_sync_ops = 0, m_async_seq = 0;
  std::uint32_t m_session = 0;
  client_counters m_counters;
};

}  // namespace gossip::sw

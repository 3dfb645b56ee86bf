#pragma once
/// The aggregation logic of the switch, free of DPDK and of sockets: the same
/// code runs inside gossip-switch (DPDK), inside gossip-switch-udp (kernel
/// UDP, the host baseline) and in the unit tests.
///
///     gossip::sw::aggregator agg({gossip::sw::group_config::parse("id=1,mode=sync,members=4")});
///     auto why = agg.handle({data, len}, [&](std::uint16_t worker, std::span<const std::byte> reply) {
///       send_to(address_of(worker), reply);   // called once per destination
///     });
///
/// Sync groups (all-reduce, the SwitchML/OmniReduce protocol on a CPU): a pool
/// of 2·slots chunk buffers, the second half the shadow copies. Chunk c of an
/// all-reduce goes to slot c % slots; a worker sends its next chunk on a slot
/// only after it received the result of the previous one, flipping the shadow
/// bit each time. Per slot and set the switch keeps a contributor bitmap and a
/// count; the first contribution overwrites, later ones add; when all members
/// contributed the sum goes back to each of them. A contribution from a
/// worker whose bit is already set is a retransmission: if the set is complete
/// the stored result is sent again to that worker only (its result was lost),
/// otherwise it is answered with sync_pending, which names the members whose
/// share the set holds (packet.hpp; not for a share of one value, whose
/// answer would be larger than it). A contribution to set v clears the
/// worker's bit in set 1 − v: it proves the worker holds the result of that
/// set, so the shadow copy can be reused once every member moved on. (One to
/// set v while set 1 − v still waits with this worker's share in it comes
/// from no client while the switch keeps its state — after a restart, a late
/// copy of a share whose result the worker had may — and is dropped as
/// slot_conflict.) A late copy of a share of a completed set's chunk (or of
/// an older one) from a worker that moved on is answered with the stored
/// result (if the chunk is the set's) and changes nothing: it neither starts
/// the set again nor touches the other set.
///
/// Async groups (shared aggregate): S holds, per chunk, the sum of every
/// member's last-sent model, and the switch keeps each member's part of it
/// (the sum of its applied deltas, members × elements floats). A delta with
/// sequence k from worker w on chunk c is applied iff k is the next one
/// expected for (w, c); an older k is a duplicate (not applied, answered); a
/// newer one means an earlier delta was never applied and is dropped
/// (sequence_gap) — the client only sends k + 1 after k was acknowledged. The
/// reply carries S / joined for the chunk, where joined counts the members
/// whose first delta for the chunk was applied (a first delta is the full
/// model, sent against x̂ = 0).
///
/// Sessions (every packet carries its sender's session id) make a group
/// reusable by one run after another, and a crashed worker replaceable:
///  - async: a member leaves with async_leave, which takes its part out of S
///    (S of each chunk is re-summed from the remaining parts, so S is exactly
///    what the members still joined have sent) and drops its sequence state.
///    A delta from a session other than the member's current one joins, and
///    must have sequence 1: the member's old part is taken out as by a leave
///    (a worker that died without leaving is replaced), its sequence numbers
///    restart at 1. Any other delta of a foreign session — a late packet of a
///    session that left or was replaced — is dropped (stale_session), and so
///    is any packet, its first delta included, of one of the member's last
///    four sessions that left or were evicted before another took it. A leave
///    is answered always (it is idempotent) and acts only on the current session.
///    A delta with sequence > 1 from a member of which the switch has seen no
///    session at all means the switch lost its state (it was restarted while
///    the member was joined): it is not applied (unknown_session) and answered
///    with async_rejoin, so that the member joins again as a new session whose
///    first delta is everything it had sent (see client.hpp). So is a delta
///    with sequence > 1 for a chunk of which the member's current session has
///    no delta here: the switch restarted while that session's first delta
///    was under way, and took the rest of it as a join.
///  - async: a member silent for longer than the group's idle_s (advance()
///    tells the aggregator the time) is evicted: its part is taken out of S as
///    by a leave, so the average is over the members still training. A later
///    delta of the evicted session is not applied (evicted) and is answered
///    with async_rejoin, as after a restart: a member that was only slow joins
///    again with everything it had sent, one model's worth of packets.
///  - sync: the first contribution of a new session clears the member's bit
///    in every completed set and discards every set still in progress that
///    holds its contribution (that all-reduce can no longer complete).
///  - both: two jobs on one group would mix their members' contributions
///    (worker 0 of one job and worker 1 of the other complete a set, or join
///    one S) while their sessions take each member from each other in turn.
///    A session that took a member from a joined one is recorded; a packet of
///    the session it displaced within conflict_grace_s is a late one and is
///    dropped (stale_session), but one after that means both are alive: the
///    switch refuses it (session_conflict) and refuses the member's current
///    session once at its next packet, so both jobs stop with that reason
///    instead of training on each other's sums. A restarted worker's old
///    process is gone and never sends again.
/// So each delta is applied exactly once within its session, and S is always
/// the sum of the last-sent models of the members currently joined. Members
/// that died without leaving stay in S until their id rejoins or idle_s
/// passes.
///
/// Not thread-safe: one polling thread owns an aggregator.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "packet.hpp"

namespace gossip::sw {

enum class group_mode : std::uint8_t { sync, async };

inline std::string_view to_string(group_mode m) noexcept { return m == group_mode::sync ? "sync" : "async"; }

/// One aggregation group as configured on the switch.
struct group_config {
  std::uint16_t id = 1;
  group_mode mode = group_mode::sync;
  std::uint16_t members = 2;              ///< 1..64 (parse(): 2..64, what a run can use)
  std::uint16_t chunk = default_chunk;    ///< float32 values per packet, 1..max_chunk
  std::uint16_t slots = 128;              ///< sync: slots per set (the pool holds 2·slots)
  std::uint64_t elements = 0;             ///< async: model size (required); sync: 0 = any
  std::uint32_t idle_s = 60;              ///< async: evict a member silent this long (s); 0: never

  std::uint64_t chunks() const noexcept { return (elements + chunk - 1) / chunk; }
  /// Exact length of `c` when the model size is known, else the chunk size.
  std::uint16_t chunk_length(std::uint64_t c) const noexcept {
    if (elements == 0) return chunk;
    return static_cast<std::uint16_t>(std::min<std::uint64_t>(chunk, elements - c * chunk));
  }

  /// Parses "id=1,mode=sync,members=4,chunk=256,slots=128,elements=0" (any
  /// order, defaults as above). Throws std::invalid_argument naming the key.
  static group_config parse(std::string_view text) {
    group_config g;
    const std::string whole(text);  // for messages: `text` is consumed item by item
    auto fail = [&](const std::string& what) {
      throw std::invalid_argument("group '" + whole + "': " + what +
                                  " (expected e.g. id=1,mode=sync,members=4,chunk=256,slots=128 or id=2,mode=async,members=4,elements=1000000)");
    };
    if (text.find_first_not_of(" \t") == std::string_view::npos) fail("is empty");
    std::vector<std::string_view> seen;  // a key given twice is refused, not the last one taken
    for (bool more = true; more;) {
      const auto comma = text.find(',');
      const auto item = text.substr(0, comma);
      more = comma != std::string_view::npos;  // "members=2," ends in an empty item, refused as ",," is
      text = more ? text.substr(comma + 1) : std::string_view{};
      const auto eq = item.find('=');
      if (eq == std::string_view::npos) fail("item '" + std::string(item) + "' is not key=value");
      const auto key = item.substr(0, eq), value = item.substr(eq + 1);
      if (std::find(seen.begin(), seen.end(), key) != seen.end()) fail("key '" + std::string(key) + "' is given twice");
      seen.push_back(key);
      auto number = [&](std::uint64_t lo, std::uint64_t hi) {
        std::uint64_t v = 0;
        if (value.empty()) fail("key '" + std::string(key) + "' has no value");
        for (char ch : value) {
          if (ch < '0' || ch > '9') fail("key '" + std::string(key) + "' must be an integer, got '" + std::string(value) + "'");
          v = v * 10 + static_cast<std::uint64_t>(ch - '0');
          if (v > hi) break;
        }
        if (v < lo || v > hi)
          fail("key '" + std::string(key) + "' must be in " + std::to_string(lo) + ".." + std::to_string(hi) + ", got " + std::string(value));
        return v;
      };
      if (key == "id") g.id = static_cast<std::uint16_t>(number(0, 65535));
      else if (key == "members") {
        if (value == "1") fail("a group of members=1 has no one to aggregate with: give the run's number of workers, 2..64");
        g.members = static_cast<std::uint16_t>(number(2, 64));
      }
      else if (key == "chunk") g.chunk = static_cast<std::uint16_t>(number(1, max_chunk));
      else if (key == "slots") g.slots = static_cast<std::uint16_t>(number(1, 4096));
      else if (key == "elements") g.elements = number(0, std::uint64_t{1} << 32);
      else if (key == "idle_s") g.idle_s = static_cast<std::uint32_t>(number(0, 86400));
      else if (key == "mode") {
        if (value == "sync") g.mode = group_mode::sync;
        else if (value == "async") g.mode = group_mode::async;
        else fail("key 'mode' must be sync or async, got '" + std::string(value) + "'");
      } else {
        fail("unknown key '" + std::string(key) + "'");
      }
    }
    if (g.mode == group_mode::async && g.elements == 0) fail("an async group needs elements=<model size in float32 values>");
    if (g.mode == group_mode::sync && std::find(seen.begin(), seen.end(), "idle_s") != seen.end())
      fail("key 'idle_s' applies to async groups only (a sync member holds no state between all-reduces)");
    return g;
  }
};

/// Counters of one aggregator (the switch adds its own port counters).
struct aggregator_stats {
  std::array<std::uint64_t, drop_reason_count> drops{};  ///< [accepted] counts accepted packets
  std::uint64_t aggregations_completed = 0;  ///< sync slot sets that got every member
  std::uint64_t results_resent = 0;          ///< sync: stored result sent again to one worker
  std::uint64_t pending_answered = 0;        ///< sync: retransmitted shares of incomplete sets answered sync_pending
  std::uint64_t retransmissions_seen = 0;    ///< contributions or deltas seen before (sync and async)
  std::uint64_t deltas_applied = 0;          ///< async
  std::uint64_t replies = 0;                 ///< reply datagrams emitted
  std::uint64_t evictions = 0;               ///< async: members evicted after idle_s of silence

  std::uint64_t dropped() const noexcept {
    std::uint64_t n = 0;
    for (std::size_t i = 1; i < drops.size(); ++i) n += drops[i];
    return n;
  }
  std::uint64_t accepted() const noexcept { return drops[0]; }
};

/// A deterministic loss injector (xorshift64*): drop(p) is true with probability p.
class drop_injector {
 public:
  explicit drop_injector(double probability = 0, std::uint64_t seed = 0x9e3779b97f4a7c15ull)
      : m_threshold(probability <= 0 ? 0 : probability >= 1 ? ~std::uint64_t{0} : static_cast<std::uint64_t>(probability * 18446744073709551615.0)),
        m_state(seed | 1) {}
  bool enabled() const noexcept { return m_threshold != 0; }
  bool drop() noexcept {
    if (m_threshold == 0) return false;
    m_state ^= m_state >> 12;
    m_state ^= m_state << 25;
    m_state ^= m_state >> 27;
    return m_state * 2685821657736338717ull < m_threshold;
  }

 private:
  std::uint64_t m_threshold;
  std::uint64_t m_state;
};

class aggregator {
 public:
  explicit aggregator(std::vector<group_config> groups) {
    // An async group holds its model (members + 1) times, and a sequence per
    // member and chunk: more than this machine's memory is refused before it
    // is allocated and zero-filled.
    const double physical = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
    double needed = 0;
    for (const auto& g : groups)
      if (g.mode == group_mode::async && g.chunk > 0)
        needed += static_cast<double>(g.elements) * 4.0 * (g.members + 1.0) + static_cast<double>(g.chunks()) * 8.0 * g.members;
    if (physical > 0 && needed > physical)
      throw std::invalid_argument("the async groups' aggregates need " + std::to_string(static_cast<long long>(needed / (1 << 30))) +
                                  " GiB (elements x (members + 1) floats, and a sequence per member and chunk), more than this machine's " +
                                  std::to_string(static_cast<long long>(physical / (1 << 30))) + " GiB of memory; check elements= and members=");
    for (const auto& g : groups) {
      if (find(g.id)) throw std::invalid_argument("group id " + std::to_string(g.id) + " is configured twice");
      if (g.members < 1 || g.members > 64) throw std::invalid_argument("group " + std::to_string(g.id) + ": members must be in 1..64");
      if (g.chunk < 1 || g.chunk > max_chunk) throw std::invalid_argument("group " + std::to_string(g.id) + ": chunk must be in 1.." + std::to_string(max_chunk));
      if (g.mode == group_mode::async && g.elements == 0) throw std::invalid_argument("group " + std::to_string(g.id) + ": async needs elements");
      auto st = std::make_unique<group_state>();
      st->cfg = g;
      if (g.mode == group_mode::sync) {
        st->sets.resize(2 * static_cast<std::size_t>(g.slots));
        st->pool.assign(2 * static_cast<std::size_t>(g.slots) * g.chunk, 0.0f);
      } else {
        st->sum.assign(g.elements, 0.0f);
        st->part.assign(static_cast<std::size_t>(g.members) * g.elements, 0.0f);
        st->next_seq.assign(static_cast<std::size_t>(g.members) * g.chunks(), 1);
        st->joined.assign(g.chunks(), 0);
      }
      st->sessions.resize(g.members);
      m_groups.push_back(std::move(st));
    }
  }

  std::size_t groups() const noexcept { return m_groups.size(); }
  const group_config* config(std::uint16_t id) const noexcept {
    const auto* g = const_cast<aggregator*>(this)->find(id);
    return g ? &g->cfg : nullptr;
  }
  const aggregator_stats& stats() const noexcept { return m_stats; }
  aggregator_stats& stats() noexcept { return m_stats; }
  /// Counts a drop decided outside (loss injection, L2/L3 checks of the switch).
  void count_drop(drop_reason r) noexcept { ++m_stats.drops[static_cast<std::size_t>(r)]; }

  /// The async aggregate S of a group (tests and checks).
  std::span<const float> async_sum(std::uint16_t id) const noexcept {
    const auto* g = const_cast<aggregator*>(this)->find(id);
    return g ? std::span<const float>(g->sum) : std::span<const float>{};
  }

  /// Members of async group `id` whose session is joined (tests and checks).
  std::uint16_t async_joined(std::uint16_t id) const noexcept {
    const auto* g = const_cast<aggregator*>(this)->find(id);
    std::uint16_t n = 0;
    if (g)
      for (const auto& m : g->sessions) n += m.state == member_session::joined;
    return n;
  }

  /// Checks a datagram against the group configuration; reads nothing past `pkt`.
  drop_reason validate(std::span<const std::byte> pkt, packet_header& h) const noexcept {
    if (!read_header(pkt.data(), pkt.size(), h)) {
      // Another version's header may be shorter; its first 8 bytes keep their
      // offsets (packet.hpp), enough to refuse it by its version.
      h = packet_header{};
      if (pkt.size() < 8) return drop_reason::too_short;
      std::memcpy(&h.magic, pkt.data(), sizeof h.magic);
      h.version = std::to_integer<std::uint8_t>(pkt[4]);
      h.type = static_cast<packet_type>(std::to_integer<std::uint8_t>(pkt[5]));
      h.flags = std::to_integer<std::uint8_t>(pkt[6]);
      h.reserved = std::to_integer<std::uint8_t>(pkt[7]);
      const bool other_version = h.magic == packet_header::magic_value && h.version != packet_header::version_value;
      return other_version ? drop_reason::bad_version : drop_reason::too_short;
    }
    if (h.magic != packet_header::magic_value) return drop_reason::bad_magic;
    if (h.version != packet_header::version_value) return drop_reason::bad_version;
    if (h.type != packet_type::sync_contribution && h.type != packet_type::async_delta && h.type != packet_type::async_leave)
      return drop_reason::bad_type;
    const auto* g = const_cast<aggregator*>(this)->find(h.group);
    if (!g) return drop_reason::unknown_group;
    const auto& c = g->cfg;
    if ((h.type == packet_type::sync_contribution) != (c.mode == group_mode::sync)) return drop_reason::wrong_mode;
    if (h.worker >= c.members) return drop_reason::bad_worker;
    // A sync group with more members than the run has ranks would wait for
    // ever for the missing ones. (An async group averages over the members
    // that joined: it may be larger than the run.)
    if (c.mode == group_mode::sync && h.count != 0 && h.count != c.members) return drop_reason::bad_worker;
    if (h.type == packet_type::async_leave) {
      if (h.elements != 0) return drop_reason::bad_elements;
      if (pkt.size() != sizeof(packet_header)) return drop_reason::bad_length;
      if (h.chunk != 0) return drop_reason::bad_chunk;
      if (h.slot != 0 || h.flags != 0) return drop_reason::bad_slot;
      return drop_reason::accepted;
    }
    if (h.elements == 0 || h.elements > c.chunk) return drop_reason::bad_elements;
    if (pkt.size() != packet_bytes(h.elements)) return drop_reason::bad_length;
    if (c.elements != 0) {
      if (h.chunk >= c.chunks()) return drop_reason::bad_chunk;
      if (h.elements != c.chunk_length(h.chunk)) return drop_reason::bad_elements;
    }
    if (c.mode == group_mode::sync) {
      if (h.slot >= c.slots || h.chunk % c.slots != h.slot) return drop_reason::bad_slot;
      if (h.flags > 1) return drop_reason::bad_slot;
    } else {
      if (h.slot != 0 || h.flags != 0) return drop_reason::bad_slot;
      if (h.sequence == 0) return drop_reason::sequence_gap;
    }
    return drop_reason::accepted;
  }

  /// The `refused` answer to a packet `validate` dropped for `why` (its header
  /// as validate read it), or false when that drop is not answered (see
  /// refusable() in packet.hpp). The caller sends it to the packet's source.
  bool refusal(const packet_header& dropped, drop_reason why, packet_header& out) const noexcept {
    if (!refusable(why)) return false;
    out = packet_header{};
    out.type = packet_type::refused;
    out.flags = static_cast<std::uint8_t>(why);
    // Past byte 8 another version's header may be laid out otherwise: echo
    // nothing. Its refusals go unanswered, as this version's do (bad_type).
    if (why == drop_reason::bad_version) return dropped.type != packet_type::refused;
    out.group = dropped.group;
    out.worker = dropped.worker;
    out.chunk = dropped.chunk;
    out.session = dropped.session;
    if (const group_config* g = config(dropped.group)) {
      out.reserved = g->mode == group_mode::sync ? 1 : 2;
      out.count = g->members;
      out.elements = g->chunk;
      out.slot = g->mode == group_mode::sync ? g->slots : 0;  // async groups have no slots
      out.sequence = static_cast<std::uint32_t>(std::min<std::uint64_t>(g->elements, 0xffffffffull));
    }
    return true;
  }

  /// How many bytes of a refusal to send in answer to a datagram of
  /// `answered` bytes: never more than it (no amplification). Only a packet
  /// of another version can be shorter than a header; its refusal is then
  /// cut to its length, and the first 8 bytes (magic, version, type, reason)
  /// are all a worker of any version reads of one.
  static constexpr std::size_t refusal_bytes(std::size_t answered) noexcept { return std::min(sizeof(packet_header), answered); }

  /// How long after a session took a member a packet of the session it
  /// displaced counts as late (stale_session) rather than as a second live job
  /// on the group (session_conflict). Time as advance() tells it.
  static constexpr double conflict_grace_s = 1.0;

  /// Tells the aggregator the time (seconds, from any fixed origin, never
  /// decreasing) and evicts every async member silent for longer than its
  /// group's idle_s. The switches call it between bursts; cheap (a pass over
  /// the members).
  void advance(double now_s) noexcept {
    m_now = now_s;
    for (auto& g : m_groups) {
      if (g->cfg.mode != group_mode::async || g->cfg.idle_s == 0) continue;
      for (std::uint16_t w = 0; w < g->cfg.members; ++w)
        if (auto& m = g->sessions[w]; m.state == member_session::joined && now_s - m.last_seen > g->cfg.idle_s) {
          remove_member(*g, w);
          m.state = member_session::evicted;
          ++m_stats.evictions;
        }
    }
  }

  /// Handles one datagram; `emit(worker, reply)` is called for every reply.
  /// Returns why it was dropped, or accepted (also for answered duplicates).
  template <class Emit>
  drop_reason handle(std::span<const std::byte> pkt, Emit&& emit) {
    packet_header h;
    drop_reason why = validate(pkt, h);
    if (why == drop_reason::accepted) {
      auto& g = *find(h.group);
      const auto* values = pkt.data() + sizeof(packet_header);
      why = h.type == packet_type::sync_contribution ? handle_sync(g, h, values, emit)
            : h.type == packet_type::async_delta     ? handle_async(g, h, values, emit)
                                                      : handle_leave(g, h, emit);
    }
    ++m_stats.drops[static_cast<std::size_t>(why)];
    return why;
  }

 private:
  struct slot_set {
    std::uint64_t seen = 0;      // contributor bitmap
    std::uint16_t count = 0;
    std::uint16_t elements = 0;
    bool complete = false;
    bool used = false;
    std::uint32_t chunk = 0;
    std::uint64_t sequence = 0;
  };
  struct member_session {
    enum state_t : std::uint8_t { none, joined, left, evicted };
    std::uint32_t id = 0;
    state_t state = none;
    double last_seen = 0;  // advance() time of its last applied or repeated delta
    bool displaced = false;      // a new session took the member from a joined one,
    std::uint32_t displaced_id = 0;  // this one,
    double displaced_at = 0;     // at this advance() time
    bool conflict = false;       // the displaced one spoke later: refuse the current one once
    // The last sessions that left or were evicted before another took the
    // member: such a session never sends again (a process that left is gone;
    // an evicted one joins again as a new session), so a packet of one is a
    // late copy, and it must not take the member from the current session.
    std::array<std::uint32_t, 4> ended{};
    std::uint8_t ended_count = 0, ended_next = 0;
    bool current(std::uint32_t session) const noexcept { return state == joined && id == session; }
    bool ended_before(std::uint32_t session) const noexcept {
      return std::find(ended.begin(), ended.begin() + ended_count, session) != ended.begin() + ended_count;
    }
  };

  // Before a packet of `session` is handled for member m: accepted to go on,
  // or why it is dropped (the displaced session of a conflict, and the current
  // one once after it).
  drop_reason admit(member_session& m, std::uint32_t session) noexcept {
    if (m.current(session)) {
      if (!m.conflict) return drop_reason::accepted;
      m.conflict = false;
      return drop_reason::session_conflict;
    }
    if (!m.displaced || session != m.displaced_id) return drop_reason::accepted;
    if (m_now - m.displaced_at <= conflict_grace_s) return drop_reason::stale_session;  // late, from a process now gone
    m.conflict = true;
    return drop_reason::session_conflict;
  }
  // Session `session` takes member m (it was not current).
  void take(member_session& m, std::uint32_t session) noexcept {
    if (m.state == member_session::joined) m.displaced = true, m.displaced_id = m.id, m.displaced_at = m_now;
    if (m.state == member_session::left || m.state == member_session::evicted) {
      m.ended[m.ended_next] = m.id;
      m.ended_next = static_cast<std::uint8_t>((m.ended_next + 1) % m.ended.size());
      m.ended_count = static_cast<std::uint8_t>(std::min<std::size_t>(m.ended_count + 1u, m.ended.size()));
    }
    m.id = session;
    m.state = member_session::joined;
  }
  struct group_state {
    group_config cfg;
    std::vector<member_session> sessions; // [worker]
    std::vector<slot_set> sets;          // [set · slots + slot]
    std::vector<float> pool;             // same index, × chunk
    std::vector<float> sum;              // async S
    std::vector<float> part;             // async [worker · elements]: the member's share of S
    std::vector<std::uint64_t> next_seq; // async [worker · chunks + chunk]
    std::vector<std::uint16_t> joined;   // async, per chunk
  };

  group_state* find(std::uint16_t id) noexcept {
    for (auto& g : m_groups)
      if (g->cfg.id == id) return g.get();
    return nullptr;
  }

  template <class Emit>
  void reply(const packet_header& h, const float* values, std::uint16_t n, std::uint16_t worker, Emit& emit) {
    packet_header r = h;
    r.worker = worker;
    r.elements = n;
    std::memcpy(m_reply.data(), &r, sizeof r);
    if (n) std::memcpy(m_reply.data() + sizeof r, values, n * sizeof(float));
    ++m_stats.replies;
    emit(worker, std::span<const std::byte>(m_reply.data(), packet_bytes(n)));
  }

  // The sync_pending answer to worker h.worker's retransmitted share of set
  // `s`, still incomplete: the members whose share it holds (packet.hpp).
  template <class Emit>
  void pending(const packet_header& h, const slot_set& s, Emit& emit) {
    packet_header r = h;
    r.type = packet_type::sync_pending;
    r.elements = 0;
    r.count = static_cast<std::uint32_t>(std::popcount(s.seen));  // the bitmap's members
    std::memcpy(m_reply.data(), &r, sizeof r);
    std::memcpy(m_reply.data() + sizeof r, &s.seen, sizeof s.seen);  // little-endian (packet.hpp)
    ++m_stats.pending_answered;
    ++m_stats.replies;
    emit(h.worker, std::span<const std::byte>(m_reply.data(), pending_bytes));
  }

  template <class Emit>
  drop_reason handle_sync(group_state& g, const packet_header& h, const std::byte* values, Emit& emit) {
    const auto& c = g.cfg;
    const std::size_t set = h.flags & 1u;
    const std::size_t index = set * c.slots + h.slot;
    auto& s = g.sets[index];
    float* acc = g.pool.data() + index * c.chunk;
    const std::uint64_t bit = std::uint64_t{1} << h.worker;
    packet_header out = h;
    out.type = packet_type::sync_result;
    out.count = c.members;
    auto& m = g.sessions[h.worker];
    if (const auto why = admit(m, h.session); why != drop_reason::accepted) return why;
    if (!m.current(h.session)) {
      if (m.ended_before(h.session)) return drop_reason::stale_session;
      for (auto& other : g.sets) {
        if (!(other.seen & bit)) continue;
        if (other.complete) other.seen &= ~bit;
        else other = slot_set{};  // holds the old session's contribution: it can never complete
      }
      take(m, h.session);
    }
    if (s.seen & bit) {
      ++m_stats.retransmissions_seen;
      if (s.complete) {
        ++m_stats.results_resent;
        reply(out, acc, s.elements, h.worker, emit);
      } else if (s.chunk == h.chunk && s.sequence == h.sequence && packet_bytes(h.elements) >= pending_bytes) {
        // The set is this share's own (not one that holds another of the
        // worker's shares), and the answer is no larger than what it answers.
        pending(h, s, emit);
      }
      return drop_reason::accepted;
    }
    if (s.used && !s.complete && (s.chunk != h.chunk || s.sequence != h.sequence || s.elements != h.elements)) {
      // A late copy of a chunk this slot held before its current one: the
      // slot moved on only after every worker had that chunk's result (a
      // worker sends a set's next chunk only once it holds the other set's
      // result, and that needed everyone's share of the chunk after ours).
      // So a retransmission that crossed its own result, not a conflict.
      if (h.sequence < s.sequence || (h.sequence == s.sequence && h.chunk < s.chunk)) {
        ++m_stats.retransmissions_seen;
        return drop_reason::accepted;
      }
      return drop_reason::slot_conflict;
    }
    auto& shadow = g.sets[(1 - set) * c.slots + h.slot];
    if (s.used && s.complete && shadow.used && (shadow.seen & bit) &&
        (h.sequence < shadow.sequence || (h.sequence == shadow.sequence && h.chunk < shadow.chunk))) {
      // A late copy of a share of this worker's older than the one it gave
      // the slot's other set since (which cleared its bit here): it had this
      // set's result, and went on. It must neither start the set again nor
      // touch its share in the other set. (Within a session a worker's chunks
      // on a slot only go forward; a new session clears its bits first.)
      ++m_stats.retransmissions_seen;
      if (h.sequence == s.sequence && h.chunk == s.chunk) {
        ++m_stats.results_resent;
        reply(out, acc, s.elements, h.worker, emit);
      }
      return drop_reason::accepted;
    }
    if (shadow.used && !shadow.complete && (shadow.seen & bit)) {
      // The other set still waits with this worker's share in it: a worker
      // gives a set a share only once it holds the other set's result, so no
      // client sends this while the switch keeps its state (after a restart,
      // a late copy of a share whose result the worker had can). Clearing
      // its bit there would leave its share in the count, and a
      // retransmission would add it again.
      return drop_reason::slot_conflict;
    }
    shadow.seen &= ~bit;
    if (!s.used || s.complete) {
      s = slot_set{.seen = 0, .count = 0, .elements = h.elements, .complete = false, .used = true, .chunk = h.chunk, .sequence = h.sequence};
      std::memcpy(acc, values, h.elements * sizeof(float));
    } else {
      // memcpy: the receive buffer need not be float-aligned.
      float v[max_chunk];
      std::memcpy(v, values, h.elements * sizeof(float));
      for (std::size_t i = 0; i < h.elements; ++i) acc[i] += v[i];
    }
    s.seen |= bit;
    if (++s.count == c.members) {
      s.complete = true;
      ++m_stats.aggregations_completed;
      for (std::uint16_t w = 0; w < c.members; ++w) {
        out.session = g.sessions[w].id;  // each member's result carries its own session
        reply(out, acc, s.elements, w, emit);
      }
    }
    return drop_reason::accepted;
  }

  template <class Emit>
  drop_reason handle_async(group_state& g, const packet_header& h, const std::byte* values, Emit& emit) {
    const auto& c = g.cfg;
    auto& m = g.sessions[h.worker];
    if (const auto why = admit(m, h.session); why != drop_reason::accepted) return why;
    if (!m.current(h.session)) {
      if (m.ended_before(h.session)) return drop_reason::stale_session;
      const bool evicted = m.state == member_session::evicted && m.id == h.session;
      if (evicted || (h.sequence != 1 && m.state == member_session::none)) {
        packet_header out = h;
        out.type = packet_type::async_rejoin;
        out.count = async_joined(c.id);
        reply(out, nullptr, 0, h.worker, emit);
        return evicted ? drop_reason::evicted : drop_reason::unknown_session;
      }
      if (h.sequence != 1 || (m.state == member_session::left && m.id == h.session)) return drop_reason::stale_session;
      remove_member(g, h.worker);
      take(m, h.session);
    }
    m.last_seen = m_now;
    auto& next = g.next_seq[static_cast<std::size_t>(h.worker) * c.chunks() + h.chunk];
    if (h.sequence > next) {
      if (next == 1) {
        // This switch holds nothing of the member's chunk while the member is
        // past its first delta: it restarted while that first delta (or a
        // re-join) was under way, and took the rest of it as a join. The
        // deltas it missed are gone: ask the member to join again (the new
        // session takes its part out and puts everything back in).
        packet_header out = h;
        out.type = packet_type::async_rejoin;
        out.count = async_joined(c.id);
        reply(out, nullptr, 0, h.worker, emit);
        return drop_reason::unknown_session;
      }
      return drop_reason::sequence_gap;
    }
    const std::size_t offset = static_cast<std::size_t>(h.chunk) * c.chunk;
    float* s = g.sum.data() + offset;
    float* part = g.part.data() + static_cast<std::size_t>(h.worker) * c.elements + offset;
    if (h.sequence == next) {
      float v[max_chunk];
      std::memcpy(v, values, h.elements * sizeof(float));
      for (std::size_t i = 0; i < h.elements; ++i) s[i] += v[i];
      for (std::size_t i = 0; i < h.elements; ++i) part[i] += v[i];
      if (next == 1) ++g.joined[h.chunk];
      ++next;
      ++m_stats.deltas_applied;
    } else {
      ++m_stats.retransmissions_seen;
    }
    const std::uint16_t joined = g.joined[h.chunk];
    // A division, not a multiplication by 1/joined: exact whenever S is a multiple of joined.
    const float div = joined ? static_cast<float>(joined) : 1.0f;
    float avg[max_chunk];
    for (std::size_t i = 0; i < h.elements; ++i) avg[i] = s[i] / div;
    packet_header out = h;
    out.type = packet_type::async_reply;
    out.count = joined;
    reply(out, avg, h.elements, h.worker, emit);
    return drop_reason::accepted;
  }

  template <class Emit>
  drop_reason handle_leave(group_state& g, const packet_header& h, Emit& emit) {
    auto& m = g.sessions[h.worker];
    if (m.current(h.session)) {
      remove_member(g, h.worker);
      m.state = member_session::left;
    }
    packet_header out = h;
    out.type = packet_type::async_reply;
    out.count = async_joined(g.cfg.id);
    reply(out, nullptr, 0, h.worker, emit);
    return drop_reason::accepted;
  }

  // Takes worker w's part out of S: every chunk it joined is re-summed from the
  // other members' parts (exact: S is then what they sent, in member order),
  // and its sequence numbers restart at 1.
  static void remove_member(group_state& g, std::uint16_t w) {
    const auto& c = g.cfg;
    for (std::uint64_t k = 0; k < c.chunks(); ++k) {
      auto& next = g.next_seq[static_cast<std::size_t>(w) * c.chunks() + k];
      if (next == 1) continue;
      next = 1;
      --g.joined[k];
      const std::size_t offset = k * c.chunk, len = c.chunk_length(k);
      std::fill_n(g.part.data() + static_cast<std::size_t>(w) * c.elements + offset, len, 0.0f);
      float* s = g.sum.data() + offset;
      std::fill_n(s, len, 0.0f);
      for (std::size_t v = 0; v < c.members; ++v) {
        const float* p = g.part.data() + v * c.elements + offset;
        for (std::size_t i = 0; i < len; ++i) s[i] += p[i];
      }
    }
  }

  std::vector<std::unique_ptr<group_state>> m_groups;
  aggregator_stats m_stats;
  double m_now = 0;  // advance()'s time
  alignas(64) std::array<std::byte, max_packet_bytes> m_reply{};
};

}  // namespace gossip::sw

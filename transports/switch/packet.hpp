#pragma once
/// The wire format spoken between workers and an aggregation switch.
///
/// One UDP datagram (default port 47000) = one 32-byte packet_header followed
/// by `elements` float32 values, little-endian, nothing else:
///
///     offset  size  field
///          0     4  magic      "GSW1" (0x31575347)
///          4     1  version    2
///          5     1  type       sync_contribution | sync_result | async_delta | async_reply | async_leave | async_rejoin | refused |
///                              sync_pending
///          6     1  flags      bit 0: shadow set of the slot (sync); refused: the drop_reason
///          7     1  reserved   0 (refused: the group's mode, below)
///          8     2  group      aggregation group id (configured on the switch)
///         10     2  worker     member id within the group, 0..members-1
///         12     2  slot       sync: slot index = chunk % slots; async: 0
///         14     2  elements   float32 values that follow: 1..chunk size of the group (0 for async_leave, its reply and sync_pending)
///         16     4  chunk      chunk index within the model (offset = chunk * chunk size)
///         20     4  count      replies: members aggregated (sync) or joined (async); requests: the
///                              members the worker's run has (0: not checked), refused as bad_worker
///                              where a sync group has another number
///         24     4  sequence   sync: all-reduce number; async: per-chunk delta number (from 1)
///         28     4  session    the sender's session: a random id a worker draws when it (re)joins
///
/// Sessions make a group reusable by run after run: sequence numbers restart
/// at 1 with every new session, and the switch resets a member's state when
/// it sees a session it does not hold for that member (the rules are in
/// aggregator.hpp). A reply carries the session of the member it goes to.
/// A switch that holds no session at all for a member (it was restarted)
/// answers that member's later deltas with async_rejoin: the worker then
/// joins as a new session, sending everything it had sent so far (the switch
/// transport survives a switch restart this way).
/// Sequence numbers are 32 bits: 2^32 deltas per chunk and session.
///
/// A packet the switch drops because it disagrees with the group's
/// configuration (no such group, a worker id past the members, the other mode,
/// a chunk, slot or length the group does not have), or because another live
/// session holds its member (two jobs on one group; see refusable()) is
/// answered with `refused`, header only, to the address it came from. It
/// echoes the dropped packet's group, worker, chunk and session, carries the
/// drop_reason in `flags` and, when the group exists, the switch's view of
/// it: `reserved` = mode (1 sync, 2 async; 0: no such group), `count` =
/// members, `elements` = chunk size, `slot` = slots (sync; 0 async),
/// `sequence` = model size in floats (0: any; saturated at 2^32 − 1). So a
/// refusal's `elements` is no count of values: none follow. The client stops at once with an error
/// that says what differs, instead of retransmitting until its timeout. A
/// refusal is never larger than what it answers (aggregator::refusal_bytes:
/// one to a packet of another version shorter than a header is cut to its
/// length), and a refusal sent to a
/// switch is dropped there as bad_type, never answered.
///
/// A sync contribution that arrives again while its set still waits for
/// other members (the worker's retransmission: no result came) is answered
/// with `sync_pending`, to that worker's address (as its result would be;
/// not for a contribution of one value, which is shorter than the answer):
/// its header echoes the
/// contribution (group, worker, slot, flags, chunk, sequence, session) with
/// `elements` = 0 and `count` = the members whose share the set holds, and 8
/// bytes follow, the bitmap of those members (bit i: member i; little-endian
/// 64 bits). The worker goes on retransmitting as before; when its operation
/// times out, its error names the members the switch was still waiting for
/// (a rank that died or stopped, or that posts at other steps). Workers that
/// do not know the type count it as malformed and are otherwise unaffected.
///
/// The first 8 bytes (magic, version, type, flags) keep these offsets in
/// every version of the format, and `refused` keeps its value, so that a
/// switch and a worker of different versions still tell each other so: a
/// packet of another version is refused (bad_version, header only, with
/// nothing echoed: the rest of its header may be laid out otherwise), and
/// a worker that hears its switch speak another version stops with an error
/// that names both versions.
///
///     gossip::sw::packet_header h{.type = gossip::sw::packet_type::sync_contribution, .group = 1, .worker = 0};
///     const std::size_t bytes = gossip::sw::packet_bytes(h.elements);
///
/// Nothing here depends on DPDK or on sockets; the switch, the kernel-UDP
/// aggregator, the client and the tests share it.
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace gossip::sw {

static_assert(std::endian::native == std::endian::little, "the switch wire format is little-endian; this host is not");

inline constexpr std::uint16_t default_port = 47000;
inline constexpr std::uint16_t default_chunk = 256;
/// The largest chunk that fits a 1500-byte MTU: (1500 − 20 IPv4 − 8 UDP − 32) / 4.
inline constexpr std::uint16_t max_chunk = 360;

enum class packet_type : std::uint8_t {
  sync_contribution = 1,
  sync_result = 2,
  async_delta = 3,
  async_reply = 4,
  async_leave = 5,  ///< header only: remove my contribution from S; answered by an async_reply of 0 elements
  async_rejoin = 6, ///< switch to worker, header only: "I hold no session of yours" (an answer to a delta, echoing its fields)
  refused = 7,      ///< switch to worker, header only: a packet dropped as inconsistent with the group (see above)
  sync_pending = 8, ///< switch to worker: a retransmitted contribution's set still waits; the members it holds follow (see above)
};

struct packet_header {
  static constexpr std::uint32_t magic_value = 0x31575347;  // "GSW1"
  static constexpr std::uint8_t version_value = 2;
  std::uint32_t magic = magic_value;
  std::uint8_t version = version_value;
  packet_type type = packet_type::sync_contribution;
  std::uint8_t flags = 0;
  std::uint8_t reserved = 0;
  std::uint16_t group = 0;
  std::uint16_t worker = 0;
  std::uint16_t slot = 0;
  std::uint16_t elements = 0;
  std::uint32_t chunk = 0;
  std::uint32_t count = 0;
  std::uint32_t sequence = 0;
  std::uint32_t session = 0;
};
static_assert(sizeof(packet_header) == 32);

inline constexpr std::size_t packet_bytes(std::size_t elements) noexcept { return sizeof(packet_header) + elements * sizeof(float); }
inline constexpr std::size_t max_packet_bytes = packet_bytes(max_chunk);
/// A sync_pending answer: the header and the 64-bit bitmap of the members whose share the set holds.
inline constexpr std::size_t pending_bytes = sizeof(packet_header) + sizeof(std::uint64_t);

/// Why a packet was not aggregated. Everything but `accepted` is a drop,
/// counted per reason by whoever saw it.
enum class drop_reason : std::uint8_t {
  accepted = 0,
  too_short,      ///< fewer bytes than a header
  bad_magic,
  bad_version,
  bad_type,       ///< not a type a worker sends
  unknown_group,
  bad_worker,     ///< worker id >= members of the group
  bad_elements,   ///< 0 (but for async_leave), above the group's chunk size, or not the chunk's exact length
  bad_length,     ///< datagram size != header + elements·4 (truncated or oversized)
  bad_chunk,      ///< chunk outside the group's model
  bad_slot,       ///< slot >= slots of the group, or != chunk % slots
  wrong_mode,     ///< sync packet to an async group or the reverse
  sequence_gap,   ///< async delta from the future: an earlier one was never applied
  slot_conflict,  ///< sync slot busy with another chunk or all-reduce
  stale_session,  ///< async delta of a session that left, or of a new session with sequence != 1
  injected,       ///< dropped on purpose (loss injection)
  not_ipv4,       ///< switch only: not IPv4 (nor ARP)
  bad_ip,         ///< switch only: IPv4 header invalid (its checksum included), fragmented or truncated
  not_udp,
  wrong_port,
  not_for_us,     ///< switch only: destination IP is not the switch's
  no_route,       ///< switch only: reply to a worker whose address was never seen
  tx_full,        ///< switch only: transmit queue full, reply freed
  unknown_session,///< async delta (sequence > 1) of a member this switch holds no session for — it restarted: answered with async_rejoin
  evicted,        ///< async delta of a session evicted after the group's idle_s of silence: answered with async_rejoin
  session_conflict,///< two live sessions on one member (two jobs on one group): both are refused (aggregator.hpp)
  count_
};
inline constexpr std::size_t drop_reason_count = static_cast<std::size_t>(drop_reason::count_);

inline constexpr std::string_view to_string(drop_reason r) noexcept {
  constexpr std::array<std::string_view, drop_reason_count> names = {
      "accepted",   "too_short",    "bad_magic",     "bad_version", "bad_type",   "unknown_group", "bad_worker",   "bad_elements",
      "bad_length", "bad_chunk",    "bad_slot",      "wrong_mode",  "sequence_gap", "slot_conflict", "stale_session", "injected", "not_ipv4",
      "bad_ip",     "not_udp",      "wrong_port",    "not_for_us",  "no_route",   "tx_full",       "unknown_session", "evicted", "session_conflict"};
  const auto i = static_cast<std::size_t>(r);
  return i < names.size() ? names[i] : "?";
}

/// The drops a switch answers with `refused`: the packet and the group's
/// configuration disagree, another job's session holds the same member, or
/// the sender speaks another version of this format, so every
/// retransmission would be dropped too.
inline constexpr bool refusable(drop_reason r) noexcept {
  switch (r) {
    case drop_reason::unknown_group:
    case drop_reason::bad_worker:
    case drop_reason::bad_elements:
    case drop_reason::bad_length:
    case drop_reason::bad_chunk:
    case drop_reason::bad_slot:
    case drop_reason::wrong_mode:
    case drop_reason::session_conflict:
    case drop_reason::bad_version:
      return true;
    default:
      return false;
  }
}

/// Reads the header of a datagram of `len` bytes; false if it is too short.
/// Copies (never aliases) so an unaligned receive buffer is fine.
inline bool read_header(const std::byte* data, std::size_t len, packet_header& h) noexcept {
  if (len < sizeof(packet_header)) return false;
  std::memcpy(&h, data, sizeof h);
  return true;
}

}  // namespace gossip::sw

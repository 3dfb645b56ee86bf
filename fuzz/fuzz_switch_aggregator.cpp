// Datagrams into the switch's aggregator (transports/switch/aggregator.hpp),
// the code that runs inside gossip-switch and gossip-switch-udp.
//
// Input: a sequence of datagrams, each a little-endian 16-bit length and that
// many bytes (a length past the end takes what is left), one second apart
// (the async group evicts a member silent for 8). The groups are fixed:
// a sync group of any model size, a sync group of a known size and an async
// group, so valid headers (see the seed corpus) reach every handler.
// Checked besides memory safety: every datagram is counted once, every reply
// is a well-formed packet for a member of the group (a rejoin request only
// from the async group, header only; a sync_pending only from a sync group, to
// a member its waiting set holds, with the holders' bitmap), a refusal answers exactly the drops
// that say the packet and its group (or its version) disagree and is
// dropped by a switch, and
// the async group's joined count never exceeds its members.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "aggregator.hpp"

namespace sw = gossip::sw;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  sw::aggregator agg({sw::group_config::parse("id=1,mode=sync,members=3,chunk=4,slots=2"),
                      sw::group_config::parse("id=2,mode=sync,members=2,chunk=8,slots=4,elements=20"),
                      sw::group_config::parse("id=3,mode=async,members=3,chunk=4,elements=10,idle_s=8")});
  std::uint64_t datagrams = 0;
  const auto* p = reinterpret_cast<const std::byte*>(data);
  while (size >= 2) {
    std::size_t len = static_cast<std::size_t>(data[0]) | static_cast<std::size_t>(data[1]) << 8;
    p += 2, data += 2, size -= 2;
    if (len > size) len = size;
    agg.advance(static_cast<double>(datagrams));  // one second per datagram: members silent for 8 are evicted
    sw::packet_header in;
    const bool readable = agg.validate(std::span<const std::byte>(p, len), in) != sw::drop_reason::too_short;
    const auto why = agg.handle(std::span<const std::byte>(p, len), [&](std::uint16_t worker, std::span<const std::byte> reply) {
      sw::packet_header h;
      if (!sw::read_header(reply.data(), reply.size(), h)) std::abort();
      const auto* g = agg.config(h.group);
      if (h.type == sw::packet_type::sync_pending) {
        // To a member whose share the waiting set holds: header, then the holders' bitmap.
        std::uint64_t holders = 0;
        if (!g || g->mode != sw::group_mode::sync || reply.size() != sw::pending_bytes || h.elements != 0 || worker != h.worker ||
            worker >= g->members || h.magic != sw::packet_header::magic_value)
          std::abort();
        std::memcpy(&holders, reply.data() + sizeof h, sizeof holders);
        if (!((holders >> worker) & 1u) || (g->members < 64 && (holders >> g->members) != 0) ||
            h.count != static_cast<std::uint32_t>(std::popcount(holders)) || h.count >= g->members)
          std::abort();
        return;
      }
      if (!g || worker != h.worker || worker >= g->members || h.elements > g->chunk ||
          reply.size() != sw::packet_bytes(h.elements) || h.magic != sw::packet_header::magic_value)
        std::abort();
      if (h.type != sw::packet_type::sync_result && h.type != sw::packet_type::async_reply && h.type != sw::packet_type::async_rejoin)
        std::abort();
      if (h.type == sw::packet_type::async_rejoin && (h.elements != 0 || h.group != 3)) std::abort();  // header only, async group only
    });
    // A refusal answers only a readable packet at odds with its group (or of
    // another version), echoes it (another version's: nothing) and is never
    // answered itself; another version's refusal is not answered either.
    const bool versions_refusal = why == sw::drop_reason::bad_version && in.type == sw::packet_type::refused;
    if (sw::packet_header r; agg.refusal(in, why, r)) {
      if (!readable || !sw::refusable(why) || versions_refusal || r.type != sw::packet_type::refused ||
          r.flags != static_cast<std::uint8_t>(why) || r.magic != sw::packet_header::magic_value)
        std::abort();
      const sw::packet_header none{.type = sw::packet_type::refused, .flags = r.flags};
      if (why == sw::drop_reason::bad_version ? std::memcmp(&r, &none, sizeof r) != 0
                                              : r.group != in.group || r.worker != in.worker || r.session != in.session || r.chunk != in.chunk ||
                                                    (agg.config(in.group) == nullptr) != (r.reserved == 0))
        std::abort();
      sw::packet_header back;
      if (agg.validate(std::as_bytes(std::span(&r, 1)), back) != sw::drop_reason::bad_type) std::abort();
    } else if (sw::refusable(why) && !versions_refusal) {
      std::abort();
    }
    ++datagrams;
    p += len, data += len, size -= len;
  }
  const auto& st = agg.stats();
  if (st.accepted() + st.dropped() != datagrams) std::abort();
  if (agg.async_joined(3) > 3) std::abort();
  return 0;
}

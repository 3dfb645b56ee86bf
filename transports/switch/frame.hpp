#pragma once
/// The Ethernet frames of gossip-switch (dpdk_switch.hpp), as bytes: what a
/// received frame is (an IPv4/UDP datagram for the switch, an ARP request
/// for its IP, or a drop and its reason), and the frames it sends back (the
/// ARP reply, a UDP datagram to a member). Nothing here depends on DPDK:
/// dpdk_switch.hpp hands these functions an mbuf's data, and fuzz_switch_frame
/// and the unit tests call them on plain buffers.
///
///     const auto v = gossip::sw::detail::parse_frame(frame, switch_ip, 47000);
///     if (v.kind == frame_kind::udp) aggregate(v.payload);
///
/// What parse_frame() accepts as a datagram for the switch, in the order it
/// checks (the first rule broken is the drop's reason):
///   - ethertype 0x0800 (else not_ipv4; 0x0806 is ARP, below), at least 14 bytes (else not_ipv4);
///   - IPv4: version 4, a header of 20 to 60 bytes, a total length from the
///     header's length up to the bytes after the Ethernet header (frames may
///     be padded past the datagram, never short of it), a header checksum
///     that verifies, not a fragment (else bad_ip); to the switch's IP (else
///     not_for_us); UDP (else not_udp);
///   - UDP: an 8-byte header and a length from 8 up to the IP datagram's
///     payload (else bad_ip); to the switch's port (else wrong_port).
/// The IPv4 header checksum is verified, so that an IP header damaged on the
/// way does not teach the switch a wrong IP address for a member
/// (dpdk_switch.hpp learns a member's address from its last datagram). The
/// UDP checksum is not (kernel senders on a veth hand af_packet a partial
/// one), so nothing here catches damage to the UDP ports or the payload
/// (the aggregator refuses a payload at odds with its group); the Ethernet
/// frame's own check is the NIC's. The payload is the UDP length's
/// bytes after the UDP header, inside the frame.
///
/// ARP (ethertype 0x0806): at least 14 + 28 bytes, Ethernet/IPv4 (hardware
/// type 1, protocol 0x0800, lengths 6 and 4), else a drop (not_ipv4). A
/// request (operation 1) for the switch's IP is answered; any other ARP
/// packet is someone else's business: ignored, not a drop.
///
/// Every field is read with bounds checks against the length given: no
/// byte outside [frame, frame + size) is read. Addresses and ports in a
/// frame_view are as on the wire (network order).
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "packet.hpp"

namespace gossip::sw::detail {

inline constexpr std::uint16_t ether_type_ipv4 = 0x0800;
inline constexpr std::uint16_t ether_type_arp = 0x0806;
inline constexpr std::uint8_t ip_proto_udp = 17;
inline constexpr std::size_t ether_bytes = 14;  ///< Ethernet header (no VLAN tag)
inline constexpr std::size_t arp_bytes = 28;    ///< ARP for Ethernet/IPv4
/// An ARP reply: the minimum Ethernet frame (without FCS), zero-padded.
inline constexpr std::size_t arp_reply_bytes = 60;
/// Ethernet + IPv4 (no options) + UDP headers of a datagram the switch sends.
inline constexpr std::size_t udp_frame_overhead = ether_bytes + 20 + 8;
/// The largest payload a UDP frame can carry: the IPv4 total length is 16 bits.
inline constexpr std::size_t max_udp_payload = 0xffff - 20 - 8;

using mac_address = std::array<std::uint8_t, 6>;

enum class frame_kind : std::uint8_t {
  dropped,      ///< counted under `why`
  udp,          ///< a datagram to the switch's IP and UDP port: `payload`, from `src_*`
  arp_request,  ///< an ARP request for the switch's IP: answer with build_arp_reply()
  arp_other,    ///< any other well-formed ARP packet: ignored, not a drop
};

/// What parse_frame() found. Fields not named for a kind are zero/empty.
struct frame_view {
  frame_kind kind = frame_kind::dropped;
  drop_reason why = drop_reason::accepted;  ///< dropped: the reason; otherwise accepted
  mac_address src_mac{};                    ///< udp, arp_*: the Ethernet source
  std::uint32_t src_ip = 0;                 ///< udp: the IPv4 source; arp_*: the ARP sender's IP
  std::uint16_t src_port = 0;               ///< udp: the UDP source port
  mac_address arp_sender_mac{};             ///< arp_*: the ARP sender's hardware address
  std::span<const std::uint8_t> payload{};  ///< udp: the UDP payload, inside the frame
};

inline std::uint16_t be16(const std::uint8_t* p) noexcept { return static_cast<std::uint16_t>(p[0] << 8 | p[1]); }

inline frame_view frame_dropped(drop_reason why) noexcept { return {.why = why}; }

/// The IPv4 header checksum of `bytes` bytes at `h` (its checksum field
/// zero), as rte_ipv4_cksum() computes it: stored with memcpy, it is in
/// network order. Over a header that holds its checksum, 0.
inline std::uint16_t ipv4_checksum(const std::uint8_t* h, std::size_t bytes) noexcept {
  std::uint32_t sum = 0;
  for (std::size_t i = 0; i + 1 < bytes; i += 2) {
    std::uint16_t w;
    std::memcpy(&w, h + i, 2);
    sum += w;
  }
  if (bytes % 2) sum += h[bytes - 1];
  sum = (sum >> 16) + (sum & 0xffff);
  sum = (sum >> 16) + (sum & 0xffff);
  return static_cast<std::uint16_t>(~sum);
}

/// The ARP part of parse_frame(): `f` holds `len` bytes, ethertype ARP.
inline frame_view parse_arp(const std::uint8_t* f, std::size_t len, std::uint32_t ip) noexcept {
  if (len < ether_bytes + arp_bytes) return frame_dropped(drop_reason::not_ipv4);
  const std::uint8_t* a = f + ether_bytes;
  if (be16(a) != 1 || be16(a + 2) != ether_type_ipv4 || a[4] != 6 || a[5] != 4) return frame_dropped(drop_reason::not_ipv4);
  frame_view v{.kind = frame_kind::arp_other};
  std::memcpy(v.src_mac.data(), f + 6, 6);
  std::memcpy(v.arp_sender_mac.data(), a + 8, 6);
  std::memcpy(&v.src_ip, a + 14, 4);
  std::uint32_t target;
  std::memcpy(&target, a + 24, 4);
  if (be16(a + 6) == 1 && target == ip) v.kind = frame_kind::arp_request;
  return v;
}

/// A received frame of `len` bytes at `f`, for a switch at `ip` (network
/// order) serving UDP port `udp_port` (host order); see above.
inline frame_view parse_frame(const std::uint8_t* f, std::size_t len, std::uint32_t ip, std::uint16_t udp_port) noexcept {
  if (len < ether_bytes) return frame_dropped(drop_reason::not_ipv4);
  const std::uint16_t type = be16(f + 12);
  if (type == ether_type_arp) return parse_arp(f, len, ip);
  if (type != ether_type_ipv4) return frame_dropped(drop_reason::not_ipv4);
  const std::uint8_t* iph = f + ether_bytes;
  const std::size_t ip_room = len - ether_bytes;
  if (ip_room < 20 || (iph[0] >> 4) != 4) return frame_dropped(drop_reason::bad_ip);
  const std::size_t ihl = static_cast<std::size_t>(iph[0] & 0x0f) * 4;
  const std::size_t total = be16(iph + 2);
  // Frames may be padded past the IP datagram (60-byte minimum), never short of it.
  if (ihl < 20 || total < ihl || total > ip_room) return frame_dropped(drop_reason::bad_ip);
  if (ipv4_checksum(iph, ihl) != 0) return frame_dropped(drop_reason::bad_ip);  // over a valid header, with its checksum: 0
  if ((be16(iph + 6) & 0x3fff) != 0) return frame_dropped(drop_reason::bad_ip);  // fragment
  std::uint32_t dst;
  std::memcpy(&dst, iph + 16, 4);
  if (dst != ip) return frame_dropped(drop_reason::not_for_us);
  if (iph[9] != ip_proto_udp) return frame_dropped(drop_reason::not_udp);
  const std::uint8_t* udp = iph + ihl;
  if (total - ihl < 8) return frame_dropped(drop_reason::bad_ip);
  const std::size_t udp_len = be16(udp + 4);
  if (udp_len < 8 || udp_len > total - ihl) return frame_dropped(drop_reason::bad_ip);
  if (be16(udp + 2) != udp_port) return frame_dropped(drop_reason::wrong_port);
  frame_view v{.kind = frame_kind::udp, .payload = {udp + 8, udp_len - 8}};
  std::memcpy(v.src_mac.data(), f + 6, 6);
  std::memcpy(&v.src_ip, iph + 12, 4);
  std::memcpy(&v.src_port, udp, 2);
  return v;
}

/// The reply to an ARP request parse_frame() classified as arp_request:
/// arp_reply_bytes written to `out`, from the switch at `mac`, `ip`
/// (network order) to the asker's Ethernet address and the ARP sender.
inline void build_arp_reply(std::span<std::uint8_t, arp_reply_bytes> out, const frame_view& request, const mac_address& mac,
                            std::uint32_t ip) noexcept {
  std::uint8_t* o = out.data();
  std::memset(o, 0, arp_reply_bytes);
  std::memcpy(o, request.src_mac.data(), 6);  // to the asker
  std::memcpy(o + 6, mac.data(), 6);
  o[12] = 0x08, o[13] = 0x06;
  std::uint8_t* ra = o + ether_bytes;
  ra[1] = 1, ra[2] = 0x08, ra[3] = 0x00, ra[4] = 6, ra[5] = 4, ra[7] = 2;  // Ethernet/IPv4, reply
  std::memcpy(ra + 8, mac.data(), 6);  // sender: the switch
  std::memcpy(ra + 14, &ip, 4);
  std::memcpy(ra + 18, request.arp_sender_mac.data(), 6);  // target: the asker's MAC and IP
  std::memcpy(ra + 24, &request.src_ip, 4);
}

/// Where a UDP frame from the switch goes. Addresses and `dst_port` in
/// network order (as a frame_view has them); `src_port` in host order.
struct udp_route {
  mac_address dst_mac{}, src_mac{};
  std::uint32_t dst_ip = 0, src_ip = 0;
  std::uint16_t dst_port = 0;
  std::uint16_t src_port = 0;
};

/// Writes an Ethernet/IPv4/UDP frame around `payload` to `out`: IPv4 header
/// of 20 bytes with identification `ip_id`, don't-fragment, TTL 64 and its
/// checksum; UDP checksum 0 (none). Returns its size, udp_frame_overhead +
/// payload.size(), or 0 (nothing written) when it does not fit `out` or
/// the payload is over max_udp_payload.
inline std::size_t build_udp_frame(std::span<std::uint8_t> out, const udp_route& r, std::uint16_t ip_id,
                                   std::span<const std::byte> payload) noexcept {
  if (payload.size() > max_udp_payload || out.size() < udp_frame_overhead + payload.size()) return 0;
  std::uint8_t* o = out.data();
  std::memcpy(o, r.dst_mac.data(), 6);
  std::memcpy(o + 6, r.src_mac.data(), 6);
  o[12] = 0x08, o[13] = 0x00;
  std::uint8_t* iph = o + ether_bytes;
  std::memset(iph, 0, 20);
  iph[0] = 0x45;
  const auto ip_len = static_cast<std::uint16_t>(20 + 8 + payload.size());
  iph[2] = static_cast<std::uint8_t>(ip_len >> 8), iph[3] = static_cast<std::uint8_t>(ip_len);
  iph[4] = static_cast<std::uint8_t>(ip_id >> 8), iph[5] = static_cast<std::uint8_t>(ip_id);
  iph[6] = 0x40;  // don't fragment
  iph[8] = 64;
  iph[9] = ip_proto_udp;
  std::memcpy(iph + 12, &r.src_ip, 4);
  std::memcpy(iph + 16, &r.dst_ip, 4);
  const std::uint16_t ck = ipv4_checksum(iph, 20);
  std::memcpy(iph + 10, &ck, 2);
  std::uint8_t* udp = iph + 20;
  udp[0] = static_cast<std::uint8_t>(r.src_port >> 8), udp[1] = static_cast<std::uint8_t>(r.src_port);
  std::memcpy(udp + 2, &r.dst_port, 2);
  const auto ulen = static_cast<std::uint16_t>(8 + payload.size());
  udp[4] = static_cast<std::uint8_t>(ulen >> 8), udp[5] = static_cast<std::uint8_t>(ulen);
  udp[6] = udp[7] = 0;  // no UDP checksum
  if (!payload.empty()) std::memcpy(udp + 8, payload.data(), payload.size());
  return udp_frame_overhead + payload.size();
}

}  // namespace gossip::sw::detail

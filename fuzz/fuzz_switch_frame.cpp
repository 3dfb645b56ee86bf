// Ethernet frames into gossip-switch (transports/switch/frame.hpp, the byte
// parsing of dpdk_switch.hpp): what a received frame is (an IPv4/UDP datagram
// for the switch, an ARP request for its IP, or a drop and its reason), and
// the frames built in answer (the ARP reply, a UDP datagram to the sender).
//
// Input: byte 0 of setup, then the frame. Setup: bits 0-5 how many bytes of
// padding (bits 6-7: which byte) the padding check appends. The switch is
// 10.77.0.1, UDP port 47000, MAC 02:00:00:00:00:fe.
// Checked besides memory safety (every frame in a heap buffer of its own
// size): parsing is deterministic; a frame is dropped exactly when the first
// rule frame.hpp lists that it breaks says so, under that rule's reason, and
// an accepted datagram's payload and sender are the bytes the headers point
// at, inside the frame and the IP datagram; an accepted frame is accepted
// alike with padding behind it and cut to its IP datagram (or ARP packet),
// and dropped one byte shorter; a header whose IPv4 checksum does not verify
// is dropped (bad_ip), and no UDP checksum, TTL, identification or payload
// byte changes what is accepted; another switch IP or port drops it (or
// ignores the ARP request); the ARP reply and a UDP frame built to the sender
// are well-formed (the IPv4 header checksum verifies), fit their buffers
// exactly (one byte less writes nothing), and parse back as what they are.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "frame.hpp"

namespace sw = gossip::sw;
namespace fd = gossip::sw::detail;

namespace {

[[noreturn]] void fail() { std::abort(); }

constexpr std::uint8_t switch_ip_bytes[4] = {10, 77, 0, 1};
constexpr std::uint16_t switch_port = 47000;
constexpr fd::mac_address switch_mac = {0x02, 0, 0, 0, 0, 0xfe};

std::uint32_t ip_of(const std::uint8_t* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
const std::uint32_t switch_ip = ip_of(switch_ip_bytes);

std::uint16_t get16(const std::uint8_t* p) { return static_cast<std::uint16_t>(p[0] << 8 | p[1]); }
std::uint16_t swap16(std::uint16_t v) { return static_cast<std::uint16_t>(v >> 8 | v << 8); }

// The frame in a buffer of exactly its size, so that ASan sees any byte read past it.
std::vector<std::uint8_t> exact(const std::uint8_t* p, std::size_t n) { return std::vector<std::uint8_t>(p, p + n); }

fd::frame_view parse(const std::vector<std::uint8_t>& f, std::uint32_t ip = switch_ip, std::uint16_t port = switch_port) {
  return fd::parse_frame(f.data(), f.size(), ip, port);
}

// The same view; the payload at the same offset of each frame.
bool same(const fd::frame_view& a, const std::uint8_t* fa, const fd::frame_view& b, const std::uint8_t* fb) {
  if (a.kind != b.kind || a.why != b.why || a.src_mac != b.src_mac || a.src_ip != b.src_ip || a.src_port != b.src_port ||
      a.arp_sender_mac != b.arp_sender_mac || a.payload.size() != b.payload.size())
    return false;
  if (a.kind == fd::frame_kind::udp) return a.payload.data() - fa == b.payload.data() - fb;
  return a.payload.data() == nullptr && b.payload.data() == nullptr;
}

// The ones' complement sum of a header with its checksum, big-endian words: all ones when it verifies.
bool checksum_ok(const std::uint8_t* h, std::size_t n) {
  std::uint32_t s = 0;
  for (std::size_t i = 0; i < n; i += 2) s += get16(h + i);
  while (s >> 16) s = (s & 0xffff) + (s >> 16);
  return s == 0xffff;
}

// frame.hpp's rules, in its order: the expected drop reason, accepted for a
// datagram to the switch, nullopt for ARP (checked apart).
std::optional<sw::drop_reason> expected(const std::vector<std::uint8_t>& f) {
  using sw::drop_reason;
  const std::size_t n = f.size();
  if (n < 14) return drop_reason::not_ipv4;
  if (get16(&f[12]) == 0x0806) return std::nullopt;
  if (get16(&f[12]) != 0x0800) return drop_reason::not_ipv4;
  if (n < 34 || f[14] >> 4 != 4) return drop_reason::bad_ip;
  const std::size_t ihl = (f[14] & 15u) * 4, total = get16(&f[16]);
  if (ihl < 20 || total < ihl || 14 + total > n) return drop_reason::bad_ip;
  if (!checksum_ok(&f[14], ihl)) return drop_reason::bad_ip;
  if (f[20] & 0x3f || f[21]) return drop_reason::bad_ip;  // more fragments or an offset
  if (ip_of(&f[30]) != switch_ip) return drop_reason::not_for_us;
  if (f[23] != 17) return drop_reason::not_udp;
  if (total < ihl + 8) return drop_reason::bad_ip;
  const std::size_t udp = 14 + ihl, udp_len = get16(&f[udp + 4]);
  if (udp_len < 8 || ihl + udp_len > total) return drop_reason::bad_ip;
  if (get16(&f[udp + 2]) != switch_port) return drop_reason::wrong_port;
  return drop_reason::accepted;
}

void check_arp(const std::vector<std::uint8_t>& f, const fd::frame_view& v) {
  const std::uint8_t* a = f.data() + 14;
  if (f.size() < 42 || get16(a) != 1 || get16(a + 2) != 0x0800 || a[4] != 6 || a[5] != 4) {
    if (v.kind != fd::frame_kind::dropped || v.why != sw::drop_reason::not_ipv4) fail();
    return;
  }
  const bool request = get16(a + 6) == 1 && ip_of(a + 24) == switch_ip;
  if (v.kind != (request ? fd::frame_kind::arp_request : fd::frame_kind::arp_other) || v.why != sw::drop_reason::accepted) fail();
  if (std::memcmp(v.src_mac.data(), &f[6], 6) != 0 || std::memcmp(v.arp_sender_mac.data(), a + 8, 6) != 0 || v.src_ip != ip_of(a + 14))
    fail();
  if (!v.payload.empty()) fail();
}

void check_udp(const std::vector<std::uint8_t>& f, const fd::frame_view& v) {
  const std::size_t ihl = (f[14] & 15u) * 4, total = get16(&f[16]), udp = 14 + ihl;
  if (v.payload.data() != f.data() + udp + 8 || v.payload.size() + 8 != get16(&f[udp + 4])) fail();
  // Inside the IP datagram, which is inside the frame.
  if (udp + 8 + v.payload.size() > 14 + total || 14 + total > f.size()) fail();
  if (std::memcmp(v.src_mac.data(), &f[6], 6) != 0 || v.src_ip != ip_of(&f[26]) || std::memcmp(&v.src_port, &f[udp], 2) != 0) fail();
  if (v.arp_sender_mac != fd::mac_address{}) fail();
}

void check_arp_reply(const fd::frame_view& req) {
  std::vector<std::uint8_t> r(fd::arp_reply_bytes, 0xa5);
  fd::build_arp_reply(std::span<std::uint8_t, fd::arp_reply_bytes>(r.data(), r.size()), req, switch_mac, switch_ip);
  const std::uint8_t* a = r.data() + 14;
  if (std::memcmp(r.data(), req.src_mac.data(), 6) != 0 || std::memcmp(&r[6], switch_mac.data(), 6) != 0 || get16(&r[12]) != 0x0806) fail();
  if (get16(a) != 1 || get16(a + 2) != 0x0800 || a[4] != 6 || a[5] != 4 || get16(a + 6) != 2) fail();
  if (std::memcmp(a + 8, switch_mac.data(), 6) != 0 || ip_of(a + 14) != switch_ip) fail();
  if (std::memcmp(a + 18, req.arp_sender_mac.data(), 6) != 0 || ip_of(a + 24) != req.src_ip) fail();
  for (std::size_t i = 42; i < r.size(); ++i)
    if (r[i] != 0) fail();
  // What the asker sees: an ARP reply from the switch, not a request (so never answered again).
  const auto back = parse(r, req.src_ip);
  if (back.kind != fd::frame_kind::arp_other || back.src_mac != switch_mac || back.arp_sender_mac != switch_mac || back.src_ip != switch_ip) fail();
}

// A UDP frame from the switch to the sender of `v`, carrying `payload`.
void check_udp_reply(const fd::frame_view& v, std::span<const std::byte> payload, std::uint16_t ip_id) {
  const fd::udp_route route{.dst_mac = v.src_mac, .src_mac = switch_mac, .dst_ip = v.src_ip, .src_ip = switch_ip, .dst_port = v.src_port,
                            .src_port = switch_port};
  const std::size_t n = fd::udp_frame_overhead + payload.size();
  // One byte short: refused, nothing written.
  std::vector<std::uint8_t> small(n - 1, 0x5a);
  if (fd::build_udp_frame(small, route, ip_id, payload) != 0) fail();
  for (auto b : small)
    if (b != 0x5a) fail();
  std::vector<std::uint8_t> r(n, 0x5a);
  if (fd::build_udp_frame(r, route, ip_id, payload) != n) fail();
  const std::uint8_t* ip = r.data() + 14;
  const std::uint8_t* udp = ip + 20;
  if (std::memcmp(r.data(), v.src_mac.data(), 6) != 0 || std::memcmp(&r[6], switch_mac.data(), 6) != 0 || get16(&r[12]) != 0x0800) fail();
  if (ip[0] != 0x45 || ip[1] != 0 || get16(ip + 2) != n - 14 || get16(ip + 4) != ip_id || get16(ip + 6) != 0x4000 || ip[8] != 64 || ip[9] != 17)
    fail();
  if (!checksum_ok(ip, 20) || ip_of(ip + 12) != switch_ip || ip_of(ip + 16) != v.src_ip) fail();
  if (get16(udp) != switch_port || std::memcmp(udp + 2, &v.src_port, 2) != 0 || get16(udp + 4) != n - 34 || get16(udp + 6) != 0) fail();
  if (!payload.empty() && std::memcmp(udp + 8, payload.data(), payload.size()) != 0) fail();
  // What the sender sees: a datagram to its address and port, from the switch's.
  const auto back = parse(r, v.src_ip, swap16(v.src_port));
  if (back.kind != fd::frame_kind::udp || back.payload.data() != udp + 8 || back.payload.size() != payload.size()) fail();
  if (back.src_mac != switch_mac || back.src_ip != switch_ip || back.src_port != swap16(switch_port)) fail();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::size_t pad = data[0] & 63;
  const auto pad_byte = static_cast<std::uint8_t>((data[0] >> 6) * 0x55);
  const auto f = exact(data + 1, size - 1);

  const auto v = parse(f);
  if (!same(v, f.data(), parse(f), f.data())) fail();  // deterministic
  if ((v.kind == fd::frame_kind::dropped) != (v.why != sw::drop_reason::accepted)) fail();
  const auto want = expected(f);
  if (want) {
    if (v.why != *want || (v.kind == fd::frame_kind::udp) != (*want == sw::drop_reason::accepted)) fail();
    if (v.kind == fd::frame_kind::dropped && !v.payload.empty()) fail();
  } else {
    check_arp(f, v);
  }
  if (v.kind == fd::frame_kind::dropped) return 0;

  // Accepted frames: the same with padding behind them, cut to what they
  // hold, and dropped one byte short of it.
  auto padded = f;
  padded.insert(padded.end(), pad, pad_byte);
  if (!same(v, f.data(), parse(padded), padded.data())) fail();
  const std::size_t held = v.kind == fd::frame_kind::udp ? 14 + std::size_t{get16(&f[16])} : 42;
  const auto cut = exact(f.data(), held);
  if (!same(v, f.data(), parse(cut), cut.data())) fail();
  const auto shorter = exact(f.data(), held - 1);
  if (parse(shorter).why != (v.kind == fd::frame_kind::udp ? sw::drop_reason::bad_ip : sw::drop_reason::not_ipv4)) fail();

  // Another switch's address or port.
  const std::uint32_t other_ip = switch_ip ^ 0x01000000;  // 10.77.0.0
  const auto elsewhere = parse(f, other_ip);
  if (v.kind == fd::frame_kind::udp && ip_of(&f[30]) != other_ip && elsewhere.why != sw::drop_reason::not_for_us) fail();
  if (v.kind != fd::frame_kind::udp && elsewhere.kind == fd::frame_kind::arp_request && ip_of(&f[38]) != other_ip) fail();
  if (v.kind == fd::frame_kind::udp && parse(f, switch_ip, static_cast<std::uint16_t>(switch_port + 1)).why != sw::drop_reason::wrong_port) fail();

  if (v.kind != fd::frame_kind::udp) {
    if (v.kind == fd::frame_kind::arp_request) check_arp_reply(v);
    return 0;
  }
  check_udp(f, v);

  // Neither the UDP checksum, nor the TOS, identification, TTL or the
  // payload's bytes decide what is accepted, once the IPv4 header's checksum
  // is made right again; a header byte changed without it is dropped.
  auto changed = f;
  const std::size_t ihl = (f[14] & 15u) * 4, udp = 14 + ihl;
  for (std::size_t i : {std::size_t{15}, std::size_t{18}, std::size_t{19}, std::size_t{22}, udp + 6, udp + 7})
    changed[i] = static_cast<std::uint8_t>(~changed[i]);
  for (std::size_t i = udp + 8; i < changed.size(); ++i) changed[i] ^= 0x5a;
  changed[24] = changed[25] = 0;
  const std::uint16_t ck = fd::ipv4_checksum(&changed[14], ihl);
  std::memcpy(&changed[24], &ck, 2);
  if (!same(v, f.data(), parse(changed), changed.data())) fail();
  auto damaged = f;
  damaged[22] = static_cast<std::uint8_t>(~damaged[22]);  // one byte changes its word's sum by an odd multiple of 1 or 256: never 0 mod 0xffff
  if (parse(damaged).why != sw::drop_reason::bad_ip) fail();

  // The answers the switch sends to this sender: the payload back, and a refusal-sized head of it.
  const auto payload = std::as_bytes(v.payload);
  const auto ip_id = get16(&f[18]);
  check_udp_reply(v, payload, ip_id);
  check_udp_reply(v, payload.first(std::min<std::size_t>(payload.size(), sizeof(sw::packet_header))), static_cast<std::uint16_t>(ip_id + 1));
  return 0;
}

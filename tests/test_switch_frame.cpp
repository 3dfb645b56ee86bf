// gossip-switch's frames as bytes, without DPDK (transports/switch/frame.hpp):
// which frames are accepted, the drop reason of each malformed one, the ARP
// reply, and the UDP frames the switch sends.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "transports/switch/frame.hpp"

using namespace gossip::sw;
using namespace gossip::sw::detail;
using bytes = std::vector<std::uint8_t>;

namespace {

constexpr std::uint8_t switch_ip_bytes[4] = {10, 77, 0, 1};
constexpr mac_address switch_mac = {0x02, 0, 0, 0, 0, 0xfe};
constexpr mac_address worker_mac = {0x02, 0, 0, 0, 0, 0x01};

std::uint32_t ip_of(const std::uint8_t* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
const std::uint32_t switch_ip = ip_of(switch_ip_bytes);

void put16(std::uint8_t* p, std::uint16_t v) { p[0] = static_cast<std::uint8_t>(v >> 8), p[1] = static_cast<std::uint8_t>(v); }
std::uint16_t get16(const std::uint8_t* p) { return static_cast<std::uint16_t>(p[0] << 8 | p[1]); }

/// Sets the IPv4 header checksum of frame `f` (header length from its first byte).
void seal(bytes& f) {
  auto* ip = f.data() + 14;
  const std::size_t ihl = static_cast<std::size_t>(ip[0] & 0x0f) * 4;
  ip[10] = ip[11] = 0;
  const std::uint16_t ck = ipv4_checksum(ip, ihl);
  std::memcpy(ip + 10, &ck, 2);
}

/// Ethernet + IPv4 + UDP from 10.77.0.10:40000 to the switch, around `payload_bytes` bytes.
bytes udp_frame(std::size_t payload_bytes) {
  bytes f(14 + 20 + 8 + payload_bytes, 0);
  std::memset(f.data(), 0xff, 6);
  std::memcpy(f.data() + 6, worker_mac.data(), 6);
  put16(f.data() + 12, 0x0800);
  auto* ip = f.data() + 14;
  ip[0] = 0x45, ip[8] = 64, ip[9] = 17;
  put16(ip + 2, static_cast<std::uint16_t>(20 + 8 + payload_bytes));
  const std::uint8_t src[4] = {10, 77, 0, 10};
  std::memcpy(ip + 12, src, 4);
  std::memcpy(ip + 16, switch_ip_bytes, 4);
  auto* udp = ip + 20;
  put16(udp, 40000);
  put16(udp + 2, default_port);
  put16(udp + 4, static_cast<std::uint16_t>(8 + payload_bytes));
  for (std::size_t i = 0; i < payload_bytes; ++i) udp[8 + i] = static_cast<std::uint8_t>(i);
  seal(f);
  return f;
}

bytes arp_request(const std::uint8_t (&target)[4]) {
  bytes f(60, 0);
  std::memset(f.data(), 0xff, 6);
  std::memcpy(f.data() + 6, worker_mac.data(), 6);
  put16(f.data() + 12, 0x0806);
  auto* a = f.data() + 14;
  put16(a, 1), put16(a + 2, 0x0800), a[4] = 6, a[5] = 4, put16(a + 6, 1);
  const mac_address sender = {0x02, 0, 0, 0, 0, 0x21};  // another address than the Ethernet source's
  std::memcpy(a + 8, sender.data(), 6);
  const std::uint8_t ip[4] = {10, 77, 0, 10};
  std::memcpy(a + 14, ip, 4);
  std::memcpy(a + 24, target, 4);
  return f;
}

frame_view parse(const bytes& f, std::uint32_t ip = switch_ip, std::uint16_t port = default_port) {
  return parse_frame(f.data(), f.size(), ip, port);
}

}  // namespace

TEST_CASE("parse_frame accepts a datagram to the switch's IP and port, padded or not, and finds its payload and sender") {
  auto f = udp_frame(36);
  auto v = parse(f);
  REQUIRE(v.kind == frame_kind::udp);
  CHECK(v.why == drop_reason::accepted);
  CHECK(v.payload.data() == f.data() + 42);
  CHECK(v.payload.size() == 36);
  CHECK(v.src_mac == worker_mac);
  CHECK(v.src_ip == ip_of(f.data() + 26));
  CHECK(get16(reinterpret_cast<const std::uint8_t*>(&v.src_port)) == 40000);

  // Ethernet padding past the IP datagram, and a UDP length short of it, are ignored.
  f.resize(f.size() + 20, 0xee);
  put16(f.data() + 38, 8 + 30);
  v = parse(f);
  REQUIRE(v.kind == frame_kind::udp);
  CHECK(v.payload.size() == 30);

  // IP options: the UDP header follows them.
  bytes o = udp_frame(4);
  o.insert(o.begin() + 34, 8, 0x01);  // two NOP-filled option words
  o[14] = 0x47;
  put16(o.data() + 16, 28 + 8 + 4);
  seal(o);
  v = parse(o);
  REQUIRE(v.kind == frame_kind::udp);
  CHECK(v.payload.data() == o.data() + 50);
  CHECK(v.payload.size() == 4);

  // The UDP checksum is not verified; the IPv4 header's is.
  f = udp_frame(8);
  put16(f.data() + 40, 0xbeef);
  CHECK(parse(f).kind == frame_kind::udp);
  put16(f.data() + 24, static_cast<std::uint16_t>(get16(f.data() + 24) ^ 1));
  CHECK(parse(f).why == drop_reason::bad_ip);
  // A header damaged on the way (here its source address) does not verify,
  // so its datagram teaches no one a wrong address.
  f = udp_frame(8);
  f[29] ^= 0x40;
  CHECK(parse(f).why == drop_reason::bad_ip);
  seal(f);
  CHECK(parse(f).kind == frame_kind::udp);
}

TEST_CASE("parse_frame drops each malformed frame under its reason, reading nothing past it") {
  const auto good = udp_frame(8);
  struct bad_case {
    const char* what;
    drop_reason why;
    bytes frame;
  };
  std::vector<bad_case> cases;
  // Each edit but the checksum's keeps the header's checksum right, so that
  // the drop is for what it changed.
  auto edit = [&](const char* what, drop_reason why, auto&& change, bool reseal = true) {
    bytes f = good;
    change(f);
    if (reseal && f.size() >= 14 + 20 && get16(f.data() + 12) == 0x0800 && f.size() >= 14 + std::size_t{4} * (f[14] & 0x0f)) seal(f);
    cases.push_back({what, why, f});
  };
  edit("empty", drop_reason::not_ipv4, [](bytes& f) { f.clear(); });
  edit("runt frame", drop_reason::not_ipv4, [](bytes& f) { f.resize(13); });
  edit("Ethernet header only", drop_reason::bad_ip, [](bytes& f) { f.resize(14); });
  edit("IPv6 ethertype", drop_reason::not_ipv4, [](bytes& f) { put16(f.data() + 12, 0x86dd); });
  edit("VLAN tag", drop_reason::not_ipv4, [](bytes& f) { put16(f.data() + 12, 0x8100); });
  edit("IP header cut short", drop_reason::bad_ip, [](bytes& f) { f.resize(14 + 19); });
  edit("IP version 6", drop_reason::bad_ip, [](bytes& f) { f[14] = 0x65; });
  edit("IP header of 16 bytes", drop_reason::bad_ip, [](bytes& f) { f[14] = 0x44; });
  edit("IP header longer than the datagram", drop_reason::bad_ip, [](bytes& f) { f[14] = 0x4f; });
  edit("IP total length past the frame", drop_reason::bad_ip, [](bytes& f) { put16(f.data() + 16, static_cast<std::uint16_t>(f.size() - 13)); });
  edit("IP header checksum wrong", drop_reason::bad_ip, [](bytes& f) { f[25] ^= 0x10; }, false);
  edit("IP header changed after its checksum", drop_reason::bad_ip, [](bytes& f) { f[33] = 2; }, false);
  edit("more fragments", drop_reason::bad_ip, [](bytes& f) { f[20] = 0x20; });
  edit("fragment offset", drop_reason::bad_ip, [](bytes& f) { f[21] = 1; });
  edit("someone else's IP", drop_reason::not_for_us, [](bytes& f) { f[33] = 2; });
  edit("TCP", drop_reason::not_udp, [](bytes& f) { f[23] = 6; });
  edit("IP datagram shorter than a UDP header", drop_reason::bad_ip, [](bytes& f) { put16(f.data() + 16, 20 + 7); });
  edit("UDP length past the IP datagram", drop_reason::bad_ip, [](bytes& f) { put16(f.data() + 38, 8 + 9); });
  edit("UDP length below its header", drop_reason::bad_ip, [](bytes& f) { put16(f.data() + 38, 7); });
  edit("another UDP port", drop_reason::wrong_port, [](bytes& f) { put16(f.data() + 36, default_port + 1); });
  for (const auto& c : cases) {
    CAPTURE(c.what);
    const bytes exact(c.frame);  // its own allocation: a sanitizer build sees a read past it
    const auto v = parse_frame(exact.data(), exact.size(), switch_ip, default_port);
    CHECK(v.kind == frame_kind::dropped);
    CHECK(v.why == c.why);
    CHECK(v.payload.empty());
  }
  // Don't-fragment alone is no fragment.
  bytes df = good;
  df[20] = 0x40;
  seal(df);
  CHECK(parse(df).kind == frame_kind::udp);
}

TEST_CASE("ARP: a request for the switch's IP is answered to the asker; other ARP is ignored; malformed ARP is dropped") {
  const auto req = arp_request(switch_ip_bytes);
  const auto v = parse(req);
  REQUIRE(v.kind == frame_kind::arp_request);
  CHECK(v.why == drop_reason::accepted);

  bytes r(arp_reply_bytes, 0xa5);
  build_arp_reply(std::span<std::uint8_t, arp_reply_bytes>(r.data(), r.size()), v, switch_mac, switch_ip);
  CHECK(std::memcmp(r.data(), worker_mac.data(), 6) == 0);  // to the Ethernet source
  CHECK(std::memcmp(r.data() + 6, switch_mac.data(), 6) == 0);
  CHECK(get16(r.data() + 12) == 0x0806);
  const auto* a = r.data() + 14;
  CHECK((get16(a) == 1 && get16(a + 2) == 0x0800 && a[4] == 6 && a[5] == 4));
  CHECK(get16(a + 6) == 2);  // reply
  CHECK(std::memcmp(a + 8, switch_mac.data(), 6) == 0);
  CHECK(ip_of(a + 14) == switch_ip);
  CHECK(std::memcmp(a + 18, req.data() + 14 + 8, 10) == 0);  // the ARP sender's MAC and IP
  for (std::size_t i = 42; i < r.size(); ++i) CHECK(r[i] == 0);
  CHECK(parse(r, v.src_ip).kind == frame_kind::arp_other);  // a reply is never answered

  const std::uint8_t other[4] = {10, 77, 0, 99};
  CHECK(parse(arp_request(other)).kind == frame_kind::arp_other);
  auto reply = req;
  put16(reply.data() + 20, 2);
  CHECK(parse(reply).kind == frame_kind::arp_other);

  auto cut = req;
  cut.resize(41);
  CHECK(parse(cut).why == drop_reason::not_ipv4);
  cut.assign(req.begin(), req.begin() + 42);  // no padding: the ARP packet ends the frame
  CHECK(parse(cut).kind == frame_kind::arp_request);
  auto ipv6 = req;
  put16(ipv6.data() + 16, 0x86dd);
  CHECK(parse(ipv6).why == drop_reason::not_ipv4);
  auto long_mac = req;
  long_mac[18] = 8;
  CHECK(parse(long_mac).why == drop_reason::not_ipv4);
}

TEST_CASE("build_udp_frame: the headers the switch sends, a verifying IPv4 checksum, and nothing written where it does not fit") {
  const auto frame = udp_frame(12);
  const auto in = parse(frame);  // its payload lies in `frame`
  REQUIRE(in.kind == frame_kind::udp);
  const udp_route route{.dst_mac = in.src_mac, .src_mac = switch_mac, .dst_ip = in.src_ip, .src_ip = switch_ip, .dst_port = in.src_port,
                        .src_port = default_port};
  const auto payload = std::as_bytes(in.payload);
  bytes out(udp_frame_overhead + payload.size(), 0x5a);
  REQUIRE(build_udp_frame(out, route, 0x1234, payload) == out.size());
  CHECK(std::memcmp(out.data(), worker_mac.data(), 6) == 0);
  CHECK(std::memcmp(out.data() + 6, switch_mac.data(), 6) == 0);
  CHECK(get16(out.data() + 12) == 0x0800);
  const auto* ip = out.data() + 14;
  CHECK(ip[0] == 0x45);
  CHECK(get16(ip + 2) == 20 + 8 + 12);
  CHECK(get16(ip + 4) == 0x1234);
  CHECK(get16(ip + 6) == 0x4000);  // don't fragment
  CHECK(ip[8] == 64);
  CHECK(ip[9] == 17);
  std::uint32_t sum = 0;
  for (int i = 0; i < 20; i += 2) sum += get16(ip + i);
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  CHECK(sum == 0xffff);
  CHECK(ip_of(ip + 12) == switch_ip);
  CHECK(ip_of(ip + 16) == in.src_ip);
  const auto* udp = ip + 20;
  CHECK(get16(udp) == default_port);
  CHECK(get16(udp + 2) == 40000);
  CHECK(get16(udp + 4) == 8 + 12);
  CHECK(get16(udp + 6) == 0);  // no UDP checksum
  CHECK(std::memcmp(udp + 8, payload.data(), payload.size()) == 0);

  // The worker's side parses it as a datagram from the switch.
  const auto back = parse(out, in.src_ip, 40000);
  REQUIRE(back.kind == frame_kind::udp);
  CHECK(back.src_ip == switch_ip);
  CHECK(back.payload.size() == 12);

  // A header whose checksum is known (192.168.0.1 -> 192.168.0.199, UDP, 115 bytes).
  const std::uint8_t hdr[20] = {0x45, 0, 0, 0x73, 0, 0, 0x40, 0, 0x40, 0x11, 0, 0, 0xc0, 0xa8, 0, 1, 0xc0, 0xa8, 0, 0xc7};
  const std::uint16_t ck = ipv4_checksum(hdr, 20);
  CHECK(get16(reinterpret_cast<const std::uint8_t*>(&ck)) == 0xb861);

  // One byte short of the frame, or a payload the IPv4 length cannot say: 0, nothing written.
  bytes small(out.size() - 1, 0x5a);
  CHECK(build_udp_frame(small, route, 1, payload) == 0);
  CHECK(std::all_of(small.begin(), small.end(), [](std::uint8_t b) { return b == 0x5a; }));
  std::vector<std::byte> huge(max_udp_payload + 1);
  bytes big(udp_frame_overhead + huge.size(), 0x5a);
  CHECK(build_udp_frame(big, route, 1, huge) == 0);
  huge.pop_back();
  CHECK(build_udp_frame(big, route, 1, huge) == udp_frame_overhead + max_udp_payload);
  CHECK(get16(big.data() + 16) == 0xffff);
}

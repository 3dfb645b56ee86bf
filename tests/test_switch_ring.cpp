// The packet path of gossip-switch (dpdk_switch.hpp) inside one process: an
// ethdev built by rte_eth_from_rings, whose rx ring the test fills with
// Ethernet frames and whose tx ring it drains after each poll. Checks ARP,
// replies (addresses, checksums, sums) and the drop counter of every kind of
// malformed frame; and that frame.hpp computes checksums as DPDK does.
// Skips (77) where EAL cannot start.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_eth_ring.h>
#include <rte_ip.h>
#include <rte_ring.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "transports/switch/dpdk_switch.hpp"

using namespace gossip::sw;
using bytes = std::vector<std::uint8_t>;

namespace {

constexpr std::uint8_t switch_ip[4] = {10, 77, 0, 1};

struct endpoint {
  std::uint8_t mac_last;
  std::uint8_t ip_last;
  std::uint16_t udp_port;
};

void put16(std::uint8_t* p, std::uint16_t v) { p[0] = static_cast<std::uint8_t>(v >> 8), p[1] = static_cast<std::uint8_t>(v); }
std::uint16_t get16(const std::uint8_t* p) { return static_cast<std::uint16_t>(p[0] << 8 | p[1]); }

/// Sets the IPv4 header checksum of frame `f` as DPDK computes it.
void seal(bytes& f) {
  auto* ip = f.data() + 14;
  rte_ipv4_hdr hdr;
  std::memcpy(&hdr, ip, 20);
  hdr.hdr_checksum = 0;
  const std::uint16_t ck = rte_ipv4_cksum(&hdr);
  std::memcpy(ip + 10, &ck, 2);
}

/// Ethernet + IPv4 + UDP around `payload`, valid unless a caller edits it.
bytes udp_frame(const endpoint& from, std::span<const std::byte> payload, std::uint16_t dport = default_port) {
  bytes f(14 + 20 + 8 + payload.size(), 0);
  std::memset(f.data(), 0xff, 6);
  const std::uint8_t mac[6] = {0x02, 0, 0, 0, 0, from.mac_last};
  std::memcpy(f.data() + 6, mac, 6);
  put16(f.data() + 12, 0x0800);
  auto* ip = f.data() + 14;
  ip[0] = 0x45, ip[8] = 64, ip[9] = IPPROTO_UDP;
  put16(ip + 2, static_cast<std::uint16_t>(20 + 8 + payload.size()));
  const std::uint8_t src[4] = {10, 77, 0, from.ip_last};
  std::memcpy(ip + 12, src, 4);
  std::memcpy(ip + 16, switch_ip, 4);
  auto* udp = ip + 20;
  put16(udp, from.udp_port);
  put16(udp + 2, dport);
  put16(udp + 4, static_cast<std::uint16_t>(8 + payload.size()));
  std::memcpy(udp + 8, payload.data(), payload.size());
  seal(f);
  return f;
}

std::vector<std::byte> packet(packet_header h, const std::vector<float>& v) {
  h.elements = static_cast<std::uint16_t>(v.size());
  std::vector<std::byte> p(packet_bytes(v.size()));
  std::memcpy(p.data(), &h, sizeof h);
  if (!v.empty()) std::memcpy(p.data() + sizeof h, v.data(), v.size() * sizeof(float));
  return p;
}

bytes arp_request(const endpoint& from, const std::uint8_t (&target)[4]) {
  bytes f(60, 0);
  std::memset(f.data(), 0xff, 6);
  const std::uint8_t mac[6] = {0x02, 0, 0, 0, 0, from.mac_last};
  std::memcpy(f.data() + 6, mac, 6);
  put16(f.data() + 12, 0x0806);
  auto* a = f.data() + 14;
  put16(a, 1), put16(a + 2, 0x0800), a[4] = 6, a[5] = 4, put16(a + 6, 1);
  std::memcpy(a + 8, mac, 6);
  const std::uint8_t ip[4] = {10, 77, 0, from.ip_last};
  std::memcpy(a + 14, ip, 4);
  std::memcpy(a + 24, target, 4);
  return f;
}

/// One switch on one ring port; frames in through rx, replies out through tx.
struct ring_switch {
  rte_ring* rx = nullptr;
  rte_ring* tx = nullptr;
  rte_mempool* pool = nullptr;
  dpdk_switch sw;

  ring_switch()
      : sw({.ip = "10.77.0.1", .mbufs = 1023},
           {group_config{.id = 1, .mode = group_mode::sync, .members = 2, .chunk = 4, .slots = 2},
            group_config{.id = 2, .mode = group_mode::async, .members = 2, .chunk = 4, .elements = 6}}) {
    rx = rte_ring_create("gsw_test_rx", 1024, static_cast<int>(rte_socket_id()), RING_F_SP_ENQ | RING_F_SC_DEQ);
    tx = rte_ring_create("gsw_test_tx", 1024, static_cast<int>(rte_socket_id()), RING_F_SP_ENQ | RING_F_SC_DEQ);
    pool = rte_pktmbuf_pool_create("gsw_test_pool", 511, 0, 0, RTE_MBUF_DEFAULT_BUF_SIZE, static_cast<int>(rte_socket_id()));
    REQUIRE(rx);
    REQUIRE(tx);
    REQUIRE(pool);
    const int port = rte_eth_from_rings("net_ring_gsw", &rx, 1, &tx, 1, rte_socket_id());
    REQUIRE(port >= 0);
    sw.add_port(static_cast<std::uint16_t>(port));
  }
  ~ring_switch() { sw.stop(); }

  /// Injects `frames`, polls once, returns what the switch transmitted.
  std::vector<bytes> exchange(const std::vector<bytes>& frames) {
    for (const auto& f : frames) {
      rte_mbuf* m = rte_pktmbuf_alloc(pool);
      REQUIRE(m);
      auto* d = rte_pktmbuf_append(m, static_cast<std::uint16_t>(f.size()));
      REQUIRE(d);
      std::memcpy(d, f.data(), f.size());
      REQUIRE(rte_ring_enqueue(rx, m) == 0);
    }
    while (sw.poll() > 0) {
    }
    std::vector<bytes> out;
    void* obj;
    while (rte_ring_dequeue(tx, &obj) == 0) {
      auto* m = static_cast<rte_mbuf*>(obj);
      const auto* p = rte_pktmbuf_mtod(m, const std::uint8_t*);
      out.emplace_back(p, p + rte_pktmbuf_data_len(m));
      rte_pktmbuf_free(m);
    }
    return out;
  }
  std::uint64_t drops(drop_reason r) const { return sw.agg().stats().drops[static_cast<std::size_t>(r)]; }
};

/// The reply's payload as a header and values, after checking its L2–L4 headers.
std::pair<packet_header, std::vector<float>> check_reply(const bytes& f, const endpoint& to) {
  REQUIRE(f.size() >= 14 + 20 + 8 + sizeof(packet_header));
  CHECK(f[5] == to.mac_last);
  CHECK(get16(f.data() + 12) == 0x0800);
  const auto* ip = f.data() + 14;
  CHECK(ip[0] == 0x45);
  CHECK(get16(ip + 2) == f.size() - 14);
  CHECK(rte_raw_cksum(ip, 20) == 0xffff);  // a valid header checksum sums to all ones
  CHECK(std::memcmp(ip + 12, switch_ip, 4) == 0);
  CHECK(ip[19] == to.ip_last);
  const auto* udp = ip + 20;
  CHECK(get16(udp) == default_port);
  CHECK(get16(udp + 2) == to.udp_port);
  CHECK(get16(udp + 4) == f.size() - 34);
  CHECK(get16(udp + 6) == 0);  // no UDP checksum
  packet_header h;
  std::memcpy(&h, udp + 8, sizeof h);
  if (h.type == packet_type::refused) {  // header only; `elements` is the group's chunk size
    REQUIRE(f.size() == 42 + sizeof h);
    return {h, {}};
  }
  REQUIRE(f.size() == 42 + packet_bytes(h.elements));
  std::vector<float> v(h.elements);
  if (!v.empty()) std::memcpy(v.data(), udp + 8 + sizeof h, v.size() * sizeof(float));
  return {h, v};
}

}  // namespace

TEST_CASE("gossip-switch's packet path on a net_ring port: ARP, replies, and every malformed frame counted") {
  ring_switch rs;
  const endpoint w0{0x01, 10, 40000}, w1{0x02, 11, 40001};

  // ARP for the switch's IP is answered; for anyone else's it is ignored.
  auto out = rs.exchange({arp_request(w0, switch_ip)});
  REQUIRE(out.size() == 1);
  CHECK(get16(out[0].data() + 12) == 0x0806);
  CHECK(get16(out[0].data() + 14 + 6) == 2);  // reply
  CHECK(std::memcmp(out[0].data() + 14 + 14, switch_ip, 4) == 0);
  CHECK(out[0][5] == w0.mac_last);
  const std::uint8_t other[4] = {10, 77, 0, 99};
  CHECK(rs.exchange({arp_request(w0, other)}).empty());
  CHECK(rs.sw.agg().stats().dropped() == 0);

  // Sync: two members, one chunk; the sum goes to each at its own address.
  packet_header s{.type = packet_type::sync_contribution, .group = 1, .worker = 0, .slot = 0, .chunk = 0, .sequence = 1, .session = 7};
  out = rs.exchange({udp_frame(w0, packet(s, {1, 2, 3, 4}))});
  CHECK(out.empty());
  s.worker = 1, s.session = 8;
  out = rs.exchange({udp_frame(w1, packet(s, {10, 20, 30, 40}))});
  REQUIRE(out.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) {
    const auto [h, v] = check_reply(out[i], i == 0 ? w0 : w1);
    CHECK(h.type == packet_type::sync_result);
    CHECK(h.worker == i);
    CHECK(h.session == 7 + i);
    CHECK(v == std::vector<float>{11, 22, 33, 44});
  }

  // Async: a delta is answered with S / joined; frame padding past the IP
  // datagram (short frames are padded to 60 bytes) is ignored.
  packet_header a{.type = packet_type::async_delta, .group = 2, .worker = 1, .chunk = 1, .sequence = 1, .session = 9};
  auto padded = udp_frame(w1, packet(a, {5, 6}));
  padded.resize(padded.size() + 16, 0xee);
  out = rs.exchange({padded});
  REQUIRE(out.size() == 1);
  CHECK(check_reply(out[0], w1).second == std::vector<float>{5, 6});

  // Every malformed frame is dropped and counted under its reason. A packet at
  // odds with its group (refusable()) is answered with a refusal to the
  // address it came from, naming the reason; any other is answered never.
  const auto good = udp_frame(w0, packet({.type = packet_type::async_delta, .group = 2, .worker = 0, .chunk = 1, .sequence = 1, .session = 10}, {1, 1}));
  struct bad_case {
    const char* what;
    bytes frame;
    drop_reason why;
  };
  std::vector<bad_case> cases;
  // Each edit but the checksum's keeps the IPv4 header's checksum right.
  auto edit = [&](const char* what, drop_reason why, auto&& change, bool reseal = true) {
    bytes f = good;
    change(f);
    if (reseal && f.size() >= 34 && (f[14] & 0x0f) == 5) seal(f);
    cases.push_back({what, f, why});
  };
  edit("runt frame", drop_reason::not_ipv4, [](bytes& f) { f.resize(10); });
  edit("IPv6 ethertype", drop_reason::not_ipv4, [](bytes& f) { put16(f.data() + 12, 0x86dd); });
  edit("IP version 6", drop_reason::bad_ip, [](bytes& f) { f[14] = 0x65; });
  edit("IP header of 16 bytes", drop_reason::bad_ip, [](bytes& f) { f[14] = 0x44; });
  edit("IP total length past the frame", drop_reason::bad_ip, [](bytes& f) { put16(f.data() + 16, static_cast<std::uint16_t>(f.size())); });
  edit("IP truncated to its header", drop_reason::bad_ip, [](bytes& f) { f.resize(34 + 4); });
  edit("IP header checksum wrong", drop_reason::bad_ip, [](bytes& f) { f[25] ^= 0x10; }, false);
  edit("source address damaged after the checksum", drop_reason::bad_ip, [](bytes& f) { f[29] ^= 0x40; }, false);
  edit("fragment", drop_reason::bad_ip, [](bytes& f) { f[20] = 0x20; });
  edit("someone else's IP", drop_reason::not_for_us, [](bytes& f) { f[33] = 2; });
  edit("TCP", drop_reason::not_udp, [](bytes& f) { f[23] = IPPROTO_TCP; });
  edit("UDP length past the IP datagram", drop_reason::bad_ip, [](bytes& f) { put16(f.data() + 38, static_cast<std::uint16_t>(f.size())); });
  edit("UDP length below its header", drop_reason::bad_ip, [](bytes& f) { put16(f.data() + 38, 4); });
  edit("another UDP port", drop_reason::wrong_port, [](bytes& f) { put16(f.data() + 36, default_port + 1); });
  edit("bad magic", drop_reason::bad_magic, [](bytes& f) { f[42] ^= 0xff; });
  edit("payload shorter than its element count", drop_reason::bad_length, [](bytes& f) {
    f.resize(f.size() - 4);
    put16(f.data() + 16, static_cast<std::uint16_t>(f.size() - 14));
    put16(f.data() + 38, static_cast<std::uint16_t>(f.size() - 34));
  });
  edit("payload shorter than a header", drop_reason::too_short, [](bytes& f) {
    f.resize(42 + 16);
    put16(f.data() + 16, 20 + 8 + 16);
    put16(f.data() + 38, 8 + 16);
  });
  edit("another wire version", drop_reason::bad_version, [](bytes& f) { f[42 + 4] = 9; });
  edit("unknown group", drop_reason::unknown_group, [](bytes& f) { f[42 + 8] = 77; });
  edit("worker outside the group", drop_reason::bad_worker, [](bytes& f) { f[42 + 10] = 5; });
  std::size_t refusals = 0;
  for (const auto& c : cases) {
    CAPTURE(c.what);
    const auto before = rs.drops(c.why);
    const auto total = rs.sw.agg().stats().dropped();
    const auto answers = rs.exchange({c.frame});
    if (refusable(c.why)) {
      ++refusals;
      REQUIRE(answers.size() == 1);
      const auto [h, v] = check_reply(answers[0], w0);
      CHECK(h.type == packet_type::refused);
      CHECK(h.flags == static_cast<std::uint8_t>(c.why));
      if (c.why == drop_reason::bad_version)  // nothing echoed: the rest of another version's header may be laid out otherwise
        CHECK((h.worker == 0 && h.session == 0));
      else
        CHECK((h.worker == (c.frame[42 + 10] | c.frame[42 + 11] << 8) && h.session == 10));
    } else {
      CHECK(answers.empty());
    }
    CHECK(rs.drops(c.why) == before + 1);
    CHECK(rs.sw.agg().stats().dropped() == total + 1);
  }
  CHECK(refusals == 4);  // bad_length, bad_version, unknown_group, bad_worker

  // All of them at once, then a valid frame: still served.
  std::vector<bytes> burst;
  for (const auto& c : cases) burst.push_back(c.frame);
  const auto total = rs.sw.agg().stats().dropped();
  CHECK(rs.exchange(burst).size() == refusals);
  CHECK(rs.sw.agg().stats().dropped() == total + cases.size());
  out = rs.exchange({good});
  REQUIRE(out.size() == 1);
  CHECK(check_reply(out[0], w0).second == std::vector<float>{3, 3.5f});  // S = {6, 7} over 2 joined

  const auto r = rs.sw.report(1.0);
  REQUIRE(r.ports.size() == 1);
  CHECK(r.arp_replies == 1);
  CHECK(r.ports[0].rx_packets == 2 + 2 + 1 + 2 * cases.size() + 1);
  CHECK(r.ports[0].tx_packets == 1 + 2 + 1 + 2 * refusals + 1);
}

TEST_CASE("frame.hpp's IPv4 header checksum is DPDK's") {
  std::mt19937 rng(5);
  for (int i = 0; i < 10000; ++i) {
    std::uint8_t h[20];
    for (auto& b : h) b = static_cast<std::uint8_t>(rng());
    h[0] = 0x45, h[10] = h[11] = 0;
    if (i == 0) std::memset(h + 1, 0, 19);
    rte_ipv4_hdr hdr;
    std::memcpy(&hdr, h, sizeof hdr);
    CHECK(detail::ipv4_checksum(h, 20) == rte_ipv4_cksum(&hdr));
  }
}

int main(int argc, char** argv) {
  std::vector<std::string> args = {"test_switch_ring", "-l", "0", "--no-huge", "-m", "256", "--no-pci", "--no-shconf", "--no-telemetry",
                                   "--log-level=error"};
  std::vector<char*> eal;
  for (auto& a : args) eal.push_back(a.data());
  if (rte_eal_init(static_cast<int>(eal.size()), eal.data()) < 0) {
    std::printf("SKIP: DPDK EAL cannot start here (%s)\n", rte_strerror(rte_errno));
    return 77;
  }
  doctest::Context ctx(argc, argv);
  const int rc = ctx.run();
  rte_eal_cleanup();
  return rc;
}

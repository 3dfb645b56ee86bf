#pragma once
/// The data path of gossip-switch: Ethernet/ARP/IPv4/UDP on DPDK ports around
/// the aggregator. gossip-switch's main() and the net_ring unit test drive it.
///
///     gossip::sw::dpdk_switch sw({.ip = "10.77.0.1"}, groups);
///     sw.add_port(0);            // configures and starts ethdev port 0
///     while (running) sw.poll(); // rx burst on every port, aggregate, tx burst
///
/// Requests: the switch answers ARP for its IP, accepts IPv4/UDP to its IP and
/// port, and does not verify UDP checksums (kernel senders on a veth hand
/// af_packet a partial checksum). Replies carry a computed IPv4 header
/// checksum and UDP checksum 0 ("none", valid for IPv4), so no offload is
/// needed on either side. A member's address (port, MAC, IP, UDP port) is
/// learned from its last valid packet. Every header is read with bounds
/// checks against the frame's data length; the IP total length and the UDP
/// length must agree with it. The frames' bytes (what is accepted, the ARP
/// reply, a reply's headers) are frame.hpp's, which does not need DPDK.
///
/// Peers that come and go: a net_memif port is only touched while an
/// intr_gate keeps the EAL interrupt thread parked, because that thread
/// unmaps the port's memory when its peer leaves (see intr_gate.hpp). The
/// port stays configured and serves the next peer that connects to it; what
/// is queued for it meanwhile waits for the next slice. net_af_packet needs no
/// gate: its rings are its own socket's and stay mapped until the port closes.
#include <rte_cycles.h>
#include <rte_ethdev.h>
#include <rte_ether.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

#include <arpa/inet.h>

#include <array>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "aggregator.hpp"
#include "frame.hpp"
#include "intr_gate.hpp"
#include "report.hpp"

namespace gossip::sw {

struct dpdk_switch_config {
  std::string ip = "10.77.0.1";   ///< the switch's IPv4 address (ARP and destination check)
  std::uint16_t udp_port = default_port;
  std::uint16_t burst = 32;
  std::uint16_t rx_desc = 1024, tx_desc = 1024;
  std::uint32_t mbufs = 16383;
  double drop = 0;                ///< loss injection on requests and on replies
  std::uint64_t seed = 1;
};

class dpdk_switch {
 public:
  dpdk_switch(dpdk_switch_config cfg, std::vector<group_config> groups)
      : m_cfg(std::move(cfg)), m_groups(groups), m_agg(std::move(groups)), m_drop_rx(m_cfg.drop, m_cfg.seed),
        m_drop_tx(m_cfg.drop, m_cfg.seed * 7919 + 1) {
    in_addr a{};
    if (::inet_pton(AF_INET, m_cfg.ip.c_str(), &a) != 1) throw std::invalid_argument("--ip '" + m_cfg.ip + "' is not an IPv4 address");
    m_ip = a.s_addr;  // network order
    m_members.resize(m_groups.size());
    for (std::size_t i = 0; i < m_groups.size(); ++i) m_members[i].resize(m_groups[i].members);
    m_pool = rte_pktmbuf_pool_create("gsw_mbufs", m_cfg.mbufs, 256, 0, RTE_MBUF_DEFAULT_BUF_SIZE, static_cast<int>(rte_socket_id()));
    if (!m_pool)
      throw std::runtime_error(fmt::format("cannot create a pool of {} mbufs: {} (give EAL more memory, e.g. -m 512, or use fewer --mbufs)",
                                           m_cfg.mbufs, rte_strerror(rte_errno)));
  }
  dpdk_switch(const dpdk_switch&) = delete;
  dpdk_switch& operator=(const dpdk_switch&) = delete;

  /// Configures and starts ethdev `port` with one rx and one tx queue.
  void add_port(std::uint16_t port) {
    if (!rte_eth_dev_is_valid_port(port))
      throw std::invalid_argument(fmt::format("port {} does not exist ({} ports available; add --vdev=... or a NIC)", port, rte_eth_dev_count_avail()));
    rte_eth_conf conf{};
    rte_eth_dev_info info{};
    if (int rc = rte_eth_dev_info_get(port, &info); rc != 0) throw std::runtime_error(fmt::format("port {}: dev_info_get: {}", port, rte_strerror(-rc)));
    std::uint16_t rxd = m_cfg.rx_desc, txd = m_cfg.tx_desc;
    auto check = [&](int rc, const char* what) {
      if (rc < 0) throw std::runtime_error(fmt::format("port {} ({}): {}: {}", port, info.driver_name, what, rte_strerror(-rc)));
    };
    // Drivers that connect and disconnect peers on the EAL interrupt thread.
    const bool gated = std::string_view(info.driver_name) == "net_memif";
    if (gated && !m_gate) m_gate = std::make_unique<intr_gate>("gossip-switch: net_memif ports");
    check(rte_eth_dev_configure(port, 1, 1, &conf), "configure");
    check(rte_eth_dev_adjust_nb_rx_tx_desc(port, &rxd, &txd), "adjust descriptors");
    check(rte_eth_rx_queue_setup(port, 0, rxd, rte_eth_dev_socket_id(port), nullptr, m_pool), "rx queue setup");
    check(rte_eth_tx_queue_setup(port, 0, txd, rte_eth_dev_socket_id(port), nullptr), "tx queue setup");
    check(rte_eth_dev_start(port), "start");
    rte_eth_promiscuous_enable(port);  // not supported by every vdev; harmless
    port_state p;
    p.id = port;
    p.gated = gated;
    rte_eth_macaddr_get(port, &p.mac);
    char name[RTE_ETH_NAME_MAX_LEN] = {};
    rte_eth_dev_get_name_by_port(port, name);
    p.counters.name = fmt::format("{}:{}", port, name);
    m_ports.push_back(p);
  }

  /// Waits up to `seconds` for every port's link to come up; returns the ports still down.
  std::vector<std::uint16_t> wait_link_up(double seconds) {
    const auto deadline = rte_get_timer_cycles() + static_cast<std::uint64_t>(seconds * static_cast<double>(rte_get_timer_hz()));
    std::vector<std::uint16_t> down;
    for (;;) {
      down.clear();
      for (const auto& p : m_ports) {
        rte_eth_link link{};
        rte_eth_link_get_nowait(p.id, &link);
        if (link.link_status != RTE_ETH_LINK_UP) down.push_back(p.id);
      }
      if (down.empty() || rte_get_timer_cycles() > deadline) return down;
      rte_delay_ms(50);
    }
  }

  /// One rx burst on every port that may be touched now; returns the packets received.
  std::size_t poll() {
    m_gate_held = m_gate && m_gate->hold();
    if (m_gate_held) flush_all();  // replies queued for gated ports while the gate was open
    std::size_t total = 0;
    bool gated_traffic = false;
    for (auto& p : m_ports) {
      if (!may_touch(p)) continue;
      std::array<rte_mbuf*, 64> rx;
      const std::uint16_t n = rte_eth_rx_burst(p.id, 0, rx.data(), std::min<std::uint16_t>(m_cfg.burst, 64));
      total += n;
      gated_traffic |= p.gated && n;
      for (std::uint16_t i = 0; i < n; ++i) {
        ++p.counters.rx_packets;
        p.counters.rx_bytes += rte_pktmbuf_pkt_len(rx[i]);
        handle_frame(p, rx[i]);
        rte_pktmbuf_free(rx[i]);
      }
      if (n) flush_all();
    }
    if (gated_traffic) m_gate->busy();
    return total;
  }

  /// After the polling loop: flushes, stops and closes every port.
  void stop() {
    // With the interrupt thread parked: a peer that just left is torn down
    // there (memif_disconnect, munmap), and rte_eth_dev_stop() does the same
    // on this thread; side by side they unmap and free twice.
    if (m_gate) {
      m_gate_held = m_gate->acquire(std::chrono::seconds(2));
      if (!m_gate_held)
        fmt::print(stderr, "gossip-switch: the EAL interrupt thread did not come within 2 s; closing the net_memif ports beside it\n");
    }
    flush_all();
    for (auto& p : m_ports) {
      drop_pending(p);
      rte_eth_dev_stop(p.id);
      rte_eth_dev_close(p.id);
    }
    if (m_gate) m_gate->let_go();
    m_gate_held = false;
    m_ports.clear();
  }

  /// At exit, after stop() and right before rte_eal_cleanup(): keeps the EAL
  /// interrupt thread out of the cleanup (see intr_gate::park_for_exit).
  void park_for_exit() {
    if (m_gate && !intr_gate::park_for_exit(std::move(m_gate), std::chrono::seconds(2)))
      fmt::print(stderr, "gossip-switch: the EAL interrupt thread did not come within 2 s; rte_eal_cleanup() runs beside it\n");
  }

  switch_report report(double seconds) {
    switch_report r{.program = "gossip-switch", .groups = m_groups, .ports = {}, .agg = m_agg.stats()};
    for (const auto& p : m_ports) {
      auto c = p.counters;
      rte_eth_stats st{};
      if (rte_eth_stats_get(p.id, &st) == 0) c.rx_missed = st.imissed + st.rx_nombuf;
      r.ports.push_back(c);
    }
    r.arp_replies = m_arp_replies;
    r.seconds = seconds;
    return r;
  }
  const aggregator& agg() const noexcept { return m_agg; }
  /// The time for idle members' eviction (aggregator::advance); from the polling thread.
  void advance(double now_s) noexcept { m_agg.advance(now_s); }
  std::size_t ports() const noexcept { return m_ports.size(); }
  rte_mempool* pool() const noexcept { return m_pool; }

 private:
  struct port_state {
    std::uint16_t id = 0;
    rte_ether_addr mac{};
    port_counters counters;
    std::array<rte_mbuf*, 64> tx{};
    std::uint16_t pending = 0;
    bool gated = false;  ///< touched only while m_gate is held
  };
  struct member {
    bool known = false;
    std::uint16_t port_index = 0;
    detail::mac_address mac{};
    std::uint32_t ip = 0;        // network order
    std::uint16_t udp_port = 0;  // network order
  };

  void drop(drop_reason r) noexcept { m_agg.count_drop(r); }

  static detail::mac_address mac_of(const rte_ether_addr& a) noexcept {
    detail::mac_address m;
    std::memcpy(m.data(), a.addr_bytes, m.size());
    return m;
  }

  // The frame's bytes are parsed by detail::parse_frame() (frame.hpp).
  void handle_frame(port_state& p, rte_mbuf* m) {
    if (m->nb_segs != 1) return drop(drop_reason::bad_ip);  // jumbo or chained: not ours
    const auto v = detail::parse_frame(rte_pktmbuf_mtod(m, const std::uint8_t*), rte_pktmbuf_data_len(m), m_ip, m_cfg.udp_port);
    switch (v.kind) {
      case detail::frame_kind::dropped: return drop(v.why);
      case detail::frame_kind::arp_other: return;  // someone else's ARP: not a drop
      case detail::frame_kind::arp_request: return answer_arp(p, v);
      case detail::frame_kind::udp: break;
    }
    if (m_drop_rx.drop()) return drop(drop_reason::injected);
    const auto payload = std::as_bytes(v.payload);

    packet_header h;
    member source{.known = true, .port_index = static_cast<std::uint16_t>(&p - m_ports.data()), .mac = v.src_mac, .ip = v.src_ip,
                  .udp_port = v.src_port};
    if (m_agg.validate(payload, h) == drop_reason::accepted) m_members[group_index(h.group)][h.worker] = source;
    const drop_reason why = m_agg.handle(payload, [&](std::uint16_t w, std::span<const std::byte> reply) {
      const auto& mb = m_members[group_index(h.group)][w];
      if (!mb.known) return drop(drop_reason::no_route);
      send_to(mb, reply);
    });
    // A packet at odds with its group's configuration is answered where it
    // came from, so that its worker stops with the reason.
    if (packet_header r; m_agg.refusal(h, why, r))
      send_to(source, std::as_bytes(std::span(&r, 1)).first(aggregator::refusal_bytes(payload.size())));
  }

  void answer_arp(port_state& p, const detail::frame_view& request) {
    rte_mbuf* r = rte_pktmbuf_alloc(m_pool);
    if (!r) return drop(drop_reason::tx_full);
    auto* o = reinterpret_cast<std::uint8_t*>(rte_pktmbuf_append(r, detail::arp_reply_bytes));
    if (!o) {
      rte_pktmbuf_free(r);
      return drop(drop_reason::tx_full);
    }
    detail::build_arp_reply(std::span<std::uint8_t, detail::arp_reply_bytes>(o, detail::arp_reply_bytes), request, mac_of(p.mac), m_ip);
    ++m_arp_replies;
    enqueue(p, r);
  }

  std::size_t group_index(std::uint16_t id) const noexcept {
    for (std::size_t i = 0; i < m_groups.size(); ++i)
      if (m_groups[i].id == id) return i;
    return 0;  // only called for validated packets
  }

  void send_to(const member& mb, std::span<const std::byte> reply) {
    if (m_drop_tx.drop()) return drop(drop_reason::injected);
    auto& p = m_ports[mb.port_index];
    rte_mbuf* r = rte_pktmbuf_alloc(m_pool);
    if (!r) return drop(drop_reason::tx_full);
    const std::size_t total = detail::udp_frame_overhead + reply.size();
    auto* o = reinterpret_cast<std::uint8_t*>(rte_pktmbuf_append(r, static_cast<std::uint16_t>(total)));
    const detail::udp_route route{.dst_mac = mb.mac, .src_mac = mac_of(p.mac), .dst_ip = mb.ip, .src_ip = m_ip, .dst_port = mb.udp_port,
                                  .src_port = m_cfg.udp_port};
    if (!o || detail::build_udp_frame(std::span(o, rte_pktmbuf_data_len(r)), route, m_ip_id++, reply) != total) {
      rte_pktmbuf_free(r);
      return drop(drop_reason::tx_full);
    }
    enqueue(p, r);
  }

  bool may_touch(const port_state& p) const noexcept { return !p.gated || m_gate_held; }

  void enqueue(port_state& p, rte_mbuf* m) {
    if (p.pending == p.tx.size()) {
      if (!may_touch(p)) {  // a gated port's queue is full until the next slice
        rte_pktmbuf_free(m);
        ++p.counters.tx_failed;
        return drop(drop_reason::tx_full);
      }
      flush(p);
    }
    p.tx[p.pending++] = m;
  }

  void flush(port_state& p) {
    std::uint16_t sent = 0;
    std::array<std::uint32_t, 64> bytes;
    for (std::uint16_t i = 0; i < p.pending; ++i) bytes[i] = rte_pktmbuf_pkt_len(p.tx[i]);  // read before the driver owns them
    // A few retries: a virtual device's queue drains as the peer reads.
    for (int tries = 0; sent < p.pending && tries < 64; ++tries) sent += rte_eth_tx_burst(p.id, 0, p.tx.data() + sent, p.pending - sent);
    for (std::uint16_t i = 0; i < sent; ++i) p.counters.tx_bytes += bytes[i];
    p.counters.tx_packets += sent;
    for (std::uint16_t i = sent; i < p.pending; ++i) {
      rte_pktmbuf_free(p.tx[i]);
      ++p.counters.tx_failed;
      drop(drop_reason::tx_full);
    }
    p.pending = 0;
  }
  void flush_all() {
    for (auto& p : m_ports)
      if (p.pending && may_touch(p)) flush(p);
  }
  // Replies that can no longer be sent (the switch stops).
  void drop_pending(port_state& p) noexcept {
    for (std::uint16_t i = 0; i < p.pending; ++i) {
      rte_pktmbuf_free(p.tx[i]);
      ++p.counters.tx_failed;
      drop(drop_reason::tx_full);
    }
    p.pending = 0;
  }

  dpdk_switch_config m_cfg;
  std::vector<group_config> m_groups;
  aggregator m_agg;
  drop_injector m_drop_rx, m_drop_tx;
  std::uint32_t m_ip = 0;
  std::uint16_t m_ip_id = 0;
  rte_mempool* m_pool = nullptr;
  std::vector<port_state> m_ports;
  std::unique_ptr<intr_gate> m_gate;  // only with gated ports
  bool m_gate_held = false;           // as of the last poll(): gated ports may be touched
  std::vector<std::vector<member>> m_members;
  std::uint64_t m_arp_replies = 0;
};

}  // namespace gossip::sw

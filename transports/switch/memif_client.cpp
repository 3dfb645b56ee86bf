// switch_memif_client — DPDK workers for gossip-switch over net_memif: one
// client vdev per worker, all polled by one lcore, each a member of a sync
// group that all-reduces `--reps` buffers; every result is checked against
// the reference sum. tests/test_switch_memif.sh runs it beside gossip-switch
// with the matching server vdevs:
//
//   gossip-switch -l 1 --no-huge -m 512 --no-pci --no-shconf --no-telemetry
//     --vdev=net_memif0,role=server,id=0,socket=/tmp/gsw.sock,socket-abstract=no  (… one per worker)
//     -- --ip 10.77.0.1 --group id=1,mode=sync,members=2 --link-wait 0
//   switch_memif_client -l 0 --no-huge -m 512 --no-pci --no-shconf --no-telemetry
//     --vdev=net_memif0,role=client,id=0,socket=/tmp/gsw.sock,socket-abstract=no  (… one per worker)
//     -- --ip 10.77.0.1 --group 1 --elements 100000 --reps 5
//
// Exits 0 when every all-reduce was exact, 1 otherwise or on a timeout.
#include <rte_byteorder.h>
#include <rte_cycles.h>
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_ip.h>
#include <rte_mbuf.h>

#include <arpa/inet.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include "cli_checks.hpp"
#include <fmt/format.h>

#include "packet.hpp"

namespace {

using namespace gossip::sw;

float value(std::size_t i, std::size_t worker, std::size_t rep) noexcept { return static_cast<float>((i * 7 + worker * 13 + rep) % 101); }

struct options {
  std::string ip = "10.77.0.1";
  std::uint16_t group = 1, chunk = default_chunk, window = 128;
  std::size_t elements = 100000;
  int reps = 5;
  double timeout = 20, rto_ms = 5, link_wait = 5;
};

// One worker = one memif port: its own MAC, IP 10.77.0.<10+w> and UDP port.
struct worker {
  std::uint16_t port = 0, id = 0;
  std::uint32_t session = 0;
  rte_ether_addr mac{};
  std::vector<float> in, out;
  std::vector<std::uint8_t> ver;                   // shadow bit per slot
  std::vector<std::int64_t> flight;                // chunk in flight per slot, −1 none
  std::vector<std::chrono::steady_clock::time_point> due;
  std::size_t done = 0;
  std::uint64_t retransmits = 0;
};

class client {
 public:
  client(const options& o, rte_mempool* pool) : m_o(o), m_pool(pool) {
    in_addr a{};
    if (::inet_pton(AF_INET, o.ip.c_str(), &a) != 1) throw std::invalid_argument("--ip '" + o.ip + "' is not an IPv4 address");
    m_switch_ip = a.s_addr;
    m_chunks = (o.elements + o.chunk - 1) / o.chunk;
  }

  /// Sync all-reduce number `seq` on every worker at once; false on a timeout.
  bool allreduce(std::vector<worker>& ws, std::uint32_t seq) {
    using clock = std::chrono::steady_clock;
    const auto now = clock::now();
    const auto deadline = now + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(m_o.timeout));
    for (auto& w : ws) {
      w.flight.assign(m_o.window, -1);
      w.due.assign(m_o.window, now);
      w.done = 0;
      for (std::size_t s = 0; s < m_o.window && s < m_chunks; ++s) {
        w.flight[s] = static_cast<std::int64_t>(s);
        send(w, s, seq);
      }
    }
    flush(ws);
    const auto rto = std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(m_o.rto_ms / 1000));
    for (;;) {
      bool all = true;
      for (auto& w : ws) {
        receive(w, seq);
        all = all && w.done == m_chunks;
      }
      if (all) return true;
      const auto t = clock::now();
      if (t > deadline) return false;
      for (auto& w : ws)
        for (std::size_t s = 0; s < m_o.window; ++s)
          if (w.flight[s] >= 0 && t > w.due[s] + rto) {
            ++w.retransmits;
            send(w, s, seq);
          }
      flush(ws);
    }
  }

 private:
  void send(worker& w, std::size_t slot, std::uint32_t seq) {
    const auto c = static_cast<std::size_t>(w.flight[slot]);
    const auto len = static_cast<std::uint16_t>(std::min<std::size_t>(m_o.chunk, m_o.elements - c * m_o.chunk));
    w.due[slot] = std::chrono::steady_clock::now();
    rte_mbuf* m = rte_pktmbuf_alloc(m_pool);
    if (!m) return;  // resent on its timeout
    const std::size_t total = 14 + 20 + 8 + packet_bytes(len);
    auto* f = reinterpret_cast<std::uint8_t*>(rte_pktmbuf_append(m, static_cast<std::uint16_t>(total)));
    if (!f) {
      rte_pktmbuf_free(m);
      return;
    }
    std::memset(f, 0xff, 6);  // the switch does not check the destination MAC
    std::memcpy(f + 6, &w.mac, 6);
    f[12] = 0x08, f[13] = 0x00;
    auto* ip = f + 14;
    std::memset(ip, 0, 20);
    ip[0] = 0x45, ip[8] = 64, ip[9] = IPPROTO_UDP;
    const auto ip_len = rte_cpu_to_be_16(static_cast<std::uint16_t>(total - 14));
    std::memcpy(ip + 2, &ip_len, 2);
    const std::uint32_t src = rte_cpu_to_be_32((10u << 24) | (77u << 16) | (10u + w.id));
    std::memcpy(ip + 12, &src, 4);
    std::memcpy(ip + 16, &m_switch_ip, 4);
    rte_ipv4_hdr hdr;
    std::memcpy(&hdr, ip, 20);
    const std::uint16_t ck = rte_ipv4_cksum(&hdr);
    std::memcpy(ip + 10, &ck, 2);
    auto* udp = ip + 20;
    const auto sport = rte_cpu_to_be_16(static_cast<std::uint16_t>(40000 + w.id)), dport = rte_cpu_to_be_16(default_port);
    const auto ulen = rte_cpu_to_be_16(static_cast<std::uint16_t>(8 + packet_bytes(len)));
    std::memcpy(udp, &sport, 2);
    std::memcpy(udp + 2, &dport, 2);
    std::memcpy(udp + 4, &ulen, 2);
    udp[6] = udp[7] = 0;
    packet_header h{.type = packet_type::sync_contribution, .flags = w.ver[slot], .group = m_o.group, .worker = w.id,
                    .slot = static_cast<std::uint16_t>(slot), .elements = len, .chunk = static_cast<std::uint32_t>(c), .sequence = seq,
                    .session = w.session};
    std::memcpy(udp + 8, &h, sizeof h);
    std::memcpy(udp + 8 + sizeof h, w.in.data() + c * m_o.chunk, len * sizeof(float));
    m_tx[w.port].push_back(m);
  }

  void flush(std::vector<worker>& ws) {
    for (auto& w : ws) flush(w.port);
  }
  void flush(std::uint16_t port) {
    auto& q = m_tx[port];
    std::size_t sent = 0;
    for (int tries = 0; sent < q.size() && tries < 64; ++tries)
      sent += rte_eth_tx_burst(port, 0, q.data() + sent, static_cast<std::uint16_t>(std::min<std::size_t>(q.size() - sent, 64)));
    for (std::size_t i = sent; i < q.size(); ++i) rte_pktmbuf_free(q[i]);  // resent on its timeout
    q.clear();
  }

  void receive(worker& w, std::uint32_t seq) {
    std::array<rte_mbuf*, 32> rx;
    const std::uint16_t n = rte_eth_rx_burst(w.port, 0, rx.data(), rx.size());
    for (std::uint16_t i = 0; i < n; ++i) {
      accept(w, rx[i], seq);
      rte_pktmbuf_free(rx[i]);
    }
    if (n) flush(w.port);  // the next chunks of the slots just answered
  }

  void accept(worker& w, rte_mbuf* m, std::uint32_t seq) {
    const auto* f = rte_pktmbuf_mtod(m, const std::uint8_t*);
    const std::size_t len = rte_pktmbuf_data_len(m);
    if (m->nb_segs != 1 || len < 14 + 20 + 8 + sizeof(packet_header) || f[12] != 0x08 || f[13] != 0x00) return;
    const std::size_t ihl = static_cast<std::size_t>(f[14] & 0x0f) * 4;
    if (ihl < 20 || 14 + ihl + 8 > len) return;
    const auto* payload = reinterpret_cast<const std::byte*>(f + 14 + ihl + 8);
    const std::size_t plen = len - 14 - ihl - 8;
    packet_header h;
    if (!read_header(payload, plen, h) || h.magic != packet_header::magic_value || h.type != packet_type::sync_result || h.worker != w.id ||
        h.session != w.session || h.sequence != seq || h.slot >= m_o.window || w.flight[h.slot] != static_cast<std::int64_t>(h.chunk) ||
        h.flags != w.ver[h.slot])
      return;  // stale (a result sent again) or not ours
    const std::size_t off = static_cast<std::size_t>(h.chunk) * m_o.chunk;
    if (h.elements != std::min<std::size_t>(m_o.chunk, m_o.elements - off) || plen < packet_bytes(h.elements)) return;
    std::memcpy(w.out.data() + off, payload + sizeof h, h.elements * sizeof(float));
    ++w.done;
    w.ver[h.slot] ^= 1;
    const std::size_t next = h.chunk + m_o.window;
    w.flight[h.slot] = next < m_chunks ? static_cast<std::int64_t>(next) : -1;
    if (next < m_chunks) send(w, h.slot, seq);
  }

  options m_o;
  rte_mempool* m_pool;
  std::uint32_t m_switch_ip = 0;
  std::size_t m_chunks = 0;
  std::array<std::vector<rte_mbuf*>, RTE_MAX_ETHPORTS> m_tx{};
};

int run(const options& o) {
  rte_mempool* pool = rte_pktmbuf_pool_create("gsw_client", 16383, 256, 0, RTE_MBUF_DEFAULT_BUF_SIZE, static_cast<int>(rte_socket_id()));
  if (!pool) throw std::runtime_error(fmt::format("cannot create the mbuf pool: {}", rte_strerror(rte_errno)));
  std::vector<worker> ws;
  std::mt19937 rng(std::random_device{}());
  std::uint16_t pid;
  RTE_ETH_FOREACH_DEV(pid) {
    rte_eth_conf conf{};
    if (rte_eth_dev_configure(pid, 1, 1, &conf) < 0 || rte_eth_rx_queue_setup(pid, 0, 1024, rte_eth_dev_socket_id(pid), nullptr, pool) < 0 ||
        rte_eth_tx_queue_setup(pid, 0, 1024, rte_eth_dev_socket_id(pid), nullptr) < 0 || rte_eth_dev_start(pid) < 0)
      throw std::runtime_error(fmt::format("port {}: cannot configure and start it", pid));
    worker w;
    w.port = pid;
    w.id = static_cast<std::uint16_t>(ws.size());
    w.session = rng() | 1;
    rte_eth_macaddr_get(pid, &w.mac);
    w.in.resize(o.elements);
    w.out.resize(o.elements);
    w.ver.assign(o.window, 0);
    ws.push_back(std::move(w));
  }
  if (ws.empty()) throw std::invalid_argument("no ports: add one --vdev=net_memifK,role=client,… per worker");
  // memif links come up when the switch's server side accepts the connection.
  const auto link_deadline = rte_get_timer_cycles() + static_cast<std::uint64_t>(o.link_wait * static_cast<double>(rte_get_timer_hz()));
  for (const auto& w : ws) {
    rte_eth_link link{};
    while (rte_eth_link_get_nowait(w.port, &link) == 0 && link.link_status != RTE_ETH_LINK_UP && rte_get_timer_cycles() < link_deadline)
      rte_delay_ms(50);
    if (link.link_status != RTE_ETH_LINK_UP)
      throw std::runtime_error(fmt::format("port {} (worker {}) is still down after {:.0f} s: is gossip-switch serving the memif socket?", w.port,
                                           w.id, o.link_wait));
  }
  client c(o, pool);
  bool ok = true;
  for (int rep = 0; rep < o.reps && ok; ++rep) {
    for (auto& w : ws)
      for (std::size_t i = 0; i < o.elements; ++i) w.in[i] = value(i, w.id, static_cast<std::size_t>(rep));
    const auto t0 = std::chrono::steady_clock::now();
    if (!c.allreduce(ws, static_cast<std::uint32_t>(rep + 1))) {
      fmt::print(stderr, "switch_memif_client: all-reduce {} timed out after {:.0f} s (group {}, {} workers)\n", rep + 1, o.timeout, o.group, ws.size());
      return 1;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < o.elements; ++i) {
      float ref = 0;
      for (const auto& w : ws) ref += value(i, w.id, static_cast<std::size_t>(rep));
      for (const auto& w : ws) wrong += w.out[i] != ref;
    }
    std::uint64_t rt = 0;
    for (const auto& w : ws) rt += w.retransmits;
    fmt::print("all-reduce {}: {} workers x {} floats over net_memif in {:.4f} s ({:.3e} elements/s), {} retransmits, {}\n", rep + 1, ws.size(),
               o.elements, s, static_cast<double>(o.elements) / s, rt, wrong ? fmt::format("{} WRONG values", wrong) : std::string("exact"));
    std::fflush(stdout);  // a test watching the log learns that traffic flows
    ok = wrong == 0;
  }
  for (const auto& w : ws) {
    rte_eth_dev_stop(w.port);
    rte_eth_dev_close(w.port);
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"DPDK workers all-reducing through gossip-switch over net_memif client vdevs (one per worker); checks every sum."};
  app.name("switch_memif_client");
  app.option_defaults()->always_capture_default();  // --help shows every default
  options o;
  app.add_option("--ip", o.ip, "the switch's IPv4 address");
  app.add_option("--group", o.group, "sync group id (members = the number of ports)");
  app.add_option("--chunk", o.chunk, "float32 values per packet (the group's chunk)")->check(gossip::cli::integer_range(1, int{max_chunk}));
  app.add_option("--window", o.window, "packets in flight per worker (the group's slots)")->check(gossip::cli::integer_range(1, 4096));
  app.add_option("--elements", o.elements, "floats per all-reduce")->check(gossip::cli::integer_range(1, 1 << 26));
  app.add_option("--reps", o.reps, "all-reduces")->check(gossip::cli::integer_range(1, 1000));
  app.add_option("--timeout", o.timeout, "seconds before one all-reduce gives up")->check(gossip::cli::number_range(0.001));
  app.add_option("--rto-ms", o.rto_ms, "retransmission timeout")->check(gossip::cli::number_range(0.001));
  app.add_option("--link-wait", o.link_wait, "seconds to wait for the memif links")->check(gossip::cli::number_range(0.0, 3600.0));
  app.footer(
      "DPDK's EAL options come first (one net_memif client vdev per worker), then '--', then these;\n"
      "the comment at the top of transports/switch/memif_client.cpp shows a full command line.\n");
  // -h/--help before '--' is this program's help, not the EAL's.
  for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i)
    if (const std::string_view a = argv[i]; a == "-h" || a == "--help") {
      fmt::print("{}", app.help());
      return 0;
    }
  const int eal = rte_eal_init(argc, argv);
  if (eal < 0) {
    fmt::print(stderr, "switch_memif_client: EAL init failed: {}\n", rte_strerror(rte_errno));
    return 1;
  }
  argc -= eal;
  argv += eal;
  argv[0] = const_cast<char*>("switch_memif_client");
  int rc = 0;
  try {
    app.parse(argc, argv);
    rc = run(o);
  } catch (const CLI::ParseError& e) {
    rc = app.exit(e);
  } catch (const std::exception& e) {
    fmt::print(stderr, "switch_memif_client: {}\n", e.what());
    rc = 1;
  }
  rte_eal_cleanup();
  return rc;
}

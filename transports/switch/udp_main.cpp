// gossip-switch-udp — the switch's aggregation code as an ordinary kernel-UDP
// process: the host-aggregation baseline of bench/switch, and a switch for
// machines without DPDK.
//
//   gossip-switch-udp --bind 127.0.0.1 --group id=1,mode=sync,members=4 --stats-json stats.json
//
// SIGINT/SIGTERM print the statistics (and write the JSON file); SIGUSR1
// writes the JSON file and keeps serving.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "aggregator.hpp"
#include "cli_checks.hpp"
#include "report.hpp"
#include "signals.hpp"

namespace signals = gossip::sw::signals;

namespace {
// The CPUs this process may run on, as "0-3" lists them ("?" if unknown).
std::string allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return "?";
  std::string out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &set)) continue;
    int last = c;
    while (last + 1 < CPU_SETSIZE && CPU_ISSET(last + 1, &set)) ++last;
    out += fmt::format("{}{}", out.empty() ? "" : ",", last == c ? fmt::format("{}", c) : fmt::format("{}-{}", c, last));
    c = last;
  }
  return out.empty() ? "?" : out;
}
}  // namespace

int main(int argc, char** argv) {
  using namespace gossip::sw;
  CLI::App app{"Kernel-UDP aggregator running the gossip-switch aggregation code (sync all-reduce and async shared aggregate)."};
  app.name("gossip-switch-udp");
  app.option_defaults()->always_capture_default();  // --help shows every default
  std::string bind = "0.0.0.0", stats_path;
  std::uint16_t port = default_port;
  std::vector<std::string> group_specs;
  double drop = 0, duration = 0;
  std::uint64_t seed = 1;
  int cpu = -1;
  app.add_option("--bind", bind, "IPv4 address to listen on");
  app.add_option("--port", port, "UDP port (0: a free one, printed when serving)")->check(gossip::cli::integer_range(std::uint16_t{0}, std::uint16_t{65535}));
  app.add_option("-g,--group", group_specs, "group: id=1,mode=sync|async,members=N[,chunk=256,slots=128,elements=E,idle_s=60]")->default_str("")->required();
  app.add_option("--drop", drop, "drop this fraction of received packets and of replies (loss injection)")
      ->check(gossip::cli::number_range(0.0, 1.0));
  app.add_option("--seed", seed, "seed of the loss injection")->check(gossip::cli::integer_range(std::uint64_t{0}, std::numeric_limits<std::uint64_t>::max()));
  app.add_option("--stats-json", stats_path, "write statistics here at start, on exit and on SIGUSR1");
  app.add_option("--duration", duration, "exit after this many seconds (0: run until SIGINT/SIGTERM)")->check(gossip::cli::number_range(0.0));
  app.add_option("--cpu", cpu, "pin to this CPU (-1: not pinned)")->check(gossip::cli::integer_range(-1, CPU_SETSIZE - 1));
  CLI11_PARSE(app, argc, argv);

  std::vector<group_config> groups;
  try {
    for (const auto& s : group_specs) groups.push_back(group_config::parse(s));
  } catch (const std::exception& e) {
    fmt::print(stderr, "gossip-switch-udp: --group: {}\n", e.what());
    return 2;
  }
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) {
      fmt::print(stderr, "gossip-switch-udp: --cpu {}: cannot pin to that CPU: {} (this process may run on CPUs {}; give one of them, or -1)\n",
                 cpu, std::strerror(errno), allowed_cpus());
      return 2;
    }
  }
  // Two groups with one id, or a model too large to hold, are refused here, not by an abort.
  std::optional<aggregator> made;
  try {
    made.emplace(groups);
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "gossip-switch-udp: --group: not enough memory for the groups' aggregates (elements x (members + 1) floats each)\n");
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "gossip-switch-udp: --group: {}\n", e.what());
    return 2;
  }
  aggregator& agg = *made;

  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    fmt::print(stderr, "gossip-switch-udp: socket(): {}\n", std::strerror(errno));
    return 1;
  }
  const int buf = 16 << 20;
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &buf, sizeof buf) != 0) ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  if (::setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof buf) != 0) ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  sockaddr_in local{};
  local.sin_family = AF_INET;
  local.sin_port = htons(port);
  if (::inet_pton(AF_INET, bind.c_str(), &local.sin_addr) != 1) {
    fmt::print(stderr, "gossip-switch-udp: --bind '{}' is not an IPv4 address\n", bind);
    return 2;
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0) {
    const int e = errno;
    fmt::print(stderr, "gossip-switch-udp: bind {}:{}: {} ({})\n", bind, port, std::strerror(e),
               e == EADDRINUSE       ? "is another aggregator running on that port? choose another --port, or 0 for a free one"
               : e == EADDRNOTAVAIL ? "no interface of this machine has that address: give one it has to --bind, or 0.0.0.0"
                                    : "check --bind and --port");
    return 1;
  }
  // --port 0: the kernel picks a free port; say which (workers need it).
  if (socklen_t len = sizeof local; ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) port = ntohs(local.sin_port);

  signals::install();

  // Member addresses, learned from their packets: [group index][worker].
  std::vector<std::vector<sockaddr_in>> members(groups.size());
  std::vector<std::vector<char>> known(groups.size());
  for (std::size_t i = 0; i < groups.size(); ++i) {
    members[i].resize(groups[i].members);
    known[i].assign(groups[i].members, 0);
  }
  auto group_index = [&](std::uint16_t id) -> int {
    for (std::size_t i = 0; i < groups.size(); ++i)
      if (groups[i].id == id) return static_cast<int>(i);
    return -1;
  };

  constexpr std::size_t batch = 64;
  const std::size_t rstride = max_packet_bytes + 64;
  std::vector<std::byte> rx(batch * rstride);
  std::array<mmsghdr, batch> rmsgs{};
  std::array<iovec, batch> riovs{};
  std::array<sockaddr_in, batch> from{};
  constexpr std::size_t tx_batch = 256;
  std::vector<std::byte> txbuf(tx_batch * max_packet_bytes);
  std::array<mmsghdr, tx_batch> tmsgs{};
  std::array<iovec, tx_batch> tiovs{};
  std::array<sockaddr_in, tx_batch> to{};
  std::size_t pending = 0;
  port_counters pc{.name = fmt::format("udp:{}:{}", bind, port)};
  drop_injector drop_rx(drop, seed), drop_tx(drop, seed * 7919 + 1);

  auto flush = [&] {
    std::size_t sent = 0;
    while (sent < pending) {
      const int r = ::sendmmsg(fd, tmsgs.data() + sent, static_cast<unsigned>(pending - sent), 0);
      if (r < 0) {
        if (errno == EINTR) continue;
        pc.tx_failed += pending - sent;  // the worker retransmits
        break;
      }
      for (int i = 0; i < r; ++i) pc.tx_bytes += tmsgs[sent + static_cast<std::size_t>(i)].msg_len;
      pc.tx_packets += static_cast<std::uint64_t>(r);
      sent += static_cast<std::size_t>(r);
    }
    pending = 0;
  };

  auto send = [&](std::span<const std::byte> reply, const sockaddr_in& dest) {
    if (drop_tx.drop()) {
      agg.count_drop(drop_reason::injected);
      return;
    }
    if (pending == tx_batch) flush();
    std::byte* q = txbuf.data() + pending * max_packet_bytes;
    std::memcpy(q, reply.data(), reply.size());
    tiovs[pending] = {q, reply.size()};
    to[pending] = dest;
    tmsgs[pending].msg_hdr = msghdr{};
    tmsgs[pending].msg_hdr.msg_iov = &tiovs[pending];
    tmsgs[pending].msg_hdr.msg_iovlen = 1;
    tmsgs[pending].msg_hdr.msg_name = &to[pending];
    tmsgs[pending].msg_hdr.msg_namelen = sizeof(sockaddr_in);
    ++pending;
  };

  const auto start = std::chrono::steady_clock::now();
  auto report = [&] {
    switch_report r{.program = "gossip-switch-udp", .groups = groups, .ports = {pc}, .agg = agg.stats()};
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return r;
  };
  // An unwritable --stats-json is found now, not after the run it was to record.
  if (!stats_path.empty() && !report().write_json(stats_path)) {
    fmt::print(stderr, "gossip-switch-udp: --stats-json: cannot write {}: {}\n", stats_path, std::strerror(errno));
    ::close(fd);
    return 2;
  }
  fmt::print(stderr, "gossip-switch-udp: serving {} group(s) on {}:{}{}\n", groups.size(), bind, port,
             drop > 0 ? fmt::format(", dropping {:.1f} % of packets", 100 * drop) : "");
  while (!signals::stop) {
    if (signals::dump.exchange(false) && !stats_path.empty() && !report().write_json(stats_path))
      fmt::print(stderr, "gossip-switch-udp: cannot write {}: {}\n", stats_path, std::strerror(errno));
    const double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (duration > 0 && now > duration) break;
    agg.advance(now);  // evicts async members silent past their group's idle_s
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    for (std::size_t i = 0; i < batch; ++i) {
      riovs[i] = {rx.data() + i * rstride, rstride};
      rmsgs[i].msg_hdr = msghdr{};
      rmsgs[i].msg_hdr.msg_iov = &riovs[i];
      rmsgs[i].msg_hdr.msg_iovlen = 1;
      rmsgs[i].msg_hdr.msg_name = &from[i];
      rmsgs[i].msg_hdr.msg_namelen = sizeof(sockaddr_in);
    }
    const int n = ::recvmmsg(fd, rmsgs.data(), batch, MSG_DONTWAIT, nullptr);
    if (n <= 0) continue;
    for (int i = 0; i < n; ++i) {
      const auto len = rmsgs[static_cast<std::size_t>(i)].msg_len;
      const std::byte* p = rx.data() + static_cast<std::size_t>(i) * rstride;
      ++pc.rx_packets;
      pc.rx_bytes += len;
      // A datagram that filled the buffer may have been cut by the kernel.
      const std::size_t size = (rmsgs[static_cast<std::size_t>(i)].msg_hdr.msg_flags & MSG_TRUNC) ? rstride + 1 : len;
      if (drop_rx.drop()) {
        agg.count_drop(drop_reason::injected);
        continue;
      }
      packet_header h;
      const std::span<const std::byte> pkt(p, std::min<std::size_t>(size, len));
      if (size > len) {
        agg.count_drop(drop_reason::bad_length);
        continue;
      }
      if (agg.validate(pkt, h) == drop_reason::accepted) {
        const int gi = group_index(h.group);
        members[static_cast<std::size_t>(gi)][h.worker] = from[static_cast<std::size_t>(i)];
        known[static_cast<std::size_t>(gi)][h.worker] = 1;
      }
      const drop_reason why = agg.handle(pkt, [&](std::uint16_t w, std::span<const std::byte> reply) {
        const int gi = group_index(h.group);
        if (!known[static_cast<std::size_t>(gi)][w]) {
          agg.count_drop(drop_reason::no_route);  // the member's address was never seen; it will retransmit
          return;
        }
        send(reply, members[static_cast<std::size_t>(gi)][w]);
      });
      // A packet at odds with its group's configuration is answered where it
      // came from, so that its worker stops with the reason.
      if (packet_header r; agg.refusal(h, why, r))
        send(std::as_bytes(std::span(&r, 1)).first(aggregator::refusal_bytes(pkt.size())), from[static_cast<std::size_t>(i)]);
    }
    flush();
  }
  const auto r = report();
  std::fputs(r.text().c_str(), stderr);
  int rc = 0;
  if (!stats_path.empty() && !r.write_json(stats_path)) {
    fmt::print(stderr, "gossip-switch-udp: cannot write {}: {}\n", stats_path, std::strerror(errno));
    rc = 1;
  }
  ::close(fd);
  return rc;
}

// gossip-switch — the DPDK aggregation switch.
//
//   gossip-switch EAL-ARGS -- --ip 10.77.0.1 --group id=1,mode=sync,members=4 [--group ...]
//
// The same binary runs on a NIC or on virtual devices, e.g. without hugepages:
//
//   gossip-switch -l 1 --no-huge -m 512 --no-pci --no-shconf --no-telemetry
//     --vdev=net_af_packet0,iface=gsw-s0,framecnt=8192,qdisc_bypass=1
//     --vdev=net_af_packet1,iface=gsw-s1,framecnt=8192,qdisc_bypass=1
//     -- --ip 10.77.0.1 --group id=1,mode=sync,members=2 --stats-json switch.json
//
// One polling loop serves every port (rx burst, aggregate, tx burst) on the
// main lcore, or on the first worker lcore when EAL got more than one
// (`-l 0,1` polls on 1). SIGINT/SIGTERM stop it and print the statistics;
// SIGUSR1 writes the JSON file and keeps serving.
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_launch.h>
#include <rte_lcore.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli_checks.hpp"
#include "dpdk_switch.hpp"
#include "signals.hpp"

namespace {

namespace signals = gossip::sw::signals;

struct loop_args {
  gossip::sw::dpdk_switch* sw;
  std::string stats_path;
  double duration;
  std::chrono::steady_clock::time_point start;
};

int poll_loop(void* arg) {
  auto& a = *static_cast<loop_args*>(arg);
  std::uint64_t iterations = 0;
  while (!signals::stop.load(std::memory_order_relaxed)) {
    a.sw->poll();
    if ((++iterations & 0xfff) == 0)  // evicts async members silent past their group's idle_s
      a.sw->advance(std::chrono::duration<double>(std::chrono::steady_clock::now() - a.start).count());
    if ((iterations & 0xffff) == 0) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - a.start).count();
      if (signals::dump.exchange(false) && !a.stats_path.empty() && !a.sw->report(s).write_json(a.stats_path))
        fmt::print(stderr, "gossip-switch: cannot write {}: {}\n", a.stats_path, std::strerror(errno));
      if (a.duration > 0 && s > a.duration) signals::stop = true;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace gossip::sw;
  CLI::App app{"DPDK aggregation switch for libgossip (sync all-reduce and async shared aggregate over UDP)."};
  app.name("gossip-switch");
  app.option_defaults()->always_capture_default();  // --help shows every default
  dpdk_switch_config cfg;
  std::vector<std::string> group_specs;
  std::vector<std::uint16_t> ports;
  std::string stats_path;
  double duration = 0, link_wait = 5;
  app.add_option("--ip", cfg.ip, "the switch's IPv4 address (answered in ARP; requests must be sent to it)");
  app.add_option("--udp-port", cfg.udp_port, "UDP port of the protocol")->check(gossip::cli::integer_range(std::uint16_t{1}, std::uint16_t{65535}));
  app.add_option("-g,--group", group_specs, "group: id=1,mode=sync|async,members=N[,chunk=256,slots=128,elements=E,idle_s=60]")->default_str("")->required();
  app.add_option("-p,--ports", ports, "ethdev port ids to serve (default: all)")->default_str("");
  app.add_option("--burst", cfg.burst, "rx/tx burst size")->check(gossip::cli::integer_range(1, 64));
  // DPDK wants a pool of at least 1.5 times its per-core cache (256 mbufs).
  app.add_option("--mbufs", cfg.mbufs, "mbufs in the pool (at least 384: 1.5 x the per-core cache of 256)")
      ->check(gossip::cli::integer_range(std::uint32_t{384}, std::uint32_t{1} << 24));
  app.add_option("--drop", cfg.drop, "drop this fraction of requests and of replies (loss injection)")
      ->check(gossip::cli::number_range(0.0, 1.0));
  app.add_option("--seed", cfg.seed, "seed of the loss injection")->check(gossip::cli::integer_range(std::uint64_t{0}, std::numeric_limits<std::uint64_t>::max()));
  app.add_option("--stats-json", stats_path, "write statistics here at start, on exit and on SIGUSR1");
  app.add_option("--duration", duration, "exit after this many seconds (0: until SIGINT/SIGTERM)")->check(gossip::cli::number_range(0.0));
  app.add_option("--link-wait", link_wait, "seconds to wait for links to come up (memif needs ~1 s)")->check(gossip::cli::number_range(0.0, 3600.0));
  app.footer(
      "DPDK's EAL options come first, then '--', then these, e.g.\n"
      "  gossip-switch -l 1 --no-huge -m 512 --no-pci --no-shconf --vdev=net_af_packet0,iface=gsw-s0 -- \\\n"
      "    --ip 10.77.0.1 --group id=1,mode=sync,members=2\n"
      "The EAL's options: gossip-switch --eal-help\n");
  // -h/--help before '--' is this program's help, not the EAL's (--eal-help).
  for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) {
    const std::string_view a = argv[i];
    if (a == "-h" || a == "--help") {
      fmt::print("{}", app.help());
      return 0;
    }
    if (a == "--eal-help") argv[i] = const_cast<char*>("--help");
  }
  const int eal = rte_eal_init(argc, argv);
  if (eal < 0) {
    fmt::print(stderr, "gossip-switch: EAL init failed: {} (without hugepages use --no-huge -m 512 --no-pci --no-shconf)\n", rte_strerror(rte_errno));
    return 1;
  }
  argc -= eal;
  argv += eal;
  argv[0] = const_cast<char*>("gossip-switch");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    rte_eal_cleanup();
    return rc;
  }

  int rc = 0;
  try {
    std::vector<group_config> groups;
    for (const auto& s : group_specs) groups.push_back(group_config::parse(s));
    for (std::size_t i = 0; i < ports.size(); ++i)
      if (std::find(ports.begin(), ports.begin() + static_cast<std::ptrdiff_t>(i), ports[i]) != ports.begin() + static_cast<std::ptrdiff_t>(i))
        throw std::invalid_argument(fmt::format("--ports: port {} is given twice; name each port once", ports[i]));
    if (ports.empty()) {
      std::uint16_t pid;
      RTE_ETH_FOREACH_DEV(pid) ports.push_back(pid);
    }
    if (ports.empty()) throw std::invalid_argument("no ethdev ports: add a NIC or --vdev=net_af_packet0,iface=... / net_memif0,... / net_ring0");
    dpdk_switch sw(cfg, groups);
    for (auto p : ports) sw.add_port(p);
    if (const auto down = sw.wait_link_up(link_wait); !down.empty())
      fmt::print(stderr, "gossip-switch: {} port(s) still down after {:.0f} s (first: {}); serving anyway\n", down.size(), link_wait, down[0]);

    // An unwritable --stats-json is found now, not after the run it was to record.
    if (!stats_path.empty() && !sw.report(0).write_json(stats_path))
      throw std::invalid_argument(fmt::format("--stats-json: cannot write {}: {}", stats_path, std::strerror(errno)));

    signals::install();

    loop_args args{&sw, stats_path, duration, std::chrono::steady_clock::now()};
    const unsigned worker = rte_get_next_lcore(rte_lcore_id(), 1, 0);
    fmt::print(stderr, "gossip-switch: {} port(s), {} group(s), ip {} udp {}, polling on lcore {}{}\n", sw.ports(), groups.size(), cfg.ip,
               cfg.udp_port, worker < RTE_MAX_LCORE ? worker : rte_lcore_id(),
               cfg.drop > 0 ? fmt::format(", dropping {:.1f} % of packets", 100 * cfg.drop) : "");
    if (worker < RTE_MAX_LCORE) {
      rte_eal_remote_launch(poll_loop, &args, worker);
      while (!signals::stop) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (signals::dump.exchange(false) && !stats_path.empty() &&
            !sw.report(std::chrono::duration<double>(std::chrono::steady_clock::now() - args.start).count()).write_json(stats_path))
          fmt::print(stderr, "gossip-switch: cannot write {}: {}\n", stats_path, std::strerror(errno));
        if (duration > 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - args.start).count() > duration) signals::stop = true;
      }
      rte_eal_wait_lcore(worker);
    } else {
      poll_loop(&args);
    }
    const auto report = sw.report(std::chrono::duration<double>(std::chrono::steady_clock::now() - args.start).count());
    std::fputs(report.text().c_str(), stderr);
    if (!stats_path.empty() && !report.write_json(stats_path)) {
      fmt::print(stderr, "gossip-switch: cannot write {}: {}\n", stats_path, std::strerror(errno));
      rc = 1;
    }
    sw.stop();
    sw.park_for_exit();
  } catch (const std::invalid_argument& e) {  // the command line (groups, ports, --stats-json): as gossip-switch-udp
    fmt::print(stderr, "gossip-switch: {}\n", e.what());
    rc = 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "gossip-switch: {}\n", e.what());
    rc = 1;
  }
  rte_eal_cleanup();
  return rc;
}

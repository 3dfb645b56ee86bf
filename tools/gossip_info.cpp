// gossip-info: every component a config file can name, with its settings
// (key, default, environment variable, meaning). Read from the same tables the
// config parser checks against.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string_view>

#include <fmt/format.h>

#include "gossip/gossip.hpp"
#include "gossip_build_config.hpp"
#if defined(GOSSIP_HAVE_SWITCH)
#include "transports/switch/switch.hpp"
#endif
#if defined(GOSSIP_HAVE_UCX)
#include "gossip/transports/ucx/ucx.hpp"
#endif

namespace {

void print_specs(const std::vector<gossip::option_spec>& specs) {
  for (const auto& s : specs)
    fmt::print("      {:<18} {:<12} {:<28} {}\n", s.key, gossip::to_string(s.default_value), s.env.empty() ? "" : s.env, s.help);
}

template <class Registry>
void print_registry(const Registry& r, const char* section) {
  fmt::print("[{}] name = one of:\n", section);
  for (const auto& e : r.entries()) {
    fmt::print("  {:<14} {}\n", e.name, e.help);
    print_specs(e.specs);
  }
  fmt::print("\n");
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc > 1) {
    const std::string_view a = argv[1];
    const bool help = a == "-h" || a == "--help";
    fmt::print(help ? stdout : stderr,
               "{}usage: gossip-info\nLists every component a config file can name ([policy], [topology], [protocol], [codec], "
               "[transport]) and the [engine] settings: key, default, environment variable, meaning. It takes no arguments.\n",
               help ? "" : fmt::format("gossip-info: unexpected argument '{}'\n", a));
    return help ? 0 : 2;
  }
#if defined(GOSSIP_HAVE_SWITCH)
  gossip::register_switch_topology();  // the switch transport's own topology
#endif
  fmt::print("libgossip {}\n\n", GOSSIP_VERSION);
  print_registry(gossip::policy_registry(), "policy");
  print_registry(gossip::topology_registry(), "topology");
  print_registry(gossip::protocol_registry(), "protocol");
  print_registry(gossip::codec_registry(), "codec");
  fmt::print("[transport] name = one of:\n");
  fmt::print("  {:<14} {}\n", "loopback", "workers as threads of one process, links emulated in memory");
  print_specs(gossip::loopback_option_specs());
#if defined(GOSSIP_HAVE_UCX)
  fmt::print("  {:<14} {}\n", "ucx", "one rank per process (or machine) over UCX; no settings here: UCX reads UCX_* environment variables, "
             "rank and world come from GOSSIP_RANK/GOSSIP_WORLD_SIZE, mpirun, Slurm or torchrun");
  fmt::print("      here: {}\n", gossip::ucx_transport(nullptr).describe());
#else
  fmt::print("  {:<14} {}\n", "ucx", "(not built into this installation: configure with libucx-dev installed)");
#endif
#if defined(GOSSIP_HAVE_SWITCH)
  fmt::print("  {:<14} {}\n", "switch", "workers through an aggregation switch (gossip-switch, gossip-switch-udp); protocol "
             "'switch-aggregate', topology 'switch'");
  print_specs(gossip::switch_option_specs());
#else
  fmt::print("  {:<14} {}\n", "switch", "(not built into this installation: configure with libdpdk-dev installed)");
#endif
  fmt::print("\n[engine]\n");
  print_specs(gossip::engine_option_specs());
  std::fflush(stdout);
  if (std::ferror(stdout)) throw std::runtime_error(std::strerror(errno));
  return 0;
} catch (const std::exception& e) {  // e.g. stdout on a full disk
  std::fprintf(stderr, "gossip-info: cannot write the listing: %s\n", e.what());
  return 1;
}

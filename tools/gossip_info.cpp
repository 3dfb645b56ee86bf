// gossip-info: every component a config file can name, with its settings
// (key, default, environment variable, meaning). Read from the same tables the
// config parser checks against.
#include <fmt/format.h>

#include "gossip/gossip.hpp"
#include "gossip_build_config.hpp"

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

int main() {
  fmt::print("libgossip {}\n\n", GOSSIP_VERSION);
  print_registry(gossip::policy_registry(), "policy");
  print_registry(gossip::topology_registry(), "topology");
  print_registry(gossip::protocol_registry(), "protocol");
  print_registry(gossip::codec_registry(), "codec");
  fmt::print("[transport] name = loopback (workers as threads of one process)\n");
  print_specs(gossip::loopback_option_specs());
  fmt::print("\n[engine]\n");
  print_specs(gossip::engine_option_specs());
  return 0;
}

#pragma once
/// Command-line checks the switch programs (gossip-switch, gossip-switch-udp) share.
#include <cmath>
#include <string>

#include <CLI/CLI.hpp>

namespace gossip::sw {

/// CLI::Range lets "nan" through (every comparison with it is false): this
/// refuses anything but a finite number.
inline CLI::Validator finite_number() {
  return CLI::Validator(
      [](std::string& s) {
        double v = 0;
        return CLI::detail::lexical_cast(s, v) && std::isfinite(v) ? std::string() : std::string("not a finite number");
      },
      "");
}

}  // namespace gossip::sw

#pragma once
// Command-line checks the benches share. CLI::Range lets "nan" through (every
// comparison with NaN is false); a bench's numbers must be finite.
#include <cmath>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

namespace gossip::bench {

/// A finite number in [lo, hi]: CLI::Range that refuses nan.
inline CLI::Validator finite_range(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v) || !std::isfinite(v) || v < lo || v > hi)
          return fmt::format("{} is not a finite number in [{}, {}]", text, lo, hi);
        return {};
      },
      fmt::format("FLOAT in [{} - {}]", lo, hi));
}

}  // namespace gossip::bench

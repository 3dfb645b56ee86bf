#pragma once
/// Command-line checks every program of the project shares (gossip-run, the
/// examples, the benches, the switch programs). CLI::Range reports "abc" and
/// "1.5" for an integer flag as "not in range" and lets "nan" through (every
/// comparison with NaN is false); these say what is wrong with the value:
///
///     --workers: abc is not a number: give an integer in [1, 256]
///     --workers: 1.5 is not an integer: give an integer in [1, 256]
///     --workers: 0 is outside [1, 256]
///     --grace: nan is not a finite number: give a number in [0, 86400]
///
/// (CLI11 puts the option's name in front.)
#include <cmath>
#include <concepts>
#include <limits>
#include <string>
#include <type_traits>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

namespace gossip::cli {

/// An integer in [lo, hi] (both inclusive).
template <std::integral Int>
CLI::Validator integer_range(Int lo, Int hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        const std::string want = fmt::format("give an integer in [{}, {}]", lo, hi);
        Int v{};
        // (An unsigned lexical_cast takes "-5" and wraps it round.)
        const auto first = text.find_first_not_of(" \t");
        const bool negative = std::is_unsigned_v<Int> && first != std::string::npos && text[first] == '-';
        if (negative || !CLI::detail::lexical_cast(text, v)) {
          double d = 0;
          if (!CLI::detail::lexical_cast(text, d)) return fmt::format("{} is not a number: {}", text, want);
          if (std::isfinite(d) && d == std::trunc(d)) {
            if (d < static_cast<double>(lo) || d > static_cast<double>(hi)) return fmt::format("{} is outside [{}, {}]", text, lo, hi);
            return fmt::format("{} is not written as an integer: write {:.0f}", text, d);
          }
          return fmt::format("{} is not an integer: {}", text, want);
        }
        if (v < lo || v > hi) return fmt::format("{} is outside [{}, {}]", text, lo, hi);
        return {};
      },
      fmt::format("INT in [{} - {}]", lo, hi));
}

/// A finite number in [lo, hi] (both inclusive; hi may be infinity).
inline CLI::Validator number_range(double lo, double hi = std::numeric_limits<double>::infinity()) {
  const std::string range = std::isinf(hi) ? fmt::format(">= {}", lo) : fmt::format("in [{}, {}]", lo, hi);
  return CLI::Validator(
      [lo, hi, range](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return fmt::format("{} is not a number: give a number {}", text, range);
        if (!std::isfinite(v)) return fmt::format("{} is not a finite number: give a number {}", text, range);
        if (v < lo || v > hi) return fmt::format("{} is outside the range: give a number {}", text, range);
        return {};
      },
      fmt::format("FLOAT {}", range));
}

}  // namespace gossip::cli

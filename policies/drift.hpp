#pragma once
#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gossip/error.hpp"
#include "gossip/options.hpp"
#include "gossip/policy.hpp"
#include "gossip/signal.hpp"

namespace gossip::policies {

/// Sends when the model has drifted more than `threshold` since it was last
/// sent: ‖x − x̂‖/‖x̂‖ when `relative`, else ‖x − x̂‖. The founding paper's rule.
///
///     gossip::policies::drift p{.threshold = 0.05, .relative = true, .max_interval = 50};
///     auto d = p.decide(s);  // fires once ‖x − x̂‖/‖x̂‖ > 0.05, or after 50 quiet steps
///
/// The comparison is strict: a drift exactly at the threshold does not fire.
/// When x̂ is zero and x is not, the relative drift is infinite and it fires.
/// A fired decision reports the drift and threshold (reason::threshold) or
/// steps_since_send and max_interval (reason::max_interval); a skip reports the
/// drift and threshold.
struct drift {
  static constexpr std::string_view config_name = "drift";
  static constexpr std::string_view help = "send when the (relative) drift ‖x − x̂‖ exceeds a fixed threshold";

  double threshold = 0.01;
  bool relative = true;
  std::uint64_t max_interval = 0;  ///< 0: no upper bound on the gap between sends

  decision decide(const signal& s) const noexcept {
    const double value = relative ? s.relative_drift() : s.drift();
    if (value > threshold) return decision::fire(reason::threshold, value, threshold);
    // A constant threshold can starve once the model settles; max_interval keeps
    // peers from drifting apart indefinitely.
    if (max_interval > 0 && s.steps_since_send >= max_interval)
      return decision::fire(reason::max_interval, static_cast<double>(s.steps_since_send),
                            static_cast<double>(max_interval));
    return decision::skip(reason::below_threshold, value, threshold);
  }

  /// The settings' ranges, for code (check()) and configs (from_options()).
  template <class Int>
  static void validate(const setting_check& c, double threshold, Int max_interval) {
    c(std::isfinite(threshold) && threshold > 0, "threshold", "a finite number > 0", threshold);
    c.at_least(max_interval, 0, "max_interval", " (0 = no limit)");
  }
  /// A policy built in code is checked as a config's is (any_policy calls this).
  void check() const { validate(setting_check("policy 'drift'"), threshold, max_interval); }

  static std::vector<option_spec> specs() {
    return {
        {"threshold", 0.01, "send when the drift exceeds this (number > 0)"},
        {"relative", true, "compare ‖x − x̂‖/‖x̂‖ (true) or ‖x − x̂‖ (false)"},
        {"max_interval", std::int64_t{0}, "send at least every this many steps (integer >= 0; 0 = no limit)"},
    };
  }

  static drift from_options(const options& o) {
    const double threshold = o.real("threshold");
    const std::int64_t max_interval = o.integer("max_interval");
    validate(setting_check("policy 'drift'", &o), threshold, max_interval);
    return drift{.threshold = threshold,
                 .relative = o.boolean("relative"),
                 .max_interval = static_cast<std::uint64_t>(max_interval)};
  }
};
static_assert(gossip::policy<drift>);

}  // namespace gossip::policies

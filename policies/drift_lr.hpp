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

/// SPARQ-SGD's trigger: after at least `min_interval` (H) steps, send when
/// ‖x − x̂‖² > c_t·η_t², with c_t = c0·(1 + step)^epsilon.
///
///     gossip::policies::drift_lr p{.c0 = 4.0, .epsilon = 0.0, .min_interval = 2};
///     auto d = p.decide(s);  // d.value = ‖x − x̂‖², d.threshold = c_t·η_t²
///
/// Drift per step is proportional to the learning rate, so a fixed threshold
/// starves after a learning-rate decay; scaling it by η_t² keeps the send rate
/// roughly unchanged across the schedule. The comparison is strict. With
/// η_t = 0 the threshold is 0 and any nonzero drift fires. A skip before H
/// steps reports steps_since_send and H (reason::min_interval).
struct drift_lr {
  static constexpr std::string_view config_name = "drift-lr";
  static constexpr std::string_view help =
      "SPARQ-style: send when ‖x − x̂‖² > c0·(1+step)^epsilon·lr², at most every min_interval steps";

  double c0 = 1.0;
  double epsilon = 0.0;  ///< c_t grows as (1 + step)^epsilon; 0 keeps it constant
  std::uint64_t min_interval = 1;

  /// The settings' ranges, for code (check()) and configs (from_options()).
  template <class Int>
  static void validate(const setting_check& c, double c0, double epsilon, Int min_interval) {
    c(std::isfinite(c0) && c0 > 0, "c0", "a finite number > 0", c0);
    // SPARQ needs c_t non-decreasing; a falling threshold is a different rule.
    c(std::isfinite(epsilon) && epsilon >= 0, "epsilon", "a finite number >= 0", epsilon);
    c.at_least(min_interval, 1, "min_interval");
  }
  /// A policy built in code is checked as a config's is (any_policy calls this).
  void check() const { validate(setting_check("policy 'drift-lr'"), c0, epsilon, min_interval); }

  /// c_t·η_t² at this step.
  double threshold_at(const signal& s) const noexcept {
    const double c = epsilon == 0 ? c0 : c0 * std::pow(1.0 + static_cast<double>(s.step), epsilon);
    return c * s.lr * s.lr;
  }

  decision decide(const signal& s) const noexcept {
    if (s.steps_since_send < min_interval)
      return decision::skip(reason::min_interval, static_cast<double>(s.steps_since_send),
                            static_cast<double>(min_interval));
    const double t = threshold_at(s);
    if (s.diff_sq > t) return decision::fire(reason::threshold, s.diff_sq, t);
    return decision::skip(reason::below_threshold, s.diff_sq, t);
  }

  static std::vector<option_spec> specs() {
    return {
        {"c0", 1.0, "threshold scale: send when ‖x − x̂‖² > c_t·lr² (number > 0)"},
        {"epsilon", 0.0, "c_t = c0·(1 + step)^epsilon, a slowly rising threshold (number >= 0; 0 = constant)"},
        {"min_interval", std::int64_t{1}, "send at most every this many steps, H (integer >= 1)"},
    };
  }

  static drift_lr from_options(const options& o) {
    const double c0 = o.real("c0"), epsilon = o.real("epsilon");
    const std::int64_t min_interval = o.integer("min_interval");
    validate(setting_check("policy 'drift-lr'", &o), c0, epsilon, min_interval);
    return drift_lr{.c0 = c0, .epsilon = epsilon, .min_interval = static_cast<std::uint64_t>(min_interval)};
  }
};
static_assert(gossip::policy<drift_lr>);

}  // namespace gossip::policies

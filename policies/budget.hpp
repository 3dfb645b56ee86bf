#pragma once
#include <algorithm>
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

/// Tunes a relative-drift threshold so that this rank sends `fraction` of the
/// bytes the periodic (every = 1) baseline would have sent by now. The
/// equal-traffic comparison tool: run it at the bytes of another policy and
/// see whether that policy's choice of *when* mattered.
///
///     gossip::policies::budget p(/*fraction=*/0.1);
///     auto d = p.decide(s);  // fires when ‖x − x̂‖/‖x̂‖ > p.threshold()
///     p.observe(o);          // after the step: nudges the threshold
///
/// decide(): skip (reason::min_interval) while steps_since_send < min_interval;
/// else fire (reason::threshold) when the relative drift > threshold(), strictly.
///
/// observe(): the target after step t is fraction · (t + 1) · bytes_per_send.
/// If bytes_sent is over it, threshold *= (1 + gain); if under, threshold /=
/// (1 + gain); if equal, unchanged. The step is multiplicative because drift
/// spans orders of magnitude over a run, and it acts on the sign of the
/// cumulative error, so it is an integral controller: the long-run byte ratio
/// converges to `fraction` while the threshold dithers around the value that
/// achieves it. Deterministic: no clock, no randomness. The threshold is kept
/// in [min_threshold, max_threshold] so a long quiet stretch cannot drive it to
/// zero (from which a multiplicative step could never recover).
class budget {
 public:
  static constexpr std::string_view config_name = "budget";
  static constexpr std::string_view help =
      "tune a relative-drift threshold so the bytes sent track `fraction` of the periodic-1 baseline's";
  static constexpr double min_threshold = 1e-12;
  static constexpr double max_threshold = 1e12;

  /// Throws gossip::config_error unless 0 < fraction <= 1, initial_threshold > 0,
  /// gain > 0 and min_interval >= 1.
  explicit budget(double fraction = 0.1, double initial_threshold = 0.01, double gain = 0.05,
                  std::uint64_t min_interval = 1)
      : m_fraction(fraction),
        m_gain(gain),
        m_min_interval(min_interval),
        m_threshold(std::clamp(initial_threshold, min_threshold, max_threshold)) {
    validate(setting_check("policy 'budget'"), fraction, initial_threshold, gain, min_interval);
  }

  /// The settings' ranges, for code (the constructor) and configs (from_options()).
  template <class Int>
  static void validate(const setting_check& c, double fraction, double initial_threshold, double gain, Int min_interval) {
    c(fraction > 0 && fraction <= 1, "fraction", "a number in (0, 1]", fraction);
    c(std::isfinite(initial_threshold) && initial_threshold > 0, "initial_threshold", "a finite number > 0", initial_threshold);
    c(std::isfinite(gain) && gain > 0, "gain", "a finite number > 0", gain);
    c.at_least(min_interval, 1, "min_interval");
  }

  decision decide(const signal& s) const noexcept {
    if (s.steps_since_send < m_min_interval)
      return decision::skip(reason::min_interval, static_cast<double>(s.steps_since_send),
                            static_cast<double>(m_min_interval));
    const double value = s.relative_drift();
    if (value > m_threshold) return decision::fire(reason::threshold, value, m_threshold);
    return decision::skip(reason::below_threshold, value, m_threshold);
  }

  void observe(const outcome& o) noexcept {
    const double target = m_fraction * (static_cast<double>(o.step) + 1.0) * static_cast<double>(o.bytes_per_send);
    const auto sent = static_cast<double>(o.bytes_sent);
    if (sent > target)
      m_threshold = std::min(m_threshold * (1 + m_gain), max_threshold);
    else if (sent < target)
      m_threshold = std::max(m_threshold / (1 + m_gain), min_threshold);
  }

  /// The relative-drift threshold decide() compares against now.
  double threshold() const noexcept { return m_threshold; }
  double fraction() const noexcept { return m_fraction; }
  double gain() const noexcept { return m_gain; }
  std::uint64_t min_interval() const noexcept { return m_min_interval; }

  static std::vector<option_spec> specs() {
    return {
        {"fraction", 0.1, "target bytes as a fraction of the periodic (every = 1) baseline's (0 < fraction <= 1)"},
        {"initial_threshold", 0.01, "relative-drift threshold to start from (number > 0)"},
        {"gain", 0.05, "per-step multiplicative adjustment of the threshold (number > 0)"},
        {"min_interval", std::int64_t{1}, "send at most every this many steps (integer >= 1)"},
    };
  }

  static budget from_options(const options& o) {
    const double fraction = o.real("fraction"), initial = o.real("initial_threshold"), gain = o.real("gain");
    const std::int64_t min_interval = o.integer("min_interval");
    validate(setting_check("policy 'budget'", &o), fraction, initial, gain, min_interval);
    return budget(fraction, initial, gain, static_cast<std::uint64_t>(min_interval));
  }

 private:
  double m_fraction;
  double m_gain;
  std::uint64_t m_min_interval;
  double m_threshold;
};
static_assert(gossip::policy<budget>);
static_assert(gossip::observing_policy<budget>);

}  // namespace gossip::policies

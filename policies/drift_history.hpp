#pragma once
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gossip/error.hpp"
#include "gossip/options.hpp"
#include "gossip/policy.hpp"
#include "gossip/signal.hpp"

namespace gossip::policies {

/// LAG's trigger: send when the drift since the last send is worth more than
/// `window` typical recent steps, i.e. when
///
///     ‖x − x̂‖² > xi · window · mean(‖x_t − x_{t−1}‖² over the last `window` steps)
///
///     gossip::policies::drift_history p(/*xi=*/1.0, /*window=*/10);
///     auto d = p.decide(s);  // needs s.step_sq: the engine provides it because
///                            // drift_history::wants_step_change is true
///
/// With a uniform weight xi this is exactly LAG's rule (Chen et al. 2018), whose
/// right-hand side is Σ_{d=1..D} ξ_d‖θ_{k+1−d} − θ_{k−d}‖² with D = window: the
/// mean times window is that sum. Read it as a step count: if every step moves
/// the model by s² and the steps are noise (a random walk), ‖x − x̂‖² ≈ k·s²
/// after k steps and it fires after about xi·window steps; if they point the
/// same way, ‖x − x̂‖² ≈ k²·s² and it fires after about √(xi·window) steps. So it
/// sends sooner when the model is really going somewhere.
///
/// History: decide() pushes s.step_sq into a ring of the last `window` values;
/// a NaN or infinite step_sq (the engine's "no predecessor yet") is not
/// recorded. Until at least one value is recorded the threshold is unknown: it
/// skips (reason::below_threshold, threshold = +inf) and fires with
/// reason::max_interval once steps_since_send >= window. While fewer than
/// `window` values are recorded, the mean of those it has is used. The
/// comparison is strict, so a model that has not moved never fires once there
/// is history.
class drift_history {
 public:
  static constexpr std::string_view config_name = "drift-history";
  static constexpr std::string_view help =
      "LAG-style: send when ‖x − x̂‖² > xi · window · mean of the last `window` per-step changes ‖x_t − x_{t−1}‖²";
  static constexpr bool wants_step_change = true;
  static constexpr std::size_t max_window = 256;

  /// Throws gossip::config_error unless xi > 0 and 1 <= window <= max_window.
  explicit drift_history(double xi = 1.0, std::size_t window = 10) : m_xi(xi), m_window(window) {
    validate(setting_check("policy 'drift-history'"), xi, window);
  }

  /// The settings' ranges, for code (the constructor) and configs (from_options()).
  template <class Int>
  static void validate(const setting_check& c, double xi, Int window) {
    c(std::isfinite(xi) && xi > 0, "xi", "a finite number > 0", xi);
    c(std::cmp_greater_equal(window, 1) && std::cmp_less_equal(window, max_window), "window", fmt::format("an integer in [1, {}]", max_window),
      window);
  }

  decision decide(const signal& s) noexcept {
    if (std::isfinite(s.step_sq) && s.step_sq >= 0) push(s.step_sq);
    if (m_count == 0) {
      if (s.steps_since_send >= m_window)
        return decision::fire(reason::max_interval, static_cast<double>(s.steps_since_send),
                              static_cast<double>(m_window));
      return decision::skip(reason::below_threshold, s.diff_sq, std::numeric_limits<double>::infinity());
    }
    const double t = m_xi * static_cast<double>(m_window) * mean_step_sq();
    if (s.diff_sq > t) return decision::fire(reason::threshold, s.diff_sq, t);
    return decision::skip(reason::below_threshold, s.diff_sq, t);
  }

  double xi() const noexcept { return m_xi; }
  std::size_t window() const noexcept { return m_window; }
  /// How many step changes are recorded (at most window()).
  std::size_t history() const noexcept { return m_count; }
  /// Mean of the recorded step changes; NaN when none is recorded.
  double mean_step_sq() const noexcept {
    if (m_count == 0) return std::numeric_limits<double>::quiet_NaN();
    // Summed afresh (at most 256 adds) rather than kept as a running sum, so
    // rounding error cannot accumulate over millions of steps.
    double sum = 0;
    for (std::size_t i = 0; i < m_count; ++i) sum += m_ring[i];
    return sum / static_cast<double>(m_count);
  }

  static std::vector<option_spec> specs() {
    return {
        {"xi", 1.0, "send when ‖x − x̂‖² > xi · window · mean recent ‖x_t − x_{t−1}‖² (number > 0)"},
        {"window", std::int64_t{10}, fmt::format("how many recent steps to average, D (integer in [1, {}])", max_window)},
    };
  }

  static drift_history from_options(const options& o) {
    const double xi = o.real("xi");
    const std::int64_t window = o.integer("window");
    validate(setting_check("policy 'drift-history'", &o), xi, window);
    return drift_history(xi, static_cast<std::size_t>(window));
  }

 private:
  void push(double v) noexcept {
    m_ring[m_next] = v;
    m_next = (m_next + 1) % m_window;
    if (m_count < m_window) ++m_count;
  }

  double m_xi;
  std::size_t m_window;
  std::array<double, max_window> m_ring{};
  std::size_t m_next = 0;
  std::size_t m_count = 0;
};
static_assert(gossip::policy<drift_history>);
static_assert(gossip::policy_wants_step_change<drift_history>());

}  // namespace gossip::policies

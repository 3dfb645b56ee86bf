#pragma once
#include <algorithm>
#include <cmath>
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

/// AdaComm (Wang & Joshi): a period that shrinks as the loss falls,
///
///     τ = ceil(sqrt(η₀·F / (η·F₀)) · τ₀), clamped to [1, tau_max]
///
/// where F is an exponential moving average of the reported loss
/// (F ← smoothing·F + (1 − smoothing)·loss), η the current learning rate, and
/// (η₀, F₀) the reference point. It fires (reason::period) when
/// steps_since_send >= τ, else skips (reason::not_due); both report
/// steps_since_send and τ.
///
///     gossip::policies::adacomm p(/*tau0=*/10, /*tau_max=*/100, /*smoothing=*/0.9);
///     auto d = p.decide(s);  // s.loss and s.lr feed the period; p.period() is τ
///
/// Decisions taken here:
/// - Only finite, positive losses are used (the formula is a ratio of losses);
///   others are treated as "no loss this step".
/// - The reference point is the first step that reports both a usable loss and
///   a positive learning rate: F₀ is F at that step (the loss itself, since the
///   EMA starts at the first loss), η₀ is that learning rate.
/// - Until a reference point exists, or when this step's learning rate is not
///   positive, τ = τ₀: it behaves as periodic with every = tau0.
/// - A step without a loss after the reference point keeps the last F (a loop
///   that reports its loss only now and then is not reset to τ₀).
/// - τ is recomputed at every step, so a falling loss can bring a send forward.
/// State lives in decide(), so decide() is not const.
class adacomm {
 public:
  static constexpr std::string_view config_name = "adacomm";
  static constexpr std::string_view help =
      "AdaComm: period tau = ceil(sqrt(lr0·F/(lr·F0))·tau0), shrinking as the (smoothed) loss falls";

  /// Throws gossip::config_error unless tau0 >= 1, tau_max >= tau0 and 0 <= smoothing < 1.
  explicit adacomm(std::uint64_t tau0 = 10, std::uint64_t tau_max = 100, double smoothing = 0.9)
      : m_tau0(tau0), m_tau_max(tau_max), m_smoothing(smoothing), m_period(tau0) {
    validate(setting_check("policy 'adacomm'"), tau0, tau_max, smoothing);
  }

  /// The settings' ranges, for code (the constructor) and configs (from_options()).
  template <class Int>
  static void validate(const setting_check& c, Int tau0, Int tau_max, double smoothing) {
    c.at_least(tau0, 1, "tau0");
    c(tau_max >= tau0, "tau_max", fmt::format("an integer >= tau0 ({})", tau0), tau_max, "tau0");
    c(smoothing >= 0 && smoothing < 1, "smoothing", "a number in [0, 1)", smoothing);
  }

  decision decide(const signal& s) noexcept {
    const bool usable_loss = std::isfinite(s.loss) && s.loss > 0;
    const bool usable_lr = std::isfinite(s.lr) && s.lr > 0;
    if (usable_loss) {
      m_loss = std::isnan(m_loss) ? s.loss : m_smoothing * m_loss + (1 - m_smoothing) * s.loss;
      if (!has_reference() && usable_lr) {
        m_loss0 = m_loss;
        m_lr0 = s.lr;
      }
    }
    m_period = (has_reference() && usable_lr) ? period_for(s.lr) : m_tau0;
    const auto since = static_cast<double>(s.steps_since_send);
    const auto tau = static_cast<double>(m_period);
    return s.steps_since_send >= m_period ? decision::fire(reason::period, since, tau)
                                          : decision::skip(reason::not_due, since, tau);
  }

  /// τ used by the last decide() (tau0 before the first).
  std::uint64_t period() const noexcept { return m_period; }
  /// The smoothed loss F; NaN before the first usable loss.
  double loss_average() const noexcept { return m_loss; }
  bool has_reference() const noexcept { return m_lr0 > 0; }
  std::uint64_t tau0() const noexcept { return m_tau0; }
  std::uint64_t tau_max() const noexcept { return m_tau_max; }

  static std::vector<option_spec> specs() {
    return {
        {"tau0", std::int64_t{10}, "initial period in steps, at the first reported loss (integer >= 1)"},
        {"tau_max", std::int64_t{100}, "longest period in steps (integer >= tau0)"},
        {"smoothing", 0.9, "weight of the old value in the loss moving average (number in [0, 1))"},
    };
  }

  static adacomm from_options(const options& o) {
    const std::int64_t tau0 = o.integer("tau0"), tau_max = o.integer("tau_max");
    const double smoothing = o.real("smoothing");
    validate(setting_check("policy 'adacomm'", &o), tau0, tau_max, smoothing);
    return adacomm(static_cast<std::uint64_t>(tau0), static_cast<std::uint64_t>(tau_max), smoothing);
  }

 private:
  std::uint64_t period_for(double lr) const noexcept {
    const double tau = std::ceil(std::sqrt((m_lr0 * m_loss) / (lr * m_loss0)) * static_cast<double>(m_tau0));
    // Written so that an overflow to +inf also lands on tau_max.
    if (!(tau < static_cast<double>(m_tau_max))) return m_tau_max;
    return std::max<std::uint64_t>(1, static_cast<std::uint64_t>(tau));
  }

  std::uint64_t m_tau0;
  std::uint64_t m_tau_max;
  double m_smoothing;
  std::uint64_t m_period;
  double m_loss = std::numeric_limits<double>::quiet_NaN();
  double m_loss0 = 0;
  double m_lr0 = 0;
};
static_assert(gossip::policy<adacomm>);

}  // namespace gossip::policies

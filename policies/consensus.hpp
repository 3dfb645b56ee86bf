#pragma once
#include <algorithm>
#include <cmath>
#include <tuple>
#include <cstdint>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gossip/error.hpp"
#include "gossip/options.hpp"
#include "gossip/policy.hpp"

namespace gossip::policies {

/// Consensus control: send when this rank's model has drifted far enough
/// from what its peers hold to matter at the current learning rate, with the
/// push-sum weight kept in balance.
///
///     value     = ‖x − x̂‖/‖x̂‖ · w^balance
///     threshold = threshold · (lr / lr_max)^lr_exponent
///
/// and it fires when value > threshold (after at least min_interval steps), or
/// after max_interval steps without a send. lr_max is the largest learning
/// rate reported so far.
///
///     gossip::policies::consensus p;           // the defaults
///     auto d = p.decide(s);  // d.value and d.threshold as above
///
/// Why each part (docs/non-iid.md has the measurements):
/// - A fixed relative threshold (policy 'drift') fires 10x less often after a
///   10x learning-rate decay, since drift per step scales with the rate: on
///   skewed shards the models then separate for hundreds of steps at the end
///   of training. Scaling the threshold by (lr/lr_max)^lr_exponent with an
///   exponent below 1 keeps sending through the low-rate phases.
/// - Under push-sum a rank that sends more often than its sources gives its
///   weight away (each send hands half of it to a peer): its data then count
///   for almost nothing in the average model. Multiplying the drift by
///   w^balance makes a light rank wait and a heavy one hurry, which pulls the
///   weights back towards 1. For other protocols the weight stays 1.
///
/// Through an aggregator's sync all-reduce (signal::shared_schedule: every
/// member must send at the same steps) the policy paces the group instead,
/// from values every member shares: g, the group's root-mean-square relative
/// drift at the last round (carried by the all-reduce), the τ steps that
/// round came after, and the learning rate. Drift grows about linearly
/// between rounds, so the next round comes when g·k/τ, k the steps since the
/// last round, reaches the threshold at the current rate; at most 2τ steps
/// after it (the interval at most doubles per round), and within
/// min_interval and max_interval. Rounds start at step 0 and double their
/// interval until the drift says otherwise. Every member computes the same
/// steps as long as every member reports the same learning rate.
/// State (lr_max, the last round's interval) lives in decide() and observe(),
/// so neither is const.
class consensus {
 public:
  static constexpr std::string_view config_name = "consensus";
  static constexpr std::string_view help =
      "send when ‖x − x̂‖/‖x̂‖·w^balance > threshold·(lr/lr_max)^lr_exponent: consensus control with push-sum weights kept in balance; "
      "through a switch's sync all-reduce, rounds paced alike on every member by the group's mean drift";

  /// It fires on ‖x − x̂‖: whatever keeps moving the model after a merge
  /// (quasi-global momentum carrying the merge on) soon makes it send, and the
  /// peers' reply corrects any overshoot. A fixed schedule has no such loop.
  static constexpr bool closed_loop = true;

  double threshold = 0.1;
  double lr_exponent = 0.5;
  double balance = 2.0;
  std::uint64_t min_interval = 1;
  std::uint64_t max_interval = 100;  ///< 0: no upper bound

  /// The threshold in force for a step that reports `lr`.
  double threshold_at(double lr) const noexcept {
    if (!(lr > 0) || !(m_lr_max > 0) || lr_exponent == 0) return threshold;
    return threshold * std::pow(std::min(1.0, lr / m_lr_max), lr_exponent);
  }

  decision decide(const signal& s) noexcept {
    if (std::isfinite(s.lr) && s.lr > m_lr_max) m_lr_max = s.lr;
    if (max_interval > 0 && s.steps_since_send >= max_interval)
      return fire_at(decision::fire(reason::max_interval, static_cast<double>(s.steps_since_send), static_cast<double>(max_interval)), s);
    if (s.steps_since_send < min_interval)
      return decision::skip(reason::min_interval, static_cast<double>(s.steps_since_send), static_cast<double>(min_interval));
    if (s.shared_schedule) return decide_shared(s);
    const double w = s.weight > 0 ? s.weight : 0.0;
    const double value = s.relative_drift() * (balance == 0 ? 1.0 : std::pow(w, balance));
    const double t = threshold_at(s.lr);
    if (value > t) return decision::fire(reason::threshold, value, t);
    return decision::skip(reason::below_threshold, value, t);
  }

  /// A round went out (shared schedule): its interval paces the next one.
  void observe(const outcome& o) noexcept {
    if (o.sent && m_pending_interval > 0) m_round_interval = m_pending_interval;
    m_pending_interval = 0;
  }

  /// Largest learning rate seen so far (0 before the first positive one).
  double lr_max() const noexcept { return m_lr_max; }
  /// Shared schedule: the steps between the last two rounds (0 before a round).
  std::uint64_t round_interval() const noexcept { return m_round_interval; }

  /// The settings' ranges, for code (check()) and configs (from_options()).
  template <class Int>
  static void validate(const setting_check& c, double threshold, double lr_exponent, double balance, Int min_interval, Int max_interval) {
    c(std::isfinite(threshold) && threshold > 0 && threshold <= 1e6, "threshold", "a number in (0, 1000000]", threshold);
    c(std::isfinite(lr_exponent) && lr_exponent >= 0 && lr_exponent <= 2, "lr_exponent", "a number in [0, 2]", lr_exponent);
    c(std::isfinite(balance) && balance >= 0 && balance <= 4, "balance", "a number in [0, 4]", balance);
    c.at_least(min_interval, 1, "min_interval");
    c.at_least(max_interval, 0, "max_interval", " (0 = no limit)");
    c(max_interval == 0 || max_interval >= min_interval, "max_interval", fmt::format("0 or an integer >= min_interval ({})", min_interval),
      max_interval, "min_interval");
  }
  /// A policy built in code is checked as a config's is (any_policy calls this).
  void check() const {
    validate(setting_check("policy 'consensus'"), threshold, lr_exponent, balance, min_interval, max_interval);
  }

  static std::vector<option_spec> specs() {
    return {
        {"threshold", 0.1, "relative drift ‖x − x̂‖/‖x̂‖ that fires at the largest learning rate (number in (0, 1000000])"},
        {"lr_exponent", 0.5, "the threshold scales as (lr/lr_max)^lr_exponent (number in [0, 2]; 0: fixed, like 'drift')"},
        {"balance", 2.0, "the drift is multiplied by w^balance, w the push-sum weight (number in [0, 4]; 0: ignore the weight)"},
        {"min_interval", std::int64_t{1}, "send at most every this many steps (integer >= 1)"},
        {"max_interval", std::int64_t{100}, "send at least every this many steps (0 = no limit, else an integer >= min_interval)"},
    };
  }

  static consensus from_options(const options& o) {
    consensus p;
    p.threshold = o.real("threshold");
    p.lr_exponent = o.real("lr_exponent");
    p.balance = o.real("balance");
    const std::int64_t min_interval = o.integer("min_interval"), max_interval = o.integer("max_interval");
    validate(setting_check("policy 'consensus'", &o), p.threshold, p.lr_exponent, p.balance, min_interval, max_interval);
    p.min_interval = static_cast<std::uint64_t>(min_interval);
    p.max_interval = static_cast<std::uint64_t>(max_interval);
    return p;
  }

 private:
  decision fire_at(decision d, const signal& s) noexcept {
    m_pending_interval = s.steps_since_send;
    return d;
  }

  // Only values every member of the group shares; see the class comment.
  decision decide_shared(const signal& s) noexcept {
    const auto k = static_cast<double>(s.steps_since_send);
    const double t = threshold_at(s.lr);
    if (m_round_interval == 0) return fire_at(decision::fire(reason::period, k, 1), s);  // the first round
    const auto tau = static_cast<double>(m_round_interval);
    const double g = std::isfinite(s.group_drift_sq) && s.group_drift_sq > 0 ? std::sqrt(s.group_drift_sq) : 0.0;
    const double value = g * k / tau;  // the group's drift now, extrapolated from the last round
    if (value > t && 2 * k >= tau) return fire_at(decision::fire(reason::threshold, value, t), s);
    if (k >= 2 * tau) return fire_at(decision::fire(reason::period, k, 2 * tau), s);
    return decision::skip(reason::below_threshold, value, t);
  }

  double m_lr_max = 0;
  std::uint64_t m_round_interval = 0, m_pending_interval = 0;
};
static_assert(gossip::policy<consensus>);

}  // namespace gossip::policies

#pragma once
/// What a policy sees at each step, and what it returns.
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>

namespace gossip {

/// Drift of one tensor since it was last sent: ‖x − x̂‖² and ‖x̂‖².
struct tensor_drift {
  double diff_sq = 0;
  double ref_sq = 0;
};

/// The drift signal, measured in one fused pass over x and x̂ at every step.
struct signal {
  std::uint64_t step = 0;              ///< steps taken so far by this rank (0-based)
  std::uint64_t round = 0;             ///< topology round the send would use (= sends so far)
  double diff_sq = 0;                  ///< ‖x − x̂‖² over the whole model
  double ref_sq = 0;                   ///< ‖x̂‖² over the whole model
  double step_sq = std::numeric_limits<double>::quiet_NaN();  ///< ‖x_t − x_{t−1}‖², if a policy asked for it
  std::span<const tensor_drift> tensors;
  double lr = 0;                       ///< learning rate the caller reported
  double loss = std::numeric_limits<double>::quiet_NaN();  ///< loss the caller reported, if any
  std::uint64_t steps_since_send = 0;  ///< steps since x̂ was last refreshed
  double seconds_since_send = 0;
  std::uint64_t bytes_sent = 0;        ///< bytes this rank has posted so far
  std::uint64_t bytes_per_send = 0;    ///< bytes one firing posts (all its peers)
  /// This rank's estimate of the relative consensus distance ‖x_i − x̄‖²/‖x̄‖²,
  /// from the models it received (half their mean squared distance to the local
  /// model at merge time, smoothed); NaN until something was received, and
  /// always for a model in device memory (the merge kernel does not measure it).
  double consensus = std::numeric_limits<double>::quiet_NaN();
  double weight = 1;                   ///< push-sum weight (1 for other protocols)
  int rank = 0, world = 1;             ///< this rank and the number of ranks
  /// True where every member must send at the same steps: an aggregator's sync
  /// all-reduce (transport "switch", mode sync). A policy then decides from
  /// what every member shares — step counts, lr, group_drift_sq — never from
  /// its own drift. (A member that fires at another step makes the others
  /// wait for it, bounded by the transport's timeout.)
  bool shared_schedule = false;
  /// With shared_schedule: the group's mean of ‖x_i − x̂_i‖²/‖x̂_i‖² at the
  /// last round's post, carried by the all-reduce itself, so every member
  /// reads the same value; NaN before the first round completed.
  double group_drift_sq = std::numeric_limits<double>::quiet_NaN();

  double drift() const noexcept { return std::sqrt(diff_sq); }
  /// ‖x − x̂‖ / ‖x̂‖; infinite when x̂ is zero and x is not.
  double relative_drift() const noexcept {
    if (ref_sq > 0) return std::sqrt(diff_sq / ref_sq);
    return diff_sq > 0 ? std::numeric_limits<double>::infinity() : 0.0;
  }
  bool has_loss() const noexcept { return !std::isnan(loss); }
};

/// Why a policy fired or held back; recorded in stats and the trace.
enum class reason : std::uint8_t {
  below_threshold,  ///< skip: drift under the threshold
  min_interval,     ///< skip: too soon after the last send
  not_due,          ///< skip: a period has not elapsed
  never,            ///< skip: this policy never sends
  threshold,        ///< send: drift crossed the threshold
  max_interval,     ///< send: too long since the last send
  period,           ///< send: the period elapsed
  finish,           ///< send: a final averaging round of engine::finish()
};

constexpr const char* to_string(reason r) noexcept {
  switch (r) {
    case reason::below_threshold: return "below_threshold";
    case reason::min_interval: return "min_interval";
    case reason::not_due: return "not_due";
    case reason::never: return "never";
    case reason::threshold: return "threshold";
    case reason::max_interval: return "max_interval";
    case reason::period: return "period";
    case reason::finish: return "finish";
  }
  return "?";
}

struct decision {
  bool send = false;
  gossip::reason why = reason::below_threshold;
  double value = 0;      ///< the quantity compared (e.g. relative drift)
  double threshold = 0;  ///< what it was compared against

  static constexpr decision skip(gossip::reason r, double v = 0, double t = 0) noexcept { return {false, r, v, t}; }
  static constexpr decision fire(gossip::reason r, double v = 0, double t = 0) noexcept { return {true, r, v, t}; }
};

/// What happened after a decision: fed back to policies that adapt.
struct outcome {
  std::uint64_t step = 0;
  bool sent = false;
  std::uint64_t bytes = 0;        ///< bytes posted by this step (0 when skipped)
  std::uint64_t bytes_sent = 0;   ///< running total after this step
  std::uint64_t bytes_per_send = 0;
};

}  // namespace gossip

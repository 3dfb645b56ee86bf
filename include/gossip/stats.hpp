#pragma once
/// Counters an engine keeps, a JSON report, and a bounded decision trace.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "gossip/signal.hpp"

namespace gossip {

inline constexpr std::size_t reason_count = 7;
inline constexpr std::size_t send_window_capacity = 256;

struct peer_stats {
  int rank = -1;
  std::uint64_t bytes_sent = 0, messages_sent = 0, bytes_received = 0, messages_received = 0, dropped = 0;
  bool dead = false;
};

struct tensor_stats {
  std::string name;
  std::uint64_t bytes_sent = 0;
  double last_diff_sq = 0;  ///< ‖x − x̂‖² of this tensor at the last decision
  double max_relative = 0;  ///< largest ‖x − x̂‖/‖x̂‖ of this tensor seen at a decision
};

struct engine_stats {
  int rank = 0, world = 1;
  std::string policy, topology, protocol, transport;
  std::string momentum = "local";  ///< what the engine does with registered momentum buffers
  std::uint64_t steps = 0, sends = 0, skips = 0;
  std::array<std::uint64_t, reason_count> by_reason{};  ///< indexed by gossip::reason
  std::uint64_t send_busy = 0;     ///< fired, but every send buffer was still on the wire
  std::uint64_t no_live_peer = 0;  ///< fired, but no target was alive
  std::uint64_t bytes_sent = 0, messages_sent = 0, bytes_received = 0, messages_received = 0, dropped = 0;
  double relative_drift_last = 0, relative_drift_max = 0, relative_drift_at_send_sum = 0;
  double weight = 1;               ///< push-sum weight
  double step_seconds = 0;         ///< time inside engine.step(), waits included
  double wait_seconds = 0;         ///< of which waiting for peers (collect)
  double busy_wait_seconds = 0;    ///< of which waiting for a send buffer (wait_when_busy)
  std::vector<peer_stats> peers;   ///< only peers this rank talks to
  std::vector<tensor_stats> tensors;
  std::vector<int> dead_peers;

  // Instruments: how sending is spread over training, and how far apart the models are.
  double lr_at_send_sum = 0;       ///< Σ learning rate reported at the steps that sent
  double weight_min = 1, weight_max = 1;  ///< push-sum weight range over the run (after each step)
  double consensus_last = 0;       ///< latest consensus-distance estimate (see signal::consensus)
  double consensus_sum = 0;        ///< Σ of the estimate over the steps that had one
  std::uint64_t consensus_steps = 0;
  /// Sends per window of `send_window_steps` steps, from step 0. Fixed capacity:
  /// when full, neighbouring windows are merged and the window doubles, so a run
  /// of any length fits without allocating on the step path.
  std::vector<std::uint32_t> sends_per_window;
  std::uint64_t send_window_steps = 16;

  /// Counts a send at `step` into sends_per_window (capacity reserved by the engine).
  void count_send_window(std::uint64_t step) noexcept;

  /// The report as a JSON document.
  std::string to_json(int indent = 2) const;
};

/// One decision, as recorded in the trace.
struct trace_event {
  std::uint64_t step = 0;
  double t_us = 0;         ///< since the engine was built
  double dur_us = 0;       ///< time the step's send took
  float value = 0, threshold = 0;
  gossip::reason why = reason::never;
  bool sent = false;
  std::uint32_t targets = 0;
  std::uint64_t bytes = 0;
  float lr = 0;          ///< learning rate the caller reported
  float weight = 1;      ///< push-sum weight after the step
  float consensus = 0;   ///< consensus-distance estimate (NaN: none yet)
};

/// Writes the report to `path` (throws gossip::error naming the path on failure).
void write_stats_file(const std::string& path, const engine_stats& stats);

/// Writes events as Chrome-trace / Perfetto JSON (one track per rank).
void write_chrome_trace(const std::string& path, int rank, const std::vector<trace_event>& events);

}  // namespace gossip

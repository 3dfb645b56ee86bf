#pragma once
/// Counters an engine keeps, a JSON report, and a bounded decision trace.
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gossip/signal.hpp"

namespace gossip {

inline constexpr std::size_t reason_count = 8;
inline constexpr std::size_t send_window_capacity = 256;

struct peer_stats {
  int rank = -1;
  std::uint64_t bytes_sent = 0, messages_sent = 0, bytes_received = 0, messages_received = 0, dropped = 0;
  std::uint64_t bytes_raw = 0;  ///< what bytes_sent would have been without the codec
  bool dead = false;
  /// A codec's streams with it started from the model both ranks began with
  /// (no full first message; codec_settings::shared_start).
  bool shared_start = false;
  // Push-sum mass (zero for other protocols).
  double weight_sent = 0;          ///< shares posted to this peer
  double weight_unconfirmed = 0;   ///< of which posted after the last message merged from it
  double last_weight_sent = 0;     ///< share on the last message posted to it
  double last_weight_received = 0; ///< share on the last message merged from it
};

/// A peer found dead, as this rank saw it (see engine::handle_failures).
struct dead_peer {
  int rank = -1;
  std::uint64_t step = 0;       ///< this rank's step when the failure was reported
  double seconds = 0;           ///< since the engine was built
  /// Push-sum shares posted to it that the transport failed to deliver: taken
  /// back by this rank, so not lost (exact).
  double weight_refunded = 0;
  /// Shares delivered to it that it may not have merged before it died: those
  /// posted after the last message merged from it or, for a peer that never
  /// sends here, the last one (an estimate). Lost with it.
  double weight_unconfirmed = 0;
  /// Its own weight, estimated from its last message here: with uniform
  /// mixing weights a sender keeps exactly the share it ships to each target.
  /// Lost with it; several survivors may estimate the same mass.
  double weight_estimate = 0;
};

struct tensor_stats {
  std::string name;
  std::uint64_t bytes_sent = 0;  ///< after the codec (segment headers included)
  std::uint64_t bytes_raw = 0;   ///< the same values in fp32
  double last_diff_sq = 0;  ///< ‖x − x̂‖² of this tensor at the last decision
  double max_relative = 0;  ///< largest ‖x − x̂‖/‖x̂‖ of this tensor seen at a decision
};

struct engine_stats {
  int rank = 0, world = 1;
  std::string policy, topology, protocol, transport;
  std::string momentum = "local";  ///< what the engine does with registered momentum buffers
  std::string momentum_merge;        ///< quasi-global only: "full" or "spread" (engine_settings::momentum_merge)
  std::string codec = "none";      ///< [codec] name
  std::string device = "host";     ///< where the model lives: "host", or its device backend's name ("cuda")
  /// Training steps and their sends and skips; finish()'s averaging rounds
  /// count apart (finish_rounds, decision `finish`) and stay out of the
  /// per-send means (drift and lr at send, sends_per_window). Everything else
  /// counts them with the training's: bytes and messages, send_busy,
  /// no_live_peer, the timings, the weight range, the consensus estimate (and
  /// engine::steps(), the step index, counts both).
  std::uint64_t steps = 0, sends = 0, skips = 0, finish_rounds = 0;
  std::array<std::uint64_t, reason_count> by_reason{};  ///< what the policy decided, indexed by gossip::reason ("decisions" in JSON; a firing that sent nothing counts in no_live_peer, send_busy or dropped too)
  std::uint64_t send_busy = 0;     ///< fired, but every send buffer was still on the wire
  std::uint64_t no_live_peer = 0;  ///< fired, but no target was alive
  std::uint64_t bytes_sent = 0, messages_sent = 0, bytes_received = 0, messages_received = 0, dropped = 0;
  std::uint64_t bytes_raw = 0;     ///< bytes_sent without the codec: header plus the model in fp32, per message
  std::uint64_t transport_rejoins = 0;  ///< the transport joined again after its far end lost its state (switch restarted)
  /// The transport's own count of what it dropped (transport_counters::dropped).
  /// UCX: messages dropped on arrival, a source's receive backlog having
  /// overflowed (a full model's push-sum share rides with the source's next
  /// message; a codec's stream is started again, codec_resyncs); loopback: posts to a peer
  /// that had left; switch: packets retransmitted.
  std::uint64_t transport_dropped = 0;
  /// Codec streams that lost a message in the transport and were started
  /// again with a full message (UCX asks the source for one), counted when
  /// it arrives, and the messages merged as weight only meanwhile: changes
  /// against the x̂ this rank no longer holds, whose push-sum shares ride
  /// with the full one.
  std::uint64_t codec_resyncs = 0, codec_resync_skipped = 0;
  /// The relative drift ‖x − x̂‖/‖x̂‖: at the last step, its largest value and
  /// its sum over the sends. A step whose x̂ was zero (a model started at 0)
  /// has an infinite one: it stays out of max and of the sum, which counts
  /// the sends it holds in relative_drift_at_send_count.
  double relative_drift_last = 0, relative_drift_max = 0, relative_drift_at_send_sum = 0;
  std::uint64_t relative_drift_at_send_count = 0;
  double weight = 1;               ///< push-sum weight
  double step_seconds = 0;         ///< time inside engine.step(), waits included
  double wait_seconds = 0;         ///< of which waiting for peers (collect)
  double busy_wait_seconds = 0;    ///< of which waiting for a send buffer (wait_when_busy)
  std::uint64_t lead_waits = 0;    ///< steps that waited for a peer to catch up ([engine] max_lead)
  double lead_wait_seconds = 0;    ///< time those waits took
  std::uint64_t lead_timeouts = 0; ///< lead waits that gave up after timeout_s (training went on unpaced)
  /// Steps that first merged what waited in the transport's receive backlog
  /// (engine::catch_up: its sources had sent faster than it merged), and the
  /// time that took.
  std::uint64_t backlog_waits = 0;
  double backlog_wait_seconds = 0;
  std::uint64_t step_beacons = 0;  ///< step beacons sent, a few bytes each (max_lead over a peer-to-peer transport)
  /// Messages of member ranks merged, by their age in steps: this rank's
  /// step at the merge less the step the sender sent it at, 0, 1, 2, 3, and
  /// 4 or more. Lockstep transports merge at 1 (same_step_merge: 0). A
  /// push-sum share misses the optimizer steps between its send and its
  /// merge; in_flight_makeup makes up one of them, numerator_steps all.
  std::array<std::uint64_t, 5> merge_age{};
  std::vector<peer_stats> peers;   ///< only peers this rank talks to
  std::vector<tensor_stats> tensors;
  std::vector<int> dead_peers;
  std::vector<dead_peer> dead;    ///< the same peers, with what was lost with them
  /// Push-sum mass this rank sent to peers that died and that is lost with
  /// them: Σ over `dead` of weight_unconfirmed (an estimate). The exact loss of
  /// a run is world − Σ survivors' weights once every survivor has drained
  /// (examples/common/trainer.hpp reports it).
  double lost_weight = 0;

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

  /// Adds a send's relative drift to the sum at send, when it is finite.
  void count_drift_at_send(double relative) noexcept {
    if (!std::isfinite(relative)) return;
    relative_drift_at_send_sum += relative;
    ++relative_drift_at_send_count;
  }

  /// Counts a send at `step` into sends_per_window (capacity reserved by the engine).
  void count_send_window(std::uint64_t step) noexcept;

  /// The report as a JSON document.
  std::string to_json(int indent = 2) const;
};

/// What came of a step's decision: the policy (or finish()) fired and the
/// model left, it did not fire, or it fired and nothing left, for the reason
/// named (no target alive, every send buffer still on the wire, every post
/// dropped by the transport).
enum class send_outcome : std::uint8_t { sent, not_fired, no_live_peer, send_busy, dropped };
inline const char* to_string(send_outcome o) noexcept {
  switch (o) {
    case send_outcome::sent: return "sent";
    case send_outcome::not_fired: return "not_fired";
    case send_outcome::no_live_peer: return "no_live_peer";
    case send_outcome::send_busy: return "send_busy";
    case send_outcome::dropped: return "dropped";
  }
  return "?";
}

/// One decision, as recorded in the trace.
struct trace_event {
  std::uint64_t step = 0;
  double t_us = 0;         ///< when the step decided (after its merge), since the engine was built
  double dur_us = 0;       ///< time the step's decision and send took
  float value = 0, threshold = 0;
  gossip::reason why = reason::never;
  bool sent = false;
  std::uint32_t targets = 0;
  std::uint64_t bytes = 0;
  std::uint64_t bytes_raw = 0;  ///< the same messages without the codec
  float lr = 0;          ///< learning rate the caller reported
  float weight = 1;      ///< push-sum weight after the step
  float consensus = 0;   ///< consensus-distance estimate (NaN: none yet)
  send_outcome outcome = send_outcome::not_fired;  ///< `why` is what the policy decided; this, what came of it
};

/// Writes the report to `path` (throws gossip::error naming the path on failure).
void write_stats_file(const std::string& path, const engine_stats& stats);
/// Checks an output path of [engine] `key` (stats, trace) when the engine is
/// built rather than when finish() writes it: with several ranks it must hold
/// {rank} (else they would all write one file), and its directory must exist
/// and be writable. config_error naming the key otherwise.
/// `where` names where the path was set (engine_settings::stats_where).
void check_output_path(const std::string& path, int rank, int world, std::string_view key, std::string_view where = "[engine]");
/// Whether two output paths name one file for rank `rank` ({rank} filled in,
/// "." and ".." and links resolved as far as the paths exist).
bool same_output_file(const std::string& a, const std::string& b, int rank);

/// Writes events as Chrome-trace / Perfetto JSON (one track per rank, all in
/// process 0, so that the files of a run's ranks merged — their traceEvents
/// arrays joined — are one trace).
/// A send's args carry `codec` and its `ratio` (bytes after / before the codec).
/// An event's `ts` is `start_unix_us` + its t_us: with the wall-clock time at
/// which the engine started, microseconds since the Unix epoch, so that the
/// ranks' tracks line up as far as their hosts' clocks agree (0: since the
/// start). `otherData` holds the rank and start_unix_us.
void write_chrome_trace(const std::string& path, int rank, const std::vector<trace_event>& events, std::string_view codec = "none",
                        double start_unix_us = 0);

}  // namespace gossip

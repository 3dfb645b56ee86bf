#pragma once
/// The engine: the one object a training loop talks to.
///
///     gossip::model_view model;
///     model.add("fc1.weight", w1).add("fc1.bias", b1);
///     auto cfg = gossip::config::load("run.toml");
///     gossip::engine eng(model, rank, world, cfg, fabric.endpoint(rank));
///     for (...) {
///       forward(); backward(); optimizer.step();
///       eng.step({.lr = lr, .loss = loss});   // merge, measure, decide, send
///     }
///     eng.finish();                           // optional final averaging
///     fmt::print("{}\n", eng.stats().to_json());
///
/// step() merges what peers sent, measures drift in one fused pass, asks the
/// policy, and — if it fires — copies the model into a send buffer (that copy
/// becomes x̂) and posts it. With a [codec], the send encodes, per target, the
/// change since what that target holds (gossip/codec.hpp); the policy still
/// sees the drift of the uncompressed model. Every buffer is allocated here, in the
/// constructor; step() allocates nothing and takes no lock.
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gossip/codec.hpp"
#include "gossip/config.hpp"
#include "gossip/device.hpp"
#include "gossip/drift.hpp"
#include "gossip/error.hpp"
#include "gossip/model.hpp"
#include "gossip/policies/consensus.hpp"
#include "gossip/policy.hpp"
#include "gossip/protocol.hpp"
#include "gossip/stats.hpp"
#include "gossip/topology.hpp"
#include "gossip/transport.hpp"
#include "gossip/wait.hpp"

namespace gossip {

struct engine_settings {
  std::chrono::duration<double> timeout{60.0};
  int send_buffers = 2;
  std::string trace_path;               ///< Chrome-trace JSON written by finish(); empty: off
  std::size_t trace_capacity = 100000;  ///< events kept at most (preallocated)
  int trace_skips_every = 1;            ///< record every n-th skip; sends are always recorded
  std::string stats_path;               ///< JSON report written by finish(); empty: off
  /// Where stats_path and trace_path were set, for errors about them (engine_settings::from fills them in:
  /// the config file, a --set or an environment variable).
  std::string stats_where = "[engine]", trace_where = "[engine]";
  int finish_rounds = -1;               ///< final averaging rounds; -1: 2·⌈log2 world⌉
  bool wait_when_busy = false;          ///< a firing policy waits for a send buffer instead of skipping
  /// Over a lockstep transport (loopback) the messages of step t are merged
  /// at step t + 1, after the optimizer step in between, which then runs with
  /// the push-sum share each send gave away still in flight: gossip every τ
  /// steps moves the ranks' average at 1 − 1/(2τ) of the learning rate (half
  /// at every step). With same_step_merge, step() merges this step's
  /// messages before it returns (waiting for the sources to post them), so
  /// the shares are back before the next optimizer step and merged models
  /// are a step fresher. Communication then no longer overlaps the next
  /// step's compute. Lockstep transports only (a config_error otherwise).
  bool same_step_merge = false;
  /// Push-sum, where a send's share is merged after the optimizer step that
  /// follows the send (loopback without same_step_merge; UCX): that step
  /// moves this rank's numerator x = w·z by w·Δz with w the weight it kept,
  /// so the share in flight misses it, and gossip every τ steps moves the
  /// ranks' average at 1 − 1/(2τ) of the learning rate. With
  /// in_flight_makeup, the next step() adds what the share missed,
  /// z ← z + (w_sent/w)·(z − x̂) with x̂ the model sent, fused into the first
  /// pass that touches z (a merge, or the drift pass): the average then moves
  /// at the full rate. Exact when the share is merged one step after its send
  /// (loopback); over UCX, where a share can be merged sooner or later, one
  /// optimizer step is made up whichever it is. A poll() that merges between the send and the optimizer step
  /// finds nothing to make up yet, and drops it. No effect with
  /// same_step_merge (nothing is in flight across an optimizer step). Push-sum
  /// host models only: the engine refuses it under other protocols and for a
  /// model in device memory.
  bool in_flight_makeup = false;
  /// Push-sum: every optimizer step counts in full in this rank's numerator
  /// x = w·z, whatever the weight w it ran at, as Stochastic Gradient Push
  /// applies its gradients (Assran et al. 2019): the next step() adds
  /// z ← z + c·(z − x_{t−1}), c = 1/w − 1, with x_{t−1} the model the last
  /// step left, fused into the first pass that touches z. The ranks' average
  /// then moves by the mean of their steps however long a share stays in
  /// flight, and a rank whose weight shares made larger than 1 steps less.
  /// Below w = ½, c stays at 1 and the step counts at 2w: in z no step is
  /// more than twice the optimizer's (a rank that sends at every step and
  /// hears late fell to w ≈ 0.1 over UCX, and steps of 1/w its optimizer's
  /// cost 3 pt on one seed of bench/torch). Quasi-global momentum divides
  /// z's displacement by 1 + c, so that the factor is not carried into the
  /// next step. Keeps x_{t−1} (one more copy of
  /// the model, read and written by the drift pass). A poll() that merges
  /// between steps leaves the next step's correction out. Push-sum host
  /// models only (refused otherwise); not with in_flight_makeup (which makes
  /// up one step after each send) or same_step_merge.
  bool numerator_steps = false;
  /// 0: off. Else (4 by default) a step waits (merging what arrives) while this rank is
  /// more than max_lead steps ahead of its slowest live source, as heard in
  /// the step beacons the transport sends every max_lead/2 steps and in
  /// model headers (a transport without beacons: of the newest step any
  /// source's model carried). So no rank trains on far ahead of another and
  /// later merges a stale model from it. Push-sum halves a sender's weight at every send, so a
  /// rank L steps ahead of its sources ends with a weight of about 2^−L and
  /// its gradients stop counting (docs/non-iid.md, "Over processes"). A
  /// source that finished or died no longer counts; a wait that reaches
  /// `timeout` gives up (stats: lead_timeouts) and the rank trains on
  /// unpaced until a source is heard again. Peer-to-peer transports only:
  /// loopback is lockstep already, and through a switch no member's step
  /// comes back.
  std::uint64_t max_lead = 4;
  /// What becomes of the momentum buffers a model registered (model_view::momentum):
  /// quasi_global rebuilds them from the model's displacement, gossip included
  /// (Lin et al. 2021); local leaves them alone; automatic is quasi_global
  /// where ranks merge in lockstep — a transport that delivers at step
  /// boundaries (loopback) or the switch's sync all-reduce, merged by every
  /// member at the step after it posted — and local over an asynchronous
  /// exchange (UCX, the switch's async aggregate), where merges land at any
  /// point of a peer's progress and quasi-global momentum carried their noise
  /// on: 4.8 points lower on label-skewed shards over UCX and 3.0 lower in
  /// bench/torch (docs/non-iid.md, "Over processes").
  enum class momentum_mode { automatic, quasi_global, local };
  momentum_mode momentum = momentum_mode::automatic;
  float momentum_beta = 0.9f;
  /// How much of a merge quasi-global momentum carries on (qgm_args::merge_share):
  /// auto: full for a closed-loop policy (any_policy::closed_loop), else spread.
  enum class merge_momentum { automatic, full, spread };
  merge_momentum momentum_merge = merge_momentum::automatic;

  /// From resolved [engine] options (see engine_option_specs()).
  static engine_settings from(const options& o);
  /// The same ranges as from(), for settings filled in code: the engine
  /// checks them when it is built (config_error naming the field).
  void check() const;
  /// The settings against each other and the transport they will run over
  /// (`lockstep`: it delivers at step boundaries, as loopback does):
  /// same_step_merge needs lockstep ranks, and numerator_steps excludes
  /// in_flight_makeup and same_step_merge. `who` starts the error.
  void check_with(std::string_view transport, bool lockstep, std::string_view who) const;
  /// The key that numerator_steps = true conflicts with, or null.
  const char* numerator_conflict() const noexcept;
  /// The stats and trace paths for rank `rank` of `world`: each needs {rank}
  /// when several ranks write, and a writable folder; the two must differ.
  void check_outputs(int rank, int world) const;
};

/// Everything an engine is built from; config::load() produces one, or fill it in code.
struct engine_spec {
  any_policy policy{policies::consensus{}, "consensus"};  ///< the shipped default
  component_config topology{"exponential", options("<code> [topology]")};
  component_config protocol{"push-sum", options("<code> [protocol]")};
  component_config codec{"auto", options("<code> [codec]")};  ///< what a message carries (gossip/codec.hpp; auto: int8 over a network)
  engine_settings settings;
  std::uint64_t config_fingerprint = 0;  ///< ranks with different fingerprints refuse to connect
  std::string config_settings;           ///< config::shared_settings(), to name what differs (empty: not told)

  static engine_spec from(const config& cfg);
};

struct step_info {
  double lr = 0;
  double loss = std::numeric_limits<double>::quiet_NaN();
};

struct step_result {
  bool sent = false;
  gossip::reason why = reason::never;
  double relative_drift = 0;
  std::size_t merged = 0;  ///< messages merged at this step
};

class engine {
 public:
  engine(const model_view& model, int rank, int world, engine_spec spec, any_transport transport);
  engine(const model_view& model, int rank, int world, const config& cfg, any_transport transport)
      : engine(model, rank, world, engine_spec::from(cfg), std::move(transport)) {}
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;
  ~engine();

  /// Merge, measure, decide, send, record. Allocation- and lock-free.
  step_result step(const step_info& info = {});

  /// Merges whatever peers sent since the last step, without deciding or
  /// sending. Call it while the training loop waits on something else (an
  /// evaluation barrier, a checkpoint): over an asynchronous transport a peer
  /// may be waiting for this rank to take its message. Returns the count merged.
  std::size_t poll();

  /// Waits (bounded) until no send buffer is referenced by the transport.
  void flush();

  /// Runs `rounds` forced exchange rounds without local updates (final
  /// averaging; -2, the default, uses the [engine] finish_rounds setting, any
  /// other negative value 2·⌈log2 world⌉), writes the stats
  /// and trace files if configured, and leaves the fabric. Idempotent; a call
  /// that an exception cut short (a timeout, an interrupt) is taken up where
  /// it stopped by the next one, without sending its rounds again.
  void finish(int rounds = -2);

  /// Counters, refreshed from the transport. Like every member but the
  /// constructor's, call it from the thread that steps: it updates the
  /// counters in place, and the engine takes no lock. A monitor on another
  /// thread gets a copy handed over by the training thread.
  const engine_stats& stats();

  double weight() const noexcept { return m_protocol.weight(); }
  int rank() const noexcept { return m_rank; }
  int world() const noexcept { return m_world; }
  std::uint64_t steps() const noexcept { return m_step; }
  /// x̂: the model as peers last received it. For a device model whose
  /// transport takes device memory directly, this points to device memory.
  std::span<const float> snapshot() const noexcept { return {m_snapshot, m_elements}; }
  /// The decisions recorded so far (as the trace file holds them). Recorded
  /// only when `[engine] trace` names a file (engine_settings::trace_path):
  /// otherwise empty, and the step spends nothing on it. At most
  /// trace_capacity events.
  const std::vector<trace_event>& trace() const noexcept { return m_trace; }
  /// The consensus-distance estimate policies see (signal::consensus); NaN until a model arrived.
  double consensus() const noexcept { return m_consensus; }
  /// Through an aggregator's sync all-reduce: the group's mean relative drift²
  /// at the last round (signal::group_drift_sq); NaN elsewhere or before it.
  double group_drift_sq() const noexcept { return m_group_drift_sq; }

 private:
  step_result run_step(const step_info& info, bool forced);
  void count_send(bool forced, double relative_drift, double lr, std::uint64_t t) noexcept;
  void send_failed(std::span<const peer> targets, std::size_t at, double share, std::uint64_t t) noexcept;
  void write_outputs();
  void merge_collected(std::size_t n, std::uint64_t t);
  std::byte* buffer(int i) noexcept {
    return (m_send_base ? m_send_base : m_send_storage.get()) + static_cast<std::size_t>(i) * m_stream_slots * m_message_bytes;
  }
  bool buffer_busy(int i) noexcept;  // any of buffer i's messages still on the wire
  std::uint32_t send_encoded(std::byte* buf, std::span<const peer> targets, std::uint64_t t, std::uint64_t& bytes, std::uint64_t& raw);
  // m_received[lo, hi), no sender twice; returns the end of what is kept there
  // (changes a stream out of step cannot apply are taken out, weight only).
  std::size_t decode_inbound(std::size_t lo, std::size_t hi);
  void settle_resync(std::size_t source);  // push-sum: a stream out of step will not get its full message
  void start_shared_streams();
  void handle_failures();
  void settle_dead(int rank, double share);
  void catch_up(std::uint64_t step, std::size_t& merged);
  static constexpr std::size_t backlog_high = 4, backlog_low = 1;  // catch_up's bounds, in messages of one source
  [[noreturn]] void throw_not_finite(std::uint64_t step) const;
  void reseed_after_not_finite();
  void check_memory(int send_buffers, bool qgm) const;
  // model_view::guard()s: a registration gone stale throws before the model is touched.
  void check_guards() const {
    for (const auto& g : m_guards) g();
  }
  std::size_t merge_inbound(std::uint64_t t);
  bool await_buffer(int i);
  void wait_for_buffer(int i);  // bounded, merging what arrives meanwhile  // collect, merge, count, release
  void merge_received(std::size_t lo, std::size_t hi);  // m_received[lo, hi)
  // The make-up coefficient w_sent/w of in_flight_makeup (0: none pending), taken once.
  float take_makeup() noexcept;
  bool makeup_pending() const noexcept { return m_settings.numerator_steps ? m_step_makeup != 0 : m_makeup > 0; }
  // What the make-up is measured from: x̂ (in_flight_makeup) or x_{t−1} (numerator_steps).
  const float* makeup_ref() const noexcept { return m_settings.numerator_steps ? m_prev.data() : m_snapshot; }
  void attach_device(const device_backend& backend, bool transport_takes_device_memory);

  int m_rank, m_world;
  std::vector<tensor_slot> m_slots;
  std::size_t m_elements = 0, m_message_bytes = 0;
  any_policy m_policy;
  topology m_topology;
  protocol m_protocol;
  engine_settings m_settings;
  std::uint64_t m_config_fingerprint = 0, m_layout_fingerprint = 0;
  std::string m_config_settings;
  std::uint64_t m_model_fingerprint = 0;  // the model when built, for a codec's shared start (0: not offered)
  std::vector<std::string> m_tensor_names;

  // Buffers, all allocated by the constructor.
  std::unique_ptr<std::byte[]> m_send_storage;  // send_buffers × (header + model)
  int m_current = 0;                            // buffer whose payload is x̂
  double m_makeup = 0;  // push-sum weight the last send left in flight (in_flight_makeup), not made up yet
  float* m_snapshot = nullptr;                  // x̂ = payload of buffer m_current
  std::vector<float> m_prev;                    // x_{t−1}, for policies that ask and for quasi-global momentum
  std::vector<float> m_mhat;                    // quasi-global momentum m̂ (only when buffers were registered)
  std::uint64_t m_last_merge_step = 0;          // step of the latest merge
  std::uint64_t m_merge_steps = 0;             // τ of a merge since the last drift pass (0: none)
  std::uint64_t m_lead_released_at = ~std::uint64_t{0};  // max_lead: the step heard when a lead wait timed out
  std::uint64_t m_heard_step = 0;               // newest step a member's message carried (max_lead)
  bool m_merge_full = true;                     // quasi-global momentum carries merges on in full
  std::vector<float*> m_momentum;               // per tensor: the optimizer's momentum buffer, or null
  std::vector<tensor_drift> m_tensor_drift;
  std::vector<received> m_received;
  std::vector<int> m_peer_index;                // rank → index in m_stats.peers, or −1
  std::vector<trace_event> m_trace;
  std::string m_send_failed;  // set when a post threw: no more steps (send_failed)
  bool m_stats_pending = false, m_trace_pending = false;  // finish()'s files still to write (write_outputs)
  inbox m_inbox;
  // A model in device memory: x̂, x_{t−1} and the (pinned) send buffers live
  // in m_device. Destroyed after the transport has left, before the inbox it pins.
  std::unique_ptr<device_model> m_device;
  std::byte* m_send_base = nullptr;            // m_device's send storage, else null
  std::vector<double> m_merge_coefficients;
  bool m_device_step = false;                  // m_device measures ‖x_t − x_{t−1}‖²
  bool m_device_qgm = false;                   // m_device updates quasi-global momentum in its drift pass
  // Codec state (empty for "none"). Per outgoing stream, the x̂ its target
  // holds of this rank; per source, this rank's x̂ of it (what is merged).
  codec m_codec;
  std::size_t m_stream_slots = 1;               // messages per send buffer: one per target with a codec
  std::vector<float> m_codec_snapshot;          // x at the last send: the drift reference
  std::vector<float> m_out_hat, m_in_hat;
  // Lag-corrected merges (codec::corrects_merge): per source, the estimate of
  // its model that is merged; the stream this rank sent on last; the merge
  // step (0: the measured fraction of a change's energy the codec keeps).
  bool m_corrected_merge = false;
  std::vector<float> m_in_estimate;
  int m_fresh_stream = -1;
  bool m_drift_from_held = false;  // drift measured from the freshest target's x̂ (codec::drift_from_held)
  double m_merge_step = 0;
  double m_kept_energy = 1;
  bool m_kept_measured = false;
  std::size_t m_corrected_in_collect = 0;       // messages of the last collect merged as corrected estimates…
  double m_collect_gamma = 0;                   // …with this step
  std::vector<int> m_out_index;                 // rank → outgoing stream, or −1
  std::vector<char> m_out_primed, m_in_primed;  // both ends hold the same x̂: the shared start model, or a full message went through
  // Per source: its stream lost a message in the transport and waits for a
  // full one (m_in_primed is 0 meanwhile), and the push-sum weight of the
  // changes taken out since, which rides with that full message.
  std::vector<char> m_in_resync;
  std::vector<double> m_in_resync_weight;
  std::vector<std::size_t> m_counts;            // tensor sizes, layout order
  std::vector<std::size_t> m_rows;              // per tensor: rows of a declared matrix, else 0
  std::vector<std::size_t> m_state_offset;      // per tensor: its codec state in a stream's share of m_out_state
  std::size_t m_state_floats = 0;               // codec state per outgoing stream (lowrank: Q of each matrix)
  std::vector<float> m_out_state;
  std::vector<std::uint64_t> m_segment_bytes;   // per tensor: encoded bytes of the message being sent
  std::vector<std::uint64_t> m_received_bytes;  // per collected message: its wire bytes
  std::uint64_t m_last_message_bytes = 0;
  any_transport m_transport;  // after m_inbox: destroyed (and departed) first

  engine_stats m_stats;
  // Consensus-distance estimate from received models (signal::consensus):
  // an exponential average over merges, weight consensus_smoothing on the newest.
  static constexpr double consensus_smoothing = 0.25;
  double m_consensus = std::numeric_limits<double>::quiet_NaN();
  // An aggregator's sync all-reduce: every member sends at the same steps
  // (signal::shared_schedule), and each reply carries the group's mean drift².
  bool m_shared_schedule = false;
  double m_group_drift_sq = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::function<void()>> m_guards;  // model_view::guards()
  std::uint64_t m_step = 0;
  bool m_in_step = false;          // inside run_step (merge_age's base: m_step there, m_step − 1 between steps)
  float m_step_makeup = 0;         // numerator_steps: min(1/w − 1, 1) for this step's optimizer step, taken once
  double m_step_scale = 1;         // numerator_steps: 1 + that, for quasi-global momentum's displacement
  bool m_prev_fresh = true;        // x_{t−1} is z as the last step left it (no poll() merged since)
  bool m_reseed = false;           // a step found the model not finite: x_{t−1} and m̂ start again from x and the momentum buffers
  std::uint64_t m_round = 0;  // sends so far: the topology round of the next send
  std::int64_t m_last_send_step = -1;
  std::chrono::steady_clock::time_point m_start, m_last_send_time;
  double m_start_unix_us = 0;  // the wall clock at m_start (the trace's time base, so that ranks line up)
  bool m_copies_on_post = false, m_finished = false;
  // How far a finish() that an exception (a Ctrl-C in a wait) cut short got:
  // the next call goes on from there rather than sending its rounds again,
  // which the drain handshake, once begun, would not count.
  int m_finish_rounds_done = 0;
  bool m_finish_merged = false;  // the rounds and the last collect are done
  std::uint64_t m_skips_seen = 0;  // skipped steps so far, for trace_skips_every
  bool m_beacon_pacing = false;  // the transport reports its slowest source's step (capabilities().step_beacons)
};

}  // namespace gossip
#include "gossip/engine-inl.hpp"

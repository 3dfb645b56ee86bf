#pragma once
// Bodies of gossip::engine (included by engine.hpp): construction, the step,
// merging, failures and finish. engine_settings-inl.hpp reads the config;
// engine_codec-inl.hpp encodes and decodes the compressed streams.
#include <algorithm>
#include <limits>
#include <utility>

#include "gossip/engine.hpp"
#include "gossip/engine_codec-inl.hpp"
#include "gossip/engine_settings-inl.hpp"

namespace gossip {

// Defined in engine_settings-inl.hpp, which a program may include first (it
// then reaches this file through engine.hpp before its own helpers).
namespace detail {
inline void check_protocol_carrier(std::string_view protocol, bool aggregated, std::string_view transport, bool aggregates, std::string_view who);
template <class Where>
void refuse_outside_push_sum(const engine_settings& s, std::string_view protocol, bool device, const Where& where);
}  // namespace detail

inline engine::engine(const model_view& model, int rank, int world, engine_spec spec, any_transport transport)
    : m_rank(rank), m_world(world), m_policy(std::move(spec.policy)), m_settings(std::move(spec.settings)),
      m_config_fingerprint(spec.config_fingerprint), m_config_settings(std::move(spec.config_settings)), m_transport(std::move(transport)) {
  if (world < 1 || rank < 0 || rank >= world)
    throw config_error(fmt::format("engine: rank {} is outside the world of {} ranks", rank, world));
  if (!m_policy) throw config_error(fmt::format("engine (rank {}): no policy was given", rank));
  if (!m_transport) throw config_error(fmt::format("engine (rank {}): no transport was given", rank));
  m_guards = model.guards();
  check_guards();
  if (model.size() == 0) throw config_error(fmt::format("engine (rank {}): the model has no tensors", rank));
  if (model.elements() == 0)
    throw config_error(fmt::format("engine (rank {}): the model's {} tensor(s) hold no values (registered before they were sized?)", rank,
                                   model.size()));
  m_settings.check();
  m_settings.check_outputs(rank, world);
  const auto caps = m_transport.capabilities();
  m_settings.check_with(caps.name, caps.copies_on_post, fmt::format("engine (rank {})", rank));
  m_topology = topology_registry().make(spec.topology.name, spec.topology.opts, rank, world);
  m_protocol = protocol_registry().make(spec.protocol.name, spec.protocol.opts);
  detail::refuse_outside_push_sum(m_settings, m_protocol.type() == protocol::kind::push_sum ? "push-sum" : std::string_view(spec.protocol.name),
                                  model.device() != nullptr, [&](const char*) { return fmt::format("engine (rank {})", rank); });
  // momentum = auto: quasi-global where ranks merge in lockstep — a transport
  // that delivers at step boundaries (loopback), or the switch's sync
  // all-reduce, which every member merges at the step after it posted — and
  // local over an asynchronous exchange (UCX, the switch's async aggregate).
  // A device model gets it from its backend's drift kernel. Gossip with peers at every
  // step (a fixed period of 1) keeps local momentum under auto too: merging
  // every step leaves little shard bias for momentum to gather, and carrying
  // each pairwise average on in momentum slows the pair's consensus
  // (docs/non-iid.md, "Momentum at every step"). The switch's all-reduce
  // gives every member the same exact average, and there it pays at any period.
  // A codec that leaves most of each change for later messages (topk,
  // randomk, lowrank) keeps local momentum too where its merges are
  // lag-corrected: carried on in momentum, the noise of each corrected merge
  // grows instead of averaging out (README, "Codecs").
  using mm = engine_settings::momentum_mode;
  // codec = auto (the default): int8 where messages cross a network between
  // processes — not in-process (loopback copies on post), not through a
  // switch that sums them, not for a device model — and ranks are paced
  // (max_lead > 0), so that a stream, which cannot skip a message, never
  // meets an overflowed receive backlog; none elsewhere. Over UCX at 100
  // Mbit/s it sends a quarter of the bytes and, less queued, fresher models
  // (README, "bench/torch").
  const codec configured_codec = make_codec(spec.codec);
  m_codec = configured_codec.resolve(!caps.copies_on_post && !m_protocol.aggregated() && !m_protocol.sends_delta() &&
                                           !model.device() && m_settings.max_lead > 0);
  if (m_codec.settings().step > 0 && m_protocol.type() == protocol::kind::stale_copy)
    throw config_error(fmt::format("engine (rank {}): [codec] step = {} applies to the merges of push-sum and pairwise; stale-copy moves by "
                                   "[protocol] gamma instead (e.g. gamma = 0.1 with topk or randomk): set that, and leave step out",
                                   rank, m_codec.settings().step));
  m_corrected_merge = m_codec.corrects_merge() && (m_protocol.type() == protocol::kind::push_sum || m_protocol.type() == protocol::kind::pairwise);
  m_drift_from_held = m_codec.drift_from_held();
  m_shared_schedule = m_protocol.aggregated() && !m_protocol.sends_delta();
  const bool lockstep = caps.copies_on_post || m_shared_schedule;
  const bool every_step_pairwise = !m_shared_schedule && m_policy.fixed_period() == 1;
  const bool sparse_corrected = m_corrected_merge && !m_codec.sends_whole_change();
  // stale-copy pulls towards its peers' last copies at every step: fed into momentum, that pull is carried on as
  // if it were the gradient's (iid/4, seeds 1–3: 60.8 / 66.8 / 69.2 % against 84.0 / 83.7 / 83.6 % with local momentum).
  const bool stale_copy = m_protocol.type() == protocol::kind::stale_copy;
  const bool quasi_global = m_settings.momentum == mm::quasi_global ||
                            (m_settings.momentum == mm::automatic && lockstep && !every_step_pairwise && !sparse_corrected && !stale_copy);
  if (quasi_global)
    for (const auto& g : model.momentum_guards()) {
      g();
      m_guards.push_back(g);
    }
  for (const auto& t : model.tensors()) {
    if (t.dtype != dtype::f32)
      throw config_error(fmt::format("engine (rank {}): tensor '{}' is {}; this engine exchanges f32 tensors", rank, t.name, to_string(t.dtype)));
    if (t.memory != memory_kind::host && !model.device())
      throw config_error(fmt::format("engine (rank {}): tensor '{}' lives in device memory but the model view has no device backend; "
                                     "call model.on_device(gossip::cuda::device(stream)) (gossip/cuda.hpp, libgossip_cuda)", rank, t.name));
    if (model.device() && t.memory != model.device()->memory())
      throw config_error(fmt::format("engine (rank {}): tensor '{}' is in {} memory but the model's backend is '{}'; keep every tensor of "
                                     "a device model in device memory", rank, t.name, t.memory == memory_kind::host ? "host" : "device",
                                     model.device()->name()));
    m_slots.push_back({static_cast<float*>(t.data), t.count, m_elements});
    m_momentum.push_back(quasi_global ? t.momentum : nullptr);
    // The buffers are rebuilt with momentum_beta: an optimizer stepping with another β would train with neither.
    if (quasi_global && t.momentum && model.momentum_beta() &&
        std::abs(*model.momentum_beta() - m_settings.momentum_beta) > 1e-6 * *model.momentum_beta())
      throw config_error(fmt::format("engine (rank {}): the optimizer's momentum is {} but [engine] momentum_beta is {}; quasi-global "
                                     "momentum rebuilds its buffers with momentum_beta: set it to {} (config::follow_momentum does), or "
                                     "set [engine] momentum = \"local\"",
                                     rank, *model.momentum_beta(), m_settings.momentum_beta, *model.momentum_beta()));
    m_tensor_names.push_back(t.name);
    m_rows.push_back(t.rows);
    m_elements += t.count;
  }
  m_protocol.prepare(m_topology.sources(), m_elements);
  if (m_codec.compresses()) {
    if (model.device())
      throw config_error(fmt::format("engine (rank {}): codec '{}' is available for host models only; set [codec] name = \"none\"", rank,
                                     m_codec.name()));
    if (m_protocol.aggregated() || m_protocol.sends_delta())
      throw config_error(fmt::format("engine (rank {}): codec '{}' cannot be used with protocol '{}': an aggregating switch adds fp32 "
                                     "values and cannot sum compressed messages; set [codec] name = \"none\"",
                                     rank, m_codec.name(), m_protocol.name()));
  }
  // (After the codec checks, which say more.)
  detail::check_protocol_carrier(spec.protocol.name, m_protocol.aggregated(), caps.name, caps.aggregates, fmt::format("engine (rank {})", rank));

  const auto layout = model.layout();
  m_layout_fingerprint = fingerprint(layout);
  m_message_bytes = sizeof(wire_header) + m_elements * sizeof(float);
  if (m_codec.compresses()) {
    std::size_t largest = 0, side = 0;
    for (std::size_t i = 0; i < m_slots.size(); ++i) {
      const std::size_t n = m_slots[i].count;
      if (n > std::numeric_limits<std::uint32_t>::max())
        throw config_error(fmt::format("engine (rank {}): tensor '{}' has {} values; codec '{}' takes at most 2^32 − 1 per tensor: register "
                                       "it as several tensors, or set [codec] name = \"none\"",
                                       rank, m_tensor_names[i], n, m_codec.name()));
      m_counts.push_back(n);
      largest = std::max(largest, n);
      m_state_offset.push_back(m_state_floats);
      const std::size_t state = m_codec.state_floats(n, m_rows[i]);
      if (state) side = std::max(side, m_rows[i] + n / m_rows[i]);
      m_state_floats += state;
    }
    // lowrank that factors nothing would send every tensor as its fallback
    // while the stats and the config say lowrank.
    if (m_codec.settings().kind == codec_kind::lowrank && m_state_floats == 0) {
      const std::size_t declared = static_cast<std::size_t>(std::count_if(m_rows.begin(), m_rows.end(), [](std::size_t r) { return r > 0; }));
      throw config_error(fmt::format(
          "engine (rank {}): codec 'lowrank' factors matrices, but it would factor none of this model's {} tensors ({}); every tensor "
          "would go as its fallback '{}': declare the weights' shapes (model_view::matrix(name, rows, cols); gossip::torch and the "
          "Python module declare 2-D parameters), lower [codec] rank, or set [codec] name = \"{}\"",
          rank, m_slots.size(),
          declared == 0 ? std::string("none is declared a matrix")
                        : fmt::format("none of the {} declared matrices is large enough for rank {} to send fewer bytes and of min_elements {} values",
                                      declared, m_codec.settings().rank, m_codec.settings().min_elements),
          to_string(m_codec.settings().fallback), to_string(m_codec.settings().fallback)));
    }
    // The same for a codec whose min_elements exceeds every tensor: each would
    // go in fp32 under the codec's name, with the codec's copies of the model.
    if (m_codec.settings().kind != codec_kind::lowrank && largest > 0 && largest < m_codec.settings().min_elements)
      throw config_error(fmt::format("engine (rank {}): codec '{}' sends tensors of fewer than min_elements = {} values in fp32, and the "
                                     "largest of this model's {} tensors has {}: it would compress nothing; lower [codec] "
                                     "min_elements, or set [codec] name = \"none\"",
                                     rank, m_codec.name(), m_codec.settings().min_elements, m_slots.size(), largest));
    m_codec.prepare(largest, side);
    m_message_bytes = std::max(m_message_bytes, sizeof(wire_header) + m_codec.payload_capacity(m_counts));
    // One message per target: each stream encodes against its own x̂.
    m_stream_slots = std::max<std::size_t>(1, m_topology.destinations().size());
  }
  m_message_bytes = (m_message_bytes + 63) / 64 * 64;

  m_copies_on_post = caps.copies_on_post;
  m_beacon_pacing = caps.step_beacons;
  const int buffers = m_copies_on_post ? 1 : m_settings.send_buffers;
  // Delta payloads keep x̂ in one more buffer after the send buffers. It starts
  // at zero: nobody holds anything of this rank yet, so its first send is the model.
  const int extra = m_protocol.sends_delta() ? 1 : 0;
  m_settings.send_buffers = buffers;
  // Quasi-global momentum on a host model: x_{t−1} and m̂ (a device model's backend keeps its own).
  const bool host_qgm = !model.device() && std::any_of(m_momentum.begin(), m_momentum.end(), [](const float* p) { return p != nullptr; });
  if (!model.device()) {  // a device model gets its buffers, x̂ and x_{t−1} from its backend, below
    check_memory(buffers + extra, host_qgm);
    m_send_storage = std::make_unique<std::byte[]>(static_cast<std::size_t>(buffers + extra) * m_stream_slots * m_message_bytes);
    if (m_codec.compresses()) {
      m_codec_snapshot.resize(m_elements);
      m_snapshot = m_codec_snapshot.data();
      for (const auto& s : m_slots) std::memcpy(m_snapshot + s.offset, s.data, s.count * sizeof(float));
      if (m_codec.settings().shared_start) m_model_fingerprint = fingerprint(std::span<const float>(m_codec_snapshot));
    } else if (m_protocol.sends_delta()) {
      m_snapshot = reinterpret_cast<float*>(buffer(buffers) + sizeof(wire_header));
      std::fill(m_snapshot, m_snapshot + m_elements, 0.0f);
    } else {
      m_snapshot = reinterpret_cast<float*>(buffer(0) + sizeof(wire_header));
      for (const auto& s : m_slots) std::memcpy(m_snapshot + s.offset, s.data, s.count * sizeof(float));
    }
    if (m_policy.wants_step_change() || host_qgm || m_settings.numerator_steps) {
      m_prev.resize(m_elements);
      for (const auto& s : m_slots) std::memcpy(m_prev.data() + s.offset, s.data, s.count * sizeof(float));
    }
    if (host_qgm) {  // m̂ starts as the optimizer's momentum (normally zero)
      m_mhat.assign(m_elements, 0.0f);
      for (std::size_t i = 0; i < m_slots.size(); ++i)
        if (m_momentum[i]) std::memcpy(m_mhat.data() + m_slots[i].offset, m_momentum[i], m_slots[i].count * sizeof(float));
    }
  }

  {
    using mm = engine_settings::merge_momentum;
    m_merge_full = m_settings.momentum_merge == mm::full || (m_settings.momentum_merge == mm::automatic && m_policy.closed_loop());
  }
  m_tensor_drift.resize(m_slots.size());
  m_received.resize(std::max<std::size_t>(m_topology.sources().size(), static_cast<std::size_t>(world)));
  if (m_codec.compresses()) {
    const auto& dests = m_topology.destinations();
    m_out_index.assign(static_cast<std::size_t>(world), -1);
    for (std::size_t k = 0; k < dests.size(); ++k) m_out_index[static_cast<std::size_t>(dests[k])] = static_cast<int>(k);
    m_out_hat.assign(dests.size() * m_elements, 0.0f);
    m_out_primed.assign(dests.size(), 0);
    m_out_state.assign(dests.size() * m_state_floats, 0.0f);
    m_in_hat.assign(m_topology.sources().size() * m_elements, 0.0f);
    m_merge_step = m_codec.settings().step;
    if (m_corrected_merge) m_in_estimate.assign(m_topology.sources().size() * m_elements, 0.0f);
    m_in_primed.assign(m_topology.sources().size(), 0);
    m_in_resync.assign(m_topology.sources().size(), 0);
    m_in_resync_weight.assign(m_topology.sources().size(), 0.0);
    m_segment_bytes.assign(m_slots.size(), 0);
    m_received_bytes.assign(m_received.size(), 0);
  }
  m_trace.reserve(m_settings.trace_path.empty() ? 0 : m_settings.trace_capacity);
  m_inbox = inbox(m_topology.sources(), 2, m_message_bytes);
  if (model.device()) attach_device(*model.device(), detail::takes_device_memory(caps));

  const std::vector<int>& targets = m_topology.destinations();

  m_stats.rank = rank;
  m_stats.world = world;
  m_stats.policy = m_policy.name();
  m_stats.topology = m_topology.name();
  m_stats.protocol = m_protocol.name();
  m_stats.transport = caps.name;
  const bool qgm = !m_mhat.empty() || m_device_qgm;
  m_stats.momentum = qgm ? "quasi-global" : "local";
  m_stats.momentum_merge = !qgm ? "" : m_merge_full ? "full" : "spread";
  m_stats.codec = m_codec.name();
  if (model.device()) m_stats.device = std::string(model.device()->name());
  m_peer_index.assign(static_cast<std::size_t>(world), -1);
  std::vector<int> neighbours = m_topology.sources();
  neighbours.insert(neighbours.end(), targets.begin(), targets.end());
  std::sort(neighbours.begin(), neighbours.end());
  neighbours.erase(std::unique(neighbours.begin(), neighbours.end()), neighbours.end());
  for (int j : neighbours) {
    m_peer_index[static_cast<std::size_t>(j)] = static_cast<int>(m_stats.peers.size());
    m_stats.peers.push_back(peer_stats{.rank = j});
  }
  for (const auto& n : m_tensor_names) m_stats.tensors.push_back(tensor_stats{.name = n});
  m_stats.dead_peers.reserve(static_cast<std::size_t>(world));
  m_stats.sends_per_window.reserve(send_window_capacity);
  m_stats.dead.reserve(static_cast<std::size_t>(world));

  transport_setup setup;
  setup.rank = rank;
  setup.world = world;
  setup.layout = layout;
  setup.layout_fingerprint = m_layout_fingerprint;
  // The codec this rank's streams use: `auto` resolves from settings of the
  // rank's own (max_lead, where the model lives), and peers must agree on the
  // result, whatever their configs' texts say.
  const std::string codec_line = fmt::format("codec.in_use=\"{}{}\"\n", to_string(m_codec.settings().kind),
                                             configured_codec.automatic() ? " (from auto)" : "");
  setup.config_fingerprint = m_config_fingerprint ^ (settings_fingerprint(codec_line) * 0x9e3779b97f4a7c15ull);
  setup.config_settings = m_config_settings + codec_line;
  setup.model_fingerprint = m_model_fingerprint;
  setup.sources = m_topology.sources();
  setup.targets = targets;
  setup.message_bytes = m_message_bytes;
  setup.inbox = &m_inbox;
  setup.timeout = m_settings.timeout;
  // max_lead paces by the steps heard from sources: peers tell theirs at least
  // twice per max_lead steps, also while the policy sends no model.
  if (m_settings.max_lead > 0) setup.step_beacon = std::max<std::uint64_t>(1, m_settings.max_lead / 2);
  m_transport.attach(setup);
  if (m_model_fingerprint) start_shared_streams();
  m_start = m_last_send_time = std::chrono::steady_clock::now();
  m_start_unix_us = std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// What the engine is about to allocate for a host model, with the model
// itself, is checked against the machine's memory: past it the kernel would
// kill the process at some later step, without a word. (The transport's
// own buffers come on top: what is counted is a floor of what the run needs.)
inline void engine::check_memory(int send_buffers, bool qgm) const {
  const std::uint64_t physical = detail::physical_memory_bytes();
  if (physical == 0) return;
  const double model = static_cast<double>(m_elements) * sizeof(float);
  const double sources = static_cast<double>(m_topology.sources().size()), dests = static_cast<double>(m_topology.destinations().size());
  double held = static_cast<double>(send_buffers) * static_cast<double>(m_stream_slots) * static_cast<double>(m_message_bytes);
  held += sources * 2 * static_cast<double>(m_message_bytes);  // the inbox: two slots per source
  if (m_policy.wants_step_change() || qgm || m_settings.numerator_steps) held += model;  // x_{t−1}
  if (qgm) held += model;                                                                 // m̂
  if (m_codec.compresses()) held += model * (1 + dests + sources * (m_corrected_merge ? 2 : 1));  // x̂ of each stream
  if (model + held <= static_cast<double>(physical)) return;
  constexpr double gib = 1024.0 * 1024.0 * 1024.0;
  throw config_error(fmt::format("engine (rank {}): the model's {} values take {:.1f} GiB, and the engine would hold {:.1f} GiB more for them "
                                 "(send buffers, receive slots for {} source(s){}): more than this machine's {:.1f} GiB of memory, so "
                                 "the process would be killed at some later step; use a smaller model, a topology with fewer "
                                 "sources, or fewer [engine] send_buffers",
                                 m_rank, m_elements, model / gib, held / gib, m_topology.sources().size(),
                                 m_codec.compresses() ? ", the codec's copies of each stream" : "", static_cast<double>(physical) / gib));
}

// Streams to and from peers that started from this rank's model (equal
// fingerprints, exchanged by the transport at attach) start x̂ at that model
// on both ends, so their first message is a compressed change like any
// other. Both ends decide from the same two fingerprints. x̂ of the others
// starts from nothing, and their first message carries the model.
inline void engine::start_shared_streams() {
  const float* x0 = m_codec_snapshot.data();  // the model when built: what the fingerprint covers
  auto shared = [&](int peer) {
    if (m_transport.peer_model(peer) != m_model_fingerprint) return false;
    if (const int k = m_peer_index[static_cast<std::size_t>(peer)]; k >= 0) m_stats.peers[static_cast<std::size_t>(k)].shared_start = true;
    return true;
  };
  const auto& dests = m_topology.destinations();
  for (std::size_t k = 0; k < dests.size(); ++k)
    if (shared(dests[k])) {
      std::memcpy(m_out_hat.data() + k * m_elements, x0, m_elements * sizeof(float));
      m_out_primed[k] = 1;
    }
  const auto& sources = m_topology.sources();
  for (std::size_t k = 0; k < sources.size(); ++k)
    if (shared(sources[k])) {
      std::memcpy(m_in_hat.data() + k * m_elements, x0, m_elements * sizeof(float));
      m_in_primed[k] = 1;
    }
}

inline engine::~engine() {
  if (!m_transport) return;
  // Without finish() this rank stops mid-run (an error unwound past it):
  // its peers are told it failed, where the transport can say so.
  if (m_finished)
    m_transport.leave();
  else
    m_transport.abandon();
}

// A peer the transport found dead leaves the topology (so peers() never
// names it, and a round whose targets all died falls back to a live
// destination) and the protocol. Push-sum mass: shares the transport failed
// to deliver to it are taken back (exact: as if they had never been sent);
// shares it received but may not have merged, and its own weight, are lost
// and recorded as estimates. Survivors do not rescale their weights: z =
// x/w is what the model holds and is unchanged by the loss; each survivor's
// model stays a convex combination of models, and the network estimate
// Σ w·z / Σ w over survivors stays an average. Rescaling w on each rank on its
// own, at different times, would change the relative weights of the survivors
// and bias that average. Allocation-free: the lists are reserved for world entries.
inline void engine::handle_failures() {
  // m_received doubles as the scratch list of newly dead ranks.
  const std::size_t n = m_transport.dead_peers(m_received);
  for (std::size_t i = 0; i < n; ++i) {
    const int r = m_received[i].sender;
    if (r < 0 || r >= m_world) continue;
    if (!m_topology.alive(r)) {
      if (m_received[i].settled) settle_dead(r, m_received[i].weight);
      continue;
    }
    m_topology.mark_dead(r);
    m_protocol.forget(r);
    if (const int si = m_inbox.index_of(r); si >= 0 && static_cast<std::size_t>(si) < m_in_resync.size()) settle_resync(static_cast<std::size_t>(si));
    if (m_received[i].departed) {  // it finished and left: nothing is lost, only undelivered shares come back
      if (m_protocol.type() == protocol::kind::push_sum && m_received[i].weight > 0) m_protocol.refund(m_received[i].weight);
      continue;
    }
    dead_peer d{.rank = r, .step = m_step, .seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - m_start).count()};
    const double refund = m_received[i].weight;
    if (m_protocol.type() == protocol::kind::push_sum && refund > 0 && std::isfinite(refund)) {
      m_protocol.refund(refund);
      d.weight_refunded = refund;
    }
    if (const int k = m_peer_index[static_cast<std::size_t>(r)]; k >= 0) {
      auto& p = m_stats.peers[static_cast<std::size_t>(k)];
      p.dead = true;
      const bool sends_here = std::find(m_topology.sources().begin(), m_topology.sources().end(), r) != m_topology.sources().end();
      const double delivered = std::max(0.0, p.weight_unconfirmed - d.weight_refunded);
      // A peer that never sends here: only the last share can be assumed
      // unmerged, unless that one failed (the failures are the latest sends).
      d.weight_unconfirmed = sends_here ? delivered : std::min(delivered, std::max(0.0, p.last_weight_sent - d.weight_refunded));
      d.weight_estimate = p.last_weight_received;
    }
    if (m_received[i].settled) d.weight_unconfirmed = 0;  // its record says what it merged; the rest came back
    m_stats.lost_weight += d.weight_unconfirmed;
    m_stats.dead_peers.push_back(r);
    m_stats.dead.push_back(d);
  }
}

// A later entry for a rank reported dead already: the transport has read
// the rank's own record of what it took from this one, so the shares handed
// back at the report are corrected by `share` (positive: a message that
// completed here but never reached the peer's model; negative: one that
// failed here but had landed there) and nothing sent to it is unconfirmed.
inline void engine::settle_dead(int r, double share) {
  // A correction this rank cannot take (not finite, or more than its whole
  // weight) leaves the record as it was, an estimate.
  if (m_protocol.type() != protocol::kind::push_sum || !std::isfinite(share) || m_protocol.weight() + share <= 0) return;
  m_protocol.refund(share);
  for (auto d = m_stats.dead.rbegin(); d != m_stats.dead.rend(); ++d)
    if (d->rank == r) {
      d->weight_refunded += share;
      m_stats.lost_weight = std::max(0.0, m_stats.lost_weight - d->weight_unconfirmed);
      d->weight_unconfirmed = 0;
      break;
    }
}

// Names the first tensor whose drift sums are not finite: its values (x) or
// the copy it is measured from (x̂, which a merge wrote) hold NaN or ±inf,
// or values so large (beyond about 1e19) that their squares overflow.
inline void engine::throw_not_finite(std::uint64_t step) const {
  std::string which = "the model";
  for (std::size_t i = 0; i < m_tensor_drift.size() && i < m_tensor_names.size(); ++i)
    if (!std::isfinite(m_tensor_drift[i].diff_sq + m_tensor_drift[i].ref_sq)) {
      which = fmt::format("tensor \"{}\"", m_tensor_names[i]);
      break;
    }
  throw error(fmt::format("engine (rank {}): at step {}, {} holds NaN or infinite values (or values beyond about 1e19); sent on, "
                          "they would spoil every peer's model, so the engine stops before it sends (what peers sent was merged "
                          "first, in the same pass: a model restored from before this step loses that share of the push-sum "
                          "mass); lower the learning rate, clip the gradients, or skip the optimizer step when the loss is not finite",
                          m_rank, step, which));
}

// After a step found the model not finite, the caller restored the model
// (and the optimizer's momentum) from before it, as the error says: the
// engine's own x_{t−1} and quasi-global m̂, written by that step's pass from
// the bad values, start again from what was restored, as when the engine was
// built (a device model's backend keeps its own and reseeds them itself).
inline void engine::reseed_after_not_finite() {
  m_reseed = false;
  if (m_device) {
    m_device->reseed();
    return;
  }
  if (!m_prev.empty())
    for (const auto& s : m_slots) std::memcpy(m_prev.data() + s.offset, s.data, s.count * sizeof(float));
  if (!m_mhat.empty())
    for (std::size_t i = 0; i < m_slots.size(); ++i)
      if (m_momentum[i]) std::memcpy(m_mhat.data() + m_slots[i].offset, m_momentum[i], m_slots[i].count * sizeof(float));
}

// Sources that send faster than this rank merges (an inbox slot frees only
// when the engine merges, and the transport's thread lands the next message
// only after that) fill the transport's backlog: past its end messages are
// dropped, a codec's stream with them. Steps are what paces the senders
// (max_lead), so a rank that steps on without merging lets them run ahead:
// once some source has more than backlog_high messages waiting, merge until
// none has more than backlog_low, bounded by timeout_s.
inline void engine::catch_up(std::uint64_t step, std::size_t& merged) {
  const auto start = std::chrono::steady_clock::now();
  ++m_stats.backlog_waits;
  try {
    detail::wait_for(
        [&] {
          merged += merge_inbound(step);
          return m_transport.backlog() <= backlog_low;
        },
        m_settings.timeout, [&] { return fmt::format("rank {} to merge the messages waiting in its receive backlog", m_rank); });
  } catch (const timeout_error&) {
    // Still behind after timeout_s: train on; what overflows is counted (transport_dropped).
  }
  m_stats.backlog_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline step_result engine::step(const step_info& info) {
  if (m_finished) [[unlikely]]
    throw error(fmt::format("engine (rank {}): step() after finish(); this rank has left its peers (train on with new engines on a new transport: over loopback a new loopback_fabric)", m_rank));
  if (!m_send_failed.empty()) [[unlikely]]
    throw error(fmt::format("engine (rank {}): {} (the error it threw said why); its peers cannot be sent to in step any more: destroy the "
                            "engine (its peers then count this rank as failed) and stop, or train on with new engines on a new transport",
                            m_rank, m_send_failed));
  check_guards();
  // Quasi-global momentum rebuilds the optimizer's buffers from the step's
  // displacement divided by lr: without it the buffers would silently stay local.
  if ((!m_mhat.empty() || m_device_qgm) && !(std::isfinite(info.lr) && info.lr > 0)) [[unlikely]]
    throw error(fmt::format("engine (rank {}): step with lr = {}, but the engine keeps quasi-global momentum, which needs the learning "
                            "rate the optimizer used at this step (> 0): pass step({{.lr = …}}), or set [engine] momentum = \"local\"",
                            m_rank, info.lr));
  // lr 0 means "not given"; a negative or non-finite one is a caller's bug that
  // would silently change what the policies decide (a NaN threshold never fires).
  if (!(info.lr >= 0) || !std::isfinite(info.lr)) [[unlikely]]
    throw error(fmt::format("engine (rank {}): step {} with lr = {}; pass the learning rate the optimizer used at this step "
                            "(finite, >= 0; 0 or leaving it out: not known)", m_rank, m_step, info.lr));
  return run_step(info, false);
}

// A send of a training step counts in the per-send means and windows; a
// round of finish() only in its own count (and its bytes with the rest).
inline void engine::count_send(bool forced, double relative_drift, double lr, std::uint64_t t) noexcept {
  if (forced) return;
  ++m_stats.sends;
  m_stats.count_drift_at_send(relative_drift);
  m_stats.lr_at_send_sum += lr;
  m_stats.count_send_window(t);
}

// A post that threw (a target that made no room within timeout_s, a message
// the emulated link cannot carry) leaves a send half done: the shares of the
// targets not posted come back, and the engine takes no more steps.
inline void engine::send_failed(std::span<const peer> targets, std::size_t at, double share, std::uint64_t t) noexcept {
  if (m_protocol.type() == protocol::kind::push_sum)
    for (std::size_t i = at; i < targets.size(); ++i) m_protocol.refund(share);
  try {
    m_send_failed = fmt::format("its send of step {} to rank {} failed", t, at < targets.size() ? targets[at].rank : -1);
  } catch (...) {
    m_send_failed = "a send failed";
  }
}

inline step_result engine::run_step(const step_info& info, bool forced) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const std::uint64_t t = m_step;
  step_result result;
  m_in_step = true;
  struct leave_step {
    bool& in;
    ~leave_step() { in = false; }
  } leave{m_in_step};
  if (m_reseed) [[unlikely]]
    reseed_after_not_finite();
  if (m_settings.numerator_steps) {
    // The optimizer step since the last one ran at the weight the rank has
    // now; z − x_{t−1} is that step unless a poll() merged in between. Below
    // w = ½ it counts at 2w: z steps at most twice the optimizer's step.
    const double w = m_protocol.weight();
    m_step_makeup = m_prev_fresh && w > 0 ? static_cast<float>(std::min(1.0 / w - 1.0, 1.0)) : 0.0f;
    m_step_scale = 1.0 + m_step_makeup;
    m_prev_fresh = true;  // this step's drift pass writes x_{t−1} again
  }

  handle_failures();

  // 1. merge what arrived since the last step (same_step_merge: merged at the
  // end of the last step already; at step 0 nothing has arrived)
  if (!m_settings.same_step_merge) result.merged = merge_inbound(t);
  if (m_transport.backlog() > backlog_high) [[unlikely]]
    catch_up(t, result.merged);
  // Lockstep transports (loopback) keep the ranks within a step already; an
  // aggregator's replies carry no member's step.
  // finish()'s forced rounds have their own drain handshake.
  // A source that finished or died counts as the largest step (UCX), so it
  // holds no one back; after a wait that timed out, pacing resumes only once
  // something new is heard.
  const bool paced = !forced && m_settings.max_lead > 0 && m_world > 1 && !m_copies_on_post && !m_protocol.aggregated();
  const std::uint64_t lead = m_settings.max_lead;
  // With step beacons the transport knows how far each source has come and
  // paces by the slowest live one: a rank stays within max_lead steps of every
  // source, so no rank falls behind the others for long (a stalled rank's
  // stale model would pull theirs back). Otherwise only models say where a
  // source is, and the newest one heard from any source paces.
  auto heard = [&] { return m_beacon_pacing ? m_transport.counters().source_step_heard : m_heard_step; };
  auto ahead = [&](std::uint64_t h) { return h < t && t - h > lead; };
  if (const std::uint64_t h = paced && (m_beacon_pacing || ahead(m_heard_step)) ? heard() : t; ahead(h) && h != m_lead_released_at) {
    ++m_stats.lead_waits;
    const auto wait_start = clock::now();
    m_transport.waiting();  // a step beacon held back goes out: ranks waiting on each other hear it
    auto told_waiting = wait_start;
    try {
      detail::wait_for(
          [&] {
            result.merged += poll();
            if (!ahead(heard())) return true;
            // Still waiting: say so again each millisecond (the UCX transport
            // asks its sources for their step; they may have had none newer).
            if (const auto now = clock::now(); now - told_waiting > std::chrono::milliseconds(1)) {
              told_waiting = now;
              m_transport.waiting();
            }
            return false;
          },
          m_settings.timeout, [&] {
            return fmt::format(
                "rank {} at step {}: word of a step at or after {} from {} ([engine] max_lead = {}; {}, is {}; waiting on {})", m_rank, t,
                t - lead, m_beacon_pacing ? "every source" : "a source", lead,
                m_beacon_pacing ? "the step heard from the slowest source, in a model or a step beacon" : "the newest step heard in a model",
                heard(), m_transport.waiting_on());
          });
    } catch (const timeout_error& e) {
      // Sources that stall (a lossy network, a stopped process) do not stop
      // training: it goes on unpaced until a source is heard again.
      m_lead_released_at = heard();
      if (m_stats.lead_timeouts++ == 0)
        fmt::print(stderr,
                   "libgossip: {}; training goes on without the bound until a source is heard again (raise timeout_s to wait longer; over "
                   "a transport without step beacons every rank must send at least every max_lead steps)\n",
                   e.what());
    }
    m_stats.lead_wait_seconds += std::chrono::duration<double>(clock::now() - wait_start).count();
  }
  const auto t1 = clock::now();

  // 2. measure drift: one fused pass over x and x̂ (and x_{t−1} when asked)
  double diff = 0, ref = 0, step_sq = 0;
  float* prev = m_prev.empty() ? nullptr : m_prev.data();
  if (m_device) {
    // One fused kernel over all tensors, with the quasi-global momentum update
    // of the host pass below when buffers were registered.
    momentum_step q;
    const bool qgm = m_device_qgm && std::isfinite(info.lr) && info.lr > 0;
    if (qgm) q = {static_cast<float>(1.0 / info.lr), m_merge_steps > 0 && !m_merge_full ? qgm_merge_share(m_settings.momentum_beta, m_merge_steps) : 1.0f};
    m_merge_steps = 0;
    m_device->drift(m_tensor_drift, step_sq, qgm ? &q : nullptr);
    for (const auto& d : m_tensor_drift) {
      diff += d.diff_sq;
      ref += d.ref_sq;
    }
  } else {
    // Quasi-global momentum needs the step's learning rate: d = (x_{t−1} − x_t)/lr.
    const bool qgm = !m_mhat.empty() && std::isfinite(info.lr) && info.lr > 0;
    // A merge since the last pass corrects the separation of the τ steps
    // since the merge before it (qgm_args::merge_share).
    const float merge_share = m_merge_steps > 0 && !m_merge_full ? qgm_merge_share(m_settings.momentum_beta, m_merge_steps) : 1.0f;
    m_merge_steps = 0;
    // The policy's reference: x at the last send, or (codec::drift_from_held:
    // topk and randomk by default) the x̂ the freshest target holds, so that
    // what the codec has not delivered yet counts as drift (README, "Codecs").
    const float* ref_base = m_drift_from_held && m_fresh_stream >= 0
                                ? m_out_hat.data() + static_cast<std::size_t>(m_fresh_stream) * m_elements
                                : m_snapshot;
    // The share the last send left in flight, made up in this pass when
    // nothing was merged since (a merge makes it up itself).
    float makeup = take_makeup();
    if (makeup != 0 && ref_base != m_snapshot && !m_settings.numerator_steps) {
      for (const auto& s : m_slots) make_up(s.data, m_snapshot + s.offset, s.count, makeup);
      makeup = 0;
    }
    for (std::size_t i = 0; i < m_slots.size(); ++i) {
      const auto& s = m_slots[i];
      float* p = prev ? prev + s.offset : nullptr;
      const float* r = ref_base + s.offset;
      const bool with_q = qgm && m_momentum[i];
      // numerator_steps: the step moved z as a learning rate (1 + c) times
      // the optimizer's would have; momentum divides by that one, else it
      // would carry the factor into the next step, which is scaled again.
      // This divides the merges' part too. Counting that part whole instead
      // (d = (1 − share·(1 + c))·v − share·e/lr) was no better on the MLP
      // over loopback, seeds 1–3: 77.41 % against 77.09 % by label (8
      // workers), 83.41 % against 84.00 % iid (4 workers).
      const qgm_args q = with_q ? qgm_args{m_mhat.data() + s.offset, m_momentum[i],
                                           static_cast<float>(1.0 / (info.lr * (m_settings.numerator_steps ? m_step_scale : 1.0))),
                                           m_settings.momentum_beta, merge_share}
                                : qgm_args{};
      const drift_sums d = makeup != 0 ? (m_settings.numerator_steps ? drift_pass_stepped(s.data, r, p, s.count, makeup, with_q ? &q : nullptr)
                                                            : drift_pass_made_up(s.data, r, p, s.count, makeup, with_q ? &q : nullptr))
                           : with_q    ? drift_pass(s.data, r, p, s.count, q)
                                       : drift_pass(s.data, r, p, s.count);
      m_tensor_drift[i] = {d.diff_sq, d.ref_sq};
      diff += d.diff_sq;
      ref += d.ref_sq;
      step_sq += d.step_sq;
    }
  }
  // A model that is no longer finite would reach every peer with the next
  // exchange and spoil theirs: stop here, where the sums already say so.
  if (!std::isfinite(diff + ref)) [[unlikely]] {
    m_reseed = true;  // the pass wrote x_{t−1} and m̂ from the bad values
    throw_not_finite(t);
  }

  // 3. decide
  signal sig;
  sig.step = t;
  sig.round = m_round;
  sig.diff_sq = diff;
  sig.ref_sq = ref;
  sig.step_sq = (prev || m_device_step) && t > 0 ? step_sq : std::numeric_limits<double>::quiet_NaN();
  sig.tensors = m_tensor_drift;
  sig.lr = info.lr;
  sig.loss = info.loss;
  sig.steps_since_send = static_cast<std::uint64_t>(static_cast<std::int64_t>(t) - m_last_send_step);
  sig.seconds_since_send = std::chrono::duration<double>(t0 - m_last_send_time).count();
  sig.bytes_sent = m_stats.bytes_sent;
  sig.consensus = m_consensus;
  sig.weight = m_protocol.weight();
  sig.rank = m_rank;
  sig.world = m_world;
  sig.shared_schedule = m_shared_schedule;
  sig.group_drift_sq = m_group_drift_sq;
  // The round counts this rank's sends, not its steps: a time-varying topology
  // then cycles through its peers whatever the sending pattern (with the step
  // index, a period that is a multiple of the cycle would always pick the
  // same peer).
  auto targets = m_topology.peers(m_round);
  // Through an aggregator one post reaches the whole group (bytes counted once,
  // under the first member).
  if (m_protocol.aggregated() && targets.size() > 1) targets = targets.first(1);
  const std::uint64_t wire_bytes = sizeof(wire_header) + m_elements * sizeof(float);
  sig.bytes_per_send = (m_codec.compresses() && m_last_message_bytes ? m_last_message_bytes : wire_bytes) * targets.size();
  decision d = forced ? decision::fire(reason::finish) : m_policy.decide(sig);
  result.why = d.why;
  result.relative_drift = sig.relative_drift();

  // 4. send: the copy into the send buffer becomes the new x̂
  std::uint64_t bytes = 0, bytes_raw = 0;
  std::uint32_t sent_to = 0;
  const double weight_before_send = m_protocol.weight();
  send_outcome came_of_it = send_outcome::not_fired;
  if (d.send) {
    const int next = m_copies_on_post ? m_current : (m_current + 1) % m_settings.send_buffers;
    if (targets.empty()) {
      ++m_stats.no_live_peer;
      came_of_it = send_outcome::no_live_peer;
    } else if (!m_copies_on_post && buffer_busy(next) && !await_buffer(next)) {
      ++m_stats.send_busy;
      came_of_it = send_outcome::send_busy;
    } else if (m_codec.compresses()) {
      // x̂ of the policy: x at this send, uncompressed.
      for (const auto& s : m_slots) std::memcpy(m_codec_snapshot.data() + s.offset, s.data, s.count * sizeof(float));
      m_current = next;
      sent_to = send_encoded(buffer(next), targets, t, bytes, bytes_raw);
      m_last_send_step = static_cast<std::int64_t>(t);
      ++m_round;
      m_last_send_time = t0;
      if (sent_to > 0) {
        count_send(forced, result.relative_drift, info.lr, t);
        result.sent = true;
      }
    } else {
      std::byte* buf = buffer(next);
      auto* payload = reinterpret_cast<float*>(buf + sizeof(wire_header));
      if (m_protocol.sends_delta()) {
        // One pass: the payload gets x − x̂ and x̂ becomes x.
        for (const auto& s : m_slots) {
          float* hat = m_snapshot + s.offset;
          float* out = payload + s.offset;
          for (std::size_t i = 0; i < s.count; ++i) {
            const float v = s.data[i];
            out[i] = v - hat[i];
            hat[i] = v;
          }
        }
      } else {
        if (m_device)
          m_device->snapshot(buf + sizeof(wire_header));  // x̂ ← x and the payload ← x, staged through pinned memory
        else
          for (const auto& s : m_slots) std::memcpy(payload + s.offset, s.data, s.count * sizeof(float));
        m_snapshot = payload;
      }
      m_current = next;
      wire_header h;
      h.flags = forced ? wire_header::finish_round : 0;
      h.sender = m_rank;
      h.step = t;
      h.weight = m_protocol.on_send(targets, m_topology.self_weight());
      // A sync all-reduce averages this over the group: the shared pace (signal::group_drift_sq).
      if (m_shared_schedule) h.weight = std::isfinite(result.relative_drift) ? result.relative_drift * result.relative_drift : 0.0;
      h.payload_bytes = m_elements * sizeof(float);
      h.layout_fingerprint = m_layout_fingerprint;
      if (m_device)
        m_device->write(buf, &h, sizeof h);  // device memory when the transport takes it directly
      else
        std::memcpy(buf, &h, sizeof h);
      const std::span<const std::byte> msg(buf, sizeof(wire_header) + h.payload_bytes);
      const auto count_tensor_bytes = [&](std::uint32_t copies) {
        for (std::size_t i = 0; i < m_slots.size(); ++i) {
          m_stats.tensors[i].bytes_sent += m_slots[i].count * sizeof(float) * copies;
          m_stats.tensors[i].bytes_raw += m_slots[i].count * sizeof(float) * copies;
        }
      };
      std::size_t posting = 0;
      try {
        for (const auto& p : targets) {
          auto& ps = m_stats.peers[static_cast<std::size_t>(m_peer_index[static_cast<std::size_t>(p.rank)])];
          if (m_transport.post(p.rank, msg, t) == post_status::ok) {
            bytes += msg.size();
            ++sent_to;
            ps.bytes_sent += msg.size();
            ps.bytes_raw += msg.size();
            ++ps.messages_sent;
            if (m_protocol.type() == protocol::kind::push_sum) {
              ps.weight_sent += h.weight;
              ps.weight_unconfirmed += h.weight;
              ps.last_weight_sent = h.weight;
            }
          } else {
            m_protocol.refund(h.weight);  // the share never left: keep push-sum mass
            ++ps.dropped;
            ++m_stats.dropped;
          }
          ++posting;
        }
      } catch (...) {
        // What the earlier posts delivered counts in the totals and tensors[]
        // as in peers[] (the record stage below, which adds them, is skipped).
        m_stats.bytes_sent += bytes;
        m_stats.bytes_raw += bytes;
        m_stats.messages_sent += sent_to;
        count_tensor_bytes(sent_to);
        send_failed(targets, posting, h.weight, t);
        throw;
      }
      m_last_send_step = static_cast<std::int64_t>(t);
      ++m_round;
      m_last_send_time = t0;
      if (sent_to > 0) {
        count_tensor_bytes(sent_to);
        bytes_raw = bytes;
        count_send(forced, result.relative_drift, info.lr, t);
        result.sent = true;
      }
    }
  }
  if (m_settings.in_flight_makeup && !m_settings.same_step_merge)  // (push-sum host models: others refused it)
    m_makeup = std::max(0.0, weight_before_send - m_protocol.weight());
  m_transport.end_step(t);
  const auto t2 = clock::now();
  // same_step_merge: this step's messages now, so that the shares sent are
  // back before the next optimizer step (engine_settings::same_step_merge).
  if (m_settings.same_step_merge) {
    handle_failures();
    result.merged += merge_inbound(t + 1);
    m_stats.wait_seconds += std::chrono::duration<double>(clock::now() - t2).count();
  }

  // 5. record
  if (!result.sent && !forced) ++m_stats.skips;
  ++m_stats.by_reason[static_cast<std::size_t>(d.why)];
  m_stats.bytes_sent += bytes;
  m_stats.bytes_raw += bytes_raw;
  m_stats.messages_sent += sent_to;
  m_stats.relative_drift_last = result.relative_drift;
  if (std::isfinite(result.relative_drift)) m_stats.relative_drift_max = std::max(m_stats.relative_drift_max, result.relative_drift);
  for (std::size_t i = 0; i < m_slots.size(); ++i) {
    auto& ts = m_stats.tensors[i];
    ts.last_diff_sq = m_tensor_drift[i].diff_sq;
    if (m_tensor_drift[i].ref_sq > 0) ts.max_relative = std::max(ts.max_relative, std::sqrt(m_tensor_drift[i].diff_sq / m_tensor_drift[i].ref_sq));
  }
  const double w = m_protocol.weight();
  m_stats.weight_min = std::min(m_stats.weight_min, w);
  m_stats.weight_max = std::max(m_stats.weight_max, w);
  if (!std::isnan(m_consensus)) {
    m_stats.consensus_last = m_consensus;
    m_stats.consensus_sum += m_consensus;
    ++m_stats.consensus_steps;
  }
  m_policy.observe(outcome{t, result.sent, bytes, m_stats.bytes_sent, sig.bytes_per_send});
  // Sends always; of the skips, the first and every trace_skips_every-th after it.
  const bool trace_skip = !result.sent && m_skips_seen++ % static_cast<std::uint64_t>(m_settings.trace_skips_every) == 0;
  if (m_trace.capacity() > m_trace.size() && (result.sent || trace_skip)) {
    m_trace.push_back(trace_event{t, std::chrono::duration<double, std::micro>(t1 - m_start).count(),
                                  std::chrono::duration<double, std::micro>(t2 - t1).count(), static_cast<float>(d.value),
                                  static_cast<float>(d.threshold), d.why, result.sent, sent_to, bytes, bytes_raw, static_cast<float>(info.lr),
                                  static_cast<float>(w), static_cast<float>(m_consensus),
                                  result.sent ? send_outcome::sent : came_of_it == send_outcome::not_fired && d.send ? send_outcome::dropped : came_of_it});
  }
  ++(forced ? m_stats.finish_rounds : m_stats.steps);
  m_stats.wait_seconds += std::chrono::duration<double>(t1 - t0).count();
  m_stats.step_seconds += std::chrono::duration<double>(clock::now() - t0).count();
  ++m_step;
  return result;
}

inline float engine::take_makeup() noexcept {
  if (m_settings.numerator_steps) return std::exchange(m_step_makeup, 0.0f);
  if (!(m_makeup > 0)) return 0;
  const double w = m_protocol.weight();
  const auto c = static_cast<float>(w > 0 ? m_makeup / w : 0.0);
  m_makeup = 0;
  return c;
}

inline void engine::merge_received(std::size_t lo, std::size_t hi) {
  const std::size_t n = hi - lo;
  const std::span<const received> msgs(m_received.data() + lo, n);
  if (!m_device) {
    const auto sums = m_protocol.merge(m_slots, msgs, m_snapshot, take_makeup(), makeup_ref());
    if (sums.models > 0 && sums.ref_sq > 0) {
      // E‖x_i − x_j‖² = 2·E‖x_i − x̄‖² for two models drawn around the mean:
      // half the squared distance to what arrived estimates the consensus distance.
      // A lag-corrected merge received z + γ·(estimate − z): its distance is γ times the estimate's.
      const double scale = m_corrected_in_collect == n && m_collect_gamma > 0 ? 1.0 / (m_collect_gamma * m_collect_gamma) : 1.0;
      const double sample = 0.5 * scale * sums.diff_sq / sums.ref_sq;
      m_consensus = std::isnan(m_consensus) ? sample : (1 - consensus_smoothing) * m_consensus + consensus_smoothing * sample;
    }
    return;
  }
  if (n == 0) return;
  // The protocol's sequential merges, written as x ← a·x + Σ b_j·m_j so one
  // kernel pass applies them all; the protocol then advances its own state
  // (the push-sum weight) with no tensors to touch.
  double a = 1;
  double* b = m_merge_coefficients.data();  // sized m_received.size() by attach_device
  if (m_protocol.type() == protocol::kind::push_sum) {
    double w = m_protocol.weight();
    for (std::size_t i = 0; i < n; ++i) {
      b[i] = 0;
      const double total = w + msgs[i].weight;
      if (!(total > 0)) continue;
      const double keep = w / total;
      a *= keep;
      for (std::size_t j = 0; j < i; ++j) b[j] *= keep;
      b[i] = msgs[i].weight / total;
      w = total;
    }
  } else {  // pairwise: z ← (z + Σ m_j) / (1 + M)
    a = 1.0 / static_cast<double>(n + 1);
    for (std::size_t i = 0; i < n; ++i) b[i] = a;
  }
  m_device->merge(a, {b, n}, msgs);
  m_protocol.merge({}, msgs, m_snapshot);
}

inline void engine::attach_device(const device_backend& backend, bool transport_takes_device_memory) {
  const auto kind = m_protocol.type();
  if ((kind != protocol::kind::push_sum && kind != protocol::kind::pairwise) || m_protocol.sends_delta())
    throw config_error(fmt::format("engine (rank {}): protocol '{}' is not available for a model in device memory; use push-sum or "
                                   "pairwise, or keep the model in host memory",
                                   m_rank, m_protocol.name()));
  device_setup s;
  s.rank = m_rank;
  s.tensors = m_slots;
  s.elements = m_elements;
  s.message_bytes = m_message_bytes;
  s.send_buffers = m_settings.send_buffers;
  m_device_qgm = std::any_of(m_momentum.begin(), m_momentum.end(), [](const float* p) { return p != nullptr; });
  s.momentum = m_momentum;  // null where a tensor has no buffer, or momentum stays local
  s.momentum_beta = static_cast<float>(m_settings.momentum_beta);
  s.measure_step = m_policy.wants_step_change() || m_device_qgm;
  s.transport_takes_device_memory = transport_takes_device_memory;
  s.max_merge = m_received.size();
  s.names = m_tensor_names;
  const auto sources = m_inbox.sources().size();
  if (sources > 0)
    s.inbox = {m_inbox.at(0, 0).data, sources * m_inbox.depth() * m_inbox.message_bytes()};  // slots are contiguous
  m_device = backend.make(s);
  m_device_step = s.measure_step;
  m_send_base = m_device->send_storage();
  m_merge_coefficients.assign(m_received.size(), 0.0);
  m_device->snapshot(buffer(0) + sizeof(wire_header));
  m_snapshot = reinterpret_cast<float*>(buffer(0) + sizeof(wire_header));
}

// The policy fired but the next send buffer is still on the wire. By default
// the send is skipped (counted in send_busy): step() never waits on the
// network. With wait_when_busy the step waits for it, merging what arrives
// meanwhile — the behaviour of a synchronous gossip baseline, whose cost then
// shows in the training time instead of in skipped sends.
inline bool engine::await_buffer(int i) {
  if (!m_settings.wait_when_busy) return false;
  const auto t0 = std::chrono::steady_clock::now();
  wait_for_buffer(i);
  m_stats.busy_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return true;
}

// An asynchronous transport may hold our sends until their receivers free
// inbox slots, and the receivers may be waiting on us too: keep merging what
// arrives while waiting, so every rank's sends can complete (and no push-sum
// share is left unmerged in a slot).
inline void engine::wait_for_buffer(int i) {
  detail::wait_for(
      [&] {
        if (!buffer_busy(i)) return true;
        poll();
        return false;
      },
      m_settings.timeout, [&] {
        return fmt::format("rank {}'s send buffer {} to be released by the transport (waiting on {})", m_rank, i, m_transport.waiting_on());
      });
}

inline std::size_t engine::merge_inbound(std::uint64_t t) {
  const std::size_t n = m_transport.collect(t, m_received);
  merge_collected(n, t);
  m_transport.release(t);
  return n;
}

// Merges m_received[0, n), which the transport delivered at step t.
inline void engine::merge_collected(std::size_t n, std::uint64_t t) {
  if (n > 0) {
    if (m_corrected_merge && makeup_pending()) {
      // A corrected merge's estimate starts from z (decode_inbound): make up first.
      const float c = take_makeup();
      for (const auto& s : m_slots) make_up(s.data, makeup_ref() + s.offset, s.count, c);
    }
    if (m_codec.compresses() && m_protocol.type() == protocol::kind::push_sum) {
      // A message decodes into its sender's x̂, which the merge then reads: a
      // second message of the same sender in this collect would overwrite the
      // x̂ that the first one's push-sum share must carry (the sum of the
      // ranks' weighted models would move by that share times the sender's
      // change between its two sends). Merge in runs with no sender twice.
      // (Pairwise and stale-copy carry no mass: they merge the latest x̂.)
      const auto in_run = [&](std::size_t lo, std::size_t hi, int sender) {
        for (std::size_t j = lo; j < hi; ++j)
          if (m_received[j].sender == sender) return true;
        return false;
      };
      for (std::size_t lo = 0; lo < n;) {
        std::size_t hi = lo + 1;
        while (hi < n && !in_run(lo, hi, m_received[hi].sender)) ++hi;
        const std::size_t kept = decode_inbound(lo, hi);
        if (kept > lo) merge_received(lo, kept);
        if (kept < hi) {  // what was taken out leaves no hole
          std::move(m_received.begin() + static_cast<std::ptrdiff_t>(hi), m_received.begin() + static_cast<std::ptrdiff_t>(n),
                    m_received.begin() + static_cast<std::ptrdiff_t>(kept));
          std::move(m_received_bytes.begin() + static_cast<std::ptrdiff_t>(hi), m_received_bytes.begin() + static_cast<std::ptrdiff_t>(n),
                    m_received_bytes.begin() + static_cast<std::ptrdiff_t>(kept));
          n -= hi - kept;
        }
        lo = kept;
      }
    } else {
      if (m_codec.compresses()) n = decode_inbound(0, n);
      if (n > 0) merge_received(0, n);
    }
  }
  if (n > 0) {
    if (m_shared_schedule && std::isfinite(m_received[n - 1].weight)) m_group_drift_sq = m_received[n - 1].weight;
    if (m_merge_steps == 0) {  // the first merge since the last drift pass
      m_merge_steps = std::max<std::uint64_t>(1, t > m_last_merge_step ? t - m_last_merge_step : 1);
      m_last_merge_step = t;
    }
    // A message's age: the optimizer steps it missed. A step t runs after
    // the optimizer step of index t and merges at age t − (the send's step);
    // between steps (poll) the last step's index is the base.
    const std::uint64_t age_base = m_in_step ? m_step : (m_step > 0 ? m_step - 1 : 0);
    if (!m_in_step) m_prev_fresh = false;  // z − x_{t−1} holds this merge now (numerator_steps)
    for (std::size_t i = 0; i < n; ++i) {
      // An aggregator's reply has no member rank as its sender.
      const int sender = m_received[i].sender;
      if (sender >= 0 && sender < m_world) {
        m_heard_step = std::max(m_heard_step, m_received[i].step);
        ++m_stats.merge_age[static_cast<std::size_t>(std::min<std::uint64_t>(age_base > m_received[i].step ? age_base - m_received[i].step : 0, 4))];
      }
      const int k = sender >= 0 && sender < m_world ? m_peer_index[static_cast<std::size_t>(sender)] : -1;
      if (k < 0) continue;
      auto& p = m_stats.peers[static_cast<std::size_t>(k)];
      p.bytes_received += m_codec.compresses() ? m_received_bytes[i] : sizeof(wire_header) + m_received[i].elements * sizeof(float);
      ++p.messages_received;
      if (m_protocol.type() == protocol::kind::push_sum) {
        p.weight_unconfirmed = 0;  // it was alive after our earlier shares reached it
        p.last_weight_received = m_received[i].weight;
      }
    }
  }
}

inline bool engine::buffer_busy(int i) noexcept {
  for (std::size_t k = 0; k < m_stream_slots; ++k)
    if (m_transport.busy(buffer(i) + k * m_message_bytes)) return true;
  return false;
}

inline std::size_t engine::poll() {
  if (m_finished || m_copies_on_post) return 0;  // lockstep transports deliver at step boundaries only
  check_guards();
  handle_failures();
  return merge_inbound(m_step);
}

inline void engine::flush() {
  for (int i = 0; i < m_settings.send_buffers; ++i) wait_for_buffer(i);
  m_transport.flush(m_settings.timeout);
}

// The stats and trace files of finish(): both are tried, whichever fails;
// a finish() called again after a failure tries the ones that failed again.
inline void engine::write_outputs() {
  std::string failed;
  const auto attempt = [&](bool& pending, auto&& write) {
    if (!pending) return;
    try {
      write();
      pending = false;
    } catch (const std::exception& e) {
      failed += failed.empty() ? e.what() : fmt::format("; {}", e.what());
    }
  };
  attempt(m_stats_pending, [&] { write_stats_file(m_settings.stats_path, stats()); });
  attempt(m_trace_pending, [&] { write_chrome_trace(m_settings.trace_path, m_rank, m_trace, m_codec.name(), m_start_unix_us); });
  if (!failed.empty())
    throw error(fmt::format("engine (rank {}): finished, but {} (call finish() again to write it again)", m_rank, failed));
}

inline void engine::finish(int rounds) {
  if (m_finished) {
    if (m_stats_pending || m_trace_pending) write_outputs();
    return;
  }
  if (!m_send_failed.empty())
    throw error(fmt::format("engine (rank {}): finish() after {}: it cannot take part in the final rounds; destroy the engine (its peers "
                            "then count this rank as failed)",
                            m_rank, m_send_failed));
  check_guards();
  if (rounds == -2) rounds = m_settings.finish_rounds;
  if (rounds < 0) {
    int hops = 0;
    while ((1 << hops) < m_world) ++hops;
    rounds = 2 * hops;
  }
  if (!m_finish_merged) {
    for (; m_finish_rounds_done < rounds; ++m_finish_rounds_done) run_step({}, true);
    // One more collect so the last step's messages are merged: a forced round's,
    // or with no rounds the last training step's (a lockstep transport
    // delivers nothing after this, and their push-sum mass would be lost).
    if (m_step > 0) {
      handle_failures();
      if (!m_settings.same_step_merge) merge_inbound(m_step);  // else the last step merged it
      m_transport.end_step(m_step);
    }
    m_finish_merged = true;
  }
  flush();
  // Before leaving, merge everything peers sent us (asynchronous transports
  // publish per-peer counts; lockstep ones are drained already).
  detail::wait_for(
      [&] {
        if (m_transport.drained()) return true;
        poll();
        return false;
      },
      m_settings.timeout, [&] {
        return fmt::format("rank {} to receive every message its peers sent before it leaves (waiting on {})", m_rank,
                           m_transport.waiting_on());
      });
  handle_failures();  // a peer found dead while draining is reported in the stats too
  // What is still in the inbox (sources that went on after this rank's last
  // step) leaves with this rank, where the transport can hand it over.
  while (const std::size_t n = m_transport.leftovers(m_received)) merge_collected(n, m_step);
  for (std::size_t s = 0; s < m_in_resync.size(); ++s) settle_resync(s);  // their full messages will not come now
  m_finished = true;
  m_transport.leave();
  m_stats_pending = !m_settings.stats_path.empty();
  m_trace_pending = !m_settings.trace_path.empty();
  write_outputs();
}

inline const engine_stats& engine::stats() {
  const auto c = m_transport.counters();
  m_stats.weight = m_protocol.weight();
  m_stats.bytes_received = c.bytes_received;
  m_stats.messages_received = c.messages_received;
  m_stats.transport_rejoins = c.rejoins;
  m_stats.transport_dropped = c.dropped;
  m_stats.step_beacons = c.beacons_sent;
  return m_stats;
}

}  // namespace gossip

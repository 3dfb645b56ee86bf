#pragma once
// The engine's compressed streams: one x̂ per outgoing stream and per source,
// messages C(x − x̂) encoded into the send buffer, received ones decoded into
// the sender's x̂ (included by engine-inl.hpp).
#include <algorithm>
#include <utility>
#include <cmath>
#include <cstring>

#include <Eigen/Core>

#include "gossip/engine.hpp"

namespace gossip {

namespace detail {
inline Eigen::Map<const Eigen::ArrayXf> cmap(const float* p, std::size_t n) noexcept { return {p, static_cast<Eigen::Index>(n)}; }
inline Eigen::Map<Eigen::ArrayXf> map(float* p, std::size_t n) noexcept { return {p, static_cast<Eigen::Index>(n)}; }
}  // namespace detail

// One message per target, each C(x − x̂) against the x̂ that target holds
// (a stream's first message is the model in fp32). A post that fails leaves
// the stream's x̂ ahead of the target's, so its next message is full again.
inline std::uint32_t engine::send_encoded(std::byte* buf, std::span<const peer> targets, std::uint64_t t, std::uint64_t& bytes,
                                          std::uint64_t& raw) {
  const double share = m_protocol.on_send(targets, m_topology.self_weight());
  const std::uint64_t raw_message = sizeof(wire_header) + m_elements * sizeof(float);
  std::uint32_t sent_to = 0;
  for (std::size_t k = 0; k < targets.size(); ++k) {
    const int to = targets[k].rank;
    const int si = m_out_index[static_cast<std::size_t>(to)];
    GOSSIP_ASSERT(si >= 0, "engine (rank {}): rank {} is not among the topology's destinations", m_rank, to);
    const auto stream = static_cast<std::size_t>(si);
    std::byte* msg_buf = buf + k * m_message_bytes;
    std::byte* out = msg_buf + sizeof(wire_header);
    float* hat = m_out_hat.data() + stream * m_elements;
    const bool absolute = !m_out_primed[stream];
    float* state = m_out_state.data() + stream * m_state_floats;
    codec_payload ph;
    ph.tensors = static_cast<std::uint32_t>(m_slots.size());
    ph.elements = m_elements;
    std::memcpy(out, &ph, sizeof ph);
    std::size_t at = sizeof ph;
    // Positions (randomk) and samples (topk) differ per stream and send.
    const std::uint64_t seed = (static_cast<std::uint64_t>(m_rank) << 40) ^ (static_cast<std::uint64_t>(to) << 20) ^ (m_round * 0x9e3779b97f4a7c15ull);
    // The automatic merge step: the fraction of ‖x − x̂‖² the codec sends.
    const bool measure = m_corrected_merge && m_merge_step == 0 && !absolute;
    double change = 0, kept = 0;
    for (std::size_t i = 0; i < m_slots.size(); ++i) {
      const auto& s = m_slots[i];
      const double before =
          measure ? (detail::cmap(s.data, s.count) - detail::cmap(hat + s.offset, s.count)).cast<double>().square().sum() : 0.0;
      const std::size_t b = m_codec.encode(s.data, hat + s.offset, s.count, out + at, absolute, seed + i, m_rows[i], state + m_state_offset[i]);
      m_segment_bytes[i] = b;
      at += b;
      change += before;
      kept += m_codec.last_change_energy() >= 0 ? m_codec.last_change_energy() : before;
    }
    if (measure && change > 0 && std::isfinite(change) && std::isfinite(kept)) {
      m_kept_energy = m_kept_measured ? 0.5 * m_kept_energy + 0.5 * std::min(1.0, kept / change) : std::min(1.0, kept / change);
      m_kept_measured = true;
    }
    wire_header h;
    h.sender = m_rank;
    h.step = t;
    h.weight = share;
    h.flags = wire_header::codec_payload;
    h.payload_bytes = at;
    h.layout_fingerprint = m_layout_fingerprint;
    std::memcpy(msg_buf, &h, sizeof h);
    const std::span<const std::byte> msg(msg_buf, sizeof(wire_header) + at);
    m_last_message_bytes = msg.size();
    auto& ps = m_stats.peers[static_cast<std::size_t>(m_peer_index[static_cast<std::size_t>(to)])];
    post_status posted;
    try {
      posted = m_transport.post(to, msg, t);
    } catch (...) {
      m_out_primed[stream] = 0;
      // What the earlier posts delivered counts in the totals as in peers[]
      // and tensors[] (the step's record stage, which adds them, is skipped).
      m_stats.bytes_sent += bytes;
      m_stats.bytes_raw += raw;
      m_stats.messages_sent += sent_to;
      send_failed(targets, k, share, t);
      throw;
    }
    if (posted == post_status::ok) {
      m_out_primed[stream] = 1;
      // x_s (the snapshot of this send) minus this stream's x̂ is now exactly
      // what the codec left unsent, and this x̂ is what the target holds (the
      // held drift reference); an fp32 first message leaves nothing and says
      // nothing about the codec, so it does not count.
      if (!absolute) m_fresh_stream = static_cast<int>(stream);
      bytes += msg.size();
      raw += raw_message;
      ++sent_to;
      ps.bytes_sent += msg.size();
      ps.bytes_raw += raw_message;
      ++ps.messages_sent;
      for (std::size_t i = 0; i < m_slots.size(); ++i) {
        m_stats.tensors[i].bytes_sent += m_segment_bytes[i];
        m_stats.tensors[i].bytes_raw += m_slots[i].count * sizeof(float);
      }
      if (m_protocol.type() == protocol::kind::push_sum) {
        ps.weight_sent += share;
        ps.weight_unconfirmed += share;
        ps.last_weight_sent = share;
      }
    } else {
      m_out_primed[stream] = 0;
      m_protocol.refund(share);  // the share never left: keep push-sum mass
      ++ps.dropped;
      ++m_stats.dropped;
    }
  }
  return sent_to;
}

// Each message updates this rank's x̂ of its sender, which is then merged in
// place of the sender's model. Checked before use: a malformed message is
// refused with the sender named. Under push-sum the range holds no sender
// twice (merge_inbound), so each share is merged with the x̂ its own message
// made; pairwise and stale-copy merge a sender's latest x̂.
inline std::size_t engine::decode_inbound(std::size_t lo, std::size_t hi) {
  m_corrected_in_collect = 0;
  std::size_t kept = lo;
  for (std::size_t i = lo; i < hi; ++i) {
    auto& m = m_received[i];
    const int si = m_inbox.index_of(m.sender);
    if (si < 0)
      throw transport_error(fmt::format("rank {}: received a message from rank {}, which is not among its sources", m_rank, m.sender));
    const auto source = static_cast<std::size_t>(si);
    // The stream lost a message: this x̂ is no longer the sender's. Where the
    // transport can ask the sender for a full message, the stream waits for
    // it; the changes that come first are taken out below.
    if (m.gap && m_transport.request_full(m.sender)) {
      m_in_primed[source] = 0;
      m_in_resync[source] = 1;
    } else if (m.gap)
      throw transport_error(fmt::format(
          "rank {}: the transport dropped a message rank {} sent before step {} and cannot ask it for a full message "
          "(request_full). A codec's stream cannot skip a message (both ends must keep the same x̂); set [codec] name = "
          "\"none\", with which a dropped model costs only freshness and its push-sum share rides with the next one",
          m_rank, m.sender, m.step));
    const std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(m.data), m.elements * sizeof(float));
    m_received_bytes[i] = sizeof(wire_header) + payload.size();
    float* hat = m_in_hat.data() + source * m_elements;
    const bool first = m_in_primed[source] == 0;  // the sender's exact model (fp32) or a dense reset: nothing lags
    const decode_status st = decode_payload(payload, m_counts, hat, !first);
    if (!st.ok() && st.before_full && m_in_resync[source]) {
      // A change against the x̂ the sender holds: its push-sum share waits
      // for the full message (merged with it); this x̂ is rewritten by it.
      // From a sender found dead or gone, no full message will come: the
      // share stays with this rank's model at once.
      if (m_protocol.type() == protocol::kind::push_sum && std::isfinite(m.weight)) {
        if (m_topology.alive(m.sender))
          m_in_resync_weight[source] += m.weight;
        else
          m_protocol.refund(m.weight);
      }
      ++m_stats.codec_resync_skipped;
      m_heard_step = std::max(m_heard_step, m.step);
      if (const int k = m_peer_index[static_cast<std::size_t>(m.sender)]; k >= 0) {
        auto& p = m_stats.peers[static_cast<std::size_t>(k)];
        p.bytes_received += m_received_bytes[i];
        ++p.messages_received;
      }
      continue;
    }
    if (!st.ok())
      throw transport_error(fmt::format("rank {}: refused the message rank {} sent at step {} ({} payload bytes, codec '{}'): {} (tensor '{}'); "
                                        "give every rank the same libgossip and [codec] settings",
                                        m_rank, m.sender, m.step, payload.size(), m_codec.name(), st.problem,
                                        m_tensor_names[std::min(st.tensor, m_tensor_names.size() - 1)]));
    m_in_primed[source] = 1;
    if (m_in_resync[source]) {  // the full message: the stream is in step again
      m.weight += std::exchange(m_in_resync_weight[source], 0.0);
      m_in_resync[source] = 0;
      ++m_stats.codec_resyncs;
    }
    m.data = hat;
    m.elements = m_elements;
    if (m_corrected_merge && m_fresh_stream >= 0 && !first) {
      // The sender's model is its x̂ plus what its codec left unsent, which
      // this rank estimates by what its own codec left at its last send: the
      // snapshot x_s minus the x̂ p its freshest target holds. The merge moves
      // z towards that estimate by a step γ, as CHOCO's consensus step does
      // (Koloskova et al. 2019): m = z + γ·(x̂ + x_s − p − z).
      const float gamma = static_cast<float>(m_merge_step > 0 ? m_merge_step : std::min(1.0, m_kept_energy));
      const float* own = m_out_hat.data() + static_cast<std::size_t>(m_fresh_stream) * m_elements;
      float* est = m_in_estimate.data() + source * m_elements;
      const float* sent = m_codec_snapshot.data();
      for (const auto& s : m_slots) {
        const auto z = detail::cmap(s.data, s.count);
        const auto residual = detail::cmap(sent + s.offset, s.count) - detail::cmap(own + s.offset, s.count);
        detail::map(est + s.offset, s.count) = z + gamma * (detail::cmap(hat + s.offset, s.count) + residual - z);
      }
      m.data = est;
      ++m_corrected_in_collect;
      m_collect_gamma = gamma;
    }
    if (kept != i) {
      m_received[kept] = m;
      m_received_bytes[kept] = m_received_bytes[i];
    }
    ++kept;
  }
  return kept;
}

// A stream that waits for its full message will not get it (its sender
// died or left, or this rank finishes): the shares of the changes taken out
// stay with this rank's model, so the push-sum weight stays exact. It still
// waits: changes of that sender still held here are taken out as before.
inline void engine::settle_resync(std::size_t source) {
  if (m_in_resync[source]) m_protocol.refund(std::exchange(m_in_resync_weight[source], 0.0));
}

}  // namespace gossip

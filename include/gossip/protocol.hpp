#pragma once
/// Protocols decide how a received model changes the local one.
///
///  push-sum   (default) each rank keeps a weight w. A sender splits (x·w, w)
///             among itself and its targets by the topology's weights and
///             ships shares; a receiver adds. The user's tensors hold the
///             de-biased model z = x/w, so a merge is the weighted average
///             z ← (w·z + Σ w_m·z_m) / (w + Σ w_m). Σ w·z and Σ w are conserved
///             under any pattern of skipped sends (SGP, Assran et al. 2019).
///  pairwise   average with each received model (Jin et al. 2016 gossip):
///             z ← (z + Σ z_m) / (1 + M).
///  stale-copy CHOCO-style: keep the latest copy c_j of every source; when a
///             copy arrives, z ← z + γ/(d+1) · Σ_j (c_j − x̂) over the d sources
///             heard from so far, so silent neighbours still count.
///  switch-aggregate  through an aggregation switch (transport "switch"): one
///             post reaches the whole group, and what comes back is the group
///             average m. In sync mode the payload is the model and m the
///             all-reduced mean; in async mode the payload is the delta x − x̂
///             and m is S/n, the mean of every member's last-sent model. Either
///             way z ← z + γ (m − x̂): the average plus the local progress made
///             since the send.
///
///     [protocol]
///     name = "switch-aggregate"
///     mode = "auto"   # periodic and consensus → sync, any other policy → async
///
/// The merge runs only when something arrived: never an extra pass otherwise.
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <Eigen/Core>
#include <fmt/format.h>

#include "gossip/drift.hpp"
#include "gossip/error.hpp"
#include "gossip/options.hpp"
#include "gossip/registry.hpp"
#include "gossip/topology.hpp"
#include "gossip/transport.hpp"

namespace gossip {

/// One tensor of the local model, and where it sits in a message payload.
struct tensor_slot {
  float* data = nullptr;
  std::size_t count = 0;
  std::size_t offset = 0;  ///< in elements, within the payload
};

class protocol {
 public:
  enum class kind { push_sum, pairwise, stale_copy, switch_aggregate };
  /// What a message carries: the model x, or the change x − x̂ since the last send.
  enum class payload { model, delta };

  protocol() = default;
  explicit protocol(kind k, double gamma = 1.0, std::string name = {}, payload p = payload::model)
      : m_kind(k), m_payload(p), m_gamma(gamma), m_name(std::move(name)) {}

  /// The engine's send pass writes x − x̂ (and refreshes x̂) instead of x.
  bool sends_delta() const noexcept { return m_payload == payload::delta; }
  /// One post reaches every member through an aggregator; replies come from it.
  bool aggregated() const noexcept { return m_kind == kind::switch_aggregate; }

  /// Allocates per-source state (stale copies). Called once by the engine.
  void prepare(std::span<const int> sources, std::size_t elements) {
    m_sources.assign(sources.begin(), sources.end());
    if (m_kind == kind::stale_copy) {
      m_copies.assign(sources.size() * elements, 0.0f);
      m_have.assign(sources.size(), 0);
      m_elements = elements;
    }
  }

  /// The weight stamped on every message of one send to `targets`, after which
  /// this rank keeps `self_weight` of its own share (push-sum).
  double on_send(std::span<const peer> targets, double self_weight) noexcept {
    if (targets.empty()) return 0;
    if (m_kind == kind::push_sum) {
      const double share = m_weight * targets[0].weight;
      m_weight *= self_weight;
      return share;
    }
    return targets[0].weight;
  }

  /// A share stamped by on_send() could not be delivered: take it back.
  void refund(double share) noexcept {
    if (m_kind == kind::push_sum) m_weight += share;
  }

  /// What a merge saw: Σ over received models of ‖m − z‖² and ‖z‖² (z before
  /// that model was merged), for push-sum and pairwise; zero for the others.
  struct merge_sums {
    double diff_sq = 0, ref_sq = 0;
    std::size_t models = 0;  ///< received models measured
  };

  /// Merges received messages into x. `snapshot` is x̂ (what peers last got).
  /// makeup (push-sum only): first x ← x + makeup·(x − ref), fused into the
  /// first merge, ref = makeup_ref or else snapshot
  /// (engine_settings::in_flight_makeup, numerator_steps).
  merge_sums merge(std::span<const tensor_slot> x, std::span<const received> msgs, const float* snapshot, float makeup = 0,
                   const float* makeup_ref = nullptr) noexcept {
    if (!makeup_ref) makeup_ref = snapshot;
    using vec = Eigen::Map<Eigen::ArrayXf, Eigen::Unaligned>;
    using cvec = Eigen::Map<const Eigen::ArrayXf, Eigen::Unaligned>;
    merge_sums sums;
    if (msgs.empty()) return sums;
    auto mix = [&](const received& m, float b) {
      for (const auto& t : x) {
        const mix_sums d = makeup != 0 ? mix_pass_made_up(t.data, m.data + t.offset, b, t.count, makeup_ref + t.offset, makeup)
                                       : mix_pass(t.data, m.data + t.offset, b, t.count);
        sums.diff_sq += d.diff_sq;
        sums.ref_sq += d.ref_sq;
      }
      if (!x.empty()) ++sums.models;
    };
    switch (m_kind) {
      case kind::push_sum:
        // z ← (w·z + w_m·m) / (w + w_m) = z + b·(m − z), b = w_m / (w + w_m)
        for (const auto& m : msgs) {
          const double total = m_weight + m.weight;
          if (!(total > 0)) continue;
          mix(m, static_cast<float>(m.weight / total));
          makeup = 0;
          m_weight = total;
        }
        if (makeup != 0)  // no share merged: the make-up alone
          for (const auto& t : x) make_up(t.data, makeup_ref + t.offset, t.count, makeup);
        break;
      case kind::pairwise: {
        float k = 1;
        for (const auto& m : msgs) {
          k += 1;
          mix(m, 1.0f / k);
        }
        break;
      }
      case kind::switch_aggregate: {
        // A later reply supersedes an earlier one: it already includes it.
        const auto& m = msgs.back();
        const auto g = static_cast<float>(m_gamma);
        for (const auto& t : x) {
          const auto n = static_cast<Eigen::Index>(t.count);
          vec z(t.data, n);
          z += g * (cvec(m.data + t.offset, n) - cvec(snapshot + t.offset, n));
        }
        break;
      }
      case kind::stale_copy: {
        for (const auto& m : msgs) {
          const std::size_t i = index_of(m.sender);
          std::memcpy(m_copies.data() + i * m_elements, m.data, m_elements * sizeof(float));
          m_have[i] = 1;
        }
        std::size_t heard = 0;
        for (char h : m_have) heard += h;
        const auto g = static_cast<float>(m_gamma / static_cast<double>(heard + 1));
        for (std::size_t i = 0; i < m_have.size(); ++i) {
          if (!m_have[i]) continue;
          const float* c = m_copies.data() + i * m_elements;
          for (const auto& t : x) {
            const auto n = static_cast<Eigen::Index>(t.count);
            vec z(t.data, n);
            z += g * (cvec(c + t.offset, n) - cvec(snapshot + t.offset, n));
          }
        }
        break;
      }
    }
    return sums;
  }

  /// A peer died: forget its stale copy so it stops pulling the model.
  void forget(int rank) noexcept {
    if (m_kind == kind::stale_copy)
      for (std::size_t i = 0; i < m_sources.size(); ++i)
        if (m_sources[i] == rank) m_have[i] = 0;
  }

  double weight() const noexcept { return m_weight; }
  kind type() const noexcept { return m_kind; }
  const std::string& name() const noexcept { return m_name; }

 private:
  std::size_t index_of(int rank) const noexcept {
    for (std::size_t i = 0; i < m_sources.size(); ++i)
      if (m_sources[i] == rank) return i;
    return 0;
  }
  kind m_kind = kind::push_sum;
  payload m_payload = payload::model;
  double m_gamma = 1.0;
  std::string m_name = "push-sum";
  double m_weight = 1.0;
  std::vector<int> m_sources;
  std::vector<float> m_copies;
  std::vector<char> m_have;
  std::size_t m_elements = 0;
};

/// The switch mode a `switch-aggregate` run uses: `requested` when it is
/// "sync" or "async"; for "auto", sync for the policies whose members send at
/// the same steps, so an all-reduce fits — periodic, and consensus, which
/// paces the group from the all-reduce's own drift figure
/// (signal::shared_schedule) — and async for any other.
///
///     switch_mode("auto", "drift") == "async"
///     switch_mode("auto", "consensus") == "sync"
/// A periodic policy with stagger = true sends at different steps on different
/// members, which no all-reduce round fits: async.
inline std::string switch_mode(std::string_view requested, std::string_view policy, bool staggered = false) {
  if (requested == "sync" || requested == "async") return std::string(requested);
  return (policy == "periodic" && !staggered) || policy == "consensus" ? "sync" : "async";
}

using protocol_registry_t = registry<protocol>;
/// Protocols by config name: push-sum, pairwise, stale-copy, switch-aggregate.
protocol_registry_t& protocol_registry();

}  // namespace gossip

#pragma once
/// A worker's minibatches over its shard of the training set.
#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "gossip/error.hpp"

namespace gossip::examples {

/// A worker's minibatches: its shard reshuffled at each epoch start and taken
/// in order; a shard smaller than an epoch's batches wraps around (reshuffled
/// again), so with unequal shards (dirichlet) every worker takes the same
/// number of steps. Shards at least an epoch long never wrap.
class batch_stream {
 public:
  batch_stream(std::vector<std::uint32_t> shard, std::uint64_t seed) : m_order(std::move(shard)), m_rng(seed) {
    if (m_order.empty()) throw config_error("batch_stream: empty shard");
  }
  void new_epoch() {
    shuffle();
    m_at = 0;
  }
  /// Fills idx with the next batch's sample indices.
  void next(std::span<std::uint32_t> idx) {
    for (auto& i : idx) {
      if (m_at == m_order.size()) new_epoch();
      i = m_order[m_at++];
    }
  }

 private:
  void shuffle() {
    for (std::size_t i = m_order.size(); i > 1; --i) std::swap(m_order[i - 1], m_order[m_rng() % i]);  // Fisher–Yates
  }
  std::vector<std::uint32_t> m_order;
  std::mt19937_64 m_rng;
  std::size_t m_at = 0;
};

}  // namespace gossip::examples

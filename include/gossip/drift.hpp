#pragma once
/// The drift pass: ‖x − x̂‖² and ‖x̂‖² (and optionally ‖x − x_prev‖², updating
/// x_prev) in one pass over memory. The model is walked in L1-sized chunks;
/// both reductions of a chunk run while it is in cache, and chunk sums are
/// accumulated in double so large models keep their precision.
#include <algorithm>
#include <cstddef>

#include <Eigen/Core>

namespace gossip {

struct drift_sums {
  double diff_sq = 0;
  double ref_sq = 0;
  double step_sq = 0;
};

namespace detail {
inline constexpr std::size_t drift_chunk = 2048;  // 8 KiB of each input
}

/// x: current model, ref: x̂. When `prev` is non-null, also measures
/// ‖x − prev‖² and then copies x into prev (fused into the same pass).
inline drift_sums drift_pass(const float* x, const float* ref, float* prev, std::size_t n) noexcept {
  using arr = Eigen::Map<const Eigen::ArrayXf, Eigen::Unaligned>;
  drift_sums s;
  for (std::size_t i = 0; i < n; i += detail::drift_chunk) {
    const auto m = static_cast<Eigen::Index>(std::min(detail::drift_chunk, n - i));
    arr xs(x + i, m), rs(ref + i, m);
    s.diff_sq += static_cast<double>((xs - rs).square().sum());
    s.ref_sq += static_cast<double>(rs.square().sum());
    if (prev) {
      Eigen::Map<Eigen::ArrayXf, Eigen::Unaligned> ps(prev + i, m);
      s.step_sq += static_cast<double>((xs - ps).square().sum());
      ps = xs;
    }
  }
  return s;
}

}  // namespace gossip

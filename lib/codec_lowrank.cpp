// The lowrank codec (PowerSGD, Vogels et al. 2019): the encoder's warm-started
// power-iteration step, the routine both sides rebuild x̂ with, and the
// segment checker.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "codec_detail.hpp"
#include "gossip/codec.hpp"

namespace gossip {

using detail::pad8;

namespace {
// Uniform in [−1, 1).
float uniform_pm1(std::uint64_t& s) noexcept { return static_cast<float>(static_cast<double>(detail::splitmix(s) >> 11) * 0x1p-52 - 1.0); }
}  // namespace

void detail::seed_directions(float* q, std::size_t n, std::uint64_t seed) noexcept {
  std::uint64_t s = seed ^ 0x6a09e667f3bcc909ull;
  for (std::size_t i = 0; i < n; ++i) q[i] = uniform_pm1(s);
}

void lowrank_apply(const float* p, const float* q, std::size_t rows, std::size_t cols, std::size_t r, float* hat) noexcept {
  for (std::size_t i = 0; i < rows; ++i) {
    const float* pi = p + i * r;
    float* hi = hat + i * cols;
    for (std::size_t j = 0; j < cols; ++j) {
      const float* qj = q + j * r;
      float v = 0;
      for (std::size_t k = 0; k < r; ++k) v += pi[k] * qj[k];
      hi[j] += v;
    }
  }
}

// One warm-started power-iteration step on M = x − x̂ (rows × cols):
// P = M·Q, orthonormalized; Q = Mᵀ·P; send P and Q (Q rather than Qᵀ: both
// are read row by row), x̂ += P·Qᵀ, and keep Q to start the next send from.
// The products accumulate in double; what is sent, and applied on both
// sides, is their fp32 rounding.
std::size_t codec::encode_lowrank(const float* x, float* hat, std::size_t rows, std::size_t cols, std::byte* out, std::uint64_t seed,
                                  float* state) noexcept {
  const std::size_t r = m_settings.rank;
  // No directions to warm-start from: the stream's first change when both
  // ends began from the shared model (no full first message seeded them).
  if (std::all_of(state, state + cols * r, [](float v) { return v == 0.0f; })) detail::seed_directions(state, cols * r, seed);
  double* P = m_factors.data();
  double* Q = P + rows * r;
  std::fill(P, P + (rows + cols) * r, 0.0);
  for (std::size_t i = 0; i < rows; ++i) {
    const float *xi = x + i * cols, *hi = hat + i * cols;
    double* pi = P + i * r;
    for (std::size_t j = 0; j < cols; ++j) {
      const double d = static_cast<double>(xi[j] - hi[j]);
      const float* qj = state + j * r;
      for (std::size_t k = 0; k < r; ++k) pi[k] += d * static_cast<double>(qj[k]);
    }
  }
  // Gram–Schmidt, twice over (one pass loses orthogonality on nearly
  // dependent columns); a column that does not stand out of the others is dropped.
  for (std::size_t k = 0; k < r; ++k) {
    double before = 0;
    for (std::size_t i = 0; i < rows; ++i) before += P[i * r + k] * P[i * r + k];
    for (int pass = 0; pass < 2; ++pass)
      for (std::size_t l = 0; l < k; ++l) {
        double dot = 0;
        for (std::size_t i = 0; i < rows; ++i) dot += P[i * r + l] * P[i * r + k];
        for (std::size_t i = 0; i < rows; ++i) P[i * r + k] -= dot * P[i * r + l];
      }
    double norm = 0;
    for (std::size_t i = 0; i < rows; ++i) norm += P[i * r + k] * P[i * r + k];
    const double scale = norm > 1e-8 * before && std::isfinite(norm) ? 1.0 / std::sqrt(norm) : 0.0;
    for (std::size_t i = 0; i < rows; ++i) P[i * r + k] *= scale;
  }
  bool finite = true;
  for (std::size_t i = 0; i < rows; ++i) {
    const float *xi = x + i * cols, *hi = hat + i * cols;
    const double* pi = P + i * r;
    for (std::size_t j = 0; j < cols; ++j) {
      const double d = static_cast<double>(xi[j] - hi[j]);
      double* qj = Q + j * r;
      for (std::size_t k = 0; k < r; ++k) qj[k] += d * pi[k];
    }
  }
  for (std::size_t j = 0; j < cols * r; ++j) finite = finite && std::isfinite(static_cast<float>(Q[j]));
  // A non-finite change is not sent (it stays in x − x̂): the factors go out as zeros.
  if (!finite) std::fill(P, P + (rows + cols) * r, 0.0);

  codec_segment sg;
  sg.kind = static_cast<std::uint8_t>(codec_kind::lowrank);
  sg.param = static_cast<std::uint32_t>(r);
  const std::uint32_t shape[2] = {static_cast<std::uint32_t>(rows), static_cast<std::uint32_t>(cols)};
  std::byte* body = out + sizeof sg;
  std::memcpy(body, shape, sizeof shape);
  auto* pf = reinterpret_cast<float*>(body + sizeof shape);
  float* qf = pf + rows * r;
  for (std::size_t i = 0; i < (rows + cols) * r; ++i) pf[i] = static_cast<float>(P[i]);
  lowrank_apply(pf, qf, rows, cols, r, hat);
  // ‖P·Qᵀ‖² = Σ_ab (PᵀP)_ab (QᵀQ)_ab: r² sums over the factors, not a pass over the matrix.
  m_change_energy = 0;
  for (std::size_t a = 0; a < r; ++a)
    for (std::size_t b = 0; b < r; ++b) {
      double pp = 0, qq = 0;
      for (std::size_t i = 0; i < rows; ++i) pp += static_cast<double>(pf[i * r + a]) * pf[i * r + b];
      for (std::size_t j = 0; j < cols; ++j) qq += static_cast<double>(qf[j * r + a]) * qf[j * r + b];
      m_change_energy += pp * qq;
    }
  // Q starts the next send; a direction that vanished (no change along it) starts again at random.
  std::memcpy(state, qf, cols * r * sizeof(float));
  std::uint64_t s = seed;
  for (std::size_t k = 0; k < r; ++k) {
    bool zero = true;
    for (std::size_t j = 0; j < cols && zero; ++j) zero = state[j * r + k] == 0.0f;
    if (zero)
      for (std::size_t j = 0; j < cols; ++j) state[j * r + k] = uniform_pm1(s);
  }
  const std::size_t used = sizeof sg + sizeof shape + (rows + cols) * r * sizeof(float);
  sg.bytes = pad8(used);
  std::memset(out + used, 0, sg.bytes - used);
  std::memcpy(out, &sg, sizeof sg);
  return sg.bytes;
}

decode_status detail::decode_lowrank(const codec_segment& sg, const std::byte* body, std::size_t room, float* hat, std::size_t n) noexcept {
  const std::size_t r = sg.param;
  std::uint32_t shape[2];
  if (room < sizeof shape) return fail("a lowrank segment's shape is truncated");
  std::memcpy(shape, body, sizeof shape);
  const std::size_t rows = shape[0], cols = shape[1];
  if (r == 0 || rows == 0 || cols == 0) return fail("a lowrank segment has rank, rows or cols 0");
  if (rows * cols != n) return fail("a lowrank segment's shape does not match the tensor");
  if (r > std::min(rows, cols)) return fail("a lowrank segment's rank exceeds its shape");
  if (sg.bytes != lowrank_segment_bytes(rows, cols, r)) return fail("a lowrank segment's size does not match its shape and rank");
  const auto* p = reinterpret_cast<const float*>(body + sizeof shape);
  for (std::size_t i = 0; i < (rows + cols) * r; ++i)
    if (!std::isfinite(p[i])) return fail("a lowrank segment has a non-finite factor");
  lowrank_apply(p, p + rows * r, rows, cols, r, hat);
  return {};
}

}  // namespace gossip

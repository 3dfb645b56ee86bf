#pragma once
// What lib/codec.cpp and lib/codec_lowrank.cpp share: segment sizes, the
// seeded generator, and the lowrank segment's checker.
#include <cstddef>
#include <cstdint>

#include "gossip/codec.hpp"

namespace gossip::detail {

constexpr std::size_t pad8(std::size_t n) noexcept { return (n + 7) / 8 * 8; }

inline std::uint64_t splitmix(std::uint64_t& s) noexcept {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline decode_status fail(const char* what) noexcept { return decode_status{what, 0}; }

/// A lowrank segment's bytes: header, u32 rows and cols, P (rows × r) and Q (cols × r) in fp32, padded.
constexpr std::size_t lowrank_segment_bytes(std::size_t rows, std::size_t cols, std::size_t r) noexcept {
  return pad8(sizeof(codec_segment) + 2 * sizeof(std::uint32_t) + r * (rows + cols) * sizeof(float));
}

/// The instruction sets of the fp16, int8 and topk kernels. Every level gives
/// the same bits (same operations in the same order, no fused multiply-add),
/// so ranks on different CPUs keep identical x̂.
enum class codec_isa : int { scalar = 0, avx2 = 1, avx512 = 2 };
/// The fastest level this CPU runs (what the kernels use unless told otherwise).
codec_isa codec_isa_best() noexcept;
/// The level whose kernels a codec runs while `level` is in use: int8 has
/// kernels up to AVX-512, fp16 and topk up to AVX2, the others none (scalar).
codec_isa kernel_isa(codec_kind kind, codec_isa level) noexcept;
/// Uses `level` (at most the best) from now on, in every thread; returns the
/// level used before. For tests and benches that compare the levels.
codec_isa use_codec_isa(codec_isa level) noexcept;

/// Starting directions of a power iteration: `n` values uniform in [−1, 1).
void seed_directions(float* q, std::size_t n, std::uint64_t seed) noexcept;

/// Checks a lowrank segment (`body`: `room` bytes after its header) against a
/// tensor of `n` values and adds P·Qᵀ to `hat`.
decode_status decode_lowrank(const codec_segment& sg, const std::byte* body, std::size_t room, float* hat, std::size_t n) noexcept;

}  // namespace gossip::detail

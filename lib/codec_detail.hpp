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

/// Starting directions of a power iteration: `n` values uniform in [−1, 1).
void seed_directions(float* q, std::size_t n, std::uint64_t seed) noexcept;

/// Checks a lowrank segment (`body`: `room` bytes after its header) against a
/// tensor of `n` values and adds P·Qᵀ to `hat`.
decode_status decode_lowrank(const codec_segment& sg, const std::byte* body, std::size_t room, float* hat, std::size_t n) noexcept;

}  // namespace gossip::detail

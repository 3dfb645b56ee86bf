#include "gossip/model.hpp"

#include <unistd.h>

#include <bit>
#include <cstring>

namespace gossip {

std::optional<std::string> layout_difference(const model_layout& mine, const model_layout& theirs) {
  const std::size_t n = std::min(mine.size(), theirs.size());
  for (std::size_t i = 0; i < n; ++i) {
    const auto& a = mine[i];
    const auto& b = theirs[i];
    if (a.name != b.name)
      return fmt::format("tensor #{} is named '{}' here but '{}' there", i, a.name, b.name);
    if (a.count != b.count)
      return fmt::format("tensor #{} '{}' has {} elements here but {} there", i, a.name, a.count, b.count);
    if (a.dtype != b.dtype)
      return fmt::format("tensor #{} '{}' is {} here but {} there", i, a.name, to_string(a.dtype), to_string(b.dtype));
    if (a.rows != b.rows) {
      const auto shape = [](const layout_entry& e) {
        return e.rows ? fmt::format("a matrix of {} rows x {} columns", e.rows, e.count / e.rows) : std::string("not declared a matrix");
      };
      return fmt::format("tensor #{} '{}' is {} here but {} there", i, a.name, shape(a), shape(b));
    }
  }
  if (mine.size() != theirs.size()) {
    const auto& longer = mine.size() > theirs.size() ? mine : theirs;
    return fmt::format("the model has {} tensors here but {} there (first unmatched: '{}')", mine.size(), theirs.size(),
                       longer[n].name);
  }
  return std::nullopt;
}

void check_layouts(const model_layout& mine, int my_rank, const model_layout& theirs, int their_rank) {
  if (auto diff = layout_difference(mine, theirs))
    throw layout_error(fmt::format(
        "model layout of rank {} does not match rank {}: {} (\"here\" is rank {}); every rank must register the same "
        "tensors in the same order with the same sizes and dtypes",
        my_rank, their_rank, *diff, my_rank));
}

std::uint64_t fingerprint(const model_layout& layout) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  for (const auto& e : layout) {
    mix(e.name.data(), e.name.size());
    const std::uint64_t c = e.count;
    mix(&c, sizeof c);
    mix(&e.dtype, sizeof e.dtype);
    const std::uint64_t r = e.rows;
    mix(&r, sizeof r);
  }
  return h;
}

std::uint64_t fingerprint(std::span<const float> values) noexcept {
  // Two values per 64-bit word, each word multiplied in and rotated (the
  // round of xxHash64), then the length and a final avalanche.
  constexpr std::uint64_t p1 = 0x9e3779b185ebca87ull, p2 = 0xc2b2ae3d27d4eb4full;
  std::uint64_t h = 0x27d4eb2f165667c5ull;
  const std::size_t n = values.size();
  std::size_t i = 0;
  for (; i + 2 <= n; i += 2) {
    std::uint64_t w;
    std::memcpy(&w, values.data() + i, sizeof w);
    h = std::rotl(h ^ (w * p2), 31) * p1;
  }
  if (i < n) {
    std::uint32_t w;
    std::memcpy(&w, values.data() + i, sizeof w);
    h = std::rotl(h ^ (w * p2), 31) * p1;
  }
  h ^= static_cast<std::uint64_t>(n);
  h ^= h >> 33;
  h *= p2;
  h ^= h >> 29;
  h *= p1;
  h ^= h >> 32;
  return h ? h : 1;
}

std::uint64_t detail::physical_memory_bytes() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

}  // namespace gossip

#include "gossip/model.hpp"

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
  }
  return h;
}

}  // namespace gossip

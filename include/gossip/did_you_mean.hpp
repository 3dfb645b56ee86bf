#pragma once
// "Did you mean" for config errors: the known name closest to a misspelt one.
#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace gossip::detail {

/// Edit distance counting a swap of two neighbouring letters as one edit
/// (optimal string alignment), so "enigne" is one edit from "engine".
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

/// The known name closest to `word`, or "" when none is close: at most one
/// edit from three letters on, two from six (none for shorter words).
template <typename Names>
std::string closest(std::string_view word, const Names& known) {
  const std::size_t limit = word.size() >= 6 ? 2 : word.size() >= 3 ? 1 : 0;
  std::string best;
  std::size_t best_d = limit + 1;
  for (const auto& k : known) {
    const std::string_view name(k);
    if (const auto d = edit_distance(word, name); d < best_d) best_d = d, best = std::string(name);
  }
  return best;
}

/// " (did you mean 'x'?)" with `quote` around the suggestion, or "".
template <typename Names>
std::string did_you_mean(std::string_view word, const Names& known, std::string_view open = "'", std::string_view close = "'") {
  const auto c = closest(word, known);
  return c.empty() ? std::string() : fmt::format(" (did you mean {}{}{}?)", open, c, close);
}

}  // namespace gossip::detail

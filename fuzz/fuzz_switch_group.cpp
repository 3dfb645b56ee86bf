// The switch's --group text (group_config::parse) and an aggregator built from
// it. Every rejection must be std::invalid_argument; an accepted group must
// satisfy the limits the aggregator relies on.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string_view>

#include "aggregator.hpp"

namespace sw = gossip::sw;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  sw::group_config g;
  try {
    g = sw::group_config::parse(text);
  } catch (const std::invalid_argument&) {
    return 0;
  }
  if (g.members < 1 || g.members > 64 || g.chunk < 1 || g.chunk > sw::max_chunk || g.slots < 1) std::abort();
  if (g.mode == sw::group_mode::async && g.elements == 0) std::abort();
  if (g.elements != 0 && g.chunk_length(g.chunks() - 1) == 0) std::abort();
  // Build it when it is small enough to allocate here (the switch sizes its pools from it).
  if (static_cast<std::uint64_t>(g.members) * g.elements <= (1u << 16) && std::uint64_t{g.slots} * g.chunk <= (1u << 16)) {
    sw::aggregator agg({g});
    if (agg.config(g.id) == nullptr) std::abort();
  }
  return 0;
}

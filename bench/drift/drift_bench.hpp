#pragma once
// Shared by the host and the device halves of bench/drift.
#include <cstddef>
#include <string>
#include <vector>

namespace gossip::bench {

/// One measured model size. Bandwidth is *model bytes per second*: the model
/// is `elements` float32 values (4·elements bytes); the drift pass reads x and
/// x̂ of that size, the copy reads a buffer of that size and writes another.
/// Both are divided into the same byte count, so `ratio` = drift_gbps /
/// copy_gbps is the drift pass's speed relative to copying the model once.
struct drift_run {
  std::string where;  ///< "host" or "device"
  std::string cache;  ///< "warm": repeats back to back; "cold": caches evicted before each repeat
  std::size_t elements = 0;
  double drift_gbps = 0, copy_gbps = 0, ratio = 0;
  int repeats = 0;
};

struct drift_bench_settings {
  std::vector<std::size_t> sizes;  ///< model sizes in elements
  double seconds_per_size = 0.3;   ///< per method, per size
  double tolerance = 1e-5;         ///< relative error of ‖x − x̂‖² and ‖x̂‖² against a double reference
};

}  // namespace gossip::bench

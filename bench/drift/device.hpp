#pragma once
// The device half of bench/drift (compiled only when libgossip_cuda is built).
#include <string>

#include "drift/drift_bench.hpp"

namespace gossip::bench {

/// Empty when a GPU can be used, else why not.
std::string device_unavailable();

/// The device drift pass (one fused kernel, as an engine step runs it: launch,
/// sums copied back, event waited for) against cudaMemcpyAsync
/// device-to-device of the same model bytes plus the same wait. Checks the
/// per-tensor sums against a double reference first; throws gossip::error when
/// they differ.
drift_run device_run(std::size_t elements, const drift_bench_settings& s);

}  // namespace gossip::bench

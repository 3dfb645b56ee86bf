// bench/traffic's own sections of a config, [bench] and [baseline]: the
// bench reads them, and the example checks them when it runs a bench config
// (bench/traffic/traffic.toml), so a misspelt key is refused by both.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <gossip/options.hpp>

namespace gossip::examples {

// [bench]: how the bench runs.
inline const std::vector<option_spec>& traffic_bench_specs() {
  static const std::vector<option_spec> specs = {
      {"seeds", std::int64_t{3}, "seeds per policy"},
      {"quick_epochs", std::int64_t{2}, "epochs in --quick mode"},
      {"quick_train_limit", std::int64_t{0}, "training samples in --quick mode (0: all)"},
  };
  return specs;
}

// [baseline]: the equal-bytes controls.
inline const std::vector<option_spec>& traffic_baseline_specs() {
  static const std::vector<option_spec> specs = {
      {"roles", std::string("equal-traffic,periodic-qgm,local-sgd,diloco,staggered-qgm"), "equal-bytes baselines to run, comma-separated"},
      {"rounds", std::int64_t{-1}, "gossip rounds at each local-sgd/diloco averaging point (-1: ceil(log2 workers))"},
      {"outer_lr", 0.7, "diloco: outer learning rate"},
      {"outer_momentum", 0.9, "diloco: outer Nesterov momentum"},
      {"max_attempts", std::int64_t{3}, "longer periods tried when a baseline's bytes overshoot the adaptive run's"},
  };
  return specs;
}

}  // namespace gossip::examples

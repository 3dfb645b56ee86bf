// Two workers as threads fit y = w·x + b, each on its own data, and gossip.
// Build: c++ -std=c++20 loopback.cpp $(pkg-config --cflags --libs gossip)
#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include <gossip/gossip.hpp>

int main(int argc, char** argv) try {
  if (argc > 2 || (argc == 2 && argv[1][0] == '-')) {
    fmt::print(stderr, "usage: {} [config.toml]\n", argv[0]);
    return 2;
  }
  const int world = 2, steps = 300;
  // [policy], [topology], … from a file, or all defaults (or fill gossip::engine_spec in code);
  // its components and keys are checked here, before the workers start.
  const auto cfg = argc > 1 ? gossip::config::load(argv[1]) : gossip::config{};
  const auto spec = gossip::engine_spec::from(cfg);
  gossip::loopback_fabric fabric(world, gossip::link_emulation::from(cfg.transport));  // [transport] bandwidth_gbps, latency_us

  std::atomic<int> failed{0};
  auto worker = [&](int rank) {
    try {
      std::vector<float> w(16, 0.0f), b(1, 0.0f);
      gossip::model_view model;  // a non-owning view: names, pointers, sizes
      model.add("w", w).add("b", b);
      gossip::engine eng(model, rank, world, spec, fabric.endpoint(rank));  // one per worker

      std::mt19937 rng(rank);
      std::normal_distribution<float> normal;
      std::vector<float> x(w.size());
      for (int t = 0; t < steps; ++t) {
        // forward and backward on one sample (this worker's data: w = 1, b = rank), then SGD in place
        float y = static_cast<float>(rank), pred = b[0];
        for (std::size_t i = 0; i < x.size(); ++i) x[i] = normal(rng), y += x[i], pred += w[i] * x[i];
        const float err = pred - y, lr = 0.02f;
        for (std::size_t i = 0; i < w.size(); ++i) w[i] -= lr * err * x[i];
        b[0] -= lr * err;
        eng.step({.lr = lr, .loss = 0.5 * err * err});  // merge, measure drift, decide, send
      }
      eng.finish();  // final averaging rounds
      fmt::print("rank {}: b = {:.2f} (its data alone: {}, all data: 0.5)\n", rank, b[0], rank);
      fmt::print("{}\n", eng.stats().to_json());  // bytes per peer and tensor, decisions by reason
    } catch (const gossip::error& e) {  // this worker's engine: a bad topology, a peer that never came, …
      fmt::print(stderr, "rank {}: error: {}\n", rank, e.what());
      failed = 1;
    }
  };
  std::vector<std::jthread> ranks;
  for (int r = 0; r < world; ++r) ranks.emplace_back(worker, r);
  ranks.clear();  // joins
  return failed;
} catch (const gossip::error& e) {  // a bad config file: what is wrong, and where
  fmt::print(stderr, "error: {}\n", e.what());
  return 1;
}

// One worker per process over UCX: the loop of loopback.cpp, with rank and
// world from the environment (gossip-run, mpirun, Slurm or torchrun).
// Build: c++ -std=c++20 ucx.cpp $(pkg-config --cflags --libs gossip-ucx)
// Run:   UCX_NET_DEVICES=lo gossip-run -n 2 [--config run.toml] -- ./a.out
#include <memory>
#include <random>
#include <vector>

#include <gossip/gossip.hpp>
#include <gossip/transports/ucx/ucx.hpp>

int main(int argc, char** argv) try {
  if (argc > 2 || (argc == 2 && argv[1][0] == '-')) {
    fmt::print(stderr, "usage: {} [config.toml]\n", argv[0]);
    return 2;
  }
  const int steps = 300;
  // The file given as argument, else gossip-run --config's (GOSSIP_CONFIG), else the defaults.
  const auto spec = gossip::engine_spec::from(argc > 1 ? gossip::config::load(argv[1]) : gossip::config::from_env());
  // Rank 0 serves the rendezvous at GOSSIP_MASTER_ADDR:GOSSIP_MASTER_PORT; it must outlive the others' use of it.
  // Its waits are bounded by [engine] timeout_s.
  auto boot = std::make_shared<gossip::bootstrap>(gossip::bootstrap::from_env(spec.settings.timeout));
  const int rank = boot->rank(), world = boot->world();

  std::vector<float> w(16, 0.0f), b(1, 0.0f);
  gossip::model_view model;
  model.add("w", w).add("b", b);
  gossip::engine eng(model, rank, world, spec, gossip::ucx_transport(boot));

  std::mt19937 rng(rank);
  std::normal_distribution<float> normal;
  std::vector<float> x(w.size());
  for (int t = 0; t < steps; ++t) {
    float y = static_cast<float>(rank), pred = b[0];
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = normal(rng), y += x[i], pred += w[i] * x[i];
    const float err = pred - y, lr = 0.02f;
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= lr * err * x[i];
    b[0] -= lr * err;
    eng.step({.lr = lr, .loss = 0.5 * err * err});  // sends in the background; waits only to pace (max_lead) or to merge a backlog
  }
  eng.finish();               // merges everything the peers sent before this rank leaves
  boot->barrier("done");      // rank 0 serves the rendezvous until every rank is through
  fmt::print("rank {} of {}: b = {:.2f}, {} bytes sent\n", rank, world, b[0], eng.stats().bytes_sent);
} catch (const gossip::error& e) {  // a bad config, a peer that never came, a timeout: what and where
  fmt::print(stderr, "error: {}\n", e.what());
  return 1;
}

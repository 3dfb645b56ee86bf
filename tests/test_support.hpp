#pragma once
// Helpers shared by the test executables.
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gossip/gossip.hpp"

namespace gossip::test {

/// A model of named float tensors with deterministic contents.
struct toy_model {
  std::vector<std::vector<float>> tensors;
  model_view view;
  explicit toy_model(std::vector<std::size_t> sizes, std::uint64_t seed = 1, float scale = 1.0f) {
    std::mt19937_64 g(seed);
    tensors.reserve(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      auto& t = tensors.emplace_back(sizes[i]);
      for (auto& v : t) v = scale * (static_cast<float>(g() % 2001) / 1000.0f - 1.0f);
      view.add(fmt::format("t{}", i), t);
    }
  }
  std::vector<float> flat() const {
    std::vector<float> f;
    for (const auto& t : tensors) f.insert(f.end(), t.begin(), t.end());
    return f;
  }
};

/// Runs fn(rank) on `world` threads; rethrows the first exception.
inline void run_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

/// An engine_spec built in code, as a user would.
inline engine_spec spec_of(any_policy p, std::string topo = "exponential", std::string proto = "push-sum", double timeout_s = 20) {
  engine_spec s;
  s.policy = std::move(p);
  s.topology.name = std::move(topo);
  s.protocol.name = std::move(proto);
  s.settings.timeout = std::chrono::duration<double>(timeout_s);
  return s;
}

/// A loopback endpoint with every call passed on: tests derive from it to
/// change one of them.
struct loopback_forward {
  loopback_transport t;
  void attach(const transport_setup& s) { t.attach(s); }
  post_status post(int peer, std::span<const std::byte> msg, std::uint64_t step) { return t.post(peer, msg, step); }
  std::size_t collect(std::uint64_t s, std::span<received> o) { return t.collect(s, o); }
  void release(std::uint64_t s) { t.release(s); }
  void end_step(std::uint64_t s) { t.end_step(s); }
  bool busy(const std::byte* b) const { return t.busy(b); }
  void flush(std::chrono::duration<double> d) { t.flush(d); }
  void leave() { t.leave(); }
  transport_capabilities capabilities() const { return t.capabilities(); }
  std::size_t dead_peers(std::span<received> o) { return t.dead_peers(o); }
  transport_counters counters() const { return t.counters(); }
};

}  // namespace gossip::test

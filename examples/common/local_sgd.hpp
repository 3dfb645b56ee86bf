#pragma once
/// Local SGD with periodic averaging over the gossip topology, and an outer
/// optimizer for it (DiLoCo, Douillard et al. 2023).
///
/// averaging_schedule is the engine policy of a local-SGD run: the training
/// loop calls engine.step() after each of its `every` optimizer steps, and
/// after every `every`-th one it calls step() `rounds` more times with no
/// local update in between. Engine steps thus come in cycles of every + rounds:
///
///     position      0 .. every-2   every-1    every .. every+rounds-2   every+rounds-1
///     local update  yes            yes        no                        no
///     sends         no             round 0    rounds 1 .. rounds-1      no (merges the last round)
///
/// Unlike periodic gossip at period every/rounds (the same bytes), the rounds
/// of one averaging point follow each other without local progress, so they
/// mix the models: on the exponential topology, push-sum and a power-of-two
/// world, ⌈log2 workers⌉ rounds (one peer each, 2^k hops) give every worker
/// the exact average of all models. Over the lockstep loopback transport the
/// last merge-only step merges the last round; over an asynchronous transport
/// (ucx) it merges what has arrived by then, so the average is approximate.
///
/// outer_optimizer is applied when an averaging point is complete: with
/// anchor the model after the previous outer step, Δ = anchor − x (x the
/// averaged model) is an outer gradient, and
///
///     v ← μ·v + Δ;   x ← anchor − lr·(Δ + μ·v)   (Nesterov; lr·v without it);   anchor ← x
///
/// lr = 1, μ = 0 is plain averaging (x unchanged), which is what active()
/// tells apart.
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "gossip/error.hpp"
#include "gossip/signal.hpp"

namespace gossip::examples {

/// The engine policy of a local-SGD run (see the file comment).
struct averaging_schedule {
  std::uint64_t every = 1;   ///< optimizer steps between averaging points
  std::uint64_t rounds = 1;  ///< gossip rounds at each averaging point

  std::uint64_t cycle() const noexcept { return every + rounds; }
  decision decide(const signal& s) const noexcept {
    const std::uint64_t pos = s.step % cycle();
    const bool fire = pos + 1 >= every && pos + 1 < every + rounds;
    return fire ? decision::fire(reason::period, static_cast<double>(pos), static_cast<double>(every))
                : decision::skip(reason::not_due, static_cast<double>(pos), static_cast<double>(every));
  }
};

/// Outer step at each averaging point (see the file comment).
struct outer_optimizer {
  float lr = 1.0f;
  float momentum = 0.0f;
  bool nesterov = true;
  std::vector<float> anchor{};    ///< the model after the last outer step
  std::vector<float> velocity{};  ///< outer momentum buffer

  /// False for lr = 1 and momentum = 0: the step would leave x as it is.
  bool active() const noexcept { return lr != 1.0f || momentum != 0.0f; }

  /// Remembers x as the anchor (call once, on the initial model).
  void start(std::span<const float> x) {
    anchor.assign(x.begin(), x.end());
    velocity.assign(x.size(), 0.0f);
  }

  /// x is the freshly averaged model; replaces it with the outer step's result.
  void step(std::span<float> x) {
    if (anchor.size() != x.size()) start(x);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float delta = anchor[i] - x[i];
      velocity[i] = momentum * velocity[i] + delta;
      const float update = nesterov ? delta + momentum * velocity[i] : velocity[i];
      x[i] = anchor[i] - lr * update;
      anchor[i] = x[i];
    }
  }
};

}  // namespace gossip::examples

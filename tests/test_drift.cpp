#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "gossip/drift.hpp"

using namespace gossip;

namespace {
// The pass adds non-negative terms in float over runs of at most 256 terms per
// accumulator lane and in double above, so it agrees with a double reference to
// a few float ulps of the total.
constexpr double tolerance = 1e-5;
bool close(double got, double want) { return std::abs(got - want) <= tolerance * std::max(std::abs(want), 1e-30); }
}  // namespace

TEST_CASE("drift_pass matches a double reference at every size around its block and tail boundaries") {
  std::mt19937_64 g(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t n : {0ul, 1ul, 15ul, 63ul, 64ul, 65ul, 1023ul, 4096ul, 4097ul, 4096ul * 16 + 61, 100003ul, 1ul << 20}) {
    for (std::size_t misalign : {0ul, 1ul}) {
      CAPTURE(n);
      CAPTURE(misalign);
      std::vector<float> xs(n + 1), rs(n + 1), ps(n + 1);
      for (std::size_t i = 0; i <= n; ++i) {
        rs[i] = u(g);
        xs[i] = rs[i] + 0.01f * u(g);
        ps[i] = xs[i] + 0.001f * u(g);
      }
      const float* x = xs.data() + misalign;
      const float* r = rs.data() + misalign;
      float* p = ps.data() + misalign;
      double diff = 0, ref = 0, step = 0;
      for (std::size_t i = 0; i < n; ++i) {
        diff += (static_cast<double>(x[i]) - r[i]) * (static_cast<double>(x[i]) - r[i]);
        ref += static_cast<double>(r[i]) * r[i];
        step += (static_cast<double>(x[i]) - p[i]) * (static_cast<double>(x[i]) - p[i]);
      }
      const drift_sums a = drift_pass(x, r, nullptr, n);
      CHECK(close(a.diff_sq, diff));
      CHECK(close(a.ref_sq, ref));
      CHECK(a.step_sq == 0.0);
      const drift_sums b = drift_pass(x, r, p, n);
      CHECK(close(b.diff_sq, diff));
      CHECK(close(b.ref_sq, ref));
      CHECK(close(b.step_sq, step));
      bool copied = true;
      for (std::size_t i = 0; i < n; ++i) copied = copied && p[i] == x[i];
      CHECK(copied);  // x_{t−1} ← x in the same pass
      if (misalign == 0) CHECK(ps[n] != xs[n]);  // and not one float further
    }
  }
}

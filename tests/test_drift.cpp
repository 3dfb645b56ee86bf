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

TEST_CASE("drift_pass with quasi-global momentum: m̂ ← β·m̂ + (1 − β)·(x_{t−1} − x)/lr, the buffer set to m̂, all in the same pass") {
  std::mt19937_64 g(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t n : {1ul, 63ul, 64ul, 65ul, 4097ul, 100003ul}) {
    CAPTURE(n);
    std::vector<float> x(n), r(n), p(n), mhat(n), buf(n);
    for (std::size_t i = 0; i < n; ++i) {
      r[i] = u(g);
      x[i] = r[i] + 0.01f * u(g);
      p[i] = x[i] + 0.001f * u(g);
      mhat[i] = u(g);
      buf[i] = 99.0f;
    }
    const float lr = 0.05f, beta = 0.9f;
    std::vector<float> want(n);
    double step = 0;
    for (std::size_t i = 0; i < n; ++i) {
      want[i] = beta * mhat[i] + (1 - beta) * (p[i] - x[i]) / lr;
      step += (static_cast<double>(x[i]) - p[i]) * (static_cast<double>(x[i]) - p[i]);
    }
    const auto plain = drift_pass(x.data(), r.data(), nullptr, n);
    const auto d = drift_pass(x.data(), r.data(), p.data(), n, qgm_args{mhat.data(), buf.data(), 1 / lr, beta});
    CHECK(d.diff_sq == plain.diff_sq);
    CHECK(d.ref_sq == plain.ref_sq);
    CHECK(close(d.step_sq, step));
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(mhat[i] == doctest::Approx(want[i]).epsilon(1e-5));
      CHECK(buf[i] == mhat[i]);
      CHECK(p[i] == x[i]);
    }
  }
}

TEST_CASE("quasi-global momentum counts a merge after tau steps as min(1, 1/((1-beta)*tau)) of it") {
  // x = x_{t-1} - lr*v + delta: the optimizer's step with velocity v (left in
  // its buffer) plus what merges moved. d = (x_{t-1} - x)/lr = v - share*delta/lr.
  std::mt19937 g(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t n : {5ul, 4097ul}) {
    for (float share : {1.0f, 0.25f, 0.0f}) {
      CAPTURE(n);
      CAPTURE(share);
      const float lr = 0.05f, beta = 0.9f;
      std::vector<float> x(n), r(n), p(n), mhat(n), buf(n), delta(n), want(n);
      for (std::size_t i = 0; i < n; ++i) {
        p[i] = u(g);
        r[i] = p[i];
        buf[i] = u(g);
        delta[i] = 0.01f * u(g);
        mhat[i] = u(g);
        x[i] = p[i] - lr * buf[i] + delta[i];
        want[i] = beta * mhat[i] + (1 - beta) * (buf[i] - share * delta[i] / lr);
      }
      drift_pass(x.data(), r.data(), p.data(), n, qgm_args{mhat.data(), buf.data(), 1 / lr, beta, share});
      for (std::size_t i = 0; i < n; ++i) {
        CHECK(mhat[i] == doctest::Approx(want[i]).epsilon(1e-4));
        CHECK(buf[i] == mhat[i]);
      }
    }
  }
}

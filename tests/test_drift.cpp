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

TEST_CASE("the make-up of a push-sum share in flight, x <- x + c*(x - ref), fused into the drift pass and the merge pass") {
  // Each fused pass must give what the make-up followed by the plain pass
  // gives, at every size around the block and tail boundaries.
  std::mt19937_64 g(13);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const float c = 1.0f / 3.0f, lr = 0.05f, beta = 0.9f;
  for (std::size_t n : {1ul, 15ul, 63ul, 64ul, 65ul, 1023ul, 1025ul, 4097ul, 100003ul}) {
    CAPTURE(n);
    std::vector<float> x(n), r(n), p(n), m(n), mhat(n), buf(n);
    for (std::size_t i = 0; i < n; ++i) {
      r[i] = u(g);
      x[i] = r[i] + 0.01f * u(g);
      p[i] = x[i] + 0.001f * u(g);
      m[i] = u(g);
      mhat[i] = u(g);
      buf[i] = u(g);
    }
    std::vector<float> made(n);
    for (std::size_t i = 0; i < n; ++i) made[i] = x[i] + c * (x[i] - r[i]);
    auto same = [&](const std::vector<float>& a, const std::vector<float>& b) {
      bool ok = true;
      for (std::size_t i = 0; i < n; ++i) ok = ok && std::abs(a[i] - b[i]) <= 1e-6f * (1 + std::abs(b[i]));
      return ok;
    };
    SUBCASE("drift pass, without and with x_{t-1}") {
      auto x1 = x;
      const auto want = drift_pass(made.data(), r.data(), nullptr, n);
      const auto got = drift_pass_made_up(x1.data(), r.data(), nullptr, n, c);
      CHECK(same(x1, made));
      CHECK(close(got.diff_sq, want.diff_sq));
      CHECK(close(got.ref_sq, want.ref_sq));
      auto x2 = x, p2 = p, p_want = p;
      const auto want2 = drift_pass(made.data(), r.data(), p_want.data(), n);
      const auto got2 = drift_pass_made_up(x2.data(), r.data(), p2.data(), n, c);
      CHECK(same(x2, made));
      CHECK(same(p2, made));  // x_{t-1} <- the made-up x
      CHECK(close(got2.step_sq, want2.step_sq));
    }
    SUBCASE("drift pass with quasi-global momentum") {
      auto x1 = x, p1 = p, mh1 = mhat, b1 = buf;
      auto p2 = p, mh2 = mhat, b2 = buf;
      const qgm_args q1{mh1.data(), b1.data(), 1 / lr, beta, 0.5f};
      const auto got = drift_pass_made_up(x1.data(), r.data(), p1.data(), n, c, &q1);
      const auto want = drift_pass(made.data(), r.data(), p2.data(), n, qgm_args{mh2.data(), b2.data(), 1 / lr, beta, 0.5f});
      CHECK(same(x1, made));
      CHECK(same(mh1, mh2));
      CHECK(same(b1, b2));
      CHECK(close(got.diff_sq, want.diff_sq));
      CHECK(close(got.step_sq, want.step_sq));
    }
    SUBCASE("numerator_steps: the step since x_{t-1} counted at weight 1, fused into the drift pass, with and without momentum") {
      // x <- x + c*(x - x_{t-1}) (negative c too: a weight above 1), then the pass with x_{t-1}.
      for (const float k : {c, -0.25f}) {
        CAPTURE(k);
        std::vector<float> stepped(n);
        for (std::size_t i = 0; i < n; ++i) stepped[i] = x[i] + k * (x[i] - p[i]);
        auto x1 = x, p1 = p, p_want = p;
        const auto got = drift_pass_stepped(x1.data(), r.data(), p1.data(), n, k);
        const auto want = drift_pass(stepped.data(), r.data(), p_want.data(), n);
        CHECK(same(x1, stepped));
        CHECK(same(p1, stepped));  // x_{t-1} <- the corrected x
        CHECK(close(got.diff_sq, want.diff_sq));
        CHECK(close(got.ref_sq, want.ref_sq));
        CHECK(close(got.step_sq, want.step_sq));
        auto x2 = x, p2 = p, mh1 = mhat, b1 = buf, p3 = p, mh2 = mhat, b2 = buf;
        const qgm_args q1{mh1.data(), b1.data(), 1 / lr, beta, 0.5f};
        const auto got2 = drift_pass_stepped(x2.data(), r.data(), p2.data(), n, k, &q1);
        const auto want2 = drift_pass(stepped.data(), r.data(), p3.data(), n, qgm_args{mh2.data(), b2.data(), 1 / lr, beta, 0.5f});
        CHECK(same(x2, stepped));
        CHECK(same(mh1, mh2));
        CHECK(same(b1, b2));
        CHECK(close(got2.step_sq, want2.step_sq));
      }
    }
    SUBCASE("merge pass") {
      auto z1 = x, z2 = made;
      const auto got = mix_pass_made_up(z1.data(), m.data(), 0.25f, n, r.data(), c);
      const auto want = mix_pass(z2.data(), m.data(), 0.25f, n);
      CHECK(same(z1, z2));
      CHECK(close(got.diff_sq, want.diff_sq));
      CHECK(close(got.ref_sq, want.ref_sq));
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

namespace {

// 8 ranks on quadratics f_r(x) = ½·Σ h_i·(x_i − b_{r,i})² (each rank its own
// optimum: label skew in miniature), heavy-ball SGD with quasi-global momentum
// through drift_pass, merging with one peer per round of the exponential graph
// every tau steps, lr 0.05 decayed x0.1 at 50 % and 75 % of 468 steps.
// Returns the consensus distance mean_r ‖x_r − x̄‖² over the last 50 steps.
template <class Share>
double periodic_qgm_consensus(std::uint64_t tau, Share share_of) {
  constexpr int n = 8, d = 50, steps = 468;
  constexpr float beta = 0.9f;
  std::mt19937 g(11);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> h(d), b(n * d), x(n * d, 0.0f), prev(n * d, 0.0f), ref(n * d, 0.0f), buf(n * d, 0.0f), mhat(n * d, 0.0f),
      mixed(n * d);
  for (auto& v : h) v = 0.1f + 0.9f * u(g);
  for (auto& v : b) v = 4.0f * u(g) - 2.0f;
  std::uint64_t last_merge = 0, merge_steps = 0, round = 0;
  double tail = 0;
  for (int t = 0; t < steps; ++t) {
    const float lr = 0.05f * (t < steps / 2 ? 1.0f : t < steps * 3 / 4 ? 0.1f : 0.01f);
    for (int k = 0; k < n * d; ++k) {
      buf[k] = beta * buf[k] + h[k % d] * (x[k] - b[k]);
      x[k] -= lr * buf[k];
    }
    const float share = merge_steps > 0 ? share_of(beta, merge_steps) : 1.0f;
    merge_steps = 0;
    for (int r = 0; r < n; ++r)
      drift_pass(&x[r * d], &ref[r * d], &prev[r * d], d, qgm_args{&mhat[r * d], &buf[r * d], 1 / lr, beta, share});
    if ((t + 1) % tau == 0) {  // push-sum with equal weights: x_r ← (x_r + x_{r − 2^k})/2
      const int offset = 1 << (round++ % 3);
      for (int r = 0; r < n; ++r)
        for (int i = 0; i < d; ++i) mixed[r * d + i] = 0.5f * (x[r * d + i] + x[((r - offset + n) % n) * d + i]);
      x.swap(mixed);
      merge_steps = t + 1 - last_merge;
      last_merge = t + 1;
    }
    if (t >= steps - 50) {
      double c = 0;
      for (int i = 0; i < d; ++i) {
        double mean = 0;
        for (int r = 0; r < n; ++r) mean += x[r * d + i];
        mean /= n;
        for (int r = 0; r < n; ++r) c += (x[r * d + i] - mean) * (x[r * d + i] - mean);
      }
      tail += c / n / 50;
    }
  }
  return tail;
}

}  // namespace

TEST_CASE("quasi-global momentum with periodic merges keeps the ranks together at every period (8 ranks, exponential graph)") {
  CHECK(qgm_merge_share(0.9f, 0) == 1.0f);
  CHECK(qgm_merge_share(0.9f, 4) == 1.0f);
  CHECK(qgm_merge_share(0.9f, 10) == doctest::Approx(0.5f));
  CHECK(qgm_merge_share(0.9f, 20) == doctest::Approx(0.25f));
  const auto ignore_merges = [](float, std::uint64_t) { return 0.0f; };
  const auto twice = [](float beta, std::uint64_t tau) { return std::min(1.0f, 1.0f / ((1.0f - beta) * static_cast<float>(tau))); };
  for (std::uint64_t tau : {5u, 7u, 11u, 13u, 15u, 20u, 27u, 40u}) {
    CAPTURE(tau);
    const double reference = periodic_qgm_consensus(tau, ignore_merges);  // momentum blind to merges
    const double engine_rule = periodic_qgm_consensus(tau, qgm_merge_share);
    CHECK(std::isfinite(engine_rule));
    CHECK(engine_rule < 2 * reference);  // at most 1.8x (tau 20), mostly far below
    // Twice the share (a carry of 0.9·Δ per interval) is what made periodic
    // every 13 diverge on label-skewed shards; here too the ranks fly apart.
    if (tau >= 11 && tau <= 20) CHECK(periodic_qgm_consensus(tau, twice) > 10 * reference);  // 70x to 1100x
  }
}

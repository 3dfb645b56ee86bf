// The 'cuda' suite: device kernels against the host reference, the staging
// path, and engine steps on device tensors. Without a usable GPU only the
// host-side checks run, and the program exits 77 (meson: SKIP) saying why.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include "gossip/cuda.hpp"
#include "test_support.hpp"

using namespace gossip;

namespace {

// Relative tolerance of device sums against the host pass: both add
// non-negative terms in float over short runs and in double above, so they
// agree to a few float ulps of the total.
constexpr double sum_tolerance = 1e-5;

void cuda_ok(cudaError_t e) { REQUIRE_MESSAGE(e == cudaSuccess, cudaGetErrorName(e), ": ", cudaGetErrorString(e)); }

struct device_floats {
  explicit device_floats(std::size_t n) : n(n) { cuda_ok(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(float))); }
  ~device_floats() { cudaFree(p); }
  device_floats(const device_floats&) = delete;
  device_floats& operator=(const device_floats&) = delete;
  // From pageable memory cudaMemcpy may return before its DMA lands, and the
  // engines' streams are non-blocking (no implicit order with the legacy
  // stream): wait for the device before a kernel on such a stream reads p.
  void upload(const std::vector<float>& h) {
    cuda_ok(cudaMemcpy(p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    cuda_ok(cudaDeviceSynchronize());
  }
  std::vector<float> download() const {
    std::vector<float> h(n);
    cuda_ok(cudaMemcpy(h.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
  }
  float* p = nullptr;
  std::size_t n;
};

struct stream {
  stream() { cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~stream() { cudaStreamDestroy(s); }
  cudaStream_t s = nullptr;
};

std::vector<float> random_floats(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

bool close(double got, double want, double tol) { return std::abs(got - want) <= tol * std::max(std::abs(want), 1e-30); }

// Tensors of awkward sizes (an empty one too), starting one float past a
// 16-byte boundary so the kernels' scalar path runs too.
const std::vector<std::size_t> sizes = {1, 3, 0, 4096, 4097, 100003, 128};

}  // namespace

TEST_CASE("host: a device tensor without a device backend is refused with the fix" * doctest::test_suite("host")) {
  std::vector<float> w(16);
  model_view m;
  m.add(tensor_view{"w", w.data(), w.size(), dtype::f32, memory_kind::cuda});
  loopback_fabric fabric(1);
  CHECK_THROWS_WITH_AS(engine(m, 0, 1, test::spec_of(policy_registry().make("periodic", options("t")), "ring"), fabric.endpoint(0)),
                       doctest::Contains("call model.on_device(gossip::cuda::device(stream))"), config_error);
}

TEST_CASE("host: the capability hook reads device_memory only where a transport reports it" * doctest::test_suite("host")) {
  struct with { bool device_memory = true; };
  struct without { bool copies_on_post = true; };
  CHECK(detail::takes_device_memory(with{}));
  CHECK_FALSE(detail::takes_device_memory(without{}));
  CHECK_FALSE(detail::takes_device_memory(transport_capabilities{}));
}

TEST_CASE("host: without a GPU gossip::cuda::device throws and names the reason" * doctest::test_suite("host")) {
  if (cuda::available()) return;
  CHECK_THROWS_WITH_AS(cuda::device(nullptr), doctest::Contains("no usable CUDA device"), error);
}

TEST_CASE("drift kernel matches gossip::drift_pass per tensor, with and without x_{t-1}") {
  stream st;
  std::size_t total = 0;
  for (auto n : sizes) total += n;
  const auto hx0 = random_floats(total, 1), hx1 = random_floats(total, 2);
  // pad 0: the tensors at offsets that are multiples of 4 take the float4
  // path; pad 1: every tensor starts one float in, unaligned, and none does.
  for (std::size_t pad : {0, 1})
  for (bool measure_step : {false, true}) {
    CAPTURE(pad);
    CAPTURE(measure_step);
    device_floats x(total + 1);
    std::vector<float> padded(total + 1, 0.0f);
    std::copy(hx0.begin(), hx0.end(), padded.begin() + static_cast<std::ptrdiff_t>(pad));
    x.upload(padded);
    std::vector<tensor_slot> slots;
    std::size_t off = 0;
    for (auto n : sizes) {
      slots.push_back({x.p + pad + off, n, off});
      off += n;
    }
    device_setup s;
    s.tensors = slots;
    s.elements = total;
    s.message_bytes = sizeof(wire_header) + total * sizeof(float);
    s.measure_step = measure_step;
    auto backend = cuda::device(st.s, {.transfer = "staged"});
    auto model = backend->make(s);
    model->snapshot(model->send_storage() + sizeof(wire_header));  // x̂ ← x0 (and x_{t-1} ← x0 at setup)
    std::copy(hx1.begin(), hx1.end(), padded.begin() + static_cast<std::ptrdiff_t>(pad));
    x.upload(padded);

    std::vector<tensor_drift> got(sizes.size());
    double step = -1;
    model->drift(got, step, nullptr);
    std::vector<float> prev(hx0);
    double want_step = 0;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const auto& sl = slots[t];
      const drift_sums want = drift_pass(hx1.data() + sl.offset, hx0.data() + sl.offset, prev.data() + sl.offset, sl.count);
      INFO("tensor ", t, " of ", sl.count, " elements");
      CHECK(close(got[t].diff_sq, want.diff_sq, sum_tolerance));
      CHECK(close(got[t].ref_sq, want.ref_sq, sum_tolerance));
      want_step += want.step_sq;
    }
    if (measure_step)
      CHECK(close(step, want_step, sum_tolerance));
    else
      CHECK(step == 0.0);
    // Again with x back at x̂: each tensor's block counter was re-armed by the
    // first pass (else no block would write new sums), partials are added in
    // block order, so Σx̂² repeats bit for bit; with x_{t-1} (= x1 since the
    // first pass) the step is now Σ(x0 − x1)², the first pass's drift.
    std::copy(hx0.begin(), hx0.end(), padded.begin() + static_cast<std::ptrdiff_t>(pad));
    x.upload(padded);
    std::vector<tensor_drift> again(sizes.size());
    double step_again = -1, drift_before = 0;
    model->drift(again, step_again, nullptr);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      INFO("tensor ", t);
      CHECK(again[t].diff_sq == 0.0);
      CHECK(again[t].ref_sq == got[t].ref_sq);
      drift_before += got[t].diff_sq;
    }
    if (measure_step)
      CHECK(close(step_again, drift_before, sum_tolerance));
    else
      CHECK(step_again == 0.0);
  }
}

TEST_CASE("staged snapshot: the pinned payload is x bit for bit, and x̂ follows") {
  stream st;
  const std::size_t n = 3 * 4096 + 5;
  device_floats x(n);
  const auto hx = random_floats(n, 3);
  x.upload(hx);
  const tensor_slot slot{x.p, n, 0};
  device_setup s;
  s.tensors = {&slot, 1};
  s.elements = n;
  s.message_bytes = (sizeof(wire_header) + n * sizeof(float) + 63) / 64 * 64;
  s.send_buffers = 2;
  auto model = cuda::device(st.s)->make(s);
  CHECK_FALSE(model->direct());  // loopback-like setup: the transport takes host memory only
  std::byte* second = model->send_storage() + s.message_bytes + sizeof(wire_header);
  model->snapshot(second);
  CHECK(std::memcmp(second, hx.data(), n * sizeof(float)) == 0);
  tensor_drift d{};
  double step = 0;
  model->drift({&d, 1}, step, nullptr);
  CHECK(d.diff_sq == 0.0);
  double ref = 0;
  for (float v : hx) ref += static_cast<double>(v) * v;
  CHECK(close(d.ref_sq, ref, sum_tolerance));
  CHECK_THROWS_AS(cuda::device(st.s, {.transfer = "direct"})->make(s), config_error);
}

TEST_CASE("merge kernel: x ← a·x + Σ b_j·m_j over batches of received payloads") {
  stream st;
  const std::size_t n = 10000;
  device_floats x(n);
  const auto hx = random_floats(n, 4);
  x.upload(hx);
  const tensor_slot slots[2] = {{x.p, 6000, 0}, {x.p + 6000, 4000, 6000}};
  std::vector<std::vector<float>> payloads;
  std::vector<received> msgs;
  for (int j = 0; j < 3; ++j) payloads.push_back(random_floats(n, 10 + j));
  for (int j = 0; j < 3; ++j) msgs.push_back({j, 0, 0.5, payloads[static_cast<std::size_t>(j)].data(), n});
  device_setup s;
  s.tensors = slots;
  s.elements = n;
  s.message_bytes = sizeof(wire_header) + n * sizeof(float);
  s.max_merge = 3;
  auto model = cuda::device(st.s, {.merge_batch = 2})->make(s);  // two batches: 2 + 1
  const double a = 0.25, b[3] = {0.5, 0.125, 0.125};
  model->merge(a, b, msgs);
  const auto got = x.download();
  for (std::size_t i = 0; i < n; i += 97) {
    const double want = a * hx[i] + b[0] * payloads[0][i] + b[1] * payloads[1][i] + b[2] * payloads[2][i];
    REQUIRE(std::abs(got[i] - want) <= 1e-6 * (1 + std::abs(want)));
  }
}

TEST_CASE("engine steps on device tensors match the host engine (push-sum and pairwise, loopback)") {
  for (const char* proto : {"push-sum", "pairwise"}) {
    CAPTURE(proto);
    const int world = 4, steps = 30;
    const std::vector<std::size_t> shape = {300, 4097, 20};
    std::vector<std::vector<float>> host_final(world), device_final(world);
    std::vector<double> host_weight(world), device_weight(world);
    for (bool on_device : {false, true}) {
      loopback_fabric fabric(world);
      test::run_ranks(world, [&](int r) {
        test::toy_model m(shape, 100 + static_cast<std::uint64_t>(r));
        stream st;
        std::vector<std::unique_ptr<device_floats>> dev;
        model_view view;
        if (on_device) {
          for (std::size_t i = 0; i < shape.size(); ++i) {
            dev.push_back(std::make_unique<device_floats>(shape[i]));
            dev.back()->upload(m.tensors[i]);
            view.add(fmt::format("t{}", i), {dev.back()->p, shape[i]}, memory_kind::cuda);
          }
          view.on_device(cuda::device(st.s));
        } else {
          view = m.view;
        }
        auto spec = test::spec_of(policy_registry().make("periodic", options("t")), "exponential", proto);
        engine e(view, r, world, std::move(spec), fabric.endpoint(r));
        for (int t = 0; t < steps; ++t) {
          // The same local update on both: x += 0.01·(r + 1) on the first tensor.
          if (on_device) {
            auto h = dev[0]->download();
            for (auto& v : h) v += 0.01f * static_cast<float>(r + 1);
            cuda_ok(cudaMemcpyAsync(dev[0]->p, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice, st.s));
            cuda_ok(cudaStreamSynchronize(st.s));
          } else {
            for (auto& v : m.tensors[0]) v += 0.01f * static_cast<float>(r + 1);
          }
          e.step({.lr = 0.1});
        }
        e.flush();
        std::vector<float> flat;
        for (std::size_t i = 0; i < shape.size(); ++i) {
          const auto h = on_device ? dev[i]->download() : m.tensors[i];
          flat.insert(flat.end(), h.begin(), h.end());
        }
        (on_device ? device_final : host_final)[static_cast<std::size_t>(r)] = flat;
        (on_device ? device_weight : host_weight)[static_cast<std::size_t>(r)] = e.weight();
        CHECK(e.stats().sends > 0);
        CHECK(e.stats().device == (on_device ? "cuda" : "host"));
      });
    }
    for (int r = 0; r < world; ++r) {
      INFO("rank ", r);
      CHECK(device_weight[static_cast<std::size_t>(r)] == doctest::Approx(host_weight[static_cast<std::size_t>(r)]).epsilon(1e-12));
      const auto& h = host_final[static_cast<std::size_t>(r)];
      const auto& d = device_final[static_cast<std::size_t>(r)];
      REQUIRE(h.size() == d.size());
      double worst = 0;
      for (std::size_t i = 0; i < h.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(h[i] - d[i])));
      CHECK(worst <= 1e-5);  // the same merges, applied as one linear combination instead of in sequence
    }
  }
}

TEST_CASE("quasi-global momentum on device tensors matches the host engine (spread and full merges, loopback)") {
  using mm = engine_settings::merge_momentum;
  for (const mm merge : {mm::spread, mm::full}) {
    CAPTURE(merge == mm::full);
    const int world = 4, steps = 24;
    const float lr = 0.05f, beta = 0.9f;
    const std::vector<std::size_t> shape = {300, 4097, 20};
    std::vector<std::vector<float>> host_final(world), device_final(world);
    std::vector<std::string> momentum_of(2 * world);
    for (bool on_device : {false, true}) {
      loopback_fabric fabric(world);
      test::run_ranks(world, [&](int r) {
        test::toy_model m(shape, 200 + static_cast<std::uint64_t>(r));
        std::vector<std::vector<float>> velocity;
        for (std::size_t n : shape) velocity.emplace_back(n, 0.0f);
        stream st;
        std::vector<std::unique_ptr<device_floats>> dev, dev_v;
        model_view view;
        for (std::size_t i = 0; i < shape.size(); ++i) {
          const auto name = fmt::format("t{}", i);
          if (on_device) {
            dev.push_back(std::make_unique<device_floats>(shape[i]));
            dev.back()->upload(m.tensors[i]);
            dev_v.push_back(std::make_unique<device_floats>(shape[i]));
            dev_v.back()->upload(velocity[i]);
            view.add(name, {dev.back()->p, shape[i]}, memory_kind::cuda).momentum(name, {dev_v.back()->p, shape[i]});
          } else {
            view.add(name, m.tensors[i]).momentum(name, velocity[i]);
          }
        }
        if (on_device) view.on_device(cuda::device(st.s));
        // every 3 steps: spread merges under auto for a fixed schedule, or full when asked
        auto spec = test::spec_of(policy_registry().make("periodic", options("t").set("every", std::int64_t{3})), "exponential");
        spec.settings.momentum_merge = merge;
        spec.settings.momentum_beta = beta;
        engine e(view, r, world, std::move(spec), fabric.endpoint(r));
        for (int t = 0; t < steps; ++t) {
          // Heavy-ball SGD on the host, as torch.optim.SGD: v ← β·v + g, x ← x − lr·v,
          // with g = x − c_r (each rank pulls towards its own point).
          for (std::size_t i = 0; i < shape.size(); ++i) {
            auto x = on_device ? dev[i]->download() : m.tensors[i];
            auto v = on_device ? dev_v[i]->download() : velocity[i];
            for (std::size_t k = 0; k < x.size(); ++k) {
              const float g = x[k] - 0.1f * static_cast<float>(r + 1);
              v[k] = beta * v[k] + g;
              x[k] -= lr * v[k];
            }
            if (on_device) {
              cuda_ok(cudaMemcpyAsync(dev[i]->p, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice, st.s));
              cuda_ok(cudaMemcpyAsync(dev_v[i]->p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice, st.s));
              cuda_ok(cudaStreamSynchronize(st.s));
            } else {
              m.tensors[i] = x;
              velocity[i] = v;
            }
          }
          e.step({.lr = lr});
        }
        e.flush();
        std::vector<float> flat;
        for (std::size_t i = 0; i < shape.size(); ++i) {
          const auto x = on_device ? dev[i]->download() : m.tensors[i];
          const auto v = on_device ? dev_v[i]->download() : velocity[i];
          flat.insert(flat.end(), x.begin(), x.end());
          flat.insert(flat.end(), v.begin(), v.end());
        }
        (on_device ? device_final : host_final)[static_cast<std::size_t>(r)] = flat;
        momentum_of[static_cast<std::size_t>(r + (on_device ? world : 0))] = e.stats().momentum + "/" + e.stats().momentum_merge;
      });
    }
    const std::string want = merge == mm::full ? "quasi-global/full" : "quasi-global/spread";
    for (int r = 0; r < world; ++r) {
      INFO("rank ", r);
      CHECK(momentum_of[static_cast<std::size_t>(r)] == want);
      CHECK(momentum_of[static_cast<std::size_t>(r + world)] == want);
      const auto& h = host_final[static_cast<std::size_t>(r)];
      const auto& d = device_final[static_cast<std::size_t>(r)];
      REQUIRE(h.size() == d.size());
      double worst = 0, scale = 0;
      for (std::size_t i = 0; i < h.size(); ++i) {
        worst = std::max(worst, static_cast<double>(std::abs(h[i] - d[i])));
        scale = std::max(scale, static_cast<double>(std::abs(h[i])));
      }
      CHECK(worst <= 1e-4 * (1 + scale));  // parameters and momentum buffers, after merges carried on in momentum
    }
  }
}

int main(int argc, char** argv) {
  doctest::Context ctx(argc, argv);
  const std::string why = cuda::unavailable_reason();
  if (!why.empty()) ctx.setOption("test-suite", "host");
  const int failed = ctx.run();
  if (failed || ctx.shouldExit()) return failed;
  if (!why.empty()) {
    std::printf("SKIP: the device tests need a CUDA GPU: %s (the host-side checks above passed)\n", why.c_str());
    return 77;
  }
  return 0;
}

// bench/drift, device half: the fused drift kernel through the same
// device_model an engine uses, against a device-to-device copy.
#include "drift/device.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include "gossip/cuda.hpp"
#include "gossip/error.hpp"

namespace gossip::bench {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw error(fmt::format("bench/drift: {} failed: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

struct device_floats {
  explicit device_floats(std::size_t n) { check(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(float)), "cudaMalloc"); }
  ~device_floats() { cudaFree(p); }
  device_floats(const device_floats&) = delete;
  device_floats& operator=(const device_floats&) = delete;
  float* p = nullptr;
};

}  // namespace

std::string device_unavailable() { return cuda::unavailable_reason(); }

drift_run device_run(std::size_t n, const drift_bench_settings& s) {
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  struct stream_guard {
    cudaStream_t s;
    ~stream_guard() { cudaStreamDestroy(s); }
  } guard{stream};

  // x as one tensor; x̂ is the backend's own copy, set from `ref` by a first snapshot.
  std::vector<float> hx(n), href(n);
  std::mt19937_64 g(n);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    href[i] = u(g);
    hx[i] = href[i] + 0.01f * u(g);
  }
  device_floats x(n), dst(n);
  // cudaMemcpy from pageable memory may return before its DMA lands, and
  // `stream` does not wait for the legacy stream: synchronize before kernels on it read x.
  check(cudaMemcpy(x.p, href.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  const auto backend = cuda::device(stream, {.transfer = "staged"});
  const tensor_slot slot{x.p, n, 0};
  device_setup setup;
  setup.tensors = {&slot, 1};
  setup.elements = n;
  setup.message_bytes = sizeof(wire_header) + n * sizeof(float);
  auto model = backend->make(setup);
  model->snapshot(model->send_storage() + sizeof(wire_header));  // x̂ ← ref
  check(cudaMemcpy(x.p, hx.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  double want_diff = 0, want_ref = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(hx[i]) - static_cast<double>(href[i]);
    want_diff += d * d;
    want_ref += static_cast<double>(href[i]) * static_cast<double>(href[i]);
  }
  tensor_drift got{};
  double step = 0;
  model->drift({&got, 1}, step, nullptr);
  auto close = [&](double a, double b) { return std::abs(a - b) <= s.tolerance * std::max(std::abs(b), 1e-30); };
  if (!close(got.diff_sq, want_diff) || !close(got.ref_sq, want_ref))
    throw error(fmt::format("bench/drift: device drift kernel is wrong at {} elements: ‖x − x̂‖² = {} (reference {}), ‖x̂‖² = {} "
                            "(reference {})",
                            n, got.diff_sq, want_diff, got.ref_sq, want_ref));

  using clock = std::chrono::steady_clock;
  auto best = [&](auto&& f) {
    double t = 1e300;
    int reps = 0;
    const auto stop = clock::now() + std::chrono::duration<double>(s.seconds_per_size);
    do {
      const auto t0 = clock::now();
      f();
      t = std::min(t, std::chrono::duration<double>(clock::now() - t0).count());
      ++reps;
    } while (reps < 3 || clock::now() < stop);
    return std::pair{t, reps};
  };
  const auto [t_drift, reps] = best([&] { model->drift({&got, 1}, step, nullptr); });
  const auto [t_copy, copy_reps] = best([&] {
    check(cudaMemcpyAsync(dst.p, x.p, n * sizeof(float), cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  });
  const double bytes = static_cast<double>(n * sizeof(float));
  drift_run r{"device", "warm", n, bytes / t_drift / 1e9, bytes / t_copy / 1e9, 0, std::min(reps, copy_reps)};
  r.ratio = r.drift_gbps / r.copy_gbps;
  return r;
}

}  // namespace gossip::bench

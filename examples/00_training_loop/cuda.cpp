// The loop of loopback.cpp with the model in GPU memory: two workers as
// threads, each ordering its work on its own CUDA stream.
// Build: c++ -std=c++20 cuda.cpp $(pkg-config --cflags --libs gossip-cuda)
// Without a usable GPU it prints why and exits with status 77, as a skipped
// test does.
#include <atomic>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <cuda_runtime.h>
#include <gossip/cuda.hpp>
#include <gossip/gossip.hpp>

int main(int argc, char** argv) try {
  if (argc > 2 || (argc == 2 && argv[1][0] == '-')) {
    fmt::print(stderr, "usage: {} [config.toml]\n", argv[0]);
    return 2;
  }
  if (!gossip::cuda::available()) {
    fmt::print(stderr, "{}: no usable CUDA GPU here ({}); loopback.cpp runs the same loop on the CPU\n", argv[0],
               gossip::cuda::unavailable_reason());
    return 77;
  }
  const int world = 2, steps = 300;
  const std::size_t n = 16;
  const auto spec = gossip::engine_spec::from(argc > 1 ? gossip::config::load(argv[1]) : gossip::config{});
  gossip::loopback_fabric fabric(world);

  // A CUDA call that failed ends this worker with its name and error.
  auto cuda_check = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw gossip::error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
  };
  std::atomic<int> failed{0};
  auto worker = [&](int rank) {
    cudaStream_t stream = nullptr;
    try {
      cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
      auto alloc = [&](std::size_t count) {
        float* p = nullptr;
        cuda_check(cudaMalloc(&p, count * sizeof(float)), "cudaMalloc");
        std::unique_ptr<float, cudaError_t (*)(void*)> owned(p, cudaFree);
        cuda_check(cudaMemsetAsync(p, 0, count * sizeof(float), stream), "cudaMemsetAsync");
        return owned;
      };
      auto w_mem = alloc(n), b_mem = alloc(1);  // freed after the engine below
      float *d_w = w_mem.get(), *d_b = b_mem.get();
      gossip::model_view model;
      model.add("w", {d_w, n}, gossip::memory_kind::cuda).add("b", {d_b, 1}, gossip::memory_kind::cuda);
      model.on_device(gossip::cuda::device(stream));  // the engine's passes run on this stream
      gossip::engine eng(model, rank, world, spec, fabric.endpoint(rank));

      std::mt19937 rng(rank);
      std::normal_distribution<float> normal;
      std::vector<float> w(n), b(1), x(n);
      for (int t = 0; t < steps; ++t) {
        // A real loop launches its forward, backward and update kernels on `stream`;
        // this one updates a host copy and puts it back, on the same stream.
        cuda_check(cudaMemcpyAsync(w.data(), d_w, n * sizeof(float), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
        cuda_check(cudaMemcpyAsync(b.data(), d_b, sizeof(float), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
        cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        float y = static_cast<float>(rank), pred = b[0];
        for (std::size_t i = 0; i < n; ++i) x[i] = normal(rng), y += x[i], pred += w[i] * x[i];
        const float err = pred - y, lr = 0.02f;
        for (std::size_t i = 0; i < n; ++i) w[i] -= lr * err * x[i];
        b[0] -= lr * err;
        cuda_check(cudaMemcpyAsync(d_w, w.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
        cuda_check(cudaMemcpyAsync(d_b, b.data(), sizeof(float), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
        eng.step({.lr = lr, .loss = 0.5 * err * err});  // drift, snapshot and merge kernels on `stream`
      }
      eng.finish();
      cuda_check(cudaMemcpyAsync(b.data(), d_b, sizeof(float), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
      cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      fmt::print("rank {}: b = {:.2f} (its data alone: {}, all data: 0.5), {} bytes sent\n", rank, b[0], rank, eng.stats().bytes_sent);
    } catch (const gossip::error& e) {  // this worker's engine or CUDA call
      fmt::print(stderr, "rank {}: error: {}\n", rank, e.what());
      failed = 1;
    }
    if (stream) cudaStreamDestroy(stream);  // after the engine and the buffers, which used it
  };
  std::vector<std::jthread> ranks;
  for (int r = 0; r < world; ++r) ranks.emplace_back(worker, r);
  ranks.clear();  // joins
  return failed;
} catch (const gossip::error& e) {
  fmt::print(stderr, "error: {}\n", e.what());
  return 1;
}

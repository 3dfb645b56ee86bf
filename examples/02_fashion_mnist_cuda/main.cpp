// Decentralized training of the Fashion-MNIST MLP on the GPU, with
// drift-triggered gossip between workers.
//
//   fashion_mnist_cuda --config examples/01_fashion_mnist/fashion_mnist.toml
//   fashion_mnist_cuda --policy periodic --workers 2 --epochs 1 --set train.train_limit=4000
//
// The same config, training loop and report as examples/01_fashion_mnist
// (examples/common/trainer.hpp) and the same model; only where the model lives
// differs. Workers are threads over the loopback transport, each with its own
// CUDA stream and cuBLAS handle on the current GPU. Parameters, gradients,
// momentum and activations stay in device memory; the engine measures drift
// and snapshots with its CUDA kernels on the worker's stream and stages sends
// through pinned host buffers. Models are evaluated on the host at each epoch
// end (the CPU MLP of examples/common reads the same parameter layout).
//
// Without a usable GPU it prints why and exits with status 77.
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/fashion_mnist_app.hpp"
#include "gossip/cuda.hpp"
#include "gossip_build_config.hpp"
#include "kernels.hpp"

namespace {

using namespace gossip;
using namespace gossip::examples;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw error(fmt::format("fashion_mnist_cuda: {} failed: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}
void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw error(fmt::format("fashion_mnist_cuda: {} failed: cuBLAS status {}", what, static_cast<int>(s)));
}

template <class T>
class device_array {
 public:
  explicit device_array(std::size_t n) : m_n(n) { cuda_check(cudaMalloc(&m_p, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc"); }
  ~device_array() { cudaFree(m_p); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  T* data() const noexcept { return m_p; }
  std::size_t size() const noexcept { return m_n; }

 private:
  T* m_p = nullptr;
  std::size_t m_n;
};

template <class T>
class pinned_array {
 public:
  explicit pinned_array(std::size_t n) { cuda_check(cudaMallocHost(&m_p, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMallocHost"); }
  ~pinned_array() { cudaFreeHost(m_p); }
  pinned_array(const pinned_array&) = delete;
  pinned_array& operator=(const pinned_array&) = delete;
  T* data() const noexcept { return m_p; }

 private:
  T* m_p = nullptr;
};

/// The MLP of examples/common/mlp.hpp with everything in device memory:
/// parameters in one buffer in the same layout (layer l: out x in weight,
/// column-major, then out biases), cuBLAS for the products.
class gpu_mlp {
 public:
  gpu_mlp(const mlp& host, int max_batch, cudaStream_t stream)
      : m_stream(stream), m_params(host.param_count()), m_grads(host.param_count()), m_velocity(host.param_count()),
        m_loss(static_cast<std::size_t>(max_batch)) {
    cublas_check(cublasCreate(&m_blas), "cublasCreate");
    cublas_check(cublasSetStream(m_blas, m_stream), "cublasSetStream");
    int in = host.config().inputs;
    std::size_t off = 0;
    std::vector<int> outs = host.config().hidden;
    outs.push_back(host.config().classes);
    for (int out : outs) {
      m_layers.push_back({in, out, off, off + static_cast<std::size_t>(in) * static_cast<std::size_t>(out)});
      off = m_layers.back().b_off + static_cast<std::size_t>(out);
      m_act.push_back(std::make_unique<device_array<float>>(static_cast<std::size_t>(out) * static_cast<std::size_t>(max_batch)));
      m_delta.push_back(std::make_unique<device_array<float>>(static_cast<std::size_t>(out) * static_cast<std::size_t>(max_batch)));
      in = out;
    }
    GOSSIP_ASSERT(off == host.param_count(), "layout of {} floats, host MLP has {}", off, host.param_count());
    cuda_check(cudaMemcpyAsync(m_params.data(), host.params().data(), off * sizeof(float), cudaMemcpyHostToDevice, m_stream), "upload");
    cuda_check(cudaMemsetAsync(m_velocity.data(), 0, off * sizeof(float), m_stream), "cudaMemsetAsync");
    m_tensors = host.tensors();
  }
  ~gpu_mlp() { cublasDestroy(m_blas); }
  gpu_mlp(const gpu_mlp&) = delete;
  gpu_mlp& operator=(const gpu_mlp&) = delete;

  /// The parameters as named device tensors of a model view, each with its
  /// momentum buffer (the engine may make it quasi-global: [engine] momentum).
  void register_tensors(model_view& view) {
    for (const auto& t : m_tensors)
      view.add(t.name, {m_params.data() + t.offset, t.count}, memory_kind::cuda)
          .momentum(t.name, {m_velocity.data() + t.offset, t.count});
  }

  /// Forward, softmax cross-entropy, backward and an SGD step, all queued on
  /// the stream; per-sample losses go to loss() (device memory).
  void train_step(const float* x, const std::uint8_t* y, int batch, const sgd_momentum& opt) {
    const float one = 1.0f, zero = 0.0f;
    const float* a = x;
    for (std::size_t l = 0; l < m_layers.size(); ++l) {
      const auto& L = m_layers[l];
      cublas_check(cublasSgemm(m_blas, CUBLAS_OP_N, CUBLAS_OP_N, L.out, batch, L.in, &one, m_params.data() + L.w_off, L.out, a, L.in, &zero,
                               m_act[l]->data(), L.out),
                   "cublasSgemm (forward)");
      gpu::bias_activation(m_act[l]->data(), m_params.data() + L.b_off, L.out, batch, l + 1 < m_layers.size(), m_stream);
      a = m_act[l]->data();
    }
    const auto& last = m_layers.back();
    gpu::softmax_xent(m_act.back()->data(), y, m_delta.back()->data(), m_loss.data(), last.out, batch, m_stream);
    for (std::size_t l = m_layers.size(); l-- > 0;) {
      const auto& L = m_layers[l];
      const float* prev = l == 0 ? x : m_act[l - 1]->data();
      cublas_check(cublasSgemm(m_blas, CUBLAS_OP_N, CUBLAS_OP_T, L.out, L.in, batch, &one, m_delta[l]->data(), L.out, prev, L.in, &zero,
                               m_grads.data() + L.w_off, L.out),
                   "cublasSgemm (weight gradient)");
      gpu::row_sum(m_delta[l]->data(), m_grads.data() + L.b_off, L.out, batch, m_stream);
      if (l > 0) {
        cublas_check(cublasSgemm(m_blas, CUBLAS_OP_T, CUBLAS_OP_N, L.in, batch, L.out, &one, m_params.data() + L.w_off, L.out,
                                 m_delta[l]->data(), L.out, &zero, m_delta[l - 1]->data(), L.in),
                     "cublasSgemm (backward)");
        gpu::relu_backward(m_delta[l - 1]->data(), m_act[l - 1]->data(), static_cast<std::size_t>(L.in) * static_cast<std::size_t>(batch),
                           m_stream);
      }
    }
    gpu::sgd_momentum(m_params.data(), m_velocity.data(), m_grads.data(), m_params.size(), opt.lr, opt.momentum, opt.weight_decay, m_stream);
    cuda_check(cudaGetLastError(), "kernel launch");
  }

  const float* loss() const noexcept { return m_loss.data(); }
  void download(std::vector<float>& out) {
    out.resize(m_params.size());
    cuda_check(cudaMemcpyAsync(out.data(), m_params.data(), out.size() * sizeof(float), cudaMemcpyDeviceToHost, m_stream), "download");
    cuda_check(cudaStreamSynchronize(m_stream), "cudaStreamSynchronize");
  }

 private:
  struct layer {
    int in = 0, out = 0;
    std::size_t w_off = 0, b_off = 0;
  };
  cudaStream_t m_stream;
  cublasHandle_t m_blas = nullptr;
  std::vector<layer> m_layers;
  std::vector<tensor_slice> m_tensors;
  device_array<float> m_params, m_grads, m_velocity, m_loss;
  std::vector<std::unique_ptr<device_array<float>>> m_act, m_delta;
};

/// One worker's model for the common training loop (see mlp_factory): the
/// MLP in device memory on a stream of its own, fed from pinned host buffers,
/// evaluated on the host.
class gpu_net {
 public:
  static constexpr bool on_device = true;

  gpu_net(const mlp_config& arch, std::uint64_t seed, int device)
      : m_host(arch), m_features(static_cast<std::size_t>(arch.inputs)), m_stream(device), m_x(static_cast<std::size_t>(arch.max_batch) * static_cast<std::size_t>(arch.inputs)),
        m_y(static_cast<std::size_t>(arch.max_batch)), m_loss(static_cast<std::size_t>(arch.max_batch)),
        m_dx(static_cast<std::size_t>(arch.max_batch) * static_cast<std::size_t>(arch.inputs)), m_dy(static_cast<std::size_t>(arch.max_batch)) {
    m_host.init(seed);  // a common initial model on every worker
    m_net = std::make_unique<gpu_mlp>(m_host, arch.max_batch, m_stream.s);
  }

  void register_tensors(model_view& view) {
    m_net->register_tensors(view);
    view.on_device(cuda::device(m_stream.s));
  }

  /// One step on a host batch: uploaded through pinned memory, trained on the
  /// stream; returns the mean loss once the stream has it.
  float train_batch(const float* x, const std::uint8_t* y, int batch, sgd_momentum& opt) {
    const auto b = static_cast<std::size_t>(batch);
    // The previous step's uploads are done: train_batch waited for the stream.
    std::memcpy(m_x.data(), x, b * m_features * sizeof(float));
    std::memcpy(m_y.data(), y, b);
    cuda_check(cudaMemcpyAsync(m_dx.data(), m_x.data(), b * m_features * sizeof(float), cudaMemcpyHostToDevice, m_stream.s), "upload batch");
    cuda_check(cudaMemcpyAsync(m_dy.data(), m_y.data(), b, cudaMemcpyHostToDevice, m_stream.s), "upload labels");
    m_net->train_step(m_dx.data(), m_dy.data(), batch, opt);
    cuda_check(cudaMemcpyAsync(m_loss.data(), m_net->loss(), b * sizeof(float), cudaMemcpyDeviceToHost, m_stream.s), "download loss");
    cuda_check(cudaStreamSynchronize(m_stream.s), "cudaStreamSynchronize");
    double l = 0;
    for (std::size_t j = 0; j < b; ++j) l += m_loss.data()[j];
    return static_cast<float>(l / batch);
  }

  void download(std::vector<float>& out) { m_net->download(out); }

  double accuracy(const float* x, const std::uint8_t* y, std::size_t n) {
    download(m_eval);
    return m_host.accuracy_of(m_eval, x, y, n);
  }
  double accuracy_of(std::span<const float> params, const float* x, const std::uint8_t* y, std::size_t n) const {
    return m_host.accuracy_of(params, x, y, n);
  }

 private:
  /// This worker's stream, on `device` (made current for the worker's thread).
  struct stream_owner {
    cudaStream_t s = nullptr;
    explicit stream_owner(int device) {
      cuda_check(cudaSetDevice(device), "cudaSetDevice");
      cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    }
    stream_owner(const stream_owner&) = delete;
    stream_owner& operator=(const stream_owner&) = delete;
    ~stream_owner() { cudaStreamDestroy(s); }
  };

  mlp m_host;
  std::size_t m_features;
  stream_owner m_stream;  // outlives the buffers and the cuBLAS handle bound to it
  pinned_array<float> m_x;
  pinned_array<std::uint8_t> m_y;
  pinned_array<float> m_loss;
  device_array<float> m_dx;
  device_array<std::uint8_t> m_dy;
  std::unique_ptr<gpu_mlp> m_net;
  std::vector<float> m_eval;
};

/// The common loop's factory for gpu_net, on the GPU that was current when it was made.
struct gpu_factory {
  int device = 0;

  gpu_net operator()(const train_settings& s, const datasets& data) const {
    return gpu_net(mlp_config{.inputs = static_cast<int>(data.train.features()), .hidden = s.hidden, .classes = 10, .max_batch = s.batch},
                   s.seed, device);
  }

  /// What this example does not do on the GPU.
  void check(const config& cfg, const train_settings& s) const {
    if (cfg.transport.name != "loopback")
      throw config_error(fmt::format("{} [transport]: name '{}' is not available in this example; it runs its workers as threads sharing "
                                     "one GPU over 'loopback'",
                                     cfg.source, cfg.transport.name));
    if (s.average_every > 0 || s.outer_lr != 1.0 || s.outer_momentum != 0.0 || s.probe_every > 0)
      throw config_error(fmt::format("{} [train]: local SGD, the outer optimizer and probes (average_every, outer_lr, outer_momentum, "
                                     "probe_every) read host parameters and are not available in this example; use examples/01_fashion_mnist",
                                     cfg.source));
  }
};

}  // namespace

int main(int argc, char** argv) {
  gpu_factory factory;
  std::string device_name;
  app_hooks hooks;
  hooks.ready = [&](std::string& title) -> std::optional<int> {
    if (const auto why = cuda::unavailable_reason(); !why.empty()) {
      fmt::print(stderr,
                 "fashion_mnist_cuda: no usable CUDA GPU here ({}).\n"
                 "This example trains on the GPU; examples/01_fashion_mnist (fashion_mnist) trains the same model on the CPU.\n",
                 why);
      return 77;
    }
    try {
      cudaDeviceProp prop{};
      cuda_check(cudaGetDevice(&factory.device), "cudaGetDevice");
      cuda_check(cudaGetDeviceProperties(&prop, factory.device), "cudaGetDeviceProperties");
      device_name = prop.name;
    } catch (const gossip::error& e) {
      fmt::print(stderr, "error: {}\n", e.what());
      return 1;
    }
    title = fmt::format("{} on {} (GPU {})", title, device_name, factory.device);
    return std::nullopt;
  };
  hooks.annotate = [&](nlohmann::json& j) { j["device"] = device_name; };
  return fashion_mnist_main(argc, argv, "Train an MLP on Fashion-MNIST on the GPU across workers that gossip only when their model drifted.",
                            "Fashion-MNIST", factory, hooks);
}

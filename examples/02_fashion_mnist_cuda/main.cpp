// Decentralized training of the Fashion-MNIST MLP on the GPU, with
// drift-triggered gossip between workers.
//
//   fashion_mnist_cuda --config examples/01_fashion_mnist/fashion_mnist.toml
//   fashion_mnist_cuda --policy periodic --workers 2 --epochs 1 --set train.train_limit=4000
//
// The same config as examples/01_fashion_mnist ([policy], [topology],
// [protocol], [transport], [engine], [train]) and the same model: workers are
// threads over the loopback transport, each with its own CUDA stream and cuBLAS
// handle on the current GPU. Parameters, gradients and activations stay in
// device memory; the engine measures drift and snapshots with its CUDA kernels
// on the worker's stream and stages sends through pinned host buffers. The
// average model is evaluated on the host at each epoch end (the CPU MLP of
// examples/common reads the same parameter layout).
//
// Without a usable GPU it prints why and exits with status 77.
#include <barrier>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <ranges>
#include <thread>

#include <CLI/CLI.hpp>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/trainer.hpp"
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

  /// The parameters as named device tensors of a model view.
  void register_tensors(model_view& view) {
    for (const auto& t : m_tensors) view.add(t.name, {m_params.data() + t.offset, t.count}, memory_kind::cuda);
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

run_report train_gpu(const config& cfg, const train_settings& s, const datasets& data,
                     const std::function<void(const epoch_record&)>& on_epoch) {
  const int world = s.workers;
  if (cfg.transport.name != "loopback")
    throw config_error(fmt::format("{} [transport]: name '{}' is not available in this example; it runs its workers as threads over "
                                   "'loopback'", cfg.source, cfg.transport.name));
  const auto link_opts = cfg.transport.opts.resolved(loopback_option_specs(), "transport 'loopback'");
  loopback_fabric fabric(world, {.bandwidth_gbps = link_opts.real("bandwidth_gbps"), .latency_us = link_opts.real("latency_us")});
  const engine_spec base = engine_spec::from(cfg);
  if (s.average_every > 0 || s.outer_lr != 1.0 || s.outer_momentum != 0.0)
    throw config_error(fmt::format("{} [train]: local SGD and the outer optimizer (average_every, outer_lr, outer_momentum) are not "
                                   "available in this example; use examples/01_fashion_mnist",
                                   cfg.source));
  const auto shards = data::partition(data.train, world, s.partition, s.seed, s.partition_opts());
  const int steps_per_epoch = examples::detail::steps_per_epoch(cfg, s, shards);
  const std::int64_t total_steps = static_cast<std::int64_t>(steps_per_epoch) * s.epochs;
  const mlp_config arch{.inputs = static_cast<int>(data.train.features()), .hidden = s.hidden, .classes = 10, .max_batch = s.batch};
  const std::size_t features = data.train.features();

  run_report report;
  report.epochs.resize(static_cast<std::size_t>(s.epochs));
  std::vector<engine_stats> final_stats(static_cast<std::size_t>(world));
  std::vector<std::vector<float>> params(static_cast<std::size_t>(world));
  std::vector<double> weights(static_cast<std::size_t>(world)), local_acc(static_cast<std::size_t>(world)),
      epoch_loss(static_cast<std::size_t>(world));
  std::vector<engine_stats> snapshot(static_cast<std::size_t>(world));
  double train_seconds = 0;
  auto phase_start = std::chrono::steady_clock::now();
  const auto wall_start = phase_start;
  std::barrier sync(world);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");

  auto worker = [&](int r) {
    const auto ri = static_cast<std::size_t>(r);
    try {
      cuda_check(cudaSetDevice(device), "cudaSetDevice");
      cudaStream_t stream = nullptr;
      cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
      struct stream_guard {
        cudaStream_t s;
        ~stream_guard() { cudaStreamDestroy(s); }
      } guard{stream};
      mlp host(arch);
      host.init(s.seed);  // a common initial model on every worker
      gpu_mlp net(host, s.batch, stream);
      model_view view;
      net.register_tensors(view);
      view.on_device(cuda::device(stream));
      engine eng(view, r, world, engine_spec(base), fabric.endpoint(r));
      sgd_momentum opt{.lr = static_cast<float>(s.lr), .momentum = static_cast<float>(s.momentum),
                       .weight_decay = static_cast<float>(s.weight_decay)};
      lr_schedule sched{.type = s.schedule, .base = static_cast<float>(s.lr), .warmup_steps = s.warmup_steps};
      batch_stream batches(shards[ri], s.seed * 1000003u + static_cast<std::uint64_t>(r));
      std::vector<std::uint32_t> idx(static_cast<std::size_t>(s.batch));
      pinned_array<float> xb(static_cast<std::size_t>(s.batch) * features), loss(static_cast<std::size_t>(s.batch));
      pinned_array<std::uint8_t> yb(static_cast<std::size_t>(s.batch));
      device_array<float> dx(static_cast<std::size_t>(s.batch) * features);
      device_array<std::uint8_t> dy(static_cast<std::size_t>(s.batch));
      cudaEvent_t loss_ready = nullptr;
      cuda_check(cudaEventCreateWithFlags(&loss_ready, cudaEventDisableTiming), "cudaEventCreate");
      std::int64_t t = 0;
      for (int epoch = 0; epoch < s.epochs; ++epoch) {
        batches.new_epoch();
        double loss_sum = 0;
        for (int b = 0; b < steps_per_epoch; ++b, ++t) {
          // The previous step's uploads finished: engine.step() returned after its passes on this stream.
          batches.next(idx);
          data::gather(data.train, idx, xb.data(), yb.data());
          cuda_check(cudaMemcpyAsync(dx.data(), xb.data(), dx.size() * sizeof(float), cudaMemcpyHostToDevice, stream), "upload batch");
          cuda_check(cudaMemcpyAsync(dy.data(), yb.data(), dy.size(), cudaMemcpyHostToDevice, stream), "upload labels");
          opt.lr = sched.at(t, total_steps);
          net.train_step(dx.data(), dy.data(), s.batch, opt);
          cuda_check(cudaMemcpyAsync(loss.data(), net.loss(), static_cast<std::size_t>(s.batch) * sizeof(float), cudaMemcpyDeviceToHost,
                                     stream),
                     "download loss");
          cuda_check(cudaEventRecord(loss_ready, stream), "cudaEventRecord");
          // The engine orders its drift pass after the update on the same stream; the
          // loss is read after it, when the step has waited for the stream anyway.
          eng.step({.lr = opt.lr});
          cuda_check(cudaEventSynchronize(loss_ready), "cudaEventSynchronize");
          double l = 0;
          for (int j = 0; j < s.batch; ++j) l += loss.data()[j];
          loss_sum += l / s.batch;
        }
        epoch_loss[ri] = loss_sum / steps_per_epoch;
        net.download(params[ri]);
        weights[ri] = eng.weight();
        snapshot[ri] = eng.stats();
        sync.arrive_and_wait();
        if (r == 0) train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - phase_start).count();
        local_acc[ri] = host.accuracy_of(params[ri], data.test.images.data(), data.test.labels.data(), data.test.size());
        sync.arrive_and_wait();
        if (r == 0) {
          const auto avg = push_sum_average(
              std::views::iota(0, world), [&](int j) -> const std::vector<float>& { return params[static_cast<std::size_t>(j)]; },
              [&](int j) { return weights[static_cast<std::size_t>(j)]; });
          epoch_record rec;
          rec.epoch = epoch + 1;
          rec.accuracy = host.accuracy_of(avg, data.test.images.data(), data.test.labels.data(), data.test.size());
          for (int j = 0; j < world; ++j) {
            const auto& st = snapshot[static_cast<std::size_t>(j)];
            rec.train_loss += epoch_loss[static_cast<std::size_t>(j)] / world;
            rec.local_accuracy_mean += local_acc[static_cast<std::size_t>(j)] / world;
            rec.bytes_sent += st.bytes_sent;
            rec.messages += st.messages_sent;
            rec.sends += st.sends;
          }
          rec.train_seconds = train_seconds;
          report.epochs[static_cast<std::size_t>(epoch)] = rec;
          if (on_epoch) on_epoch(rec);
          phase_start = std::chrono::steady_clock::now();
        }
        sync.arrive_and_wait();
      }
      eng.finish(0);
      final_stats[ri] = eng.stats();
      cudaEventDestroy(loss_ready);
    } catch (...) {
      errors[ri] = std::current_exception();
      sync.arrive_and_drop();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(worker, r);
  for (auto& th : threads) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);

  const auto& last = report.epochs.back();
  report.complete = true;
  report.accuracy = last.accuracy;
  report.local_accuracy_mean = last.local_accuracy_mean;
  report.train_seconds = train_seconds;
  report.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  for (const auto& st : final_stats) {
    report.rank_stats.push_back(st.to_json(-1));
    report.bytes_sent += st.bytes_sent;
    report.messages += st.messages_sent;
    report.sends += st.sends;
    report.steps += st.steps;
  }
  return report;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train an MLP on Fashion-MNIST on the GPU across workers that gossip only when their model drifted."};
  std::string config_path, policy, topology, protocol, json_path;
  int workers = 0, epochs = 0;
  app.add_option("-c,--config", config_path, "TOML file with [policy], [topology], [protocol], [transport], [engine], [train]")->check(CLI::ExistingFile);
  app.add_option("--policy", policy, "override [policy] name (" + policy_registry().names_joined() + ")");
  app.add_option("--topology", topology, "override [topology] name (" + topology_registry().names_joined() + ")");
  app.add_option("--protocol", protocol, "override [protocol] name (push-sum or pairwise on the GPU)");
  app.add_option("-n,--workers", workers, "override [train] workers (threads sharing the GPU)")->check(CLI::Range(1, 64));
  app.add_option("--epochs", epochs, "override [train] epochs")->check(CLI::Range(1, 10000));
  app.add_option("--json", json_path, "write the run report as JSON here");
  std::vector<std::string> overrides;
  app.add_option("--set", overrides, "section.key=value on top of the config, e.g. --set train.train_limit=5000");
  std::string help_settings;
  for (const auto& s : train_option_specs()) help_settings += fmt::format("  {:<20} {:<10} {}\n", s.key, to_string(s.default_value), s.help);
  app.footer("[train] settings (key, default, meaning):\n" + help_settings);
  CLI11_PARSE(app, argc, argv);

  if (const auto why = cuda::unavailable_reason(); !why.empty()) {
    fmt::print(stderr,
               "fashion_mnist_cuda: no usable CUDA GPU here ({}).\n"
               "This example trains on the GPU; examples/01_fashion_mnist (fashion_mnist) trains the same model on the CPU.\n",
               why);
    return 77;
  }
  try {
    // [train] is this program's; [bench] and [baseline] are bench/traffic's, whose configs run this example too.
    const std::vector<std::string> own_sections = {"train", "bench", "baseline"};
    config cfg = config_path.empty() ? config(own_sections) : config::load(config_path, own_sections);
    if (!policy.empty()) cfg.apply_override("policy.name=" + policy);
    if (!topology.empty()) cfg.apply_override("topology.name=" + topology);
    if (!protocol.empty()) cfg.apply_override("protocol.name=" + protocol);
    if (workers) cfg.apply_override(fmt::format("train.workers={}", workers));
    if (epochs) cfg.apply_override(fmt::format("train.epochs={}", epochs));
    for (const auto& o : overrides) cfg.apply_override(o);
    const auto settings = train_settings::from(cfg.section("train", train_option_specs()));
    cudaDeviceProp prop{};
    int dev = 0;
    cuda_check(cudaGetDevice(&dev), "cudaGetDevice");
    cuda_check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
    fmt::print("libgossip {} — Fashion-MNIST on {} (GPU {}), {} workers, policy '{}', topology '{}', protocol '{}', {} data\n", GOSSIP_VERSION,
               prop.name, dev, settings.workers, cfg.policy.name, cfg.topology.name, cfg.protocol.name, data::to_string(settings.partition));
    const auto data = datasets::load(settings);
    print_epoch_header();
    const auto report = train_gpu(cfg, settings, data, print_epoch);
    print_done(report);
    if (!json_path.empty()) {
      nlohmann::json j;
      j["device"] = prop.name;
      j["accuracy"] = report.accuracy;
      j["local_accuracy_mean"] = report.local_accuracy_mean;
      j["bytes_sent"] = report.bytes_sent;
      j["messages"] = report.messages;
      j["train_seconds"] = report.train_seconds;
      j["ranks"] = nlohmann::json::array();
      for (const auto& r : report.rank_stats) j["ranks"].push_back(nlohmann::json::parse(r));
      std::ofstream(json_path) << j.dump(2) << '\n';
    }
  } catch (const gossip::error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}

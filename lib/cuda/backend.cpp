// gossip::cuda::device(): the device_backend for CUDA memory. Host code only;
// the kernels are in kernels.cu.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gossip/cuda.hpp"
#include "gossip/error.hpp"
#include "kernels.hpp"

namespace gossip::cuda {
namespace {

using detail::block_desc;

// A kernel launch reports errors through cudaGetLastError, which also returns
// an error left by an earlier call that nobody checked (the training loop's
// own launch, say): take that one first and say whose it is, so it is not
// blamed on the engine's kernel.
void check_pending(const char* what, int rank) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw error(fmt::format("libgossip CUDA backend (rank {}): before the {}, an earlier CUDA call on this thread had failed unchecked: {} "
                            "({}); check the return codes of the training loop's CUDA calls (cudaGetLastError after its kernels)",
                            rank, what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

void check(cudaError_t e, const char* what, int rank) {
  if (e != cudaSuccess)
    throw error(fmt::format("libgossip CUDA backend (rank {}): {} failed: {} ({}); check that the model's tensors are device memory of "
                            "the current device and that the stream belongs to it",
                            rank, what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

// Makes `device` current for the calling thread while alive (engines may be
// stepped from threads that selected another device).
class device_guard {
 public:
  /// rank >= 0: a failure to select the device throws, naming the rank;
  /// rank < 0 (teardown): best effort.
  device_guard(int device, int rank) {
    cudaGetDevice(&m_saved);
    if (m_saved == device) return;
    const cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess && rank >= 0) {
      (void)cudaGetLastError();
      throw error(fmt::format("libgossip CUDA backend (rank {}): cudaSetDevice({}) failed: {} ({}); the backend's device (gossip::cuda::"
                              "device_options::device) must be visible to this process (CUDA_VISIBLE_DEVICES) and usable",
                              rank, device, cudaGetErrorName(e), cudaGetErrorString(e)));
    }
  }
  ~device_guard() {
    int now = -1;
    cudaGetDevice(&now);
    if (now != m_saved) cudaSetDevice(m_saved);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int m_saved = 0;
};

// Tensors and momentum buffers must be device memory of the backend's device
// (or managed memory): a kernel on another device would read them over the
// interconnect, or fault and take the whole CUDA context with it.
void check_placement(const void* p, std::size_t count, const std::string& what, int rank, int device) {
  if (count == 0) return;
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw config_error(fmt::format("libgossip CUDA backend (rank {}): {} at {} is not memory CUDA knows ({}); a model in device memory "
                                   "takes pointers from cudaMalloc (or a framework's CUDA tensors)",
                                   rank, what, p, cudaGetErrorName(e)));
  }
  if (a.type == cudaMemoryTypeManaged) return;
  if (a.type != cudaMemoryTypeDevice)
    throw config_error(fmt::format("libgossip CUDA backend (rank {}): {} at {} is host memory, not device memory; add it with "
                                   "memory_kind::host (and no device backend), or allocate it with cudaMalloc on device {}",
                                   rank, what, p, device));
  if (a.device != device)
    throw config_error(fmt::format("libgossip CUDA backend (rank {}): {} lives on CUDA device {} but the backend's device is {}; pass "
                                   "device_options::device = {} to gossip::cuda::device (or make device {} current before calling it)",
                                   rank, what, a.device, device, a.device, a.device));
}

class cuda_model final : public device_model {
 public:
  cuda_model(const device_setup& s, cudaStream_t stream, int device, bool direct, int merge_batch)
      : m_rank(s.rank), m_stream(stream), m_device(device), m_direct(direct), m_elements(s.elements),
        m_storage_bytes(static_cast<std::size_t>(s.send_buffers) * s.message_bytes) {
    const device_guard g(m_device, m_rank);
    try {
      check_pending("engine's setup", m_rank);
      m_merge_batch = static_cast<std::size_t>(std::clamp(merge_batch, 1, detail::max_merge_sources));
      m_merge_batch = std::min(m_merge_batch, std::max<std::size_t>(s.max_merge, 1));
      std::vector<block_desc> blocks;
      std::vector<std::uint32_t> first;
      for (std::size_t t = 0; t < s.tensors.size(); ++t) {
        first.push_back(static_cast<std::uint32_t>(blocks.size()));
        const auto& slot = s.tensors[t];
        float* momentum = t < s.momentum.size() ? s.momentum[t] : nullptr;
        const std::string name = t < s.names.size() ? fmt::format("tensor '{}'", s.names[t]) : fmt::format("tensor {}", t);
        check_placement(slot.data, slot.count, name, m_rank, m_device);
        if (momentum) {
          check_placement(momentum, slot.count, "the momentum buffer of " + name, m_rank, m_device);
          m_momentum.push_back({momentum, slot.offset, slot.count});
          m_qgm = true;
        }
        for (std::size_t b = 0; b < slot.count; b += detail::block_elements)
          blocks.push_back({slot.data + b, momentum ? momentum + b : nullptr, slot.offset + b,
                            static_cast<std::uint32_t>(std::min(detail::block_elements, slot.count - b)),
                            static_cast<std::uint32_t>(t)});
      }
      first.push_back(static_cast<std::uint32_t>(blocks.size()));
      m_blocks = static_cast<std::uint32_t>(blocks.size());
      m_tensors = static_cast<std::uint32_t>(s.tensors.size());

      alloc(m_d_blocks, blocks.size() * sizeof(block_desc), "cudaMalloc (block table)");
      alloc(m_d_first, first.size() * sizeof(std::uint32_t), "cudaMalloc (tensor table)");
      alloc(m_d_ref, m_elements * sizeof(float), "cudaMalloc (x̂)");
      if (m_qgm && !s.measure_step)
        throw error(fmt::format("libgossip CUDA backend (rank {}): momentum buffers were registered without measure_step; quasi-global "
                                "momentum needs x_{{t-1}}",
                                m_rank));
      if (s.measure_step) alloc(m_d_prev, m_elements * sizeof(float), "cudaMalloc (x_{t-1})");
      if (m_qgm) {
        // m̂ starts as the optimizer's momentum (normally zero); tensors without a buffer leave their part unused.
        alloc(m_d_mhat, m_elements * sizeof(float), "cudaMalloc (quasi-global momentum)");
        check(cudaMemsetAsync(m_d_mhat, 0, m_elements * sizeof(float), m_stream), "cudaMemsetAsync (quasi-global momentum)", m_rank);
        for (std::size_t t = 0; t < s.tensors.size() && t < s.momentum.size(); ++t)
          if (s.momentum[t] && s.tensors[t].count > 0)
            check(cudaMemcpyAsync(static_cast<float*>(m_d_mhat) + s.tensors[t].offset, s.momentum[t], s.tensors[t].count * sizeof(float),
                                  cudaMemcpyDeviceToDevice, m_stream),
                  "cudaMemcpyAsync (momentum buffer to m̂)", m_rank);
        m_beta = s.momentum_beta;
      }
      alloc(m_d_partials, std::max<std::size_t>(m_blocks, 1) * 3 * sizeof(double), "cudaMalloc (partial sums)");
      alloc(m_d_arrivals, std::max<std::uint32_t>(m_tensors, 1) * sizeof(std::uint32_t), "cudaMalloc (block arrivals)");
      m_d_recv.assign(m_merge_batch, nullptr);
      for (auto& r : m_d_recv) alloc(r, m_elements * sizeof(float), "cudaMalloc (receive buffer)");
      const std::size_t sums_bytes = std::max<std::uint32_t>(m_tensors, 1) * 3 * sizeof(double);
      check(cudaMallocHost(&m_h_sums, sums_bytes), "cudaMallocHost (sums)", m_rank);
      std::memset(m_h_sums, 0, sums_bytes);  // tensors without elements keep 0
      // The drift kernel writes its sums straight into this pinned memory
      // (mapped into the device's address space); where the device cannot
      // map host memory it writes device memory, copied back after.
      void* mapped = nullptr;
      if (cudaHostGetDevicePointer(&mapped, m_h_sums, 0) == cudaSuccess) {
        m_sums_target = static_cast<double*>(mapped);
      } else {
        (void)cudaGetLastError();
        alloc(m_d_sums, sums_bytes, "cudaMalloc (sums)");
        check(cudaMemsetAsync(m_d_sums, 0, sums_bytes, m_stream), "cudaMemsetAsync (sums)", m_rank);
        m_sums_target = static_cast<double*>(m_d_sums);
      }
      if (m_direct)
        alloc(m_storage, m_storage_bytes, "cudaMalloc (send buffers)");
      else
        check(cudaMallocHost(&m_storage, m_storage_bytes), "cudaMallocHost (pinned send buffers)", m_rank);
      check(cudaEventCreateWithFlags(&m_done, cudaEventDisableTiming), "cudaEventCreate", m_rank);

      // Uploads of received payloads are asynchronous only from pinned memory;
      // when pinning the inbox fails they are still correct, just synchronous.
      if (!s.inbox.empty()) {
        if (const cudaError_t e = cudaHostRegister(s.inbox.data(), s.inbox.size(), cudaHostRegisterDefault); e == cudaSuccess) {
          m_inbox = s.inbox.data();
        } else {
          (void)cudaGetLastError();
          // Already registered (by the caller): pinned all the same, and not ours to unregister.
          if (e != cudaErrorHostMemoryAlreadyRegistered)
            std::fprintf(stderr,
                         "libgossip CUDA backend (rank %d): cudaHostRegister refused the inbox (%zu bytes: %s), so received models are "
                         "uploaded synchronously: correct, but each upload waits for the copy\n",
                         m_rank, s.inbox.size(), cudaGetErrorString(e));
        }
      }

      check(cudaMemcpyAsync(m_d_blocks, blocks.data(), blocks.size() * sizeof(block_desc), cudaMemcpyHostToDevice, m_stream),
            "cudaMemcpyAsync (block table)", m_rank);
      check(cudaMemcpyAsync(m_d_first, first.data(), first.size() * sizeof(std::uint32_t), cudaMemcpyHostToDevice, m_stream),
            "cudaMemcpyAsync (tensor table)", m_rank);
      check(cudaMemsetAsync(m_d_arrivals, 0, std::max<std::uint32_t>(m_tensors, 1) * sizeof(std::uint32_t), m_stream),
            "cudaMemsetAsync (block arrivals)", m_rank);
      if (m_d_prev)
        check(detail::launch_snapshot(static_cast<block_desc*>(m_d_blocks), m_blocks, static_cast<float*>(m_d_prev), nullptr, m_stream),
              "snapshot kernel (x_{t-1})", m_rank);
      wait("cudaEventSynchronize (setup)");  // `blocks` and `first` go out of scope
    } catch (...) {
      release();
      throw;
    }
  }
  ~cuda_model() override { release(); }

  std::byte* send_storage() noexcept override { return static_cast<std::byte*>(m_storage); }
  bool direct() const noexcept override { return m_direct; }

  void drift(std::span<tensor_drift> per_tensor, double& step_sq, const momentum_step* qgm) override {
    const device_guard g(m_device, m_rank);
    check_pending("drift kernel", m_rank);
    detail::qgm_params q{};
    if (qgm && m_d_mhat)
      q = {static_cast<float*>(m_d_mhat), 1.0f - qgm->merge_share, qgm->merge_share * qgm->inv_lr, m_beta, 1.0f - m_beta};
    check(detail::launch_drift(static_cast<block_desc*>(m_d_blocks), m_blocks, static_cast<std::uint32_t*>(m_d_first),
                               static_cast<float*>(m_d_ref), static_cast<float*>(m_d_prev), q, static_cast<double*>(m_d_partials),
                               static_cast<std::uint32_t*>(m_d_arrivals), m_sums_target, m_stream),
          "drift kernel", m_rank);
    if (m_d_sums)
      check(cudaMemcpyAsync(m_h_sums, m_d_sums, m_tensors * 3 * sizeof(double), cudaMemcpyDeviceToHost, m_stream),
            "cudaMemcpyAsync (drift sums)", m_rank);
    wait("cudaEventSynchronize (drift)");
    step_sq = 0;
    for (std::uint32_t t = 0; t < m_tensors && t < per_tensor.size(); ++t) {
      per_tensor[t] = {m_h_sums[3 * t], m_h_sums[3 * t + 1]};
      step_sq += m_h_sums[3 * t + 2];
    }
  }

  void snapshot(std::byte* payload) override {
    const device_guard g(m_device, m_rank);
    check_pending("snapshot kernel", m_rank);
    check(detail::launch_snapshot(static_cast<block_desc*>(m_d_blocks), m_blocks, static_cast<float*>(m_d_ref),
                                  m_direct ? reinterpret_cast<float*>(payload) : nullptr, m_stream),
          "snapshot kernel", m_rank);
    if (!m_direct)
      check(cudaMemcpyAsync(payload, m_d_ref, m_elements * sizeof(float), cudaMemcpyDeviceToHost, m_stream),
            "cudaMemcpyAsync (x̂ to the pinned send buffer)", m_rank);
    wait("cudaEventSynchronize (snapshot)");
  }

  void write(std::byte* dst, const void* src, std::size_t bytes) override {
    if (!m_direct) {
      std::memcpy(dst, src, bytes);
      return;
    }
    const device_guard g(m_device, m_rank);
    // Pageable source: cudaMemcpyAsync returns once `src` was read.
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, m_stream), "cudaMemcpyAsync (header)", m_rank);
    wait("cudaEventSynchronize (header)");
  }

  void reseed() override {
    if (!m_d_prev && !m_d_mhat) return;
    const device_guard g(m_device, m_rank);
    check_pending("reseed after a model that was not finite", m_rank);
    if (m_d_prev)
      check(detail::launch_snapshot(static_cast<block_desc*>(m_d_blocks), m_blocks, static_cast<float*>(m_d_prev), nullptr, m_stream),
            "snapshot kernel (x_{t-1}, reseed)", m_rank);
    if (m_d_mhat)
      for (const auto& mb : m_momentum)
        check(cudaMemcpyAsync(static_cast<float*>(m_d_mhat) + mb.offset, mb.data, mb.count * sizeof(float), cudaMemcpyDeviceToDevice,
                              m_stream),
              "cudaMemcpyAsync (momentum buffer to m̂, reseed)", m_rank);
    wait("cudaEventSynchronize (reseed)");
  }

  void merge(double a, std::span<const double> b, std::span<const received> msgs) override {
    if (msgs.empty()) return;
    const device_guard g(m_device, m_rank);
    check_pending("merge kernel", m_rank);
    for (std::size_t first = 0; first < msgs.size(); first += m_merge_batch) {
      detail::merge_args args{};
      args.a = first == 0 ? static_cast<float>(a) : 1.0f;  // the batches after the first only add their share
      args.count = static_cast<int>(std::min(m_merge_batch, msgs.size() - first));
      for (int j = 0; j < args.count; ++j) {
        const auto& m = msgs[first + static_cast<std::size_t>(j)];
        GOSSIP_ASSERT(m.elements == m_elements, "rank {}: a message of {} floats from rank {} for a model of {}", m_rank, m.elements,
                      m.sender, m_elements);
        check(cudaMemcpyAsync(m_d_recv[static_cast<std::size_t>(j)], m.data, m_elements * sizeof(float), cudaMemcpyHostToDevice, m_stream),
              "cudaMemcpyAsync (received payload)", m_rank);
        args.src[j] = static_cast<const float*>(m_d_recv[static_cast<std::size_t>(j)]);
        args.b[j] = static_cast<float>(b[first + static_cast<std::size_t>(j)]);
      }
      check(detail::launch_merge(static_cast<block_desc*>(m_d_blocks), m_blocks, args, m_stream), "merge kernel", m_rank);
    }
    wait("cudaEventSynchronize (merge)");
  }

 private:
  void alloc(void*& p, std::size_t bytes, const char* what) {
    const cudaError_t e = cudaMalloc(&p, std::max<std::size_t>(bytes, 1));
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      std::size_t free_bytes = 0, total = 0;
      (void)cudaMemGetInfo(&free_bytes, &total);
      (void)cudaGetLastError();
      throw error(fmt::format("libgossip CUDA backend (rank {}): {} of {:.1f} MiB failed: device {} is out of memory ({:.1f} of {:.1f} MiB "
                              "free). An engine keeps in device memory x̂, x_{{t-1}} (policies that measure the step, quasi-global "
                              "momentum), m̂ (quasi-global momentum) and up to merge_batch = {} received models, each the model's size "
                              "({:.1f} MiB); lower gossip::cuda::device_options::merge_batch, or put fewer ranks on this GPU",
                              m_rank, what, bytes / 1048576.0, m_device, free_bytes / 1048576.0, total / 1048576.0, m_merge_batch,
                              m_elements * sizeof(float) / 1048576.0));
    }
    check(e, what, m_rank);
  }
  void wait(const char* what) {
    check(cudaEventRecord(m_done, m_stream), "cudaEventRecord", m_rank);
    check(cudaEventSynchronize(m_done), what, m_rank);
  }
  void release() noexcept {
    const device_guard g(m_device, -1);
    // Nothing of ours may still be in flight on the stream when buffers go.
    if (m_done) {
      if (cudaEventRecord(m_done, m_stream) == cudaSuccess) cudaEventSynchronize(m_done);
      cudaEventDestroy(m_done);
      m_done = nullptr;
    }
    if (m_inbox) cudaHostUnregister(m_inbox);
    m_inbox = nullptr;
    for (void* p : {m_d_blocks, m_d_first, m_d_ref, m_d_prev, m_d_mhat, m_d_partials, m_d_arrivals, m_d_sums})
      if (p) cudaFree(p);
    for (void* p : m_d_recv)
      if (p) cudaFree(p);
    m_d_recv.clear();
    m_d_blocks = m_d_first = m_d_ref = m_d_prev = m_d_mhat = m_d_partials = m_d_arrivals = m_d_sums = nullptr;
    m_sums_target = nullptr;
    if (m_h_sums) cudaFreeHost(m_h_sums);
    m_h_sums = nullptr;
    if (m_storage) m_direct ? cudaFree(m_storage) : cudaFreeHost(m_storage);
    m_storage = nullptr;
  }

  int m_rank;
  cudaStream_t m_stream;
  int m_device;
  bool m_direct;
  std::size_t m_elements, m_storage_bytes, m_merge_batch = 1;
  std::uint32_t m_blocks = 0, m_tensors = 0;
  bool m_qgm = false;  // some tensor registered a momentum buffer
  float m_beta = 0.9f;
  void *m_d_blocks = nullptr, *m_d_first = nullptr, *m_d_ref = nullptr, *m_d_prev = nullptr, *m_d_mhat = nullptr, *m_d_partials = nullptr,
       *m_d_arrivals = nullptr, *m_d_sums = nullptr, *m_storage = nullptr;
  std::vector<void*> m_d_recv;
  struct momentum_buffer {
    float* data;
    std::size_t offset, count;
  };
  std::vector<momentum_buffer> m_momentum;  // the optimizer's buffers, for reseed()
  double* m_h_sums = nullptr;
  double* m_sums_target = nullptr;  // where the drift kernel writes: m_h_sums mapped, or m_d_sums
  void* m_inbox = nullptr;
  cudaEvent_t m_done = nullptr;
};

class cuda_backend final : public device_backend {
 public:
  cuda_backend(cudaStream_t stream, int device, device_options o) : m_stream(stream), m_device(device), m_options(std::move(o)) {}
  std::string_view name() const noexcept override { return "cuda"; }
  memory_kind memory() const noexcept override { return memory_kind::cuda; }
  void* stream() const noexcept override { return m_stream; }

  std::unique_ptr<device_model> make(const device_setup& s) const override {
    bool direct = false;
    if (m_options.transfer == "direct") {
      if (!s.transport_takes_device_memory)
        throw config_error(fmt::format("gossip::cuda::device (rank {}): transfer = \"direct\" but the transport cannot send device "
                                       "memory (no transport does yet: sends are staged through pinned host buffers); use \"auto\" or \"staged\"",
                                       s.rank));
      direct = true;
    } else if (m_options.transfer == "auto") {
      direct = s.transport_takes_device_memory;
    }
    return std::make_unique<cuda_model>(s, m_stream, m_device, direct, m_options.merge_batch);
  }

 private:
  cudaStream_t m_stream;
  int m_device;
  device_options m_options;
};

// Empty when `device` can run the kernels: its context starts (not
// prohibited, not out of memory) and the build has code for it.
std::string kernel_reason(int device) {
  const device_guard g(device, -1);
  if (const cudaError_t e = cudaFree(nullptr); e != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("CUDA device {} cannot be used: {} ({})", device, cudaGetErrorName(e), cudaGetErrorString(e));
  }
  const cudaError_t e = detail::kernel_image_status();
  if (e == cudaSuccess) return {};
  (void)cudaGetLastError();
  int major = 0, minor = 0;
  (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  (void)cudaGetLastError();
  return fmt::format("CUDA device {} (compute capability {}.{}) cannot run libgossip_cuda's kernels: {} ({}); this build has code for "
                     "sm_75, sm_80 and sm_90 and PTX for compute_90 (newer GPUs), which the driver must be recent enough to compile "
                     "(lib/cuda/meson.build: add the GPU's architecture to cuda_arch_args and rebuild, or update the driver)",
                     device, major, minor, cudaGetErrorName(e), cudaGetErrorString(e));
}

}  // namespace

namespace {
// Empty when some CUDA device is visible.
std::string device_count_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("cudaGetDeviceCount failed: {} ({})", cudaGetErrorName(e), cudaGetErrorString(e));
  }
  if (n == 0) return "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)";
  return {};
}
}  // namespace

std::string unavailable_reason() {
  if (auto why = device_count_reason(); !why.empty()) return why;
  int dev = 0;
  if (const cudaError_t g = cudaGetDevice(&dev); g != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("cudaGetDevice failed: {} ({})", cudaGetErrorName(g), cudaGetErrorString(g));
  }
  return kernel_reason(dev);
}

std::shared_ptr<const device_backend> device(void* stream, device_options options) {
  if (options.transfer != "auto" && options.transfer != "staged" && options.transfer != "direct")
    throw config_error(fmt::format("gossip::cuda::device: transfer '{}' is not one of auto, staged, direct", options.transfer));
  if (options.merge_batch < 1 || options.merge_batch > detail::max_merge_sources)
    throw config_error(fmt::format("gossip::cuda::device: merge_batch {} is outside 1..{}", options.merge_batch, detail::max_merge_sources));
  if (auto why = device_count_reason(); !why.empty())
    throw error(fmt::format("gossip::cuda::device: no usable CUDA device: {}; run on a machine with an NVIDIA GPU and driver, or keep "
                            "the model in host memory",
                            why));
  int dev = options.device;
  if (dev < 0) {
    check(cudaGetDevice(&dev), "cudaGetDevice", -1);
  } else {
    int count = 0;
    check(cudaGetDeviceCount(&count), "cudaGetDeviceCount", -1);
    if (dev >= count)
      throw config_error(fmt::format("gossip::cuda::device: device {} does not exist: {} CUDA device(s) are visible (0..{}; check "
                                     "CUDA_VISIBLE_DEVICES)",
                                     dev, count, count - 1));
  }
  if (auto why = kernel_reason(dev); !why.empty()) throw error(fmt::format("gossip::cuda::device: {}", why));
  return std::make_shared<cuda_backend>(static_cast<cudaStream_t>(stream), dev, std::move(options));
}

}  // namespace gossip::cuda

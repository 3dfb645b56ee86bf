#pragma once
/// The seam between the engine and a backend for models in accelerator
/// memory. Host-only: no accelerator header is needed to include it, and a
/// program whose tensors all live in host memory never touches it.
///
/// A user does not implement these; a backend library does (libgossip_cuda:
/// gossip::cuda::device() in gossip/cuda.hpp). The model view carries the
/// backend, and every engine built from that view asks it for a device_model:
///
///     gossip::model_view model;
///     model.add("fc1.weight", {d_w1, 784 * 128}, gossip::memory_kind::cuda);
///     model.on_device(gossip::cuda::device(stream));  // the stream the training loop updates the model on
///     gossip::engine eng(model, rank, world, cfg, transport);  // unchanged from the host case
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "gossip/model.hpp"
#include "gossip/protocol.hpp"
#include "gossip/signal.hpp"
#include "gossip/transport.hpp"

namespace gossip {

/// What an engine tells its device backend once, when it is built.
struct device_setup {
  int rank = 0;
  std::span<const tensor_slot> tensors;  ///< device pointers; offsets within the payload
  std::size_t elements = 0;              ///< payload floats (sum of tensor counts)
  std::size_t message_bytes = 0;         ///< one send buffer: wire_header + payload, padded
  int send_buffers = 1;
  bool measure_step = false;             ///< keep x_{t−1} on the device and measure ‖x_t − x_{t−1}‖²
  bool transport_takes_device_memory = false;  ///< the transport can post device buffers
  std::size_t max_merge = 1;             ///< most messages one merge() call gets
  std::span<std::byte> inbox;            ///< host memory received payloads land in (pinned if possible)
  /// Per tensor: the optimizer's momentum buffer in device memory (same count
  /// as the tensor), or null. Empty, or all null: no quasi-global momentum.
  /// Non-empty implies measure_step (quasi-global momentum needs x_{t−1}).
  std::span<float* const> momentum;
  float momentum_beta = 0.9f;            ///< β of quasi-global momentum
  std::span<const std::string> names;    ///< per tensor, for messages (may be empty)
};

/// One step's quasi-global momentum update, fused into the drift pass (see
/// gossip::qgm_args): d = (1 − merge_share)·v − merge_share·(x − x_{t−1})/lr,
/// m̂ ← β·m̂ + (1 − β)·d, and the optimizer's buffer v ← m̂.
struct momentum_step {
  float inv_lr = 0;          ///< 1 / the step's learning rate
  float merge_share = 1.0f;  ///< qgm_args::merge_share
};

/// Per-engine device state: x̂ (and x_{t−1}) in device memory, the send
/// buffers, and the fused passes of one step. All work is ordered on the
/// backend's stream; calls return once their results are usable on the host
/// (an event on that stream is waited for — never the whole device).
class device_model {
 public:
  virtual ~device_model() = default;
  /// send_buffers × message_bytes: pinned host memory when staged, device memory when direct().
  virtual std::byte* send_storage() noexcept = 0;
  /// True when send buffers live in device memory and go to the transport as they are.
  virtual bool direct() const noexcept = 0;
  /// ‖x − x̂‖² and ‖x̂‖² of every tensor (and ‖x − x_{t−1}‖² in total, updating
  /// x_{t−1}, when setup.measure_step) in one pass over the model; with `qgm`
  /// (only when setup.momentum registered buffers) the same pass updates m̂ and
  /// the momentum buffers.
  virtual void drift(std::span<tensor_drift> per_tensor, double& step_sq, const momentum_step* qgm) = 0;
  /// x̂ ← x in one pass, and the payload of a send buffer ← x (an async copy
  /// from x̂ when staged); returns when the payload is complete.
  virtual void snapshot(std::byte* payload) = 0;
  /// Copies host bytes into a send buffer (the wire header).
  virtual void write(std::byte* dst, const void* src, std::size_t bytes) = 0;
  /// x ← a·x + Σ_j b[j]·m_j for received payloads m_j (host memory), by async
  /// uploads and one merge kernel per batch; returns once the payloads were
  /// read, so their inbox slots can be released.
  virtual void merge(double a, std::span<const double> b, std::span<const received> msgs) = 0;
  /// After a drift pass found the model not finite and the caller restored the
  /// model and the optimizer's momentum buffers: x_{t−1} ← x and m̂ ← the
  /// buffers, as when the model was made, since that pass wrote them from the
  /// bad values. Returns when done. (A backend without x_{t−1} or m̂ does nothing.)
  virtual void reseed() {}
};

/// A factory of device_models: one object per device and stream, shared by the
/// model views (and engines) that use it.
class device_backend {
 public:
  virtual ~device_backend() = default;
  virtual std::string_view name() const noexcept = 0;
  virtual memory_kind memory() const noexcept = 0;
  /// The stream every pass is ordered on (a cudaStream_t for CUDA), as an opaque pointer.
  virtual void* stream() const noexcept = 0;
  virtual std::unique_ptr<device_model> make(const device_setup& setup) const = 0;
};

namespace detail {
/// Capability hook: true when a transport reports that it can send from and
/// receive into device memory (a `device_memory` member of its
/// capabilities). No transport has that member yet (transport_capabilities
/// does not declare it), so every transport is treated as host-only and
/// device models are staged through pinned host buffers.
template <class Capabilities>
constexpr bool takes_device_memory(const Capabilities& caps) noexcept {
  if constexpr (requires { caps.device_memory; })
    return static_cast<bool>(caps.device_memory);
  else
    return false;
}
}  // namespace detail

}  // namespace gossip

#pragma once
/// Models in CUDA device memory: the backend that lets an engine measure,
/// snapshot, send and merge tensors that live on the GPU. Implemented in
/// libgossip_cuda (meson: gossip_cuda_dep); this header needs no CUDA include.
///
///     cudaStream_t stream;  cudaStreamCreate(&stream);
///     gossip::model_view model;
///     model.add("fc1.weight", {d_w1, 784 * 128}, gossip::memory_kind::cuda)
///          .add("fc1.bias", {d_b1, 128}, gossip::memory_kind::cuda);
///     model.on_device(gossip::cuda::device(stream));
///     gossip::engine eng(model, rank, world, cfg, transport);
///     // loop: launch forward/backward/update on `stream`, then eng.step({...})
///
/// The engine orders its passes on that stream after the caller's update, and
/// waits only for events it recorded there (never cudaDeviceSynchronize). A
/// step's drift pass and its snapshot copy are one fused kernel each. No
/// transport takes device memory yet (Debian's UCX has no CUDA support, and
/// the UCX transport does not ask a CUDA-aware one), so a send is
/// staged through pinned host buffers by cudaMemcpyAsync on the stream, while
/// the transport still moves the previous send from another buffer; received
/// payloads are uploaded asynchronously and merged by one kernel.
#include <memory>
#include <string>

#include "gossip/device.hpp"

namespace gossip::cuda {

/// Empty when a CUDA device can be used here (the current one starts and can
/// run this build's kernels); otherwise why not, e.g.
/// "cudaGetDeviceCount failed: cudaErrorInsufficientDriver (CUDA driver version
/// is insufficient for CUDA runtime version)". For skips and messages.
std::string unavailable_reason();
inline bool available() { return unavailable_reason().empty(); }

struct device_options {
  /// How sends reach the transport: "auto" (direct when the transport reports
  /// device memory support, staged otherwise), "staged" or "direct". No
  /// transport reports it yet: "auto" stages, and "direct" is refused.
  std::string transfer = "auto";
  /// Messages merged by one kernel (each needs a model-sized device buffer).
  int merge_batch = 4;
  /// The CUDA device the tensors live on; -1: the calling thread's current device.
  int device = -1;
};

/// The backend for tensors on `options.device` (default: the current CUDA
/// device), ordered on `stream` (a cudaStream_t of that device; nullptr is the
/// legacy default stream). Every call then runs on that device, from any
/// thread. Throws gossip::error naming the reason when no device is usable.
std::shared_ptr<const device_backend> device(void* stream, device_options options = {});

}  // namespace gossip::cuda

#pragma once
// Launchers of libgossip's CUDA kernels. Shared by kernels.cu (nvcc) and
// backend.cpp (the host compiler): only the CUDA runtime header and <cstdint>,
// so nvcc never sees fmt, Eigen or the C++20 parts of the library.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace gossip::cuda::detail {

/// Elements one thread block of the fused passes covers (64 KiB of each input):
/// on an H200 the drift pass reached 1.04x a device-to-device copy at 1 GiB
/// with this, against 0.94x with 4096 (bench/drift --device-only).
inline constexpr std::size_t block_elements = 16384;
inline constexpr int block_threads = 256;
inline constexpr int max_merge_sources = 8;

/// One thread block's share of the model: `count` elements of one tensor,
/// starting at `data` in the tensor and at `offset` in the contiguous copies
/// (x̂, x_{t−1}, payloads). Built once per engine, uploaded once.
struct block_desc {
  float* data;
  float* momentum;  ///< the optimizer's momentum buffer at the same element as data, or null
  std::uint64_t offset;
  std::uint32_t count;
  std::uint32_t tensor;
};

/// Quasi-global momentum in the drift pass (mhat null: none this pass). For
/// each element of a block with a momentum buffer v, e = x − prev:
/// d = own·v − shared·e, m̂ ← beta·m̂ + rest·d, v ← m̂ (own = 1 − merge share,
/// shared = merge share / lr, rest = 1 − beta: gossip::qgm_args on the host).
struct qgm_params {
  float* mhat;  ///< m̂ at the payload offsets, like prev
  float own, shared, beta, rest;
};

/// Fused drift pass, one kernel launch. Per block: Σ(x − x̂)², Σx̂² and, when
/// prev is not null, Σ(x − prev)² (then prev ← x, and the momentum update of
/// `qgm` where qgm.mhat and the block's momentum are set) into partials[3·block]; the
/// last block of tensor t to finish adds its blocks' partials (first_block[t]
/// .. first_block[t+1]) into sums[3·t] and sets arrivals[t] back to 0.
/// `arrivals` (one counter per tensor) must be zero before the first launch;
/// `sums` may be mapped pinned host memory (no copy back needed). Tensors
/// without elements have no block and leave their sums untouched. Partials
/// and sums are double and added in block order, so results are reproducible
/// run to run.
cudaError_t launch_drift(const block_desc* blocks, std::uint32_t n_blocks, const std::uint32_t* first_block, const float* ref,
                         float* prev, const qgm_params& qgm, double* partials, std::uint32_t* arrivals, double* sums,
                         cudaStream_t stream);

/// Fused snapshot: ref[offset + i] ← x and, when second is not null, second[offset + i] ← x.
cudaError_t launch_snapshot(const block_desc* blocks, std::uint32_t n_blocks, float* ref, float* second,
                            cudaStream_t stream);

struct merge_args {
  const float* src[max_merge_sources];
  float b[max_merge_sources];
  float a;
  int count;
};
/// x ← a·x + Σ_j b[j]·src[j][offset + i], j < count.
cudaError_t launch_merge(const block_desc* blocks, std::uint32_t n_blocks, const merge_args& args, cudaStream_t stream);

/// cudaSuccess when the current device can run this library's kernels (the
/// build holds code for its architecture, or PTX its driver can compile).
cudaError_t kernel_image_status();

}  // namespace gossip::cuda::detail

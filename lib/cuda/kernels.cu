// The fused passes over a device model. One thread block per block_desc
// (block_elements of one tensor); float4 loads when every pointer of the block
// is 16-byte aligned, scalar otherwise. Per-thread sums of at most 64 terms
// are float; everything above is double.
#include "kernels.hpp"

namespace gossip::cuda::detail {
namespace {

constexpr int warps = block_threads / 32;

__device__ inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Sums v over the block; the result is valid in thread 0.
__device__ inline double block_sum(double v, double* scratch) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = threadIdx.x < warps ? scratch[threadIdx.x] : 0.0;
  if (warp == 0)
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  __syncthreads();  // scratch is reused by the next call
  return v;
}

// One launch per drift pass: each block sums its share, and the last block of
// each tensor to finish (counted in arrivals[tensor]) adds that tensor's
// partials in block order, writes the three sums and re-arms the counter for
// the next pass (ordered after this one on the stream).
__global__ void __launch_bounds__(block_threads) drift_kernel(const block_desc* blocks, const std::uint32_t* first_block,
                                                              const float* ref, float* prev, const qgm_params q,
                                                              double* partials, std::uint32_t* arrivals, double* sums) {
  __shared__ double scratch[warps];
  __shared__ bool last;
  const block_desc d = blocks[blockIdx.x];
  const float* x = d.data;
  const float* r = ref + d.offset;
  float* p = prev ? prev + d.offset : nullptr;
  // Quasi-global momentum where this block's tensor registered a buffer (it needs x_{t−1}).
  float* v = p && q.mhat ? d.momentum : nullptr;
  float* mh = v ? q.mhat + d.offset : nullptr;
  float diff = 0.0f, refs = 0.0f, step = 0.0f;
  std::uint32_t scalar_from = 0;
  if (aligned16(x) && aligned16(r) && (!p || aligned16(p)) && (!v || (aligned16(v) && aligned16(mh)))) {
    const std::uint32_t n4 = d.count / 4;
#pragma unroll 4
    for (std::uint32_t i = threadIdx.x; i < n4; i += block_threads) {
      const float4 xv = reinterpret_cast<const float4*>(x)[i];
      const float4 rv = reinterpret_cast<const float4*>(r)[i];
      const float e0 = xv.x - rv.x, e1 = xv.y - rv.y, e2 = xv.z - rv.z, e3 = xv.w - rv.w;
      diff += e0 * e0 + e1 * e1 + e2 * e2 + e3 * e3;
      refs += rv.x * rv.x + rv.y * rv.y + rv.z * rv.z + rv.w * rv.w;
      if (p) {
        const float4 pv = reinterpret_cast<const float4*>(p)[i];
        const float s0 = xv.x - pv.x, s1 = xv.y - pv.y, s2 = xv.z - pv.z, s3 = xv.w - pv.w;
        step += s0 * s0 + s1 * s1 + s2 * s2 + s3 * s3;
        reinterpret_cast<float4*>(p)[i] = xv;
        if (v) {
          const float4 vv = reinterpret_cast<const float4*>(v)[i];
          const float4 m0 = reinterpret_cast<const float4*>(mh)[i];
          float4 m;
          m.x = q.beta * m0.x + q.rest * (q.own * vv.x - s0 * q.shared);
          m.y = q.beta * m0.y + q.rest * (q.own * vv.y - s1 * q.shared);
          m.z = q.beta * m0.z + q.rest * (q.own * vv.z - s2 * q.shared);
          m.w = q.beta * m0.w + q.rest * (q.own * vv.w - s3 * q.shared);
          reinterpret_cast<float4*>(mh)[i] = m;
          reinterpret_cast<float4*>(v)[i] = m;
        }
      }
    }
    scalar_from = n4 * 4;
  }
  for (std::uint32_t i = scalar_from + threadIdx.x; i < d.count; i += block_threads) {
    const float xv = x[i], rv = r[i], e = xv - rv;
    diff += e * e;
    refs += rv * rv;
    if (p) {
      const float s = xv - p[i];
      step += s * s;
      p[i] = xv;
      if (v) {
        const float m = q.beta * mh[i] + q.rest * (q.own * v[i] - s * q.shared);
        mh[i] = m;
        v[i] = m;
      }
    }
  }
  const double total_diff = block_sum(diff, scratch);
  const double total_ref = block_sum(refs, scratch);
  const double total_step = block_sum(step, scratch);
  const std::uint32_t t = d.tensor, begin = first_block[t], end = first_block[t + 1];
  if (threadIdx.x == 0) {
    partials[3 * blockIdx.x + 0] = total_diff;
    partials[3 * blockIdx.x + 1] = total_ref;
    partials[3 * blockIdx.x + 2] = total_step;
    __threadfence();  // the partials are visible device-wide before the arrival is counted
    last = atomicAdd(&arrivals[t], 1u) == end - begin - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  double s[3] = {0.0, 0.0, 0.0};
  for (std::uint32_t b = begin + threadIdx.x; b < end; b += block_threads)
    for (int k = 0; k < 3; ++k) s[k] += __ldcg(&partials[3 * b + k]);  // L2: other blocks wrote them
  for (int k = 0; k < 3; ++k) {
    const double v = block_sum(s[k], scratch);
    if (threadIdx.x == 0) sums[3 * t + k] = v;
  }
  if (threadIdx.x == 0) arrivals[t] = 0;
}

__global__ void __launch_bounds__(block_threads) snapshot_kernel(const block_desc* blocks, float* ref, float* second) {
  const block_desc d = blocks[blockIdx.x];
  const float* x = d.data;
  float* r = ref + d.offset;
  float* s = second ? second + d.offset : nullptr;
  std::uint32_t scalar_from = 0;
  if (aligned16(x) && aligned16(r) && (!s || aligned16(s))) {
    const std::uint32_t n4 = d.count / 4;
    for (std::uint32_t i = threadIdx.x; i < n4; i += block_threads) {
      const float4 v = reinterpret_cast<const float4*>(x)[i];
      reinterpret_cast<float4*>(r)[i] = v;
      if (s) reinterpret_cast<float4*>(s)[i] = v;
    }
    scalar_from = n4 * 4;
  }
  for (std::uint32_t i = scalar_from + threadIdx.x; i < d.count; i += block_threads) {
    const float v = x[i];
    r[i] = v;
    if (s) s[i] = v;
  }
}

__global__ void __launch_bounds__(block_threads) merge_kernel(const block_desc* blocks, merge_args args) {
  const block_desc d = blocks[blockIdx.x];
  float* x = d.data;
  for (std::uint32_t i = threadIdx.x; i < d.count; i += block_threads) {
    float v = args.a * x[i];
    for (int j = 0; j < args.count; ++j) v += args.b[j] * args.src[j][d.offset + i];
    x[i] = v;
  }
}

}  // namespace

cudaError_t launch_drift(const block_desc* blocks, std::uint32_t n_blocks, const std::uint32_t* first_block, const float* ref,
                         float* prev, const qgm_params& qgm, double* partials, std::uint32_t* arrivals, double* sums,
                         cudaStream_t stream) {
  if (n_blocks > 0) drift_kernel<<<n_blocks, block_threads, 0, stream>>>(blocks, first_block, ref, prev, qgm, partials, arrivals, sums);
  return cudaGetLastError();
}

cudaError_t launch_snapshot(const block_desc* blocks, std::uint32_t n_blocks, float* ref, float* second,
                            cudaStream_t stream) {
  if (n_blocks > 0) snapshot_kernel<<<n_blocks, block_threads, 0, stream>>>(blocks, ref, second);
  return cudaGetLastError();
}

cudaError_t launch_merge(const block_desc* blocks, std::uint32_t n_blocks, const merge_args& args, cudaStream_t stream) {
  if (n_blocks > 0) merge_kernel<<<n_blocks, block_threads, 0, stream>>>(blocks, args);
  return cudaGetLastError();
}

cudaError_t kernel_image_status() {
  cudaFuncAttributes a{};
  return cudaFuncGetAttributes(&a, drift_kernel);
}

}  // namespace gossip::cuda::detail

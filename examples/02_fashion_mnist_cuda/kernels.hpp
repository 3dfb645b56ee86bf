#pragma once
// The element-wise kernels of the GPU MLP (kernels.cu); the matrix products
// are cuBLAS. Only the CUDA runtime header, so nvcc never sees the library's
// C++20 headers.
#include <cstdint>

#include <cuda_runtime.h>

namespace gossip::examples::gpu {

/// z[r + c·rows] += bias[r]; then max(z, 0) when relu.
void bias_activation(float* z, const float* bias, int rows, int cols, bool relu, cudaStream_t s);
/// Softmax cross-entropy of `batch` columns of `classes` logits: delta ← (p − onehot(y)) / batch,
/// loss[j] ← −log p_j(y_j).
void softmax_xent(const float* logits, const std::uint8_t* labels, float* delta, float* loss, int classes, int batch,
                  cudaStream_t s);
/// delta[i] ← act[i] > 0 ? delta[i] : 0 (backward through ReLU).
void relu_backward(float* delta, const float* act, std::size_t n, cudaStream_t s);
/// out[r] ← Σ_c m[r + c·rows] (bias gradient).
void row_sum(const float* m, float* out, int rows, int cols, cudaStream_t s);
/// Heavy-ball SGD, as examples::sgd_momentum: v ← μ·v + (g + λ·w); w ← w − η·v.
void sgd_momentum(float* w, float* v, const float* g, std::size_t n, float lr, float momentum, float weight_decay, cudaStream_t s);

}  // namespace gossip::examples::gpu

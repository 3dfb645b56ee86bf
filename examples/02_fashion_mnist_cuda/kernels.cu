#include "kernels.hpp"

#include <cmath>

namespace gossip::examples::gpu {
namespace {

constexpr int threads = 256;
unsigned blocks_for(std::size_t n) { return static_cast<unsigned>((n + threads - 1) / threads); }

__global__ void bias_activation_kernel(float* z, const float* bias, int rows, std::size_t n, bool relu) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float v = z[i] + bias[i % static_cast<std::size_t>(rows)];
  z[i] = relu ? fmaxf(v, 0.0f) : v;
}

__global__ void softmax_xent_kernel(const float* logits, const std::uint8_t* labels, float* delta, float* loss, int classes,
                                    int batch) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= batch) return;
  const float* z = logits + static_cast<std::size_t>(j) * classes;
  float* d = delta + static_cast<std::size_t>(j) * classes;
  float zmax = z[0];
  for (int k = 1; k < classes; ++k) zmax = fmaxf(zmax, z[k]);
  float sum = 0.0f;
  for (int k = 0; k < classes; ++k) {
    d[k] = expf(z[k] - zmax);
    sum += d[k];
  }
  const int y = labels[j];
  loss[j] = logf(sum) - (z[y] - zmax);
  const float scale = 1.0f / (sum * static_cast<float>(batch));
  for (int k = 0; k < classes; ++k) d[k] *= scale;
  d[y] -= 1.0f / static_cast<float>(batch);
}

__global__ void relu_backward_kernel(float* delta, const float* act, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n && !(act[i] > 0.0f)) delta[i] = 0.0f;
}

__global__ void row_sum_kernel(const float* m, float* out, int rows, int cols) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float s = 0.0f;
  for (int c = 0; c < cols; ++c) s += m[r + static_cast<std::size_t>(c) * rows];
  out[r] = s;
}

__global__ void sgd_momentum_kernel(float* w, float* v, const float* g, std::size_t n, float lr, float momentum, float wd) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float vi = momentum * v[i] + (g[i] + wd * w[i]);
  v[i] = vi;
  w[i] -= lr * vi;
}

}  // namespace

void bias_activation(float* z, const float* bias, int rows, int cols, bool relu, cudaStream_t s) {
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  bias_activation_kernel<<<blocks_for(n), threads, 0, s>>>(z, bias, rows, n, relu);
}
void softmax_xent(const float* logits, const std::uint8_t* labels, float* delta, float* loss, int classes, int batch,
                  cudaStream_t s) {
  softmax_xent_kernel<<<blocks_for(static_cast<std::size_t>(batch)), threads, 0, s>>>(logits, labels, delta, loss, classes, batch);
}
void relu_backward(float* delta, const float* act, std::size_t n, cudaStream_t s) {
  relu_backward_kernel<<<blocks_for(n), threads, 0, s>>>(delta, act, n);
}
void row_sum(const float* m, float* out, int rows, int cols, cudaStream_t s) {
  row_sum_kernel<<<blocks_for(static_cast<std::size_t>(rows)), threads, 0, s>>>(m, out, rows, cols);
}
void sgd_momentum(float* w, float* v, const float* g, std::size_t n, float lr, float momentum, float weight_decay, cudaStream_t s) {
  sgd_momentum_kernel<<<blocks_for(n), threads, 0, s>>>(w, v, g, n, lr, momentum, weight_decay);
}

}  // namespace gossip::examples::gpu

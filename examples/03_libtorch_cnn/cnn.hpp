#pragma once
// A small libtorch CNN for Fashion-MNIST with the MLP's training interface
// (examples/common/trainer.hpp), so the shared loop trains it: conv 5x5 (16)
// → pool → conv 5x5 (32) → pool → fc (hidden[0]) → fc 10, about 215k
// parameters at hidden = [128].
//
// The parameters live in one flat buffer (each torch parameter is a view of
// its slice), which is what the loop averages and evaluates; the engine sees
// them through gossip::add_parameters (gossip/torch.hpp), by their torch names.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "common/mlp.hpp"
#include "common/trainer.hpp"
#include "gossip/torch.hpp"

namespace gossip::examples {

struct cnn_module : torch::nn::Module {
  explicit cnn_module(int hidden)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 5).padding(2)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 5).padding(2)))),
        fc1(register_module("fc1", torch::nn::Linear(32 * 7 * 7, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
    return fc2->forward(torch::relu(fc1->forward(x.flatten(1))));
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};

class cnn {
 public:
  cnn(int hidden, std::uint64_t seed) {
    {
      // The same initial model on every worker: torch's generator is global, so
      // workers (threads) take turns.
      static std::mutex init_mutex;
      const std::lock_guard lock(init_mutex);
      torch::manual_seed(seed);
      m_module = std::make_shared<cnn_module>(hidden);
    }
    std::size_t n = 0;
    for (const auto& p : m_module->parameters()) n += static_cast<std::size_t>(p.numel());
    m_params.resize(n);
    const torch::NoGradGuard no_grad;
    std::size_t off = 0;
    for (const auto& item : m_module->named_parameters()) {
      auto p = item.value();
      const auto count = static_cast<std::size_t>(p.numel());
      auto slice = torch::from_blob(m_params.data() + off, p.sizes(), torch::kFloat32);
      slice.copy_(p);
      p.set_data(slice);  // the parameter now lives in m_params
      m_tensors.push_back({item.key(), off, count});
      m_torch_params.push_back(p);
      off += count;
    }
  }

  std::span<float> params() noexcept { return m_params; }
  std::span<const float> params() const noexcept { return m_params; }
  std::vector<tensor_slice> tensors() const { return m_tensors; }

  template <class View>
  View& register_tensors(View& view) {
    return add_parameters(view, *m_module);
  }

  /// Forward, backward and one step of `opt` (heavy-ball, its velocity over params()).
  float train_batch(const float* x, const std::uint8_t* y, int batch, sgd_momentum& opt) {
    const auto input = torch::from_blob(const_cast<float*>(x), {batch, 1, 28, 28}, torch::kFloat32);
    const auto labels = torch::from_blob(const_cast<std::uint8_t*>(y), {batch}, torch::kUInt8).to(torch::kLong);
    m_module->zero_grad();
    auto loss = torch::nn::functional::cross_entropy(m_module->forward(input), labels);
    loss.backward();
    m_grads.resize(m_params.size());
    for (std::size_t i = 0; i < m_tensors.size(); ++i)
      std::memcpy(m_grads.data() + m_tensors[i].offset, m_torch_params[i].grad().data_ptr<float>(), m_tensors[i].count * sizeof(float));
    opt.step(m_params, m_grads);
    return loss.item<float>();
  }

  double accuracy(const float* x, const std::uint8_t* y, std::size_t n) const {
    const torch::NoGradGuard no_grad;
    std::size_t correct = 0;
    for (std::size_t i = 0; i < n; i += eval_batch) {
      const auto b = static_cast<std::int64_t>(std::min(eval_batch, n - i));
      const auto input = torch::from_blob(const_cast<float*>(x + i * 784), {b, 1, 28, 28}, torch::kFloat32);
      const auto labels = torch::from_blob(const_cast<std::uint8_t*>(y + i), {b}, torch::kUInt8).to(torch::kLong);
      correct += static_cast<std::size_t>(m_module->forward(input).argmax(1).eq(labels).sum().item<std::int64_t>());
    }
    return n ? static_cast<double>(correct) / static_cast<double>(n) : 0.0;
  }

  /// Accuracy of other parameters (e.g. the average model) in this network.
  double accuracy_of(std::span<const float> params, const float* x, const std::uint8_t* y, std::size_t n) {
    std::vector<float> saved(m_params.begin(), m_params.end());
    std::copy(params.begin(), params.end(), m_params.begin());
    const double a = accuracy(x, y, n);
    std::copy(saved.begin(), saved.end(), m_params.begin());
    return a;
  }

 private:
  static constexpr std::size_t eval_batch = 1000;
  std::vector<float> m_params, m_grads;  // m_params before m_module: the module's tensors point into it
  std::shared_ptr<cnn_module> m_module;
  std::vector<tensor_slice> m_tensors;
  std::vector<torch::Tensor> m_torch_params;  // in m_tensors' order
};

/// The factory examples/common/trainer.hpp calls on each worker: [train]
/// hidden[0] is the width of the fully connected layer.
struct cnn_factory {
  cnn operator()(const train_settings& s, const datasets&) const {
    return cnn(s.hidden.front(), s.seed);
  }
  /// Its input layer is sized for Fashion-MNIST: other images are refused once loaded, before any worker starts.
  void check_data(const datasets& data) const {
    if (data.train.rows != 28 || data.train.cols != 28)
      throw data_error(fmt::format("the CNN takes 28x28 images (Fashion-MNIST's); the data directory holds {}x{} images",
                                   data.train.rows, data.train.cols));
  }
  /// The CNN has one fully connected hidden layer: a longer list is refused, not cut.
  void check(const config& cfg, const train_settings& s) const {
    if (s.hidden.size() != 1) {
      const auto it = cfg.sections.find("train");
      throw config_error(fmt::format("{}: key 'hidden' must hold one width for the CNN (its fully connected layer), e.g. [128]; got {} widths",
                                     it != cfg.sections.end() ? it->second.where("hidden") : cfg.source + " [train]", s.hidden.size()));
    }
  }
};

}  // namespace gossip::examples

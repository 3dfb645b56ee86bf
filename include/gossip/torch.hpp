#pragma once
/// libtorch adapter: a model_view over a torch::nn::Module's parameters, in
/// place (no copy), named as named_parameters() names them.
///
///     auto net = std::make_shared<my_net>();
///     torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
///     gossip::model_view view = gossip::torch_model(*net);
///     gossip::torch_momentum(view, *net, opt);  // optional: quasi-global momentum
///     gossip::engine eng(view, rank, world, cfg, transport);
///     ...; opt.step(); eng.step({.lr = lr, .loss = loss});
///
/// Parameters must be contiguous float32 CPU tensors and keep their storage
/// (update them in place, as the optimizers do). Only built where libtorch is
/// found (meson option `torch`); the rest of libgossip does not include it.
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include "gossip/error.hpp"
#include "gossip/model.hpp"

namespace gossip {

namespace detail {
inline void check_torch_tensor(const std::string& what, const torch::Tensor& t) {
  if (!t.defined()) throw config_error(fmt::format("torch_model: {} is undefined", what));
  if (t.scalar_type() != torch::kFloat32)
    throw config_error(fmt::format("torch_model: {} is {}; the engine exchanges float32 tensors (module->to(torch::kFloat32))", what,
                                   std::string(c10::toString(t.scalar_type()))));
  if (!t.device().is_cpu())
    throw config_error(fmt::format("torch_model: {} is on {}; this adapter takes CPU tensors", what, t.device().str()));
  if (!t.is_contiguous())
    throw config_error(fmt::format("torch_model: {} is not contiguous; the engine reads a tensor's storage as one block", what));
}
}  // namespace detail

namespace detail {
/// named_parameters() without repeats: a module registered twice (a shared
/// layer) lists its parameters under each name, as Python's
/// named_parameters(remove_duplicate=True) does not; the first name is kept.
inline std::vector<std::pair<std::string, torch::Tensor>> unique_parameters(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::unordered_set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true))
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  return out;
}
}  // namespace detail

/// Adds every parameter of `module` (recursively, named as named_parameters()
/// names them, after `prefix`; a parameter shared by two submodules once,
/// under its first name) to `view`.
inline model_view& add_parameters(model_view& view, const torch::nn::Module& module, const std::string& prefix = "") {
  for (const auto& item : detail::unique_parameters(module)) {
    const auto& t = item.second;
    const std::string name = prefix + item.first;
    detail::check_torch_tensor(fmt::format("parameter '{}'", name), t);
    view.add(name, {t.data_ptr<float>(), static_cast<std::size_t>(t.numel())});
    // A weight (dim ≥ 2) is a matrix of size(0) rows, for codecs that factor them.
    if (t.dim() >= 2 && t.numel() > 0) view.matrix(name, static_cast<std::size_t>(t.size(0)), static_cast<std::size_t>(t.numel() / t.size(0)));
  }
  return view;
}

/// A view of every parameter of `module`.
inline model_view torch_model(const torch::nn::Module& module) {
  model_view view;
  add_parameters(view, module);
  return view;
}

/// Registers the heavy-ball momentum buffers of `opt` (an SGD with momentum,
/// not Nesterov) for the parameters of `module` in `view` (added with the same
/// `prefix`), creating them as zeros now — the first step is then the same
/// (β·0 + g) and their address stays fixed. Set [engine] momentum_beta to the
/// optimizer's momentum.
inline model_view& torch_momentum(model_view& view, const torch::nn::Module& module, torch::optim::SGD& opt, const std::string& prefix = "") {
  for (const auto& group : opt.param_groups()) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    if (o.nesterov())
      throw config_error("torch_momentum: the optimizer uses Nesterov momentum; quasi-global momentum is heavy-ball (nesterov(false))");
    if (o.momentum() > 0 && o.dampening() != 0)
      throw config_error(fmt::format("torch_momentum: the optimizer has dampening {}; quasi-global momentum needs 0", o.dampening()));
  }
  auto& state = opt.state();
  for (const auto& item : detail::unique_parameters(module)) {
    const auto& p = item.second;
    const std::string key = c10::guts::to_string(p.unsafeGetTensorImpl());  // how torch::optim::SGD keys its state
    auto it = state.find(key);
    if (it == state.end()) {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(torch::zeros_like(p, torch::MemoryFormat::Contiguous));
      it = state.emplace(key, std::move(s)).first;
    }
    auto& buffer = static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer();
    const std::string name = prefix + item.first;
    detail::check_torch_tensor(fmt::format("the momentum buffer of parameter '{}'", name), buffer);
    view.momentum(name, {buffer.data_ptr<float>(), static_cast<std::size_t>(buffer.numel())});
  }
  return view;
}

}  // namespace gossip

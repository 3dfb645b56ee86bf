#pragma once
/// libtorch adapter: a model_view over a torch::nn::Module's parameters, in
/// place (no copy), named as named_parameters() names them.
///
///     auto net = std::make_shared<my_net>();
///     torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
///     gossip::model_view view = gossip::torch_model(*net);
///     gossip::add_buffers(view, *net);         // optional: BatchNorm's running statistics too
///     gossip::torch_momentum(view, *net, opt);  // optional: quasi-global momentum
///     cfg.follow_momentum(0.9, "the optimizer's momentum");  // [engine] momentum_beta, which the engine checks
///     gossip::engine eng(view, rank, world, cfg, transport);
///     ...; opt.step(); eng.step({.lr = lr, .loss = loss});
///
/// Parameters must be dense, contiguous float32 CPU tensors and keep their
/// storage (update them in place, as the optimizers do). Load checkpoints
/// (torch::load) and convert the module (module->to()) before torch_model():
/// the engine checks at every step that each tensor still has the storage it
/// registered, and refuses one that was given new storage, naming it (it
/// keeps the old storage alive until then, so nothing reads freed memory).
/// The module's tensors, and the optimizer given to torch_momentum, must
/// outlive the engine. Only built where libtorch is found (meson option
/// `torch`); the rest of libgossip does not include it.
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_map>
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

/// How torch::optim keys a parameter's state: libtorch 1.x by the text of
/// its TensorImpl's address (c10::guts::to_string, an ostringstream), 2.1
/// and later by the address itself; `Key` is the state map's key type.
template <class Key>
Key optimizer_state_key(const torch::Tensor& p) {
  if constexpr (std::is_convertible_v<void*, Key>) {
    return p.unsafeGetTensorImpl();
  } else {
    std::ostringstream text;
    text << p.unsafeGetTensorImpl();
    return text.str();
  }
}
inline void check_torch_tensor(const std::string& what, const torch::Tensor& t) {
  if (!t.defined()) throw config_error(fmt::format("torch_model: {} is undefined", what));
  if (t.layout() != torch::kStrided) {
    std::ostringstream layout;
    layout << t.layout();
    throw config_error(fmt::format("torch_model: {} is not dense (layout {}); the engine exchanges dense tensors (tensor.to_dense())", what,
                                   layout.str()));
  }
  if (!t.device().is_cpu())
    throw config_error(fmt::format("torch_model: {} is on {}; this adapter takes CPU tensors (a model in GPU memory goes through a device "
                                   "backend: gossip/cuda.hpp)",
                                   what, t.device().str()));
  if (t.scalar_type() != torch::kFloat32)
    throw config_error(fmt::format("torch_model: {} is {}; the engine exchanges float32 tensors (module->to(torch::kFloat32))", what,
                                   std::string(c10::toString(t.scalar_type()))));
  if (!t.is_contiguous())
    throw config_error(fmt::format("torch_model: {} is not contiguous; the engine reads a tensor's storage as one block: make it contiguous "
                                   "before building the optimizer (p.set_data(p.contiguous()); channels-last modules: "
                                   "module->to(torch::MemoryFormat::Contiguous))",
                                   what));
}

/// A tensor as the view registered it. Holding the tensor and its storage
/// keeps that memory alive while an engine may touch it.
struct torch_registration {
  std::string what;
  torch::Tensor tensor;
  c10::Storage storage;
  const void* data;
  std::int64_t numel;
};

inline torch_registration registered(std::string what, const torch::Tensor& t) {
  return {std::move(what), t, t.storage(), t.data_ptr(), t.numel()};
}

/// The view's guard (model_view::guard) over `kept`: a tensor given new storage
/// (torch::load, module->to(), set_data) or resized since it was registered is refused.
inline void guard_registrations(model_view& view, std::vector<torch_registration> kept) {
  if (kept.empty()) return;
  view.guard([kept = std::make_shared<const std::vector<torch_registration>>(std::move(kept))] {
    for (const auto& r : *kept)
      if (r.tensor.data_ptr() != r.data || r.tensor.numel() != r.numel)
        throw config_error(fmt::format("torch_model: {} has new storage since the view was built (torch::load, module->to() and "
                                       "set_data() give it one); load and convert the module before torch_model(), or build a new "
                                       "view and engine",
                                       r.what));
  });
}

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
  model_view staged = view;  // all or nothing: a refused parameter leaves `view` as it was
  std::vector<detail::torch_registration> kept;
  for (const auto& item : detail::unique_parameters(module)) {
    const auto& t = item.second;
    const std::string name = prefix + item.first;
    detail::check_torch_tensor(fmt::format("parameter '{}'", name), t);
    staged.add(name, {t.data_ptr<float>(), static_cast<std::size_t>(t.numel())});
    // A weight (dim ≥ 2) is a matrix of size(0) rows, for codecs that factor them.
    if (t.dim() >= 2 && t.numel() > 0) staged.matrix(name, static_cast<std::size_t>(t.size(0)), static_cast<std::size_t>(t.numel() / t.size(0)));
    kept.push_back(detail::registered(fmt::format("parameter '{}'", name), t));
  }
  detail::guard_registrations(staged, std::move(kept));
  view = std::move(staged);
  return view;
}

/// Adds the module's float32 buffers (BatchNorm's running_mean and
/// running_var; integer ones such as num_batches_tracked stay local, and a
/// floating buffer of another type is refused, naming it), named
/// as named_buffers() names them after `prefix`, so that they are averaged
/// with the parameters: without them every rank evaluates the averaged
/// weights with running statistics of its own data.
inline model_view& add_buffers(model_view& view, const torch::nn::Module& module, const std::string& prefix = "") {
  model_view staged = view;  // all or nothing: a refused buffer leaves `view` as it was
  std::vector<detail::torch_registration> kept;
  std::unordered_set<const void*> seen;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    const auto& t = item.value();
    if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    const std::string name = prefix + item.key();
    if (t.scalar_type() != torch::kFloat32) {
      // Integer counters stay local; a floating buffer of another type would
      // silently go unaveraged.
      if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()))
        throw config_error(fmt::format("add_buffers: buffer '{}' is {}; the engine averages float32 tensors: convert the module "
                                       "(module->to(torch::kFloat32)), or leave its buffers local (no add_buffers)",
                                       name, c10::toString(t.scalar_type())));
      continue;
    }
    detail::check_torch_tensor(fmt::format("buffer '{}'", name), t);
    staged.add(name, {t.data_ptr<float>(), static_cast<std::size_t>(t.numel())});
    kept.push_back(detail::registered(fmt::format("buffer '{}'", name), t));
  }
  detail::guard_registrations(staged, std::move(kept));
  view = std::move(staged);
  return view;
}

/// A view of every parameter of `module`.
inline model_view torch_model(const torch::nn::Module& module) {
  model_view view;
  add_parameters(view, module);
  return view;
}

/// Registers the heavy-ball momentum buffers of `opt` (an SGD with momentum,
/// not Nesterov, no dampening) for the parameters of `module` in `view`
/// (added with the same `prefix`) that `opt` steps with momentum > 0,
/// creating them as zeros now — the first step is then the same (β·0 + g) and
/// their address stays fixed. Quasi-global momentum rebuilds every buffer with
/// one β and the step's one lr, so the groups with momentum must share both.
/// Records β in the view: an engine that makes the buffers quasi-global
/// refuses an [engine] momentum_beta that differs (config::follow_momentum
/// sets it). An optimizer with no momentum registers nothing. `opt` must
/// outlive the engine: under quasi-global momentum a buffer it replaced
/// (torch::load(opt, …)) is refused at the next step, naming the parameter
/// (under local momentum the engine never touches the buffers, and a
/// checkpoint's may replace them); it must stay where it is (not be
/// moved into another object) while the engine runs. Groups that hold none of
/// the module's parameters are the optimizer's own business and are not looked
/// at. Everything is checked before the optimizer's state or the view change.
inline model_view& torch_momentum(model_view& view, const torch::nn::Module& module, torch::optim::SGD& opt, const std::string& prefix = "") {
  std::unordered_map<const void*, std::string> name_of;
  for (const auto& item : detail::unique_parameters(module)) name_of.emplace(item.second.unsafeGetTensorImpl(), prefix + item.first);
  std::optional<double> beta, lr;
  std::vector<torch::Tensor> stepped;  // the module's parameters the optimizer steps with momentum
  std::size_t index = 0;
  for (const auto& group : opt.param_groups()) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    const bool ours = std::any_of(group.params().begin(), group.params().end(),
                                  [&](const torch::Tensor& p) { return name_of.count(p.unsafeGetTensorImpl()) > 0; });
    if (!ours) {
      ++index;
      continue;
    }
    if (o.nesterov())
      throw config_error("torch_momentum: the optimizer uses Nesterov momentum; quasi-global momentum is heavy-ball (nesterov(false))");
    if (o.momentum() > 0 && o.dampening() != 0)
      throw config_error(fmt::format("torch_momentum: the optimizer has dampening {}; quasi-global momentum needs 0", o.dampening()));
    if (o.momentum() > 0) {
      if (beta && *beta != o.momentum())
        throw config_error(fmt::format("torch_momentum: the optimizer's param groups use momentum {} and {} (group {}); quasi-global "
                                       "momentum rebuilds every buffer with one β: use one, or keep momentum local",
                                       *beta, o.momentum(), index));
      if (lr && *lr != o.lr())
        throw config_error(fmt::format("torch_momentum: the optimizer's param groups with momentum use lr {} and {} (group {}); "
                                       "quasi-global momentum rebuilds every buffer with the step's one lr: use one, or keep momentum local",
                                       *lr, o.lr(), index));
      beta = o.momentum(), lr = o.lr();
      for (const auto& p : group.params())
        if (name_of.count(p.unsafeGetTensorImpl())) stepped.push_back(p);
    }
    ++index;
  }
  if (!beta) {  // plain SGD (for this module's parameters): no buffers
    const bool any = std::any_of(opt.param_groups().begin(), opt.param_groups().end(), [&](const auto& group) {
      return std::any_of(group.params().begin(), group.params().end(),
                         [&](const torch::Tensor& p) { return name_of.count(p.unsafeGetTensorImpl()) > 0; });
    });
    if (!any)
      throw config_error("torch_momentum: the optimizer steps none of the module's parameters (an optimizer of another module?); give "
                         "the optimizer that trains this module");
    return view;
  }
  if (!(*beta < 1))
    throw config_error(fmt::format("torch_momentum: the optimizer's momentum is {}; quasi-global momentum takes one in (0, 1)", *beta));
  for (const auto& p : stepped) {
    const std::string& name = name_of.at(p.unsafeGetTensorImpl());
    const auto t = view.find(name);
    if (!t)
      throw config_error(fmt::format("torch_momentum: the view has no tensor '{}'; add the module's parameters first (torch_model, or "
                                     "add_parameters with the same prefix)",
                                     name));
    if (view[*t].data != p.data_ptr())
      throw config_error(fmt::format("torch_momentum: the view's tensor '{}' is not the module's parameter of that name (a view of "
                                     "another module, or of a copy?); give the module and optimizer the view was built from",
                                     name));
    if (view[*t].momentum)
      throw config_error(fmt::format("torch_momentum: tensor '{}' has a momentum buffer already; register one optimizer's buffers per tensor",
                                     name));
  }
  auto& state = opt.state();
  using state_key = typename std::remove_reference_t<decltype(state)>::key_type;
  // Buffers the optimizer made already (it stepped before) are checked before
  // any is created, so that a refused one leaves the optimizer as it was.
  for (const auto& p : stepped)
    if (const auto it = state.find(detail::optimizer_state_key<state_key>(p)); it != state.end()) {
      const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get());
      if (s && s->momentum_buffer().defined())
        detail::check_torch_tensor(fmt::format("the momentum buffer of parameter '{}'", name_of.at(p.unsafeGetTensorImpl())),
                                   s->momentum_buffer());
    }
  model_view staged = view;  // all or nothing, as add_parameters
  std::vector<std::pair<state_key, const void*>> keys;  // (state key, the buffer registered)
  std::vector<detail::torch_registration> kept;
  for (const auto& p : stepped) {
    const state_key key = detail::optimizer_state_key<state_key>(p);  // how torch::optim::SGD keys its state
    auto it = state.find(key);
    if (it == state.end()) {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(torch::zeros_like(p, torch::MemoryFormat::Contiguous));
      it = state.emplace(key, std::move(s)).first;
    }
    auto& buffer = static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer();
    const std::string& name = name_of.at(p.unsafeGetTensorImpl());
    const std::string what = fmt::format("the momentum buffer of parameter '{}'", name);
    detail::check_torch_tensor(what, buffer);
    staged.momentum(name, {buffer.data_ptr<float>(), static_cast<std::size_t>(buffer.numel())});
    keys.emplace_back(key, buffer.data_ptr());
    kept.push_back(detail::registered(what, buffer));
  }
  staged.momentum_beta(*beta);
  // A buffer the optimizer replaced (torch::load(opt, …)) would leave the
  // engine rebuilding one nobody reads; under local momentum the engine
  // leaves the buffers alone, and a replaced one is the optimizer's business.
  staged.momentum_guard([&opt, keys = std::move(keys), kept = std::make_shared<const std::vector<detail::torch_registration>>(std::move(kept))] {
    auto& now = opt.state();
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const auto it = now.find(keys[i].first);
      const auto* s = it == now.end() ? nullptr : dynamic_cast<const torch::optim::SGDParamState*>(it->second.get());
      if (!s || !s->momentum_buffer().defined() || s->momentum_buffer().data_ptr() != keys[i].second)
        throw config_error(fmt::format("torch_momentum: the optimizer replaced {} (torch::load(opt, …) does); load the optimizer before "
                                       "torch_momentum(), or build a new view and engine",
                                       (*kept)[i].what));
    }
  });
  view = std::move(staged);
  return view;
}

}  // namespace gossip

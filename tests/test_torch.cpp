// gossip/torch.hpp: model views over libtorch modules, momentum buffers, and
// two engines (threads, loopback) averaging two modules in place. Debian's
// libtorch brings glog, whose CHECK replaces doctest's: DOCTEST_* throughout.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <thread>
#include <vector>

#include "gossip/gossip.hpp"
#include "gossip/torch.hpp"

namespace {

struct two_layers : torch::nn::Module {
  two_layers() : fc1(register_module("fc1", torch::nn::Linear(4, 3))), fc2(register_module("fc2", torch::nn::Linear(3, 2))) {}
  torch::nn::Linear fc1, fc2;
};

// Engines of `world` ranks as threads over loopback, periodic every step for
// 20 steps, then finish(): `view_of(r)` is rank r's model view.
template <class ViewOf>
void average_in_threads(int world, const ViewOf& view_of) {
  gossip::loopback_fabric fabric(world);
  gossip::config cfg;
  cfg.policy.name = "periodic";
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      gossip::engine eng(view_of(r), r, world, cfg, fabric.endpoint(r));
      for (int t = 0; t < 20; ++t) eng.step({.lr = 0.1});
      eng.finish();
    });
  for (auto& t : threads) t.join();
}

}  // namespace

TEST_CASE("torch_model views every parameter in place, by its torch name") {
  two_layers net;
  const auto view = gossip::torch_model(net);
  DOCTEST_REQUIRE(view.size() == 4);
  const std::vector<std::string> names = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  const auto params = net.named_parameters();
  for (std::size_t i = 0; i < names.size(); ++i) {
    DOCTEST_CHECK(view[i].name == names[i]);
    DOCTEST_CHECK(view[i].data == params[names[i]].data_ptr<float>());
    DOCTEST_CHECK(view[i].count == static_cast<std::size_t>(params[names[i]].numel()));
    // Weights are declared size(0) × the rest, for codecs that factor matrices; biases are not.
    DOCTEST_CHECK(view[i].rows == (i % 2 == 0 ? static_cast<std::size_t>(params[names[i]].size(0)) : 0));
  }
  gossip::model_view prefixed;
  gossip::add_parameters(prefixed, net, "student.");
  DOCTEST_CHECK(prefixed[0].name == "student.fc1.weight");
}

TEST_CASE("a layer registered twice is one tensor of the view, under its first name") {
  struct shared : torch::nn::Module {
    shared() : fc(register_module("fc", torch::nn::Linear(4, 4))) { register_module("again", fc); }
    torch::nn::Linear fc;
  } net;
  DOCTEST_REQUIRE(net.named_parameters().size() == 4);  // libtorch lists fc's two tensors under both names
  auto view = gossip::torch_model(net);
  DOCTEST_REQUIRE(view.size() == 2);
  DOCTEST_CHECK(view[0].name == "fc.weight");
  DOCTEST_CHECK(view[1].name == "fc.bias");
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  DOCTEST_CHECK_NOTHROW(gossip::torch_momentum(view, net, opt));
  DOCTEST_CHECK(view[1].momentum != nullptr);
}

TEST_CASE("torch_model refuses a parameter it cannot use, naming it") {
  two_layers net;
  net.to(torch::kFloat64);
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::torch_model(net), doctest::Contains("parameter 'fc1.weight' is Double"), gossip::config_error);
  two_layers strided;
  {
    const torch::NoGradGuard no_grad;
    strided.fc1->weight.set_data(torch::zeros({4, 3}).t());  // 3x4, transposed: not contiguous
  }
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::torch_model(strided), doctest::Contains("parameter 'fc1.weight' is not contiguous"), gossip::config_error);

  // All or nothing: a refused parameter after good ones leaves the view as it was.
  two_layers mixed;
  mixed.fc2->to(torch::kFloat64);
  std::vector<float> own(3);
  gossip::model_view view;
  view.add("own", {own.data(), own.size()});
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::add_parameters(view, mixed, "m."), doctest::Contains("parameter 'm.fc2.weight' is Double"),
                               gossip::config_error);
  DOCTEST_CHECK(view.size() == 1);
  DOCTEST_CHECK(view.guards().empty());
  struct with_double : torch::nn::Module {
    torch::Tensor good = register_buffer("good", torch::zeros({3}));
    torch::Tensor ema = register_buffer("ema", torch::zeros({3}, torch::kFloat64));
  } d;
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::add_buffers(view, d), doctest::Contains("buffer 'ema' is Double"), gossip::config_error);
  DOCTEST_CHECK(view.size() == 1);

  // An optimizer that stepped already, one of whose buffers the view cannot
  // take (fc2.weight's, after fc1's good ones): nothing is registered.
  two_layers stepped;
  torch::optim::SGD opt(stepped.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  stepped.fc2->forward(stepped.fc1->forward(torch::ones({5, 4}))).sum().backward();
  opt.step();
  for (auto& [key, state] : opt.state()) {
    auto& sgd = static_cast<torch::optim::SGDParamState&>(*state);
    if (sgd.momentum_buffer().dim() == 2 && sgd.momentum_buffer().size(0) == 2) sgd.momentum_buffer(torch::zeros({3, 2}).t());
  }
  auto net_view = gossip::torch_model(stepped);
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::torch_momentum(net_view, stepped, opt),
                               doctest::Contains("the momentum buffer of parameter 'fc2.weight' is not contiguous"), gossip::config_error);
  for (const auto& t : net_view.tensors()) DOCTEST_CHECK(t.momentum == nullptr);
  DOCTEST_CHECK(net_view.momentum_guards().empty());
}

TEST_CASE("torch_momentum registers SGD's buffers, which the optimizer then updates in place") {
  two_layers net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto view = gossip::torch_model(net);
  gossip::torch_momentum(view, net, opt);
  std::vector<float*> buffers;
  for (const auto& t : view.tensors()) {
    DOCTEST_REQUIRE(t.momentum != nullptr);
    buffers.push_back(t.momentum);
  }
  const auto loss = net.fc2->forward(net.fc1->forward(torch::ones({5, 4}))).sum();
  loss.backward();
  opt.step();
  // The first step left β·0 + g in the buffers the view points at.
  const auto g = net.fc2->bias.grad();
  DOCTEST_CHECK(buffers[3][0] == doctest::Approx(g[0].item<float>()));
  DOCTEST_CHECK(buffers[3][1] == doctest::Approx(g[1].item<float>()));

  torch::optim::SGD nesterov(net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::torch_momentum(view, net, nesterov), doctest::Contains("Nesterov"), gossip::config_error);

  // The module and optimizer of another network with the same names and
  // shapes: refused before the optimizer's state or the view change.
  two_layers other;
  torch::optim::SGD theirs(other.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto fresh = gossip::torch_model(net);
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::torch_momentum(fresh, other, theirs),
                               doctest::Contains("the view's tensor 'fc1.weight' is not the module's parameter of that name"), gossip::config_error);
  DOCTEST_CHECK(theirs.state().empty());
  for (const auto& t : fresh.tensors()) DOCTEST_CHECK(t.momentum == nullptr);
}

TEST_CASE("two engines average two libtorch modules in place") {
  const int world = 2;
  std::vector<two_layers> nets(world);
  {
    const torch::NoGradGuard no_grad;
    for (int r = 0; r < world; ++r)
      for (auto& p : nets[static_cast<std::size_t>(r)].parameters()) p.fill_(static_cast<float>(r + 1));  // 1 and 2
  }
  average_in_threads(world, [&](int r) { return gossip::torch_model(nets[static_cast<std::size_t>(r)]); });
  for (auto& net : nets)
    for (const auto& p : net.parameters()) DOCTEST_CHECK(p.mean().item<float>() == doctest::Approx(1.5).epsilon(1e-3));
}

TEST_CASE("a tensor given new storage after registration is refused by name, before the engine reads it") {
  gossip::config cfg;
  cfg.policy.name = "periodic";
  {  // set_data (module->to() and torch::load do the same) between the view and the engine
    two_layers net;
    auto view = gossip::torch_model(net);
    {
      const torch::NoGradGuard no_grad;
      net.fc2->bias.set_data(torch::zeros({2}));
    }
    gossip::loopback_fabric fabric(1);
    DOCTEST_CHECK_THROWS_WITH_AS(gossip::engine(view, 0, 1, cfg, fabric.endpoint(0)),
                                 doctest::Contains("parameter 'fc2.bias' has new storage since the view was built"), gossip::config_error);
  }
  {  // after the engine: refused at the next step
    two_layers net;
    gossip::loopback_fabric fabric(1);
    gossip::engine eng(gossip::torch_model(net), 0, 1, cfg, fabric.endpoint(0));
    eng.step({.lr = 0.1});
    {
      const torch::NoGradGuard no_grad;
      net.fc1->weight.set_(torch::zeros({3, 4}));  // as torch::load(module, …) does
    }
    DOCTEST_CHECK_THROWS_WITH_AS(eng.step({.lr = 0.1}), doctest::Contains("parameter 'fc1.weight' has new storage"), gossip::config_error);
  }
  {  // a sparse parameter is named
    struct sparse : torch::nn::Module {
      sparse() { register_parameter("w", torch::eye(3).to_sparse()); }
    } net;
    DOCTEST_CHECK_THROWS_WITH_AS(gossip::torch_model(net), doctest::Contains("parameter 'w' is not dense"), gossip::config_error);
  }
}

TEST_CASE("torch_momentum registers what the optimizer steps, with one β the engine checks") {
  gossip::config cfg;
  cfg.policy.name = "periodic";
  cfg.engine.set("momentum", std::string("quasi-global"));
  {  // a frozen first layer: only fc2's buffers
    two_layers net;
    torch::optim::SGD opt(net.fc2->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
    auto view = gossip::torch_model(net);
    gossip::torch_momentum(view, net, opt);
    DOCTEST_CHECK(view[0].momentum == nullptr);
    DOCTEST_CHECK(view[2].momentum != nullptr);
    DOCTEST_CHECK(opt.state().size() == 2);
    DOCTEST_CHECK(view.momentum_beta() == 0.5);
    // [engine] momentum_beta (0.9 by default) differs from the optimizer's 0.5: refused; following it works.
    gossip::loopback_fabric fabric(1);
    DOCTEST_CHECK_THROWS_WITH_AS(gossip::engine(view, 0, 1, cfg, fabric.endpoint(0)),
                                 doctest::Contains("the optimizer's momentum is 0.5 but [engine] momentum_beta is 0.9"), gossip::config_error);
    auto followed = cfg;
    followed.follow_momentum(0.5, "the optimizer's momentum");
    gossip::loopback_fabric again(1);
    gossip::engine eng(view, 0, 1, followed, again.endpoint(0));
    eng.step({.lr = 0.1});
    // The optimizer's state replaced (torch::load(opt, …)): refused at the next step.
    opt.state().clear();
    DOCTEST_CHECK_THROWS_WITH_AS(eng.step({.lr = 0.1}), doctest::Contains("the optimizer replaced the momentum buffer of parameter 'fc2.weight'"),
                                 gossip::config_error);
  }
  {  // under local momentum the engine leaves the buffers alone: the optimizer may replace them
    two_layers net;
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto view = gossip::torch_model(net);
    gossip::torch_momentum(view, net, opt);
    auto local = cfg;
    local.engine.set("momentum", std::string("local"));
    gossip::loopback_fabric fabric(1);
    gossip::engine eng(view, 0, 1, local, fabric.endpoint(0));
    eng.step({.lr = 0.1});
    opt.state().clear();
    DOCTEST_CHECK_NOTHROW(eng.step({.lr = 0.1}));
  }
  two_layers net;
  auto view = gossip::torch_model(net);
  torch::optim::SGD plain(net.parameters(), torch::optim::SGDOptions(0.1));
  gossip::torch_momentum(view, net, plain);  // no momentum: nothing to register
  DOCTEST_CHECK(view[0].momentum == nullptr);
  DOCTEST_CHECK_FALSE(view.momentum_beta());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(net.fc1->parameters(), std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1).momentum(0.9)));
  groups.emplace_back(net.fc2->parameters(), std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.01).momentum(0.9)));
  torch::optim::SGD two_lr(groups, torch::optim::SGDOptions(0.1));
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::torch_momentum(view, net, two_lr), doctest::Contains("use lr 0.1 and 0.01"), gossip::config_error);
  {  // a group of another module's parameters is the optimizer's own business: its lr and momentum are not looked at
    two_layers extra;
    std::vector<torch::optim::OptimizerParamGroup> mixed;
    mixed.emplace_back(net.parameters(), std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1).momentum(0.9)));
    mixed.emplace_back(extra.parameters(), std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.01).momentum(0.5)));
    torch::optim::SGD both(mixed, torch::optim::SGDOptions(0.1));
    auto v = gossip::torch_model(net);
    DOCTEST_CHECK_NOTHROW(gossip::torch_momentum(v, net, both));
    DOCTEST_CHECK(v.momentum_beta() == 0.9);
    DOCTEST_CHECK(both.state().size() == 4);  // the module's four; the other group's buffers are the optimizer's to create
  }
  two_layers other;
  torch::optim::SGD foreign(other.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::torch_momentum(view, net, foreign), doctest::Contains("steps none of the module's parameters"),
                               gossip::config_error);
  torch::optim::SGD first(net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  gossip::torch_momentum(view, net, first);
  torch::optim::SGD second(net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::torch_momentum(view, net, second), doctest::Contains("has a momentum buffer already"), gossip::error);
}

TEST_CASE("add_buffers averages BatchNorm's running statistics with the parameters") {
  struct with_bn : torch::nn::Module {
    with_bn() : bn(register_module("bn", torch::nn::BatchNorm1d(3))) {}
    torch::nn::BatchNorm1d bn;
  };
  const int world = 2;
  std::vector<with_bn> nets(world);
  {
    const torch::NoGradGuard no_grad;
    for (int r = 0; r < world; ++r) nets[static_cast<std::size_t>(r)].bn->running_mean.fill_(static_cast<float>(r));  // 0 and 1
  }
  auto view = gossip::torch_model(nets[0]);
  gossip::add_buffers(view, nets[0]);
  DOCTEST_REQUIRE(view.size() == 4);  // weight, bias, running_mean, running_var (num_batches_tracked is int64: local)
  DOCTEST_CHECK(view[2].name == "bn.running_mean");
  average_in_threads(world, [&](int r) {
    auto& net = nets[static_cast<std::size_t>(r)];
    auto v = gossip::torch_model(net);
    gossip::add_buffers(v, net);
    return v;
  });
  for (auto& net : nets) DOCTEST_CHECK(net.bn->running_mean.mean().item<float>() == doctest::Approx(0.5).epsilon(1e-3));

  // A float64 buffer is refused by name rather than left unaveraged.
  struct with_double : torch::nn::Module {
    torch::Tensor ema = register_buffer("ema", torch::zeros({3}, torch::kFloat64));
  } d;
  gossip::model_view dv;
  DOCTEST_CHECK_THROWS_WITH_AS(gossip::add_buffers(dv, d), doctest::Contains("buffer 'ema' is Double"), gossip::config_error);
}

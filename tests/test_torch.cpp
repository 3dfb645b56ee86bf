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
}

TEST_CASE("two engines average two libtorch modules in place") {
  const int world = 2;
  gossip::loopback_fabric fabric(world);
  gossip::config cfg;
  cfg.policy.name = "periodic";
  std::vector<two_layers> nets(world);
  {
    const torch::NoGradGuard no_grad;
    for (int r = 0; r < world; ++r)
      for (auto& p : nets[static_cast<std::size_t>(r)].parameters()) p.fill_(static_cast<float>(r + 1));  // 1 and 2
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      gossip::engine eng(gossip::torch_model(nets[static_cast<std::size_t>(r)]), r, world, cfg, fabric.endpoint(r));
      for (int t = 0; t < 20; ++t) eng.step({.lr = 0.1});
      eng.finish();
    });
  for (auto& t : threads) t.join();
  for (auto& net : nets)
    for (const auto& p : net.parameters()) DOCTEST_CHECK(p.mean().item<float>() == doctest::Approx(1.5).epsilon(1e-3));
}

// Decentralized training of a small libtorch CNN on Fashion-MNIST with
// drift-triggered gossip: example 01's loop, config format and report, with
// the model in libtorch (gossip/torch.hpp gives the engine its parameters).
//
//   libtorch_cnn --config examples/03_libtorch_cnn/libtorch_cnn.toml
//   libtorch_cnn --policy periodic --workers 4 --epochs 1 --set train.train_limit=16000
#include <torch/torch.h>

#include "03_libtorch_cnn/cnn.hpp"
#include "common/fashion_mnist_app.hpp"

int main(int argc, char** argv) {
  torch::set_num_threads(1);  // the workers are threads (or processes) already
  return gossip::examples::fashion_mnist_main(argc, argv,
                                              "Train a small CNN (libtorch) on Fashion-MNIST across workers that gossip only when their "
                                              "model drifted.",
                                              "Fashion-MNIST CNN (libtorch)", gossip::examples::cnn_factory{});
}

// Decentralized training of an MLP on Fashion-MNIST with drift-triggered gossip.
//
//   fashion_mnist --config examples/01_fashion_mnist/fashion_mnist.toml
//   fashion_mnist --policy periodic --workers 8 --epochs 2 --partition by_label
//
// Each worker runs SGD with momentum on its shard and calls engine.step()
// after every optimizer step; the engine decides when to gossip.
#include "common/fashion_mnist_app.hpp"

int main(int argc, char** argv) {
  return gossip::examples::fashion_mnist_main(argc, argv, "Train an MLP on Fashion-MNIST across workers that gossip only when their model drifted.",
                                              "Fashion-MNIST");
}

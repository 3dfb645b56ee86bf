# Sourced by the tests that train on Fashion-MNIST: exits 77 (SKIP) with the
# reason when its files are not where the programs will look for them
# (GOSSIP_FASHION_MNIST_DIR, else the directory this build was configured with,
# which meson passes as GOSSIP_TEST_DATA_DIR).
gossip_data_dir=${GOSSIP_FASHION_MNIST_DIR:-${GOSSIP_TEST_DATA_DIR:-/usr/share/datasets/fashion-mnist}}
if [[ ! -f $gossip_data_dir/train-images-idx3-ubyte.gz ]]; then
  echo "SKIP: no Fashion-MNIST in $gossip_data_dir (apt-get install dataset-fashion-mnist, or set GOSSIP_FASHION_MNIST_DIR)"
  exit 77
fi

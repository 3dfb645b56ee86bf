#pragma once
/// Datasets for the examples and experiments: an IDX reader (the format of
/// MNIST and Fashion-MNIST) and partitioning of a dataset across workers.
///
///     auto train = gossip::data::load_fashion_mnist(/*train=*/true);
///     auto shares = gossip::data::partition(train, /*workers=*/8,
///                                           gossip::data::partition_kind::by_label, /*seed=*/1);
///     // shares[w] lists the sample indices worker w trains on.
///
/// Every failure to read a file throws gossip::data_error naming the path and
/// the problem; a missing Fashion-MNIST says which Debian package provides it.
///
/// Not part of libgossip: a program that links the library into its own loop
/// brings its own data. The examples, benches, tests and fuzz targets link
/// this reader from examples/common (example_data_dep in its meson.build).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gossip::data {

/// Labelled images, pixels scaled to [0, 1].
///
/// Layout: sample-per-row, row-major. Sample i occupies
/// images[i * features() .. (i + 1) * features()), and within a sample pixel
/// (r, c) is at r * cols + c. Seen by Eigen this is a column-major
/// features() x size() matrix, one sample per column:
///
///     Eigen::Map<const Eigen::MatrixXf> x(ds.images.data(), ds.features(), ds.size());
struct dataset {
  std::size_t rows = 0, cols = 0;
  std::vector<float> images;         ///< size() * rows * cols
  std::vector<std::uint8_t> labels;  ///< size(), each < 10

  std::size_t size() const noexcept { return labels.size(); }
  std::size_t features() const noexcept { return rows * cols; }
  /// The pixels of sample i.
  std::span<const float> image(std::size_t i) const noexcept {
    return {images.data() + i * features(), features()};
  }
};

/// Reads a pair of IDX files (gzipped or not): images with magic 0x00000803
/// (uint8, count x rows x cols) and labels with magic 0x00000801 (uint8, count).
/// Throws data_error on a missing file, wrong magic, implausible dimensions
/// (rows/cols outside 1..4096, more than 10M samples), truncated data, a count
/// mismatch between the two files, or a label >= 10.
dataset read_idx(const std::string& images_gz, const std::string& labels_gz);

/// Where Fashion-MNIST is looked for: $GOSSIP_FASHION_MNIST_DIR if set and not
/// empty, else the build default (meson option fashion_mnist_dir, normally
/// /usr/share/datasets/fashion-mnist from the package dataset-fashion-mnist).
std::string fashion_mnist_dir();

/// Loads {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz from dir (falls back
/// to the uncompressed names when the .gz files are absent).
dataset load_fashion_mnist(bool train, const std::string& dir = fashion_mnist_dir());

/// Copies the samples named by idx into contiguous buffers (x: idx.size() *
/// features() floats in the dataset's layout, y: idx.size() labels), so a
/// minibatch drawn from a partition can be handed to a model in one piece.
void gather(const dataset& ds, std::span<const std::uint32_t> idx, float* x, std::uint8_t* y);

enum class partition_kind {
  iid,        ///< seeded shuffle, then equal contiguous shares
  by_label,   ///< non-iid: each worker gets shards of label-sorted data (McMahan et al. 2017)
  dirichlet,  ///< non-iid: each class split among workers by Dir(alpha) proportions (Hsu et al. 2019)
};

std::string_view to_string(partition_kind kind) noexcept;
/// "iid", "by_label" (also "non_iid") or "dirichlet"; throws config_error naming the value otherwise.
partition_kind parse_partition_kind(std::string_view name);

/// How a partition is drawn beyond its kind and seed.
struct partition_options {
  int classes_per_worker = 2;    ///< by_label: shards (about classes) per worker
  double dirichlet_alpha = 0.1;  ///< dirichlet: concentration; 0.1 is strongly skewed, large is nearly iid
  std::size_t min_samples = 1;   ///< dirichlet: every worker ends with at least this many samples
};

/// Splits the sample indices of ds among workers; result[w] is worker w's share.
///
/// iid: a seeded Fisher–Yates shuffle cut into workers contiguous shares whose
/// sizes differ by at most one.
/// by_label: samples are shuffled, stably sorted by label, cut into
/// workers * classes_per_worker equal shards, and the shards are dealt to
/// workers after a seeded shuffle, so each worker sees about
/// classes_per_worker classes (exactly at most that many when every class
/// size is a multiple of the shard size).
/// dirichlet: for each class, its (shuffled) samples are cut among the workers
/// in proportions p ~ Dir(alpha, …, alpha) drawn afresh per class, so shard
/// sizes and class mixes are very unequal for small alpha. Then any worker
/// left with fewer than min_samples samples takes samples, chosen at random,
/// from the largest share until it has min_samples (with alpha = 0.1 and 16
/// workers on Fashion-MNIST that moves a few dozen samples, when any).
///
/// Deterministic for a given seed on every platform (mt19937_64 and our own
/// shuffle and Gamma sampler, not std::shuffle or std::gamma_distribution).
/// Throws gossip::config_error when workers < 1, workers > ds.size(),
/// classes_per_worker < 1, there are fewer samples than shards (by_label),
/// alpha is not > 0 or workers * min_samples > ds.size() (dirichlet).
std::vector<std::vector<std::uint32_t>> partition(const dataset& ds, int workers, partition_kind kind,
                                                  std::uint64_t seed, const partition_options& opts);
/// The same with default options and the given classes_per_worker.
std::vector<std::vector<std::uint32_t>> partition(const dataset& ds, int workers, partition_kind kind,
                                                  std::uint64_t seed, int classes_per_worker = 2);

}  // namespace gossip::data

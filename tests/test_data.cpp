// The IDX reader, partitioning, and the example MLP.
//
// Eigen's runtime allocation check is on in this file so a test can assert
// that a training step makes no heap allocation of its own; an Eigen
// assertion throws here instead of aborting the test binary.
#define EIGEN_RUNTIME_NO_MALLOC
#include <stdexcept>
#define eigen_assert(x)                                              \
  do {                                                               \
    if (!(x)) throw std::logic_error("Eigen assertion failed: " #x); \
  } while (0)

#include <doctest/doctest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../examples/common/batch_stream.hpp"
#include "../examples/common/data.hpp"
#include "../examples/common/epoch_exchange.hpp"
#include "../examples/common/local_sgd.hpp"
#include "../examples/common/mlp.hpp"
#include "gossip/error.hpp"
#include "harness.hpp"

namespace fs = std::filesystem;
using gossip::data::partition_kind;
using gossip::examples::mlp;

namespace {

using bytes = std::vector<unsigned char>;

void put_be32(bytes& b, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<unsigned char>(v >> s));
}

bytes idx_images(std::uint32_t magic, std::uint32_t n, std::uint32_t rows, std::uint32_t cols,
                 std::size_t pixels_present) {
  bytes b;
  put_be32(b, magic);
  put_be32(b, n);
  put_be32(b, rows);
  put_be32(b, cols);
  for (std::size_t i = 0; i < pixels_present; ++i)
    b.push_back(static_cast<unsigned char>((i * 37 + 11) % 256));
  return b;
}

bytes idx_labels(std::uint32_t magic, std::uint32_t n, const std::vector<std::uint8_t>& labels) {
  bytes b;
  put_be32(b, magic);
  put_be32(b, n);
  b.insert(b.end(), labels.begin(), labels.end());
  return b;
}

struct temp_dir {
  fs::path path;
  temp_dir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("gossip_test_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void write_gz(const std::string& path, const bytes& data) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  if (!data.empty())
    REQUIRE(gzwrite(f, data.data(), static_cast<unsigned>(data.size())) == static_cast<int>(data.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

void write_raw(const std::string& path, const bytes& data) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  REQUIRE(out.good());
}

// The message of the data_error that read_idx throws, or "" when it does not throw.
std::string read_error(const std::string& images, const std::string& labels) {
  try {
    (void)gossip::data::read_idx(images, labels);
  } catch (const gossip::data_error& e) {
    return e.what();
  }
  return "";
}

const std::vector<std::uint8_t> five_labels = {3, 0, 9, 1, 4};

// A dataset of n samples with one pixel each (partition only looks at labels).
gossip::data::dataset labelled(const std::vector<std::uint8_t>& labels) {
  gossip::data::dataset ds;
  ds.rows = ds.cols = 1;
  ds.labels = labels;
  ds.images.assign(labels.size(), 0.0f);
  return ds;
}

std::vector<std::uint8_t> balanced_labels(std::size_t per_class, int classes) {
  std::vector<std::uint8_t> l;
  for (std::size_t i = 0; i < per_class; ++i)
    for (int c = 0; c < classes; ++c) l.push_back(static_cast<std::uint8_t>(c));
  return l;
}

// Gaussian blobs in `dims` dimensions, one per class, well separated; the
// seed picks the samples, the centers are fixed.
struct blobs {
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  blobs(int n, int dims, int classes, std::uint64_t seed) {
    std::mt19937_64 center_rng(1234), rng(seed);  // same centers for every sample set
    std::normal_distribution<float> noise(0.0f, 0.3f);
    std::vector<float> centers(static_cast<std::size_t>(classes * dims));
    std::uniform_real_distribution<float> c(-2.0f, 2.0f);
    for (auto& v : centers) v = c(center_rng);
    for (int i = 0; i < n; ++i) {
      const int label = i % classes;
      y.push_back(static_cast<std::uint8_t>(label));
      for (int d = 0; d < dims; ++d)
        x.push_back(centers[static_cast<std::size_t>(label * dims + d)] + noise(rng));
    }
  }
};

}  // namespace

TEST_SUITE("idx") {
  TEST_CASE("a gzipped IDX pair round-trips") {
    temp_dir dir;
    const auto img = dir.file("img.gz"), lab = dir.file("lab.gz");
    write_gz(img, idx_images(0x803, 5, 3, 4, 5 * 3 * 4));
    write_gz(lab, idx_labels(0x801, 5, five_labels));
    const auto ds = gossip::data::read_idx(img, lab);
    CHECK(ds.size() == 5);
    CHECK(ds.rows == 3);
    CHECK(ds.cols == 4);
    CHECK(ds.features() == 12);
    REQUIRE(ds.images.size() == 60);
    CHECK(ds.labels == five_labels);
    for (std::size_t i = 0; i < 60; ++i)
      CHECK(ds.images[i] == static_cast<float>((i * 37 + 11) % 256) / 255.0f);
    CHECK(ds.image(2).data() == ds.images.data() + 24);
    CHECK(*std::max_element(ds.images.begin(), ds.images.end()) <= 1.0f);
  }

  TEST_CASE("uncompressed IDX files are read too") {
    temp_dir dir;
    const auto img = dir.file("img"), lab = dir.file("lab");
    write_raw(img, idx_images(0x803, 5, 2, 2, 20));
    write_raw(lab, idx_labels(0x801, 5, five_labels));
    const auto ds = gossip::data::read_idx(img, lab);
    CHECK(ds.size() == 5);
    CHECK(ds.images[1] == 48.0f / 255.0f);
  }

  TEST_CASE("an empty but well-formed pair gives an empty dataset") {
    temp_dir dir;
    write_gz(dir.file("i.gz"), idx_images(0x803, 0, 28, 28, 0));
    write_gz(dir.file("l.gz"), idx_labels(0x801, 0, {}));
    const auto ds = gossip::data::read_idx(dir.file("i.gz"), dir.file("l.gz"));
    CHECK(ds.size() == 0);
    CHECK(ds.images.empty());
  }

  TEST_CASE("a missing file names the path and the directory it was looked for in") {
    temp_dir dir;
    write_gz(dir.file("lab.gz"), idx_labels(0x801, 5, five_labels));
    const auto msg = read_error(dir.file("nope.gz"), dir.file("lab.gz"));
    CHECK(msg.find(dir.file("nope.gz")) != std::string::npos);
    // Neither the package's directory nor GOSSIP_FASHION_MNIST_DIR's: the one given is named.
    CHECK(msg.find(fmt::format("the directory '{}' was given", dir.path.string())) != std::string::npos);

    const auto dir_msg = read_error(dir.path.string(), dir.file("lab.gz"));
    CHECK(dir_msg.find("is a directory") != std::string::npos);

    const auto load_msg = [&] {
      try {
        (void)gossip::data::load_fashion_mnist(false, dir.file("no_such_dir"));
      } catch (const gossip::data_error& e) {
        return std::string(e.what());
      }
      return std::string();
    }();
    CHECK(load_msg.find(dir.file("no_such_dir") + "/t10k-images-idx3-ubyte.gz") != std::string::npos);
    CHECK(load_msg.find(fmt::format("the directory '{}' was given", dir.file("no_such_dir"))) != std::string::npos);
    // The same directory from GOSSIP_FASHION_MNIST_DIR (with a trailing slash): the variable is named.
    const char* old = std::getenv("GOSSIP_FASHION_MNIST_DIR");
    const std::string saved = old ? old : "";
    ::setenv("GOSSIP_FASHION_MNIST_DIR", (dir.file("no_such_dir") + "/").c_str(), 1);
    try {
      (void)gossip::data::load_fashion_mnist(false);
      FAIL("a missing directory was accepted");
    } catch (const gossip::data_error& e) {
      CHECK(std::string(e.what()).find("GOSSIP_FASHION_MNIST_DIR is set to") != std::string::npos);
    }
    if (old)
      ::setenv("GOSSIP_FASHION_MNIST_DIR", saved.c_str(), 1);
    else
      ::unsetenv("GOSSIP_FASHION_MNIST_DIR");
  }

  TEST_CASE("a wrong magic number names the file, expected and got") {
    temp_dir dir;
    const auto img = dir.file("img.gz"), lab = dir.file("lab.gz");
    write_gz(img, idx_images(0x803, 5, 2, 2, 20));
    write_gz(lab, idx_labels(0x801, 5, five_labels));
    write_gz(dir.file("bad.gz"), idx_images(0x0d03, 5, 2, 2, 20));

    auto msg = read_error(dir.file("bad.gz"), lab);
    CHECK(msg.find(dir.file("bad.gz")) != std::string::npos);
    CHECK(msg.find("magic") != std::string::npos);
    CHECK(msg.find("0x00000803") != std::string::npos);
    CHECK(msg.find("0x00000d03") != std::string::npos);

    msg = read_error(lab, img);  // swapped
    CHECK(msg.find(lab) != std::string::npos);
    CHECK(msg.find("swapped") != std::string::npos);

    msg = read_error(img, img);
    CHECK(msg.find("expected 0x00000801") != std::string::npos);
  }

  TEST_CASE("implausible dimensions are refused before allocating") {
    temp_dir dir;
    write_gz(dir.file("lab.gz"), idx_labels(0x801, 5, five_labels));
    write_gz(dir.file("rows0.gz"), idx_images(0x803, 5, 0, 2, 0));
    write_gz(dir.file("wide.gz"), idx_images(0x803, 5, 2, 5000, 0));
    write_gz(dir.file("many.gz"), idx_images(0x803, 20'000'000, 2, 2, 0));
    // Within every bound, but promising 10M x 4096 x 4096 bytes: fails as
    // truncated after reading what is there, without allocating for the promise.
    write_gz(dir.file("huge.gz"), idx_images(0x803, 10'000'000, 4096, 4096, 100));
    write_gz(dir.file("hugelab.gz"), idx_labels(0x801, 10'000'000, five_labels));

    auto msg = read_error(dir.file("rows0.gz"), dir.file("lab.gz"));
    CHECK(msg.find(dir.file("rows0.gz")) != std::string::npos);
    CHECK(msg.find("rows = 0") != std::string::npos);
    msg = read_error(dir.file("wide.gz"), dir.file("lab.gz"));
    CHECK(msg.find("cols = 5000") != std::string::npos);
    msg = read_error(dir.file("many.gz"), dir.file("lab.gz"));
    CHECK(msg.find("count = 20000000") != std::string::npos);
    msg = read_error(dir.file("huge.gz"), dir.file("hugelab.gz"));
    CHECK(msg.find(dir.file("hugelab.gz")) != std::string::npos);
    CHECK(msg.find("truncated labels") != std::string::npos);
    write_gz(dir.file("hugelab.gz"), idx_labels(0x801, 10'000'000, std::vector<std::uint8_t>(10'000'000, 0)));
    msg = read_error(dir.file("huge.gz"), dir.file("hugelab.gz"));
    CHECK(msg.find(dir.file("huge.gz")) != std::string::npos);
    CHECK(msg.find("truncated images") != std::string::npos);
    CHECK(msg.find("read 100") != std::string::npos);
  }

  TEST_CASE("truncated data names the file, expected and read bytes") {
    temp_dir dir;
    const auto lab = dir.file("lab.gz");
    write_gz(lab, idx_labels(0x801, 5, five_labels));

    write_gz(dir.file("short.gz"), idx_images(0x803, 5, 3, 4, 50));  // 60 promised
    auto msg = read_error(dir.file("short.gz"), lab);
    CHECK(msg.find(dir.file("short.gz")) != std::string::npos);
    CHECK(msg.find("truncated images") != std::string::npos);
    CHECK(msg.find("60 bytes") != std::string::npos);
    CHECK(msg.find("read 50") != std::string::npos);

    write_gz(dir.file("header.gz"), bytes{0, 0, 8, 3, 0, 0});
    msg = read_error(dir.file("header.gz"), lab);
    CHECK(msg.find(dir.file("header.gz")) != std::string::npos);
    CHECK(msg.find("truncated header") != std::string::npos);

    write_gz(dir.file("empty.gz"), bytes{});
    msg = read_error(dir.file("empty.gz"), lab);
    CHECK(msg.find("truncated header: expected 4 bytes, read 0") != std::string::npos);

    write_gz(dir.file("img.gz"), idx_images(0x803, 5, 3, 4, 60));
    write_gz(dir.file("shortlab.gz"), idx_labels(0x801, 5, {1, 2, 3}));
    msg = read_error(dir.file("img.gz"), dir.file("shortlab.gz"));
    CHECK(msg.find(dir.file("shortlab.gz")) != std::string::npos);
    CHECK(msg.find("truncated labels") != std::string::npos);
    CHECK(msg.find("read 3 bytes") != std::string::npos);

    // A gzip stream cut off mid-way (a partial download).
    bytes big = idx_images(0x803, 5, 100, 100, 50000);
    write_gz(dir.file("cut.gz"), big);
    const auto full = fs::file_size(dir.file("cut.gz"));
    fs::resize_file(dir.file("cut.gz"), full / 2);
    msg = read_error(dir.file("cut.gz"), lab);
    CHECK(msg.find(dir.file("cut.gz")) != std::string::npos);
    CHECK(msg.find("images") != std::string::npos);
  }

  TEST_CASE("trailing data beyond the header's promise is not read") {
    temp_dir dir;
    write_gz(dir.file("img.gz"), idx_images(0x803, 2, 2, 2, 8 + 100));
    bytes lab = idx_labels(0x801, 2, {7, 8});
    lab.push_back(200);  // would be an out-of-range label if read
    write_gz(dir.file("lab.gz"), lab);
    const auto ds = gossip::data::read_idx(dir.file("img.gz"), dir.file("lab.gz"));
    CHECK(ds.size() == 2);
    CHECK(ds.images.size() == 8);
  }

  TEST_CASE("a gzip stream whose checksum does not match is refused, naming the file") {
    temp_dir dir;
    const auto img = dir.file("img.gz"), lab = dir.file("lab.gz");
    write_gz(img, idx_images(0x803, 5, 3, 4, 5 * 3 * 4));
    write_gz(lab, idx_labels(0x801, 5, five_labels));
    for (const auto& path : {img, lab}) {
      // The stream decodes as before; only its CRC-32 (the trailer's first word) is off.
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(-8, std::ios::end);
      const int c = f.get();
      f.seekp(-8, std::ios::end);
      f.put(static_cast<char>(c ^ 0x5a));
      f.close();
      const std::string msg = read_error(img, lab);
      CHECK(msg.find(path) != std::string::npos);
      CHECK(msg.find("incorrect data check") != std::string::npos);
      write_gz(img, idx_images(0x803, 5, 3, 4, 5 * 3 * 4));
      write_gz(lab, idx_labels(0x801, 5, five_labels));
    }
  }

  TEST_CASE("image and label counts must match") {
    temp_dir dir;
    write_gz(dir.file("img.gz"), idx_images(0x803, 5, 2, 2, 20));
    write_gz(dir.file("lab.gz"), idx_labels(0x801, 4, {1, 2, 3, 4}));
    const auto msg = read_error(dir.file("img.gz"), dir.file("lab.gz"));
    CHECK(msg.find(dir.file("img.gz")) != std::string::npos);
    CHECK(msg.find(dir.file("lab.gz")) != std::string::npos);
    CHECK(msg.find("5 images") != std::string::npos);
    CHECK(msg.find("4 labels") != std::string::npos);
  }

  TEST_CASE("a label out of range names the file and index") {
    temp_dir dir;
    write_gz(dir.file("img.gz"), idx_images(0x803, 5, 2, 2, 20));
    write_gz(dir.file("lab.gz"), idx_labels(0x801, 5, {1, 2, 10, 3, 4}));
    const auto msg = read_error(dir.file("img.gz"), dir.file("lab.gz"));
    CHECK(msg.find(dir.file("lab.gz")) != std::string::npos);
    CHECK(msg.find("label 10 at index 2") != std::string::npos);
  }

  TEST_CASE("load_fashion_mnist finds the Debian file names, and the directory comes from the environment") {
    temp_dir dir;
    write_gz(dir.file("t10k-images-idx3-ubyte.gz"), idx_images(0x803, 5, 2, 2, 20));
    write_gz(dir.file("t10k-labels-idx1-ubyte.gz"), idx_labels(0x801, 5, five_labels));
    write_raw(dir.file("train-images-idx3-ubyte"), idx_images(0x803, 3, 2, 2, 12));  // uncompressed fallback
    write_raw(dir.file("train-labels-idx1-ubyte"), idx_labels(0x801, 3, {1, 1, 2}));
    CHECK(gossip::data::load_fashion_mnist(false, dir.path.string()).size() == 5);
    CHECK(gossip::data::load_fashion_mnist(true, dir.path.string()).size() == 3);

    const char* old = std::getenv("GOSSIP_FASHION_MNIST_DIR");
    const std::string saved = old ? old : "";
    ::setenv("GOSSIP_FASHION_MNIST_DIR", dir.path.c_str(), 1);
    CHECK(gossip::data::fashion_mnist_dir() == dir.path.string());
    CHECK(gossip::data::load_fashion_mnist(false).labels == five_labels);
    ::setenv("GOSSIP_FASHION_MNIST_DIR", "", 1);
    CHECK(!gossip::data::fashion_mnist_dir().empty());
    if (old)
      ::setenv("GOSSIP_FASHION_MNIST_DIR", saved.c_str(), 1);
    else
      ::unsetenv("GOSSIP_FASHION_MNIST_DIR");
  }

  // The dataset is a declared dependency (tools/setup.sh installs it), so its
  // absence is a failure with the fix in the message, not a silent pass.
  TEST_CASE("real Fashion-MNIST t10k") {
    const auto dir = gossip::data::fashion_mnist_dir();
    INFO("Fashion-MNIST looked for in " << dir << " (apt-get install dataset-fashion-mnist, or set GOSSIP_FASHION_MNIST_DIR)");
    REQUIRE(fs::exists(fs::path(dir) / "t10k-images-idx3-ubyte.gz"));
    REQUIRE(fs::exists(fs::path(dir) / "t10k-labels-idx1-ubyte.gz"));
    const auto ds = gossip::data::load_fashion_mnist(false, dir);
    CHECK(ds.size() == 10000);
    CHECK(ds.rows == 28);
    CHECK(ds.cols == 28);
    CHECK(ds.images.size() == 10000u * 784u);
    CHECK(std::all_of(ds.labels.begin(), ds.labels.end(), [](std::uint8_t l) { return l < 10; }));
    CHECK(ds.labels[0] == 9);  // ankle boot
    CHECK(ds.labels[1] == 2);  // pullover
    std::vector<int> per_class(10);
    for (auto l : ds.labels) ++per_class[l];
    for (int c : per_class) CHECK(c == 1000);
    const auto [lo, hi] = std::minmax_element(ds.images.begin(), ds.images.end());
    CHECK(*lo == 0.0f);
    CHECK(*hi == 1.0f);
  }
}

TEST_SUITE("partition") {
  TEST_CASE("iid shares are disjoint, cover the set, differ in size by at most one") {
    const auto ds = labelled(std::vector<std::uint8_t>(103, 1));
    const auto shares = gossip::data::partition(ds, 7, partition_kind::iid, 42);
    REQUIRE(shares.size() == 7);
    std::set<std::uint32_t> seen;
    std::size_t total = 0, lo = SIZE_MAX, hi = 0;
    for (const auto& s : shares) {
      total += s.size();
      lo = std::min(lo, s.size());
      hi = std::max(hi, s.size());
      seen.insert(s.begin(), s.end());
    }
    CHECK(total == 103);
    CHECK(seen.size() == 103);  // disjoint and covering
    CHECK(*seen.rbegin() == 102);
    CHECK(hi - lo <= 1);

    CHECK(gossip::data::partition(ds, 7, partition_kind::iid, 42) == shares);
    CHECK(gossip::data::partition(ds, 7, partition_kind::iid, 43) != shares);
    // One worker gets everything, shuffled.
    const auto one = gossip::data::partition(ds, 1, partition_kind::iid, 42);
    CHECK(one[0].size() == 103);
    // n workers get one sample each.
    for (const auto& s : gossip::data::partition(ds, 103, partition_kind::iid, 1)) CHECK(s.size() == 1);
  }

  TEST_CASE("iid partitions are pinned: the same on every standard library") {
    // mt19937_64 is fully specified by the standard and the shuffle is ours,
    // so these values must not change between platforms or releases.
    const auto ds = labelled(std::vector<std::uint8_t>(10, 0));
    const auto shares = gossip::data::partition(ds, 2, partition_kind::iid, 1);
    const std::vector<std::vector<std::uint32_t>> expected = {{1, 7, 3, 9, 4}, {0, 5, 2, 6, 8}};
    CHECK(shares == expected);
  }

  TEST_CASE("by_label gives each worker at most classes_per_worker labels") {
    const auto ds = labelled(balanced_labels(100, 10));  // 1000 samples
    for (auto [workers, cpw] :
         {std::pair{10, 2}, std::pair{5, 2}, std::pair{10, 1}, std::pair{4, 5}, std::pair{2, 5}}) {
      CAPTURE(workers);
      CAPTURE(cpw);
      const auto shares = gossip::data::partition(ds, workers, partition_kind::by_label, 7, cpw);
      REQUIRE(shares.size() == static_cast<std::size_t>(workers));
      std::set<std::uint32_t> seen;
      for (const auto& s : shares) {
        std::set<int> labels;
        for (auto i : s) labels.insert(ds.labels[i]);
        CHECK(labels.size() <= static_cast<std::size_t>(cpw));
        CHECK(s.size() == 1000u / static_cast<std::size_t>(workers));
        seen.insert(s.begin(), s.end());
      }
      CHECK(seen.size() == 1000);
    }
    const auto a = gossip::data::partition(ds, 10, partition_kind::by_label, 7);
    CHECK(gossip::data::partition(ds, 10, partition_kind::by_label, 7) == a);
    CHECK(gossip::data::partition(ds, 10, partition_kind::by_label, 8) != a);
  }

  TEST_CASE("invalid arguments name the value") {
    const auto ds = labelled(std::vector<std::uint8_t>(10, 0));
    auto message = [&](int workers, partition_kind kind, int cpw) {
      try {
        (void)gossip::data::partition(ds, workers, kind, 1, cpw);
      } catch (const gossip::error& e) {
        return std::string(e.what());
      }
      return std::string();
    };
    CHECK(message(0, partition_kind::iid, 2).find("workers = 0") != std::string::npos);
    CHECK(message(-3, partition_kind::iid, 2).find("workers = -3") != std::string::npos);
    CHECK(message(11, partition_kind::iid, 2).find("workers = 11") != std::string::npos);
    CHECK(message(2, partition_kind::by_label, 0).find("classes_per_worker = 0") != std::string::npos);
    CHECK(message(4, partition_kind::by_label, 3).find("12 shards") != std::string::npos);
    CHECK(gossip::data::parse_partition_kind("iid") == partition_kind::iid);
    CHECK(gossip::data::parse_partition_kind("by_label") == partition_kind::by_label);
    CHECK(gossip::data::to_string(partition_kind::by_label) == "by_label");
    CHECK(gossip::data::parse_partition_kind("dirichlet") == partition_kind::dirichlet);
    CHECK(gossip::data::to_string(partition_kind::dirichlet) == "dirichlet");
    CHECK_THROWS_AS(gossip::data::parse_partition_kind("zipf"), gossip::config_error);
    auto dirichlet_message = [&](double alpha, std::size_t min_samples) {
      try {
        (void)gossip::data::partition(ds, 2, partition_kind::dirichlet, 1, {.dirichlet_alpha = alpha, .min_samples = min_samples});
      } catch (const gossip::config_error& e) {
        return std::string(e.what());
      }
      return std::string();
    };
    CHECK(dirichlet_message(0, 1).find("dirichlet_alpha = 0") != std::string::npos);
    CHECK(dirichlet_message(1e-310, 1).find("at least 1e-300") != std::string::npos);
    CHECK(dirichlet_message(-1, 1).find("dirichlet_alpha = -1") != std::string::npos);
    CHECK(dirichlet_message(0.1, 6).find("at least 6 samples each") != std::string::npos);
    CHECK(dirichlet_message(0.1, 5).empty());
  }

  TEST_CASE("by_label class histograms: each shard holds whole label shards") {
    // 10 classes of 100; 5 workers x 2 shards of 100: every shard is one class,
    // so each worker's histogram has at most two nonzero bins of 100 (or one of 200).
    const auto ds = labelled(balanced_labels(100, 10));
    const auto shares = gossip::data::partition(ds, 5, partition_kind::by_label, 3, 2);
    std::array<std::size_t, 10> total{};
    for (const auto& s : shares) {
      std::array<std::size_t, 10> h{};
      for (auto i : s) ++h[ds.labels[i]];
      std::size_t bins = 0;
      for (std::size_t c = 0; c < 10; ++c) {
        if (h[c] == 0) continue;
        ++bins;
        CHECK((h[c] == 100 || h[c] == 200));
        total[c] += h[c];
      }
      CHECK(bins >= 1);
      CHECK(bins <= 2);
    }
    for (auto t : total) CHECK(t == 100);
    // 16 workers, 2 shards each of 1000/32 samples: a shard may straddle two
    // labels, so a worker sees at most 4 classes.
    for (const auto& s : gossip::data::partition(ds, 16, partition_kind::by_label, 3, 2)) {
      std::set<int> labels;
      for (auto i : s) labels.insert(ds.labels[i]);
      CHECK(labels.size() <= 4);
    }
  }

  TEST_CASE("dirichlet: every sample once, reproducible per seed, skewed, every worker at least a batch") {
    const auto ds = labelled(balanced_labels(300, 10));  // 3000 samples
    const gossip::data::partition_options opts{.dirichlet_alpha = 0.1, .min_samples = 32};
    for (int workers : {4, 16}) {
      CAPTURE(workers);
      for (std::uint64_t seed = 1; seed <= 5; ++seed) {
        CAPTURE(seed);
        const auto shares = gossip::data::partition(ds, workers, partition_kind::dirichlet, seed, opts);
        REQUIRE(shares.size() == static_cast<std::size_t>(workers));
        std::vector<int> seen(ds.size(), 0);
        std::size_t smallest = ds.size(), largest = 0;
        for (const auto& s : shares) {
          CHECK(s.size() >= 32);
          smallest = std::min(smallest, s.size());
          largest = std::max(largest, s.size());
          for (auto i : s) {
            REQUIRE(i < ds.size());
            ++seen[i];
          }
        }
        CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
        CHECK(largest > 2 * smallest);  // alpha = 0.1: very unequal shares
        CHECK(gossip::data::partition(ds, workers, partition_kind::dirichlet, seed, opts) == shares);
        CHECK(gossip::data::partition(ds, workers, partition_kind::dirichlet, seed + 100, opts) != shares);
      }
    }
    // Skew: with alpha = 0.1 a worker's largest class is about half its share; with
    // alpha = 1000 every worker's histogram is close to uniform.
    auto dominant_share = [&](double alpha) {
      double sum = 0;
      const auto shares = gossip::data::partition(ds, 10, partition_kind::dirichlet, 7, {.dirichlet_alpha = alpha, .min_samples = 1});
      for (const auto& s : shares) {
        std::array<std::size_t, 10> h{};
        for (auto i : s) ++h[ds.labels[i]];
        sum += static_cast<double>(*std::max_element(h.begin(), h.end())) / static_cast<double>(s.size());
      }
      return sum / 10;
    };
    CHECK(dominant_share(0.1) > 0.4);
    CHECK(dominant_share(1000) < 0.2);
    // The limits: as alpha falls a class goes to one worker, as it grows it is
    // split evenly, however far (no draw underflows or overflows).
    auto largest_holder = [&](double alpha) {
      double least = 1;
      const auto shares = gossip::data::partition(ds, 10, partition_kind::dirichlet, 7, {.dirichlet_alpha = alpha, .min_samples = 1});
      for (int c = 0; c < 10; ++c) {
        std::size_t most = 0;
        for (const auto& s : shares) most = std::max<std::size_t>(most, static_cast<std::size_t>(std::count_if(s.begin(), s.end(), [&](auto i) {
                                                                            return ds.labels[i] == c;
                                                                          })));
        least = std::min(least, static_cast<double>(most) / 300);
      }
      return least;  // over the classes, the smallest share of a class its largest holder has
    };
    for (double alpha : {1e-3, 1e-4, 1e-300}) {
      CAPTURE(alpha);
      CHECK(largest_holder(alpha) > 0.95);
    }
    for (double alpha : {1e6, 1e300}) {
      CAPTURE(alpha);
      CHECK(largest_holder(alpha) < 0.12);
    }
  }

  TEST_CASE("dirichlet partitions are pinned: the same on every standard library") {
    // mt19937_64, the shuffle and the Gamma sampler are ours: only the shares'
    // sizes are pinned here (a change to the sampler shows as a change here).
    const auto ds = labelled(balanced_labels(100, 10));
    const auto shares = gossip::data::partition(ds, 4, partition_kind::dirichlet, 1, {.dirichlet_alpha = 0.5, .min_samples = 1});
    std::vector<std::size_t> sizes;
    for (const auto& s : shares) sizes.push_back(s.size());
    MESSAGE("dirichlet sizes: ", sizes[0], " ", sizes[1], " ", sizes[2], " ", sizes[3]);
    CHECK(sizes == std::vector<std::size_t>{268, 183, 431, 118});
  }

  TEST_CASE("batch_stream: the same batches as one shuffle per epoch, and small shards wrap") {
    // A shard of 10 with batches of 4: two batches per epoch never wrap and
    // equal the old per-epoch Fisher–Yates order.
    std::vector<std::uint32_t> shard(10);
    for (std::uint32_t i = 0; i < 10; ++i) shard[i] = i;
    gossip::examples::batch_stream s(shard, 77);
    std::vector<std::uint32_t> order = shard;
    std::mt19937_64 rng(77);
    for (int epoch = 0; epoch < 3; ++epoch) {
      for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng() % i]);
      s.new_epoch();
      std::vector<std::uint32_t> b(4);
      for (int k = 0; k < 2; ++k) {
        s.next(b);
        CHECK(std::equal(b.begin(), b.end(), order.begin() + 4 * k));
      }
    }
    // A shard of 3 with batches of 4: every batch is full and each pass covers the shard.
    gossip::examples::batch_stream tiny({5, 6, 7}, 1);
    tiny.new_epoch();
    std::vector<std::uint32_t> b(4), all;
    for (int k = 0; k < 3; ++k) {
      tiny.next(b);
      all.insert(all.end(), b.begin(), b.end());
    }
    for (std::size_t pass = 0; pass < 4; ++pass) {
      std::set<std::uint32_t> p(all.begin() + 3 * static_cast<std::ptrdiff_t>(pass), all.begin() + 3 * static_cast<std::ptrdiff_t>(pass) + 3);
      CHECK(p == std::set<std::uint32_t>{5, 6, 7});
    }
  }

  TEST_CASE("gather copies the named samples") {
    gossip::data::dataset ds;
    ds.rows = 1;
    ds.cols = 2;
    ds.images = {0, 1, 10, 11, 20, 21};
    ds.labels = {5, 6, 7};
    const std::vector<std::uint32_t> idx = {2, 0};
    float x[4];
    std::uint8_t y[2];
    gossip::data::gather(ds, idx, x, y);
    CHECK(x[0] == 20);
    CHECK(x[1] == 21);
    CHECK(x[2] == 0);
    CHECK(x[3] == 1);
    CHECK(y[0] == 7);
    CHECK(y[1] == 5);
  }
}

TEST_SUITE("mlp") {
  TEST_CASE("parameters are one buffer of named tensors") {
    mlp net({.inputs = 784, .hidden = {128}, .classes = 10, .max_batch = 32});
    CHECK(net.param_count() == 784u * 128 + 128 + 128 * 10 + 10);
    const auto t = net.tensors();
    REQUIRE(t.size() == 4);
    CHECK(t[0].name == "fc1.weight");
    CHECK(t[0].offset == 0);
    CHECK(t[0].count == 784u * 128);
    CHECK(t[1].name == "fc1.bias");
    CHECK(t[1].offset == 784u * 128);
    CHECK(t[2].name == "fc2.weight");
    CHECK(t[3].name == "fc2.bias");
    CHECK(t[3].offset + t[3].count == net.param_count());

    struct fake_view {
      std::vector<std::pair<std::string, std::span<float>>> entries;
      fake_view& add(std::string name, std::span<float> s) {
        entries.emplace_back(std::move(name), s);
        return *this;
      }
    } view;
    net.register_tensors(view);
    REQUIRE(view.entries.size() == 4);
    CHECK(view.entries[2].second.data() == net.params().data() + t[2].offset);

    mlp deep({.inputs = 6, .hidden = {5, 4}, .classes = 3});
    CHECK(deep.tensors().size() == 6);
    CHECK(deep.tensors()[5].name == "fc3.bias");
    CHECK_THROWS_AS(mlp({.inputs = 6, .hidden = {}, .classes = 3}), gossip::config_error);
  }

  TEST_CASE("init is He-uniform and reproducible") {
    mlp a({.inputs = 50, .hidden = {20}, .classes = 3}), b = a, c = a;
    a.init(5);
    b.init(5);
    c.init(6);
    CHECK(std::equal(a.params().begin(), a.params().end(), b.params().begin()));
    CHECK(!std::equal(a.params().begin(), a.params().end(), c.params().begin()));
    const auto t = a.tensors();
    const float bound1 = std::sqrt(6.0f / 50.0f), bound2 = std::sqrt(6.0f / 20.0f);
    float max1 = 0;
    for (std::size_t i = 0; i < t[0].count; ++i) max1 = std::max(max1, std::abs(a.params()[i]));
    CHECK(max1 <= bound1);
    CHECK(max1 > 0.9f * bound1);
    for (std::size_t i = 0; i < t[2].count; ++i) CHECK(std::abs(a.params()[t[2].offset + i]) <= bound2);
    for (std::size_t i = 0; i < t[1].count; ++i) CHECK(a.params()[t[1].offset + i] == 0.0f);
    // Pinned: mt19937_64 is specified by the standard and the conversion is ours.
    CHECK(a.params()[0] == doctest::Approx(0.119902872).epsilon(1e-6));
  }

  TEST_CASE("gradient matches finite differences") {
    // Central differences of the float forward pass at two step sizes: the
    // larger one drowns float rounding, the smaller one avoids stepping across
    // a ReLU kink; a wrong gradient disagrees with both.
    for (std::uint64_t seed = 1; seed <= 5; ++seed) {
      CAPTURE(seed);
      mlp net({.inputs = 6, .hidden = {5}, .classes = 3, .max_batch = 8});
      net.init(seed);
      std::mt19937_64 rng(seed + 10);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (auto& p : net.params()) p += 0.1f * u(rng);  // nonzero biases too
      std::vector<float> x(6 * 8);
      for (auto& v : x) v = u(rng);
      const std::vector<std::uint8_t> y = {0, 1, 2, 2, 1, 0, 1, 2};

      const float loss = net.gradient(x.data(), y.data(), 8);
      CHECK(loss == doctest::Approx(net.loss(x.data(), y.data(), 8)).epsilon(1e-5));
      std::vector<float> g(net.grads().begin(), net.grads().end());
      std::vector<float> p(net.params().begin(), net.params().end());
      auto rel_error = [&](std::size_t i, float eps) {
        const float saved = p[i];
        p[i] = saved + eps;
        const double up = net.loss_of(p, x.data(), y.data(), 8);
        p[i] = saved - eps;
        const double down = net.loss_of(p, x.data(), y.data(), 8);
        p[i] = saved;
        const double numeric = (up - down) / (2.0 * static_cast<double>(eps));
        return std::abs(numeric - g[i]) / std::max(1e-3, std::abs(numeric) + std::abs(g[i]));
      };
      for (std::size_t i = 0; i < p.size(); ++i) {  // 53 parameters: check them all
        CAPTURE(i);
        CHECK(std::min(rel_error(i, 1e-2f), rel_error(i, 1e-3f)) < 1e-2);
      }
      // And the check has teeth: the largest gradient coordinate off by 5 % fails it.
      const auto big = static_cast<std::size_t>(
          std::max_element(g.begin(), g.end(), [](float a, float b) { return std::abs(a) < std::abs(b); }) -
          g.begin());
      g[big] *= 1.05f;
      CHECK(std::min(rel_error(big, 1e-2f), rel_error(big, 1e-3f)) > 1e-2);
    }
  }

  TEST_CASE("a training step makes no heap allocation") {
    // Small enough that Eigen's product packing buffers stay on the stack, so
    // any allocation here would be a temporary of ours (a missing noalias).
    mlp net({.inputs = 6, .hidden = {5, 4}, .classes = 3, .max_batch = 16});
    net.init(1);
    std::vector<float> x(6 * 16, 0.5f);
    std::vector<std::uint8_t> y(16, 1);
    gossip::examples::sgd_momentum opt{.lr = 0.1f};
    net.train_batch(x.data(), y.data(), 16, opt);  // sizes the velocity
    Eigen::internal::set_is_malloc_allowed(false);
    CHECK_NOTHROW(net.train_batch(x.data(), y.data(), 16, opt));
    CHECK_NOTHROW(net.train_batch(x.data(), y.data(), 7, opt));
    Eigen::internal::set_is_malloc_allowed(true);
  }

  TEST_CASE("training separates blobs, and accuracy_of agrees with accuracy") {
    const int dims = 10, classes = 4;
    const blobs train(2000, dims, classes, 1), test(400, dims, classes, 2);
    mlp net({.inputs = dims, .hidden = {16}, .classes = classes, .max_batch = 32, .eval_batch = 128});
    net.init(9);
    gossip::examples::sgd_momentum opt{.lr = 0.05f, .momentum = 0.9f};
    const double before = net.loss(test.x.data(), test.y.data(), 400);
    for (int epoch = 0; epoch < 3; ++epoch)
      for (int s = 0; s + 32 <= 2000; s += 32)
        net.train_batch(train.x.data() + s * dims, train.y.data() + s, 32, opt);
    const double acc = net.accuracy(test.x.data(), test.y.data(), 400);
    CHECK(acc > 0.9);
    CHECK(net.loss(test.x.data(), test.y.data(), 400) < before);

    const std::vector<float> p(net.params().begin(), net.params().end());
    CHECK(net.accuracy_of(p, test.x.data(), test.y.data(), 400) == acc);

    // The average of two models: evaluated without touching either.
    mlp other = net;
    other.init(10);
    std::vector<float> avg(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) avg[i] = 0.5f * (p[i] + other.params()[i]);
    const double avg_acc = net.accuracy_of(avg, test.x.data(), test.y.data(), 400);
    CHECK(avg_acc >= 0.0);
    CHECK(avg_acc <= 1.0);
    CHECK(net.accuracy(test.x.data(), test.y.data(), 400) == acc);

    const std::vector<float> wrong(p.size() + 1);
    CHECK_THROWS_AS((void)net.accuracy_of(wrong, test.x.data(), test.y.data(), 400), gossip::layout_error);
  }

  TEST_CASE("sgd_momentum is heavy-ball") {
    gossip::examples::sgd_momentum opt{.lr = 0.5f, .momentum = 0.9f, .weight_decay = 0.1f};
    std::vector<float> w = {1.0f, -2.0f};
    const std::vector<float> g = {0.2f, 0.0f};
    opt.step(w, g);  // v = g + 0.1 w = {0.3, -0.2}; w -= 0.5 v
    CHECK(w[0] == doctest::Approx(0.85f));
    CHECK(w[1] == doctest::Approx(-1.9f));
    opt.step(w, g);  // v = 0.9 v + g + 0.1 w = {0.27 + 0.2 + 0.085, -0.18 - 0.19}
    CHECK(opt.velocity[0] == doctest::Approx(0.555f));
    CHECK(opt.velocity[1] == doctest::Approx(-0.37f));
    CHECK(w[0] == doctest::Approx(0.85f - 0.2775f));
  }

  TEST_CASE("outer_optimizer: Nesterov outer step by hand, and plain averaging when inactive") {
    gossip::examples::outer_optimizer o{.lr = 0.7f, .momentum = 0.9f};
    CHECK(o.active());
    std::vector<float> x = {1.0f, -2.0f};
    o.start(x);
    // Averaging moved x to {0.8, -1.5}: Δ = anchor − x = {0.2, −0.5}; v = Δ;
    // x = anchor − 0.7 (Δ + 0.9 v) = anchor − 1.33 Δ = {0.734, −1.335}.
    x = {0.8f, -1.5f};
    o.step(x);
    CHECK(x[0] == doctest::Approx(0.734f));
    CHECK(x[1] == doctest::Approx(-1.335f));
    CHECK(o.anchor[0] == x[0]);
    CHECK(o.velocity[0] == doctest::Approx(0.2f));
    // Next averaging point at {0.634, −1.235}: Δ = {0.1, −0.1}; v = 0.9 v + Δ = {0.28, −0.55};
    // x = anchor − 0.7 (Δ + 0.9 v) = {0.734 − 0.7·0.352, −1.335 + 0.7·0.595}.
    x = {0.634f, -1.235f};
    o.step(x);
    CHECK(o.velocity[0] == doctest::Approx(0.28f));
    CHECK(o.velocity[1] == doctest::Approx(-0.55f));
    CHECK(x[0] == doctest::Approx(0.734f - 0.7f * 0.352f));
    CHECK(x[1] == doctest::Approx(-1.335f + 0.7f * 0.595f));

    // Without Nesterov: x = anchor − lr·v.
    gossip::examples::outer_optimizer h{.lr = 0.5f, .momentum = 0.5f, .nesterov = false};
    std::vector<float> y = {2.0f};
    h.start(y);
    y = {1.0f};
    h.step(y);  // Δ = 1, v = 1, y = 2 − 0.5
    CHECK(y[0] == doctest::Approx(1.5f));
    y = {1.0f};
    h.step(y);  // Δ = 0.5, v = 0.5 + 0.5 = 1, y = 1.5 − 0.5
    CHECK(y[0] == doctest::Approx(1.0f));

    CHECK_FALSE(gossip::examples::outer_optimizer{}.active());  // lr 1, momentum 0: x stays the average
  }

  TEST_CASE("averaging_schedule fires the rounds of each averaging point") {
    const gossip::examples::averaging_schedule a{.every = 4, .rounds = 2};
    std::string fires;
    for (std::uint64_t t = 0; t < 12; ++t) {
      gossip::signal s;
      s.step = t;
      fires += a.decide(s).send ? 'x' : '.';
    }
    // Cycle of 6 engine steps: local steps 0..3 (the 4th sends round 0), then
    // round 1 and a merge-only step.
    CHECK(fires == "...xx....xx.");
  }

  TEST_CASE("learning-rate schedules") {
    using gossip::examples::lr_schedule;
    const lr_schedule constant{.type = lr_schedule::constant, .base = 0.1f, .warmup_steps = 10};
    CHECK(constant.at(0, 100) == doctest::Approx(0.01f));
    CHECK(constant.at(4, 100) == doctest::Approx(0.05f));
    CHECK(constant.at(9, 100) == doctest::Approx(0.1f));
    CHECK(constant.at(99, 100) == doctest::Approx(0.1f));

    const lr_schedule step{.type = lr_schedule::step, .base = 0.1f, .gamma = 0.1f};
    CHECK(step.at(0, 100) == doctest::Approx(0.1f));
    CHECK(step.at(49, 100) == doctest::Approx(0.1f));
    CHECK(step.at(50, 100) == doctest::Approx(0.01f));
    CHECK(step.at(75, 100) == doctest::Approx(0.001f));

    const lr_schedule cosine{.type = lr_schedule::cosine, .base = 0.1f, .warmup_steps = 10, .final_lr = 0.0f};
    CHECK(cosine.at(10, 110) == doctest::Approx(0.1f));
    CHECK(cosine.at(60, 110) == doctest::Approx(0.05f));
    CHECK(cosine.at(110, 110) == doctest::Approx(0.0f));
    CHECK(cosine.at(200, 110) == doctest::Approx(0.0f));

    CHECK(lr_schedule::parse("cosine") == lr_schedule::cosine);
    CHECK(lr_schedule::to_string(lr_schedule::step) == "step");
    CHECK_THROWS_AS(lr_schedule::parse("linear"), gossip::config_error);
  }

  TEST_CASE("end-of-training barrier: rank 0 learns of a death it cannot see from a survivor's arrival") {
    // Three ranks in one process. Rank 2 dies before the barrier (it never
    // arrives); rank 0 is not its neighbour, rank 1's engine found it dead.
    // Rank 0 must leave it out at once, not wait out the timeout.
    using namespace gossip;
    using gossip::examples::bootstrap_exchange;
    const std::uint16_t port = harness::free_port();
    const auto timeout = std::chrono::duration<double>(10.0);
    auto b0 = std::make_shared<bootstrap>(0, 3, "127.0.0.1", port, timeout);
    auto b1 = std::make_shared<bootstrap>(1, 3, "127.0.0.1", port, timeout);
    auto b2 = std::make_shared<bootstrap>(2, 3, "127.0.0.1", port, timeout);
    bootstrap_exchange ex0(b0), ex1(b1), ex2(b2);  // rank 2 posts its host, then is gone
    engine_stats s1;
    s1.rank = 1;
    s1.world = 3;
    s1.dead_peers = {2};
    dead_peer d;
    d.rank = 2;
    s1.dead = {d};
    std::thread rank1([&] {
      gossip::examples::run_report r;
      ex1.done(1, 1.0, s1, r);
    });
    engine_stats s0;
    s0.world = 3;
    gossip::examples::run_report r0;
    const auto t0 = std::chrono::steady_clock::now();
    ex0.done(0, 1.0, s0, r0);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rank1.join();
    REQUIRE(r0.dead.size() == 1);
    CHECK(r0.dead[0].rank == 2);
    CHECK(r0.dead[0].reason == "found dead by rank 1's engine");
    CHECK(r0.survivors == 2);
    CHECK(took < 5.0);  // the deadline is 10 s
  }
}

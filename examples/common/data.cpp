#include "common/data.hpp"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include "gossip/error.hpp"

#if __has_include("gossip_build_config.hpp")
#include "gossip_build_config.hpp"
#endif
#ifndef GOSSIP_FASHION_MNIST_DIR
#define GOSSIP_FASHION_MNIST_DIR "/usr/share/datasets/fashion-mnist"
#endif

namespace gossip::data {
namespace {

constexpr std::uint32_t images_magic = 0x00000803;  // uint8, 3 dimensions
constexpr std::uint32_t labels_magic = 0x00000801;  // uint8, 1 dimension
constexpr std::uint32_t max_side = 4096;
constexpr std::uint32_t max_count = 10'000'000;
// What we reserve from a header's word once the first chunk of pixels has
// arrived in full; beyond it the buffer only grows as data actually arrives,
// so a lying header in a small file ends in a truncation error, not a huge
// allocation.
constexpr std::size_t trusted_reserve = std::size_t{1} << 26;
constexpr unsigned chunk_bytes = 1u << 20;

// What to do about a missing file: where its directory came from decides it
// (the variable, the Debian package's, or one the program was given).
std::string install_hint(const std::string& path) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  const auto norm = [](std::filesystem::path p) {  // "/a/b/" as "/a/b"
    p = p.lexically_normal();
    return !p.has_filename() && p != p.root_path() ? p.parent_path() : p;
  };
  const auto same = [&](const char* other) { return norm(dir) == norm(other); };
  if (const char* env = std::getenv("GOSSIP_FASHION_MNIST_DIR"); env != nullptr && *env != '\0' && same(env))
    return fmt::format("GOSSIP_FASHION_MNIST_DIR is set to '{}': point it at the directory of the IDX files, or unset it to use "
                       "`apt-get install dataset-fashion-mnist`'s",
                       env);
  if (same(GOSSIP_FASHION_MNIST_DIR))
    return "install it with `apt-get install dataset-fashion-mnist`, or set GOSSIP_FASHION_MNIST_DIR (or pass the directory) to where "
           "the IDX files are";
  return fmt::format("the directory '{}' was given (as [train] data_dir, or to load_fashion_mnist): give the directory of the IDX files",
                     dir.string());
}

class gz_file {
 public:
  explicit gz_file(const std::string& path) : m_path(path) {
    std::error_code ec;
    auto st = std::filesystem::status(path, ec);
    if (!std::filesystem::exists(st))
      throw data_error(fmt::format("dataset file '{}' does not exist; {}", path, install_hint(path)));
    if (std::filesystem::is_directory(st))
      throw data_error(fmt::format("dataset file '{}' is a directory, expected a (gzipped) IDX file", path));
    errno = 0;
    m_file = gzopen(path.c_str(), "rb");
    if (m_file == nullptr)
      throw data_error(fmt::format("cannot open dataset file '{}': {}; {}", path,
                                   errno != 0 ? std::strerror(errno) : "out of memory", install_hint(path)));
    gzbuffer(m_file, 1u << 17);
  }
  gz_file(const gz_file&) = delete;
  gz_file& operator=(const gz_file&) = delete;
  ~gz_file() { gzclose(m_file); }

  const std::string& path() const noexcept { return m_path; }

  /// Reads up to n bytes; returns how many arrived (fewer only at the end of
  /// the data). Throws on a read or decompression error.
  std::size_t read(void* buf, std::size_t n, std::size_t done_before, std::string_view what) {
    auto* out = static_cast<unsigned char*>(buf);
    std::size_t got = 0;
    while (got < n) {
      const unsigned want = static_cast<unsigned>(std::min<std::size_t>(n - got, chunk_bytes));
      const int r = gzread(m_file, out + got, want);
      if (r < 0) {
        int errnum = 0;
        const char* msg = gzerror(m_file, &errnum);
        throw data_error(fmt::format("'{}': read error in the {} after {} bytes: {}", m_path, what,
                                     done_before + got, errnum == Z_ERRNO ? std::strerror(errno) : msg));
      }
      if (r == 0) break;
      got += static_cast<std::size_t>(r);
    }
    return got;
  }

  /// After the last byte the header promises: reads on to the end of the
  /// file (what follows is ignored, as IDX readers do), which is what makes
  /// zlib check the gzip stream's CRC-32 and length, so that a corrupted file
  /// is refused, naming it, rather than trained on.
  void check_to_end(std::size_t done_before, std::string_view what) {
    unsigned char sink[4096];
    while (const std::size_t got = read(sink, sizeof sink, done_before, what)) done_before += got;
  }

  /// Why the data stopped early, when zlib knows (e.g. a cut-off gzip stream).
  std::string zlib_detail() {
    int errnum = Z_OK;
    const char* msg = gzerror(m_file, &errnum);
    if (errnum == Z_OK || msg == nullptr || *msg == '\0') return {};
    return fmt::format(" (zlib: {})", msg);
  }

  void read_exact(void* buf, std::size_t n, std::size_t done_before, std::string_view what) {
    const std::size_t got = read(buf, n, done_before, what);
    if (got != n)
      throw data_error(fmt::format("'{}': truncated {}: expected {} bytes, read {}{}", m_path, what, n, got,
                                   zlib_detail()));
  }

  std::uint32_t read_be32(std::size_t offset, std::string_view what) {
    std::array<unsigned char, 4> b{};
    read_exact(b.data(), b.size(), offset, what);
    return (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) |
           std::uint32_t{b[3]};
  }

 private:
  std::string m_path;
  gzFile m_file = nullptr;
};

void check_magic(const gz_file& f, std::uint32_t got, std::uint32_t expected) {
  if (got == expected) return;
  const char* kind = expected == images_magic ? "an images file (uint8, 3 dimensions)"
                                              : "a labels file (uint8, 1 dimension)";
  std::string hint;
  if (got == images_magic)
    hint = "; that is an images file: were the images and labels paths swapped?";
  else if (got == labels_magic)
    hint = "; that is a labels file: were the images and labels paths swapped?";
  throw data_error(fmt::format("'{}': wrong IDX magic number: expected 0x{:08x} for {}, got 0x{:08x}{}",
                               f.path(), expected, kind, got, hint));
}

void check_dim(const gz_file& f, std::string_view name, std::uint32_t value, std::uint32_t lo,
               std::uint32_t hi) {
  if (value < lo || value > hi)
    throw data_error(
        fmt::format("'{}': implausible IDX header: {} = {}, expected {}..{}", f.path(), name, value, lo, hi));
}

// Unbiased integer in [0, bound) from the raw 64-bit stream, so results are
// the same with every standard library.
std::uint64_t uniform_below(std::mt19937_64& rng, std::uint64_t bound) {
  const std::uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  for (;;) {
    const std::uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

template <class T>
void fisher_yates(std::vector<T>& v, std::mt19937_64& rng) {
  for (std::size_t i = v.size(); i > 1; --i) {
    const std::size_t j = static_cast<std::size_t>(uniform_below(rng, i));
    std::swap(v[i - 1], v[j]);
  }
}

// A double in (0, 1) from the top 53 bits of the raw stream (never 0, so its
// logarithm is finite).
double uniform_open(std::mt19937_64& rng) {
  for (;;) {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    if (u > 0) return u;
  }
}

// Standard normal by the Marsaglia polar method (log and sqrt only).
double standard_normal(std::mt19937_64& rng) {
  for (;;) {
    const double u = 2 * uniform_open(rng) - 1, v = 2 * uniform_open(rng) - 1;
    const double s = u * u + v * v;
    if (s > 0 && s < 1) return u * std::sqrt(-2 * std::log(s) / s);
  }
}

// The log of a Gamma(shape, 1) draw, by Marsaglia and Tsang (2000); for
// shape < 1 the usual boost Gamma(shape + 1) · U^(1/shape), whose factor
// U^(1/shape) underflows a double for small shapes (a few thousandths), so
// the draw is kept as its log. Ours rather than std::gamma_distribution so
// partitions are the same with every standard library.
double log_gamma_sample(std::mt19937_64& rng, double shape) {
  if (shape < 1) return log_gamma_sample(rng, shape + 1) + std::log(uniform_open(rng)) / shape;
  const double d = shape - 1.0 / 3, c = 1 / std::sqrt(9 * d);
  for (;;) {
    double x, v;
    do {
      x = standard_normal(rng);
      v = 1 + c * x;
    } while (v <= 0);
    v = v * v * v;
    const double u = uniform_open(rng);
    if (u < 1 - 0.0331 * x * x * x * x || std::log(u) < 0.5 * x * x + d * (1 - v + std::log(v))) return std::log(d * v);
  }
}

// Indices of ds stably sorted by label, keeping `order` inside each class;
// start[c]..start[c + 1] is class c's range.
std::vector<std::uint32_t> sort_by_label(const dataset& ds, const std::vector<std::uint32_t>& order,
                                         std::array<std::size_t, 257>& start) {
  start.fill(0);
  for (std::uint8_t l : ds.labels) ++start[std::size_t{l} + 1];
  for (std::size_t l = 1; l < start.size(); ++l) start[l] += start[l - 1];
  std::array<std::size_t, 257> at = start;
  std::vector<std::uint32_t> sorted(order.size());
  for (std::uint32_t i : order) sorted[at[ds.labels[i]]++] = i;
  return sorted;
}

}  // namespace

dataset read_idx(const std::string& images_gz, const std::string& labels_gz) {
  gz_file img(images_gz);
  check_magic(img, img.read_be32(0, "header"), images_magic);
  const std::uint32_t n = img.read_be32(4, "header");
  const std::uint32_t rows = img.read_be32(8, "header");
  const std::uint32_t cols = img.read_be32(12, "header");
  check_dim(img, "count", n, 0, max_count);
  check_dim(img, "rows", rows, 1, max_side);
  check_dim(img, "cols", cols, 1, max_side);

  gz_file lab(labels_gz);
  check_magic(lab, lab.read_be32(0, "header"), labels_magic);
  const std::uint32_t nl = lab.read_be32(4, "header");
  check_dim(lab, "count", nl, 0, max_count);
  if (nl != n)
    throw data_error(fmt::format("IDX count mismatch: '{}' holds {} images but '{}' holds {} labels",
                                 images_gz, n, labels_gz, nl));

  dataset ds;
  ds.rows = rows;
  ds.cols = cols;

  // Labels: at most max_count bytes, so the header's word is safe to allocate.
  ds.labels.resize(n);
  {
    const std::size_t got = lab.read(ds.labels.data(), n, 8, "labels");
    if (got != n)
      throw data_error(
          fmt::format("'{}': truncated labels: the header promises {} labels ({} bytes), read {} bytes{}",
                      labels_gz, n, n, got, lab.zlib_detail()));
  }
  lab.check_to_end(8 + std::size_t{n}, "labels");
  for (std::size_t i = 0; i < n; ++i)
    if (ds.labels[i] >= 10)
      throw data_error(fmt::format("'{}': label {} at index {} is out of range (expected 0..9)", labels_gz,
                                   ds.labels[i], i));

  // Images: 64-bit product of values each already bounded, so no overflow.
  const std::size_t expected = std::size_t{n} * rows * cols;
  std::vector<unsigned char> chunk(std::min<std::size_t>(expected, chunk_bytes));
  std::size_t done = 0;
  while (done < expected) {
    const std::size_t want = std::min<std::size_t>(expected - done, chunk.size());
    const std::size_t got = img.read(chunk.data(), want, 16 + done, "images");
    if (done == 0 && got == want) ds.images.reserve(std::min(expected, trusted_reserve));
    const std::size_t old = ds.images.size();
    ds.images.resize(old + got);
    std::transform(chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(got),
                   ds.images.begin() + static_cast<std::ptrdiff_t>(old),
                   [](unsigned char p) { return static_cast<float>(p) / 255.0f; });
    done += got;
    if (got != want)
      throw data_error(fmt::format(
          "'{}': truncated images: the header promises {} x {} x {} = {} bytes of pixels, read {}{}",
          images_gz, n, rows, cols, expected, done, img.zlib_detail()));
  }
  img.check_to_end(16 + expected, "images");
  return ds;
}

std::string fashion_mnist_dir() {
  if (const char* env = std::getenv("GOSSIP_FASHION_MNIST_DIR"); env != nullptr && *env != '\0') return env;
  return GOSSIP_FASHION_MNIST_DIR;
}

dataset load_fashion_mnist(bool train, const std::string& dir) {
  const std::string prefix = train ? "train" : "t10k";
  auto pick = [&](const std::string& stem) {
    const std::filesystem::path base = std::filesystem::path(dir) / stem;
    std::error_code ec;
    const std::string gz = base.string() + ".gz";
    if (!std::filesystem::exists(gz, ec) && std::filesystem::exists(base, ec)) return base.string();
    return gz;
  };
  return read_idx(pick(prefix + "-images-idx3-ubyte"), pick(prefix + "-labels-idx1-ubyte"));
}

void gather(const dataset& ds, std::span<const std::uint32_t> idx, float* x, std::uint8_t* y) {
  const std::size_t f = ds.features();
  for (std::size_t k = 0; k < idx.size(); ++k) {
    const std::size_t i = idx[k];
    GOSSIP_ASSERT(i < ds.size(), "sample index {} out of range for a dataset of {}", i, ds.size());
    std::memcpy(x + k * f, ds.images.data() + i * f, f * sizeof(float));
    y[k] = ds.labels[i];
  }
}

std::string_view to_string(partition_kind kind) noexcept {
  switch (kind) {
    case partition_kind::iid: return "iid";
    case partition_kind::by_label: return "by_label";
    case partition_kind::dirichlet: return "dirichlet";
  }
  return "?";
}

partition_kind parse_partition_kind(std::string_view name) {
  if (name == "iid") return partition_kind::iid;
  if (name == "by_label" || name == "non_iid") return partition_kind::by_label;
  if (name == "dirichlet") return partition_kind::dirichlet;
  throw config_error(fmt::format("unknown partition kind '{}': expected 'iid', 'by_label' or 'dirichlet'", name));
}

std::vector<std::vector<std::uint32_t>> partition(const dataset& ds, int workers, partition_kind kind,
                                                  std::uint64_t seed, int classes_per_worker) {
  return partition(ds, workers, kind, seed, partition_options{.classes_per_worker = classes_per_worker});
}

std::vector<std::vector<std::uint32_t>> partition(const dataset& ds, int workers, partition_kind kind,
                                                  std::uint64_t seed, const partition_options& opts) {
  const int classes_per_worker = opts.classes_per_worker;
  const std::size_t n = ds.size();
  if (workers < 1 || static_cast<std::size_t>(workers) > n)
    throw config_error(
        n == 0 ? fmt::format("cannot partition an empty training set among workers = {}: the training files hold no samples", workers)
               : fmt::format("cannot partition {} samples among workers = {}: each worker needs at least one sample (workers in 1..{}, or "
                             "more samples: [train] train_limit)",
                             n, workers, n));
  if (n > UINT32_MAX) throw config_error(fmt::format("cannot partition {} samples: indices are 32-bit", n));

  std::mt19937_64 rng(seed);
  std::vector<std::uint32_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = static_cast<std::uint32_t>(i);
  fisher_yates(order, rng);

  const auto w_count = static_cast<std::size_t>(workers);
  std::vector<std::vector<std::uint32_t>> out(w_count);

  if (kind == partition_kind::iid) {
    for (std::size_t w = 0; w < w_count; ++w) {
      const std::size_t lo = w * n / w_count, hi = (w + 1) * n / w_count;
      out[w].assign(order.begin() + static_cast<std::ptrdiff_t>(lo),
                    order.begin() + static_cast<std::ptrdiff_t>(hi));
    }
    return out;
  }

  if (kind == partition_kind::dirichlet) {
    const double alpha = opts.dirichlet_alpha;
    // Below 1e-300 the draws' logs (log U / alpha) overflow to -inf.
    if (!(alpha >= 1e-300) || !std::isfinite(alpha))
      throw config_error(fmt::format("dirichlet_alpha = {} for a dirichlet partition: expected a finite number of at least 1e-300", alpha));
    const std::size_t min_samples = std::max<std::size_t>(opts.min_samples, 1);
    if (min_samples > n / w_count)
      throw config_error(fmt::format("dirichlet partition of {} samples among workers = {} with at least {} samples each (a batch: [train] "
                                     "batch): too few samples; raise [train] train_limit, or lower workers or batch",
                                     n, workers, min_samples));
    std::array<std::size_t, 257> start{};
    const auto sorted = sort_by_label(ds, order, start);
    std::vector<double> p(w_count);
    for (std::size_t c = 0; c < 256; ++c) {
      const std::size_t lo = start[c], count = start[c + 1] - lo;
      if (count == 0) continue;
      // Proportions from the draws' logs, scaled by the largest: no draw
      // underflows to nothing or overflows, whatever alpha (a tiny one gives
      // the class to one worker, a huge one splits it evenly).
      double top = -INFINITY;
      for (auto& x : p) top = std::max(top, x = log_gamma_sample(rng, alpha));
      double sum = 0;
      for (auto& x : p) sum += (x = std::exp(x - top));
      // Cut the class at the rounded cumulative proportions: every sample once.
      double cum = 0;
      std::size_t from = 0;
      for (std::size_t w = 0; w < w_count; ++w) {
        cum += p[w];
        const std::size_t to = w + 1 == w_count ? count : std::min(count, static_cast<std::size_t>(std::llround(cum / sum * static_cast<double>(count))));
        if (to > from) out[w].insert(out[w].end(), sorted.begin() + static_cast<std::ptrdiff_t>(lo + from), sorted.begin() + static_cast<std::ptrdiff_t>(lo + to));
        from = std::max(from, to);
      }
    }
    // Top up: a worker short of min_samples takes random samples from the
    // largest share (the lowest rank among equals) until it has enough.
    for (std::size_t w = 0; w < w_count; ++w) {
      while (out[w].size() < min_samples) {
        std::size_t big = 0;
        for (std::size_t v = 1; v < w_count; ++v)
          if (out[v].size() > out[big].size()) big = v;
        auto& from = out[big];
        const std::size_t k = static_cast<std::size_t>(uniform_below(rng, from.size()));
        out[w].push_back(from[k]);
        from.erase(from.begin() + static_cast<std::ptrdiff_t>(k));
      }
    }
    return out;
  }

  if (classes_per_worker < 1)
    throw config_error(
        fmt::format("classes_per_worker = {} for a by_label partition: expected >= 1", classes_per_worker));
  const std::size_t shards = w_count * static_cast<std::size_t>(classes_per_worker);
  if (shards > n)
    throw config_error(
        fmt::format("by_label partition of {} samples into workers * classes_per_worker = {} * {} = {} "
                    "shards: too few samples; raise [train] train_limit, or lower workers or classes_per_worker",
                    n, workers, classes_per_worker, shards));

  // Stable counting sort by label keeps the shuffled order inside each class.
  std::array<std::size_t, 257> start{};
  const auto sorted = sort_by_label(ds, order, start);

  std::vector<std::uint32_t> shard_ids(shards);
  for (std::size_t s = 0; s < shards; ++s) shard_ids[s] = static_cast<std::uint32_t>(s);
  fisher_yates(shard_ids, rng);

  for (std::size_t w = 0; w < w_count; ++w) {
    auto& share = out[w];
    for (std::size_t k = 0; k < static_cast<std::size_t>(classes_per_worker); ++k) {
      const std::size_t s = shard_ids[w * static_cast<std::size_t>(classes_per_worker) + k];
      const std::size_t lo = s * n / shards, hi = (s + 1) * n / shards;
      share.insert(share.end(), sorted.begin() + static_cast<std::ptrdiff_t>(lo),
                   sorted.begin() + static_cast<std::ptrdiff_t>(hi));
    }
  }
  return out;
}

}  // namespace gossip::data

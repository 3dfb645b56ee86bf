#pragma once
/// A non-owning view of a worker's parameters.
///
///     std::vector<float> w1(784 * 128), b1(128);
///     gossip::model_view model;
///     model.add("fc1.weight", w1).add("fc1.bias", b1);
///
/// Peers compare layouts (names, element counts, dtypes) when they connect and
/// refuse to exchange if they differ, naming the first differing tensor.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gossip/error.hpp"

namespace gossip {

enum class dtype : std::uint8_t { f32, f64, f16, bf16 };
enum class memory_kind : std::uint8_t { host, cuda };

constexpr std::size_t dtype_size(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return 4;
    case dtype::f64: return 8;
    case dtype::f16:
    case dtype::bf16: return 2;
  }
  return 0;
}

constexpr std::string_view to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f64: return "f64";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
  }
  return "?";
}

struct tensor_view {
  std::string name;
  void* data = nullptr;
  std::size_t count = 0;  ///< elements, not bytes
  gossip::dtype dtype = dtype::f32;
  memory_kind memory = memory_kind::host;
  /// The optimizer's heavy-ball momentum buffer for this tensor (same count),
  /// when the training loop lets the engine make it quasi-global; else null.
  float* momentum = nullptr;
  /// Rows when the tensor is a row-major matrix of count / rows columns (see
  /// model_view::matrix), which the lowrank codec factors; 0 when not declared.
  std::size_t rows = 0;

  std::size_t bytes() const noexcept { return count * dtype_size(dtype); }
  std::span<float> f32() const noexcept { return {static_cast<float*>(data), count}; }
};

/// The shape of a model without its data: what peers compare at connect time.
struct layout_entry {
  std::string name;
  std::size_t count = 0;
  gossip::dtype dtype = dtype::f32;
  std::size_t rows = 0;  // a matrix's rows (model_view::matrix), else 0: a 2x3 and a 3x2 weight differ
  bool operator==(const layout_entry&) const = default;
};
using model_layout = std::vector<layout_entry>;

/// First difference between two layouts, or nothing when they match.
std::optional<std::string> layout_difference(const model_layout& mine, const model_layout& theirs);

/// Throws layout_error naming both ranks and the first differing tensor.
void check_layouts(const model_layout& mine, int my_rank, const model_layout& theirs, int their_rank);

/// A stable 64-bit fingerprint of a layout (FNV-1a over names, counts, dtypes, rows).
std::uint64_t fingerprint(const model_layout& layout) noexcept;

/// A 64-bit fingerprint of values, bit for bit (-0 and 0, NaN payloads
/// differ); never 0. Hosts of one byte order give equal values equal fingerprints.
std::uint64_t fingerprint(std::span<const float> values) noexcept;

class device_backend;  // gossip/device.hpp

class model_view {
 public:
  model_view() = default;

  model_view& add(std::string name, std::span<float> values, memory_kind mem = memory_kind::host) {
    return add(tensor_view{std::move(name), values.data(), values.size(), dtype::f32, mem});
  }
  model_view& add(tensor_view t) {
    if (t.name.empty()) throw error(fmt::format("model_view: tensor #{} has an empty name; give every tensor a unique name", m_tensors.size()));
    if (m_index.contains(t.name)) throw error(fmt::format("model_view: tensor name '{}' is used twice; names must be unique", t.name));
    // Names go into messages, the stats and the trace as they are.
    if (const auto bad = std::find_if(t.name.begin(), t.name.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; });
        bad != t.name.end()) {
      std::string shown;
      for (const char c : t.name) shown += static_cast<unsigned char>(c) < 0x20 || c == 0x7f ? fmt::format("\\x{:02x}", static_cast<unsigned char>(c)) : std::string(1, c);
      throw error(fmt::format("model_view: tensor #{} is named '{}', with a control character; give it a printable name", m_tensors.size(), shown));
    }
    if (t.count > 0 && t.data == nullptr) throw error(fmt::format("model_view: tensor '{}' has {} elements but a null pointer", t.name, t.count));
    if (t.count > std::numeric_limits<std::size_t>::max() / 2 / dtype_size(t.dtype))
      throw error(fmt::format("model_view: tensor '{}' has {} elements, more than any memory holds", t.name, t.count));
    // The passes read whole values: a pointer into the middle of one is a caller's mistake.
    if (t.count > 0 && reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
      throw error(fmt::format("model_view: tensor '{}' starts at {}, which is not aligned to its {}-byte values; pass the tensor's own "
                              "storage",
                              t.name, t.data, dtype_size(t.dtype)));
    // Memory seen twice would be merged twice at every exchange (and overshoot the average).
    if (const auto* r = first_overlap(t.memory, t.data, t.bytes(), npos))
      throw error(r->momentum ? fmt::format("model_view: tensor '{}' shares memory with the momentum buffer of tensor '{}'; register "
                                            "parameters, not the optimizer's buffers",
                                            t.name, m_tensors[r->tensor].name)
                              : fmt::format("model_view: tensor '{}' shares memory with tensor '{}'; register each parameter's memory once",
                                            t.name, m_tensors[r->tensor].name));
    m_index.emplace(t.name, m_tensors.size());
    insert_range(t.memory, t.data, t.bytes(), m_tensors.size(), false);
    m_tensors.push_back(std::move(t));
    return *this;
  }

  /// Registers the optimizer's momentum buffer of tensor `name` (heavy-ball:
  /// v ← β·v + g; x ← x − lr·v, as torch.optim.SGD without nesterov), so the
  /// engine can replace it with quasi-global momentum ([engine] momentum).
  ///
  ///     model.add("fc1.weight", w1).momentum("fc1.weight", v1);
  model_view& momentum(std::string_view name, std::span<float> buffer) {
    const std::size_t i = index_of(name, "momentum buffer");
    auto& t = m_tensors[i];
    if (buffer.size() != t.count)
      throw error(fmt::format("model_view: momentum buffer of tensor '{}' has {} elements but the tensor has {}", name, buffer.size(), t.count));
    if (t.momentum == buffer.data()) return *this;  // the same buffer again
    // One buffer for two tensors would be replaced by both (quasi-global momentum).
    if (const auto* r = first_overlap(t.memory, buffer.data(), buffer.size_bytes(), i))
      throw error(r->momentum ? fmt::format("model_view: the momentum buffer of tensor '{}' shares memory with the momentum buffer of tensor "
                                            "'{}'; give each tensor the optimizer's own buffer",
                                            name, m_tensors[r->tensor].name)
                              : fmt::format("model_view: the momentum buffer of tensor '{}' shares memory with tensor '{}'; give the "
                                            "optimizer's own buffer",
                                            name, m_tensors[r->tensor].name));
    if (t.momentum)
      throw error(fmt::format("model_view: tensor '{}' has a momentum buffer already; register one optimizer's buffer per tensor", name));
    t.momentum = buffer.data();
    insert_range(t.memory, buffer.data(), buffer.size_bytes(), i, true);
    return *this;
  }

  /// The index of tensor `name` in tensors(), or nothing.
  std::optional<std::size_t> find(std::string_view name) const {
    const auto it = m_index.find(std::string(name));
    if (it == m_index.end()) return std::nullopt;
    return it->second;
  }

  /// The optimizer's momentum factor β, for an adapter that read it (e.g.
  /// torch_momentum): an engine that makes the buffers quasi-global refuses a
  /// [engine] momentum_beta that differs, since it rebuilds them with that one.
  model_view& momentum_beta(double beta) {
    if (!(beta > 0 && beta < 1)) throw error(fmt::format("model_view: momentum_beta must be in (0, 1), got {}", beta));
    m_momentum_beta = beta;
    return *this;
  }
  std::optional<double> momentum_beta() const noexcept { return m_momentum_beta; }

  /// A check the engine runs before it touches the model: when it is built and
  /// at the start of every step(), poll() and finish(). For a framework whose
  /// tensors can get new storage after registration (the libtorch adapter:
  /// torch::load, module->to(), set_data), so that it throws, naming the
  /// tensor, instead of the engine reading memory that was freed. What the
  /// check captures lives as long as the engine.
  model_view& guard(std::function<void()> check) {
    if (!check) throw error("model_view: guard() needs a callable");
    m_guards.push_back(std::move(check));
    return *this;
  }
  const std::vector<std::function<void()>>& guards() const noexcept { return m_guards; }
  /// A guard of the registered momentum buffers: run as guard() checks are,
  /// but only by an engine that rebuilds those buffers (quasi-global
  /// momentum); under local momentum the engine never touches them, and the
  /// optimizer may replace them (a checkpoint's state).
  model_view& momentum_guard(std::function<void()> check) {
    if (!check) throw error("model_view: momentum_guard() needs a callable");
    m_momentum_guards.push_back(std::move(check));
    return *this;
  }
  const std::vector<std::function<void()>>& momentum_guards() const noexcept { return m_momentum_guards; }

  /// Declares tensor `name` a row-major rows × cols matrix (a weight, or a
  /// convolution kernel as out_channels × the rest), so that codecs that
  /// factor matrices (lowrank) can; other tensors are sent whole by them.
  ///
  ///     model.add("fc1.weight", w1).matrix("fc1.weight", 128, 784);
  model_view& matrix(std::string_view name, std::size_t rows, std::size_t cols) {
    auto& t = named(name, "matrix shape");
    if (rows == 0 || cols == 0 || rows * cols != t.count)
      throw error(fmt::format("model_view: tensor '{}' has {} elements, not a {} x {} matrix", name, t.count, rows, cols));
    t.rows = rows;
    return *this;
  }

  /// The backend for tensors added with memory_kind::cuda, and through it the
  /// stream the training loop updates them on; engines order all their work on
  /// that stream.
  ///
  ///     model.add("fc1.weight", {d_w1, n}, gossip::memory_kind::cuda);
  ///     model.on_device(gossip::cuda::device(stream));  // gossip/cuda.hpp, libgossip_cuda
  model_view& on_device(std::shared_ptr<const device_backend> backend) {
    m_device = std::move(backend);
    return *this;
  }
  const std::shared_ptr<const device_backend>& device() const noexcept { return m_device; }

  std::span<const tensor_view> tensors() const noexcept { return m_tensors; }
  std::size_t size() const noexcept { return m_tensors.size(); }
  const tensor_view& operator[](std::size_t i) const noexcept { return m_tensors[i]; }

  std::size_t elements() const noexcept {
    std::size_t n = 0;
    for (const auto& t : m_tensors) n += t.count;
    return n;
  }
  std::size_t bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& t : m_tensors) n += t.bytes();
    return n;
  }
  model_layout layout() const {
    model_layout l;
    l.reserve(m_tensors.size());
    for (const auto& t : m_tensors) l.push_back({t.name, t.count, t.dtype, t.rows});
    return l;
  }

 private:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  // Every registered block of memory (tensors and momentum buffers), which
  // never overlap, by where it starts: registering n tensors checks each
  // against the others in O(n log n), not O(n²).
  struct range {
    std::uintptr_t end = 0;
    std::size_t tensor = 0;
    bool momentum = false;
  };
  using range_key = std::pair<memory_kind, std::uintptr_t>;

  // The registered range that overlaps [data, data + bytes), skipping the
  // momentum buffer of tensor `own` (npos: skip none); null when none does.
  const range* first_overlap(memory_kind mem, const void* data, std::size_t bytes, std::size_t own) const {
    if (bytes == 0) return nullptr;
    const auto x = reinterpret_cast<std::uintptr_t>(data);
    // Ranges that start before x + bytes, latest first; the ranges are
    // disjoint, so the walk stops at the first that ends at or before x.
    for (auto it = m_ranges.lower_bound({mem, x + bytes}); it != m_ranges.begin();) {
      --it;
      if (it->first.first != mem || it->second.end <= x) break;
      if (!(it->second.momentum && it->second.tensor == own)) return &it->second;
    }
    return nullptr;
  }
  void insert_range(memory_kind mem, const void* data, std::size_t bytes, std::size_t tensor, bool momentum) {
    if (bytes == 0) return;
    const auto x = reinterpret_cast<std::uintptr_t>(data);
    m_ranges.insert_or_assign({mem, x}, range{x + bytes, tensor, momentum});
  }
  std::size_t index_of(std::string_view name, std::string_view what) const {
    if (const auto i = find(name)) return *i;
    throw error(fmt::format("model_view: {} for '{}', but no tensor has that name; add the tensor first", what, name));
  }
  tensor_view& named(std::string_view name, std::string_view what) { return m_tensors[index_of(name, what)]; }

  std::vector<tensor_view> m_tensors;
  std::unordered_map<std::string, std::size_t> m_index;  // name → position in m_tensors
  std::map<range_key, range> m_ranges;
  std::shared_ptr<const device_backend> m_device;
  std::optional<double> m_momentum_beta;
  std::vector<std::function<void()>> m_guards;
  std::vector<std::function<void()>> m_momentum_guards;
};

namespace detail {
/// Bytes of physical memory on this machine; 0 when the system does not say.
std::uint64_t physical_memory_bytes() noexcept;
}  // namespace detail

}  // namespace gossip

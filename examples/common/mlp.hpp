#pragma once
/// A small Eigen multilayer perceptron for the examples and experiments:
/// inputs -> hidden... (ReLU) -> classes, softmax cross-entropy.
///
///     gossip::examples::mlp net({.inputs = 784, .hidden = {128}, .classes = 10, .max_batch = 32});
///     net.init(/*seed=*/1);
///     gossip::examples::sgd_momentum opt{.lr = 0.05f};
///     float loss = net.train_batch(x, y, 32, opt);   // x: 32 samples of 784 floats, back to back
///     double acc = net.accuracy(test_x, test_y, n_test);
///
/// All parameters live in one contiguous float buffer, params(), so the model
/// can be handed to libgossip as named tensors pointing into it (tensors(),
/// register_tensors()). Layer l's weight is an out x in column-major matrix
/// followed by its bias of out floats; gradients use the same layout.
///
/// Inputs are `batch` samples stored back to back (gossip::data::dataset's
/// layout), i.e. a column-major inputs x batch matrix, one sample per column.
///
/// Not thread-safe: one mlp per worker thread (the evaluation functions are
/// const but share a scratch buffer).
#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <Eigen/Core>
#if defined(__SSE2__) || defined(_M_X64)
#include <xmmintrin.h>
#endif
#include <fmt/format.h>

#include "gossip/error.hpp"

namespace gossip::examples {

/// A named range of params(): what a model_view entry points at.
struct tensor_slice {
  std::string name;        ///< "fc1.weight", "fc1.bias", "fc2.weight", ...
  std::size_t offset = 0;  ///< in floats from params().data()
  std::size_t count = 0;   ///< floats
  std::size_t rows = 0;    ///< a weight: rows of it as a row-major matrix (in; out columns); 0 for a bias
};

struct mlp_config {
  int inputs = 784;
  std::vector<int> hidden = {128};  ///< at least one hidden layer
  int classes = 10;
  int max_batch = 64;     ///< largest batch train_batch accepts; scratch is sized for it
  int eval_batch = 1000;  ///< samples per forward pass in accuracy()/loss()
};

/// Anything that updates params from grads in place.
template <class O>
concept optimizer = requires(O& o, std::span<float> p, std::span<const float> g) {
  o.step(p, g);
};

namespace detail {
/// Sets flush-to-zero and denormals-are-zero on this thread while alive and
/// restores the caller's setting after. Heavy-ball velocity of a coordinate
/// whose gradient stays zero (the weight of a pixel that is always black)
/// decays geometrically into the subnormal range, where x86 arithmetic takes a
/// microcode assist: without this an SGD step over 100k floats took ~1.7 ms
/// instead of ~30 us. (TensorFlow does the same around its kernels.)
class scoped_flush_denormals {
 public:
#if defined(__SSE2__) || defined(_M_X64)
  scoped_flush_denormals() noexcept : m_saved(_mm_getcsr()) { _mm_setcsr(m_saved | 0x8040u); }  // FTZ | DAZ
  ~scoped_flush_denormals() { _mm_setcsr(m_saved); }
#else
  scoped_flush_denormals() noexcept = default;  // ARMv8 and others handle subnormals at full speed
#endif
  scoped_flush_denormals(const scoped_flush_denormals&) = delete;
  scoped_flush_denormals& operator=(const scoped_flush_denormals&) = delete;

 private:
#if defined(__SSE2__) || defined(_M_X64)
  unsigned m_saved;
#endif
};
}  // namespace detail

/// Classic heavy-ball SGD: v = momentum * v + (g + weight_decay * w); w -= lr * v.
/// The velocity is sized on the first step. Subnormals are flushed to zero
/// during the step (see detail::scoped_flush_denormals).
struct sgd_momentum {
  float lr = 0.05f;
  float momentum = 0.9f;
  float weight_decay = 0.0f;
  std::vector<float> velocity{};

  void step(std::span<float> params, std::span<const float> grads) {
    GOSSIP_ASSERT(params.size() == grads.size(), "{} params but {} grads", params.size(), grads.size());
    if (velocity.size() != params.size()) velocity.assign(params.size(), 0.0f);
    const detail::scoped_flush_denormals ftz;
    const auto n = static_cast<Eigen::Index>(params.size());
    Eigen::Map<Eigen::ArrayXf> v(velocity.data(), n), w(params.data(), n);
    const Eigen::Map<const Eigen::ArrayXf> g(grads.data(), n);
    if (weight_decay != 0.0f)
      v = momentum * v + (g + weight_decay * w);
    else
      v = momentum * v + g;
    w -= lr * v;
  }
};
static_assert(optimizer<sgd_momentum>);

/// Learning rate as a function of the step: linear warmup over warmup_steps,
/// then constant, step decay (multiply by gamma at each fraction of training
/// in milestones) or cosine decay from base to final_lr.
///
///     lr_schedule s{.type = lr_schedule::cosine, .base = 0.1f, .warmup_steps = 100};
///     opt.lr = s.at(step, total_steps);
struct lr_schedule {
  enum kind { constant, step, cosine };
  kind type = constant;
  float base = 0.05f;
  int warmup_steps = 0;
  float gamma = 0.1f;                          ///< step: factor per milestone
  std::vector<float> milestones{0.5f, 0.75f};  ///< step: fractions of total_steps
  float final_lr = 0.0f;                       ///< cosine: value at the last step

  float at(std::int64_t t, std::int64_t total_steps) const {
    if (warmup_steps > 0 && t < warmup_steps)
      return base * static_cast<float>(t + 1) / static_cast<float>(warmup_steps);
    switch (type) {
      case constant: return base;
      case step: {
        float lr = base;
        for (float m : milestones)
          if (static_cast<double>(t) >= static_cast<double>(m) * static_cast<double>(total_steps))
            lr *= gamma;
        return lr;
      }
      case cosine: {
        const double span = static_cast<double>(std::max<std::int64_t>(1, total_steps - warmup_steps));
        const double progress = std::clamp(static_cast<double>(t - warmup_steps) / span, 0.0, 1.0);
        return final_lr +
               (base - final_lr) * static_cast<float>(0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
      }
    }
    return base;
  }

  static std::string_view to_string(kind k) noexcept {
    switch (k) {
      case constant: return "constant";
      case step: return "step";
      case cosine: return "cosine";
    }
    return "?";
  }
  /// "constant", "step" or "cosine"; throws config_error naming the value otherwise.
  static kind parse(std::string_view name) {
    if (name == "constant") return constant;
    if (name == "step") return step;
    if (name == "cosine") return cosine;
    throw config_error(
        fmt::format("unknown learning-rate schedule '{}': expected constant, step or cosine", name));
  }
};

class mlp {
 public:
  using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic>;  // column-major
  using vector = Eigen::Matrix<float, Eigen::Dynamic, 1>;

  explicit mlp(mlp_config cfg = {}) : m_cfg(std::move(cfg)) {
    if (m_cfg.hidden.empty())
      throw config_error("mlp: at least one hidden layer is needed (hidden is empty)");
    auto check = [](std::string_view what, int v) {
      if (v < 1) throw config_error(fmt::format("mlp: {} = {}, expected >= 1", what, v));
    };
    check("inputs", m_cfg.inputs);
    check("classes", m_cfg.classes);
    check("max_batch", m_cfg.max_batch);
    check("eval_batch", m_cfg.eval_batch);
    for (int h : m_cfg.hidden) check("hidden layer width", h);

    int in = m_cfg.inputs;
    std::size_t off = 0;
    std::vector<int> outs = m_cfg.hidden;
    outs.push_back(m_cfg.classes);
    for (int out : outs) {
      layer l{in, out, off, off + static_cast<std::size_t>(in) * static_cast<std::size_t>(out)};
      off = l.b_off + static_cast<std::size_t>(out);
      m_layers.push_back(l);
      m_act.emplace_back(out, m_cfg.max_batch);
      m_delta.emplace_back(out, m_cfg.max_batch);
      m_eval.emplace_back(out, m_cfg.eval_batch);
      in = out;
    }
    m_params.assign(off, 0.0f);
    m_grads.assign(off, 0.0f);
  }

  const mlp_config& config() const noexcept { return m_cfg; }
  std::size_t param_count() const noexcept { return m_params.size(); }
  std::span<float> params() noexcept { return m_params; }
  std::span<const float> params() const noexcept { return m_params; }
  /// Gradient of the mean loss of the last train_batch()/gradient() call.
  std::span<const float> grads() const noexcept { return m_grads; }

  /// Named slices of params(), in memory order.
  std::vector<tensor_slice> tensors() const {
    std::vector<tensor_slice> out;
    for (std::size_t l = 0; l < m_layers.size(); ++l) {
      const auto& L = m_layers[l];
      out.push_back({fmt::format("fc{}.weight", l + 1), L.w_off, L.b_off - L.w_off, static_cast<std::size_t>(L.in)});
      out.push_back({fmt::format("fc{}.bias", l + 1), L.b_off, static_cast<std::size_t>(L.out)});
    }
    return out;
  }

  /// Adds every tensor to something with add(name, std::span<float>), e.g.
  /// gossip::model_view, and declares the weights' shapes where the view
  /// takes them (matrix(name, rows, cols)). The spans stay valid as long as this mlp lives.
  template <class View>
  View& register_tensors(View& view) {
    for (auto& t : tensors()) {
      view.add(t.name, params().subspan(t.offset, t.count));
      if constexpr (requires { view.matrix(t.name, t.rows, t.count); })
        if (t.rows) view.matrix(t.name, t.rows, t.count / t.rows);
    }
    return view;
  }

  /// He/Kaiming-uniform weights (bound sqrt(6 / fan_in)), zero biases.
  /// Reproducible across standard libraries: mt19937_64 and our own
  /// conversion to [0, 1).
  void init(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (const auto& L : m_layers) {
      const float bound = std::sqrt(6.0f / static_cast<float>(L.in));
      for (std::size_t i = L.w_off; i < L.b_off; ++i) {
        const float u = static_cast<float>(rng() >> 40) * 0x1p-24f;  // [0, 1), 24 exact bits
        m_params[i] = bound * (2.0f * u - 1.0f);
      }
      std::fill(m_params.begin() + static_cast<std::ptrdiff_t>(L.b_off),
                m_params.begin() + static_cast<std::ptrdiff_t>(L.b_off) + L.out, 0.0f);
    }
  }

  /// Forward and backward on one batch; fills grads() and returns the mean
  /// loss. Labels must be < classes. Allocates nothing itself; Eigen's matrix
  /// product takes its packing buffers from the stack up to
  /// EIGEN_STACK_ALLOCATION_LIMIT (128 KiB) and from the heap beyond (a
  /// 784x128 layer at batch 32 is beyond): one malloc per large product,
  /// noise next to that product's arithmetic.
  float gradient(const float* x, const std::uint8_t* y, int batch) {
    GOSSIP_ASSERT(batch >= 1 && batch <= m_cfg.max_batch, "batch {} outside 1..max_batch {}", batch,
                  m_cfg.max_batch);
    const detail::scoped_flush_denormals ftz;
    const Eigen::Index B = batch;
    const Eigen::Map<const matrix> X(x, m_cfg.inputs, B);
    forward(m_params.data(), X, m_act);

    // Softmax cross-entropy; delta of the logits is (p - onehot(y)) / B.
    auto& logits = m_act.back();
    auto& dz = m_delta.back();
    double total = 0.0;
    for (Eigen::Index j = 0; j < B; ++j) {
      const int label = y[j];
      GOSSIP_ASSERT(label < m_cfg.classes, "label {} at batch position {} is not < classes {}", label, j,
                    m_cfg.classes);
      auto z = logits.col(j);
      const float zmax = z.maxCoeff();
      auto d = dz.col(j);
      d = (z.array() - zmax).exp().matrix();
      const float s = d.sum();
      total += std::log(static_cast<double>(s)) - static_cast<double>(z(label) - zmax);
      d *= 1.0f / (s * static_cast<float>(B));
      d(label) -= 1.0f / static_cast<float>(B);
    }

    for (std::size_t l = m_layers.size(); l-- > 0;) {
      const auto D = m_delta[l].leftCols(B);
      if (l == 0)
        gw(0).noalias() = D * X.transpose();
      else
        gw(l).noalias() = D * m_act[l - 1].leftCols(B).transpose();
      gb(l).noalias() = D.rowwise().sum();
      if (l > 0) {
        auto prev = m_delta[l - 1].leftCols(B);
        prev.noalias() = w(m_params.data(), l).transpose() * D;
        prev = (m_act[l - 1].leftCols(B).array() > 0.0f).select(prev, 0.0f);
      }
    }
    return static_cast<float>(total / static_cast<double>(B));
  }

  /// gradient() then opt.step(params(), grads()); returns the mean loss.
  template <optimizer O>
  float train_batch(const float* x, const std::uint8_t* y, int batch, O& opt) {
    const float l = gradient(x, y, batch);
    opt.step(params(), grads());
    return l;
  }

  /// Fraction of the n samples classified correctly.
  double accuracy(const float* x, const std::uint8_t* y, std::size_t n) const {
    return accuracy_of(m_params, x, y, n);
  }
  /// Mean cross-entropy over the n samples.
  double loss(const float* x, const std::uint8_t* y, std::size_t n) const {
    return loss_of(m_params, x, y, n);
  }

  /// accuracy() of another parameter vector of this architecture, e.g. the
  /// average of several workers' models. Throws layout_error on a size mismatch.
  double accuracy_of(std::span<const float> params, const float* x, const std::uint8_t* y,
                     std::size_t n) const {
    std::size_t correct = 0;
    evaluate(params, x, n, [&](Eigen::Index j, const auto& z, std::size_t sample) {
      Eigen::Index best = 0;
      z.col(j).maxCoeff(&best);
      correct += best == static_cast<Eigen::Index>(y[sample]);
    });
    return n == 0 ? 0.0 : static_cast<double>(correct) / static_cast<double>(n);
  }

  /// loss() of another parameter vector of this architecture.
  double loss_of(std::span<const float> params, const float* x, const std::uint8_t* y, std::size_t n) const {
    double total = 0.0;
    evaluate(params, x, n, [&](Eigen::Index j, const auto& z, std::size_t sample) {
      const int label = y[sample];
      GOSSIP_ASSERT(label < m_cfg.classes, "label {} of sample {} is not < classes {}", label, sample,
                    m_cfg.classes);
      const auto c = z.col(j);
      const float zmax = c.maxCoeff();
      double s = 0.0;
      for (Eigen::Index k = 0; k < c.size(); ++k) s += std::exp(static_cast<double>(c(k) - zmax));
      total += std::log(s) - static_cast<double>(c(label) - zmax);
    });
    return n == 0 ? 0.0 : total / static_cast<double>(n);
  }

 private:
  struct layer {
    int in = 0, out = 0;
    std::size_t w_off = 0, b_off = 0;
  };

  Eigen::Map<const matrix> w(const float* p, std::size_t l) const {
    return {p + m_layers[l].w_off, m_layers[l].out, m_layers[l].in};
  }
  Eigen::Map<const vector> b(const float* p, std::size_t l) const {
    return {p + m_layers[l].b_off, m_layers[l].out};
  }
  Eigen::Map<matrix> gw(std::size_t l) {
    return {m_grads.data() + m_layers[l].w_off, m_layers[l].out, m_layers[l].in};
  }
  Eigen::Map<vector> gb(std::size_t l) { return {m_grads.data() + m_layers[l].b_off, m_layers[l].out}; }

  // Writes every layer's output for the X.cols() samples into the first
  // columns of act: ReLU activations for hidden layers, logits for the last.
  void forward(const float* p, const Eigen::Map<const matrix>& X, std::vector<matrix>& act) const {
    const Eigen::Index B = X.cols();
    for (std::size_t l = 0; l < m_layers.size(); ++l) {
      auto out = act[l].leftCols(B);
      if (l == 0)
        out.noalias() = w(p, 0) * X;
      else
        out.noalias() = w(p, l) * act[l - 1].leftCols(B);
      out.colwise() += b(p, l);
      if (l + 1 < m_layers.size()) out = out.cwiseMax(0.0f);
    }
  }

  // Runs the forward pass in chunks of eval_batch and calls
  // per_sample(column, logits, sample index) for every sample.
  template <class F>
  void evaluate(std::span<const float> params, const float* x, std::size_t n, F&& per_sample) const {
    if (params.size() != m_params.size())
      throw layout_error(
          fmt::format("mlp: a parameter vector of {} floats does not fit this architecture ({} floats)",
                      params.size(), m_params.size()));
    const auto chunk = static_cast<std::size_t>(m_cfg.eval_batch);
    const auto in = static_cast<std::size_t>(m_cfg.inputs);
    for (std::size_t start = 0; start < n; start += chunk) {
      const auto B = static_cast<Eigen::Index>(std::min(chunk, n - start));
      const Eigen::Map<const matrix> X(x + start * in, m_cfg.inputs, B);
      forward(params.data(), X, m_eval);
      const auto& logits = m_eval.back();
      for (Eigen::Index j = 0; j < B; ++j) per_sample(j, logits, start + static_cast<std::size_t>(j));
    }
  }

  mlp_config m_cfg;
  std::vector<layer> m_layers;
  std::vector<float> m_params, m_grads;
  std::vector<matrix> m_act, m_delta;  // out x max_batch per layer
  mutable std::vector<matrix> m_eval;  // out x eval_batch per layer
};

}  // namespace gossip::examples

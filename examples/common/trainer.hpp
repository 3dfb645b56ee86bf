#pragma once
// Decentralized training of the Fashion-MNIST MLP: N workers, each with its own
// shard, optimizer and gossip engine — as threads of one process (loopback,
// switch) or as processes (ucx). Shared by examples/01_fashion_mnist and
// bench/traffic.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <map>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/batch_stream.hpp"
#include "common/data.hpp"
#include "common/epoch_exchange.hpp"
#include "common/local_sgd.hpp"
#include "common/mlp.hpp"
#include "gossip/bootstrap.hpp"
#include "gossip/gossip.hpp"
#if defined(GOSSIP_HAVE_UCX)
#include "gossip/transports/ucx/ucx.hpp"
#endif
#if defined(GOSSIP_HAVE_SWITCH)
#include "gossip/transports/switch/switch.hpp"
#endif

namespace gossip::examples {

/// The [train] section: what is trained, on how many workers, for how long.
inline const std::vector<option_spec>& train_option_specs() {
  static const std::vector<option_spec> specs = {
      {"workers", std::int64_t{4}, "number of workers (threads, one rank each)"},
      {"epochs", std::int64_t{3}, "passes over each worker's shard"},
      {"batch", std::int64_t{32}, "minibatch size per worker"},
      {"hidden", int_list{128}, "hidden layer widths, e.g. [256, 128] (the CNN: one width, its fully connected layer)"},
      {"lr", 0.05, "base learning rate"},
      {"momentum", 0.9, "heavy-ball momentum"},
      {"weight_decay", 0.0, "L2 weight decay"},
      {"schedule", std::string("step"), "learning-rate schedule: constant, step (x0.1 at 50 % and 75 %) or cosine"},
      {"warmup_steps", std::int64_t{0}, "linear learning-rate warmup"},
      {"partition", std::string("iid"),
       "iid, by_label (non-iid: each worker sees about classes_per_worker classes) or dirichlet (each class split by Dir(dirichlet_alpha))"},
      {"classes_per_worker", std::int64_t{2}, "classes per worker for partition = by_label"},
      {"dirichlet_alpha", 0.1, "concentration for partition = dirichlet (0.1: strongly skewed; large: nearly iid)"},
      {"average_every", std::int64_t{0},
       "0: the [policy] decides after every step; H >= 1: local SGD instead, average_rounds gossip rounds after every H steps"},
      {"average_rounds", std::int64_t{-1}, "gossip rounds at each local-SGD averaging point (-1: ceil(log2 workers), at least 1)"},
      {"outer_lr", 1.0,
       "outer learning rate at each averaging point, or with average_every = 0 after each step that merged (DiLoCo: 0.7; 1 with "
       "outer_momentum 0: plain averaging)"},
      {"outer_momentum", 0.0, "outer Nesterov momentum at the same points (DiLoCo: 0.9)"},
      {"seed", std::int64_t{1}, "seed for initialisation, partition and batch order"},
      {"train_limit", std::int64_t{0}, "use only the first N training samples (0: all 60000)"},
      {"data_dir", std::string(), "Fashion-MNIST directory (default: $GOSSIP_FASHION_MNIST_DIR or the Debian package's)"},
      {"probe_every", std::int64_t{0}, "every this many steps record the exact consensus distance, sends and weights (workers as threads; 0: off)"},
  };
  return specs;
}

struct train_settings {
  int workers = 4, epochs = 3, batch = 32;
  std::vector<int> hidden{128};
  double lr = 0.05, momentum = 0.9, weight_decay = 0.0;
  lr_schedule::kind schedule = lr_schedule::step;
  int warmup_steps = 0;
  data::partition_kind partition = data::partition_kind::iid;
  int classes_per_worker = 2;
  double dirichlet_alpha = 0.1;
  int average_every = 0;   ///< 0: gossip as the [policy] decides; H: local SGD averaging every H steps
  int average_rounds = -1; ///< -1: ceil(log2 workers)
  double outer_lr = 1.0, outer_momentum = 0.0;
  std::uint64_t seed = 1;
  std::size_t train_limit = 0;
  std::string data_dir;
  int probe_every = 0;
  std::string workers_from;       ///< where `workers` was set (file and section, or the command line)
  std::string probe_every_from;   ///< where `probe_every` was set; empty when the config file set it (or nothing did)

  static train_settings from(const options& o) {
    train_settings s;
    auto positive = [&](const char* key, std::int64_t lo, std::int64_t hi) {
      const auto v = o.integer(key);
      if (v < lo || v > hi) throw config_error(fmt::format("{}: key '{}' must be in {}..{}, got {}", o.where(key), key, lo, hi, v));
      return static_cast<int>(v);
    };
    s.workers = positive("workers", 1, 256);
    s.epochs = positive("epochs", 1, 10000);
    s.batch = positive("batch", 1, 4096);
    s.hidden.clear();
    for (auto h : o.integers("hidden")) {
      if (h < 1 || h > 65536) throw config_error(fmt::format("{}: key 'hidden' holds width {}; widths must be in 1..65536", o.where("hidden"), h));
      s.hidden.push_back(static_cast<int>(h));
    }
    if (s.hidden.empty()) throw config_error(fmt::format("{}: key 'hidden' must list at least one hidden layer width", o.where("hidden")));
    s.lr = o.real("lr");
    s.momentum = o.real("momentum");
    s.weight_decay = o.real("weight_decay");
    // The model trains in float: each value must hold as one (1e39 would be
    // inf, 0.99999999 would round to 1).
    const auto as_float = [](double v) { return static_cast<double>(static_cast<float>(v)); };
    if (!(s.lr > 0) || !std::isfinite(as_float(s.lr)) || !(s.lr >= std::numeric_limits<float>::min()))
      throw config_error(fmt::format("{}: key 'lr' must be a number > 0 that a float holds (1.2e-38 to 3.4e38), got {}", o.where("lr"), s.lr));
    if (!(s.weight_decay >= 0) || !std::isfinite(as_float(s.weight_decay)))
      throw config_error(fmt::format("{}: key 'weight_decay' must be a number >= 0 that a float holds (up to 3.4e38), got {}", o.where("weight_decay"),
                                     s.weight_decay));
    if (!(s.momentum >= 0 && as_float(s.momentum) < 1))
      throw config_error(fmt::format("{}: key 'momentum' must be in [0, 1) as a float (at most 0.99999994), got {}", o.where("momentum"), s.momentum));
    try {
      s.schedule = lr_schedule::parse(o.string("schedule"));
    } catch (const config_error& e) {
      throw config_error(fmt::format("{}: key 'schedule': {}", o.where("schedule"), e.what()));
    }
    try {
      s.partition = data::parse_partition_kind(o.string("partition"));
    } catch (const config_error& e) {
      throw config_error(fmt::format("{}: key 'partition': {}", o.where("partition"), e.what()));
    }
    s.warmup_steps = positive("warmup_steps", 0, 1 << 30);
    s.classes_per_worker = positive("classes_per_worker", 1, 10);
    s.dirichlet_alpha = o.real("dirichlet_alpha");
    if (!(s.dirichlet_alpha >= 1e-300) || !std::isfinite(s.dirichlet_alpha))
      throw config_error(fmt::format("{}: key 'dirichlet_alpha' must be a finite number of at least 1e-300, got {}", o.where("dirichlet_alpha"),
                                     s.dirichlet_alpha));
    s.average_every = positive("average_every", 0, 1 << 30);
    s.average_rounds = positive("average_rounds", -1, 64);
    if (s.average_rounds == 0) throw config_error(fmt::format("{}: key 'average_rounds' must be >= 1, or -1 for automatic", o.where("average_rounds")));
    s.outer_lr = o.real("outer_lr");
    s.outer_momentum = o.real("outer_momentum");
    if (!(s.outer_lr > 0) || !std::isfinite(as_float(s.outer_lr)) || !(s.outer_lr >= std::numeric_limits<float>::min()))
      throw config_error(fmt::format("{}: key 'outer_lr' must be a number > 0 that a float holds (1.2e-38 to 3.4e38), got {}", o.where("outer_lr"),
                                     s.outer_lr));
    if (!(s.outer_momentum >= 0 && as_float(s.outer_momentum) < 1))
      throw config_error(fmt::format("{}: key 'outer_momentum' must be in [0, 1) as a float (at most 0.99999994), got {}", o.where("outer_momentum"),
                                     s.outer_momentum));
    if (o.integer("seed") < 0) throw config_error(fmt::format("{}: key 'seed' must be an integer >= 0, got {}", o.where("seed"), o.integer("seed")));
    s.seed = static_cast<std::uint64_t>(o.integer("seed"));
    s.train_limit = static_cast<std::size_t>(positive("train_limit", 0, 1 << 30));
    s.data_dir = o.string("data_dir");
    s.probe_every = positive("probe_every", 0, 1 << 30);
    s.workers_from = o.where("workers");
    if (o.where("probe_every") != o.where()) s.probe_every_from = o.where("probe_every");
    // A key given on the command line for a mode that does not read it would
    // change nothing (a config file may hold them all, to switch modes with --set).
    const auto unused = [&](const char* key, bool used, std::string_view needs) {
      if (!used && o.where(key) != o.where())
        throw config_error(fmt::format("{}: [train] {} applies only with {}; it would change nothing here: leave it out, or set that too", o.where(key),
                                       key, needs));
    };
    unused("classes_per_worker", s.partition == data::partition_kind::by_label, "partition = \"by_label\"");
    unused("dirichlet_alpha", s.partition == data::partition_kind::dirichlet, "partition = \"dirichlet\"");
    unused("average_rounds", s.average_every > 0, "average_every > 0 (local SGD)");
    return s;
  }

  /// How the training set is split (every worker gets at least one batch).
  data::partition_options partition_opts() const {
    return {.classes_per_worker = classes_per_worker, .dirichlet_alpha = dirichlet_alpha, .min_samples = static_cast<std::size_t>(batch)};
  }
  /// Gossip rounds at each local-SGD averaging point.
  int rounds_per_average() const {
    if (average_rounds > 0) return average_rounds;
    int k = 0;
    while ((1 << k) < workers) ++k;
    return std::max(k, 1);
  }
};

struct datasets {
  data::dataset train, test;
  static datasets load(const train_settings& s) {
    const std::string dir = s.data_dir.empty() ? data::fashion_mnist_dir() : s.data_dir;
    datasets d{data::load_fashion_mnist(true, dir), data::load_fashion_mnist(false, dir)};
    // A model is sized by the training images and evaluated on the test ones.
    if (d.test.size() == 0)
      throw data_error(fmt::format("{}: the test set holds no images; give a directory whose t10k files hold some", dir));
    if (d.test.rows != d.train.rows || d.test.cols != d.train.cols)
      throw data_error(fmt::format("{}: the training images are {}x{} and the test images {}x{}; give a directory whose train and t10k "
                                   "files come from one dataset",
                                   dir, d.train.rows, d.train.cols, d.test.rows, d.test.cols));
    if (s.train_limit > 0 && s.train_limit < d.train.size()) {
      d.train.labels.resize(s.train_limit);
      d.train.images.resize(s.train_limit * d.train.features());
    }
    return d;
  }
};

/// The push-sum estimate of the global average, Σ w_i z_i / Σ w_i, over
/// `workers`: params(w) gives a worker's parameters z_i, weight(w) its push-sum
/// weight w_i. The CPU and the GPU example evaluate this model at each epoch.
template <class Workers, class Params, class Weight>
std::vector<float> push_sum_average(const Workers& workers, Params params, Weight weight) {
  std::vector<float> avg(params(*std::begin(workers)).size(), 0.0f);
  double wsum = 0;
  for (const auto& w : workers) wsum += weight(w);
  for (const auto& w : workers) {
    const auto a = static_cast<float>(weight(w) / wsum);
    const auto& z = params(w);
    for (std::size_t k = 0; k < avg.size(); ++k) avg[k] += a * z[k];
  }
  return avg;
}

/// The example programs' report on stdout: a header, a line per epoch as it
/// completes, and a closing line.
inline void print_epoch_header() {
  fmt::print("{:>5} {:>10} {:>12} {:>12} {:>14} {:>10} {:>9}\n", "epoch", "loss", "avg-model", "local-mean", "bytes", "sends", "train-s");
}
inline void print_epoch(const epoch_record& e) {
  fmt::print("{:>5} {:>10.4f} {:>11.2f}% {:>11.2f}% {:>14} {:>10} {:>9.1f}\n", e.epoch, e.train_loss, 100 * e.accuracy,
             100 * e.local_accuracy_mean, e.bytes_sent, e.sends, e.train_seconds);
  std::fflush(stdout);
}
inline void print_done(const run_report& r) {
  fmt::print("done: accuracy {:.2f}% (average model), {:.2f}% (mean of local models), {:.1f} MB sent in {} messages, "
             "{} of {} steps sent, {:.1f} s training\n",
             100 * r.accuracy, 100 * r.local_accuracy_mean, r.bytes_sent / 1e6, r.messages, r.sends, r.steps, r.train_seconds);
}

inline nlohmann::json to_json(const std::vector<timeline_point>& timeline) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& p : timeline)
    j.push_back({{"step", p.step}, {"lr", p.lr}, {"consensus", p.consensus}, {"consensus_estimate", p.consensus_estimate},
                 {"weight_min", p.weight_min}, {"weight_max", p.weight_max}, {"sends", p.sends}});
  return j;
}

/// Makes each worker's model: the MLP of [train] hidden. Another model comes
/// with a factory of its own whose product has the MLP's training interface:
/// register_tensors(view), train_batch(x, y, batch, sgd_momentum&) (host
/// batch in, mean loss out), accuracy(x, y, n) and accuracy_of(params, x, y, n)
/// on host test data, and either
///   - host parameters: params() (one contiguous span) and tensors(), whose
///     momentum is opt.velocity (examples/03_libtorch_cnn), or
///   - device parameters: `static constexpr bool on_device = true` and
///     download(std::vector<float>&); the model keeps its own momentum in
///     device memory and registers it with its tensors, so the engine can make
///     it quasi-global there too (examples/02_fashion_mnist_cuda).
/// A factory may also refuse settings it cannot train with: check(cfg, s),
/// called once before any worker starts, throws config_error.
struct mlp_factory {
  /// Refuses, before anything is allocated, a model that the workers of this
  /// process could not hold: each keeps its parameters, gradients and
  /// velocity, and its engine at least two send buffers and two receive
  /// slots, seven copies in all (threads over loopback: every worker here).
  void check(const config& cfg, const train_settings& s) const {
    double values = 0, in = 784;  // Fashion-MNIST's 28x28 pixels
    for (const int h : s.hidden) values += (in + 1) * h, in = h;
    values += (in + 1) * 10;
    const int here = cfg.transport.name == "ucx" ? 1 : s.workers;
    const double bytes = values * sizeof(float) * 7 * here;
    const std::uint64_t physical = gossip::detail::physical_memory_bytes();
    constexpr double gib = 1024.0 * 1024.0 * 1024.0;
    if (physical != 0 && bytes > static_cast<double>(physical))
      throw config_error(fmt::format("[train] hidden = [{}] makes a model of {:.3g} values; {} worker(s) in this process would hold at least "
                                     "{:.1f} GiB for it (parameters, gradients, velocity and the engine's buffers: seven copies each), more "
                                     "than this machine's {:.1f} GiB; use narrower hidden layers{}",
                                     fmt::join(s.hidden, ", "), values, here, bytes / gib, static_cast<double>(physical) / gib,
                                     here > 1 ? " or fewer workers" : ""));
  }
  mlp operator()(const train_settings& s, const datasets& data) const {
    mlp net(mlp_config{.inputs = static_cast<int>(data.train.features()), .hidden = s.hidden, .classes = 10, .max_batch = s.batch});
    net.init(s.seed);  // a common initial model on every worker
    return net;
  }
};

/// True for a model whose parameters live in device memory (see mlp_factory).
template <class Net>
inline constexpr bool on_device_v = requires { requires Net::on_device; };

/// The parameters of `net` in host memory, into `out`.
template <class Net>
void host_params(Net& net, std::vector<float>& out) {
  if constexpr (on_device_v<Net>)
    net.download(out);
  else
    out.assign(net.params().begin(), net.params().end());
}

/// One rank's training loop. Rank 0 evaluates the average model at each
/// epoch boundary and fills the report.
template <class MakeNet = mlp_factory>
void train_rank(int r, int world, const engine_spec& base, any_transport transport, const train_settings& s, const datasets& data,
                const std::vector<std::vector<std::uint32_t>>& shards, int steps_per_epoch, epoch_exchange& exchange,
                run_report& report, const std::function<void(const epoch_record&)>& on_epoch, const MakeNet& make_net = {}) {
  const auto ri = static_cast<std::size_t>(r);
  const std::int64_t total_steps = static_cast<std::int64_t>(steps_per_epoch) * s.epochs;
  auto net = make_net(s, data);
  using net_type = decltype(net);
  sgd_momentum opt{.lr = static_cast<float>(s.lr), .momentum = static_cast<float>(s.momentum), .weight_decay = static_cast<float>(s.weight_decay)};
  model_view view;
  net.register_tensors(view);
  if constexpr (!on_device_v<net_type>) {
    opt.velocity.assign(net.params().size(), 0.0f);
    // The engine may make the momentum quasi-global ([engine] momentum).
    for (const auto& t : net.tensors()) view.momentum(t.name, std::span<float>(opt.velocity).subspan(t.offset, t.count));
  }
  engine eng(view, r, world, base, std::move(transport));
  const int average_every = s.average_every, rounds = s.rounds_per_average();
  // The outer optimizer and the probes read and write host parameters (a device model's factory refuses them in check()).
  outer_optimizer outer{.lr = static_cast<float>(s.outer_lr), .momentum = static_cast<float>(s.outer_momentum)};
  const auto outer_start = [&] {
    if constexpr (!on_device_v<net_type>) outer.start(net.params());
  };
  const auto outer_step = [&] {
    if constexpr (!on_device_v<net_type>) outer.step(net.params());
  };
  if (outer.active()) outer_start();
  lr_schedule sched{.type = s.schedule, .base = static_cast<float>(s.lr), .warmup_steps = s.warmup_steps};
  batch_stream batches(shards[ri], s.seed * 1000003u + static_cast<std::uint64_t>(r));
  std::vector<std::uint32_t> idx(static_cast<std::size_t>(s.batch));
  std::vector<float> xb(static_cast<std::size_t>(s.batch) * data.train.features());
  std::vector<std::uint8_t> yb(static_cast<std::size_t>(s.batch));
  std::int64_t t = 0;
  double train_seconds = 0;
  const auto wall_start = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < s.epochs; ++epoch) {
    const auto phase_start = std::chrono::steady_clock::now();
    batches.new_epoch();
    double loss_sum = 0;
    for (int b = 0; b < steps_per_epoch; ++b, ++t) {
      batches.next(idx);
      data::gather(data.train, idx, xb.data(), yb.data());
      opt.lr = sched.at(t, total_steps);
      const float loss = net.train_batch(xb.data(), yb.data(), s.batch, opt);
      loss_sum += loss;
      const auto res = eng.step({.lr = opt.lr, .loss = loss});
      if (average_every > 0 && (t + 1) % average_every == 0) {
        // An averaging point: the rounds of averaging_schedule, no local update in between.
        for (int k = 0; k < rounds; ++k) eng.step({.lr = opt.lr, .loss = loss});
        if (outer.active()) outer_step();
      } else if (average_every == 0 && outer.active() && res.merged > 0) {
        outer_step();  // gossip: an outer step at each merge
      }
      if constexpr (!on_device_v<net_type>)
        if (s.probe_every > 0 && (t + 1) % s.probe_every == 0)
          exchange.probe(r, t + 1, {net.params(), eng.weight(), eng.consensus(), opt.lr, eng.stats().sends}, report.timeline);
    }
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - phase_start).count();
    const bool last = epoch + 1 == s.epochs;
    const auto& st = eng.stats();
    rank_epoch mine;
    mine.loss = loss_sum / steps_per_epoch;
    mine.local_accuracy = net.accuracy(data.test.images.data(), data.test.labels.data(), data.test.size());
    mine.weight = eng.weight();
    mine.bytes_sent = st.bytes_sent, mine.messages = st.messages_sent, mine.sends = st.sends, mine.steps = st.steps;
    host_params(net, mine.params);
    if (last) mine.stats_json = st.to_json(-1);
    const std::size_t mine_size = mine.params.size();
    mine.dead = st.dead_peers;
    mine.lost_weight = st.lost_weight;
    auto all = exchange.gather(r, epoch, std::move(mine), [&] {
      eng.poll();
      return eng.stats().dead_peers;
    });
    if (r != 0) continue;
    // A worker thread that failed left its slot empty (its error is rethrown after the join).
    std::erase_if(all, [&](const rank_epoch& e) { return e.params.size() != mine_size; });
    if (all.empty()) continue;
    const double live = static_cast<double>(all.size());
    const auto avg = push_sum_average(all, [](const rank_epoch& e) -> const std::vector<float>& { return e.params; },
                                      [](const rank_epoch& e) { return e.weight; });
    epoch_record rec;
    rec.epoch = epoch + 1;
    rec.accuracy = net.accuracy_of(avg, data.test.images.data(), data.test.labels.data(), data.test.size());
    for (const auto& e : all) {
      rec.train_loss += e.loss / live;
      rec.local_accuracy_mean += e.local_accuracy / live;
      rec.bytes_sent += e.bytes_sent;
      rec.messages += e.messages;
      rec.sends += e.sends;
    }
    rec.train_seconds = train_seconds;
    report.epochs.push_back(rec);
    if (on_epoch) on_epoch(rec);
    if (last) {
      report.complete = true;
      report.accuracy = rec.accuracy;
      report.local_accuracy_mean = rec.local_accuracy_mean;
      report.train_seconds = train_seconds;
      report.bytes_sent = rec.bytes_sent;
      report.messages = rec.messages;
      report.sends = rec.sends;
      for (const auto& e : all) {
        report.steps += e.steps;
        report.rank_stats.push_back(e.stats_json);
      }
    }
  }
  exchange.before_finish(r, [&] {
    eng.poll();
    return eng.stats().dead_peers;
  });
  eng.finish(0);
  exchange.done(r, eng.weight(), eng.stats(), report);
  if (r == 0) report.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
}

namespace detail {
/// iid and by_label: ⌊smallest shard / batch⌋, every sample of the smallest
/// shard once per epoch. dirichlet: ⌊samples / (workers · batch)⌋, the mean
/// shard's batches; each worker cycles through its own shard (batch_stream),
/// so small shards repeat and large ones are subsampled within an epoch.
inline int steps_per_epoch(const config& cfg, const train_settings& s, const std::vector<std::vector<std::uint32_t>>& shards) {
  // Where the sample count came from: train_limit when it was set, else the [train] section.
  const auto it = cfg.sections.find("train");
  const std::string where = it != cfg.sections.end() && it->second.has("train_limit") ? it->second.where("train_limit") : cfg.source + " [train]";
  std::size_t shard_min = std::numeric_limits<std::size_t>::max(), total = 0;
  for (const auto& sh : shards) shard_min = std::min(shard_min, sh.size()), total += sh.size();
  int steps = 0;
  if (s.partition == data::partition_kind::dirichlet) {
    const auto per_worker = total / (shards.size() * static_cast<std::size_t>(s.batch));
    if (per_worker < 1 || shard_min < 1)
      throw config_error(fmt::format("{}: {} samples among {} workers make less than one batch of {} each; use more samples (train_limit), "
                                     "a smaller batch or fewer workers",
                                     where, total, s.workers, s.batch));
    steps = static_cast<int>(per_worker);
  } else {
    steps = static_cast<int>(shard_min / static_cast<std::size_t>(s.batch));
    if (steps < 1)
      throw config_error(fmt::format("{}: each of {} workers has only {} samples, fewer than one batch of {}; use more samples (train_limit), "
                                     "a smaller batch or fewer workers",
                                     where, s.workers, shard_min, s.batch));
  }
  // A warmup longer than the run never reaches [train] lr.
  const std::int64_t run = static_cast<std::int64_t>(steps) * s.epochs;
  if (s.warmup_steps > run) {
    const std::string wu = it != cfg.sections.end() && it->second.has("warmup_steps") ? it->second.where("warmup_steps") : cfg.source + " [train]";
    throw config_error(fmt::format("{}: warmup_steps = {} is longer than the whole run ({} epochs of {} steps = {} steps), so the learning "
                                   "rate would never reach lr; use fewer warmup steps, or more epochs or samples",
                                   wu, s.warmup_steps, s.epochs, steps, run));
  }
  // Local SGD that never reaches its first average trains every worker alone:
  // a control that sends nothing (bench/traffic may ask for one), so said, not refused.
  if (s.average_every > run) {
    // The config's value, or one the program chose (bench/traffic's local-SGD control), not the config's.
    const bool from_config = it != cfg.sections.end() && it->second.has("average_every") && it->second.integer("average_every") == s.average_every;
    const std::string ae = from_config ? it->second.where("average_every")
                                       : fmt::format("[train] as the program set it (not {}'s)", cfg.source);
    fmt::print(stderr, "warning: {}: average_every = {} is longer than the whole run ({} epochs of {} steps = {} steps): the workers never "
                       "average\n", ae, s.average_every, s.epochs, steps, run);
  }
  return steps;
}

/// The engine settings of `cfg`; for local SGD (s.average_every > 0) the
/// [policy] is replaced by the averaging schedule.
inline engine_spec engine_spec_for(const config& cfg, const train_settings& s) {
  // The report is the ranks' exact push-sum average after the last epoch, and
  // the ranks leave without forced rounds (finish(0)), whose bytes it would not count.
  if (cfg.engine.has("finish_rounds"))
    throw config_error(fmt::format("{}: this program evaluates the ranks' exact push-sum average after the last epoch and ends "
                                   "without forced rounds, so finish_rounds would go unused; remove it (it is for training "
                                   "loops of your own that call finish())",
                                   cfg.engine.where("finish_rounds")));
  // Quasi-global momentum rebuilds SGD's buffers with [engine] momentum_beta:
  // it follows [train] momentum unless set, and must then agree with it.
  config c = cfg;
  if (s.momentum > 0) c.follow_momentum(s.momentum, "[train] momentum");
  engine_spec spec = engine_spec::from(c);
  // Ranks in processes must train alike: [train] joins the settings peers
  // compare at connection (all of it but data_dir, a path on this host, and
  // probe_every, which only threads use), so a rank started with another
  // seed, partition or schedule is refused, the key named.
  const options train = cfg.section("train", train_option_specs());
  for (const auto& [k, v] : train.values())
    if (k != "data_dir" && k != "probe_every") spec.config_settings += fmt::format("train.{}={}\n", k, to_string(v));
  spec.config_fingerprint = settings_fingerprint(spec.config_settings);
  if (s.average_every > 0)
    spec.policy = any_policy(averaging_schedule{.every = static_cast<std::uint64_t>(s.average_every),
                                                .rounds = static_cast<std::uint64_t>(s.rounds_per_average())},
                             "local-sgd");
  return spec;
}
}  // namespace detail

/// True when `cfg` runs one rank per process (the UCX transport).
inline bool runs_as_processes(const config& cfg) { return cfg.transport.name == "ucx"; }

namespace detail {
/// Refuses a [transport] this program cannot run as configured: an unknown
/// or missing transport, an unknown key, a bad link setting, or 'loopback'
/// in a process that gossip-run started as one of several ranks. Returns the
/// loopback link settings for 'loopback' (none for the others).
inline link_emulation check_transport(const config& cfg) {
  const auto& t = cfg.transport;
  if (t.name == "loopback") {
    const link_emulation link = link_emulation::from(t);
    if (const char* w = std::getenv("GOSSIP_WORLD_SIZE"); w && std::string_view(w) != "1" && *w)
      throw config_error(fmt::format("{}: transport 'loopback' runs every worker as a thread of one process, but this process is one of "
                                     "GOSSIP_WORLD_SIZE={} ranks (gossip-run -n); set [transport] name = \"ucx\" (--set transport.name=ucx), "
                                     "or run the program once without gossip-run",
                                     t.opts.where("name"), w));
    return link;
  }
  if (t.name == "ucx") {
#if defined(GOSSIP_HAVE_UCX)
    return {};  // UCX takes no keys (engine_spec::from refuses them): it reads UCX_* variables
#else
    throw config_error(fmt::format("{} [transport]: 'ucx' was not built into this program (configure with UCX found: apt-get install libucx-dev)",
                                   cfg.source));
#endif
  }
  if (t.name == "switch") {
#if defined(GOSSIP_HAVE_SWITCH)
    (void)t.opts.resolved(switch_option_specs(), "transport 'switch'");  // keys and types; ranges when it is built
    if (const char* w = std::getenv("GOSSIP_WORLD_SIZE"); w && std::string_view(w) != "1" && *w)
      throw config_error(fmt::format("{}: this program runs every worker of transport 'switch' as a thread of one process, but this "
                                     "process is one of GOSSIP_WORLD_SIZE={} ranks (gossip-run -n): each would train all the workers on "
                                     "the same switch group; run the program once without gossip-run",
                                     t.opts.where("name"), w));
    return {};
#else
    throw config_error(fmt::format("{} [transport]: 'switch' was not built into this program (configure with DPDK found: apt-get install libdpdk-dev)",
                                   cfg.source));
#endif
  }
  throw config_error(fmt::format("{}: unknown transport '{}'; known transports: loopback, ucx, switch", t.opts.where("name"), t.name));
}
}  // namespace detail

/// Builds what train() builds from `cfg` and throws as train() would: a bad
/// [policy], [topology], [protocol], [codec], [engine] or [transport] key is
/// refused before any data is loaded or any run begins.
inline void check_components(const config& cfg, const train_settings& s) {
  // Only threads record the timeline; a key given on the command line for a
  // mode that does not read it would change nothing (train_settings::from).
  if (runs_as_processes(cfg) && s.probe_every > 0 && !s.probe_every_from.empty())
    throw config_error(fmt::format("{}: [train] probe_every applies only with workers as threads (transport 'loopback' or 'switch'); "
                                   "over 'ucx' it would change nothing: leave it out",
                                   s.probe_every_from));
  const engine_spec spec = detail::engine_spec_for(cfg, s);
  // [codec] name = "auto" is int8 between paced processes only, and none
  // elsewhere, where a codec key given on the command line would change
  // nothing (a config file may hold them for the runs between processes).
  if (cfg.codec.name == "auto" && !(runs_as_processes(cfg) && spec.settings.max_lead > 0))
    for (const auto& [key, value] : cfg.codec.opts.values())
      if (const auto& from = cfg.codec.opts.where(key); from != cfg.codec.opts.where())
        throw config_error(fmt::format("{}: [codec] name = \"auto\" sends uncompressed here ({}), so [codec] {} would change nothing: "
                                       "leave it out, or name the codec it is for (e.g. --set codec.name=int8)",
                                       from, runs_as_processes(cfg) ? "[engine] max_lead = 0" : "workers as threads", key));
  (void)detail::check_transport(cfg);
  // The switch transport checks its own topology ('switch', which it registers), its protocol and its keys' ranges
  // (building it opens nothing).
#if defined(GOSSIP_HAVE_SWITCH)
  if (cfg.transport.name == "switch") (void)make_switch_transport(cfg, 0, s.workers);
#endif
  if (cfg.transport.name != "switch") (void)topology_registry().make(spec.topology.name, spec.topology.opts, 0, s.workers);
  const auto protocol = protocol_registry().make(spec.protocol.name, spec.protocol.opts);
  // What the engines would refuse when the workers start.
  const std::string where = cfg.protocol.opts.where("name");
  gossip::detail::check_protocol_carrier(spec.protocol.name, protocol.aggregated(), cfg.transport.name, cfg.transport.name == "switch", where);
  spec.settings.check_with(cfg.transport.name, cfg.transport.name == "loopback", cfg.engine.where("same_step_merge"));
  // Every rank's paths ("out/{rank}/stats.json" names a directory per rank).
  // Over UCX each process is one rank, and checks them all the same: the
  // run fails if any rank cannot write.
  for (int r = 0; r < s.workers; ++r) spec.settings.check_outputs(r, s.workers);
}

/// Trains with the gossip settings of `cfg` (policy, topology, protocol,
/// transport, engine); `on_epoch` sees each epoch's record as it completes.
///
/// Over 'loopback' (and 'switch') the workers are threads of this process.
/// Over 'ucx' this process is one rank: rank and world come from the
/// environment (gossip-run, mpirun, srun), s.workers must equal the world, and
/// only rank 0's report is complete.
template <class MakeNet = mlp_factory>
run_report train(const config& cfg, const train_settings& s, const datasets& data,
                 const std::function<void(const epoch_record&)>& on_epoch = {}, const MakeNet& make_net = {}) {
  if constexpr (requires { make_net.check(cfg, s); }) make_net.check(cfg, s);
  const engine_spec base = detail::engine_spec_for(cfg, s);
  (void)detail::check_transport(cfg);
  run_report report;
  const auto wall_start = std::chrono::steady_clock::now();

  if (runs_as_processes(cfg)) {
#if defined(GOSSIP_HAVE_UCX)
    auto boot = std::make_shared<bootstrap>(bootstrap::from_env(base.settings.timeout));
    if (boot->world() != s.workers) {
      // Left at its default, the count came from no file: say so, and how to set it.
      const auto train = cfg.sections.find("train");
      const bool given = train != cfg.sections.end() && train->second.has("workers");
      throw config_error(fmt::format("{}: workers = {}{} but {} processes were started (rank {}); start as many ranks as workers, "
                                     "e.g. gossip-run -n {} …",
                                     s.workers_from.empty() ? cfg.source + " [train]" : s.workers_from, s.workers,
                                     given ? "" : " (the default: set [train] workers or --set train.workers=N)", boot->world(), boot->rank(),
                                     s.workers));
    }
    const auto shards = data::partition(data.train, s.workers, s.partition, s.seed, s.partition_opts());
    bootstrap_exchange exchange(boot);
    train_rank(boot->rank(), boot->world(), base, ucx_transport(boot), s, data, shards, detail::steps_per_epoch(cfg, s, shards), exchange, report,
               on_epoch, make_net);
    return report;  // exchange.done() kept rank 0 serving the rendezvous until every survivor was through
#else
    throw config_error(fmt::format("{} [transport]: 'ucx' was not built into this program (configure with UCX found: apt-get install libucx-dev)",
                                   cfg.source));
#endif
  }

  const int world = s.workers;
  // Workers are threads: over 'loopback', or each with its own UDP socket to a
  // switch (gossip-switch or gossip-switch-udp serving a group of `workers`).
  const bool via_switch = cfg.transport.name == "switch";
  std::optional<loopback_fabric> fabric;
  if (!via_switch) {
    fabric.emplace(world, detail::check_transport(cfg));
  }
  auto endpoint = [&](int r) -> any_transport {
#if defined(GOSSIP_HAVE_SWITCH)
    if (via_switch) return make_switch_transport(cfg, r, world);
#endif
    return fabric->endpoint(r);
  };
  const auto shards = data::partition(data.train, world, s.partition, s.seed, s.partition_opts());
  const int steps = detail::steps_per_epoch(cfg, s, shards);
  thread_exchange exchange(world);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  // No rank trains before every rank's thread exists: a rank that starts
  // while another could not would wait for it until the engine's timeout.
  enum : int { starting, go, abandon };
  std::atomic<int> start{starting};
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world));
  std::string failed;
  for (int r = 0; r < world && failed.empty(); ++r) {
    try {
      threads.emplace_back([&, r] {
        start.wait(starting, std::memory_order_acquire);
        if (start.load(std::memory_order_acquire) == abandon) return;
        try {
          train_rank(r, world, base, endpoint(r), s, data, shards, steps, exchange, report, on_epoch, make_net);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          exchange.drop();
        }
      });
    } catch (const std::system_error& e) {
      failed = fmt::format("cannot start the thread of worker {} of {}: {}; the process's thread or memory limit "
                           "(ulimit -u, ulimit -v) is too low for this many workers: lower [train] workers, or run "
                           "the ranks as processes ([transport] name = \"ucx\")",
                           r, world, e.what());
    }
  }
  start.store(failed.empty() ? go : abandon, std::memory_order_release);
  start.notify_all();
  for (auto& th : threads) th.join();
  if (!failed.empty()) throw std::runtime_error(failed);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  report.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  return report;
}

}  // namespace gossip::examples

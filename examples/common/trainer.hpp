#pragma once
// Decentralized training of the Fashion-MNIST MLP: N workers as threads of one
// process, each with its own shard, optimizer and gossip engine, all over the
// loopback fabric. Shared by examples/01_fashion_mnist and bench/traffic.
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/mlp.hpp"
#include "gossip/data.hpp"
#include "gossip/gossip.hpp"

namespace gossip::examples {

/// The [train] section: what is trained, on how many workers, for how long.
inline const std::vector<option_spec>& train_option_specs() {
  static const std::vector<option_spec> specs = {
      {"workers", std::int64_t{4}, "number of workers (threads, one rank each)"},
      {"epochs", std::int64_t{3}, "passes over each worker's shard"},
      {"batch", std::int64_t{32}, "minibatch size per worker"},
      {"hidden", int_list{128}, "hidden layer widths, e.g. [256, 128]"},
      {"lr", 0.05, "base learning rate"},
      {"momentum", 0.9, "heavy-ball momentum"},
      {"weight_decay", 0.0, "L2 weight decay"},
      {"schedule", std::string("step"), "learning-rate schedule: constant, step (x0.1 at 50 % and 75 %) or cosine"},
      {"warmup_steps", std::int64_t{0}, "linear learning-rate warmup"},
      {"partition", std::string("iid"), "iid, or by_label (non-iid: each worker sees about classes_per_worker classes)"},
      {"classes_per_worker", std::int64_t{2}, "classes per worker for partition = by_label"},
      {"seed", std::int64_t{1}, "seed for initialisation, partition and batch order"},
      {"train_limit", std::int64_t{0}, "use only the first N training samples (0: all 60000)"},
      {"data_dir", std::string(), "Fashion-MNIST directory (default: $GOSSIP_FASHION_MNIST_DIR or the Debian package's)"},
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
  std::uint64_t seed = 1;
  std::size_t train_limit = 0;
  std::string data_dir;

  static train_settings from(const options& o) {
    train_settings s;
    auto positive = [&](const char* key, std::int64_t lo, std::int64_t hi) {
      const auto v = o.integer(key);
      if (v < lo || v > hi) throw config_error(fmt::format("{}: key '{}' must be in {}..{}, got {}", o.where(), key, lo, hi, v));
      return static_cast<int>(v);
    };
    s.workers = positive("workers", 1, 256);
    s.epochs = positive("epochs", 1, 10000);
    s.batch = positive("batch", 1, 4096);
    s.hidden.clear();
    for (auto h : o.integers("hidden")) {
      if (h < 1 || h > 65536) throw config_error(fmt::format("{}: key 'hidden' holds width {}; widths must be in 1..65536", o.where(), h));
      s.hidden.push_back(static_cast<int>(h));
    }
    if (s.hidden.empty()) throw config_error(fmt::format("{}: key 'hidden' must list at least one hidden layer width", o.where()));
    s.lr = o.real("lr");
    s.momentum = o.real("momentum");
    s.weight_decay = o.real("weight_decay");
    if (!(s.lr > 0)) throw config_error(fmt::format("{}: key 'lr' must be > 0, got {}", o.where(), s.lr));
    if (!(s.momentum >= 0 && s.momentum < 1)) throw config_error(fmt::format("{}: key 'momentum' must be in [0, 1), got {}", o.where(), s.momentum));
    try {
      s.schedule = lr_schedule::parse(o.string("schedule"));
      s.partition = data::parse_partition_kind(o.string("partition"));
    } catch (const config_error& e) {
      throw config_error(fmt::format("{}: {}", o.where(), e.what()));
    }
    s.warmup_steps = positive("warmup_steps", 0, 1 << 30);
    s.classes_per_worker = positive("classes_per_worker", 1, 10);
    s.seed = static_cast<std::uint64_t>(o.integer("seed"));
    s.train_limit = static_cast<std::size_t>(positive("train_limit", 0, 1 << 30));
    s.data_dir = o.string("data_dir");
    return s;
  }
};

struct epoch_record {
  int epoch = 0;
  double train_loss = 0;        ///< mean over workers of the epoch's mean batch loss
  double accuracy = 0;          ///< test accuracy of the push-sum-weighted average model
  double local_accuracy_mean = 0;
  std::uint64_t bytes_sent = 0; ///< all workers, so far
  std::uint64_t messages = 0;
  std::uint64_t sends = 0;
  double train_seconds = 0;     ///< so far, evaluation excluded
};

struct run_report {
  std::vector<epoch_record> epochs;
  std::vector<engine_stats> ranks;
  std::uint64_t bytes_sent = 0, messages = 0, sends = 0, steps = 0;
  double accuracy = 0, local_accuracy_mean = 0, train_seconds = 0, wall_seconds = 0;
};

struct datasets {
  data::dataset train, test;
  static datasets load(const train_settings& s) {
    const std::string dir = s.data_dir.empty() ? data::fashion_mnist_dir() : s.data_dir;
    datasets d{data::load_fashion_mnist(true, dir), data::load_fashion_mnist(false, dir)};
    if (s.train_limit > 0 && s.train_limit < d.train.size()) {
      d.train.labels.resize(s.train_limit);
      d.train.images.resize(s.train_limit * d.train.features());
    }
    return d;
  }
};

/// Trains with the gossip settings of `cfg` (policy, topology, protocol,
/// transport, engine); `on_epoch` sees each epoch's record as it completes.
inline run_report train(const config& cfg, const train_settings& s, const datasets& data,
                        const std::function<void(const epoch_record&)>& on_epoch = {}) {
  const int world = s.workers;
  if (cfg.transport.name != "loopback")
    throw config_error(fmt::format("{} [transport]: name '{}' is not available in this example; it runs its workers as threads over "
                                   "'loopback'", cfg.source, cfg.transport.name));
  const auto link_opts = cfg.transport.opts.resolved(loopback_option_specs(), "transport 'loopback'");
  loopback_fabric fabric(world, {.bandwidth_gbps = link_opts.real("bandwidth_gbps"), .latency_us = link_opts.real("latency_us")});
  const engine_spec base = engine_spec::from(cfg);

  const auto shards = data::partition(data.train, world, s.partition, s.seed, s.classes_per_worker);
  std::size_t shard_min = data.train.size();
  for (const auto& sh : shards) shard_min = std::min(shard_min, sh.size());
  const int steps_per_epoch = static_cast<int>(shard_min / static_cast<std::size_t>(s.batch));
  if (steps_per_epoch < 1)
    throw config_error(fmt::format("{} [train]: each of {} workers has only {} samples, fewer than one batch of {}", cfg.source, world,
                                   shard_min, s.batch));
  const std::int64_t total_steps = static_cast<std::int64_t>(steps_per_epoch) * s.epochs;
  const mlp_config arch{.inputs = static_cast<int>(data.train.features()), .hidden = s.hidden, .classes = 10, .max_batch = s.batch};

  run_report report;
  report.epochs.resize(static_cast<std::size_t>(s.epochs));
  report.ranks.resize(static_cast<std::size_t>(world));
  std::vector<std::vector<float>> params(static_cast<std::size_t>(world));
  std::vector<double> weights(static_cast<std::size_t>(world)), local_acc(static_cast<std::size_t>(world)),
      epoch_loss(static_cast<std::size_t>(world));
  std::vector<engine_stats> snapshot(static_cast<std::size_t>(world));
  double train_seconds = 0;
  auto phase_start = std::chrono::steady_clock::now();
  const auto wall_start = phase_start;
  std::barrier sync(world);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));

  auto worker = [&](int r) {
    const auto ri = static_cast<std::size_t>(r);
    try {
      mlp net(arch);
      net.init(s.seed);  // a common initial model on every worker
      model_view view;
      net.register_tensors(view);
      engine_spec spec = base;
      engine eng(view, r, world, std::move(spec), fabric.endpoint(r));
      sgd_momentum opt{.lr = static_cast<float>(s.lr), .momentum = static_cast<float>(s.momentum),
                       .weight_decay = static_cast<float>(s.weight_decay)};
      lr_schedule sched{.type = s.schedule, .base = static_cast<float>(s.lr), .warmup_steps = s.warmup_steps};
      std::vector<std::uint32_t> order(shards[ri].begin(), shards[ri].end());
      std::mt19937_64 rng(s.seed * 1000003u + static_cast<std::uint64_t>(r));
      std::vector<float> xb(static_cast<std::size_t>(s.batch) * data.train.features());
      std::vector<std::uint8_t> yb(static_cast<std::size_t>(s.batch));
      std::int64_t t = 0;
      for (int epoch = 0; epoch < s.epochs; ++epoch) {
        for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng() % i]);  // Fisher–Yates
        double loss_sum = 0;
        for (int b = 0; b < steps_per_epoch; ++b, ++t) {
          data::gather(data.train, {order.data() + static_cast<std::size_t>(b) * static_cast<std::size_t>(s.batch),
                                    static_cast<std::size_t>(s.batch)},
                       xb.data(), yb.data());
          opt.lr = sched.at(t, total_steps);
          const float loss = net.train_batch(xb.data(), yb.data(), s.batch, opt);
          loss_sum += loss;
          eng.step({.lr = opt.lr, .loss = loss});
        }
        // Epoch boundary: every worker publishes its model, rank 0 evaluates.
        epoch_loss[ri] = loss_sum / steps_per_epoch;
        params[ri].assign(net.params().begin(), net.params().end());
        weights[ri] = eng.weight();
        snapshot[ri] = eng.stats();
        sync.arrive_and_wait();
        if (r == 0) train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - phase_start).count();
        local_acc[ri] = net.accuracy(data.test.images.data(), data.test.labels.data(), data.test.size());
        sync.arrive_and_wait();
        if (r == 0) {
          // The push-sum estimate of the global average: Σ w_i z_i / Σ w_i.
          std::vector<float> avg(params[0].size(), 0.0f);
          double wsum = 0;
          for (int j = 0; j < world; ++j) wsum += weights[static_cast<std::size_t>(j)];
          for (int j = 0; j < world; ++j) {
            const auto a = static_cast<float>(weights[static_cast<std::size_t>(j)] / wsum);
            for (std::size_t k = 0; k < avg.size(); ++k) avg[k] += a * params[static_cast<std::size_t>(j)][k];
          }
          epoch_record rec;
          rec.epoch = epoch + 1;
          rec.accuracy = net.accuracy_of(avg, data.test.images.data(), data.test.labels.data(), data.test.size());
          for (int j = 0; j < world; ++j) {
            const auto& st = snapshot[static_cast<std::size_t>(j)];
            rec.train_loss += epoch_loss[static_cast<std::size_t>(j)] / world;
            rec.local_accuracy_mean += local_acc[static_cast<std::size_t>(j)] / world;
            rec.bytes_sent += st.bytes_sent;
            rec.messages += st.messages_sent;
            rec.sends += st.sends;
          }
          rec.train_seconds = train_seconds;
          report.epochs[static_cast<std::size_t>(epoch)] = rec;
          if (on_epoch) on_epoch(rec);
          phase_start = std::chrono::steady_clock::now();
        }
        sync.arrive_and_wait();
      }
      eng.finish(0);
      report.ranks[ri] = eng.stats();
    } catch (...) {
      errors[ri] = std::current_exception();
      sync.arrive_and_drop();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(worker, r);
  for (auto& th : threads) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);

  const auto& last = report.epochs.back();
  report.accuracy = last.accuracy;
  report.local_accuracy_mean = last.local_accuracy_mean;
  report.train_seconds = train_seconds;
  report.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  for (const auto& st : report.ranks) {
    report.bytes_sent += st.bytes_sent;
    report.messages += st.messages_sent;
    report.sends += st.sends;
    report.steps += st.steps;
  }
  return report;
}

}  // namespace gossip::examples

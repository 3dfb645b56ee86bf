#pragma once
// Decentralized training of the Fashion-MNIST MLP: N workers, each with its own
// shard, optimizer and gossip engine — as threads of one process (loopback,
// switch) or as processes (ucx). Shared by examples/01_fashion_mnist and
// bench/traffic.
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <map>
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
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/batch_stream.hpp"
#include "common/local_sgd.hpp"
#include "common/mlp.hpp"
#include "gossip/data.hpp"
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
      {"hidden", int_list{128}, "hidden layer widths, e.g. [256, 128]"},
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
      {"outer_lr", 1.0, "outer learning rate at each averaging point (DiLoCo: 0.7; 1 with outer_momentum 0: plain averaging)"},
      {"outer_momentum", 0.0, "outer Nesterov momentum at each averaging point (DiLoCo: 0.9)"},
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
    s.dirichlet_alpha = o.real("dirichlet_alpha");
    if (!(s.dirichlet_alpha > 0) || !std::isfinite(s.dirichlet_alpha))
      throw config_error(fmt::format("{}: key 'dirichlet_alpha' must be > 0, got {}", o.where(), s.dirichlet_alpha));
    s.average_every = positive("average_every", 0, 1 << 30);
    s.average_rounds = positive("average_rounds", -1, 64);
    if (s.average_rounds == 0) throw config_error(fmt::format("{}: key 'average_rounds' must be >= 1, or -1 for automatic", o.where()));
    s.outer_lr = o.real("outer_lr");
    s.outer_momentum = o.real("outer_momentum");
    if (!(s.outer_lr > 0) || !std::isfinite(s.outer_lr)) throw config_error(fmt::format("{}: key 'outer_lr' must be > 0, got {}", o.where(), s.outer_lr));
    if (!(s.outer_momentum >= 0 && s.outer_momentum < 1))
      throw config_error(fmt::format("{}: key 'outer_momentum' must be in [0, 1), got {}", o.where(), s.outer_momentum));
    s.seed = static_cast<std::uint64_t>(o.integer("seed"));
    s.train_limit = static_cast<std::size_t>(positive("train_limit", 0, 1 << 30));
    s.data_dir = o.string("data_dir");
    s.probe_every = positive("probe_every", 0, 1 << 30);
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

struct epoch_record {
  int epoch = 0;
  double train_loss = 0;        ///< mean over workers of the epoch's mean batch loss
  double accuracy = 0;          ///< test accuracy of the push-sum-weighted average model
  double local_accuracy_mean = 0;
  std::uint64_t bytes_sent = 0; ///< all workers, so far
  std::uint64_t messages = 0;
  std::uint64_t sends = 0;
  double train_seconds = 0;     ///< so far, evaluation excluded (rank 0's clock)
};

/// The state of all workers at one step (train_settings::probe_every).
struct timeline_point {
  std::int64_t step = 0;                 ///< steps taken by each worker
  double lr = 0;
  double consensus = 0;                  ///< exact: mean_i ‖z_i − x̄‖² / ‖x̄‖², x̄ the push-sum average
  double consensus_estimate = 0;         ///< mean over workers of the engines' own estimates (NaN-free ones)
  double weight_min = 1, weight_max = 1; ///< push-sum weights
  std::vector<std::uint64_t> sends;      ///< per worker, so far
};

/// A rank that stopped taking part, as rank 0 saw it (process mode).
struct dead_rank {
  int rank = -1;
  std::string host;      ///< as the rank reported it while alive ("?" if it never did)
  int last_epoch = 0;    ///< the last epoch whose model it delivered (0: none)
  std::string reason;    ///< who found it dead, or the deadline it missed
};

struct run_report {
  bool complete = false;                 ///< false on ranks other than 0 in process mode
  std::vector<epoch_record> epochs;
  std::vector<std::string> rank_stats;   ///< each rank's engine_stats as JSON
  std::vector<timeline_point> timeline;  ///< filled when probe_every > 0 and workers are threads
  std::uint64_t bytes_sent = 0, messages = 0, sends = 0, steps = 0;
  double accuracy = 0, local_accuracy_mean = 0, train_seconds = 0, wall_seconds = 0;
  std::vector<dead_rank> dead;           ///< ranks that died (process mode, rank 0)
  int survivors = 0;                     ///< ranks that reached the end (process mode, rank 0)
  /// Push-sum weight lost with the dead ranks: world − Σ survivors' weight
  /// after every survivor has drained (exact); −1 when not known.
  double lost_weight = -1;
  double lost_weight_estimate = 0;       ///< Σ of the survivors' own estimates (engine_stats::lost_weight)
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

/// What one rank contributes at an epoch boundary.
struct rank_epoch {
  int rank = -1;
  double loss = 0, local_accuracy = 0, weight = 1;
  std::uint64_t bytes_sent = 0, messages = 0, sends = 0, steps = 0;
  std::vector<float> params;
  std::string stats_json;  ///< filled at the last epoch only
  std::string host;
  std::vector<int> dead;   ///< ranks this rank's engine found dead so far
  double lost_weight = 0;  ///< its engine's estimate of the push-sum mass lost with them
};

/// What one worker shows a probe.
struct probe_sample {
  std::span<const float> params;
  double weight = 1, consensus_estimate = 0, lr = 0;
  std::uint64_t sends = 0;
};

/// How ranks meet at an epoch boundary: every rank calls gather(); rank 0 gets
/// the entries of every live rank (in rank order), the others an empty list.
class epoch_exchange {
 public:
  virtual ~epoch_exchange() = default;
  /// Every rank calls it at the same step; rank 0 appends the point to `out`.
  /// Only where ranks share memory (threads); elsewhere it does nothing.
  virtual void probe(int, std::int64_t, const probe_sample&, std::vector<timeline_point>&) {}
  /// `progress` is called while waiting: it merges what peers send meanwhile
  /// and returns the ranks this rank's engine has found dead so far.
  virtual std::vector<rank_epoch> gather(int rank, int epoch, rank_epoch mine, const std::function<std::vector<int>()>& progress) = 0;
  /// After the engine's finish(): every live rank calls it with its final
  /// weight; rank 0 returns last (it serves the rendezvous) and fills the
  /// report's dead ranks and lost weight.
  virtual void done(int rank, double weight, const engine_stats& stats, run_report& report) = 0;
};

/// Ranks as threads of this process.
class thread_exchange final : public epoch_exchange {
 public:
  explicit thread_exchange(int world) : m_slots(static_cast<std::size_t>(world)), m_probes(static_cast<std::size_t>(world)), m_sync(world) {}
  std::vector<rank_epoch> gather(int rank, int, rank_epoch mine, const std::function<std::vector<int>()>&) override {
    m_slots[static_cast<std::size_t>(rank)] = std::move(mine);
    m_sync.arrive_and_wait();
    std::vector<rank_epoch> all;
    if (rank == 0) all = m_slots;
    m_sync.arrive_and_wait();  // nobody overwrites a slot before rank 0 has copied it
    return all;
  }
  void done(int, double, const engine_stats&, run_report&) override {}
  void drop() { m_sync.arrive_and_drop(); }

  void probe(int rank, std::int64_t step, const probe_sample& mine, std::vector<timeline_point>& out) override {
    m_probes[static_cast<std::size_t>(rank)] = mine;
    m_sync.arrive_and_wait();
    if (rank == 0) out.push_back(measure(step));
    m_sync.arrive_and_wait();  // models stay put until rank 0 has read them
  }

 private:
  timeline_point measure(std::int64_t step) const {
    timeline_point p;
    p.step = step;
    p.lr = m_probes[0].lr;
    const std::size_t n = m_probes[0].params.size();
    std::vector<double> mean(n, 0.0);
    double wsum = 0;
    p.weight_min = p.weight_max = m_probes[0].weight;
    int estimates = 0;
    for (const auto& q : m_probes) {
      wsum += q.weight;
      p.weight_min = std::min(p.weight_min, q.weight);
      p.weight_max = std::max(p.weight_max, q.weight);
      p.sends.push_back(q.sends);
      if (!std::isnan(q.consensus_estimate)) p.consensus_estimate += q.consensus_estimate, ++estimates;
    }
    if (estimates) p.consensus_estimate /= estimates;
    for (const auto& q : m_probes)
      for (std::size_t k = 0; k < n; ++k) mean[k] += q.weight / wsum * q.params[k];
    double ref = 0, dist = 0;
    for (double v : mean) ref += v * v;
    for (const auto& q : m_probes)
      for (std::size_t k = 0; k < n; ++k) dist += (q.params[k] - mean[k]) * (q.params[k] - mean[k]);
    p.consensus = ref > 0 ? dist / static_cast<double>(m_probes.size()) / ref : 0.0;
    return p;
  }

  std::vector<rank_epoch> m_slots;
  std::vector<probe_sample> m_probes;
  std::barrier<> m_sync;
};

/// Ranks as processes: entries travel through the bootstrap rendezvous that
/// rank 0 serves. Rank 0 waits for every rank it does not know to be dead, and
/// leaves out (naming it) a rank that an engine found dead or that missed the
/// deadline (the engine timeout): its model is not in the average, and later
/// epochs and the final barrier do not wait for it. If rank 0 itself is gone
/// (its engine peers found it dead, or its rendezvous stops answering), the
/// other ranks say so once and train on without epoch evaluation.
class bootstrap_exchange final : public epoch_exchange {
 public:
  explicit bootstrap_exchange(std::shared_ptr<bootstrap> boot)
      : m_boot(std::move(boot)), m_hosts(static_cast<std::size_t>(m_boot->world()), "?"),
        m_last_epoch(static_cast<std::size_t>(m_boot->world()), 0) {
    char h[256] = {};
    m_host = ::gethostname(h, sizeof h - 1) == 0 && h[0] ? h : "?";
    // So that rank 0 can name the host of a rank that dies before its first epoch.
    const auto* p = reinterpret_cast<const std::byte*>(m_host.data());
    m_boot->put(fmt::format("train/host/{}", m_boot->rank()), bootstrap::blob(p, p + m_host.size()));
  }

  std::vector<rank_epoch> gather(int rank, int epoch, rank_epoch mine, const std::function<std::vector<int>()>& progress) override {
    mine.rank = rank;
    mine.host = m_host;
    std::vector<rank_epoch> all;
    if (rank != 0) {
      publish(fmt::format("epoch/{}/{}", epoch, rank), pack(mine), mine.dead);
      return all;
    }
    m_hosts[0] = m_host;
    m_last_epoch[0] = epoch + 1;
    std::vector<std::optional<rank_epoch>> got(static_cast<std::size_t>(m_boot->world()));
    got[0] = std::move(mine);
    note_dead(got[0]->dead, "found dead by rank 0's engine");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(m_boot->timeout());
    for (unsigned i = 0;; ++i) {
      bool waiting = false;
      for (int j = 1; j < m_boot->world(); ++j) {
        const auto ju = static_cast<std::size_t>(j);
        if (got[ju] || m_dead.contains(j)) continue;
        if (auto b = m_boot->try_get(fmt::format("epoch/{}/{}", epoch, j))) {
          got[ju] = unpack(*b);
          m_hosts[ju] = got[ju]->host;
          m_last_epoch[ju] = epoch + 1;
          note_dead(got[ju]->dead, fmt::format("found dead by rank {}'s engine", j));
        } else {
          waiting = true;
        }
      }
      note_dead(progress(), "found dead by rank 0's engine");  // rank j may be waiting for us to take its message
      if (!waiting) break;
      if (std::chrono::steady_clock::now() > deadline) {
        for (int j = 1; j < m_boot->world(); ++j)
          if (!got[static_cast<std::size_t>(j)] && !m_dead.contains(j))
            declare_dead(j, fmt::format("missed the {:.1f} s deadline for its epoch-{} model", m_boot->timeout().count(), epoch + 1));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(1u + i, 20u)));
    }
    for (auto& e : got)
      if (e && !m_dead.contains(e->rank)) all.push_back(std::move(*e));
    return all;
  }

  void done(int rank, double weight, const engine_stats& stats, run_report& report) override {
    const auto world = m_boot->world();
    // Arrival record: final weight, lost-mass estimate, (rank, own-weight
    // estimate) per dead peer, then the engine's stats after finish().
    bootstrap::blob w;
    put(w, weight), put(w, stats.lost_weight), put(w, static_cast<std::uint64_t>(stats.dead.size()));
    for (const auto& d : stats.dead) put(w, static_cast<std::int32_t>(d.rank)), put(w, d.weight_estimate);
    const std::string json = stats.to_json(-1);
    put(w, static_cast<std::uint64_t>(json.size()));
    w.insert(w.end(), reinterpret_cast<const std::byte*>(json.data()), reinterpret_cast<const std::byte*>(json.data()) + json.size());
    const std::vector<int>& dead = stats.dead_peers;
    if (rank != 0) {
      if (!publish(fmt::format("train/done/arrive/{}", rank), w, dead)) return;
      // Bounded: rank 0 releases once every live rank has arrived, or after
      // its own deadline for the missing ones; this wait outlasts that.
      try {
        m_boot->get("train/done/release",
                    fmt::format("rank 0 (rendezvous {}) to release the end-of-training barrier; rank 0 may have died", m_boot->where()),
                    2 * m_boot->timeout() + std::chrono::duration<double>(5.0));
        m_boot->put(fmt::format("train/done/ack/{}", rank), {});
      } catch (const error& e) {
        fmt::print(stderr, "rank {}: leaving without rank 0's release: {}\n", rank, e.what());
      }
      return;
    }
    note_dead(dead, "found dead by rank 0's engine");
    double survivors_weight = 0, lost_sent = 0;
    std::map<int, double> own;  // dead rank → largest estimate of its own weight
    std::vector<std::string> final_stats(static_cast<std::size_t>(world));
    const auto arrive = [&](int j, const bootstrap::blob& b) {
      std::size_t at = 0;
      survivors_weight += take<double>(b, at);
      lost_sent += take<double>(b, at);
      const auto n = take<std::uint64_t>(b, at);
      for (std::uint64_t i = 0; i < n && i < 1u << 20; ++i) {
        const int d = take<std::int32_t>(b, at);
        const double e = take<double>(b, at);
        own[d] = std::max(own[d], e);
      }
      const auto len = take<std::uint64_t>(b, at);
      if (at + len > b.size()) throw error(fmt::format("end-of-training record of rank {} is truncated", j));
      final_stats[static_cast<std::size_t>(j)].assign(reinterpret_cast<const char*>(b.data() + at), len);
    };
    arrive(0, w);
    std::vector<char> arrived(static_cast<std::size_t>(world), 0);
    arrived[0] = 1;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(m_boot->timeout());
    for (unsigned i = 0;; ++i) {
      bool waiting = false;
      for (int j = 1; j < world; ++j) {
        if (arrived[static_cast<std::size_t>(j)] || m_dead.contains(j)) continue;
        if (auto b = m_boot->try_get(fmt::format("train/done/arrive/{}", j))) {
          arrive(j, *b);
          arrived[static_cast<std::size_t>(j)] = 1;
        } else {
          waiting = true;
        }
      }
      if (!waiting) break;
      if (std::chrono::steady_clock::now() > deadline) {
        for (int j = 1; j < world; ++j)
          if (!arrived[static_cast<std::size_t>(j)] && !m_dead.contains(j))
            declare_dead(j, fmt::format("missed the {:.1f} s deadline of the end-of-training barrier", m_boot->timeout().count()));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(1u + i, 20u)));
    }
    m_boot->put("train/done/release", {});
    // Acknowledgements keep the rendezvous up until every survivor has its
    // release; one that died meanwhile costs at most a few seconds.
    const auto ack_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (int j = 1; j < world; ++j)
      while (arrived[static_cast<std::size_t>(j)] && !m_boot->try_get(fmt::format("train/done/ack/{}", j)) &&
             std::chrono::steady_clock::now() < ack_deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    report.survivors = static_cast<int>(std::count(arrived.begin(), arrived.end(), 1));
    report.lost_weight = m_dead.empty() ? 0.0 : static_cast<double>(world) - survivors_weight;
    report.lost_weight_estimate = lost_sent;
    // Each survivor's stats as they stand after finish(): deaths found while
    // draining are in them.
    report.rank_stats.clear();
    for (int j = 0; j < world; ++j)
      if (arrived[static_cast<std::size_t>(j)]) report.rank_stats.push_back(std::move(final_stats[static_cast<std::size_t>(j)]));
    for (const auto& [d, e] : own) report.lost_weight_estimate += e;
    for (const auto& [j, why] : m_dead)
      report.dead.push_back(dead_rank{j, m_hosts[static_cast<std::size_t>(j)], m_last_epoch[static_cast<std::size_t>(j)], why});
  }

 private:
  template <class T>
  static void put(bootstrap::blob& b, const T& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    b.insert(b.end(), p, p + sizeof v);
  }
  template <class T>
  static T take(const bootstrap::blob& b, std::size_t& at) {
    if (at + sizeof(T) > b.size()) throw error("epoch exchange: truncated record from a peer (ranks built from different versions?)");
    T v;
    std::memcpy(&v, b.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  static bootstrap::blob pack(const rank_epoch& e) {
    bootstrap::blob b;
    put(b, e.loss), put(b, e.local_accuracy), put(b, e.weight);
    put(b, e.bytes_sent), put(b, e.messages), put(b, e.sends), put(b, e.steps);
    put(b, static_cast<std::uint64_t>(e.params.size()));
    const auto* p = reinterpret_cast<const std::byte*>(e.params.data());
    b.insert(b.end(), p, p + e.params.size() * sizeof(float));
    put(b, static_cast<std::uint64_t>(e.stats_json.size()));
    const auto* q = reinterpret_cast<const std::byte*>(e.stats_json.data());
    b.insert(b.end(), q, q + e.stats_json.size());
    put(b, static_cast<std::int32_t>(e.rank)), put(b, e.lost_weight);
    put(b, static_cast<std::uint64_t>(e.host.size()));
    b.insert(b.end(), reinterpret_cast<const std::byte*>(e.host.data()), reinterpret_cast<const std::byte*>(e.host.data()) + e.host.size());
    put(b, static_cast<std::uint64_t>(e.dead.size()));
    for (int d : e.dead) put(b, static_cast<std::int32_t>(d));
    return b;
  }
  static rank_epoch unpack(const bootstrap::blob& b) {
    rank_epoch e;
    std::size_t at = 0;
    e.loss = take<double>(b, at), e.local_accuracy = take<double>(b, at), e.weight = take<double>(b, at);
    e.bytes_sent = take<std::uint64_t>(b, at), e.messages = take<std::uint64_t>(b, at), e.sends = take<std::uint64_t>(b, at);
    e.steps = take<std::uint64_t>(b, at);
    const auto n = take<std::uint64_t>(b, at);
    if (at + n * sizeof(float) > b.size()) throw error("epoch exchange: truncated model from a peer");
    e.params.resize(n);
    std::memcpy(e.params.data(), b.data() + at, n * sizeof(float));
    at += n * sizeof(float);
    const auto m = take<std::uint64_t>(b, at);
    if (at + m > b.size()) throw error("epoch exchange: truncated stats from a peer");
    e.stats_json.assign(reinterpret_cast<const char*>(b.data() + at), m);
    at += m;
    e.rank = take<std::int32_t>(b, at);
    e.lost_weight = take<double>(b, at);
    const auto h = take<std::uint64_t>(b, at);
    if (at + h > b.size()) throw error("epoch exchange: truncated host name from a peer");
    e.host.assign(reinterpret_cast<const char*>(b.data() + at), h);
    at += h;
    const auto nd = take<std::uint64_t>(b, at);
    if (nd > 1u << 20) throw error("epoch exchange: corrupt dead-rank list from a peer");
    for (std::uint64_t i = 0; i < nd; ++i) e.dead.push_back(take<std::int32_t>(b, at));
    return e;
  }
  // Rank 0: a rank leaves every later wait, named once on stderr.
  void declare_dead(int j, const std::string& why) {
    if (j == 0 || !m_dead.emplace(j, why).second) return;
    auto& host = m_hosts[static_cast<std::size_t>(j)];
    if (host == "?")
      if (const auto b = m_boot->try_get(fmt::format("train/host/{}", j))) host.assign(reinterpret_cast<const char*>(b->data()), b->size());
    fmt::print(stderr, "rank 0: rank {} (host {}) is dead ({}); the average model, later epochs and the final barrier leave it out\n", j,
               m_hosts[static_cast<std::size_t>(j)], why);
  }
  void note_dead(const std::vector<int>& ranks, const std::string& why) {
    for (int j : ranks) declare_dead(j, why);
  }
  // A rank other than 0: publish at rank 0's rendezvous unless rank 0 is known
  // dead. Returns false (once saying why) when rank 0 is gone.
  bool publish(const std::string& key, const bootstrap::blob& value, const std::vector<int>& dead) {
    if (!m_rank0_gone && std::find(dead.begin(), dead.end(), 0) != dead.end()) {
      m_rank0_gone = true;
      fmt::print(stderr, "rank {}: rank 0 (rendezvous {}) was found dead; training goes on without epoch evaluation\n", m_boot->rank(),
                 m_boot->where());
    }
    if (m_rank0_gone) return false;
    try {
      m_boot->put(key, value);
      return true;
    } catch (const error& e) {
      m_rank0_gone = true;
      fmt::print(stderr, "rank {}: rank 0's rendezvous does not answer (rank 0 died?); training goes on without epoch evaluation: {}\n",
                 m_boot->rank(), e.what());
      return false;
    }
  }

  std::shared_ptr<bootstrap> m_boot;
  std::string m_host;
  std::map<int, std::string> m_dead;      // rank 0: ranks left out, and why
  std::vector<std::string> m_hosts;       // rank 0: as each rank reported
  std::vector<int> m_last_epoch;          // rank 0: last epoch each rank delivered
  bool m_rank0_gone = false;              // other ranks: stop using the rendezvous
};

inline nlohmann::json to_json(const std::vector<timeline_point>& timeline) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& p : timeline)
    j.push_back({{"step", p.step}, {"lr", p.lr}, {"consensus", p.consensus}, {"consensus_estimate", p.consensus_estimate},
                 {"weight_min", p.weight_min}, {"weight_max", p.weight_max}, {"sends", p.sends}});
  return j;
}

/// Makes each worker's model: the MLP of [train] hidden. Another model (e.g.
/// examples/03_libtorch_cnn) comes with a factory of its own whose product has
/// the MLP's training interface: params() (one contiguous span), tensors(),
/// register_tensors(view), train_batch(x, y, batch, sgd_momentum&),
/// accuracy(x, y, n) and accuracy_of(params, x, y, n).
struct mlp_factory {
  mlp operator()(const train_settings& s, const datasets& data) const {
    mlp net(mlp_config{.inputs = static_cast<int>(data.train.features()), .hidden = s.hidden, .classes = 10, .max_batch = s.batch});
    net.init(s.seed);  // a common initial model on every worker
    return net;
  }
};

/// One rank's training loop. Rank 0 evaluates the average model at each
/// epoch boundary and fills the report.
template <class MakeNet = mlp_factory>
void train_rank(int r, int world, const engine_spec& base, any_transport transport, const train_settings& s, const datasets& data,
                const std::vector<std::vector<std::uint32_t>>& shards, int steps_per_epoch, epoch_exchange& exchange,
                run_report& report, const std::function<void(const epoch_record&)>& on_epoch, const MakeNet& make_net = {}) {
  const auto ri = static_cast<std::size_t>(r);
  const std::int64_t total_steps = static_cast<std::int64_t>(steps_per_epoch) * s.epochs;
  auto net = make_net(s, data);
  sgd_momentum opt{.lr = static_cast<float>(s.lr), .momentum = static_cast<float>(s.momentum), .weight_decay = static_cast<float>(s.weight_decay)};
  opt.velocity.assign(net.params().size(), 0.0f);
  model_view view;
  net.register_tensors(view);
  // The engine may make the momentum quasi-global ([engine] momentum).
  for (const auto& t : net.tensors()) view.momentum(t.name, std::span<float>(opt.velocity).subspan(t.offset, t.count));
  engine eng(view, r, world, base, std::move(transport));
  const int average_every = s.average_every, rounds = s.rounds_per_average();
  outer_optimizer outer{.lr = static_cast<float>(s.outer_lr), .momentum = static_cast<float>(s.outer_momentum)};
  if (outer.active()) outer.start(net.params());
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
        if (outer.active()) outer.step(net.params());
      } else if (average_every == 0 && outer.active() && res.merged > 0) {
        outer.step(net.params());  // gossip: an outer step at each merge
      }
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
    mine.params.assign(net.params().begin(), net.params().end());
    if (last) mine.stats_json = st.to_json(-1);
    mine.dead = st.dead_peers;
    mine.lost_weight = st.lost_weight;
    auto all = exchange.gather(r, epoch, std::move(mine), [&] {
      eng.poll();
      return eng.stats().dead_peers;
    });
    if (r != 0) continue;
    // A worker thread that failed left its slot empty (its error is rethrown after the join).
    std::erase_if(all, [&](const rank_epoch& e) { return e.params.size() != net.params().size(); });
    if (all.empty()) continue;
    const double live = static_cast<double>(all.size());
    // The push-sum estimate of the global average: Σ w_i z_i / Σ w_i.
    std::vector<float> avg(all[0].params.size(), 0.0f);
    double wsum = 0;
    for (const auto& e : all) wsum += e.weight;
    for (const auto& e : all) {
      const auto a = static_cast<float>(e.weight / wsum);
      for (std::size_t k = 0; k < avg.size(); ++k) avg[k] += a * e.params[k];
    }
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
  std::size_t shard_min = std::numeric_limits<std::size_t>::max(), total = 0;
  for (const auto& sh : shards) shard_min = std::min(shard_min, sh.size()), total += sh.size();
  if (s.partition == data::partition_kind::dirichlet) {
    const auto steps = total / (shards.size() * static_cast<std::size_t>(s.batch));
    if (steps < 1 || shard_min < 1)
      throw config_error(fmt::format("{} [train]: {} samples among {} workers make less than one batch of {} each", cfg.source, total,
                                     s.workers, s.batch));
    return static_cast<int>(steps);
  }
  const int steps = static_cast<int>(shard_min / static_cast<std::size_t>(s.batch));
  if (steps < 1)
    throw config_error(fmt::format("{} [train]: each of {} workers has only {} samples, fewer than one batch of {}", cfg.source, s.workers, shard_min,
                                   s.batch));
  return steps;
}

/// The engine settings of `cfg`; for local SGD (s.average_every > 0) the
/// [policy] is replaced by the averaging schedule.
inline engine_spec engine_spec_for(const config& cfg, const train_settings& s) {
  engine_spec spec = engine_spec::from(cfg);
  if (s.average_every > 0)
    spec.policy = any_policy(averaging_schedule{.every = static_cast<std::uint64_t>(s.average_every),
                                                .rounds = static_cast<std::uint64_t>(s.rounds_per_average())},
                             "local-sgd");
  return spec;
}
}  // namespace detail

/// True when `cfg` runs one rank per process (the UCX transport).
inline bool runs_as_processes(const config& cfg) { return cfg.transport.name == "ucx"; }

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
  const engine_spec base = detail::engine_spec_for(cfg, s);
  run_report report;
  const auto wall_start = std::chrono::steady_clock::now();

  if (runs_as_processes(cfg)) {
#if defined(GOSSIP_HAVE_UCX)
    auto boot = std::make_shared<bootstrap>(bootstrap::from_env(base.settings.timeout));
    if (boot->world() != s.workers)
      throw config_error(fmt::format("{} [train]: workers = {} but {} processes were started (rank {}); start as many ranks as workers, "
                                     "e.g. gossip-run -n {} …",
                                     cfg.source, s.workers, boot->world(), boot->rank(), s.workers));
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
#if !defined(GOSSIP_HAVE_SWITCH)
  if (via_switch)
    throw config_error(fmt::format("{} [transport]: 'switch' was not built into this program (configure with DPDK found: apt-get install libdpdk-dev)",
                                   cfg.source));
#endif
  if (cfg.transport.name != "loopback" && !via_switch)
    throw config_error(fmt::format("{} [transport]: unknown transport '{}'; known transports: loopback, ucx, switch", cfg.source, cfg.transport.name));
  std::optional<loopback_fabric> fabric;
  if (!via_switch) {
    const auto link_opts = cfg.transport.opts.resolved(loopback_option_specs(), "transport 'loopback'");
    fabric.emplace(world, link_emulation{.bandwidth_gbps = link_opts.real("bandwidth_gbps"), .latency_us = link_opts.real("latency_us")});
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
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        train_rank(r, world, base, endpoint(r), s, data, shards, steps, exchange, report, on_epoch, make_net);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        exchange.drop();
      }
    });
  for (auto& th : threads) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  report.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  return report;
}

}  // namespace gossip::examples

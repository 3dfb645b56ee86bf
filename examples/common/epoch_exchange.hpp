#pragma once
// How the workers of the example programs meet at epoch boundaries, and what
// they report: each rank's contribution (rank_epoch), rank 0's view of the run
// (epoch_record, run_report, dead_rank), and the two ways of gathering it,
// threads of one process (thread_exchange) or processes through the bootstrap
// rendezvous (bootstrap_exchange). Used by trainer.hpp.
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gossip/bootstrap.hpp"
#include "gossip/gossip.hpp"

namespace gossip::examples {

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
  /// After the last gather, before the engine's finish(): every rank calls it.
  /// Ranks other than 0 wait (merging, bounded) until rank 0 has its last
  /// epoch, telling it meanwhile of every peer their engine finds dead — so
  /// that rank 0 need not wait out a deadline for a rank it cannot see die.
  virtual void before_finish(int, const std::function<std::vector<int>()>&) {}
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
/// epochs and the final barrier do not wait for it. Ranks also post the peers
/// their engine found dead under train/dead/<rank> (at every epoch, and while
/// they wait for rank 0 to close the last one), so rank 0 hears of a death it
/// cannot see itself (a rank that is not its neighbour). If rank 0 itself is gone
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
      const auto dead = mine.dead;
      if (publish(fmt::format("epoch/{}/{}", epoch, rank), pack(mine), dead) && dead.size() > m_dead_posted &&
          publish(fmt::format("train/dead/{}", rank), pack_ranks(dead), dead))
        m_dead_posted = dead.size();
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
        const std::string key = fmt::format("epoch/{}/{}", epoch, j);
        if (auto b = m_boot->try_get(key)) {
          m_boot->erase(key);  // read once: the store would otherwise hold every rank's model of every epoch
          got[ju] = unpack(*b);
          m_hosts[ju] = got[ju]->host;
          m_last_epoch[ju] = epoch + 1;
          note_dead(got[ju]->dead, fmt::format("found dead by rank {}'s engine", j));
        } else {
          waiting = true;
        }
      }
      note_dead(progress(), "found dead by rank 0's engine");  // rank j may be waiting for us to take its message
      read_dead_posts(nullptr);
      if (!waiting) break;
      if (std::chrono::steady_clock::now() > deadline) {
        for (int j = 1; j < m_boot->world(); ++j)
          if (!got[static_cast<std::size_t>(j)] && !m_dead.contains(j))
            declare_dead(j, fmt::format("missed the {:.1f} s deadline for its epoch-{} model", m_boot->timeout().count(), epoch + 1));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(1u + i, 20u)));
    }
    // What no one reads again: this epoch's models of ranks left out (one
    // declared dead may still be alive, and publish), and the last epoch's
    // that a put asked again after a lost reply stored anew once read.
    for (int j = 1; j < m_boot->world(); ++j) {
      if (m_dead.contains(j)) m_boot->erase(fmt::format("epoch/{}/{}", epoch, j));
      if (epoch > 0) m_boot->erase(fmt::format("epoch/{}/{}", epoch - 1, j));
    }
    for (auto& e : got)
      if (e && !m_dead.contains(e->rank)) all.push_back(std::move(*e));
    return all;
  }

  void before_finish(int rank, const std::function<std::vector<int>()>& progress) override {
    if (rank == 0) {
      m_boot->put("train/final/go", {});
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(m_boot->timeout());
    for (unsigned i = 0; !m_rank0_gone; ++i) {
      const auto dead = progress();
      if (dead.size() > m_dead_posted && !publish(fmt::format("train/dead/{}", rank), pack_ranks(dead), dead)) return;
      m_dead_posted = std::max(m_dead_posted, dead.size());
      try {
        if (m_boot->try_get("train/final/go")) return;
      } catch (const error& e) {
        m_rank0_gone = true;
        fmt::print(stderr, "rank {}: rank 0's rendezvous does not answer (rank 0 died?): {}\n", rank, e.what());
        return;
      }
      // Bounded: rank 0 closes its last epoch within its own deadline.
      if (std::chrono::steady_clock::now() > deadline) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(1u + 2 * i, 50u)));
    }
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
    // A rank that some survivor's engine found dead is not waited for (rank 0
    // may not be its neighbour); one that arrived first stays a survivor.
    std::vector<char> arrived(static_cast<std::size_t>(world), 0);
    const auto arrive = [&](int j, const bootstrap::blob& b) {
      std::size_t at = 0;
      survivors_weight += take<double>(b, at);
      lost_sent += take<double>(b, at);
      const auto n = take<std::uint64_t>(b, at);
      for (std::uint64_t i = 0; i < n && i < 1u << 20; ++i) {
        const int d = take<std::int32_t>(b, at);
        const double e = take<double>(b, at);
        own[d] = std::max(own[d], e);
        if (d > 0 && d < world && !arrived[static_cast<std::size_t>(d)]) declare_dead(d, fmt::format("found dead by rank {}'s engine", j));
      }
      const auto len = take<std::uint64_t>(b, at);
      if (at + len > b.size()) throw error(fmt::format("end-of-training record of rank {} is truncated", j));
      final_stats[static_cast<std::size_t>(j)].assign(reinterpret_cast<const char*>(b.data() + at), len);
    };
    arrived[0] = 1;
    arrive(0, w);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(m_boot->timeout());
    for (unsigned i = 0;; ++i) {
      bool waiting = false;
      for (int j = 1; j < world; ++j) {
        if (arrived[static_cast<std::size_t>(j)] || m_dead.contains(j)) continue;
        if (auto b = m_boot->try_get(fmt::format("train/done/arrive/{}", j))) {
          arrived[static_cast<std::size_t>(j)] = 1;
          arrive(j, *b);
        } else {
          waiting = true;
        }
      }
      if (waiting) {  // deaths posted by ranks still draining (before_finish), not yet in an arrival
        read_dead_posts(&arrived);
        waiting = false;
        for (int j = 1; j < world; ++j) waiting = waiting || (!arrived[static_cast<std::size_t>(j)] && !m_dead.contains(j));
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
  static bootstrap::blob pack_ranks(const std::vector<int>& ranks) {
    bootstrap::blob b;
    for (int r : ranks) put(b, static_cast<std::int32_t>(r));
    return b;
  }
  std::vector<int> unpack_ranks(const bootstrap::blob& b) const {
    std::vector<int> out;
    std::size_t at = 0;
    while (at + sizeof(std::int32_t) <= b.size())
      if (const int r = take<std::int32_t>(b, at); r > 0 && r < m_boot->world()) out.push_back(r);
    return out;
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
  // The ranks other ranks posted under train/dead/<k> (their engines found
  // them dead), except those marked in `keep` (ranks that already arrived).
  void read_dead_posts(const std::vector<char>* keep) {
    for (int k = 1; k < m_boot->world(); ++k)
      if (!m_dead.contains(k))
        if (auto b = m_boot->try_get(fmt::format("train/dead/{}", k)))
          for (int d : unpack_ranks(*b))
            if (!keep || !(*keep)[static_cast<std::size_t>(d)]) declare_dead(d, fmt::format("found dead by rank {}'s engine", k));
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
    } catch (const config_error&) {
      throw;  // rank 0 answered: its store refused the value (full), which no waiting mends
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
  std::size_t m_dead_posted = 0;          // other ranks: dead peers posted under train/dead/<rank> (the list only grows)
};

}  // namespace gossip::examples

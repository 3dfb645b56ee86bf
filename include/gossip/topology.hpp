#pragma once
/// Topologies decide *with whom* a rank exchanges at a given round.
///
/// A topology is any type with
///   std::size_t targets(std::uint64_t round, std::span<int> out) const noexcept;
///   std::vector<int> sources() const;   // every rank that may ever send to us
/// `targets` writes the ranks this rank sends to at `round` (ignoring failures)
/// and returns how many. A topology may also define
///   std::vector<int> destinations() const;  // every rank we may ever send to
/// otherwise it is found by asking `targets` for many rounds. gossip::topology wraps one, removes dead peers and
/// assigns mixing weights that sum to one:
///
///     gossip::topology t(gossip::topologies::ring{rank, world}, rank, world);
///     for (const gossip::peer& p : t.peers(round)) send_to(p.rank, p.weight);
///
/// Weights are uniform over the live targets and this rank itself, which is
/// what push-sum needs to split (x, w) without bias.
#include <algorithm>
#include <bit>
#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gossip/error.hpp"
#include "gossip/registry.hpp"

namespace gossip {

struct peer {
  int rank = -1;
  double weight = 0;  ///< mixing weight; self_weight() + Σ weights == 1
};

template <class T>
concept topology_like = requires(const T& t, std::uint64_t round, std::span<int> out) {
  { t.targets(round, out) } noexcept -> std::same_as<std::size_t>;
  { t.sources() } -> std::convertible_to<std::vector<int>>;
};

namespace topologies {

inline void check_world(int rank, int world, const char* what) {
  if (world < 1) throw config_error(fmt::format("topology {}: world size must be >= 1, got {}", what, world));
  if (rank < 0 || rank >= world)
    throw config_error(fmt::format("topology {}: rank {} is outside the world of {} ranks", what, rank, world));
}

/// Both ring neighbours every round.
struct ring {
  int rank, world;
  ring(int r, int w) : rank(r), world(w) { check_world(r, w, "ring"); }
  std::size_t targets(std::uint64_t, std::span<int> out) const noexcept {
    if (world == 1) return 0;
    out[0] = (rank + 1) % world;
    if (world == 2) return 1;
    out[1] = (rank + world - 1) % world;
    return 2;
  }
  std::vector<int> sources() const {
    std::vector<int> s;
    if (world > 1) s.push_back((rank + world - 1) % world);
    if (world > 2) s.push_back((rank + 1) % world);
    return s;
  }
};

/// One peer per round, 2^k hops ahead with k = round mod ⌈log2 world⌉ (SGP's
/// time-varying exponential graph): log2(world) rounds mix every rank with all.
struct exponential {
  int rank, world, hops;
  exponential(int r, int w) : rank(r), world(w), hops(0) {
    check_world(r, w, "exponential");
    while ((1 << hops) < world) ++hops;
  }
  std::size_t targets(std::uint64_t round, std::span<int> out) const noexcept {
    if (world == 1) return 0;
    out[0] = static_cast<int>((rank + (std::int64_t{1} << (round % hops))) % world);
    return 1;
  }
  std::vector<int> sources() const {
    std::vector<int> s;
    for (int k = 0; k < hops; ++k) {
      int src = static_cast<int>(((rank - (std::int64_t{1} << k)) % world + world) % world);
      if (src != rank && std::find(s.begin(), s.end(), src) == s.end()) s.push_back(src);
    }
    std::sort(s.begin(), s.end());
    return s;
  }
};

/// One uniformly random other rank per round, the same on every rank for a seed.
struct random {
  int rank, world;
  std::uint64_t seed;
  random(int r, int w, std::uint64_t s) : rank(r), world(w), seed(s) { check_world(r, w, "random"); }
  static std::uint64_t mix(std::uint64_t z) noexcept {  // splitmix64 finaliser
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::size_t targets(std::uint64_t round, std::span<int> out) const noexcept {
    if (world == 1) return 0;
    const std::uint64_t h = mix(seed ^ mix(round * 0x100000001b3ull + static_cast<std::uint64_t>(rank)));
    const int offset = 1 + static_cast<int>(h % static_cast<std::uint64_t>(world - 1));
    out[0] = (rank + offset) % world;
    return 1;
  }
  std::vector<int> sources() const {
    std::vector<int> s;
    for (int j = 0; j < world; ++j)
      if (j != rank) s.push_back(j);
    return s;
  }
  std::vector<int> destinations() const { return sources(); }
};

/// Every other rank, every round.
struct complete {
  int rank, world;
  complete(int r, int w) : rank(r), world(w) { check_world(r, w, "complete"); }
  std::size_t targets(std::uint64_t, std::span<int> out) const noexcept {
    std::size_t n = 0;
    for (int j = 0; j < world; ++j)
      if (j != rank) out[n++] = j;
    return n;
  }
  std::vector<int> sources() const {
    std::vector<int> s;
    for (int j = 0; j < world; ++j)
      if (j != rank) s.push_back(j);
    return s;
  }
};

/// An explicit edge list; undirected unless `directed`.
struct edges {
  int rank, world;
  std::vector<int> out_ranks, in_ranks;
  edges(int r, int w, const std::vector<std::pair<int, int>>& list, bool directed, const std::string& where = "edges") : rank(r), world(w) {
    check_world(r, w, "edges");
    for (auto [a, b] : list) {
      if (a < 0 || a >= w || b < 0 || b >= w || a == b)
        throw config_error(fmt::format("{}: edge [{}, {}] is invalid for a world of {} ranks (ranks are 0..{}, no self-loops)",
                                       where, a, b, w, w - 1));
      auto add = [](std::vector<int>& v, int x) {
        if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
      };
      if (a == r) add(out_ranks, b);
      if (b == r) add(in_ranks, a);
      if (!directed) {
        if (b == r) add(out_ranks, a);
        if (a == r) add(in_ranks, b);
      }
    }
    std::sort(out_ranks.begin(), out_ranks.end());
    std::sort(in_ranks.begin(), in_ranks.end());
    // The ranks that rank 0 cannot reach along the edges: forward (a → b),
    // backward (b → a), or both ways.
    enum class along { forward, backward, both };
    auto unreached = [&](along way) {
      std::vector<std::vector<int>> next(static_cast<std::size_t>(w));
      for (auto [a, b] : list) {
        if (way != along::backward) next[static_cast<std::size_t>(a)].push_back(b);
        if (way != along::forward) next[static_cast<std::size_t>(b)].push_back(a);
      }
      std::vector<char> seen(static_cast<std::size_t>(w), 0);
      std::vector<int> todo = {0};
      seen[0] = 1;
      while (!todo.empty()) {
        const int x = todo.back();
        todo.pop_back();
        for (int y : next[static_cast<std::size_t>(x)])
          if (!seen[static_cast<std::size_t>(y)]) seen[static_cast<std::size_t>(y)] = 1, todo.push_back(y);
      }
      std::vector<int> out;
      for (int j = 0; j < w; ++j)
        if (!seen[static_cast<std::size_t>(j)]) out.push_back(j);
      return out;
    };
    // Every rank must be joined to every other, edges taken both ways: the
    // models of ranks in separate pieces could never mix.
    if (const auto apart = unreached(along::both); !apart.empty())
      throw config_error(fmt::format("{}: the edges leave rank(s) {} unconnected to rank 0 in a world of {}; their models could never mix. "
                                     "Add edges that join every rank (e.g. a ring: [[0, 1], [1, 2], …, [{}, 0]])",
                                     where, fmt::join(apart, ", "), w, w - 1));
    if (!directed) return;
    // Directed: every rank's model must reach every other along the edges'
    // direction — each reachable from rank 0, and rank 0 from each. Else some
    // rank never takes in the others' models (a chain's head trains alone,
    // and under push-sum its weight drains away to nothing).
    const auto deaf = unreached(along::forward), mute = unreached(along::backward);
    if (!deaf.empty() || !mute.empty())
      throw config_error(fmt::format(
          "{}: the directed edges do not carry every rank's model to every other: {}{}{}; those models could never mix. Add edges so "
          "that a path leads from each rank to each other (e.g. a directed ring: [[0, 1], [1, 2], …, [{}, 0]])",
          where, deaf.empty() ? "" : fmt::format("nothing from rank 0 ever reaches rank(s) {}", fmt::join(deaf, ", ")),
          !deaf.empty() && !mute.empty() ? "; " : "",
          mute.empty() ? "" : fmt::format("nothing from rank(s) {} ever reaches rank 0", fmt::join(mute, ", ")), w - 1));
  }
  std::size_t targets(std::uint64_t, std::span<int> out) const noexcept {
    std::copy(out_ranks.begin(), out_ranks.end(), out.begin());
    return out_ranks.size();
  }
  std::vector<int> sources() const { return in_ranks; }
};

static_assert(topology_like<ring> && topology_like<exponential> && topology_like<random> &&
              topology_like<complete> && topology_like<edges>);

}  // namespace topologies

/// A topology with failure handling and mixing weights; what the engine holds.
class topology {
 public:
  topology() = default;

  template <topology_like T>
    requires(!std::same_as<std::remove_cvref_t<T>, topology>)
  topology(T t, int rank, int world, std::string name = {})
      : m_self(make_model(std::move(t), world)), m_name(std::move(name)), m_rank(rank), m_world(world),
        m_alive(static_cast<std::size_t>(world), 1), m_raw(static_cast<std::size_t>(world)),
        m_peers(static_cast<std::size_t>(world)) {
    if (world < 1 || rank < 0 || rank >= world)
      throw config_error(fmt::format("topology '{}': rank {} is outside the world of {} ranks", m_name, rank, world));
    m_sources = m_self->sources();
    m_destinations = m_self->destinations();
    std::sort(m_destinations.begin(), m_destinations.end());
    m_destinations.erase(std::unique(m_destinations.begin(), m_destinations.end()), m_destinations.end());
    for (const auto* list : {&m_sources, &m_destinations})
      for (int s : *list)
        if (s < 0 || s >= world || s == rank)
          throw config_error(fmt::format("topology '{}': peer rank {} is invalid for rank {} of {}", m_name, s, rank, world));
  }
  topology(topology&&) noexcept = default;
  topology& operator=(topology&&) noexcept = default;

  /// Live targets at `round` with their weights. Allocation-free. When every
  /// target of the round is dead, the next live rank among destinations()
  /// after the first target (cyclically, in rank order) takes its place, so
  /// one-peer topologies keep mixing. The stand-in is always a destination:
  /// a rank the transport connected to and that expects messages from this
  /// one. When every destination is dead the list is empty.
  std::span<const peer> peers(std::uint64_t round) noexcept {
    const std::size_t n = m_self->targets(round, m_raw);
    std::size_t live = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (m_alive[static_cast<std::size_t>(m_raw[i])]) m_peers[live++].rank = m_raw[i];
    if (live == 0 && n > 0 && !m_destinations.empty()) {
      // m_destinations is sorted: start at the first one after m_raw[0].
      const auto first = std::upper_bound(m_destinations.begin(), m_destinations.end(), m_raw[0]) - m_destinations.begin();
      const std::size_t d = m_destinations.size();
      for (std::size_t k = 0; k < d; ++k) {
        const int cand = m_destinations[(static_cast<std::size_t>(first) + k) % d];
        if (m_alive[static_cast<std::size_t>(cand)]) {
          m_peers[live++].rank = cand;
          break;
        }
      }
    }
    const double w = 1.0 / static_cast<double>(live + 1);
    for (std::size_t i = 0; i < live; ++i) m_peers[i].weight = w;
    m_self_weight = w;
    return {m_peers.data(), live};
  }
  /// This rank's own share after the last peers() call.
  double self_weight() const noexcept { return m_self_weight; }

  /// Every rank that may ever send to this one (what a transport connects to).
  const std::vector<int>& sources() const noexcept { return m_sources; }
  /// Every rank this one may ever send to.
  const std::vector<int>& destinations() const noexcept { return m_destinations; }

  /// Removes `r` from every later peers() answer (idempotent).
  void mark_dead(int r) noexcept {
    if (r >= 0 && r < m_world) m_alive[static_cast<std::size_t>(r)] = 0;
  }
  bool alive(int r) const noexcept { return r >= 0 && r < m_world && m_alive[static_cast<std::size_t>(r)]; }
  int rank() const noexcept { return m_rank; }
  int world() const noexcept { return m_world; }
  const std::string& name() const noexcept { return m_name; }

 private:
  struct concept_t {
    virtual ~concept_t() = default;
    virtual std::size_t targets(std::uint64_t, std::span<int>) const noexcept = 0;
    virtual std::vector<int> sources() const = 0;
    virtual std::vector<int> destinations() const = 0;
  };
  template <class T>
  struct model final : concept_t {
    explicit model(T t) : m_t(std::move(t)) {}
    std::size_t targets(std::uint64_t r, std::span<int> out) const noexcept override { return m_t.targets(r, out); }
    std::vector<int> sources() const override { return m_t.sources(); }
    std::vector<int> destinations() const override {
      if constexpr (requires { m_t.destinations(); }) {
        return m_t.destinations();
      } else {
        // Periodic topologies repeat within a few rounds; 64 + 4·world covers them.
        std::vector<int> d, buf(static_cast<std::size_t>(m_world_hint));
        for (std::uint64_t r = 0; r < 64 + 4 * static_cast<std::uint64_t>(m_world_hint); ++r) {
          const std::size_t n = m_t.targets(r, buf);
          for (std::size_t i = 0; i < n; ++i)
            if (std::find(d.begin(), d.end(), buf[i]) == d.end()) d.push_back(buf[i]);
        }
        std::sort(d.begin(), d.end());
        return d;
      }
    }
    T m_t;
    int m_world_hint = 1;
  };
  template <class T>
  static std::unique_ptr<concept_t> make_model(T t, int world) {
    auto m = std::make_unique<model<T>>(std::move(t));
    m->m_world_hint = std::max(world, 1);
    return m;
  }

  std::unique_ptr<concept_t> m_self;
  std::string m_name;
  int m_rank = 0, m_world = 1;
  std::vector<char> m_alive;
  std::vector<int> m_raw;
  std::vector<peer> m_peers;
  std::vector<int> m_sources, m_destinations;
  double m_self_weight = 1;
};

using topology_registry_t = registry<topology, int, int>;
/// Topologies by config name: ring, exponential, random, complete, edges.
topology_registry_t& topology_registry();

}  // namespace gossip

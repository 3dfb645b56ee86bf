#pragma once
/// Bootstrap: who am I, how many are we, and where are my peers.
///
///     auto id = gossip::bootstrap::identity_from_env();   // rank, world
///     gossip::bootstrap boot = gossip::bootstrap::from_env();
///     boot.put("ucx/3", my_address_blob);
///     auto blob = boot.get("ucx/5");                     // bounded wait
///
/// Rank and world size come from the first set pair of
///   GOSSIP_RANK / GOSSIP_WORLD_SIZE, OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE,
///   SLURM_PROCID / SLURM_NTASKS, RANK / WORLD_SIZE (torchrun).
/// Blobs are exchanged through a small key-value rendezvous served by rank 0 at
/// GOSSIP_MASTER_ADDR:GOSSIP_MASTER_PORT (blocking POSIX sockets, every call
/// bounded by poll timeouts). Each rank publishes one blob and fetches only the
/// blobs of the peers its topology needs — no full mesh. Rank 0 serves until
/// its bootstrap object is destroyed, so it must outlive the other ranks'
/// connect phase (the transport that uses it keeps it alive).
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <thread>
#include <vector>

#include "gossip/error.hpp"

namespace gossip {

struct rank_identity {
  int rank = 0;
  int world = 1;
  std::string source;  ///< which variables it came from, e.g. "GOSSIP_RANK/GOSSIP_WORLD_SIZE"
};

/// A bootstrap client reached a rendezvous store other than the one it
/// joined: rank 0 has started another on the same port since, so the run
/// this client belongs to is over there.
class rendezvous_replaced : public transport_error {
 public:
  using transport_error::transport_error;
};

class bootstrap {
 public:
  using blob = std::vector<std::byte>;

  /// Rank and world size from the environment; config_error listing the
  /// variables when none is set or a value is invalid.
  static rank_identity identity_from_env();

  /// identity_from_env() plus GOSSIP_MASTER_ADDR (default 127.0.0.1) and
  /// GOSSIP_MASTER_PORT (required when world > 1). The timeout of every wait
  /// on the rendezvous: `timeout` when given, else [engine] timeout_s's
  /// default (60 s) or GOSSIP_TIMEOUT_S, read as the engine reads it.
  static bootstrap from_env(std::optional<std::chrono::duration<double>> timeout = std::nullopt);

  /// Rank 0 listens on address:port (0.0.0.0 or a local address); the others
  /// connect to it. A world of one needs no rendezvous (port may be 0).
  /// `origin` names where address and port came from, for messages.
  bootstrap(int rank, int world, std::string address, std::uint16_t port,
            std::chrono::duration<double> timeout = std::chrono::duration<double>(60.0),
            std::string origin = "GOSSIP_MASTER_ADDR:GOSSIP_MASTER_PORT");
  bootstrap(bootstrap&&) noexcept;
  bootstrap& operator=(bootstrap&&) noexcept;
  ~bootstrap();

  int rank() const noexcept { return m_rank; }
  int world() const noexcept { return m_world; }
  std::chrono::duration<double> timeout() const noexcept { return m_timeout; }
  /// "address:port" of the rendezvous, for messages.
  std::string where() const;

  /// Publishes `value` under `key` (overwrites). Rank 0's store holds every
  /// key until it is erased or rank 0's bootstrap ends, at most 4 GiB of keys
  /// and values (set_store_limit): a put past that throws config_error
  /// naming the key and what the store holds.
  void put(const std::string& key, const blob& value);
  /// Publishes `value` under `key` unless another value is there already: a
  /// config_error naming `what` (e.g. "rank 3's UCX address") and the
  /// rendezvous then, for a rank number started twice or two jobs on one port.
  void put_once(const std::string& key, const blob& value, const std::string& what);
  /// Fetches `key`, waiting until some rank has published it; timeout_error
  /// naming `waiting_for` (e.g. "rank 3's UCX address") and the rendezvous.
  blob get(const std::string& key, const std::string& waiting_for);
  blob get(const std::string& key, const std::string& waiting_for, std::chrono::duration<double> timeout);
  /// One look-up without waiting: the blob, or nothing when no rank has published `key` yet.
  std::optional<blob> try_get(const std::string& key);
  /// Removes `key` from the store; true when it was there (an erase asked
  /// again after a lost reply finds nothing, and says false). Erase what was
  /// read and is not needed again (a model published for every epoch), or
  /// the store grows with the run; a put asked again after a lost reply may
  /// store a key anew after it was erased.
  bool erase(const std::string& key);
  /// Rank 0 only: the most its store holds, keys and values together (each
  /// key counted with 64 bytes more); default 4 GiB. Puts past it are
  /// refused; what is held stays. Values that other ranks' puts are sending
  /// count too while they arrive: a put that fits beside what is held but
  /// not beside them waits for them before its value is taken in (for at
  /// most the bootstrap timeout or 5 s, whichever is longer; a rank that
  /// rank 0 answered before asks again meanwhile, each time no byte moved
  /// for timeout/12, 1–5 s).
  void set_store_limit(std::uint64_t bytes);
  /// Every rank calls it with the same name; returns when all `world` have.
  /// Rank 0 returns last, so it may exit (and stop serving) right after.
  /// A name may be used again: the k-th barrier of a name that returned on
  /// this rank is the k-th on every rank (every rank calls them in the same
  /// order), and one that threw (a timeout, Ctrl-C) may be called again to
  /// go on where it stopped. Not thread-safe, as the rest of the class.
  void barrier(const std::string& name);
  /// The same, for ranks that may have lost peers: each arriving rank
  /// publishes the ranks it found dead (`known_dead`, e.g. stats::dead_peers),
  /// and rank 0 does not wait for a rank that some arrived rank found dead,
  /// then publishes `name`/done, which the others wait for. A rank that died
  /// before reaching it then costs no timeout, as long as one of its peers got
  /// through. Rank 0 must be alive (it serves the store).
  void barrier(const std::string& name, std::span<const int> known_dead);
  /// Marks this rank as through barrier `name` without waiting for the
  /// others: a rank that leaves early (rank 0 must not) calls it so that
  /// the others' barrier does not wait for it.
  void pass(const std::string& name);

  /// The numeric address ("10.0.0.7", "127.0.0.1") of this host's end of
  /// the route to rank 0's rendezvous, found by connecting a UDP socket
  /// there (nothing is sent): the address ranks on other hosts reach this
  /// one by, when they reach rank 0 the same way. Empty when the rendezvous
  /// address is a wildcard (0.0.0.0, ::), which names no route, or does not
  /// resolve.
  std::string local_address() const;

  /// Per-bootstrap counter so that several transports built in one process
  /// (in the same order on every rank) use distinct keys.
  std::uint64_t next_generation() noexcept { return m_generation++; }

 private:
  struct server;
  blob request(char op, const std::string& key, const blob* value, std::chrono::steady_clock::time_point deadline, char& status);
  char put_status(char op, const std::string& key, const blob& value);
  std::string barrier_key(const std::string& name) const;

  int m_rank = 0, m_world = 1;
  std::string m_address;
  std::string m_origin;  ///< the variables address and port came from
  std::uint16_t m_port = 0;
  std::chrono::duration<double> m_timeout{60.0};
  std::uint64_t m_generation = 0;
  bool m_contacted = false;          // rank 0 has answered once: a refusal now means it is gone
  std::uint64_t m_store = 0;         // the identity of rank 0's store that answered first (0: none yet)
  std::unique_ptr<server> m_server;  // rank 0 only
  std::unordered_map<std::string, unsigned> m_barriers;  // barriers of each name this rank got through (or passed)
};

}  // namespace gossip

#pragma once
/// The UCX transport: ranks are processes (or machines) talking UCP active
/// messages.
///
///     auto boot = std::make_shared<gossip::bootstrap>(gossip::bootstrap::from_env());
///     gossip::engine e(model, boot->rank(), boot->world(), cfg, gossip::ucx_transport(boot));
///
/// Connect. attach() creates one ucp_context + ucp_worker (UCX_TLS,
/// UCX_NET_DEVICES and every other UCX_* variable are honoured), publishes
/// the worker address (and, over tcp, a listener's socket address: see
/// ucx_connect) together with the model layout and the config
/// fingerprint at the bootstrap rendezvous, fetches the blobs of its
/// neighbours only (sources ∪ targets — no full mesh), refuses a neighbour
/// whose layout or settings differ (both sides throw), and makes one
/// endpoint per neighbour with peer error handling. A failed endpoint marks
/// the peer dead: dead_peers() reports it once and post() to it returns
/// post_status::peer_dead.
///
/// Wire. One active message per model: the 48-byte wire_header is the AM
/// header, the float32 payload is the AM data. Eager messages are copied once
/// from UCX's receive buffer into the inbox slot; rendezvous messages are
/// fetched by ucp_am_recv_data_nbx straight into the engine-owned slot, with
/// no intermediate copy.
///
/// Progress. A progress thread per transport drives the worker after attach
/// (worker in UCS_THREAD_MODE_SERIALIZED: attach hands the worker to the
/// thread, leave takes it back after joining), so large rendezvous transfers
/// move while the training computes. post() pushes onto a lock-free
/// single-producer queue; post(), busy() on a buffer in flight, collect()
/// (unless the thread sleeps idle: nothing is under way) and release() then
/// drive the worker once themselves — hand the queued send to UCX, land
/// what has arrived, ucp_worker_progress — when the progress thread is not
/// driving it at that moment. Whoever drives holds a flag taken by an atomic
/// exchange; the engine thread never waits for it (it leaves the work to the
/// thread), so step() never blocks on the network. On a core shared by the
/// caller and the progress thread this saves a thread switch per rendezvous
/// hop (docs/ucx-small-messages.md, §6). When idle the thread sleeps in
/// poll() on the worker's event fd (or at most a few milliseconds, so UCX
/// keepalive still runs); post() wakes it through an eventfd when it did not
/// drive the worker itself or the thread sleeps idle.
///
/// Delivery. All messages, in order per source (not only the newest): a
/// push-sum weight must be merged exactly once. A source has `depth` inbox
/// slots; a message arriving while they are all full is kept inside UCX
/// (persistent eager data, or an unstarted rendezvous — whose sender then
/// stays busy(), which is natural back-pressure) in a backlog of
/// `backlog` messages (and `backlog_bytes` of eager data) per source; when that overflows too, the oldest is
/// dropped and counted in counters().dropped, and the next message collected
/// from that source says so (received::gap: an engine with a codec, whose
/// stream cannot skip a message, then asks the source for a full one,
/// request_full()).
///
/// Peer failure. A failed peer is reported once by dead_peers() and logged
/// once on stderr as "rank J (host H)" with UCX's reason. tcp sees a killed peer as a reset connection; shared memory
/// only through UCX keepalive, whose interval this transport sets to
/// `keepalive_s` unless UCX_KEEPALIVE_INTERVAL is set; sysv's keepalive does
/// not see a dead process, so unless UCX_TLS is set (in the environment or
/// in a ucx.conf UCX reads) attach leaves sysv out (UCX_TLS=^sysv: shared
/// memory goes over posix). Error handling on the
/// posix/sysv transports is off by default in UCX 1.13
/// (UCX_POSIX_ERROR_HANDLING=n), which would exclude them under peer error
/// mode; attach turns it on unless the variable is set.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "gossip/bootstrap.hpp"
#include "gossip/transport.hpp"

namespace gossip {

/// How a rank makes its endpoints (ucx_options::connect).
enum class ucx_connect {
  /// `listener` when UCX_TLS names tcp (and self) only and a model message
  /// is at least 256 KiB, else `worker_address`: below that size a put's
  /// extra acknowledgement costs more than the fragments' copy (tcp over
  /// loopback, 2 send buffers: 0.6 against 0.8 of ucx_perftest at 64 KiB,
  /// 0.9 against 0.8 at 256 KiB). GOSSIP_UCX_CONNECT=auto|worker|listener
  /// chooses for a transport built with `automatic`.
  automatic,
  /// From the worker addresses published at the rendezvous: every UCX
  /// transport, shared memory included. Over tcp, peer error handling then
  /// costs the endpoint its rendezvous put lane (docs/ucx-small-messages.md,
  /// §7): messages above UCX's eager limit go as active-message fragments.
  worker_address,
  /// Each rank listens on a socket address (the local address of its route
  /// to rank 0's rendezvous, a port the kernel picks) and publishes it; of a
  /// pair of neighbours that both listen, the lower rank connects to the
  /// higher one's listener and both use that one connection. UCX's
  /// connection manager keeps the put lane under peer error handling. Not
  /// for shared memory, which a connection manager does not serve; a pair
  /// where either rank does not listen connects by worker address. Forced,
  /// attach throws when the listener cannot be made (a rendezvous address
  /// that is a wildcard, or no connection manager in UCX).
  listener,
};

struct ucx_options {
  /// Messages per source held inside UCX beyond the inbox slots. Cheap: an eager
  /// message is small, a rendezvous one is only a descriptor (its data waits at the sender);
  /// the ring costs about 64 bytes an entry. Pacing ([engine] max_lead) bounds
  /// a source's lead only to within a beacon interval (5 ms), in which a
  /// small model's rank steps hundreds of times: with 64 entries a
  /// 5-parameter model over 2 processes on 2 cores overflowed it within
  /// the first thousand steps in most runs.
  std::size_t backlog = 1024;
  /// Bytes of eager data per source that the backlog may hold inside UCX (a
  /// rendezvous message's data waits at its sender and costs nothing here).
  /// Eager messages are small unless UCX_RNDV_THRESH is raised: with it at
  /// `inf` and a 1 MiB model, 1024 held messages of a source whose receiver
  /// stopped merging were 1 GiB. Past the bound the oldest are dropped as
  /// when the backlog overflows (received::gap); one message is always kept.
  std::size_t backlog_bytes = std::size_t{64} << 20;
  double keepalive_s = 1.0;      ///< UCX keepalive interval, unless UCX_KEEPALIVE_INTERVAL is set
  double close_timeout_s = 5.0;  ///< bound on the graceful endpoint close in leave()
  /// While a transfer is under way, the progress thread keeps polling (yielding
  /// its core between polls) for this long after its last progress before it
  /// sleeps on the worker's event fd. 0: sleep at once. Only while one of the
  /// transfers under way is smaller than 16 MiB: larger ones saturate memory
  /// by themselves, and polling would only take the training's core.
  double spin_us = 200;
  /// Step beacons ([engine] max_lead) go out at most this often. A rank
  /// stepping faster than max_lead/2 steps per interval sends one per
  /// interval and says how many steps late it is; its targets add those
  /// steps to the lead they allow it, so a skipped step costs no wake-up of
  /// the progress thread on either side. A rank that waits asks its sources
  /// for their step, so a wait does not last until a held beacon falls due.
  /// Steps longer than interval / (max_lead/2) are paced exactly. 0: a
  /// beacon every max_lead/2 steps, however short. 0 to 60000.
  double beacon_interval_ms = 5;
  ucx_connect connect = ucx_connect::automatic;  ///< how endpoints are made
};

class ucx_transport {
 public:
  explicit ucx_transport(std::shared_ptr<gossip::bootstrap> boot, ucx_options options = {});
  ucx_transport(ucx_transport&&) noexcept;
  ucx_transport& operator=(ucx_transport&&) noexcept;
  ~ucx_transport();

  void attach(const transport_setup& setup);
  [[nodiscard]] post_status post(int peer, std::span<const std::byte> msg, std::uint64_t step);
  std::size_t collect(std::uint64_t step, std::span<received> out);
  void release(std::uint64_t step);
  /// The codec stream from `source` lost a message here (received::gap):
  /// asks it, in a message of a few bytes, to make its next message to this
  /// rank full; there its next post() to this rank returns busy once, and
  /// the engine, which then counts the stream as out of step, sends in full.
  void request_full(int source) noexcept;
  void end_step(std::uint64_t step) noexcept;
  /// The engine waits for its sources (max_lead): a step beacon held back by
  /// ucx_options::beacon_interval_ms goes out now, and the sources are asked
  /// for theirs (each tells its newest step at once).
  void waiting() noexcept;
  bool busy(const std::byte* buffer) const noexcept;
  void flush(std::chrono::duration<double> timeout);
  void leave();
  transport_capabilities capabilities() const noexcept;
  std::size_t dead_peers(std::span<received> out);
  /// True once every live source's messages have been consumed (see engine::finish).
  bool drained();
  /// The peers this rank still waits for (sends in flight, drain counts), each
  /// as "rank J (host H)", for timeout messages.
  std::string waiting_on() const;
  /// The longest backlog of any source: messages UCX delivered that wait for a slot.
  std::size_t backlog() const noexcept;
  /// Whether attach made a listener (ucx_connect): endpoints to neighbours
  /// that listen too go through it.
  bool listening() const noexcept;
  /// The model fingerprint neighbour `rank` attached with (0: none, or not a neighbour).
  std::uint64_t peer_model(int rank) const noexcept;
  transport_counters counters() const noexcept;
  /// Bytes this transport allocates per neighbour after attach: its peer
  /// record (send contexts), and per source the backlog ring and receive
  /// contexts. Not counted: the inbox slots (the engine's) and what UCX
  /// allocates inside (its eager buffers, shared-memory FIFOs per worker).
  std::size_t held_bytes_per_peer() const noexcept;

  /// The UCX version and the transports it may use, for a log line: UCX_TLS
  /// as set in the environment or a ucx.conf, else "^sysv" (see attach), and
  /// UCX_NET_DEVICES.
  std::string describe() const;

  /// Can UCX create a context and worker here (with the current UCX_* environment)?
  /// Returns an empty string when it can, else the reason. Does not start threads
  /// that outlive the call.
  static std::string probe();

 private:
  struct impl;
  std::unique_ptr<impl> m;
};
static_assert(transport<ucx_transport>);

}  // namespace gossip

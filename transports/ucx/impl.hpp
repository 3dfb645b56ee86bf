#pragma once
// The UCX transport's state, shared by its three parts: ucx.cpp (the
// transport's interface and the engine thread's data path: post, collect,
// release), lifecycle.cpp (UCX set-up, the rendezvous through the bootstrap,
// the drain handshake, leaving and teardown) and progress.cpp (the progress
// thread: sends, arrivals, goodbyes and endpoint errors). Only these files
// include it; ucx.hpp keeps UCX out of users' builds.
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "ucx.hpp"
#include "wire.hpp"

namespace gossip {

namespace ucx_detail {

inline constexpr unsigned am_id = 0x47;                  // "G"
inline constexpr unsigned bye_id = 0x48;                 // a rank leaving: header = bye_header
struct bye_header {
  std::int32_t rank = -1;
  std::int32_t drained = 0;  // 1: engine::finish reached the drain handshake, 0: it did not (an error, no finish())
  // The push-sum weight of the receiver's messages that the leaving rank held
  // and never merged (its drain handshake did not complete, or it never
  // finished); the receiver takes it back, as for a send that failed.
  double unmerged_weight = 0;
};
inline constexpr unsigned step_id = 0x49;                // a step beacon: header = step_beacon_header
inline constexpr unsigned ask_id = 0x4A;                 // a target waits on this rank (max_lead): header = its rank
// Liveness probe: a rank whose send to a target has been held for a while asks
// the target's progress thread to answer, whatever its engine is doing. A
// target that does not answer within half of timeout_s is declared dead (its
// process is stopped, hung, or gone without UCX noticing: over shared memory
// a peer that ended before its endpoint connected is never reported). A
// target not heard from yet is probed only once this rank has run for
// timeout_s: it may still be attaching.
inline constexpr unsigned ping_id = 0x4B;                // header = the asking rank
inline constexpr unsigned pong_id = 0x4C;                // the answer: header = the answering rank
// A codec's stream lost a message here (received::gap): the receiver asks its
// source to send the next one full (transport request_full); header = the asking rank.
inline constexpr unsigned full_id = 0x4D;

struct step_beacon_header {
  std::int32_t rank = -1;
  /// Steps by which this beacon comes later than transport_setup::step_beacon
  /// asks, because the sender steps faster than one beacon per
  /// ucx_options::beacon_interval_ms allows (0 from older senders).
  std::uint32_t late = 0;
  std::uint64_t step = 0;
};
// ucx_connect::automatic makes endpoints through listeners (over tcp alone)
// for messages of at least this many bytes.
inline constexpr std::size_t listener_from_bytes = std::size_t{256} << 10;
inline constexpr std::size_t max_buffers = 64;           // distinct send buffers tracked by busy()
inline constexpr std::size_t queue_capacity = 1024;

inline std::string status_text(ucs_status_t s) { return ucs_status_string(s); }

/// The transports the user chose: UCX_TLS from the environment, else from a
/// ucx.conf that UCX reads ($UCX_CONFIG_DIR/ucx.conf or the installation's);
/// nullopt when neither sets it (or a file sets UCX's default, "all").
std::optional<std::string> user_tls();

/// What the transport runs with: the user's choice, else "^sysv" (UCX's
/// "all" less sysv, whose keepalive never sees a peer process die).
std::string effective_tls(const std::optional<std::string>& user);

/// UCX 1.13 leaves peer error handling off on the shared-memory transports
/// (UCX_POSIX_ERROR_HANDLING=n), so under UCP_ERR_HANDLING_MODE_PEER they
/// drop out and posix,self finds no path ("Destination is unreachable").
/// Turns it on for the transports `user` (user_tls()) may select, unless the
/// user chose in the environment.
void enable_shm_error_handling(const std::optional<std::string>& user);

/// True when `tls` (a UCX_TLS value) lets UCX use tcp and nothing else but
/// self: ucx_connect::automatic then connects through listeners.
bool tcp_only(std::string_view tls);
/// True when `tls` lets UCX use tcp at all (it names tcp or all, or excludes others).
bool may_use_tcp(std::string_view tls);

/// ucp_config_read with the above applied: error handling on shared memory,
/// and TLS = effective_tls(user). Throws transport_error starting with `who`.
ucp_config_t* read_config(std::string_view who, const std::optional<std::string>& user);

}  // namespace ucx_detail

struct ucx_transport::impl {
  struct send_ctx {
    impl* owner = nullptr;
    int peer = -1;
    int entry = -1;
    std::size_t length = 0;  // one send per (peer, buffer) is in flight at a time
    bool held = false;       // progress thread: UCX holds the request and has not completed it
    std::chrono::steady_clock::time_point held_at{};  // progress thread: since when
    bool abandoned = false;  // progress thread: given up on (its peer is dead); a late completion is ignored
  };
  struct peer_state {
    int rank = -1;
    bool target = false;
    std::string name;       // "rank J (host H)", for messages; set by attach
    std::uint64_t model_fp = 0;  // the model fingerprint it attached with; set by attach
    ucp_ep_h ep = nullptr;  // progress thread after attach
    std::atomic<bool> dead{false};
    // It said goodbye (left after its drain handshake): its endpoint closing
    // later is a departure, not a death, and is neither reported nor logged.
    std::atomic<bool> departed{false};
    // It said goodbye before its drain handshake (its engine was destroyed
    // without finish(), or by an error): dead from that moment, its mass lost.
    std::atomic<bool> left_early{false};
    std::atomic<int> why{UCS_OK};  // the error that marked it dead, when UCX gave one
    std::atomic<int> inflight{0};  // sends posted and not completed
    // Protocol weight stamped on sends to it that failed (written by the
    // progress thread before it decrements inflight; read once inflight is 0).
    std::atomic<double> failed_weight{0};
    // It connects to our listener (ucx_connect::listener; it is the lower
    // rank): attach waits until its connection request made `ep`.
    bool accepts = false;
    bool by_listener = false;  // its endpoint is made through a listener (ours or its own)
    bool reported = false;         // engine thread
    std::chrono::steady_clock::time_point dead_seen{};  // engine thread: when dead_peers() first saw it dead
    std::uint64_t posted = 0;      // engine thread: messages accepted by post()
    // Engine thread, for settling a dead peer's push-sum account (settle()):
    // the weight stamped on the messages post() accepted for it, what
    // dead_peers() has handed back for it so far, whether its record was read
    // (or given up on), and when the rendezvous was last asked for it.
    double weight_posted = 0, weight_handed_back = 0;
    bool settled = false;
    std::chrono::steady_clock::time_point record_asked{};
    bool closing = false;          // progress thread
    std::chrono::steady_clock::time_point closed_at{};  // progress thread: when close_dead() closed its endpoint
    std::uint64_t told_step = 0;   // progress thread: the step of the last beacon to it
    ucx_detail::step_beacon_header beacon;  // progress thread: UCX reads it until beacon_req completes
    void* beacon_req = nullptr;              // progress thread: the beacon still in flight, if any
    void* ask_req = nullptr;                 // progress thread: the ask (ask_id) still in flight, if any
    // Codec stream resync (full_id): the engine thread asks the progress
    // thread to send the request to this source (full_asked); a target's
    // request makes the next post() to it refused once (full_wanted), so the
    // engine's next message to it is full.
    std::atomic<bool> full_asked{false}, full_wanted{false};
    void* full_req = nullptr;  // progress thread: the request still in flight, if any
    // Liveness probe (ping_id / pong_id), progress thread:
    void* ping_req = nullptr;  // our ping still in flight, if any
    void* pong_req = nullptr;  // our answer still in flight, if any
    bool pong_due = false;     // it pinged us: answer
    bool alive_seen = false;   // its progress thread has run: it pinged, answered or asked us, or told us a step
    bool probing = false;      // a ping to it awaits its answer
    std::chrono::steady_clock::time_point probed_at{}, answered_at{};
    std::atomic<bool> unresponsive{false};  // declared dead for not answering a probe (for messages)
    std::array<send_ctx, ucx_detail::max_buffers> ctx{};
    impl* owner = nullptr;
  };
  // A message UCX holds for us while every slot of its source is full.
  struct pending {
    wire_header h;
    void* data = nullptr;
    std::size_t length = 0;
    bool rndv = false;
  };
  struct recv_ctx {
    impl* owner = nullptr;
    inbox::slot* slot = nullptr;
    void* request = nullptr;
  };
  struct source_state {
    int rank = -1;
    std::size_t index = 0;
    std::uint64_t write = 0;            // progress thread: next slot to fill
    std::uint64_t read = 0, taken = 0;  // engine thread: first slot not released; returned by last collect
    std::uint64_t consumed = 0;         // engine thread: slots handed to the engine (or skipped as failed)
    std::uint64_t gaps_told = 0;        // engine thread: discarded messages already flagged by collect (received::gap)
    // Engine thread: the weight collect handed on from it (the shares of
    // dropped messages that rode with later ones included), and whether that
    // sum is published as its dead source's record (publish_records()): from
    // then on nothing more of it is handed on, so the record stays true.
    double weight_taken = 0;
    bool sealed = false;
    // Engine thread, once it is found dead: it said it posts nothing more
    // here (its "stopped" record), the record is published or given up on,
    // and when the rendezvous was last asked and since when it is dead.
    bool stopped = false, records_done = false;
    std::chrono::steady_clock::time_point record_asked{}, record_dead_seen{};
    std::uint64_t expected = ~0ull;     // engine thread: what the source says it sent us, once known
    std::chrono::steady_clock::time_point dead_drain{};  // engine thread: when the drain first found it dead
    std::uint64_t heard = 0;            // progress thread: newest step its beacons or model headers carried (~0: finished or dead)
    std::uint64_t beacon = 0;           // progress thread: the step of its newest beacon
    std::uint32_t late = 0;             // progress thread: that beacon's `late` (the source may be that far past `beacon`)
    std::vector<pending> backlog;       // progress thread: ring of `backlog` entries
    std::size_t head = 0, count = 0;
    std::size_t held_bytes = 0;         // progress thread: eager data the ring holds inside UCX (ucx_options::backlog_bytes)
    std::vector<recv_ctx> recv;  // one per slot
  };
  struct send_op {
    int peer;
    int entry;
    const std::byte* data;
    std::size_t length;
  };
  struct buffer_entry {
    const std::byte* ptr = nullptr;  // engine thread
    std::atomic<int> inflight{0};
  };

  std::shared_ptr<gossip::bootstrap> boot;
  ucx_options opt;
  transport_setup setup;
  std::string self_name;  // "rank R (host H)"
  bool attached = false, left = false;

  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  // ucx_connect::listener: where neighbours connect (listen_len 0: no listener).
  ucp_listener_h listener = nullptr;
  sockaddr_storage listen_addr{};
  socklen_t listen_len = 0;
  int worker_fd = -1, wake_fd = -1;
  std::thread thread;
  std::atomic<bool> stop{false};
  // The worker's driver: whoever holds it (the progress thread, or the
  // engine thread inside help()) may call into the worker and touch the
  // state marked "progress thread" below. Taken with exchange, never waited
  // for by the engine thread.
  std::atomic<bool> driver{false};
  bool running = false;  // engine thread: the progress thread has started and not been stopped
  // Progress thread → engine thread: it sleeps on its long idle wait, so a
  // transfer that help() starts needs a wake-up to be carried on.
  std::atomic<bool> idle{false};

  std::vector<std::unique_ptr<peer_state>> peers;  // by rank; null when not a neighbour
  std::vector<int> neighbours;
  std::vector<source_state> sources;
  std::vector<int> source_of;  // rank → index in sources, or -1
  std::array<buffer_entry, ucx_detail::max_buffers> buffers{};

  std::array<send_op, ucx_detail::queue_capacity> queue{};
  std::atomic<std::size_t> q_head{0}, q_tail{0};  // head: consumer, tail: producer

  std::atomic<std::uint64_t> bytes_sent{0}, messages_sent{0}, bytes_received{0}, messages_received{0}, dropped{0};
  // Step beacons (transport_setup::step_beacon): the engine thread publishes
  // its step every `step_beacon` steps, but not more often than every
  // ucx_options::beacon_interval_ms, and wakes the progress thread, which
  // tells every live target. A source's beacon or model header raises its
  // `heard`; heard_step is the least over sources of heard + late (slowest
  // live source).
  std::atomic<std::uint64_t> beacon_step{0}, beacons_sent{0}, heard_step{0};
  std::atomic<int> slowest_rank{-1};  // the source heard_step comes from (-1: none), for messages
  // A step held back by beacon_interval_ms, and when it is due (steady_clock
  // ticks): written by the engine thread without waking the progress thread.
  std::atomic<std::uint64_t> held_step{0};
  std::atomic<std::int64_t> held_due{0};
  std::uint64_t next_beacon = 0;                             // engine thread
  std::chrono::steady_clock::time_point next_beacon_time{};  // engine thread
  std::uint64_t told = 0;                                    // progress thread: the step of the newest beacon it sends
  std::uint32_t told_late = 0;                               // progress thread: that beacon's `late`
  // Progress thread → engine thread: the newest step told and when (steady_clock
  // ticks; told_at is written first). A held step the progress thread told
  // when it fell due then counts as published for end_step.
  std::atomic<std::uint64_t> told_step{0};
  std::atomic<std::int64_t> told_at{0};
  std::atomic<bool> want_beacons{false};   // engine thread → progress thread: ask every source for its step
  std::atomic<bool> want_full{false};      // engine thread → progress thread: some peer's full_asked is set
  void request_full(int source) noexcept;  // engine thread
  bool ask_now = false;                    // progress thread: a target asked; tell a held step now
  std::int32_t ask_header = -1;            // this rank, the header of every ask (UCX reads it until the send completes)
  std::chrono::steady_clock::duration beacon_interval() const noexcept {
    return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double, std::milli>(opt.beacon_interval_ms));
  }
  // Progress thread: the step to tell targets now (published, or held and
  // due), updating told / told_late; 0: none.
  std::uint64_t beacon_to_tell(std::int64_t now_ticks) noexcept;
  // Per source: messages UCX delivered that never reached a slot (backlog overflow,
  // unkeepable eager data). Written by the progress thread, read by drained().
  std::unique_ptr<std::atomic<std::uint64_t>[]> discarded;
  // Per source: the push-sum weight those messages carried, not yet handed
  // on; collect adds it to the source's next message (received::gap), so the
  // total weight stays exact and the share rides with a newer model.
  std::unique_ptr<std::atomic<double>[]> discarded_weight;
  // Per source: its backlog's length (source_state::count), published by the
  // progress thread for ucx_transport::backlog().
  std::unique_ptr<std::atomic<std::uint32_t>[]> backlogged;
  void discard(std::size_t si, double weight) noexcept;
  std::uint64_t generation = 0;
  bool drain_published = false, rendezvous_gone = false;
  bool finishing = false;  // engine::finish reached the drain handshake: leaving is a departure

  ~impl() { teardown_now(); }

  // ---- engine thread -------------------------------------------------------

  void wake() const noexcept {
    if (wake_fd < 0) return;
    const std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_fd, &one, sizeof one);
  }

  peer_state* peer(int r) const noexcept {
    return r >= 0 && static_cast<std::size_t>(r) < peers.size() ? peers[static_cast<std::size_t>(r)].get() : nullptr;
  }

  // Engine thread: drives the worker once (queued sends, held messages,
  // ucp_worker_progress, at most 8 passes) unless the progress thread holds
  // it; true if it did.
  bool help() noexcept;
  void init_ucx();
  // ucx_connect: makes the listener when this rank should listen (see
  // ucx_connect::automatic); returns whether it listens.
  bool start_listener();
  // Waits (driving the worker) until every neighbour that connects to our
  // listener has, then until every connection through a listener is
  // flushed, up to setup.timeout in all.
  void accept_neighbours();
  void attach(const transport_setup& s);
  int find_buffer(const std::byte* ptr) noexcept;
  post_status post(int to, std::span<const std::byte> msg, std::uint64_t step);
  std::size_t collect(std::span<received> out);
  void release();
  void end_step(std::uint64_t step) noexcept;
  void waiting() noexcept;
  void publish_step(std::uint64_t step, std::chrono::steady_clock::time_point now) noexcept;

  // Drain handshake: publish how many messages we posted to each rank, then
  // report true once every live source's count has been consumed (or lost
  // inside UCX). The engine keeps merging while it waits, so nothing a peer
  // sent before it left is stranded in a slot or a held rendezvous.
  bool drained();
  bool drained_through_rendezvous();
  std::string outstanding() const;
  bool holds_from(std::size_t source_index) const noexcept;  // a message of that source in the backlog or a slot

  // What this rank still waits for, naming each peer and its host.
  std::string waiting_on() const;
  void flush(std::chrono::duration<double> timeout);
  void leave();

  // Stops the thread (it closes the endpoints and the worker) or, when it
  // never started, does the same here.
  void teardown_now() noexcept;

  // A dead peer is reported once its sends have all completed (UCX fails them
  // when the endpoint closes), so that the weight of the ones that never
  // arrived is known: received::weight carries it, for the engine to take
  // back. After 2 s it is reported regardless, with what has failed so far.
  std::size_t dead_peers(std::span<received> out);
  // Push-sum exactness when a peer is found dead while both ends still run
  // (a probe that gave up on a stopped process, a link cut for longer than
  // the probe waits): a message under way between them can complete at its
  // sender and fail at its receiver (UCX 1.13 completes a rendezvous send
  // whose receiver closed the endpoint mid-transfer), or the reverse, and
  // neither end alone knows where its share went. So, through the
  // rendezvous (keys gossip/ucx/<generation>/<what>/<from>/<to>):
  //  - a rank that reports a target dead says it posts nothing more to it
  //    ("stopped"); its posts to it are refused from then on;
  //  - a rank that found a source dead and read that source's "stopped"
  //    seals it once nothing of it is held (collect hands nothing more of it
  //    on) and publishes the weight it took from it ("taken");
  //  - the source, having reported the rank dead with the shares that failed
  //    at its end, reads "taken" and hands back the difference to what it
  //    posted (a later dead_peers() entry, received::settled).
  // A rank that really died publishes nothing: its peers keep the estimate.
  // A source found dead that never finds this rank dead says nothing, and
  // its messages are merged as before. The rendezvous is asked at most every
  // 250 ms per peer, for up to 4 × timeout_s (20 s at least); after an error
  // (the rendezvous is gone or stalled — a call to a rank 0 whose host froze
  // without its connections reset waits up to the bootstrap's timeout once)
  // no more.
  void publish_records(std::chrono::steady_clock::time_point now);
  std::string record_key(std::string_view what, int from, int to) const;
  // Whether to ask the rendezvous now (at most every 250 ms, within the
  // window after dead_seen); sets gave_up once the window is over.
  bool record_due(std::chrono::steady_clock::time_point& asked, std::chrono::steady_clock::time_point dead_seen,
                  std::chrono::steady_clock::time_point now, bool& gave_up) const noexcept;
  bool records_off = false;  // engine thread: the rendezvous failed a call; settling is given up
  // Runs a call to the rendezvous; false (and records_off) when it threw.
  // None once the rendezvous failed (here or in the drain), nor once rank 0
  // stopped answering probes: the rendezvous is in its process, and a call
  // would wait for it.
  template <class F>
  bool store(F&& call) noexcept {
    const peer_state* r0 = peer(0);
    if (records_off || rendezvous_gone || !boot || (r0 && r0->unresponsive.load(std::memory_order_relaxed))) return false;
    try {
      call();
      return true;
    } catch (const config_error& e) {
      // Rank 0 is there but its store refused a record (full): settling
      // stops as if it were gone, but not unseen.
      records_off = true;
      std::fprintf(stderr, "libgossip ucx (%s): settling the push-sum weight of peers found dead stops, their shares stay estimates: %s\n",
                   self_name.c_str(), e.what());
      return false;
    } catch (const std::exception&) {
      records_off = true;
      return false;
    }
  }
  std::optional<double> read_record(peer_state& p, std::chrono::steady_clock::time_point now);

  // ---- progress thread (and UCX callbacks, which run inside it) -----------

  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status);
  // A neighbour connects to our listener: its client id names it (generation, rank).
  static void on_connect(ucp_conn_request_h request, void* arg);
  static void on_send_done(void* request, ucs_status_t status, void* user);
  void send_done(int to, int entry, ucs_status_t status, std::size_t length) noexcept;
  bool drain_sends() noexcept;
  static ucs_status_t on_bye(void* arg, const void* header, std::size_t header_length, void*, std::size_t, const ucp_am_recv_param_t*);
  static ucs_status_t on_step(void* arg, const void* header, std::size_t header_length, void*, std::size_t, const ucp_am_recv_param_t*);
  bool send_beacons() noexcept;
  // A target waits on this rank: tell it the newest (held) step now.
  static ucs_status_t on_ask(void* arg, const void* header, std::size_t header_length, void*, std::size_t, const ucp_am_recv_param_t*);
  // A control message of this rank's number (ask, full, ping, pong) to p,
  // one at a time per kind: `req` holds the one UCX has not completed.
  enum class control_sent { sent, in_flight, failed };
  control_sent send_control(peer_state& p, unsigned id, void*& req) noexcept;
  bool send_asks() noexcept;
  static ucs_status_t on_full(void* arg, const void* header, std::size_t header_length, void*, std::size_t, const ucp_am_recv_param_t*);
  bool send_full_requests() noexcept;
  // Liveness probe (see ping_id): answers pings, pings targets whose sends
  // UCX has held for probe_after(), declares dead those that do not answer
  // within probe_timeout().
  peer_state* sender_of(const void* header, std::size_t header_length) const noexcept;
  static ucs_status_t on_ping(void* arg, const void* header, std::size_t header_length, void*, std::size_t, const ucp_am_recv_param_t*);
  static ucs_status_t on_pong(void* arg, const void* header, std::size_t header_length, void*, std::size_t, const ucp_am_recv_param_t*);
  bool probe_peers(std::chrono::steady_clock::time_point now) noexcept;
  std::chrono::steady_clock::time_point run_started{};  // progress thread: when run() began
  // A ping to it is out and unanswered (progress thread): shutdown_ucx closes its endpoint as a dead one's.
  static bool unanswered(const peer_state& p) noexcept { return p.probing && p.answered_at < p.probed_at; }
  std::chrono::steady_clock::duration probe_after() const noexcept;
  std::chrono::steady_clock::duration probe_timeout() const noexcept;

  static ucs_status_t on_am(void* arg, const void* header, std::size_t header_length, void* data, std::size_t length,
                            const ucp_am_recv_param_t* param);
  ucs_status_t arrived(const void* header, std::size_t header_length, void* data, std::size_t length, std::uint64_t attr) noexcept;

  bool slot_free(const source_state& src) const noexcept {
    return setup.inbox->at(src.index, src.write).state.load(std::memory_order_acquire) == inbox::empty;
  }

  // Fills the next slot of `src` with `m`. `owned`: m.data must be released to UCX after the copy.
  void land(source_state& src, const pending& m, bool owned) noexcept;
  // Progress thread: source `src` has reached `step`; heard_step follows the slowest.
  void heard_from(source_state& src, std::uint64_t step) noexcept;
  void update_heard_step() noexcept;
  // The least `heard` over sources (~0 when there are none): max_lead's slowest
  // source; `rank`, when given, is set to that source's rank (-1: none).
  std::uint64_t slowest_source(int* rank = nullptr) const noexcept;
  void landed(inbox::slot& slot, std::size_t length) noexcept;

  // A slot whose receive failed: full but empty, so collect skips it and keeps the order.
  void failed(inbox::slot& slot) noexcept;
  static void on_recv_done(void* request, ucs_status_t status, std::size_t length, void* user);
  bool land_backlog() noexcept;
  // Progress thread: the oldest message of the source's backlog, out of the ring.
  pending pop_backlog(source_state& src) noexcept;
  void close_dead() noexcept;
  // Sends to a peer closed as dead that UCX has still not completed a while
  // later are given up on, as failed (see abandon_stuck_sends in progress.cpp).
  void abandon_stuck_sends() noexcept;
  // Transfers under way: sends UCX holds, receives into slots, messages
  // waiting in a backlog for a slot; the smallest one's bytes. The progress
  // thread polls while one smaller than spin_below is under way.
  struct transfers {
    bool any = false;
    std::size_t smallest = ~std::size_t{0};
  };
  static constexpr std::size_t spin_below = std::size_t{16} << 20;
  transfers under_way() const noexcept;
  void run() noexcept;

  // Cancels what is queued, returns held messages to UCX, closes endpoints
  // (gracefully, bounded by close_timeout_s) and destroys the worker.
  void shutdown_ucx() noexcept;
};

}  // namespace gossip

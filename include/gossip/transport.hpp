#pragma once
/// Transports move opaque payloads between ranks.
///
/// The engine owns every buffer: one inbox per source rank (a ring of slots,
/// each large enough for one message) and its send buffers. A transport writes
/// received messages straight into those slots and never allocates on the step
/// path. The engine does not know which transport it has; it calls:
///
///   attach(setup)             connect to setup.sources / setup.targets, check
///                             layouts, register the inboxes (may block, bounded)
///   post(peer, msg, step)     non-blocking send of one message
///   collect(step, out)        messages to merge at `step` (slots stay owned by
///                             the transport until release)
///   release(step)             the engine has merged them; slots are free again
///   end_step(step)            this rank finished `step` (sends all posted)
///   busy(buffer)              is a send buffer still referenced by the wire?
///   flush(timeout) / leave()  drain sends / depart (peers stop waiting for us)
///
/// A message is a wire_header followed by the model as float32, tensors in
/// layout order. Byte counters count both.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gossip/error.hpp"
#include "gossip/model.hpp"

namespace gossip {

struct wire_header {
  static constexpr std::uint32_t magic_value = 0x31505347;  // "GSP1"
  static constexpr std::uint16_t version_value = 1;
  std::uint32_t magic = magic_value;
  std::uint16_t version = version_value;
  /// Bits of `flags`: the payload is a codec's segments (codec_payload),
  /// the message is of a round finish() forced (finish_round).
  static constexpr std::uint16_t codec_payload = 1, finish_round = 2;
  std::uint16_t flags = 0;
  std::int32_t sender = -1;
  std::uint32_t reserved = 0;
  std::uint64_t step = 0;
  /// Protocol weight (push-sum share, mixing weight). Through an aggregator in
  /// sync mode: the member's relative drift² at the send, and in the reply the
  /// group's mean of it (signal::group_drift_sq).
  double weight = 0;
  std::uint64_t payload_bytes = 0;   ///< bytes after this header
  std::uint64_t layout_fingerprint = 0;
};
static_assert(sizeof(wire_header) == 48);

/// One received message: points into an engine-owned inbox slot. (Also the
/// entry type of dead_peers(), which uses sender, weight and departed.)
struct received {
  int sender = -1;
  std::uint64_t step = 0;
  double weight = 0;
  const float* data = nullptr;
  std::size_t elements = 0;
  bool departed = false;  ///< dead_peers(): the rank left on purpose after its drain handshake; not a failure
  /// collect(): the transport dropped a message of this source since the
  /// last one it delivered (UCX: its backlog overflowed while this rank did
  /// not collect). `weight` then includes the push-sum shares the dropped
  /// messages carried, so the total weight stays exact and the share merges
  /// with this newer model; a codec's stream cannot skip a message and asks
  /// for a full one (any_transport::request_full).
  bool gap = false;
  /// dead_peers(): `weight` comes from the peer's own record of what it
  /// took from this rank, so the shares handed back are exact and nothing
  /// this rank sent is lost with it.
  bool settled = false;
};

/// Engine-owned receive buffers: `depth` slots per source rank.
class inbox {
 public:
  enum : std::uint32_t { empty = 0, writing = 1, full = 2 };
  struct slot {
    std::atomic<std::uint32_t> state{empty};
    std::uint64_t bytes = 0;
    std::chrono::steady_clock::time_point ready_at{};  ///< emulated arrival time
    std::byte* data = nullptr;
  };

  inbox() = default;
  inbox(std::span<const int> sources, std::size_t depth, std::size_t message_bytes)
      : m_sources(sources.begin(), sources.end()), m_depth(depth), m_message_bytes(message_bytes),
        m_storage(std::make_unique<std::byte[]>(sources.size() * depth * message_bytes + 64)),
        m_slots(std::make_unique<slot[]>(sources.size() * depth)) {
    std::byte* base = m_storage.get();
    base += (64 - reinterpret_cast<std::uintptr_t>(base) % 64) % 64;
    for (std::size_t i = 0; i < sources.size() * depth; ++i) m_slots[i].data = base + i * message_bytes;
  }

  std::span<const int> sources() const noexcept { return m_sources; }
  std::size_t depth() const noexcept { return m_depth; }
  std::size_t message_bytes() const noexcept { return m_message_bytes; }
  /// Index of `rank` among the sources, or -1.
  int index_of(int rank) const noexcept {
    for (std::size_t i = 0; i < m_sources.size(); ++i)
      if (m_sources[i] == rank) return static_cast<int>(i);
    return -1;
  }
  slot& at(std::size_t source_index, std::uint64_t step) noexcept {
    return m_slots[source_index * m_depth + step % m_depth];
  }

 private:
  std::vector<int> m_sources;
  std::size_t m_depth = 0, m_message_bytes = 0;
  std::unique_ptr<std::byte[]> m_storage;
  std::unique_ptr<slot[]> m_slots;
};

/// What an engine tells its transport when it attaches.
struct transport_setup {
  int rank = 0;
  int world = 1;
  model_layout layout;
  std::uint64_t layout_fingerprint = 0;
  std::uint64_t config_fingerprint = 0;
  std::string config_settings;  ///< config::shared_settings(), to name what differs (empty: not told)
  /// Fingerprint of the model's values when the engine was built (0: not
  /// told). Peers that report the same one started from the same model, and
  /// a codec's streams between them start from it (engine: shared start).
  std::uint64_t model_fingerprint = 0;
  std::vector<int> sources;  ///< ranks that may send to us
  std::vector<int> targets;  ///< ranks we may send to (union over rounds)
  std::size_t message_bytes = 0;
  gossip::inbox* inbox = nullptr;
  std::chrono::duration<double> timeout{60.0};
  /// Tell every target this rank's step every this many steps, in a message
  /// of a few bytes apart from the model's ([engine] max_lead paces by the
  /// steps it hears; 0: never). A transport may send them less often when
  /// steps are short, saying how late they are
  /// (transport_counters::source_step_heard). Transports whose ranks step
  /// together (copies_on_post) or that aggregate ignore it.
  std::uint64_t step_beacon = 0;
};

struct transport_capabilities {
  bool deterministic = false;    ///< merge order and content independent of timing
  bool copies_on_post = false;   ///< send buffer reusable as soon as post() returns
  bool emulates_network = false; ///< bandwidth / latency emulated per link
  /// Sends step beacons (transport_setup::step_beacon) and reports in
  /// transport_counters::source_step_heard how far its slowest live source
  /// has come; [engine] max_lead then paces by it alone.
  bool step_beacons = false;
  /// Sums what the ranks post in the network (the switch) instead of
  /// delivering each message: only the switch-aggregate protocol speaks to
  /// it, and it carries no other.
  bool aggregates = false;
  const char* name = "?";
};

enum class post_status : std::uint8_t { ok, peer_dead, busy };

struct transport_counters {
  std::uint64_t bytes_sent = 0, messages_sent = 0, bytes_received = 0, messages_received = 0, dropped = 0;
  std::uint64_t rejoins = 0;  ///< times the transport joined again after its far end lost its state (a restarted switch)
  std::uint64_t beacons_sent = 0;       ///< step beacons (transport_setup::step_beacon) posted
  /// Transports with step beacons: the least, over this rank's live sources,
  /// of the newest step each one's beacons or model headers carried: every
  /// live source has reached it, or is presumed to have, when its beacons
  /// come fewer than step_beacon asks because it steps faster than the
  /// transport sends them (then that source counts as its step plus the
  /// steps its last beacon came late). 0 until every source has been heard
  /// from; a source that died or finished no longer counts (none left: ~0).
  std::uint64_t source_step_heard = 0;
};

template <class T>
concept transport = requires(T& t, const transport_setup& s, int peer, std::span<const std::byte> msg, std::uint64_t step,
                             std::span<received> out, const std::byte* buf, std::chrono::duration<double> d) {
  { t.attach(s) };
  { t.post(peer, msg, step) } -> std::same_as<post_status>;
  { t.collect(step, out) } -> std::same_as<std::size_t>;
  { t.release(step) };
  { t.end_step(step) };
  { t.busy(buf) } -> std::same_as<bool>;
  { t.flush(d) };
  { t.leave() };
  { t.capabilities() } -> std::same_as<transport_capabilities>;
  // Ranks detected dead since the last call: received::sender is the rank,
  // received::weight the protocol weight stamped on messages to it that were
  // never delivered (the engine takes that share back), 0 when not known;
  // received::departed when it said goodbye before going (not a failure).
  // A later entry for a rank reported already (received::settled) settles
  // its account: weight is the correction (either sign) to what the first
  // entry handed back.
  { t.dead_peers(out) };
  { t.counters() } -> std::same_as<transport_counters>;
};

/// Type-erased transport so the engine is built once for all of them.
class any_transport {
 public:
  any_transport() = default;
  template <transport T>
    requires(!std::same_as<std::remove_cvref_t<T>, any_transport>)
  any_transport(T t) : m_self(std::make_unique<model<T>>(std::move(t))) {}

  explicit operator bool() const noexcept { return m_self != nullptr; }
  void attach(const transport_setup& s) { m_self->attach(s); }
  [[nodiscard]] post_status post(int peer, std::span<const std::byte> msg, std::uint64_t step) { return m_self->post(peer, msg, step); }
  std::size_t collect(std::uint64_t step, std::span<received> out) { return m_self->collect(step, out); }
  void release(std::uint64_t step) { m_self->release(step); }
  void end_step(std::uint64_t step) { m_self->end_step(step); }
  bool busy(const std::byte* buf) const { return m_self->busy(buf); }
  void flush(std::chrono::duration<double> d) { m_self->flush(d); }
  void leave() { m_self->leave(); }
  /// The engine goes without finish() (an error, or destroyed early): a
  /// transport that can tell its peers that this rank failed, rather than
  /// left, does (loopback); others leave() as they would.
  void abandon() { m_self->abandon(); }
  transport_capabilities capabilities() const { return m_self->capabilities(); }
  std::size_t dead_peers(std::span<received> out) { return m_self->dead_peers(out); }
  transport_counters counters() const { return m_self->counters(); }
  /// Whether every message peers sent us has been consumed. Transports that
  /// deliver in lockstep (or have no such handshake) are always drained.
  bool drained() { return m_self->drained(); }
  /// The peers this rank still waits for, each named by rank (and host where
  /// the transport knows it), for timeout messages; "" when the transport
  /// cannot say.
  std::string waiting_on() const { return m_self->waiting_on(); }
  /// The most messages any one source has delivered to this rank that wait
  /// for a free inbox slot (UCX's receive backlog); 0 for transports that
  /// have none. The engine merges until it is small again (engine::catch_up).
  std::size_t backlog() const noexcept { return m_self->backlog(); }
  /// The model_fingerprint a neighbour attached with, once attach() has
  /// returned; 0 when it told none or the transport does not exchange it.
  std::uint64_t peer_model(int rank) const { return m_self->peer_model(rank); }
  /// This rank is about to wait, or still waits, for its sources ([engine]
  /// max_lead; called at the start of a wait and each millisecond of it): a
  /// transport that held back a step beacon (steps shorter than it sends
  /// them) sends it now, so that ranks waiting on each other hear it, and
  /// may ask its sources for theirs.
  void waiting() noexcept { m_self->waiting(); }
  /// Before leave(), where the transport can: stops being written to and
  /// returns the messages left undelivered in this rank's inbox (at most
  /// out.size() per call; 0 when none are left), for the engine to merge, so
  /// that their push-sum mass leaves with this rank (loopback). 0 for the others.
  std::size_t leftovers(std::span<received> out) { return m_self->leftovers(out); }
  /// A codec's stream from `source` lost a message here (received::gap): a
  /// transport that can asks the source to make its next message to this
  /// rank full (UCX: its next post() here is refused once, which the engine
  /// answers with a full message), and says true; false when it cannot, and
  /// the engine then stops with the error that explains the gap.
  bool request_full(int source) { return m_self->request_full(source); }

 private:
  struct concept_t {
    virtual ~concept_t() = default;
    virtual void attach(const transport_setup&) = 0;
    virtual post_status post(int, std::span<const std::byte>, std::uint64_t) = 0;
    virtual std::size_t collect(std::uint64_t, std::span<received>) = 0;
    virtual void release(std::uint64_t) = 0;
    virtual void end_step(std::uint64_t) = 0;
    virtual bool busy(const std::byte*) const = 0;
    virtual void flush(std::chrono::duration<double>) = 0;
    virtual void leave() = 0;
    virtual void abandon() = 0;
    virtual transport_capabilities capabilities() const = 0;
    virtual std::size_t dead_peers(std::span<received>) = 0;
    virtual transport_counters counters() const = 0;
    virtual bool drained() = 0;
    virtual std::string waiting_on() const = 0;
    virtual std::size_t backlog() const noexcept = 0;
    virtual std::uint64_t peer_model(int) const = 0;
    virtual void waiting() noexcept = 0;
    virtual std::size_t leftovers(std::span<received>) = 0;
    virtual bool request_full(int) = 0;
  };
  template <class T>
  struct model final : concept_t {
    explicit model(T t) : m_t(std::move(t)) {}
    void attach(const transport_setup& s) override { m_t.attach(s); }
    post_status post(int p, std::span<const std::byte> m, std::uint64_t s) override { return m_t.post(p, m, s); }
    std::size_t collect(std::uint64_t s, std::span<received> o) override { return m_t.collect(s, o); }
    void release(std::uint64_t s) override { m_t.release(s); }
    void end_step(std::uint64_t s) override { m_t.end_step(s); }
    bool busy(const std::byte* b) const override { return m_t.busy(b); }
    void flush(std::chrono::duration<double> d) override { m_t.flush(d); }
    void leave() override { m_t.leave(); }
    void abandon() override {
      if constexpr (requires { m_t.abandon(); })
        m_t.abandon();
      else
        m_t.leave();
    }
    transport_capabilities capabilities() const override { return m_t.capabilities(); }
    std::size_t dead_peers(std::span<received> o) override { return static_cast<std::size_t>(m_t.dead_peers(o)); }
    transport_counters counters() const override { return m_t.counters(); }
    bool drained() override {
      if constexpr (requires { m_t.drained(); })
        return m_t.drained();
      else
        return true;
    }
    std::string waiting_on() const override {
      if constexpr (requires { m_t.waiting_on(); })
        return m_t.waiting_on();
      else
        return {};
    }
    std::size_t backlog() const noexcept override {
      if constexpr (requires { m_t.backlog(); })
        return m_t.backlog();
      else
        return 0;
    }
    std::uint64_t peer_model(int rank) const override {
      if constexpr (requires { m_t.peer_model(rank); })
        return m_t.peer_model(rank);
      else
        return 0;
    }
    void waiting() noexcept override {
      if constexpr (requires { m_t.waiting(); }) m_t.waiting();
    }
    std::size_t leftovers(std::span<received> o) override {
      if constexpr (requires { m_t.leftovers(o); })
        return m_t.leftovers(o);
      else
        return 0;
    }
    bool request_full(int source) override {
      if constexpr (requires { m_t.request_full(source); }) {
        m_t.request_full(source);
        return true;
      } else {
        return false;
      }
    }
    T m_t;
  };
  std::unique_ptr<concept_t> m_self;
};

}  // namespace gossip

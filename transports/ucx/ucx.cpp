#include "ucx.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gossip/wait.hpp"
#include "wire.hpp"

namespace gossip {

namespace {

constexpr unsigned am_id = 0x47;                  // "G"
constexpr unsigned bye_id = 0x48;                 // a rank leaving on purpose: header = its rank
constexpr std::uint32_t blob_magic = 0x58435547;  // "GUCX"
constexpr std::size_t max_buffers = 64;           // distinct send buffers tracked by busy()
constexpr std::size_t queue_capacity = 1024;

std::string status_text(ucs_status_t s) { return ucs_status_string(s); }

// Little serialiser for the rendezvous blob.
struct writer {
  bootstrap::blob b;
  template <class T>
  void pod(const T& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    b.insert(b.end(), p, p + sizeof v);
  }
  void bytes(const void* p, std::size_t n) {
    pod<std::uint64_t>(n);
    const auto* q = static_cast<const std::byte*>(p);
    b.insert(b.end(), q, q + n);
  }
};
struct reader {
  const bootstrap::blob& b;
  std::size_t at = 0;
  bool ok = true;
  template <class T>
  T pod() {
    T v{};
    if (at + sizeof v > b.size()) {
      ok = false;
      return v;
    }
    std::memcpy(&v, b.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  std::vector<std::byte> bytes() {
    const auto n = pod<std::uint64_t>();
    if (!ok || n > b.size() - at) {
      ok = false;
      return {};
    }
    std::vector<std::byte> v(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
    return v;
  }
};

struct peer_blob {
  int rank = -1, world = 0;
  std::uint64_t config_fp = 0, layout_fp = 0, message_bytes = 0;
  std::vector<int> sources, targets;
  model_layout layout;
  std::vector<std::byte> address;
  std::string host;
};

std::string host_name() {
  char h[256] = {};
  if (::gethostname(h, sizeof h - 1) != 0 || !h[0]) return "?";
  return h;
}

bootstrap::blob encode(const transport_setup& s, const void* address, std::size_t address_len, const std::string& host) {
  writer w;
  w.pod(blob_magic);
  w.pod<std::int32_t>(s.rank);
  w.pod<std::int32_t>(s.world);
  w.pod(s.config_fingerprint);
  w.pod(s.layout_fingerprint);
  w.pod<std::uint64_t>(s.message_bytes);
  w.bytes(s.sources.data(), s.sources.size() * sizeof(int));
  w.bytes(s.targets.data(), s.targets.size() * sizeof(int));
  w.pod<std::uint64_t>(s.layout.size());
  for (const auto& e : s.layout) {
    w.bytes(e.name.data(), e.name.size());
    w.pod<std::uint64_t>(e.count);
    w.pod(static_cast<std::uint8_t>(e.dtype));
  }
  w.bytes(address, address_len);
  w.bytes(host.data(), host.size());
  return std::move(w.b);
}

std::vector<int> ints(const std::vector<std::byte>& v) {
  std::vector<int> out(v.size() / sizeof(int));
  if (!out.empty()) std::memcpy(out.data(), v.data(), out.size() * sizeof(int));  // an empty list has no data()
  return out;
}

std::optional<peer_blob> decode(const bootstrap::blob& b) {
  reader r{b};
  peer_blob p;
  if (r.pod<std::uint32_t>() != blob_magic) return std::nullopt;
  p.rank = r.pod<std::int32_t>();
  p.world = r.pod<std::int32_t>();
  p.config_fp = r.pod<std::uint64_t>();
  p.layout_fp = r.pod<std::uint64_t>();
  p.message_bytes = r.pod<std::uint64_t>();
  p.sources = ints(r.bytes());
  p.targets = ints(r.bytes());
  const auto n = r.pod<std::uint64_t>();
  for (std::uint64_t i = 0; r.ok && i < n; ++i) {
    const auto name = r.bytes();
    layout_entry e;
    e.name.assign(reinterpret_cast<const char*>(name.data()), name.size());
    e.count = r.pod<std::uint64_t>();
    e.dtype = static_cast<gossip::dtype>(r.pod<std::uint8_t>());
    p.layout.push_back(std::move(e));
  }
  p.address = r.bytes();
  const auto host = r.bytes();
  p.host.assign(reinterpret_cast<const char*>(host.data()), host.size());
  if (!r.ok) return std::nullopt;
  return p;
}

// UCX 1.13 leaves peer error handling off on the shared-memory transports
// (UCX_POSIX_ERROR_HANDLING=n), so under UCP_ERR_HANDLING_MODE_PEER they
// drop out and posix,self finds no path ("Destination is unreachable").
// Turn it on for the transports UCX_TLS may select, unless the user chose.
void enable_shm_error_handling() {
  const char* tls_env = std::getenv("UCX_TLS");
  const std::string tls = tls_env ? tls_env : "all";
  const auto may_use = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (tls.find(n) != std::string::npos) return true;
    return false;
  };
  if (may_use({"all", "posix", "sm", "shm", "^"})) ::setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
  if (may_use({"all", "sysv", "sm", "shm", "^"})) ::setenv("UCX_SYSV_ERROR_HANDLING", "y", 0);
}

bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

}  // namespace

struct ucx_transport::impl {
  struct send_ctx {
    impl* owner = nullptr;
    int peer = -1;
    int entry = -1;
    std::size_t length = 0;  // one send per (peer, buffer) is in flight at a time
  };
  struct peer_state {
    int rank = -1;
    bool target = false;
    std::string name;       // "rank J (host H)", for messages; set by attach
    ucp_ep_h ep = nullptr;  // progress thread after attach
    std::atomic<bool> dead{false};
    // It said goodbye (left after its drain handshake): its endpoint closing
    // later is a departure, not a death, and is neither reported nor logged.
    std::atomic<bool> departed{false};
    std::atomic<int> why{UCS_OK};  // the error that marked it dead, when UCX gave one
    std::atomic<int> inflight{0};  // sends posted and not completed
    // Protocol weight stamped on sends to it that failed (written by the
    // progress thread before it decrements inflight; read once inflight is 0).
    std::atomic<double> failed_weight{0};
    bool reported = false;         // engine thread
    std::chrono::steady_clock::time_point dead_seen{};  // engine thread: when dead_peers() first saw it dead
    std::uint64_t posted = 0;      // engine thread: messages accepted by post()
    bool closing = false;          // progress thread
    std::array<send_ctx, max_buffers> ctx{};
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
    std::uint64_t expected = ~0ull;     // engine thread: what the source says it sent us, once known
    std::vector<pending> backlog;       // progress thread: ring of `backlog` entries
    std::size_t head = 0, count = 0;
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
  int worker_fd = -1, wake_fd = -1;
  std::thread thread;
  std::atomic<bool> stop{false};

  std::vector<std::unique_ptr<peer_state>> peers;  // by rank; null when not a neighbour
  std::vector<int> neighbours;
  std::vector<source_state> sources;
  std::vector<int> source_of;  // rank → index in sources, or -1
  std::array<buffer_entry, max_buffers> buffers{};

  std::array<send_op, queue_capacity> queue{};
  std::atomic<std::size_t> q_head{0}, q_tail{0};  // head: consumer, tail: producer

  std::atomic<std::uint64_t> bytes_sent{0}, messages_sent{0}, bytes_received{0}, messages_received{0}, dropped{0};
  // Per source: messages UCX delivered that never reached a slot (backlog overflow,
  // unkeepable eager data). Written by the progress thread, read by drained().
  std::unique_ptr<std::atomic<std::uint64_t>[]> discarded;
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

  void init_ucx() {
    // Shared-memory transports exclude themselves under peer error handling
    // unless told otherwise; the user's setting wins.
    enable_shm_error_handling();
    ucp_config_t* cfg = nullptr;
    if (auto s = ucp_config_read(nullptr, nullptr, &cfg); s != UCS_OK)
      throw transport_error(fmt::format("ucx (rank {}): cannot read the UCX configuration: {}", setup.rank, status_text(s)));
    if (!std::getenv("UCX_KEEPALIVE_INTERVAL")) {
      const auto v = fmt::format("{}s", opt.keepalive_s);
      ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", v.c_str());
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    ucs_status_t s = ucp_init(&params, cfg, &context);
    if (s != UCS_OK) {
      params.features = UCP_FEATURE_AM;  // no wakeup support: poll with short sleeps instead
      s = ucp_init(&params, cfg, &context);
    }
    ucp_config_release(cfg);
    if (s != UCS_OK) {
      context = nullptr;
      const char* tls = std::getenv("UCX_TLS");
      throw transport_error(fmt::format("ucx (rank {}): cannot create a UCX context: {} (UCX_TLS={}); check UCX_TLS and UCX_NET_DEVICES",
                                        setup.rank, status_text(s), tls ? tls : "<unset>"));
    }
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    if (s = ucp_worker_create(context, &wp, &worker); s != UCS_OK) {
      worker = nullptr;
      throw transport_error(fmt::format("ucx (rank {}): cannot create a UCX worker: {}", setup.rank, status_text(s)));
    }
    if (ucp_worker_get_efd(worker, &worker_fd) != UCS_OK) worker_fd = -1;
    wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd < 0) throw transport_error(fmt::format("ucx (rank {}): eventfd: {}", setup.rank, std::strerror(errno)));

    ucp_am_handler_param_t hp{};
    hp.field_mask =
        UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = am_id;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    hp.cb = &impl::on_am;
    hp.arg = this;
    if (s = ucp_worker_set_am_recv_handler(worker, &hp); s != UCS_OK)
      throw transport_error(fmt::format("ucx (rank {}): cannot register the active-message handler: {}", setup.rank, status_text(s)));
    hp.id = bye_id;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = &impl::on_bye;
    if (s = ucp_worker_set_am_recv_handler(worker, &hp); s != UCS_OK)
      throw transport_error(fmt::format("ucx (rank {}): cannot register the active-message handler: {}", setup.rank, status_text(s)));
  }

  void attach(const transport_setup& s) {
    GOSSIP_ASSERT(s.inbox != nullptr, "ucx: attach without an inbox");
    GOSSIP_ASSERT(!attached, "ucx (rank {}): attach called twice", s.rank);
    if (!boot) throw config_error(fmt::format("ucx (rank {}): no bootstrap was given", s.rank));
    if (boot->rank() != s.rank || boot->world() != s.world)
      throw config_error(
          fmt::format("ucx: the engine is rank {} of {} but the bootstrap says rank {} of {}; build the engine from "
                      "bootstrap.rank() and bootstrap.world()",
                      s.rank, s.world, boot->rank(), boot->world()));
    setup = s;
    attached = true;
    neighbours = s.sources;
    for (int t : s.targets)
      if (!contains(neighbours, t)) neighbours.push_back(t);
    std::sort(neighbours.begin(), neighbours.end());
    peers.resize(static_cast<std::size_t>(s.world));
    for (int j : neighbours) {
      auto p = std::make_unique<peer_state>();
      p->rank = j;
      p->target = contains(s.targets, j);
      p->owner = this;
      for (std::size_t e = 0; e < max_buffers; ++e) p->ctx[e] = {this, j, static_cast<int>(e)};
      peers[static_cast<std::size_t>(j)] = std::move(p);
    }
    source_of.assign(static_cast<std::size_t>(s.world), -1);
    const auto& in_sources = s.inbox->sources();
    sources.resize(in_sources.size());
    discarded = std::make_unique<std::atomic<std::uint64_t>[]>(in_sources.size());
    for (std::size_t i = 0; i < in_sources.size(); ++i) {
      auto& src = sources[i];
      src.rank = in_sources[i];
      src.index = i;
      src.backlog.resize(std::max<std::size_t>(opt.backlog, 1));
      src.recv.resize(s.inbox->depth());
      for (std::size_t k = 0; k < s.inbox->depth(); ++k) src.recv[k] = {this, &s.inbox->at(i, k), nullptr};
      source_of[static_cast<std::size_t>(src.rank)] = static_cast<int>(i);
    }

    init_ucx();

    ucp_address_t* addr = nullptr;
    std::size_t addr_len = 0;
    if (auto st = ucp_worker_get_address(worker, &addr, &addr_len); st != UCS_OK)
      throw transport_error(fmt::format("ucx (rank {}): cannot get the worker address: {}", s.rank, status_text(st)));
    const std::string host = host_name();
    self_name = fmt::format("rank {} (host {})", s.rank, host);
    const auto blob = encode(s, addr, addr_len, host);
    ucp_worker_release_address(worker, addr);

    const std::uint64_t gen = boot->next_generation();
    generation = gen;
    boot->put(fmt::format("gossip/ucx/{}/{}", gen, s.rank), blob);
    for (int j : neighbours) {
      const auto b = boot->get(fmt::format("gossip/ucx/{}/{}", gen, j),
                               fmt::format("rank {} to publish its UCX address (rank {} connecting)", j, s.rank), s.timeout);
      const auto pb = decode(b);
      if (!pb || pb->rank != j)
        throw transport_error(fmt::format("ucx (rank {}): the rendezvous entry of rank {} is not a libgossip UCX address; are all ranks "
                                          "built from the same libgossip version?",
                                          s.rank, j));
      auto& p = *peers[static_cast<std::size_t>(j)];
      p.name = fmt::format("rank {} (host {})", j, pb->host);
      if (pb->world != s.world)
        throw config_error(
            fmt::format("ucx: {} was started in a world of {} ranks but {} in a world of {}", self_name, s.world, p.name, pb->world));
      check_layouts(s.layout, s.rank, pb->layout, j);
      if (pb->config_fp != s.config_fingerprint)
        throw config_error(
            fmt::format("{} and {} were built from different gossip settings (fingerprints {:016x} vs {:016x}); "
                        "give every rank the same config file",
                        self_name, p.name, s.config_fingerprint, pb->config_fp));
      if (contains(s.targets, j) && !contains(pb->sources, s.rank))
        throw config_error(
            fmt::format("{} may send to {}, but rank {} does not expect messages from it; every rank must use the same topology",
                        self_name, p.name, j));
      GOSSIP_ASSERT(pb->message_bytes == s.message_bytes, "ucx: ranks {} and {} have equal layouts but message sizes {} and {}", s.rank, j,
                    s.message_bytes, pb->message_bytes);

      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(pb->address.data());
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &impl::on_ep_error;
      ep.err_handler.arg = &p;
      if (auto st = ucp_ep_create(worker, &ep, &p.ep); st != UCS_OK) {
        p.ep = nullptr;
        throw transport_error(
            fmt::format("ucx ({}): cannot reach {}: {}; check that UCX_TLS / UCX_NET_DEVICES offer a transport "
                        "both ranks share (with error handling: UCX_POSIX_ERROR_HANDLING=y for posix)",
                        self_name, p.name, status_text(st)));
      }
    }
    thread = std::thread([this] { run(); });
  }

  int find_buffer(const std::byte* ptr) noexcept {
    for (std::size_t i = 0; i < max_buffers; ++i)
      if (buffers[i].ptr == ptr) return static_cast<int>(i);
    for (std::size_t i = 0; i < max_buffers; ++i)
      if (buffers[i].inflight.load(std::memory_order_acquire) == 0) {
        buffers[i].ptr = ptr;
        return static_cast<int>(i);
      }
    return -1;
  }

  post_status post(int to, std::span<const std::byte> msg, std::uint64_t /*step*/) {
    peer_state* p = peer(to);
    GOSSIP_ASSERT(p && p->target, "ucx (rank {}): post to rank {}, which is not a target of this rank", setup.rank, to);
    GOSSIP_ASSERT(msg.size() >= sizeof(wire_header) && msg.size() <= setup.message_bytes,
                  "ucx (rank {}): message of {} bytes (slots hold {})", setup.rank, msg.size(), setup.message_bytes);
    if (p->dead.load(std::memory_order_acquire) || left) {
      dropped.fetch_add(1, std::memory_order_relaxed);
      return post_status::peer_dead;
    }
    const int e = find_buffer(msg.data());
    const std::size_t tail = q_tail.load(std::memory_order_relaxed);
    if (e < 0 || tail - q_head.load(std::memory_order_acquire) >= queue_capacity) return post_status::busy;
    buffers[static_cast<std::size_t>(e)].inflight.fetch_add(1, std::memory_order_acq_rel);
    p->inflight.fetch_add(1, std::memory_order_acq_rel);
    ++p->posted;
    queue[tail % queue_capacity] = {to, e, msg.data(), msg.size()};
    q_tail.store(tail + 1, std::memory_order_release);
    wake();
    return post_status::ok;
  }

  std::size_t collect(std::span<received> out) {
    std::size_t n = 0;
    const std::size_t depth = setup.inbox->depth();
    for (auto& src : sources) {
      while (src.taken < depth) {  // taken slots stay full until release()
        auto& slot = setup.inbox->at(src.index, src.read + src.taken);
        if (slot.state.load(std::memory_order_acquire) != inbox::full) break;
        if (slot.bytes > 0 && n == out.size()) break;
        ++src.consumed;
        if (slot.bytes > 0) {
          wire_header h;
          std::memcpy(&h, slot.data, sizeof h);
          out[n++] = received{h.sender, h.step, h.weight, reinterpret_cast<const float*>(slot.data + sizeof(wire_header)),
                              h.payload_bytes / sizeof(float)};
        }
        ++src.taken;
      }
    }
    return n;
  }

  void release() {
    bool freed = false;
    for (auto& src : sources)
      for (; src.taken > 0; --src.taken, ++src.read) {
        setup.inbox->at(src.index, src.read).state.store(inbox::empty, std::memory_order_release);
        freed = true;
      }
    if (freed) wake();  // the progress thread may hold messages for these slots
  }

  // Drain handshake: publish how many messages we posted to each rank, then
  // report true once every live source's count has been consumed (or lost
  // inside UCX). The engine keeps merging while it waits, so nothing a peer
  // sent before it left is stranded in a slot or a held rendezvous.
  bool drained() {
    finishing = true;
    if (rendezvous_gone) return true;
    try {
      return drained_through_rendezvous();
    } catch (const error& e) {
      // Rank 0 is gone: no peer can publish or read drain counts any more.
      // Leave with what has been merged; messages still on their way are lost.
      rendezvous_gone = true;
      std::fprintf(stderr, "libgossip ucx (%s): leaving without the drain handshake, messages still in flight to this rank are lost: %s\n",
                   self_name.c_str(), e.what());
      return true;
    }
  }

  bool drained_through_rendezvous() {
    if (!drain_published) {
      bootstrap::blob b(static_cast<std::size_t>(setup.world) * sizeof(std::uint64_t));
      for (int j : neighbours)
        if (const peer_state* p = peer(j); p && p->target) {
          const std::uint64_t n = p->posted;
          std::memcpy(b.data() + static_cast<std::size_t>(j) * sizeof n, &n, sizeof n);
        }
      boot->put(fmt::format("gossip/ucx/{}/drain/{}", generation, setup.rank), b);
      drain_published = true;
    }
    for (std::size_t i = 0; i < sources.size(); ++i) {
      auto& src = sources[i];
      const peer_state* p = peer(src.rank);
      if (p && p->dead.load(std::memory_order_acquire)) continue;
      if (src.expected == ~0ull) {
        const auto b = boot->try_get(fmt::format("gossip/ucx/{}/drain/{}", generation, src.rank));
        if (!b) return false;
        if (b->size() != static_cast<std::size_t>(setup.world) * sizeof(std::uint64_t))
          throw transport_error(fmt::format("ucx ({}): {}'s drain record has {} bytes, expected {}", self_name, p->name, b->size(),
                                            static_cast<std::size_t>(setup.world) * sizeof(std::uint64_t)));
        std::memcpy(&src.expected, b->data() + static_cast<std::size_t>(setup.rank) * sizeof src.expected, sizeof src.expected);
      }
      if (src.consumed + discarded[i].load(std::memory_order_acquire) < src.expected) return false;
    }
    return true;
  }

  std::string outstanding() const {
    std::string who;
    for (int j : neighbours)
      if (const int k = peer(j)->inflight.load(); k > 0)
        who += fmt::format("{}{}: {} send{}", who.empty() ? "" : ", ", peer(j)->name, k, k == 1 ? "" : "s");
    return who.empty() ? "the progress thread to pick up queued sends" : who;
  }

  // What this rank still waits for, naming each peer and its host.
  std::string waiting_on() const {
    std::string who;
    for (int j : neighbours)
      if (const int k = peer(j)->inflight.load(); k > 0)
        who += fmt::format("{}{}: {} send{} in flight", who.empty() ? "" : "; ", peer(j)->name, k, k == 1 ? "" : "s");
    for (std::size_t i = 0; i < sources.size(); ++i) {
      const auto& src = sources[i];
      const peer_state* p = peer(src.rank);
      if (!drain_published || (p && p->dead.load())) continue;
      if (src.expected == ~0ull)
        who += fmt::format("{}{}: has not said how many messages it sent (it has not reached finish(), or it hangs)",
                           who.empty() ? "" : "; ", p->name);
      else if (const auto got = src.consumed + discarded[i].load(); got < src.expected)
        who += fmt::format("{}{}: {} of {} messages received", who.empty() ? "" : "; ", p->name, got, src.expected);
    }
    return who.empty() ? "no peer" : who;
  }

  void flush(std::chrono::duration<double> timeout) {
    if (!attached || left) return;
    detail::wait_for(
        [&] {
          for (int j : neighbours)
            if (peer(j)->inflight.load(std::memory_order_acquire) > 0) return false;
          return true;
        },
        timeout, [&] { return fmt::format("rank {}'s sends to complete: to {}", setup.rank, outstanding()); });
  }

  void leave() {
    if (!attached || left) return;
    try {
      flush(std::min<std::chrono::duration<double>>(setup.timeout, std::chrono::duration<double>(opt.close_timeout_s)));
    } catch (const timeout_error&) {
      // leaving anyway: what is still in flight is lost, and counted in teardown
    }
    left = true;
    teardown_now();
  }

  // Stops the thread (it closes the endpoints and the worker) or, when it
  // never started, does the same here.
  void teardown_now() noexcept {
    left = true;
    if (thread.joinable()) {
      stop.store(true, std::memory_order_release);
      wake();
      thread.join();
    } else if (worker) {
      shutdown_ucx();
    }
    if (context) {
      ucp_cleanup(context);
      context = nullptr;
    }
    if (wake_fd >= 0) {
      ::close(wake_fd);
      wake_fd = -1;
    }
  }

  // A dead peer is reported once its sends have all completed (UCX fails them
  // when the endpoint closes), so that the weight of the ones that never
  // arrived is known: received::weight carries it, for the engine to take
  // back. After 2 s it is reported regardless, with what has failed so far.
  std::size_t dead_peers(std::span<received> out) {
    std::size_t n = 0;
    const auto now = std::chrono::steady_clock::now();
    for (int j : neighbours) {
      auto& p = *peer(j);
      if (p.reported || !p.dead.load(std::memory_order_acquire)) continue;
      if (p.dead_seen == std::chrono::steady_clock::time_point{}) p.dead_seen = now;
      if (p.inflight.load(std::memory_order_acquire) > 0 && now - p.dead_seen < std::chrono::seconds(2)) continue;
      if (n == out.size()) break;
      p.reported = true;
      out[n++] = received{.sender = j, .weight = p.failed_weight.load(std::memory_order_relaxed), .departed = p.departed.load(std::memory_order_acquire)};
    }
    return n;
  }

  // ---- progress thread (and UCX callbacks, which run inside it) -----------

  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* p = static_cast<peer_state*>(arg);
    int expected = UCS_OK;
    p->why.compare_exchange_strong(expected, static_cast<int>(status), std::memory_order_relaxed);
    p->dead.store(true, std::memory_order_release);
  }

  static void on_send_done(void* request, ucs_status_t status, void* user) {
    auto* c = static_cast<send_ctx*>(user);
    c->owner->send_done(c->peer, c->entry, status, c->length);
    ucp_request_free(request);
  }

  void send_done(int to, int entry, ucs_status_t status, std::size_t length) noexcept {
    if (status == UCS_OK) {
      messages_sent.fetch_add(1, std::memory_order_relaxed);
      bytes_sent.fetch_add(length, std::memory_order_relaxed);
    } else {
      dropped.fetch_add(1, std::memory_order_relaxed);
      if (peer_state* p = peer(to)) {
        // The buffer stays untouched until inflight drops below: its header
        // says what share of push-sum mass never arrived.
        wire_header h;
        std::memcpy(&h, buffers[static_cast<std::size_t>(entry)].ptr, sizeof h);
        p->failed_weight.store(p->failed_weight.load(std::memory_order_relaxed) + h.weight, std::memory_order_relaxed);
        if (status != UCS_ERR_CANCELED) {
          int expected = UCS_OK;
          p->why.compare_exchange_strong(expected, static_cast<int>(status), std::memory_order_relaxed);
          p->dead.store(true, std::memory_order_release);
        }
      }
    }
    buffers[static_cast<std::size_t>(entry)].inflight.fetch_sub(1, std::memory_order_acq_rel);
    if (peer_state* p = peer(to)) p->inflight.fetch_sub(1, std::memory_order_acq_rel);
  }

  bool drain_sends() noexcept {
    bool any = false;
    for (;;) {
      const std::size_t head = q_head.load(std::memory_order_relaxed);
      if (head == q_tail.load(std::memory_order_acquire)) return any;
      const send_op op = queue[head % queue_capacity];
      q_head.store(head + 1, std::memory_order_release);
      any = true;
      peer_state* pp = peer(op.peer);
      if (!pp) continue;  // post() only queues targets
      auto& p = *pp;
      if (p.dead.load(std::memory_order_acquire) || !p.ep) {
        send_done(op.peer, op.entry, UCS_ERR_CANCELED, op.length);
        continue;
      }
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.send = &impl::on_send_done;
      auto& ctx = p.ctx[static_cast<std::size_t>(op.entry)];
      ctx.length = op.length;
      rp.user_data = &ctx;
      ucs_status_ptr_t r =
          ucp_am_send_nbx(p.ep, am_id, op.data, sizeof(wire_header), op.data + sizeof(wire_header), op.length - sizeof(wire_header), &rp);
      if (r == nullptr)
        send_done(op.peer, op.entry, UCS_OK, op.length);
      else if (UCS_PTR_IS_ERR(r))
        send_done(op.peer, op.entry, UCS_PTR_STATUS(r), op.length);
    }
  }

  static ucs_status_t on_bye(void* arg, const void* header, std::size_t header_length, void*, std::size_t, const ucp_am_recv_param_t*) {
    auto* self = static_cast<impl*>(arg);
    std::int32_t from = -1;
    if (header_length == sizeof from) std::memcpy(&from, header, sizeof from);
    if (peer_state* p = self->peer(from)) p->departed.store(true, std::memory_order_release);
    return UCS_OK;
  }

  static ucs_status_t on_am(void* arg, const void* header, std::size_t header_length, void* data, std::size_t length,
                            const ucp_am_recv_param_t* param) {
    return static_cast<impl*>(arg)->arrived(header, header_length, data, length, param->recv_attr);
  }

  ucs_status_t arrived(const void* header, std::size_t header_length, void* data, std::size_t length, std::uint64_t attr) noexcept {
    const bool rndv = attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
    const bool persistent = attr & UCP_AM_RECV_ATTR_FLAG_DATA;
    wire_header h;
    const int si = detail::accept_message(header, header_length, length, source_of, setup.message_bytes, setup.layout_fingerprint, h);
    if (si < 0) {
      dropped.fetch_add(1, std::memory_order_relaxed);  // foreign or corrupt: never trust a length from the wire
      return UCS_OK;
    }
    auto& src = sources[static_cast<std::size_t>(si)];
    if (src.count == 0 && !rndv && slot_free(src)) {
      land(src, pending{h, data, length, false}, false);
      return UCS_OK;
    }
    if (!rndv && !persistent) {  // UCX will reuse the buffer: cannot keep it
      dropped.fetch_add(1, std::memory_order_relaxed);
      discarded[static_cast<std::size_t>(si)].fetch_add(1, std::memory_order_release);
      return UCS_OK;
    }
    if (src.count == src.backlog.size()) {  // keep the newest
      auto& old = src.backlog[src.head];
      ucp_am_data_release(worker, old.data);
      src.head = (src.head + 1) % src.backlog.size();
      --src.count;
      dropped.fetch_add(1, std::memory_order_relaxed);
      discarded[static_cast<std::size_t>(si)].fetch_add(1, std::memory_order_release);
    }
    src.backlog[(src.head + src.count) % src.backlog.size()] = pending{h, data, length, rndv};
    ++src.count;
    return UCS_INPROGRESS;
  }

  bool slot_free(const source_state& src) const noexcept {
    return setup.inbox->at(src.index, src.write).state.load(std::memory_order_acquire) == inbox::empty;
  }

  // Fills the next slot of `src` with `m`. `owned`: m.data must be released to UCX after the copy.
  void land(source_state& src, const pending& m, bool owned) noexcept {
    auto& rc = src.recv[src.write % src.recv.size()];
    auto& slot = *rc.slot;
    slot.state.store(inbox::writing, std::memory_order_relaxed);
    std::memcpy(slot.data, &m.h, sizeof m.h);
    slot.bytes = sizeof m.h + m.length;
    ++src.write;
    if (!m.rndv) {
      std::memcpy(slot.data + sizeof m.h, m.data, m.length);
      if (owned) ucp_am_data_release(worker, m.data);
      landed(slot, m.length);
      return;
    }
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &impl::on_recv_done;
    rp.user_data = &rc;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker, m.data, slot.data + sizeof m.h, m.length, &rp);
    if (r == nullptr) {
      landed(slot, m.length);
    } else if (UCS_PTR_IS_ERR(r)) {
      failed(slot);
    } else {
      rc.request = r;
    }
  }

  void landed(inbox::slot& slot, std::size_t length) noexcept {
    bytes_received.fetch_add(sizeof(wire_header) + length, std::memory_order_relaxed);
    messages_received.fetch_add(1, std::memory_order_relaxed);
    slot.state.store(inbox::full, std::memory_order_release);
  }

  // A slot whose receive failed: full but empty, so collect skips it and keeps the order.
  void failed(inbox::slot& slot) noexcept {
    dropped.fetch_add(1, std::memory_order_relaxed);
    slot.bytes = 0;
    slot.state.store(inbox::full, std::memory_order_release);
  }

  static void on_recv_done(void* request, ucs_status_t status, std::size_t length, void* user) {
    auto* rc = static_cast<recv_ctx*>(user);
    rc->request = nullptr;
    if (status == UCS_OK)
      rc->owner->landed(*rc->slot, length);
    else
      rc->owner->failed(*rc->slot);
    ucp_request_free(request);
  }

  bool land_backlog() noexcept {
    bool any = false;
    for (auto& src : sources)
      while (src.count > 0 && slot_free(src)) {
        const pending m = src.backlog[src.head];
        src.head = (src.head + 1) % src.backlog.size();
        --src.count;
        land(src, m, true);
        any = true;
      }
    return any;
  }

  void close_dead() noexcept {
    for (int j : neighbours) {
      auto& p = *peer(j);
      if (p.ep && !p.closing && p.dead.load(std::memory_order_acquire)) {
        p.closing = true;
        // Once per peer, outside the step path: who failed, where, and what happens now.
        if (!p.departed.load(std::memory_order_acquire))
          std::fprintf(stderr,
                     "libgossip ucx (%s): peer %s failed (%s); it is removed from this rank's topology and training goes on "
                     "without it\n",
                     self_name.c_str(), p.name.c_str(), p.why.load(std::memory_order_relaxed) == UCS_OK ? "declared dead" : status_text(static_cast<ucs_status_t>(p.why.load(std::memory_order_relaxed))).c_str());
        ucp_request_param_t rp{};
        rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
        ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &rp);
        if (r && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);  // completes inside UCX
        p.ep = nullptr;
      }
    }
  }

  bool transfer_under_way() const noexcept {
    for (const auto& b : buffers)
      if (b.inflight.load(std::memory_order_relaxed) > 0) return true;
    for (const auto& src : sources) {
      if (src.count > 0) return true;
      for (const auto& rc : src.recv)
        if (rc.request) return true;
    }
    return false;
  }

  void run() noexcept {
    using clock = std::chrono::steady_clock;
    pollfd fds[2] = {{wake_fd, POLLIN, 0}, {worker_fd, POLLIN, 0}};
    const nfds_t nfds = worker_fd >= 0 ? 2 : 1;
    // Not for very large messages: two 16 MiB+ transfers in flight already
    // saturate memory, and polling then only steals the training's core.
    const double spin_us = setup.message_bytes >= (std::size_t{16} << 20) ? 0.0 : opt.spin_us;
    const auto spin = std::chrono::duration_cast<clock::duration>(std::chrono::duration<double, std::micro>(spin_us));
    auto last_work = clock::now();
    while (!stop.load(std::memory_order_acquire)) {
      bool work = drain_sends();
      work = land_backlog() || work;
      close_dead();
      while (ucp_worker_progress(worker) != 0) work = true;
      if (work) {
        last_work = clock::now();
        continue;
      }
      // Mid-transfer, poll instead of sleeping: each rendezvous step (RTS, RTR,
      // data, ATS) and each freed slot would otherwise cost a sleep and a
      // wake-up — tens of µs on a busy core, per message.
      if (spin.count() > 0 && clock::now() - last_work < spin && transfer_under_way()) {
        std::this_thread::yield();
        continue;
      }
      if (worker_fd >= 0) {
        const ucs_status_t s = ucp_worker_arm(worker);
        if (s == UCS_ERR_BUSY) continue;
      }
      if (q_head.load(std::memory_order_acquire) != q_tail.load(std::memory_order_acquire)) continue;
      // While a transfer is under way, wake often so that a missed wake-up
      // costs 50 µs rather than 10 ms. Idle, sleep long (keepalive still runs).
      const timespec busy_wait{0, 50'000};
      const timespec idle_wait{0, worker_fd >= 0 ? 10'000'000 : 1'000'000};
      ::ppoll(fds, nfds, transfer_under_way() ? &busy_wait : &idle_wait, nullptr);
      if (fds[0].revents & POLLIN) {
        std::uint64_t v;
        [[maybe_unused]] auto n = ::read(wake_fd, &v, sizeof v);
      }
    }
    shutdown_ucx();
  }

  // Cancels what is queued, returns held messages to UCX, closes endpoints
  // (gracefully, bounded by close_timeout_s) and destroys the worker.
  void shutdown_ucx() noexcept {
    if (!worker) return;
    drain_sends();  // sends queued after the last flush: dropped
    for (auto& src : sources) {
      for (; src.count > 0; --src.count, src.head = (src.head + 1) % src.backlog.size()) {
        ucp_am_data_release(worker, src.backlog[src.head].data);
        dropped.fetch_add(1, std::memory_order_relaxed);
      }
      for (auto& rc : src.recv)
        if (rc.request) ucp_request_cancel(worker, rc.request);
    }
    std::vector<void*> closing;
    // Goodbye first, on the same endpoints: the graceful close below flushes
    // it, and the peers then know this rank left rather than died. Only after
    // the drain handshake (engine::finish): a rank torn down by an error is
    // seen as failed.
    const std::int32_t me = setup.rank;
    for (int j : neighbours) {
      auto& p = *peer(j);
      if (!finishing || !p.ep || p.dead.load()) continue;
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_AM_SEND_FLAG_EAGER;
      ucs_status_ptr_t r = ucp_am_send_nbx(p.ep, bye_id, &me, sizeof me, nullptr, 0, &rp);
      if (r && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
    }
    for (int j : neighbours) {
      auto& p = *peer(j);
      if (!p.ep) continue;
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = p.dead.load() ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &rp);
      if (r && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
      p.ep = nullptr;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                                 std::chrono::duration<double>(opt.close_timeout_s));
    auto busy_recv = [&] {
      for (auto& src : sources)
        for (auto& rc : src.recv)
          if (rc.request) return true;
      return false;
    };
    while (std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker);
      closing.erase(std::remove_if(closing.begin(), closing.end(),
                                   [](void* r) {
                                     if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
                                     ucp_request_free(r);
                                     return true;
                                   }),
                    closing.end());
      if (closing.empty() && !busy_recv()) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    // Past the bound (a peer that stopped reading, e.g. SIGSTOP): the close
    // requests still in progress are released to UCX, which completes them
    // when the worker is destroyed; a request still held by us there is a
    // fatal assertion in UCX (ucp_ep.c: UCP_REQUEST_FLAG_RELEASED).
    for (void* r : closing) ucp_request_free(r);
    closing.clear();
    ucp_worker_destroy(worker);
    worker = nullptr;
  }
};

ucx_transport::ucx_transport(std::shared_ptr<gossip::bootstrap> boot, ucx_options options) : m(std::make_unique<impl>()) {
  m->boot = std::move(boot);
  m->opt = options;
}
ucx_transport::ucx_transport(ucx_transport&&) noexcept = default;
ucx_transport& ucx_transport::operator=(ucx_transport&&) noexcept = default;
ucx_transport::~ucx_transport() = default;

void ucx_transport::attach(const transport_setup& setup) { m->attach(setup); }
post_status ucx_transport::post(int peer, std::span<const std::byte> msg, std::uint64_t step) { return m->post(peer, msg, step); }
std::size_t ucx_transport::collect(std::uint64_t, std::span<received> out) { return m->collect(out); }
void ucx_transport::release(std::uint64_t) { m->release(); }
void ucx_transport::end_step(std::uint64_t) noexcept {}
bool ucx_transport::busy(const std::byte* buffer) const noexcept {
  for (const auto& b : m->buffers)
    if (b.ptr == buffer) return b.inflight.load(std::memory_order_acquire) > 0;
  return false;
}
void ucx_transport::flush(std::chrono::duration<double> timeout) { m->flush(timeout); }
void ucx_transport::leave() { m->leave(); }
transport_capabilities ucx_transport::capabilities() const noexcept {
  return {.deterministic = false, .copies_on_post = false, .emulates_network = false, .name = "ucx"};
}
bool ucx_transport::drained() { return m->drained(); }
std::string ucx_transport::waiting_on() const { return m->attached ? m->waiting_on() : std::string("no peer (not attached)"); }
std::size_t ucx_transport::dead_peers(std::span<received> out) { return m->dead_peers(out); }
std::size_t ucx_transport::held_bytes_per_peer() const noexcept {
  if (!m->attached || m->neighbours.empty()) return 0;
  std::size_t total = m->neighbours.size() * sizeof(impl::peer_state);
  for (const auto& src : m->sources)
    total += sizeof src + src.backlog.capacity() * sizeof(impl::pending) + src.recv.capacity() * sizeof(impl::recv_ctx);
  return total / m->neighbours.size();
}
transport_counters ucx_transport::counters() const noexcept {
  return {m->bytes_sent.load(), m->messages_sent.load(), m->bytes_received.load(), m->messages_received.load(), m->dropped.load()};
}

std::string ucx_transport::describe() const {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  const char* tls = std::getenv("UCX_TLS");
  const char* dev = std::getenv("UCX_NET_DEVICES");
  return fmt::format("UCX {}.{}.{} active messages, UCX_TLS={}, UCX_NET_DEVICES={}", major, minor, release, tls ? tls : "all",
                     dev ? dev : "all");
}

std::string ucx_transport::probe() {
  enable_shm_error_handling();
  ucp_config_t* cfg = nullptr;
  if (auto s = ucp_config_read(nullptr, nullptr, &cfg); s != UCS_OK) return fmt::format("ucp_config_read: {}", status_text(s));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM;
  ucp_context_h ctx = nullptr;
  const ucs_status_t s = ucp_init(&params, cfg, &ctx);
  ucp_config_release(cfg);
  if (s != UCS_OK) return fmt::format("ucp_init: {}", status_text(s));
  ucp_worker_params_t wp{};
  ucp_worker_h w = nullptr;
  const ucs_status_t ws = ucp_worker_create(ctx, &wp, &w);
  if (ws == UCS_OK) ucp_worker_destroy(w);
  ucp_cleanup(ctx);
  return ws == UCS_OK ? std::string() : fmt::format("ucp_worker_create: {}", status_text(ws));
}

}  // namespace gossip

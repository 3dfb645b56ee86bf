// The UCX transport's interface (ucx.hpp) and the engine thread's data path:
// post() queues a send for the progress thread, collect() and release() hand
// the inbox's landed messages to the engine. impl.hpp says where the rest is.
#include "ucx.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>

#include "impl.hpp"

namespace gossip {

using namespace ucx_detail;

int ucx_transport::impl::find_buffer(const std::byte* ptr) noexcept {
  for (std::size_t i = 0; i < max_buffers; ++i)
    if (buffers[i].ptr == ptr) return static_cast<int>(i);
  for (std::size_t i = 0; i < max_buffers; ++i)
    if (buffers[i].inflight.load(std::memory_order_acquire) == 0) {
      buffers[i].ptr = ptr;
      return static_cast<int>(i);
    }
  return -1;
}

post_status ucx_transport::impl::post(int to, std::span<const std::byte> msg, std::uint64_t /*step*/) {
  peer_state* p = peer(to);
  GOSSIP_ASSERT(p && p->target, "ucx (rank {}): post to rank {}, which is not a target of this rank", setup.rank, to);
  GOSSIP_ASSERT(msg.size() >= sizeof(wire_header) && msg.size() <= setup.message_bytes,
                "ucx (rank {}): message of {} bytes (slots hold {})", setup.rank, msg.size(), setup.message_bytes);
  if (p->dead.load(std::memory_order_acquire) || left) {
    dropped.fetch_add(1, std::memory_order_relaxed);
    return post_status::peer_dead;
  }
  // Its codec stream from this rank lost a message: refused once, so the
  // engine's next message to it is full (and this one's share stays here).
  if (p->full_wanted.load(std::memory_order_relaxed) && p->full_wanted.exchange(false, std::memory_order_acq_rel)) return post_status::busy;
  const int e = find_buffer(msg.data());
  const std::size_t tail = q_tail.load(std::memory_order_relaxed);
  if (e < 0 || tail - q_head.load(std::memory_order_acquire) >= queue_capacity) return post_status::busy;
  buffers[static_cast<std::size_t>(e)].inflight.fetch_add(1, std::memory_order_acq_rel);
  p->inflight.fetch_add(1, std::memory_order_acq_rel);
  ++p->posted;
  double weight;
  std::memcpy(&weight, msg.data() + offsetof(wire_header, weight), sizeof weight);
  if (std::isfinite(weight)) p->weight_posted += weight;
  queue[tail % queue_capacity] = {to, e, msg.data(), msg.size()};
  q_tail.store(tail + 1, std::memory_order_release);
  // Started here when the progress thread is elsewhere; it carries the
  // transfer on, woken if it sleeps long.
  if (!help() || idle.load(std::memory_order_acquire)) wake();
  return post_status::ok;
}

bool ucx_transport::impl::help() noexcept {
  if (!running || driver.exchange(true, std::memory_order_acquire)) return false;
  drain_sends();
  land_backlog();
  // A bounded number of passes: while a transfer streams (tcp at a slow
  // link's pace), every pass finds a little to do, and the caller's step
  // must not wait for the transfer; the progress thread carries it on.
  for (int pass = 0; pass < 8 && ucp_worker_progress(worker) != 0; ++pass) {
  }
  driver.store(false, std::memory_order_release);
  return true;
}

std::size_t ucx_transport::impl::collect(std::span<received> out) {
  // Lands what has arrived, unless the progress thread sleeps idle: then
  // nothing is under way, and a skipped step costs no call into UCX.
  if (!idle.load(std::memory_order_relaxed)) help();
  std::size_t n = 0;
  const std::size_t depth = setup.inbox->depth();
  for (std::size_t si = 0; si < sources.size(); ++si) {
    auto& src = sources[si];
    while (src.taken < depth) {  // taken slots stay full until release()
      auto& slot = setup.inbox->at(src.index, src.read + src.taken);
      if (slot.state.load(std::memory_order_acquire) != inbox::full) break;
      if (slot.bytes > 0 && n == out.size() && !src.sealed) break;
      ++src.consumed;
      if (slot.bytes > 0 && !src.sealed) {  // a sealed source's record says what was taken from it: no more
        wire_header h;
        std::memcpy(&h, slot.data, sizeof h);
        out[n] = received{h.sender, h.step, h.weight, reinterpret_cast<const float*>(slot.data + sizeof(wire_header)),
                          h.payload_bytes / sizeof(float)};
        if (const auto d = discarded[si].load(std::memory_order_acquire); d != src.gaps_told) {
          out[n].gap = true;
          out[n].weight += discarded_weight[si].exchange(0.0, std::memory_order_relaxed);  // the dropped shares ride with this one
          src.gaps_told = d;
        }
        if (std::isfinite(out[n].weight)) src.weight_taken += out[n].weight;
        ++n;
      }
      ++src.taken;
    }
  }
  return n;
}

void ucx_transport::impl::release() {
  bool freed = false;
  for (auto& src : sources)
    for (; src.taken > 0; --src.taken, ++src.read) {
      setup.inbox->at(src.index, src.read).state.store(inbox::empty, std::memory_order_release);
      freed = true;
    }
  // Messages held for these slots land now, or the progress thread lands them.
  if (freed && (!help() || idle.load(std::memory_order_acquire))) wake();
}

ucx_transport::ucx_transport(std::shared_ptr<gossip::bootstrap> boot, ucx_options options) : m(std::make_unique<impl>()) {
  if (!(options.beacon_interval_ms >= 0 && options.beacon_interval_ms <= 60'000))
    throw config_error(fmt::format("ucx: ucx_options::beacon_interval_ms = {} is out of range; give 0 (a beacon every max_lead/2 steps) to 60000",
                                   options.beacon_interval_ms));
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
void ucx_transport::request_full(int source) noexcept {
  if (m->attached && !m->left) m->request_full(source);
}
void ucx_transport::end_step(std::uint64_t step) noexcept { m->end_step(step); }

void ucx_transport::impl::end_step(std::uint64_t step) noexcept {
  if (setup.step_beacon == 0 || left || step < next_beacon) return;
  // A held step that the progress thread told when it fell due counts as
  // published: the next beacon is due a stride and an interval after it, not
  // at once (which would also tell the targets `late` = 0 mid-interval).
  if (const std::uint64_t t = told_step.load(std::memory_order_acquire); t > beacon_step.load(std::memory_order_relaxed) && t != ~std::uint64_t{0}) {
    beacon_step.store(t, std::memory_order_relaxed);
    next_beacon = t + setup.step_beacon;
    next_beacon_time =
        std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(told_at.load(std::memory_order_relaxed))) + beacon_interval();
    if (step < next_beacon) return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (now < next_beacon_time) {
    // Held back without a wake-up: the progress thread sends it once the
    // interval is over (should this rank stop stepping), waiting() at once.
    held_due.store(next_beacon_time.time_since_epoch().count(), std::memory_order_relaxed);
    held_step.store(step, std::memory_order_release);
    return;
  }
  publish_step(step, now);
}

void ucx_transport::waiting() noexcept { m->waiting(); }

void ucx_transport::impl::waiting() noexcept {
  if (setup.step_beacon == 0 || left) return;
  // The sources it waits on may hold their newest step for up to an
  // interval: ask them for it (the engine calls this again each millisecond
  // that it goes on waiting).
  want_beacons.store(true, std::memory_order_release);
  if (const std::uint64_t held = held_step.load(std::memory_order_relaxed); held > beacon_step.load(std::memory_order_relaxed))
    publish_step(held, std::chrono::steady_clock::now());
  else
    wake();
}

void ucx_transport::impl::publish_step(std::uint64_t step, std::chrono::steady_clock::time_point now) noexcept {
  next_beacon_time = now + beacon_interval();
  next_beacon = step + setup.step_beacon;
  beacon_step.store(step, std::memory_order_release);
  wake();
}
bool ucx_transport::busy(const std::byte* buffer) const noexcept {
  for (const auto& b : m->buffers)
    if (b.ptr == buffer) {
      if (b.inflight.load(std::memory_order_acquire) == 0) return false;
      m->help();
      return b.inflight.load(std::memory_order_acquire) > 0;
    }
  return false;
}
void ucx_transport::flush(std::chrono::duration<double> timeout) { m->flush(timeout); }
void ucx_transport::leave() { m->leave(); }
transport_capabilities ucx_transport::capabilities() const noexcept {
  return {.deterministic = false, .copies_on_post = false, .emulates_network = false, .step_beacons = true, .name = "ucx"};
}
bool ucx_transport::drained() { return m->drained(); }
std::size_t ucx_transport::backlog() const noexcept {
  if (!m->attached) return 0;
  std::size_t most = 0;
  for (std::size_t i = 0; i < m->sources.size(); ++i) most = std::max<std::size_t>(most, m->backlogged[i].load(std::memory_order_relaxed));
  return most;
}
std::string ucx_transport::waiting_on() const { return m->attached ? m->waiting_on() : std::string("no peer (not attached)"); }
std::uint64_t ucx_transport::peer_model(int rank) const noexcept {
  const auto* p = m && m->attached ? m->peer(rank) : nullptr;
  return p ? p->model_fp : 0;
}
std::size_t ucx_transport::dead_peers(std::span<received> out) { return m->dead_peers(out); }
std::size_t ucx_transport::held_bytes_per_peer() const noexcept {
  if (!m->attached || m->neighbours.empty()) return 0;
  std::size_t total = m->neighbours.size() * sizeof(impl::peer_state);
  for (const auto& src : m->sources)
    total += sizeof src + src.backlog.capacity() * sizeof(impl::pending) + src.recv.capacity() * sizeof(impl::recv_ctx);
  return total / m->neighbours.size();
}
transport_counters ucx_transport::counters() const noexcept {
  return {m->bytes_sent.load(), m->messages_sent.load(), m->bytes_received.load(), m->messages_received.load(), m->dropped.load(), 0,
          m->beacons_sent.load(), m->heard_step.load(std::memory_order_acquire)};
}

bool ucx_transport::listening() const noexcept { return m->listen_len > 0; }

std::string ucx_transport::describe() const {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  const auto tls = ucx_detail::user_tls();
  const char* dev = std::getenv("UCX_NET_DEVICES");
  return fmt::format("UCX {}.{}.{} active messages, UCX_TLS={}{}, UCX_NET_DEVICES={}", major, minor, release, ucx_detail::effective_tls(tls),
                     tls ? "" : " (unset: all but sysv)", dev ? dev : "all");
}

std::string ucx_transport::probe() {
  ucp_config_t* cfg = nullptr;
  try {
    cfg = read_config("ucx", user_tls());
  } catch (const transport_error& e) {
    return e.what();
  }
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

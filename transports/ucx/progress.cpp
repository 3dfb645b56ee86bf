// The UCX transport's progress thread: it posts the engine's queued sends,
// completes them, lands arriving messages in the inbox (straight away, or
// from a backlog while every slot of their source is full), notes goodbyes
// and endpoint errors, and sleeps on the worker's event fd when idle.
#include <fmt/format.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include "impl.hpp"

namespace gossip {

using namespace ucx_detail;

void ucx_transport::impl::on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* p = static_cast<peer_state*>(arg);
  int expected = UCS_OK;
  p->why.compare_exchange_strong(expected, static_cast<int>(status), std::memory_order_relaxed);
  p->dead.store(true, std::memory_order_release);
}

void ucx_transport::impl::on_send_done(void* request, ucs_status_t status, void* user) {
  auto* c = static_cast<send_ctx*>(user);
  c->held = false;
  if (!std::exchange(c->abandoned, false)) c->owner->send_done(c->peer, c->entry, status, c->length);
  ucp_request_free(request);
}

void ucx_transport::impl::send_done(int to, int entry, ucs_status_t status, std::size_t length) noexcept {
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

bool ucx_transport::impl::drain_sends() noexcept {
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
    else {
      ctx.held = true;
      ctx.held_at = std::chrono::steady_clock::now();
    }
  }
}

ucs_status_t ucx_transport::impl::on_bye(void* arg, const void* header, std::size_t header_length, void*, std::size_t, const ucp_am_recv_param_t*) {
  auto* self = static_cast<impl*>(arg);
  bye_header b;
  if (header_length != sizeof b) return UCS_OK;  // foreign: ignored
  std::memcpy(&b, header, sizeof b);
  if (peer_state* p = self->peer(b.rank)) {
    // Messages it held unmerged: their weight comes back as a failed send's.
    if (std::isfinite(b.unmerged_weight) && b.unmerged_weight > 0)
      p->failed_weight.store(p->failed_weight.load(std::memory_order_relaxed) + b.unmerged_weight, std::memory_order_relaxed);
    if (!b.drained) {
      // Gone without the drain handshake: a failure, known now rather than
      // when UCX notices the endpoint (seconds over shared memory).
      p->left_early.store(true, std::memory_order_release);
      p->dead.store(true, std::memory_order_release);
      return UCS_OK;
    }
    p->departed.store(true, std::memory_order_release);
    // It has finished: it paces no one, even if its last beacon was lost.
    if (const int si = self->source_of[static_cast<std::size_t>(b.rank)]; si >= 0)
      self->heard_from(self->sources[static_cast<std::size_t>(si)], ~std::uint64_t{0});
  }
  return UCS_OK;
}

ucs_status_t ucx_transport::impl::on_step(void* arg, const void* header, std::size_t header_length, void*, std::size_t,
                                         const ucp_am_recv_param_t*) {
  auto* self = static_cast<impl*>(arg);
  step_beacon_header b;
  if (header_length != sizeof b) return UCS_OK;  // foreign: ignored
  std::memcpy(&b, header, sizeof b);
  if (b.rank < 0 || static_cast<std::size_t>(b.rank) >= self->source_of.size() || self->source_of[static_cast<std::size_t>(b.rank)] < 0)
    return UCS_OK;
  if (peer_state* p = self->peer(b.rank)) p->alive_seen = true;
  auto& src = self->sources[static_cast<std::size_t>(self->source_of[static_cast<std::size_t>(b.rank)])];
  // `late` belongs to its beacon's step, not to a step heard in a model
  // header since: a newer beacon replaces both.
  if (b.step > src.beacon) {
    src.beacon = b.step;
    src.late = b.late;
  }
  if (b.step > src.heard) src.heard = b.step;
  self->update_heard_step();
  return UCS_OK;
}

// The neighbour a control message whose header is its rank came from (null: foreign).
ucx_transport::impl::peer_state* ucx_transport::impl::sender_of(const void* header, std::size_t header_length) const noexcept {
  std::int32_t from = -1;
  if (header_length == sizeof from) std::memcpy(&from, header, sizeof from);
  return peer(from);
}

ucs_status_t ucx_transport::impl::on_ask(void* arg, const void* header, std::size_t header_length, void*, std::size_t,
                                        const ucp_am_recv_param_t*) {
  auto* self = static_cast<impl*>(arg);
  peer_state* p = self->sender_of(header, header_length);
  if (!p || !p->target) return UCS_OK;  // foreign: ignored
  p->alive_seen = true;
  self->ask_now = true;
  return UCS_OK;
}

ucs_status_t ucx_transport::impl::on_full(void* arg, const void* header, std::size_t header_length, void*, std::size_t,
                                         const ucp_am_recv_param_t*) {
  peer_state* p = static_cast<impl*>(arg)->sender_of(header, header_length);
  if (p && p->target) p->full_wanted.store(true, std::memory_order_release);  // else foreign: ignored
  return UCS_OK;
}

ucs_status_t ucx_transport::impl::on_ping(void* arg, const void* header, std::size_t header_length, void*, std::size_t,
                                         const ucp_am_recv_param_t*) {
  // Answered from probe_peers, outside UCX's callback.
  if (peer_state* p = static_cast<impl*>(arg)->sender_of(header, header_length)) {
    p->pong_due = true;
    p->alive_seen = true;
  }
  return UCS_OK;
}

ucs_status_t ucx_transport::impl::on_pong(void* arg, const void* header, std::size_t header_length, void*, std::size_t,
                                         const ucp_am_recv_param_t*) {
  if (peer_state* p = static_cast<impl*>(arg)->sender_of(header, header_length)) {
    p->answered_at = std::chrono::steady_clock::now();
    p->alive_seen = true;
  }
  return UCS_OK;
}

std::chrono::steady_clock::duration ucx_transport::impl::probe_after() const noexcept {
  // A send held for a second is not yet a worry: a receiver's full inbox
  // (its engine busy elsewhere) holds rendezvous sends that long routinely.
  const auto quarter = std::chrono::duration_cast<std::chrono::steady_clock::duration>(setup.timeout / 4);
  return std::min<std::chrono::steady_clock::duration>(std::chrono::seconds(1), quarter);
}

std::chrono::steady_clock::duration ucx_transport::impl::probe_timeout() const noexcept {
  // Half the engine's timeout_s, so that with the default 60 s the sends a
  // dead peer held come back (abandon_stuck_sends, a second after the close)
  // well before a wait for them (flush in finish(), wait_when_busy) would
  // give up.
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(setup.timeout / 2);
}

bool ucx_transport::impl::probe_peers(std::chrono::steady_clock::time_point now) noexcept {
  using clock = std::chrono::steady_clock;
  bool any = false;
  // true: sent, or (in_flight_counts) the last one is still in flight.
  const auto send = [&](peer_state& p, unsigned id, void*& req, bool in_flight_counts) {
    const control_sent st = send_control(p, id, req);
    any = any || st == control_sent::sent;
    return st == control_sent::sent || (st == control_sent::in_flight && in_flight_counts);
  };
  for (int j : neighbours) {
    auto& p = *peer(j);
    if (!p.ep || p.closing || p.dead.load(std::memory_order_acquire)) continue;
    if (p.pong_due && send(p, pong_id, p.pong_req, false)) p.pong_due = false;
    if (!p.target || p.departed.load(std::memory_order_acquire)) continue;
    auto oldest = clock::time_point::max();
    for (const auto& c : p.ctx)
      if (c.held && !c.abandoned) oldest = std::min(oldest, c.held_at);
    if (oldest == clock::time_point::max()) {
      p.probing = false;
      continue;
    }
    if (p.probing && p.answered_at >= p.probed_at) p.probing = false;  // alive: probe again if the sends stay held
    // A target not heard from yet may still be attaching (waiting for another
    // rank's address, up to timeout_s), and answers nothing until it is done:
    // it is probed only once this rank has run for timeout_s.
    if (!p.probing && !p.alive_seen && now - run_started < setup.timeout) continue;
    if (!p.probing) {
      // A ping UCX still holds from an earlier probe is this probe (a peer
      // that stopped reading holds it for ever).
      if (now - std::max(oldest, p.answered_at) >= probe_after() && send(p, ping_id, p.ping_req, true)) {
        p.probing = true;
        p.probed_at = now;
      }
    } else if (now - p.probed_at > probe_timeout()) {
      p.unresponsive.store(true, std::memory_order_relaxed);
      int expected = UCS_OK;
      p.why.compare_exchange_strong(expected, static_cast<int>(UCS_ERR_ENDPOINT_TIMEOUT), std::memory_order_relaxed);
      p.dead.store(true, std::memory_order_release);
      any = true;
    }
  }
  return any;
}

std::uint64_t ucx_transport::impl::slowest_source(int* rank) const noexcept {
  // A source that beacons less often than asked (it steps fast) may be its
  // last beacon's `late` steps past that beacon: that much more lead.
  std::uint64_t slowest = ~std::uint64_t{0};
  int who = -1;
  for (const auto& s : sources) {
    const std::uint64_t told = s.beacon > ~std::uint64_t{0} - s.late ? ~std::uint64_t{0} : s.beacon + s.late;
    if (const std::uint64_t at = std::max(s.heard, told); at < slowest || who < 0) {
      slowest = at;
      who = s.rank;
    }
  }
  if (rank) *rank = who;
  return slowest;
}

void ucx_transport::impl::heard_from(source_state& src, std::uint64_t step) noexcept {
  if (step <= src.heard) return;
  src.heard = step;
  update_heard_step();
}

void ucx_transport::impl::update_heard_step() noexcept {
  int rank = -1;
  const std::uint64_t slowest = slowest_source(&rank);
  // Only this thread writes them.
  slowest_rank.store(rank, std::memory_order_relaxed);
  if (slowest != heard_step.load(std::memory_order_relaxed)) heard_step.store(slowest, std::memory_order_release);
}

std::uint64_t ucx_transport::impl::beacon_to_tell(std::int64_t now_ticks) noexcept {
  std::uint64_t step = beacon_step.load(std::memory_order_acquire);
  // A held step goes out when it falls due, or at once when a target waits on this rank.
  if (const std::uint64_t held = held_step.load(std::memory_order_acquire);
      held > step && (ask_now || now_ticks >= held_due.load(std::memory_order_relaxed)))
    step = held;
  ask_now = false;  // nothing newer held: the asking rank asks again if it still waits
  if (step > told) {
    // Later than step_beacon asks (the rank steps faster than
    // beacon_interval_ms lets it tell): say by how much; the first counts from 0.
    // A beacon within an interval of the last (a target asked, or this rank
    // waits) keeps the last one's claim, told + told_late, from going down
    // (without raising it): the next regular beacon is still up to an
    // interval away, and a smaller lead would only make the targets wait,
    // and ask, again.
    const std::uint64_t fresh = step == ~std::uint64_t{0} || step - told <= setup.step_beacon ? 0 : step - told - setup.step_beacon;
    const bool early = told > 0 && now_ticks - told_at.load(std::memory_order_relaxed) < beacon_interval().count();
    const std::uint64_t kept = told + told_late > step ? told + told_late - step : 0;
    const std::uint64_t late = early && step != ~std::uint64_t{0} ? std::max(fresh, kept) : fresh;
    told_late = static_cast<std::uint32_t>(std::min<std::uint64_t>(late, 0xffffffffu));
    told = step;
    told_at.store(now_ticks, std::memory_order_relaxed);
    told_step.store(told, std::memory_order_release);
  }
  return told;
}

ucx_transport::impl::control_sent ucx_transport::impl::send_control(peer_state& p, unsigned id, void*& req) noexcept {
  if (req) {  // one in flight at a time
    if (ucp_request_check_status(req) == UCS_INPROGRESS) return control_sent::in_flight;
    ucp_request_free(std::exchange(req, nullptr));
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t r = ucp_am_send_nbx(p.ep, id, &ask_header, sizeof ask_header, nullptr, 0, &rp);
  if (UCS_PTR_IS_ERR(r)) return control_sent::failed;  // a failing endpoint is reported by its error handler
  req = r;                                              // null: sent already
  return control_sent::sent;
}

bool ucx_transport::impl::send_asks() noexcept {
  bool any = false;
  for (int j : neighbours) {
    if (source_of[static_cast<std::size_t>(j)] < 0) continue;
    auto& p = *peer(j);
    if (!p.ep || p.dead.load(std::memory_order_acquire) || p.departed.load(std::memory_order_acquire)) continue;
    any = send_control(p, ask_id, p.ask_req) == control_sent::sent || any;  // one in flight per source is enough
  }
  return any;
}

void ucx_transport::impl::request_full(int source) noexcept {
  peer_state* p = peer(source);
  if (!p || source_of[static_cast<std::size_t>(source)] < 0) return;
  p->full_asked.store(true, std::memory_order_release);
  want_full.store(true, std::memory_order_release);
  wake();
}

bool ucx_transport::impl::send_full_requests() noexcept {
  if (!want_full.exchange(false, std::memory_order_acq_rel)) return false;
  bool any = false;
  for (int j : neighbours) {
    auto& p = *peer(j);
    if (!p.full_asked.load(std::memory_order_acquire)) continue;
    if (!p.ep || p.dead.load(std::memory_order_acquire) || p.departed.load(std::memory_order_acquire)) {
      p.full_asked.store(false, std::memory_order_release);
      continue;
    }
    p.full_asked.store(false, std::memory_order_release);  // before the send: a request made meanwhile is sent again
    const control_sent st = send_control(p, full_id, p.full_req);
    if (st == control_sent::in_flight) {  // the one in flight says the same: ask again after it
      p.full_asked.store(true, std::memory_order_release);
      want_full.store(true, std::memory_order_release);
      continue;
    }
    any = any || st == control_sent::sent;
  }
  return any;
}

bool ucx_transport::impl::send_beacons() noexcept {
  // This rank waits on its sources (max_lead): ask them for their newest step.
  bool asked = false;
  if (want_beacons.exchange(false, std::memory_order_acq_rel)) asked = send_asks();
  const std::uint64_t step = beacon_to_tell(std::chrono::steady_clock::now().time_since_epoch().count());
  if (step == 0) return asked;
  bool any = asked;
  for (int j : neighbours) {
    auto& p = *peer(j);
    if (!p.target || p.told_step >= step) continue;
    // One beacon per peer in flight: UCX reads its header until it completes.
    if (p.beacon_req) {
      if (ucp_request_check_status(p.beacon_req) == UCS_INPROGRESS) continue;
      ucp_request_free(p.beacon_req);
      p.beacon_req = nullptr;
    }
    if (!p.ep || p.dead.load(std::memory_order_acquire)) continue;
    p.told_step = step;
    p.beacon = {setup.rank, told_late, step};
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t r = ucp_am_send_nbx(p.ep, step_id, &p.beacon, sizeof p.beacon, nullptr, 0, &rp);
    if (UCS_PTR_IS_ERR(r)) continue;  // a failing endpoint is reported by its error handler
    p.beacon_req = r;                 // null: sent already
    beacons_sent.fetch_add(1, std::memory_order_relaxed);
    any = true;
  }
  return any;
}

ucs_status_t ucx_transport::impl::on_am(void* arg, const void* header, std::size_t header_length, void* data, std::size_t length,
                          const ucp_am_recv_param_t* param) {
  return static_cast<impl*>(arg)->arrived(header, header_length, data, length, param->recv_attr);
}

ucs_status_t ucx_transport::impl::arrived(const void* header, std::size_t header_length, void* data, std::size_t length, std::uint64_t attr) noexcept {
  const bool rndv = attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  const bool persistent = attr & UCP_AM_RECV_ATTR_FLAG_DATA;
  wire_header h;
  const int si = detail::accept_message(header, header_length, length, source_of, setup.message_bytes, setup.layout_fingerprint, h);
  if (si < 0) {
    dropped.fetch_add(1, std::memory_order_relaxed);  // foreign or corrupt: never trust a length from the wire
    return UCS_OK;
  }
  auto& src = sources[static_cast<std::size_t>(si)];
  heard_from(src, h.step);  // where the source is, for max_lead, even before its model lands
  if (src.count == 0 && !rndv && slot_free(src)) {
    land(src, pending{h, data, length, false}, false);
    return UCS_OK;
  }
  if (!rndv && !persistent) {  // UCX will reuse the buffer: cannot keep it
    discard(static_cast<std::size_t>(si), h.weight);
    return UCS_OK;
  }
  // Keep the newest: the oldest go while the ring is full or its eager data
  // would pass the byte bound (a message alone is always kept).
  const std::size_t bytes = rndv ? 0 : length;
  while (src.count > 0 && (src.count == src.backlog.size() || src.held_bytes + bytes > opt.backlog_bytes)) {
    const pending old = pop_backlog(src);
    ucp_am_data_release(worker, old.data);
    discard(static_cast<std::size_t>(si), old.h.weight);
  }
  src.backlog[(src.head + src.count) % src.backlog.size()] = pending{h, data, length, rndv};
  ++src.count;
  src.held_bytes += bytes;
  backlogged[static_cast<std::size_t>(si)].store(static_cast<std::uint32_t>(src.count), std::memory_order_relaxed);
  return UCS_INPROGRESS;
}

ucx_transport::impl::pending ucx_transport::impl::pop_backlog(source_state& src) noexcept {
  const pending m = src.backlog[src.head];
  src.head = (src.head + 1) % src.backlog.size();
  --src.count;
  if (!m.rndv) src.held_bytes -= m.length;
  backlogged[src.index].store(static_cast<std::uint32_t>(src.count), std::memory_order_relaxed);
  return m;
}

void ucx_transport::impl::discard(std::size_t si, double weight) noexcept {
  dropped.fetch_add(1, std::memory_order_relaxed);
  // The weight first: a collect that sees the new count also sees its weight.
  if (std::isfinite(weight)) discarded_weight[si].fetch_add(weight, std::memory_order_relaxed);
  discarded[si].fetch_add(1, std::memory_order_release);
}

void ucx_transport::impl::land(source_state& src, const pending& m, bool owned) noexcept {
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
  // UCX 1.13 may complete the receive inside the call (a sender whose
  // endpoint is closed already: the callback runs and frees the request)
  // and still return the request's pointer. The callback clears this mark;
  // a pointer returned after that is not a request any more.
  rc.request = &rc;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker, m.data, slot.data + sizeof m.h, m.length, &rp);
  if (r == nullptr) {
    rc.request = nullptr;
    landed(slot, m.length);
  } else if (UCS_PTR_IS_ERR(r)) {
    rc.request = nullptr;
    failed(slot);
  } else if (rc.request != nullptr) {
    rc.request = r;
  }
}

void ucx_transport::impl::landed(inbox::slot& slot, std::size_t length) noexcept {
  bytes_received.fetch_add(sizeof(wire_header) + length, std::memory_order_relaxed);
  messages_received.fetch_add(1, std::memory_order_relaxed);
  slot.state.store(inbox::full, std::memory_order_release);
}

void ucx_transport::impl::failed(inbox::slot& slot) noexcept {
  dropped.fetch_add(1, std::memory_order_relaxed);
  slot.bytes = 0;
  slot.state.store(inbox::full, std::memory_order_release);
}

void ucx_transport::impl::on_recv_done(void* request, ucs_status_t status, std::size_t length, void* user) {
  auto* rc = static_cast<recv_ctx*>(user);
  rc->request = nullptr;
  if (status == UCS_OK)
    rc->owner->landed(*rc->slot, length);
  else
    rc->owner->failed(*rc->slot);
  ucp_request_free(request);
}

bool ucx_transport::impl::land_backlog() noexcept {
  bool any = false;
  for (auto& src : sources)
    while (src.count > 0 && slot_free(src)) {
      land(src, pop_backlog(src), true);
      any = true;
    }
  return any;
}

void ucx_transport::impl::close_dead() noexcept {
  for (int j : neighbours) {
    auto& p = *peer(j);
    if (p.ep && !p.closing && p.dead.load(std::memory_order_acquire)) {
      p.closing = true;
      // A source that died paces no one: the largest step takes it out of max_lead's bound.
      if (const int si = source_of[static_cast<std::size_t>(j)]; si >= 0) heard_from(sources[static_cast<std::size_t>(si)], ~std::uint64_t{0});
      // Once per peer, outside the step path: who failed, where, and what happens now.
      if (p.left_early.load(std::memory_order_acquire))
        std::fprintf(stderr,
                     "libgossip ucx (%s): peer %s left before its drain handshake (its engine was destroyed without finish(), or by an "
                     "error); its own push-sum weight is lost (what it held of this rank's comes back), and training goes on without it\n",
                     self_name.c_str(), p.name.c_str());
      else if (p.unresponsive.load(std::memory_order_relaxed))
        std::fprintf(stderr,
                     "libgossip ucx (%s): peer %s did not answer a liveness probe within %.3g s (half of [engine] timeout_s) "
                     "while UCX held a send to it: its process is stopped, hung or gone; it is removed from this rank's "
                     "topology and training goes on without it\n",
                     self_name.c_str(), p.name.c_str(), std::chrono::duration<double>(probe_timeout()).count());
      else if (!p.departed.load(std::memory_order_acquire))
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
      p.closed_at = std::chrono::steady_clock::now();
      // A beacon still queued to it is released to UCX, which frees it when it ends.
      if (p.beacon_req) ucp_request_free(std::exchange(p.beacon_req, nullptr));
      if (p.ask_req) ucp_request_free(std::exchange(p.ask_req, nullptr));
      if (p.full_req) ucp_request_free(std::exchange(p.full_req, nullptr));
      if (p.ping_req) ucp_request_free(std::exchange(p.ping_req, nullptr));
      if (p.pong_req) ucp_request_free(std::exchange(p.pong_req, nullptr));
    }
  }
}

// Closing a failed endpoint normally completes every send still on it, with
// an error. UCX 1.13 does not always: over shared memory, once a dead
// receiver's FIFO is full, sends queued behind it stay pending for ever, and
// the send buffers they hold would never come back (finish() then times out).
// A second after the close such sends are given up on as failed — their
// push-sum share counted as lost, like any failed send — and their buffers
// returned to the engine; should UCX complete one later, that is ignored.
// UCX no longer moves their bytes: the endpoint is closed.
void ucx_transport::impl::abandon_stuck_sends() noexcept {
  const auto now = std::chrono::steady_clock::now();
  for (int j : neighbours) {
    auto& p = *peer(j);
    if (!p.closing || p.inflight.load(std::memory_order_acquire) == 0 || now - p.closed_at < std::chrono::seconds(1)) continue;
    for (auto& c : p.ctx)
      if (c.held && !c.abandoned) {
        c.abandoned = true;
        send_done(c.peer, c.entry, UCS_ERR_CANCELED, c.length);
      }
  }
}

ucx_transport::impl::transfers ucx_transport::impl::under_way() const noexcept {
  transfers u;
  const auto take = [&u](std::size_t bytes) {
    u.any = true;
    u.smallest = std::min(u.smallest, bytes);
  };
  for (std::size_t e = 0; e < buffers.size(); ++e) {
    if (buffers[e].inflight.load(std::memory_order_relaxed) == 0) continue;
    u.any = true;  // queued or held; drain_sends has handed every queued one to UCX by now
    for (int j : neighbours)
      if (const auto& c = peer(j)->ctx[e]; c.held && !c.abandoned) take(c.length);
  }
  for (const auto& src : sources) {
    for (std::size_t k = 0; k < src.count; ++k) take(sizeof(wire_header) + src.backlog[(src.head + k) % src.backlog.size()].length);
    for (const auto& rc : src.recv)
      if (rc.request) take(rc.slot->bytes);
  }
  return u;
}

void ucx_transport::impl::run() noexcept {
  using clock = std::chrono::steady_clock;
  pollfd fds[2] = {{wake_fd, POLLIN, 0}, {worker_fd, POLLIN, 0}};
  const nfds_t nfds = worker_fd >= 0 ? 2 : 1;
  const auto spin = std::chrono::duration_cast<clock::duration>(std::chrono::duration<double, std::micro>(opt.spin_us));
  const timespec busy_wait{0, 50'000};
  auto last_work = clock::now();
  run_started = last_work;
  while (!stop.load(std::memory_order_acquire)) {
    if (driver.exchange(true, std::memory_order_acquire)) {
      // The engine thread drives the worker right now (help()): it is in a
      // transport call, which returns in microseconds.
      std::this_thread::yield();
      continue;
    }
    bool work = drain_sends();
    work = send_beacons() || work;
    work = send_full_requests() || work;
    work = land_backlog() || work;
    // Bounded, so that a stream of arrivals cannot keep the thread from its
    // other duties (a probe unanswered would make this rank look dead).
    for (int i = 0; i < 1024 && ucp_worker_progress(worker) != 0; ++i) work = true;
    // After progress: an answer already waiting in the worker counts (this
    // thread may itself have been stopped while its probe was out).
    work = probe_peers(clock::now()) || work;
    close_dead();
    abandon_stuck_sends();
    const auto now = clock::now();
    if (work) {
      last_work = now;
      driver.store(false, std::memory_order_release);
      continue;
    }
    // Mid-transfer, poll instead of sleeping: each rendezvous step (RTS, RTR,
    // data, ATS) and each freed slot would otherwise cost a sleep and a
    // wake-up — tens of µs on a busy core, per message.
    // Not for very large messages alone: two 16 MiB+ transfers in flight
    // already saturate memory, and polling then only steals the training's
    // core. What counts is each transfer's size, not the slots' (a model of
    // 64 MiB under a codec sends small messages).
    const transfers u = under_way();
    if (spin.count() > 0 && now - last_work < spin && u.smallest < spin_below) {
      driver.store(false, std::memory_order_release);
      std::this_thread::yield();
      continue;
    }
    if (worker_fd >= 0 && ucp_worker_arm(worker) == UCS_ERR_BUSY) {
      driver.store(false, std::memory_order_release);
      continue;
    }
    if (q_head.load(std::memory_order_acquire) != q_tail.load(std::memory_order_acquire)) {
      driver.store(false, std::memory_order_release);
      continue;
    }
    // While a transfer is under way, wake often, so that a missed wake-up
    // costs 50 µs rather than 10 ms. Idle, sleep long (keepalive still runs).
    timespec idle_wait{0, worker_fd >= 0 ? 10'000'000 : 1'000'000};
    // A step beacon held back (beacon_interval_ms) goes out when it falls due.
    if (held_step.load(std::memory_order_acquire) > told) {
      const std::int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  clock::duration(held_due.load(std::memory_order_relaxed)) - clock::now().time_since_epoch())
                                  .count();
      if (ns < idle_wait.tv_nsec) idle_wait.tv_nsec = std::max<std::int64_t>(ns, 0);
    }
    // Set while this thread holds the worker: a help() that starts a
    // transfer after this sees it, and wakes the thread to carry it on.
    idle.store(!u.any, std::memory_order_release);
    driver.store(false, std::memory_order_release);
    ::ppoll(fds, nfds, u.any ? &busy_wait : &idle_wait, nullptr);
    idle.store(false, std::memory_order_relaxed);
    if (fds[0].revents & POLLIN) {
      std::uint64_t v;
      [[maybe_unused]] auto r = ::read(wake_fd, &v, sizeof v);
    }
  }
  // The engine thread has stopped calling help() (teardown_now joins this thread).
  (void)driver.exchange(true, std::memory_order_acquire);
  shutdown_ucx();
}

}  // namespace gossip

// The UCX transport's life: UCX context and worker, the rendezvous of
// worker addresses through the bootstrap, endpoints to the topology's
// neighbours, the drain handshake of engine::finish, leaving, teardown.
#include <fmt/format.h>
#include <netdb.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "gossip/config.hpp"
#include "gossip/wait.hpp"
#include "impl.hpp"
#include "peer_blob.hpp"

namespace gossip {

using namespace ucx_detail;
using detail::ucx_blob::decode;
using detail::ucx_blob::encode;

namespace {

std::string host_name() {
  char h[256] = {};
  if (::gethostname(h, sizeof h - 1) != 0 || !h[0]) return "?";
  return h;
}

bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

}  // namespace

std::optional<std::string> ucx_detail::user_tls() {
  if (const char* env = std::getenv("UCX_TLS")) return std::string(env);
  // A ucx.conf may set it: ask UCX for the value it read.
  ucp_config_t* cfg = nullptr;
  if (ucp_config_read(nullptr, nullptr, &cfg) != UCS_OK) return std::nullopt;
  char* text = nullptr;
  std::size_t size = 0;
  std::optional<std::string> tls;
  if (FILE* f = ::open_memstream(&text, &size)) {
    ucp_config_print(cfg, f, nullptr, UCS_CONFIG_PRINT_CONFIG);
    std::fclose(f);
    const std::string_view printed(text, size);
    constexpr std::string_view key = "UCX_TLS=";
    for (auto at = printed.find(key); at != std::string_view::npos; at = printed.find(key, at + 1)) {
      if (at != 0 && printed[at - 1] != '\n') continue;
      const auto value = printed.substr(at + key.size(), printed.find('\n', at) - at - key.size());
      if (value != "all") tls = std::string(value);
      break;
    }
    std::free(text);
  }
  ucp_config_release(cfg);
  return tls;
}

std::string ucx_detail::effective_tls(const std::optional<std::string>& user) { return user ? *user : "^sysv"; }

namespace {

// The comma-separated names of a UCX_TLS value.
std::vector<std::string_view> tls_names(std::string_view tls) {
  std::vector<std::string_view> names;
  for (std::size_t at = 0; at <= tls.size();) {
    const auto comma = std::min(tls.find(',', at), tls.size());
    if (comma > at) names.push_back(tls.substr(at, comma - at));
    at = comma + 1;
  }
  return names;
}

bool names_one_of(const std::vector<std::string_view>& names, std::initializer_list<std::string_view> of) {
  return std::any_of(names.begin(), names.end(), [&](std::string_view n) { return std::find(of.begin(), of.end(), n) != of.end(); });
}

}  // namespace

bool ucx_detail::may_use_tcp(std::string_view tls) {
  const bool excluding = tls.starts_with('^');  // "^a,b": all but a and b
  const auto names = tls_names(excluding ? tls.substr(1) : tls);
  return excluding ? !names_one_of(names, {"tcp"}) : names_one_of(names, {"tcp", "all"});
}

bool ucx_detail::tcp_only(std::string_view tls) {
  // Not another transport, an alias ("sm", "all") or an exclusion ("^...").
  const auto names = tls_names(tls);
  return names_one_of(names, {"tcp"}) &&
         std::all_of(names.begin(), names.end(), [](std::string_view n) { return n == "tcp" || n == "self"; });
}

void ucx_detail::enable_shm_error_handling(const std::optional<std::string>& user) {
  if (!user) {  // read_config then leaves sysv out
    ::setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
    return;
  }
  const auto may_use = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (user->find(n) != std::string::npos) return true;
    return false;
  };
  if (may_use({"all", "posix", "sm", "shm", "^"})) ::setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
  if (may_use({"all", "sysv", "sm", "shm", "^"})) ::setenv("UCX_SYSV_ERROR_HANDLING", "y", 0);
}

ucp_config_t* ucx_detail::read_config(std::string_view who, const std::optional<std::string>& user) {
  // Shared-memory transports exclude themselves under peer error handling
  // unless told otherwise; the user's setting wins.
  enable_shm_error_handling(user);
  ucp_config_t* cfg = nullptr;
  if (auto s = ucp_config_read(nullptr, nullptr, &cfg); s != UCS_OK)
    throw transport_error(fmt::format("{}: cannot read the UCX configuration: {}", who, status_text(s)));
  // UCX picks sysv for shared memory when free to, and sysv's keepalive never
  // sees a peer process die (a killed rank stayed "alive" for minutes, its
  // sends in flight forever); posix's does within a keepalive interval.
  if (!user) ucp_config_modify(cfg, "TLS", "^sysv");
  return cfg;
}

void ucx_transport::impl::init_ucx() {
  const auto tls = user_tls();
  ucp_config_t* cfg = read_config(fmt::format("ucx (rank {})", setup.rank), tls);
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
    throw transport_error(fmt::format("ucx (rank {}): cannot create a UCX context: {} (UCX_TLS={}{}); check UCX_TLS and UCX_NET_DEVICES",
                                      setup.rank, status_text(s), effective_tls(tls), tls ? "" : ": unset, so all but sysv"));
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_CLIENT_ID;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  // What a listener learns of who connects (on_connect): this transport's
  // generation and this rank.
  wp.client_id = generation << 32 | static_cast<std::uint32_t>(setup.rank);
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
  hp.arg = this;
  // Models keep their data (persistent) until a slot takes them; the control
  // messages are headers only.
  const struct {
    unsigned id;
    std::uint32_t flags;
    ucp_am_recv_callback_t cb;
  } handlers[] = {
      {am_id, UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA, &impl::on_am},
      {bye_id, UCP_AM_FLAG_WHOLE_MSG, &impl::on_bye},
      {step_id, UCP_AM_FLAG_WHOLE_MSG, &impl::on_step},
      {ask_id, UCP_AM_FLAG_WHOLE_MSG, &impl::on_ask},
      {ping_id, UCP_AM_FLAG_WHOLE_MSG, &impl::on_ping},
      {pong_id, UCP_AM_FLAG_WHOLE_MSG, &impl::on_pong},
      {full_id, UCP_AM_FLAG_WHOLE_MSG, &impl::on_full},
  };
  for (const auto& h : handlers) {
    hp.id = h.id;
    hp.flags = h.flags;
    hp.cb = h.cb;
    if (s = ucp_worker_set_am_recv_handler(worker, &hp); s != UCS_OK)
      throw transport_error(
          fmt::format("ucx (rank {}): cannot register the active-message handler {:#x}: {}", setup.rank, h.id, status_text(s)));
  }
}

bool ucx_transport::impl::start_listener() {
  ucx_connect mode = opt.connect;
  const char* env = std::getenv("GOSSIP_UCX_CONNECT");
  if (mode == ucx_connect::automatic && env && *env) {
    const std::string_view v = env;
    if (v == "worker")
      mode = ucx_connect::worker_address;
    else if (v == "listener")
      mode = ucx_connect::listener;
    else if (v != "auto")
      throw config_error(fmt::format("ucx (rank {}): GOSSIP_UCX_CONNECT='{}' is not a way to connect; give auto, worker or listener", setup.rank, v));
  }
  const bool forced = mode == ucx_connect::listener;
  const std::string chosen = opt.connect == ucx_connect::listener ? "ucx_connect::listener" : "GOSSIP_UCX_CONNECT=listener";
  // Automatic: over tcp alone, for models from listener_from_bytes up, where
  // the put lane pays; below it, a put's extra acknowledgement costs more
  // than the fragments' copy (docs/ucx-small-messages.md, §7).
  const std::string tls = effective_tls(user_tls());
  if (neighbours.empty() || mode == ucx_connect::worker_address ||
      (!forced && (setup.message_bytes < listener_from_bytes || !tcp_only(tls))))
    return false;
  if (!may_use_tcp(tls))
    throw config_error(fmt::format("ucx (rank {}): {} connects over tcp, which UCX_TLS={} leaves out; add tcp to UCX_TLS, or connect "
                                   "by worker address (shared memory does)",
                                   setup.rank, chosen, tls));
  // The address ranks on other hosts reach this one by: the local end of the
  // route to rank 0's rendezvous. A wildcard rendezvous address names none.
  const std::string ip = boot->local_address();
  if (ip.empty()) {
    if (!forced) return false;
    throw config_error(fmt::format("ucx (rank {}): {} needs an address to listen on, and the rendezvous address {} names no route "
                                   "(a wildcard, or it does not resolve); give rank 0's address (GOSSIP_MASTER_ADDR), or connect by "
                                   "worker address",
                                   setup.rank, chosen, boot->where()));
  }
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(ip.c_str(), "0", &hints, &res) != 0 || !res) {  // inet_ntop's own text: not expected
    if (!forced) return false;
    throw transport_error(fmt::format("ucx (rank {}): cannot make a socket address of {} to listen on ({})", setup.rank, ip, chosen));
  }
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = res->ai_addr;
  lp.sockaddr.addrlen = res->ai_addrlen;
  lp.conn_handler.cb = &impl::on_connect;
  lp.conn_handler.arg = this;
  const ucs_status_t st = ucp_listener_create(worker, &lp, &listener);
  ::freeaddrinfo(res);
  if (st != UCS_OK) {
    listener = nullptr;
    if (!forced) return false;  // no connection manager: worker addresses serve
    throw transport_error(fmt::format("ucx (rank {}): cannot listen on {} ({}): {}; UCX needs a connection manager (its tcp or "
                                      "rdmacm component) for it, or connect by worker address",
                                      setup.rank, ip, chosen, status_text(st)));
  }
  ucp_listener_attr_t la{};
  la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (ucp_listener_query(listener, &la) != UCS_OK) {
    ucp_listener_destroy(std::exchange(listener, nullptr));
    if (!forced) return false;
    throw transport_error(fmt::format("ucx (rank {}): cannot tell which port the listener on {} took", setup.rank, ip));
  }
  listen_addr = la.sockaddr;
  listen_len = la.sockaddr.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  return true;
}

void ucx_transport::impl::on_connect(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<impl*>(arg);
  ucp_conn_request_attr_t a{};
  a.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID;
  peer_state* p = nullptr;
  // Only a neighbour of this transport's generation, once: anything else (a
  // stranger on the port, a second request) is turned away.
  if (ucp_conn_request_query(request, &a) == UCS_OK && a.client_id >> 32 == (self->generation & 0xffffffffu))
    if (peer_state* q = self->peer(static_cast<int>(a.client_id & 0xffffffffu)); q && q->accepts && !q->ep) p = q;
  if (!p) {
    ucp_listener_reject(self->listener, request);
    return;
  }
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = request;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &impl::on_ep_error;
  ep.err_handler.arg = p;
  if (const ucs_status_t st = ucp_ep_create(self->worker, &ep, &p->ep); st != UCS_OK) {
    p->ep = nullptr;
    on_ep_error(p, nullptr, st);
  }
}

void ucx_transport::impl::accept_neighbours() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(setup.timeout);
  const auto names = [&](auto&& which) {
    std::string who;
    for (int j : neighbours)
      if (const peer_state* p = peer(j); which(*p)) who += fmt::format("{}{}", who.empty() ? "" : ", ", p->name);
    return who;
  };
  const auto unconnected = [](const peer_state& p) { return p.accepts && !p.ep && !p.dead.load(std::memory_order_relaxed); };
  detail::wait_for(
      [&] {
        ucp_worker_progress(worker);
        return std::none_of(neighbours.begin(), neighbours.end(), [&](int j) { return unconnected(*peer(j)); });
      },
      setup.timeout, [&] {
        return fmt::format("{} to connect to {}'s listener (it published its addresses; it may have died since, or its "
                           "UCX cannot reach this rank's address: GOSSIP_UCX_CONNECT=worker or ucx_connect::worker_address avoids listeners)",
                           names(unconnected), self_name);
      });
  // Then each such connection is flushed before attach returns: UCX 1.13
  // reorders active messages sent on an endpoint made through its
  // connection manager while the endpoint's wire-up is still under way (the
  // first model arrived after the second), and the transport delivers in
  // order. A flush completes once the wire-up has.
  std::vector<void*> flushes;
  for (int j : neighbours) {
    peer_state& p = *peer(j);
    if (!p.by_listener || !p.ep || p.dead.load(std::memory_order_relaxed)) continue;
    ucp_request_param_t rp{};
    if (const ucs_status_ptr_t r = ucp_ep_flush_nbx(p.ep, &rp); UCS_PTR_IS_PTR(r)) flushes.push_back(r);
  }
  try {
    detail::wait_for(
        [&] {
          ucp_worker_progress(worker);
          std::erase_if(flushes, [](void* r) {
            if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
            ucp_request_free(r);
            return true;
          });
          return flushes.empty();
        },
        std::max(std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()), std::chrono::duration<double>(0)), [&] {
          return fmt::format("{}'s connections with {} to be established (UCX's wire-up through listeners; a peer that stopped "
                             "or died holds it up)",
                             self_name, names([](const peer_state& p) { return p.by_listener; }));
        });
  } catch (...) {
    for (void* r : flushes) ucp_request_free(r);  // UCX completes them when the endpoints close
    throw;
  }
}

void ucx_transport::impl::attach(const transport_setup& s) {
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
  ask_header = s.rank;
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
  discarded_weight = std::make_unique<std::atomic<double>[]>(in_sources.size());
  backlogged = std::make_unique<std::atomic<std::uint32_t>[]>(in_sources.size());
  for (std::size_t i = 0; i < in_sources.size(); ++i) {
    auto& src = sources[i];
    src.rank = in_sources[i];
    src.index = i;
    src.backlog.resize(std::max<std::size_t>(opt.backlog, 1));
    src.recv.resize(s.inbox->depth());
    for (std::size_t k = 0; k < s.inbox->depth(); ++k) src.recv[k] = {this, &s.inbox->at(i, k), nullptr};
    source_of[static_cast<std::size_t>(src.rank)] = static_cast<int>(i);
  }

  const std::uint64_t gen = boot->next_generation();
  generation = gen;
  init_ucx();
  const bool listening = start_listener();

  ucp_address_t* addr = nullptr;
  std::size_t addr_len = 0;
  if (auto st = ucp_worker_get_address(worker, &addr, &addr_len); st != UCS_OK)
    throw transport_error(fmt::format("ucx (rank {}): cannot get the worker address: {}", s.rank, status_text(st)));
  const std::string host = host_name();
  self_name = fmt::format("rank {} (host {})", s.rank, host);
  const auto blob = encode(s, addr, addr_len, &listen_addr, listen_len, host);
  ucp_worker_release_address(worker, addr);

  boot->put_once(fmt::format("gossip/ucx/{}/{}", gen, s.rank), blob, fmt::format("rank {}'s UCX address", s.rank));
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
    p.model_fp = pb->model_fp;
    if (pb->world != s.world)
      throw config_error(
          fmt::format("ucx: {} was started in a world of {} ranks but {} in a world of {}", self_name, s.world, p.name, pb->world));
    check_layouts(s.layout, s.rank, pb->layout, j);
    if (pb->config_fp != s.config_fingerprint)
      throw settings_mismatch(self_name, p.name, s.config_fingerprint, pb->config_fp, s.config_settings, pb->config_settings);
    if (contains(s.targets, j) && !contains(pb->sources, s.rank))
      throw config_error(
          fmt::format("{} may send to {}, but rank {} does not expect messages from it; every rank must use the same topology",
                      self_name, p.name, j));
    GOSSIP_ASSERT(pb->message_bytes == s.message_bytes, "ucx: ranks {} and {} have equal layouts but message sizes {} and {}", s.rank, j,
                  s.message_bytes, pb->message_bytes);
    // A source that never sends here (a topology whose sources() lists more
    // ranks than send to this one) sends no beacons either: it paces no one.
    if (const int si = source_of[static_cast<std::size_t>(j)]; si >= 0 && !contains(pb->targets, s.rank))
      sources[static_cast<std::size_t>(si)].heard = ~std::uint64_t{0};

    // Both listen: one connection, made by the lower rank (see ucx_connect::listener).
    const bool by_listener = listening && !pb->listener.empty();
    p.by_listener = by_listener;
    if (by_listener && j < s.rank) {
      p.accepts = true;
      continue;
    }
    sockaddr_storage remote{};
    ucp_ep_params_t ep{};
    if (by_listener) {
      std::memcpy(&remote, pb->listener.data(), pb->listener.size());
      ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
      ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER | UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID;
      ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&remote);
      ep.sockaddr.addrlen = static_cast<socklen_t>(pb->listener.size());
    } else {
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
      ep.address = reinterpret_cast<const ucp_address_t*>(pb->address.data());
    }
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &impl::on_ep_error;
    ep.err_handler.arg = &p;
    if (auto st = ucp_ep_create(worker, &ep, &p.ep); st != UCS_OK) {
      p.ep = nullptr;
      throw transport_error(
          fmt::format("ucx ({}): cannot reach {}: {}; either {} has exited since it published its address (its own "
                      "output says why), or UCX_TLS / UCX_NET_DEVICES offer no transport both ranks share (with error "
                      "handling: UCX_POSIX_ERROR_HANDLING=y for posix)",
                      self_name, p.name, status_text(st), p.name));
    }
  }
  if (listening) accept_neighbours();
  // max_lead's slowest source before anything is heard: 0 while some source
  // has yet to speak, ~0 when none ever will (no sources at all).
  int slowest = -1;
  heard_step.store(slowest_source(&slowest), std::memory_order_release);
  slowest_rank.store(slowest, std::memory_order_relaxed);
  try {
    thread = std::thread([this] { run(); });
  } catch (const std::system_error& e) {
    throw transport_error(fmt::format("ucx ({}): cannot start the progress thread: {}; the process's thread or memory limit "
                                      "(ulimit -u, ulimit -v) is too low",
                                      self_name, e.what()));
  }
  running = true;
}

bool ucx_transport::impl::drained() {
  if (!finishing && setup.step_beacon > 0) {
    // Done stepping: the largest step tells the targets not to wait for this rank.
    beacon_step.store(~std::uint64_t{0}, std::memory_order_release);
    wake();
  }
  finishing = true;
  if (rendezvous_gone) return true;
  try {
    return drained_through_rendezvous();
  } catch (const config_error&) {
    // Rank 0's store refused this rank's drain count (full: the error names
    // the key and the limit). Rank 0 is there, and the peers wait for the
    // count: the caller is told, not a handshake skipped as if it were gone.
    // Leaving now without a count is no departure: the goodbye says failed,
    // so that the peers stop waiting for it and count what it held.
    if (!drain_published) finishing = false;
    throw;
  } catch (const error& e) {
    // Rank 0 is gone: no peer can publish or read drain counts any more.
    // Leave with what has been merged; messages still on their way are lost.
    rendezvous_gone = true;
    std::fprintf(stderr, "libgossip ucx (%s): leaving without the drain handshake, messages still in flight to this rank are lost: %s\n",
                 self_name.c_str(), e.what());
    return true;
  }
}

bool ucx_transport::impl::drained_through_rendezvous() {
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
    if (p && p->dead.load(std::memory_order_acquire)) {
      // A dead source sends nothing more — also one that finished and left,
      // whose endpoint then closed — but what it sent before may still be
      // here: in the backlog, or in a slot not yet merged. Merged first, its
      // push-sum weight is not lost. (Bounded: a receive from a dead peer
      // that UCX never completes does not hold the drain.)
      if (!holds_from(i)) continue;
      const auto now = std::chrono::steady_clock::now();
      if (src.dead_drain == std::chrono::steady_clock::time_point{}) src.dead_drain = now;
      if (now - src.dead_drain >= std::chrono::duration<double>(opt.close_timeout_s)) continue;
      return false;
    }
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

bool ucx_transport::impl::holds_from(std::size_t si) const noexcept {
  if (backlogged[si].load(std::memory_order_relaxed) > 0) return true;
  for (std::size_t k = 0; k < setup.inbox->depth(); ++k)
    if (setup.inbox->at(si, k).state.load(std::memory_order_acquire) != inbox::empty) return true;
  return false;
}

std::string ucx_transport::impl::outstanding() const {
  std::string who;
  for (int j : neighbours)
    if (const int k = peer(j)->inflight.load(); k > 0)
      who += fmt::format("{}{}: {} send{}", who.empty() ? "" : ", ", peer(j)->name, k, k == 1 ? "" : "s");
  return who.empty() ? "the progress thread to pick up queued sends" : who;
}

std::string ucx_transport::impl::waiting_on() const {
  std::string who;
  for (int j : neighbours)
    if (const int k = peer(j)->inflight.load(); k > 0)
      who += fmt::format("{}{}: {} send{} in flight", who.empty() ? "" : "; ", peer(j)->name, k, k == 1 ? "" : "s");
  for (std::size_t i = 0; i < sources.size(); ++i) {
    const auto& src = sources[i];
    const peer_state* p = peer(src.rank);
    if (!drain_published) continue;
    if (p && p->dead.load()) {
      if (holds_from(i)) who += fmt::format("{}{}: gone, its last messages still to merge", who.empty() ? "" : "; ", p->name);
      continue;
    }
    if (src.expected == ~0ull)
      who += fmt::format("{}{}: has not said how many messages it sent (it has not reached finish(), or it hangs)",
                         who.empty() ? "" : "; ", p->name);
    else if (const auto got = src.consumed + discarded[i].load(); got < src.expected)
      who += fmt::format("{}{}: {} of {} messages received", who.empty() ? "" : "; ", p->name, got, src.expected);
  }
  // Nothing in flight or to drain: what max_lead waits on, the source the slowest step heard comes from.
  if (const int r = slowest_rank.load(std::memory_order_relaxed); who.empty() && r >= 0 && setup.step_beacon > 0 && !finishing) {
    const std::uint64_t h = heard_step.load(std::memory_order_acquire);
    const peer_state* p = peer(r);
    const std::string name = p ? p->name : fmt::format("rank {}", r);
    if (h != ~std::uint64_t{0})
      who = h == 0 ? fmt::format("{}, the slowest source: nothing heard from it yet", name)
                   : fmt::format("{}, the slowest source, at step {} as last heard", name, h);
  }
  return who.empty() ? "no peer" : who;
}

void ucx_transport::impl::flush(std::chrono::duration<double> timeout) {
  if (!attached || left) return;
  detail::wait_for(
      [&] {
        help();
        for (int j : neighbours)
          if (peer(j)->inflight.load(std::memory_order_acquire) > 0) return false;
        return true;
      },
      timeout, [&] { return fmt::format("rank {}'s sends to complete: to {}", setup.rank, outstanding()); });
}

void ucx_transport::impl::leave() {
  if (!attached || left) return;
  try {
    flush(std::min<std::chrono::duration<double>>(setup.timeout, std::chrono::duration<double>(opt.close_timeout_s)));
  } catch (const timeout_error&) {
    // leaving anyway: what is still in flight is lost, and counted in teardown
  }
  left = true;
  teardown_now();
}

void ucx_transport::impl::teardown_now() noexcept {
  left = true;
  running = false;
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

std::size_t ucx_transport::impl::dead_peers(std::span<received> out) {
  std::size_t n = 0;
  const auto now = std::chrono::steady_clock::now();
  publish_records(now);
  for (int j : neighbours) {
    auto& p = *peer(j);
    if (!p.dead.load(std::memory_order_acquire)) continue;
    if (p.reported) {
      // Reported with the shares that failed here: its own record may say
      // otherwise (see publish_records in impl.hpp).
      if (p.settled || n == out.size()) continue;
      if (const auto taken = read_record(p, now)) {
        const double owed = std::max(0.0, p.weight_posted - *taken) - p.weight_handed_back;
        p.weight_handed_back += owed;
        out[n++] = received{.sender = j, .weight = owed, .settled = true};
      }
      continue;
    }
    if (p.dead_seen == std::chrono::steady_clock::time_point{}) p.dead_seen = now;
    if (p.inflight.load(std::memory_order_acquire) > 0 && now - p.dead_seen < std::chrono::seconds(2)) continue;
    if (n == out.size()) break;
    p.reported = true;
    const bool departed = p.departed.load(std::memory_order_acquire);
    received r{.sender = j, .weight = p.failed_weight.load(std::memory_order_relaxed), .departed = departed};
    // A goodbye told what it left unmerged (failed_weight): nothing to settle.
    if (departed || p.left_early.load(std::memory_order_acquire) || !p.target) {
      p.settled = true;
    } else {
      // This rank posts nothing more to it: say so, so that it can seal what
      // it took from this rank.
      store([&] { boot->put(record_key("stopped", setup.rank, j), {}); });
      if (const auto taken = read_record(p, now)) {
        r.weight = std::max(0.0, p.weight_posted - *taken);
        r.settled = true;
      }
    }
    p.weight_handed_back = r.weight;
    out[n++] = r;
  }
  return n;
}

std::string ucx_transport::impl::record_key(std::string_view what, int from, int to) const {
  return fmt::format("gossip/ucx/{}/{}/{}/{}", generation, what, from, to);
}

bool ucx_transport::impl::record_due(std::chrono::steady_clock::time_point& asked, std::chrono::steady_clock::time_point dead_seen,
                                     std::chrono::steady_clock::time_point now, bool& gave_up) const noexcept {
  const auto window = std::max<std::chrono::steady_clock::duration>(
      std::chrono::seconds(20), std::chrono::duration_cast<std::chrono::steady_clock::duration>(4 * setup.timeout));
  if (records_off || !boot || now - dead_seen >= window) {
    gave_up = true;
    return false;
  }
  if (asked != std::chrono::steady_clock::time_point{} && now - asked < std::chrono::milliseconds(250)) return false;
  asked = now;
  return true;
}

std::optional<double> ucx_transport::impl::read_record(peer_state& p, std::chrono::steady_clock::time_point now) {
  if (!record_due(p.record_asked, p.dead_seen, now, p.settled)) return std::nullopt;
  std::optional<bootstrap::blob> b;
  if (!store([&] { b = boot->try_get(record_key("taken", setup.rank, p.rank)); })) p.settled = true;
  double taken;
  if (!b || b->size() != sizeof taken) return std::nullopt;
  p.settled = true;
  std::memcpy(&taken, b->data(), sizeof taken);
  if (!std::isfinite(taken)) return std::nullopt;
  return taken;
}

void ucx_transport::impl::publish_records(std::chrono::steady_clock::time_point now) {
  for (auto& src : sources) {
    if (src.records_done) continue;
    peer_state* p = peer(src.rank);
    if (!p || !p->dead.load(std::memory_order_acquire) || p->departed.load(std::memory_order_acquire) ||
        p->left_early.load(std::memory_order_acquire))
      continue;
    if (src.record_dead_seen == std::chrono::steady_clock::time_point{}) src.record_dead_seen = now;
    // Only once the source has said that it posts nothing more here: a rank
    // found dead that still runs and never finds this one dead goes on
    // sending, and what it sends is merged as before.
    if (!src.stopped) {
      if (!record_due(src.record_asked, src.record_dead_seen, now, src.records_done)) continue;
      std::optional<bootstrap::blob> b;
      if (!store([&] { b = boot->try_get(record_key("stopped", src.rank, setup.rank)); })) src.records_done = true;
      if (!b) continue;
      src.stopped = true;
    }
    // Nothing of it is held (its receives have landed or failed, the engine
    // has collected what landed): what was taken from it is final. Sealed
    // before the put, whatever the put does: one that reached the rendezvous
    // but whose answer stalled must not let more be taken.
    if (holds_from(src.index)) continue;
    src.sealed = true;
    src.records_done = true;
    bootstrap::blob b(sizeof src.weight_taken);
    std::memcpy(b.data(), &src.weight_taken, sizeof src.weight_taken);
    store([&] { boot->put(record_key("taken", src.rank, setup.rank), b); });
  }
}

void ucx_transport::impl::shutdown_ucx() noexcept {
  if (!worker) return;
  if (listener) ucp_listener_destroy(std::exchange(listener, nullptr));
  drain_sends();  // sends queued after the last flush: dropped
  // What each source sent that this rank holds unmerged (its backlog, and
  // slots the engine never collected): the goodbye gives the weight back.
  std::vector<double> unmerged(sources.size(), 0.0);
  const auto add = [&](std::size_t si, double w) {
    if (std::isfinite(w)) unmerged[si] += w;
  };
  for (auto& src : sources) {
    for (std::size_t k = 0; k < src.count; ++k) add(src.index, src.backlog[(src.head + k) % src.backlog.size()].h.weight);
    for (const auto& rc : src.recv)
      if (!rc.request && rc.slot->state.load(std::memory_order_acquire) == inbox::full && rc.slot->bytes >= sizeof(wire_header)) {
        wire_header h;
        std::memcpy(&h, rc.slot->data, sizeof h);
        add(src.index, h.weight);
      }
  }
  for (auto& src : sources) {
    while (src.count > 0) {
      ucp_am_data_release(worker, pop_backlog(src).data);
      dropped.fetch_add(1, std::memory_order_relaxed);
    }
    for (auto& rc : src.recv)
      if (rc.request) ucp_request_cancel(worker, rc.request);
  }
  std::vector<void*> closing;
  for (int j : neighbours) {  // beacons still in flight complete (or fail) with their endpoints
    auto& p = *peer(j);
    if (p.beacon_req) closing.push_back(std::exchange(p.beacon_req, nullptr));
    if (p.ask_req) closing.push_back(std::exchange(p.ask_req, nullptr));
    if (p.full_req) closing.push_back(std::exchange(p.full_req, nullptr));
    if (p.ping_req) closing.push_back(std::exchange(p.ping_req, nullptr));
    if (p.pong_req) closing.push_back(std::exchange(p.pong_req, nullptr));
  }
  // Goodbye first, on the same endpoints: the graceful close below flushes
  // it. After the drain handshake (engine::finish) the peers know this rank
  // left rather than died; without it (an engine destroyed unfinished, or by
  // an error) they count it as failed at once, instead of stalling on it until
  // UCX notices the closed endpoint.
  // A rank that leaves holding messages of its sources unmerged (it reached
  // the drain handshake but did not complete it, or it never finished) gives
  // their weight back in each source's goodbye: their sends completed, so
  // nothing else tells the sources that weight was never merged.
  std::vector<bye_header> bye(neighbours.size());
  std::vector<void*> byes;
  for (std::size_t k = 0; k < neighbours.size(); ++k) {
    const int j = neighbours[k];
    auto& p = *peer(j);
    if (!p.ep || p.dead.load() || unanswered(p)) continue;
    bye[k] = {.rank = setup.rank, .drained = finishing ? 1 : 0};
    if (const int si = source_of[static_cast<std::size_t>(j)]; si >= 0) bye[k].unmerged_weight = unmerged[static_cast<std::size_t>(si)];
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t r = ucp_am_send_nbx(p.ep, bye_id, &bye[k], sizeof bye[k], nullptr, 0, &rp);
    if (r && !UCS_PTR_IS_ERR(r)) byes.push_back(r);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                               std::chrono::duration<double>(opt.close_timeout_s));
  const auto reap = [](std::vector<void*>& reqs) {
    reqs.erase(std::remove_if(reqs.begin(), reqs.end(),
                              [](void* r) {
                                if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
                                ucp_request_free(r);
                                return true;
                              }),
               reqs.end());
  };
  // A live peer that still holds a send of ours (its inbox is full: it is not
  // merging) is closed by force below, which cancels that send; UCX 1.13
  // asserts at ucp_worker_destroy when a graceful close leaves a rendezvous
  // send on the endpoint (ucp_ep.c, proto_reqs). Its goodbye goes first.
  // The same for a peer whose message this rank is still receiving: that
  // peer may force-close its own endpoint (it leaves too, or it took this
  // rank's goodbye as a failure), which over shared memory fails nothing on
  // this side, and the receive left on a gracefully closed endpoint made
  // ucp_worker_destroy assert the same way.
  const auto under_way_with = [&](int j) {
    if (peer(j)->inflight.load(std::memory_order_acquire) > 0) return true;
    if (const int si = source_of[static_cast<std::size_t>(j)]; si >= 0)
      for (const auto& rc : sources[static_cast<std::size_t>(si)].recv)
        if (rc.request) return true;
    return false;
  };
  if (std::any_of(neighbours.begin(), neighbours.end(), [&](int j) { return peer(j)->ep && under_way_with(j); }))
    for (reap(byes); !byes.empty() && std::chrono::steady_clock::now() < deadline; reap(byes)) {
      ucp_worker_progress(worker);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  closing.insert(closing.end(), byes.begin(), byes.end());
  for (int j : neighbours) {
    auto& p = *peer(j);
    if (!p.ep) continue;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // A peer that leaves a probe unanswered (stopped, most likely) is closed as
    // a dead one: a graceful close would wait close_timeout_s for a peer that
    // answers nothing, and a small message still queued to a stopped peer on a
    // gracefully closed endpoint made UCX 1.13 assert when the worker was
    // destroyed (a pong sent as a hello at start, since removed).
    rp.flags = p.dead.load() || unanswered(p) || under_way_with(j) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &rp);
    if (r && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
    p.ep = nullptr;
  }
  auto busy_recv = [&] {
    for (auto& src : sources)
      for (auto& rc : src.recv)
        if (rc.request) return true;
    return false;
  };
  while (std::chrono::steady_clock::now() < deadline) {
    ucp_worker_progress(worker);
    reap(closing);
    if (closing.empty() && !busy_recv()) break;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // A forced close completes at once but leaves UCX work (the endpoint's
  // discard) for the worker's next progress.
  for (int i = 0; i < 64 && ucp_worker_progress(worker) != 0; ++i) {
  }
  // Past the bound (a peer that stopped reading, e.g. SIGSTOP): the close
  // requests still in progress are released to UCX, which completes them
  // when the worker is destroyed; a request still held by us there is a
  // fatal assertion in UCX (ucp_ep.c: UCP_REQUEST_FLAG_RELEASED).
  for (void* r : closing) ucp_request_free(r);
  closing.clear();
  // Sends a forced close did not complete (UCX 1.13 leaves some pending):
  // counted as failed now, their push-sum share as lost, as for a dead peer.
  for (int j : neighbours)
    for (auto& c : peer(j)->ctx)
      if (c.held && !c.abandoned) {
        c.abandoned = true;
        send_done(c.peer, c.entry, UCS_ERR_CANCELED, c.length);
      }
  ucp_worker_destroy(worker);
  worker = nullptr;
}

}  // namespace gossip

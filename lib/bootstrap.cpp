#include "gossip/bootstrap.hpp"
#include "gossip/engine.hpp"

#include "bootstrap_detail.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#if defined(__linux__)
#include <linux/sockios.h>
#endif
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <system_error>

namespace gossip {

namespace {

using clock = std::chrono::steady_clock;
namespace rendezvous = detail::rendezvous;
using rendezvous::magic, rendezvous::max_blob, rendezvous::max_key;

void check_key_size(const std::string& key) {
  if (key.size() > max_key)
    throw config_error(fmt::format("bootstrap: key '{}…' of {} bytes exceeds the {} byte limit of the rendezvous's keys", key.substr(0, 64),
                                   key.size(), max_key));
}

void check_blob_size(const std::string& key, const bootstrap::blob& value) {
  check_key_size(key);
  if (value.size() > max_blob)
    throw config_error(fmt::format("bootstrap: blob '{}' of {} bytes exceeds the {} byte limit", key, value.size(), max_blob));
}

// The error for a put that rank 0's store refused as full (status 'F'):
// it holds or is receiving `held` bytes of at most `limit`.
config_error store_full(int rank, const std::string& where, const std::string& key, std::size_t bytes, std::uint64_t held,
                        std::uint64_t limit) {
  return config_error(fmt::format(
      "bootstrap: rank {}: rank 0's rendezvous at {} refused key '{}' ({} bytes): it holds or is receiving {} bytes of keys and values "
      "and takes at most "
      "{}; erase the keys that were read and are not needed again (bootstrap::erase), e.g. a model published for every epoch, or "
      "raise rank 0's limit (bootstrap::set_store_limit)",
      rank, where, key.substr(0, 256), bytes, held, limit));
}

clock::time_point deadline_after(std::chrono::duration<double> d) { return clock::now() + std::chrono::duration_cast<clock::duration>(d); }

int remaining_ms(clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1000));
}

struct fd_guard {
  int fd = -1;
  explicit fd_guard(int f = -1) : fd(f) {}
  fd_guard(const fd_guard&) = delete;
  fd_guard& operator=(const fd_guard&) = delete;
  ~fd_guard() {
    if (fd >= 0) ::close(fd);
  }
};

// Outcome of a socket operation that may be retried or reported by the caller.
enum class io { ok, timeout, closed, failed };

// With `idle` > 0 the deadline moves to now + idle whenever bytes move (never
// past `cap`): a slow but live peer (a lossy link) is not cut off, a silent
// one is. A `stop_fd` that becomes readable ends the wait (io::failed).
// `flags` go to send() besides MSG_NOSIGNAL and MSG_DONTWAIT (MSG_MORE).
io send_all(int fd, const void* data, std::size_t n, clock::time_point deadline, clock::duration idle = {}, int stop_fd = -1,
            clock::time_point cap = clock::time_point::max(), int flags = 0) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT | flags);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      if (idle.count() > 0) deadline = std::min(clock::now() + idle, cap);
      continue;
    }
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return errno == EPIPE || errno == ECONNRESET ? io::closed : io::failed;
    if (clock::now() >= deadline) return io::timeout;
    pollfd pfd[2] = {{fd, POLLOUT, 0}, {stop_fd, POLLIN, 0}};
    ::poll(pfd, stop_fd >= 0 ? 2 : 1, remaining_ms(deadline));
    if (stop_fd >= 0 && pfd[1].revents) return io::failed;
  }
  return io::ok;
}

io recv_all(int fd, void* data, std::size_t n, clock::time_point deadline, clock::duration idle = {}, int stop_fd = -1,
            clock::time_point cap = clock::time_point::max()) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      if (idle.count() > 0) deadline = std::min(clock::now() + idle, cap);
      continue;
    }
    if (k == 0) return io::closed;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return errno == ECONNRESET ? io::closed : io::failed;
    if (clock::now() >= deadline) return io::timeout;
    pollfd pfd[2] = {{fd, POLLIN, 0}, {stop_fd, POLLIN, 0}};
    ::poll(pfd, stop_fd >= 0 ? 2 : 1, remaining_ms(deadline));
    if (stop_fd >= 0 && pfd[1].revents) return io::failed;
  }
  return io::ok;
}

// Waits until what was written to `fd` has left the kernel (its send queue,
// unsent and unacknowledged bytes, is empty) or the reply starts; the queue
// shrinking counts as progress, so a large request crossing a slow link is not
// taken for silence. Where the queue cannot be read, returns at once.
io drain(int fd, clock::duration idle, clock::time_point cap) {
#if defined(SIOCOUTQ)
  auto deadline = std::min(clock::now() + idle, cap);
  for (int last = -1;;) {
    int queued = 0;
    if (::ioctl(fd, SIOCOUTQ, &queued) != 0 || queued == 0) return io::ok;
    if (last >= 0 && queued < last) deadline = std::min(clock::now() + idle, cap);
    last = queued;
    if (clock::now() >= deadline) return io::timeout;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 50) > 0) return io::ok;  // the reply (or a close) is there
  }
#else
  (void)fd, (void)idle, (void)cap;
  return io::ok;
#endif
}

// Closes with a reset: what the kernel still holds of an abandoned request is
// discarded rather than delivered late, after the request asked again (or a
// newer one for the same key).
void reset_on_close(int fd) {
  const linger l{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

struct endpoint {
  int family = 0, socktype = 0, protocol = 0;
  sockaddr_storage addr{};
  socklen_t len = 0;
};

std::vector<endpoint> resolve(const std::string& address, std::uint16_t port, bool passive, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(address.empty() ? nullptr : address.c_str(), service.c_str(), &hints, &res);
  std::vector<endpoint> out;
  if (rc != 0) {
    error = ::gai_strerror(rc);
    return out;
  }
  for (addrinfo* a = res; a; a = a->ai_next) {
    endpoint e{a->ai_family, a->ai_socktype, a->ai_protocol, {}, a->ai_addrlen};
    std::memcpy(&e.addr, a->ai_addr, a->ai_addrlen);
    out.push_back(e);
  }
  ::freeaddrinfo(res);
  return out;
}

std::optional<long long> parse_int(const char* s) {
  if (!s || !*s) return std::nullopt;
  long long v = 0;
  const char* end = s + std::strlen(s);
  auto [p, ec] = std::from_chars(s, end, v);
  if (ec != std::errc{} || p != end) return std::nullopt;
  return v;
}

// A store's identity: a restarted rank 0 (or its next store) gets another.
std::uint64_t new_store_id() {
  std::uint64_t id = 0;
  try {
    std::random_device rd;
    id = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  } catch (const std::exception&) {  // no entropy source: the time and the process tell stores apart
  }
  id ^= static_cast<std::uint64_t>(clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull ^ static_cast<std::uint64_t>(::getpid());
  return id == 0 ? 1 : id;
}

}  // namespace

rank_identity bootstrap::identity_from_env() {
  static constexpr const char* pairs[][2] = {{"GOSSIP_RANK", "GOSSIP_WORLD_SIZE"},
                                             {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                                             {"SLURM_PROCID", "SLURM_NTASKS"},
                                             {"RANK", "WORLD_SIZE"}};
  for (const auto& p : pairs) {
    const char* r = std::getenv(p[0]);
    const char* w = std::getenv(p[1]);
    if (!r && !w) continue;
    const auto rank = parse_int(r), world = parse_int(w);
    if (!r || !w)
      throw config_error(
          fmt::format("bootstrap: {} is set but {} is not; set both (rank and world size)", r ? p[0] : p[1], r ? p[1] : p[0]));
    if (!world || *world < 1 || *world > 1 << 20)
      throw config_error(fmt::format("bootstrap: {}='{}' is not a valid world size (an integer in 1..{})", p[1], w, 1 << 20));
    if (!rank || *rank < 0 || *rank >= *world)
      throw config_error(
          fmt::format("bootstrap: {}='{}' is not a valid rank for {}={} (an integer in 0..{})", p[0], r, p[1], *world, *world - 1));
    return {static_cast<int>(*rank), static_cast<int>(*world), fmt::format("{}/{}", p[0], p[1])};
  }
  throw config_error(
      "bootstrap: no rank and world size in the environment; set GOSSIP_RANK and GOSSIP_WORLD_SIZE, or launch with "
      "mpirun (OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE), srun (SLURM_PROCID/SLURM_NTASKS) or torchrun (RANK/WORLD_SIZE)");
}

bootstrap bootstrap::from_env(std::optional<std::chrono::duration<double>> given) {
  const auto id = identity_from_env();
  // Not given: [engine] timeout_s's default, or GOSSIP_TIMEOUT_S, read and
  // checked as the engine reads it.
  const auto timeout = given ? *given : engine_settings::from(options("[engine]").resolved(engine_option_specs(), "[engine]")).timeout;
  const char* addr = std::getenv("GOSSIP_MASTER_ADDR");
  const char* port_s = std::getenv("GOSSIP_MASTER_PORT");
  std::uint16_t port = 0;
  if (port_s) {
    const auto p = parse_int(port_s);
    if (!p || *p < 1 || *p > 65535)
      throw config_error(fmt::format("bootstrap: GOSSIP_MASTER_PORT='{}' is not a TCP port (1..65535)", port_s));
    port = static_cast<std::uint16_t>(*p);
  } else if (id.world > 1) {
    throw config_error(
        fmt::format("bootstrap: rank {} of {} ({}) needs GOSSIP_MASTER_PORT (and GOSSIP_MASTER_ADDR, default 127.0.0.1): "
                    "the TCP rendezvous that rank 0 serves",
                    id.rank, id.world, id.source));
  }
  return bootstrap(id.rank, id.world, addr && *addr ? addr : "127.0.0.1", port, timeout);
}

// Rank 0's key-value store and the thread that serves it.
struct bootstrap::server {
  std::mutex mutex;
  rendezvous::store store;
  std::uint64_t receiving = 0;  // bytes of the values that connections were admitted to receive (under `mutex`)
  std::condition_variable room;  // notified, under `mutex`, when values under way end or the store may have room
  // The value stored under `key`, or null; copied by the caller outside the lock.
  rendezvous::value_ptr find(std::string_view key) {
    std::lock_guard lock(mutex);
    const auto it = store.map.find(key);
    return it == store.map.end() ? nullptr : it->second;
  }
  // Stores `value` under `key` (the caller holds `mutex`); see rendezvous::put.
  rendezvous::put_result put_locked(bool once, const std::string& key, blob value) {
    return rendezvous::put(store, once, key, std::move(value));
  }
  int listen_fd = -1;
  int stop_pipe[2] = {-1, -1};  // written once at shutdown: readable from then on, for every waiter
  std::thread thread;
  clock::duration idle{};        // a request silent this long is dropped (the bootstrap timeout)
  std::mutex conn_mutex;
  std::condition_variable conn_done;
  int active = 0;                // connections being served, each on its own thread
  std::uint64_t id = new_store_id();  // this store's identity: another store on the same port has another

  ~server() {
    if (stop_pipe[1] >= 0) {
      const char c = 'x';
      [[maybe_unused]] auto n = ::write(stop_pipe[1], &c, 1);
    }
    if (thread.joinable()) thread.join();
    {
      // Handlers see the stop pipe and return at once.
      std::unique_lock lock(conn_mutex);
      conn_done.wait(lock, [&] { return active == 0; });
    }
    for (int fd : {listen_fd, stop_pipe[0], stop_pipe[1]})
      if (fd >= 0) ::close(fd);
  }

  // Each connection on its own thread: one slow client (a model crossing a
  // lossy link, where TCP sits out retransmission timeouts of many seconds)
  // delays no other.
  void serve() {
    for (;;) {
      pollfd pfd[2] = {{listen_fd, POLLIN, 0}, {stop_pipe[0], POLLIN, 0}};
      if (::poll(pfd, 2, -1) < 0 && errno != EINTR) return;
      if (pfd[1].revents) return;
      if (!(pfd[0].revents & POLLIN)) continue;
      const int c = ::accept(listen_fd, nullptr, nullptr);
      if (c < 0) {
        // Out of descriptors or memory, the pending connection stays and
        // poll() reports it again at once: wait a little (or for the stop).
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) ::poll(&pfd[1], 1, 50);
        continue;
      }
      set_nonblocking(c);
      {
        std::lock_guard lock(conn_mutex);
        ++active;
      }
      const auto run = [this, c] {
        {
          fd_guard g(c);
          handle(c);
        }
        std::lock_guard lock(conn_mutex);
        --active;
        conn_done.notify_all();
      };
      try {
        std::thread(run).detach();
      } catch (const std::system_error&) {
        run();  // no thread to be had: serve it here
      }
    }
  }

  // One request per connection; a stuck or foreign client is dropped after
  // `idle` of silence. A slow one that keeps sending is served to the end.
  void handle(int c) {
    const int stop = stop_pipe[0];
    bool abandoned = false;  // the client hung up, or the rendezvous stops: read nothing more, answer nothing
    const auto read = [&](void* p, std::size_t n) { return !abandoned && recv_all(c, p, n, clock::now() + idle, idle, stop) == io::ok; };
    rendezvous::request req;
    // A put's value is received only when it fits beside what the store
    // holds and what other connections are receiving (rendezvous::admit), so
    // that clients announcing large values cannot make rank 0 hold more
    // than its limit. One that could not be stored even with nothing else
    // under way is refused at once (read past, answered 'F', or 'X' for a
    // put once of a key that holds a value of another length); any other
    // waits for the values under way: until it fits, its client gives up
    // (a client that rank 0 answered before asks again when no byte moved
    // for a few seconds, and its new connection waits again), the
    // rendezvous stops (both: dropped unanswered), or `idle` passes
    // (answered 'F'). Waiting puts take no turns: small ones may pass a
    // large one. A stranger's value (answered 'S') is never held.
    std::uint64_t admitted = 0;
    const auto admit = [&](rendezvous::request& r, std::uint64_t length) {
      std::unique_lock lock(mutex);
      if (r.joined != 0 && r.joined != id) return false;
      const bool once = r.op == 'O';
      const auto until = clock::now() + idle;
      while (!rendezvous::admit(store, receiving, once, r.key, length)) {
        if (!rendezvous::admit(store, 0, once, r.key, length) || clock::now() >= until) {
          r.other_value = rendezvous::holds_other_length(store, once, r.key, length);  // as the store is now
          return false;
        }
        pollfd pfd[2] = {{c, POLLRDHUP, 0}, {stop, POLLIN, 0}};
        if (::poll(pfd, 2, 0) > 0 && ((pfd[0].revents & (POLLRDHUP | POLLHUP | POLLERR)) || pfd[1].revents)) {
          abandoned = true;
          return false;
        }
        room.wait_for(lock, std::chrono::milliseconds(50));
      }
      receiving += length;
      admitted = length;
      return true;
    };
    struct release_guard {
      server& s;
      std::uint64_t& n;
      ~release_guard() {
        if (n == 0) return;
        std::lock_guard lock(s.mutex);
        s.receiving -= n;
        s.room.notify_all();
      }
    } release{*this, admitted};
    switch (rendezvous::read_request(read, req, admit)) {
      case rendezvous::read_status::ok:
        break;
      case rendezvous::read_status::other_version: {
        // A client of another version is answered with this one's magic, so
        // that it can say so; anything else is not ours to answer.
        const blob reply = rendezvous::encode_reply('V', 0, {});
        // Closed with the request unread, the connection would be reset and
        // the reply maybe lost: end the writing side, and read what comes for a moment.
        if (send_all(c, reply.data(), reply.size(), clock::now() + idle, idle, stop) == io::ok) {
          ::shutdown(c, SHUT_WR);
          char sink[4096];
          const auto until = clock::now() + std::chrono::milliseconds(200);
          while (recv_all(c, sink, sizeof sink, until, {}, stop) == io::ok) {
          }
        }
        return;
      }
      case rendezvous::read_status::dropped:
      case rendezvous::read_status::foreign:
        return;
    }
    if (abandoned) return;  // a put of no bytes read nothing after it was given up on
    rendezvous::value_ptr reply_value;  // a found value is the stored one, sent without a copy
    char status;
    {
      std::lock_guard lock(mutex);
      const bool freed = admitted > 0 || req.op == 'D';
      receiving -= admitted;
      admitted = 0;
      status = rendezvous::answer(store, id, req, reply_value, receiving);
      if (freed || req.op == 'P') room.notify_all();  // a value no longer under way, a key erased or a value made smaller
    }
    const std::uint64_t length = reply_value ? reply_value->size() : 0;
    const auto head = rendezvous::encode_reply_head(status, id, length);
    // MSG_MORE: the head goes out with the value's first bytes, not alone.
    if (send_all(c, head.data(), head.size(), clock::now() + idle, idle, stop, clock::time_point::max(), length ? MSG_MORE : 0) == io::ok &&
        length)
      send_all(c, reply_value->data(), reply_value->size(), clock::now() + idle, idle, stop);
  }
};

bootstrap::bootstrap(int rank, int world, std::string address, std::uint16_t port, std::chrono::duration<double> timeout,
                     std::string origin)
    : m_rank(rank), m_world(world), m_address(std::move(address)), m_origin(std::move(origin)), m_port(port), m_timeout(timeout) {
  if (world < 1 || rank < 0 || rank >= world)
    throw config_error(fmt::format("bootstrap: rank {} is outside the world of {} ranks", rank, world));
  if (!(timeout.count() > 0)) throw config_error(fmt::format("bootstrap: timeout must be > 0 s, got {}", timeout.count()));
  if (world > 1 && port == 0)
    throw config_error(fmt::format("bootstrap: rank {} of {} needs a rendezvous port (GOSSIP_MASTER_PORT)", rank, world));
  // A host name or an IP address alone: brackets, a port or spaces would only
  // fail to resolve later, under a message that hides them.
  if (world > 1 && (m_address.empty() || m_address.find_first_of(" \t\r\n[]/") != std::string::npos ||
                    std::count(m_address.begin(), m_address.end(), ':') == 1))
    throw config_error(fmt::format("bootstrap: rank {}: the rendezvous address \"{}\" ({}) is not a host name or an IP address alone; "
                                   "give it without brackets, port or spaces (the port is set apart: {})",
                                   rank, m_address, m_origin.substr(0, m_origin.find(':')),
                                   m_origin.find(':') != std::string::npos ? m_origin.substr(m_origin.find(':') + 1) : "the port"));
  if (rank != 0) return;
  m_server = std::make_unique<server>();
  if (world == 1) return;  // no one to talk to; the store is used locally

  std::string err;
  auto addrs = resolve(m_address, port, true, err);
  if (addrs.empty())
    throw transport_error(fmt::format("bootstrap: rank 0 cannot resolve the rendezvous address {} ({}): {}", where(), m_origin, err));
  int last_errno = 0;
  for (const auto& a : addrs) {
    const int fd = ::socket(a.family, a.socktype | SOCK_CLOEXEC, a.protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&a.addr), a.len) == 0 && ::listen(fd, 128) == 0) {
      m_server->listen_fd = fd;
      break;
    }
    last_errno = errno;
    ::close(fd);
  }
  if (m_server->listen_fd < 0)
    throw transport_error(
        fmt::format("bootstrap: rank 0 cannot listen on the rendezvous {} ({}): {}; "
                    "pick a free port and an address of this host",
                    where(), m_origin, std::strerror(last_errno)));
  set_nonblocking(m_server->listen_fd);
  if (::pipe2(m_server->stop_pipe, O_CLOEXEC) != 0) throw transport_error(fmt::format("bootstrap: pipe: {}", std::strerror(errno)));
  m_server->idle = std::chrono::duration_cast<clock::duration>(std::max(timeout, std::chrono::duration<double>(5.0)));
  try {
    m_server->thread = std::thread([s = m_server.get()] { s->serve(); });
  } catch (const std::system_error& e) {
    throw transport_error(fmt::format("bootstrap: rank 0 cannot start the rendezvous server's thread: {}; the process's thread or "
                                      "memory limit (ulimit -u, ulimit -v) is too low",
                                      e.what()));
  }
}

bootstrap::bootstrap(bootstrap&&) noexcept = default;
bootstrap& bootstrap::operator=(bootstrap&&) noexcept = default;
bootstrap::~bootstrap() = default;

std::string bootstrap::where() const {
  return m_address.find(':') != std::string::npos ? fmt::format("[{}]:{}", m_address, m_port) : fmt::format("{}:{}", m_address, m_port);
}

std::string bootstrap::local_address() const {
  std::string err;
  for (const auto& a : resolve(m_address, m_port, false, err)) {
    const bool wildcard = a.family == AF_INET    ? reinterpret_cast<const sockaddr_in&>(a.addr).sin_addr.s_addr == htonl(INADDR_ANY)
                          : a.family == AF_INET6 ? IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6&>(a.addr).sin6_addr)
                                                 : true;
    if (wildcard) continue;
    fd_guard s(::socket(a.family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (s.fd < 0 || ::connect(s.fd, reinterpret_cast<const sockaddr*>(&a.addr), a.len) != 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::getsockname(s.fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* ip = local.ss_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in&>(local).sin_addr)
                                                : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6&>(local).sin6_addr);
    if (::inet_ntop(local.ss_family, ip, text, sizeof text)) return text;
  }
  return {};
}

bootstrap::blob bootstrap::request(char op, const std::string& key, const blob* value, clock::time_point deadline, char& status) {
  std::string err;
  const auto addrs = resolve(m_address, m_port, false, err);
  if (addrs.empty())
    throw transport_error(
        fmt::format("bootstrap: rank {} cannot resolve the rendezvous address {} ({}): {}", m_rank, where(), m_origin, err));
  std::string last = "no attempt";
  // Rank 0 listens from its start until it exits: once it has answered, a
  // refused connection means it has exited or died. A few retries cover a
  // full backlog; then the wait ends at once instead of at the deadline.
  const auto refused_since_limit = clock::now() + std::chrono::seconds(2);
  const auto gone = [&] {
    return fmt::format(
        "bootstrap: rank {} cannot reach rank 0's rendezvous at {} ({}) any more: {}; rank 0 "
        "answered before, so it has exited or died (its own output says why)",
        m_rank, where(), m_origin, last);
  };
  const auto describe = [&] {
    return fmt::format(
        "timed out after {:.1f} s waiting for rank 0's rendezvous at {} ({}), rank {} "
        "connecting: {}; check that rank 0 is running (it may have died) and that the address and port are right",
        m_timeout.count(), where(), m_origin, m_rank, last);
  };
  // Once rank 0 has answered, an exchange in which no byte moved for `stall`
  // is asked again on a new connection: on a lossy link TCP's retransmission
  // timeout backs off to tens of seconds, and a new connection starts again
  // from its initial timeout. Asking again is safe: a put stores the same
  // value again (anew, if the key was erased meanwhile: whoever erases reads
  // so), a get reads again, and an erase asked again finds nothing.
  const auto stall = std::chrono::duration_cast<clock::duration>(
      std::clamp(m_timeout / 12, std::chrono::duration<double>(1.0), std::chrono::duration<double>(5.0)));
  unsigned stalls = 0;
  const auto stalled = [&] {
    if (!m_contacted || clock::now() >= deadline) return false;
    ++stalls;
    last = fmt::format("{} exchange{} stalled, each asked again after {:.0f} s without a byte moving ({})", stalls,
                       stalls == 1 ? "" : "s", std::chrono::duration<double>(stall).count(),
                       op == 'P' || op == 'O' ? "a lossy link, or rank 0's store waiting for room for this value while other ranks' values arrive?"
                                              : "a lossy link?");
    return true;
  };
  for (unsigned attempt = 0;; ++attempt) {
    if (attempt > 0) {
      if (m_contacted && last == std::strerror(ECONNREFUSED) && clock::now() >= refused_since_limit) throw rendezvous_gone(gone());
      if (clock::now() >= deadline) throw timeout_error(describe());
      detail::check_interrupt();
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(20u * attempt, 200u)));
    }
    // Once rank 0 has answered, each phase of an attempt (connect, request,
    // reply) gets `stall` from its start, moved on while bytes move.
    const auto phase = [&] { return m_contacted ? std::min(deadline, clock::now() + stall) : deadline; };
    for (const auto& a : addrs) {
      fd_guard s(::socket(a.family, a.socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a.protocol));
      if (s.fd < 0) {
        last = std::strerror(errno);
        continue;
      }
      if (::connect(s.fd, reinterpret_cast<const sockaddr*>(&a.addr), a.len) != 0) {
        if (errno != EINPROGRESS) {
          last = std::strerror(errno);
          continue;
        }
        pollfd pfd{s.fd, POLLOUT, 0};
        const auto until = phase();
        while (::poll(&pfd, 1, remaining_ms(until)) == 0 && clock::now() < until) {
        }
        int e = 0;
        socklen_t len = sizeof e;
        ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &e, &len);
        if (!(pfd.revents & POLLOUT) || e != 0) {
          last = e ? std::strerror(e) : "connection not established";
          continue;
        }
      }
      const int one = 1;
      ::setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      const blob req = rendezvous::encode_request(op, m_store, key, value);
      const auto idle = m_contacted ? stall : clock::duration{};
      io r = send_all(s.fd, req.data(), req.size(), phase(), idle, -1, deadline);
      if (r == io::ok && m_contacted) r = drain(s.fd, stall, deadline);
      char head[rendezvous::reply_head_bytes] = {};  // zeros: what a reply cut short did not fill
      if (r == io::ok) r = recv_all(s.fd, head, sizeof head, phase());
      if (r == io::timeout) {
        if (stalled()) {
          reset_on_close(s.fd);
          break;
        }
        if (stalls == 0) last = "it accepted the connection but did not answer";
        throw timeout_error(describe());
      }
      // Once rank 0 has answered, an exchange cut short is the link's doing
      // (a lossy network resets connections): asking again is safe (above),
      // so ask again until the deadline.
      if (r != io::ok && m_contacted) {
        last = "the connection was cut before the reply (a failing link?)";
        continue;
      }
      // Another version's reply may be shorter (and then look cut short): its magic says which.
      const auto reply = rendezvous::parse_reply_head(head);
      if (reply.kind == rendezvous::reply_kind::other_version)
        throw transport_error(fmt::format("bootstrap: rank {}: rank 0's rendezvous at {} speaks version {} of its protocol and this rank "
                                          "version {}: run every rank from the same libgossip release",
                                          m_rank, where(), reply.version, magic[3]));
      if (r != io::ok || reply.kind == rendezvous::reply_kind::foreign)
        throw transport_error(
            fmt::format("bootstrap: rank {}: {} accepted the connection but {}",
                        m_rank, where(), r != io::ok ? "closed it without answering; either it is not a gossip rendezvous (wrong "
                                                        "GOSSIP_MASTER_PORT?) or the request stalled on the way for longer than the rendezvous's timeout (a failing link?)"
                                                     : "answered in a foreign protocol; it is not a gossip rendezvous (wrong GOSSIP_MASTER_PORT?)"));
      if (reply.kind == rendezvous::reply_kind::replaced)
        throw rendezvous_replaced(fmt::format(
            "bootstrap: rank {}: the rendezvous at {} ({}) is no longer the one this rank joined: rank 0 has started another one on "
            "that port since (a new run, or a new Engine in rank 0's process), so the run this rank belongs to is over there; its "
            "rank 0 has finished or was restarted (its output says which)",
            m_rank, where(), m_origin));
      const std::uint64_t len = reply.length;
      if (reply.kind == rendezvous::reply_kind::too_long)
        throw transport_error(
            fmt::format("bootstrap: rank {}: {} sent a reply of {} bytes; not a gossip rendezvous", m_rank, where(), len));
      // Grown as it arrives, as the server reads a value: a reply cut short
      // holds no more than what came.
      blob out;
      io rr = io::ok;
      while (rr == io::ok && out.size() < len) {
        const std::size_t at = out.size(), n = static_cast<std::size_t>(std::min<std::uint64_t>(len - at, rendezvous::value_chunk));
        out.resize(at + n);
        rr = recv_all(s.fd, out.data() + at, n, phase(), idle, -1, deadline);
      }
      if (rr != io::ok) {
        if (rr == io::timeout) {
          if (stalled()) {
            reset_on_close(s.fd);
            break;
          }
          if (stalls == 0) last = "its reply stalled";
          throw timeout_error(describe());
        }
        last = "its reply was cut short (a failing link?)";
        if (m_contacted) continue;
        throw transport_error(fmt::format("bootstrap: rank {}: the reply from {} was cut short", m_rank, where()));
      }
      status = reply.status;
      m_contacted = true;
      if (m_store == 0) m_store = reply.store;
      return out;
    }
  }
}

// What a put's status says: 'Y' stored, 'X' another value is there; 'F'
// (the store is full, `answer` the bytes it holds and its limit) throws config_error.
char bootstrap::put_status(char op, const std::string& key, const blob& value) {
  check_blob_size(key, value);
  std::uint64_t held = 0, limit = 0;
  if (m_server) {
    std::lock_guard lock(m_server->mutex);
    const auto result = m_server->put_locked(op == 'O', key, blob(value));
    m_server->room.notify_all();  // a value made smaller frees room
    switch (result) {
      case rendezvous::put_result::stored:
        return 'Y';
      case rendezvous::put_result::other_value:
        return 'X';
      case rendezvous::put_result::full:
        held = m_server->store.bytes + m_server->receiving;
        limit = m_server->store.limit;
        break;
    }
  } else {
    char status = 0;
    const blob answer = request(op, key, &value, deadline_after(m_timeout), status);
    if (status != 'F') return status;
    if (answer.size() == sizeof held + sizeof limit) {
      std::memcpy(&held, answer.data(), sizeof held);
      std::memcpy(&limit, answer.data() + sizeof held, sizeof limit);
    }
  }
  throw store_full(m_rank, where(), key, value.size(), held, limit);
}

void bootstrap::set_store_limit(std::uint64_t bytes) {
  if (!m_server) throw config_error(fmt::format("bootstrap: rank {} holds no store (rank 0 serves it): set_store_limit is for rank 0", m_rank));
  std::lock_guard lock(m_server->mutex);
  m_server->store.limit = bytes;
  m_server->room.notify_all();
}

void bootstrap::put(const std::string& key, const blob& value) { (void)put_status('P', key, value); }

bool bootstrap::erase(const std::string& key) {
  check_key_size(key);
  if (m_server) {
    std::lock_guard lock(m_server->mutex);
    m_server->room.notify_all();
    return rendezvous::erase(m_server->store, key);
  }
  char status = 0;
  (void)request('D', key, nullptr, deadline_after(m_timeout), status);
  return status == 'Y';
}

void bootstrap::put_once(const std::string& key, const blob& value, const std::string& what) {
  const bool stored = put_status('O', key, value) == 'Y';
  if (!stored)
    throw config_error(fmt::format(
        "bootstrap: rank {}: another process has published {} at the rendezvous {} ({}) already (key '{}'): a rank number started "
        "twice, or another job using the same port; start each rank number once (GOSSIP_RANK / RANK), and give each job a port of its own",
        m_rank, what, where(), m_origin, key));
}

bootstrap::blob bootstrap::get(const std::string& key, const std::string& waiting_for) { return get(key, waiting_for, m_timeout); }

bootstrap::blob bootstrap::get(const std::string& key, const std::string& waiting_for, std::chrono::duration<double> timeout) {
  check_key_size(key);
  const auto deadline = deadline_after(timeout);
  // A poll may take this much past the deadline to be answered: the last
  // one, sent at the deadline, is then not cut short, and one that rank 0
  // leaves unanswered that long says that rank 0 stalled, not that the key never came.
  const auto grace = std::min(std::chrono::duration_cast<clock::duration>(std::chrono::seconds(1)),
                              std::chrono::duration_cast<clock::duration>(timeout));
  for (unsigned i = 0;; ++i) {
    const bool last = clock::now() >= deadline;
    if (m_server) {
      if (const auto v = m_server->find(key)) return *v;
    } else {
      char status = 0;
      blob b;
      try {
        b = request('G', key, nullptr, std::max(deadline, clock::now() + grace), status);
      } catch (const timeout_error&) {
        // Rank 0 answered this wait's earlier polls: it stalled on this one.
        if (i == 0) throw;
        throw timeout_error(fmt::format(
            "timed out after {:.1f} s waiting for {} at the rendezvous {} (rank {} asking for '{}'; rank 0 answered {} polls, then left "
            "the last one unanswered for {:.1f} s: is rank 0 stalled or overloaded?)",
            timeout.count(), waiting_for, where(), m_rank, key, i, std::chrono::duration<double>(grace).count()));
      }
      if (status == 'Y') return b;
    }
    if (last)
      throw timeout_error(fmt::format("timed out after {:.1f} s waiting for {} at the rendezvous {} (rank {} asking for '{}')",
                                      timeout.count(), waiting_for, where(), m_rank, key));
    detail::check_interrupt();
    const auto pause = std::chrono::duration_cast<clock::duration>(std::chrono::milliseconds(std::min(5u + 5u * i, 100u)));
    std::this_thread::sleep_for(std::min(pause, std::max(deadline - clock::now(), clock::duration::zero())));
  }
}

std::optional<bootstrap::blob> bootstrap::try_get(const std::string& key) {
  check_key_size(key);
  if (m_server) {
    if (const auto v = m_server->find(key)) return *v;
    return std::nullopt;
  }
  char status = 0;
  blob b = request('G', key, nullptr, deadline_after(m_timeout), status);
  if (status == 'Y') return b;
  return std::nullopt;
}

// The store's name of the next barrier called `name`: the name itself the
// first time, then name#1, name#2, … (a completed barrier's keys stay in the
// store, and would let a later one of the same name through at once).
std::string bootstrap::barrier_key(const std::string& name) const {
  const auto it = m_barriers.find(name);
  return it == m_barriers.end() ? name : fmt::format("{}#{}", name, it->second);
}

void bootstrap::barrier(const std::string& name) {
  const std::string n = barrier_key(name);
  // Two phases, so that rank 0 — which serves the store — returns last and
  // may exit right after without stranding a rank still asking.
  put(fmt::format("{}/arrive/{}", n, m_rank), blob{});
  for (int r = 0; r < m_world; ++r)
    if (r != m_rank) get(fmt::format("{}/arrive/{}", n, r), fmt::format("rank {} to reach barrier '{}'", r, name));
  put(fmt::format("{}/ack/{}", n, m_rank), blob{});
  if (m_rank == 0)
    for (int r = 1; r < m_world; ++r) get(fmt::format("{}/ack/{}", n, r), fmt::format("rank {} to leave barrier '{}'", r, name));
  ++m_barriers[name];
}

void bootstrap::barrier(const std::string& name, std::span<const int> known_dead) {
  const std::string n = barrier_key(name);
  const auto key = [&](const char* phase, int r) { return fmt::format("{}/{}/{}", n, phase, r); };
  put(key("arrive", m_rank), rendezvous::encode_ranks(known_dead));
  if (m_rank != 0) {
    // Rank 0 decides who is through (it reads its own store); then it waits
    // for this rank's ack before it may exit.
    // Rank 0 may reach the barrier a whole timeout later and then wait its own.
    (void)get(n + "/done", fmt::format("rank 0 to see every rank at barrier '{}' (or hear that it died)", name), 2 * m_timeout);
    try {
      put(key("ack", m_rank), blob{});
    } catch (const transport_error&) {
      // Rank 0 decided and left without waiting: some rank reported this one dead.
    }
    ++m_barriers[name];
    return;
  }
  // Each rank: arrived (its key is there), or found dead by one that arrived.
  std::vector<char> arrived(static_cast<std::size_t>(m_world), 0), dead(static_cast<std::size_t>(m_world), 0);
  arrived[0] = 1;
  rendezvous::mark_dead(known_dead, dead);
  const auto deadline = deadline_after(m_timeout);
  for (unsigned i = 0;; ++i) {
    std::vector<int> missing;
    for (int r = 1; r < m_world; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      if (arrived[ur]) continue;
      if (auto b = try_get(key("arrive", r))) {
        arrived[ur] = 1;
        rendezvous::mark_dead(rendezvous::decode_ranks(*b), dead);
      } else if (!dead[ur]) {
        missing.push_back(r);
      }
    }
    if (missing.empty()) break;
    if (clock::now() >= deadline)
      throw timeout_error(fmt::format("timed out after {:.1f} s waiting for rank(s) {} to reach barrier '{}' at the rendezvous {} (no "
                                      "rank that got there found them dead)",
                                      m_timeout.count(), fmt::join(missing, ", "), name, where()));
    detail::check_interrupt();
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(5u + 5u * i, 100u)));
  }
  put(n + "/done", blob{});
  // Rank 0 stays until every rank that arrived has read "done".
  for (int r = 1; r < m_world; ++r)
    if (arrived[static_cast<std::size_t>(r)]) (void)get(key("ack", r), fmt::format("rank {} to leave barrier '{}'", r, name));
  ++m_barriers[name];
}

void bootstrap::pass(const std::string& name) {
  GOSSIP_ASSERT(m_rank != 0, "bootstrap: rank 0 serves the store and cannot pass barrier '{}' early", name);
  const std::string n = barrier_key(name);
  put(fmt::format("{}/arrive/{}", n, m_rank), blob{});
  put(fmt::format("{}/ack/{}", n, m_rank), blob{});
  ++m_barriers[name];
}

}  // namespace gossip

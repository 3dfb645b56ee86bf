// Multi-process tests of the UCX transport and the bootstrap rendezvous.
// Every rank is a fork()ed process on 127.0.0.1 (tests/harness.hpp): every
// child runs under alarm() and the parent kills (by PID) what outlives its deadline.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <optional>
#include <thread>

#include "gossip/bootstrap.hpp"
#include "gossip/gossip.hpp"
#include "gossip/transports/ucx/ucx.hpp"
#include "harness.hpp"
#include "test_support.hpp"

using namespace gossip;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

namespace {

using harness::free_port;

// Exit with 77 (meson: skipped) when UCX cannot make a context here.
void require_ucx() {
  static bool checked = false;
  if (checked) return;
  const std::string why = harness::probe_in_child([] {
    ::setenv("UCX_NET_DEVICES", "lo", 0);
    return ucx_transport::probe();
  });
  if (!why.empty()) {
    std::fprintf(stderr, "SKIP: UCX cannot create a context and worker here: %s\n", why.c_str());
    std::exit(77);
  }
  checked = true;
}

// Runs fn(rank) in `world` forked processes with the given UCX_TLS; returns
// how each ended. "tcp/listener" (or "tcp/worker"): UCX_TLS=tcp with
// GOSSIP_UCX_CONNECT=listener (worker).
std::vector<harness::child_end> run_procs(int world, const char* tls, int timeout_s, const std::function<int(int)>& fn) {
  harness::child_options o;
  const std::string_view t = tls;
  const auto slash = t.find('/');
  o.env = {{"UCX_TLS", std::string(t.substr(0, slash))}, {"UCX_NET_DEVICES", "lo"}};
  if (slash != std::string_view::npos) o.env.emplace_back("GOSSIP_UCX_CONNECT", std::string(t.substr(slash + 1)));
  o.alarm_s = static_cast<unsigned>(timeout_s);
  o.label = fmt::format("UCX_TLS={}", tls);
  return harness::run_ranks(world, o, fn);
}

// A deterministic payload: raw 32-bit patterns (NaNs and denormals included),
// compared bit for bit.
void fill(std::byte* p, std::size_t elements, int sender, std::uint64_t step) {
  std::mt19937 g(static_cast<std::uint32_t>(sender * 1000003 + static_cast<int>(step) * 7919 + 17));
  for (std::size_t i = 0; i < elements; ++i) {
    const std::uint32_t v = g();
    std::memcpy(p + i * 4, &v, 4);
  }
}

// Rank 0 serves the rendezvous, so it must be the last to leave: everyone
// arrives, rank 0 releases, everyone acknowledges, rank 0 returns.
void final_barrier(bootstrap& b, const std::string& name, const std::vector<int>& ranks) {
  b.put(name + "/arrive/" + std::to_string(b.rank()), {});
  for (int r : ranks)
    if (r != b.rank()) b.get(name + "/arrive/" + std::to_string(r), fmt::format("rank {} at barrier {}", r, name));
  b.put(name + "/ack/" + std::to_string(b.rank()), {});
  if (b.rank() == 0)
    for (int r : ranks)
      if (r != 0) b.get(name + "/ack/" + std::to_string(r), fmt::format("rank {} to acknowledge barrier {}", r, name));
}

// One rank driving a ucx_transport directly (no engine): the transport contract.
struct direct {
  int rank, world;
  std::size_t elements, message_bytes;
  std::shared_ptr<bootstrap> boot;
  model_layout layout;
  std::vector<int> others;
  inbox in;
  std::vector<std::byte> send[2];
  ucx_transport t;
  std::vector<received> got;
  std::vector<std::uint64_t> next_step;  // per rank: the step expected next
  std::size_t received_total = 0;
  double timeout_s = 20;  // transport_setup::timeout ([engine] timeout_s)

  direct(int r, int w, std::uint16_t port, std::size_t n, std::size_t layout_extra = 0, ucx_options o = {},
         const std::string& address = "127.0.0.1")
      : rank(r),
        world(w),
        elements(n),
        message_bytes((sizeof(wire_header) + n * 4 + 63) / 64 * 64),
        boot(std::make_shared<bootstrap>(r, w, address, port, std::chrono::duration<double>(20.0))),
        t(boot, o),
        got(static_cast<std::size_t>(4 * w)),
        next_step(static_cast<std::size_t>(w), 0) {
    layout = {{"w", n + layout_extra, dtype::f32}};
    for (int j = 0; j < w; ++j)
      if (j != r) others.push_back(j);
    in = inbox(others, 2, message_bytes);
    for (auto& s : send) s.assign(message_bytes, std::byte{0});
  }

  void attach() {
    transport_setup s;
    s.rank = rank;
    s.world = world;
    s.layout = layout;
    s.layout_fingerprint = fingerprint(layout);
    s.config_fingerprint = 42;
    s.sources = others;
    s.targets = others;
    s.message_bytes = message_bytes;
    s.inbox = &in;
    s.timeout = std::chrono::duration<double>(timeout_s);
    t.attach(s);
  }

  // Collects, verifies order and content bit for bit, releases. Returns messages seen.
  std::size_t poll_once() {
    const std::size_t n = t.collect(0, got);
    std::vector<std::byte> expect(elements * 4);
    for (std::size_t i = 0; i < n; ++i) {
      const auto& m = got[i];
      auto& want = next_step.at(static_cast<std::size_t>(m.sender));
      if (m.step != want) {
        std::string all;
        for (std::size_t k = 0; k < n; ++k) all += fmt::format(" {}:{}", got[k].sender, got[k].step);
        throw error(
            fmt::format("rank {}: from rank {} got step {}, expected {} (lost or reordered); batch{}", rank, m.sender, m.step, want, all));
      }
      ++want;
      if (m.elements != elements)
        throw error(fmt::format("rank {}: {} elements from rank {}, expected {}", rank, m.elements, m.sender, elements));
      if (m.weight != static_cast<double>(m.step) + 0.25) throw error(fmt::format("rank {}: wrong weight from rank {}", rank, m.sender));
      fill(expect.data(), elements, m.sender, m.step);
      if (std::memcmp(expect.data(), m.data, elements * 4) != 0)
        throw error(fmt::format("rank {}: payload of step {} from rank {} differs from what was sent", rank, m.step, m.sender));
    }
    t.release(0);
    received_total += n;
    return n;
  }

  // Posts step `s` to `targets` from buffer s % 2, waiting (bounded, while receiving) for that buffer.
  std::vector<post_status> post_step(std::uint64_t s, const std::vector<int>& targets) {
    auto& buf = send[s % 2];
    const auto deadline = clock_type::now() + 20s;
    while (t.busy(buf.data())) {
      poll_once();
      if (clock_type::now() > deadline) throw timeout_error(fmt::format("rank {}: send buffer still busy", rank));
      std::this_thread::sleep_for(100us);
    }
    wire_header h;
    h.sender = rank;
    h.step = s;
    h.weight = static_cast<double>(s) + 0.25;
    h.payload_bytes = elements * 4;
    h.layout_fingerprint = fingerprint(layout);
    std::memcpy(buf.data(), &h, sizeof h);
    fill(buf.data() + sizeof h, elements, rank, s);
    std::vector<post_status> st;
    for (int j : targets) st.push_back(t.post(j, {buf.data(), sizeof h + elements * 4}, s));
    return st;
  }

  // For tests that stop and continue each other: this rank's pid through the rendezvous, and another's.
  void publish_pid() {
    const pid_t me = ::getpid();
    boot->put(fmt::format("pid/{}", rank), bootstrap::blob(reinterpret_cast<const std::byte*>(&me), reinterpret_cast<const std::byte*>(&me) + sizeof me));
  }
  pid_t pid_of(int r) {
    const auto b = boot->get(fmt::format("pid/{}", r), fmt::format("rank {}'s pid", r));
    pid_t pid = 0;
    std::memcpy(&pid, b.data(), sizeof pid);
    return pid;
  }

  // leave(), timed: seconds it took.
  double timed_leave() {
    const auto t0 = clock_type::now();
    t.leave();
    return std::chrono::duration<double>(clock_type::now() - t0).count();
  }

  // Waits (up to 20 s) until dead_peers() reports a peer gone; returns what it reported.
  received wait_gone() {
    const auto deadline = clock_type::now() + 20s;
    std::vector<received> gone(static_cast<std::size_t>(world));
    while (t.dead_peers(gone) == 0) {
      if (clock_type::now() > deadline) throw error(fmt::format("rank {}: no peer was reported gone within 20 s", rank));
      std::this_thread::sleep_for(1ms);
    }
    return gone[0];
  }

  void receive_until(std::size_t total, std::chrono::seconds limit) {
    const auto deadline = clock_type::now() + limit;
    while (received_total < total) {
      if (poll_once() == 0) std::this_thread::sleep_for(200us);
      if (clock_type::now() > deadline)
        throw timeout_error(fmt::format("rank {}: received {} of {} messages", rank, received_total, total));
    }
  }
};

// Every rank sends `rounds` models to every other rank; all arrive, in order, bit for bit.
int exchange(int rank, int world, std::uint16_t port, std::size_t elements, int rounds) {
  direct d(rank, world, port, elements);
  d.attach();
  for (int s = 0; s < rounds; ++s)
    for (auto st : d.post_step(static_cast<std::uint64_t>(s), d.others))
      if (st != post_status::ok) throw error(fmt::format("rank {}: post failed at step {}", rank, s));
  d.receive_until(static_cast<std::size_t>(rounds * (world - 1)), 20s);
  d.t.flush(std::chrono::duration<double>(10.0));
  const auto c = d.t.counters();
  if (c.messages_received != static_cast<std::uint64_t>(rounds * (world - 1)) || c.messages_sent != c.messages_received || c.dropped != 0)
    throw error(fmt::format("rank {}: counters sent {} received {} dropped {}", rank, c.messages_sent, c.messages_received, c.dropped));
  final_barrier(*d.boot, "end", [&] {
    std::vector<int> all(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) all[static_cast<std::size_t>(r)] = r;
    return all;
  }());
  d.t.leave();
  return 0;
}

void check_all_ok(const std::vector<harness::child_end>& out) {
  for (std::size_t r = 0; r < out.size(); ++r) {
    INFO("rank " << r << " exited=" << out[r].exited << " code=" << out[r].code << " signal=" << out[r].signal);
    CHECK((out[r].exited && out[r].code == 0));
  }
}

struct env_guard {
  static constexpr const char* names[] = {
      "GOSSIP_RANK", "GOSSIP_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
      "RANK",        "WORLD_SIZE",        "GOSSIP_MASTER_ADDR",   "GOSSIP_MASTER_PORT"};
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  env_guard() {
    for (const char* n : names) {
      const char* v = std::getenv(n);
      saved.emplace_back(n, v ? std::optional<std::string>(v) : std::nullopt);
      ::unsetenv(n);
    }
  }
  ~env_guard() {
    for (auto& [n, v] : saved)
      if (v)
        ::setenv(n.c_str(), v->c_str(), 1);
      else
        ::unsetenv(n.c_str());
  }
};

}  // namespace

TEST_CASE("bootstrap: rank and world size from the environment, in order of precedence") {
  env_guard g;
  CHECK_THROWS_WITH_AS(bootstrap::identity_from_env(), doctest::Contains("GOSSIP_RANK"), config_error);
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  CHECK(bootstrap::identity_from_env().rank == 1);
  ::setenv("SLURM_PROCID", "2", 1);
  ::setenv("SLURM_NTASKS", "4", 1);
  CHECK(bootstrap::identity_from_env().rank == 2);
  ::setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  CHECK(bootstrap::identity_from_env().rank == 3);
  ::setenv("GOSSIP_RANK", "0", 1);
  ::setenv("GOSSIP_WORLD_SIZE", "2", 1);
  const auto id = bootstrap::identity_from_env();
  CHECK(id.rank == 0);
  CHECK(id.world == 2);
  CHECK(id.source == "GOSSIP_RANK/GOSSIP_WORLD_SIZE");
  ::setenv("GOSSIP_RANK", "2", 1);
  CHECK_THROWS_WITH_AS(bootstrap::identity_from_env(), doctest::Contains("GOSSIP_RANK='2'"), config_error);
  ::setenv("GOSSIP_RANK", "x", 1);
  CHECK_THROWS_AS(bootstrap::identity_from_env(), config_error);
  ::unsetenv("GOSSIP_WORLD_SIZE");
  CHECK_THROWS_WITH_AS(bootstrap::identity_from_env(), doctest::Contains("GOSSIP_WORLD_SIZE is not"), config_error);
  ::setenv("GOSSIP_RANK", "1", 1);
  ::setenv("GOSSIP_WORLD_SIZE", "2", 1);
  CHECK_THROWS_WITH_AS(bootstrap::from_env(), doctest::Contains("GOSSIP_MASTER_PORT"), config_error);
  ::setenv("GOSSIP_MASTER_PORT", "70000", 1);
  CHECK_THROWS_AS(bootstrap::from_env(), config_error);
  // The rendezvous waits as long as the engine: GOSSIP_TIMEOUT_S, checked alike.
  ::setenv("GOSSIP_MASTER_PORT", "29999", 1);
  for (const char* bad : {"abc", "0", "-1", "nan", "1e99"}) {
    ::setenv("GOSSIP_TIMEOUT_S", bad, 1);
    const auto message = fmt::format("environment variable GOSSIP_TIMEOUT_S={}", bad);
    CHECK_THROWS_WITH_AS(bootstrap::from_env(), doctest::Contains(message.c_str()), config_error);
  }
  ::unsetenv("GOSSIP_TIMEOUT_S");
  ::unsetenv("GOSSIP_MASTER_PORT");
}

sockaddr_in loopback_address(std::uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  return a;
}

// A TCP connection to 127.0.0.1:port, as a client of rank 0's rendezvous.
int connect_loopback(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const auto a = loopback_address(port);
  REQUIRE(::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

// A listening TCP socket on 127.0.0.1:port: a stand-in for rank 0's rendezvous.
int listen_loopback(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const auto a = loopback_address(port);
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  REQUIRE(::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 8) == 0);
  return fd;
}

// A stand-in for rank 0's rendezvous on 127.0.0.1:port: answer(fd, n) is
// called for the n-th connection it accepts (from 0), which it then closes.
class stand_in_rendezvous {
 public:
  stand_in_rendezvous(std::uint16_t port, std::function<void(int, int)> answer) : m_fd(listen_loopback(port)) {
    m_thread = std::thread([this, answer = std::move(answer)] {
      for (int n = 0; !m_stop;) {
        pollfd p{m_fd, POLLIN, 0};
        if (::poll(&p, 1, 50) <= 0) continue;
        const int c = ::accept(m_fd, nullptr, nullptr);
        if (c < 0) continue;
        answer(c, n++);
        ::close(c);
      }
    });
  }
  ~stand_in_rendezvous() {
    m_stop = true;
    m_thread.join();
    ::close(m_fd);
  }
  stand_in_rendezvous(const stand_in_rendezvous&) = delete;
  stand_in_rendezvous& operator=(const stand_in_rendezvous&) = delete;

 private:
  int m_fd;
  std::atomic<bool> m_stop{false};
  std::thread m_thread;
};

// Rendezvous replies: magic, 'N' (not there yet) or 'Y', the store's u64
// identity (7 here), u64 length, blob.
constexpr char not_there_yet[21] = {'G', 'R', 'V', '5', 'N', 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

TEST_CASE("bootstrap: an unreachable master or a wrong port is a clear error within the timeout") {
  const std::uint16_t port = free_port();
  const auto timeout = std::chrono::duration<double>(1.0);

  SUBCASE("nothing listens: timeout_error naming the address") {
    const auto t0 = clock_type::now();
    bootstrap b(1, 2, "127.0.0.1", port, timeout);
    CHECK_THROWS_WITH_AS(b.get("k", "rank 0's blob"), doctest::Contains(fmt::format("127.0.0.1:{}", port).c_str()), timeout_error);
    CHECK_THROWS_AS(b.put("k", {}), timeout_error);
    CHECK(clock_type::now() - t0 < 4s);
  }
  SUBCASE("a foreign server: transport_error saying it is not a rendezvous") {
    std::atomic<bool> silent{false};
    stand_in_rendezvous server(port, [&](int c, int) {
      if (silent) {
        std::this_thread::sleep_for(1500ms);
      } else {
        const char reply[] = "HTTP/1.0 400 Bad Request\r\n\r\n";
        [[maybe_unused]] auto n = ::write(c, reply, sizeof reply - 1);
      }
    });
    bootstrap b(1, 2, "127.0.0.1", port, timeout);
    CHECK_THROWS_WITH_AS(b.get("k", "rank 0's blob"), doctest::Contains("not a gossip rendezvous"), transport_error);
    silent = true;
    const auto t0 = clock_type::now();
    CHECK_THROWS_WITH_AS(b.get("k", "rank 0's blob"), doctest::Contains(fmt::format("127.0.0.1:{}", port).c_str()), timeout_error);
    CHECK(clock_type::now() - t0 < 3s);
  }
  SUBCASE("a rendezvous that answered earlier polls but not the last: the error names what was awaited") {
    stand_in_rendezvous server(port, [](int c, int n) {
      if (n < 3) {
        [[maybe_unused]] auto k = ::write(c, not_there_yet, sizeof not_there_yet);
      } else {
        std::this_thread::sleep_for(1500ms);  // then a poll that is never answered
      }
    });
    bootstrap b(1, 2, "127.0.0.1", port, timeout);
    try {
      b.get("k", "rank 3's epoch model");
      FAIL("get() returned");
    } catch (const timeout_error& e) {
      const std::string what = e.what();
      CHECK_MESSAGE(what.find("waiting for rank 3's epoch model") != std::string::npos, what);
      CHECK_MESSAGE(what.find("answered 3 polls") != std::string::npos, what);
    }
  }
  SUBCASE("a rendezvous that answered before: an exchange the link cuts is asked again") {
    std::atomic<int> cut{0};
    // The first poll: "not there yet"; the next two: closed unanswered (a
    // reset on a lossy link); then the blob, one byte 'x'.
    stand_in_rendezvous server(port, [&](int c, int n) {
      if (n == 0) {
        [[maybe_unused]] auto k = ::write(c, not_there_yet, sizeof not_there_yet);
      } else if (n <= 2) {
        ++cut;
      } else {
        const char reply[22] = {'G', 'R', 'V', '5', 'Y', 7, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 'x'};
        [[maybe_unused]] auto k = ::write(c, reply, sizeof reply);
      }
    });
    bootstrap b(1, 2, "127.0.0.1", port, std::chrono::duration<double>(10.0));
    bootstrap::blob blob;
    CHECK_NOTHROW(blob = b.get("k", "rank 0's blob"));
    CHECK(cut == 2);
    CHECK((blob.size() == 1 && static_cast<char>(blob[0]) == 'x'));
  }
  SUBCASE("a rendezvous that answered before: an exchange that stalls is asked again on a new connection") {
    // The first poll: "not there yet"; the second: read, then left open and
    // silent (TCP backing off on a lossy link); the third: the blob. With a
    // 12 s timeout the client gives up on a silent exchange after 1 s.
    std::atomic<int> held{-1};
    stand_in_rendezvous server(port, [&](int c, int n) {
      if (n == 0) {
        [[maybe_unused]] auto k = ::write(c, not_there_yet, sizeof not_there_yet);
      } else if (n == 1) {
        held = ::dup(c);
      } else {
        const char reply[22] = {'G', 'R', 'V', '5', 'Y', 7, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 'x'};
        [[maybe_unused]] auto k = ::write(c, reply, sizeof reply);
      }
    });
    bootstrap b(1, 2, "127.0.0.1", port, std::chrono::duration<double>(12.0));
    const auto t0 = clock_type::now();
    bootstrap::blob blob;
    CHECK_NOTHROW(blob = b.get("k", "rank 0's blob"));
    CHECK((blob.size() == 1 && static_cast<char>(blob[0]) == 'x'));
    CHECK(clock_type::now() - t0 < 6s);
    if (held >= 0) ::close(held);
  }
  SUBCASE("an address that does not resolve") {
    bootstrap b(1, 2, "no-such-host.invalid", port, timeout);
    CHECK_THROWS_WITH_AS(b.get("k", "rank 0's blob"), doctest::Contains("no-such-host.invalid"), transport_error);
  }
}

TEST_CASE("bootstrap: a client that connects and stays silent delays neither other ranks nor rank 0's exit") {
  // Rank 0 serves each connection on its own thread and drops one only after
  // its timeout of silence (a slow upload over a lossy link is not cut off).
  const std::uint16_t port = free_port();
  const auto timeout = std::chrono::duration<double>(30.0);
  std::optional<bootstrap> root(std::in_place, 0, 2, "127.0.0.1", port, timeout);
  std::vector<int> silent;
  for (int i = 0; i < 3; ++i) {
    const int fd = connect_loopback(port);
    const char part[] = "GRV5";  // the start of a request, then nothing
    REQUIRE(::write(fd, part, 4) == 4);
    silent.push_back(fd);
  }
  std::this_thread::sleep_for(100ms);
  const auto t0 = clock_type::now();
  bootstrap b(1, 2, "127.0.0.1", port, timeout);
  const bootstrap::blob v{std::byte{7}, std::byte{9}};
  b.put("k", v);
  CHECK(b.get("k", "rank 0's blob") == v);
  CHECK(clock_type::now() - t0 < 10s);  // served at once, not after the silent ones' 30 s
  const auto t1 = clock_type::now();
  root.reset();  // the handlers of the silent connections see the stop and return
  CHECK(clock_type::now() - t1 < 10s);
  for (int fd : silent) ::close(fd);
}

TEST_CASE("bootstrap: put, get and barrier across processes") {
  const std::uint16_t port = free_port();
  const auto out = run_procs(3, "tcp", 20, [&](int r) {
    bootstrap b(r, 3, "127.0.0.1", port, std::chrono::duration<double>(10.0));
    bootstrap::blob mine(static_cast<std::size_t>(1000 * (r + 1)), static_cast<std::byte>(r));
    b.put(fmt::format("x/{}", r), mine);
    for (int j = 0; j < 3; ++j) {
      const auto v = b.get(fmt::format("x/{}", j), "a blob");
      if (v != bootstrap::blob(static_cast<std::size_t>(1000 * (j + 1)), static_cast<std::byte>(j))) return 1;
    }
    b.barrier("end");
    return 0;
  });
  check_all_ok(out);
}

TEST_CASE("bootstrap: a client of a rendezvous that rank 0 has replaced on the same port is told so and writes nothing there") {
  const std::uint16_t port = free_port();
  const auto timeout = std::chrono::duration<double>(10.0);
  auto first = std::make_unique<bootstrap>(0, 2, "127.0.0.1", port, timeout);
  bootstrap old_client(1, 2, "127.0.0.1", port, timeout);
  old_client.put("a", bootstrap::blob(3, std::byte{1}));
  CHECK(first->try_get("a").has_value());
  first.reset();  // rank 0's run ends, and a new one listens on the same port
  bootstrap second(0, 2, "127.0.0.1", port, timeout);
  const auto t0 = clock_type::now();
  CHECK_THROWS_WITH_AS(old_client.put("b", bootstrap::blob(3, std::byte{2})),
                       doctest::Contains("is no longer the one this rank joined: rank 0 has started another one on that port"),
                       transport_error);
  CHECK_THROWS_WITH_AS((void)old_client.get("a", "a key"), doctest::Contains("is no longer the one this rank joined"), rendezvous_replaced);
  CHECK(clock_type::now() - t0 < 5s);
  CHECK_FALSE(second.try_get("b").has_value());
  // A client that joins now is the new store's.
  bootstrap new_client(1, 2, "127.0.0.1", port, timeout);
  new_client.put("c", bootstrap::blob(1, std::byte{3}));
  CHECK(second.try_get("c").has_value());
  CHECK_FALSE(new_client.try_get("a").has_value());
}

TEST_CASE("bootstrap: an entry published once is not overwritten by a second process with the same rank") {
  const std::uint16_t port = free_port();
  const auto timeout = std::chrono::duration<double>(10.0);
  bootstrap server(0, 3, "127.0.0.1", port, timeout);
  bootstrap first(1, 3, "127.0.0.1", port, timeout), twin(1, 3, "127.0.0.1", port, timeout);
  const bootstrap::blob a(5, std::byte{1}), b(5, std::byte{2});
  first.put_once("gossip/ucx/0/1", a, "rank 1's UCX address");
  first.put_once("gossip/ucx/0/1", a, "rank 1's UCX address");  // asked again (a lost reply): the same value is fine
  CHECK_THROWS_WITH_AS(twin.put_once("gossip/ucx/0/1", b, "rank 1's UCX address"),
                       doctest::Contains("rank 1: another process has published rank 1's UCX address at the rendezvous 127.0.0.1:"),
                       config_error);
  CHECK(server.try_get("gossip/ucx/0/1") == std::optional<bootstrap::blob>(a));
  server.put_once("gossip/ucx/0/0", a, "rank 0's UCX address");
  CHECK_THROWS_WITH_AS(server.put_once("gossip/ucx/0/0", b, "rank 0's UCX address"), doctest::Contains("a rank number started twice"),
                       config_error);
  twin.put("free", b);  // put still overwrites
  twin.put("free", a);
  CHECK(server.try_get("free") == std::optional<bootstrap::blob>(a));
}

TEST_CASE("bootstrap: erase removes a key, and a store past its limit refuses a put, naming the key, holding what it had") {
  const std::uint16_t port = free_port();
  const auto timeout = std::chrono::duration<double>(10.0);
  bootstrap server(0, 2, "127.0.0.1", port, timeout);
  bootstrap client(1, 2, "127.0.0.1", port, timeout);
  // Each entry counts its key, its value and 64 bytes: "epoch/1/1" + 1000 = 1073.
  server.set_store_limit(2500);
  const bootstrap::blob model(1000, std::byte{5});
  client.put("epoch/1/1", model);
  server.put("epoch/1/0", model);
  const std::string full = fmt::format("rank 1: rank 0's rendezvous at 127.0.0.1:{} refused key 'epoch/2/1' (1000 bytes): it holds or is "
                                       "receiving 2146 bytes of keys and values and takes at most 2500; erase the keys that were read",
                                       port);
  CHECK_THROWS_WITH_AS(client.put("epoch/2/1", model), doctest::Contains(full.c_str()), config_error);
  CHECK_THROWS_WITH_AS(server.put("epoch/2/0", model), doctest::Contains("rank 0: rank 0's rendezvous at 127.0.0.1:"), config_error);
  CHECK_THROWS_WITH_AS(client.put_once("epoch/2/1", model, "rank 1's model"), doctest::Contains("refused key 'epoch/2/1'"), config_error);
  CHECK(client.try_get("epoch/1/1") == std::optional<bootstrap::blob>(model));  // what it held stays
  client.put("epoch/1/1", bootstrap::blob(10, std::byte{1}));                  // a smaller value fits where a larger one would not
  // Erased by anyone, through the store or locally; a second erase finds nothing.
  CHECK(server.erase("epoch/1/1"));
  CHECK_FALSE(client.erase("epoch/1/1"));
  CHECK(client.erase("epoch/1/0"));
  CHECK_FALSE(server.try_get("epoch/1/0").has_value());
  client.put("epoch/2/1", model);
  server.put("epoch/2/0", model);
  CHECK(client.try_get("epoch/2/0") == std::optional<bootstrap::blob>(model));
  CHECK_THROWS_WITH_AS(client.set_store_limit(1), doctest::Contains("rank 1 holds no store"), config_error);
}

TEST_CASE("bootstrap: a value that cannot fit is refused before it is received; one that fits only without the values under way waits") {
  const std::uint16_t port = free_port();
  const auto timeout = std::chrono::duration<double>(60.0);  // also how long rank 0 keeps the held-back put below
  bootstrap server(0, 2, "127.0.0.1", port, timeout);
  bootstrap client(1, 2, "127.0.0.1", port, timeout), other(1, 2, "127.0.0.1", port, timeout);
  server.set_store_limit(1'000'000);
  // "big" holds 600 000 bytes (600 067 with its key and 64); a put of as
  // many again under "big" is announced and sent halfway: it grows nothing,
  // but its value is under way.
  const std::uint64_t vlen = 600'000;
  client.put("big", bootstrap::blob(vlen, std::byte{1}));
  const int fd = connect_loopback(port);
  const auto send_all = [&](const void* p, std::size_t n) {
    for (std::size_t at = 0; at < n;) {
      const ssize_t k = ::write(fd, static_cast<const char*>(p) + at, n - at);
      REQUIRE(k > 0);
      at += static_cast<std::size_t>(k);
    }
  };
  std::vector<char> head = {'G', 'R', 'V', '5', 'P', 0, 0, 0, 0, 0, 0, 0, 0};
  const std::uint32_t klen = 3;
  head.insert(head.end(), reinterpret_cast<const char*>(&klen), reinterpret_cast<const char*>(&klen) + 4);
  head.insert(head.end(), {'b', 'i', 'g'});
  head.insert(head.end(), reinterpret_cast<const char*>(&vlen), reinterpret_cast<const char*>(&vlen) + 8);
  send_all(head.data(), head.size());
  const std::vector<char> half(vlen / 2, 'v');
  send_all(half.data(), half.size());
  const auto refusal = [&](const std::string& key, std::size_t bytes) {
    try {
      client.put(key, bootstrap::blob(bytes, std::byte{1}));
    } catch (const config_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // A value past the whole limit is refused at once, whatever is under way
  // (read past, not kept); once rank 0 has admitted the held-back put, the
  // refusal counts it.
  const auto t0 = clock_type::now();
  std::string said;
  while ((said = refusal("probe", 1'000'001)).find("it holds or is receiving 1200067 bytes") == std::string::npos &&
         clock_type::now() - t0 < 30s)
    std::this_thread::sleep_for(20ms);
  CHECK_MESSAGE(said.find("refused key 'probe' (1000001 bytes): it holds or is receiving 1200067 bytes") != std::string::npos, said);
  // 300 000 bytes fit beside what is held, not beside the value under way
  // as well: that put waits, and is stored once the value under way is.
  std::atomic<bool> done{false};
  std::string failed;
  std::thread waiting([&] {
    try {
      other.put("b", bootstrap::blob(300'000, std::byte{2}));
    } catch (const std::exception& e) {
      failed = e.what();
    }
    done = true;
  });
  std::this_thread::sleep_for(300ms);
  CHECK_FALSE(done);
  CHECK_FALSE(server.try_get("b").has_value());
  send_all(half.data(), half.size());
  char reply[21] = {};
  std::size_t got = 0;
  for (ssize_t n; got < sizeof reply && (n = ::read(fd, reply + got, sizeof reply - got)) > 0;) got += static_cast<std::size_t>(n);
  ::close(fd);
  CHECK(std::string(reply, 5) == "GRV5Y");
  waiting.join();
  CHECK_MESSAGE(failed.empty(), failed);
  CHECK(server.try_get("big") == std::optional<bootstrap::blob>(bootstrap::blob(vlen, std::byte{'v'})));
  CHECK(server.try_get("b").value_or(bootstrap::blob{}).size() == 300'000);
  // What cannot fit beside what is held is refused at once: 600 067 + 300 065 held.
  CHECK(refusal("c", 200'000).find("it holds or is receiving 900132 bytes of keys and values and takes at most 1000000") != std::string::npos);
  // A put once of a key that holds a value of another length finds another
  // value there, even when its own would pass the limit.
  CHECK_THROWS_WITH_AS(client.put_once("big", bootstrap::blob(1'000'001, std::byte{3}), "rank 1's model"),
                       doctest::Contains("another process has published rank 1's model"), config_error);
  CHECK(server.erase("big"));
  client.put("c", bootstrap::blob(200'000, std::byte{3}));
}

TEST_CASE("bootstrap: ranks of two versions of the rendezvous protocol say so") {
  // A rank 0 of another version: its reply names its version.
  const std::uint16_t port = free_port();
  {
    stand_in_rendezvous other(port, [](int c, int) {
      const char reply[13] = {'G', 'R', 'V', '9', 'N', 0, 0, 0, 0, 0, 0, 0, 0};
      [[maybe_unused]] auto k = ::write(c, reply, sizeof reply);
    });
    bootstrap b(1, 2, "127.0.0.1", port, std::chrono::duration<double>(5.0));
    CHECK_THROWS_WITH_AS((void)b.try_get("k"), doctest::Contains("speaks version 9 of its protocol and this rank version 5"), transport_error);
  }
  // A client of another version: this rank 0 answers with its own magic and 'V'.
  const std::uint16_t port2 = free_port();
  bootstrap b0(0, 2, "127.0.0.1", port2, std::chrono::duration<double>(5.0));
  const int fd = connect_loopback(port2);
  const char request[] = {'G', 'R', 'V', '1', 'G', 1, 0, 0, 0, 'k'};
  REQUIRE(::write(fd, request, sizeof request) == static_cast<ssize_t>(sizeof request));
  char reply[5] = {};
  std::size_t got = 0;
  for (ssize_t n; got < sizeof reply && (n = ::read(fd, reply + got, sizeof reply - got)) > 0;) got += static_cast<std::size_t>(n);
  ::close(fd);
  CHECK(std::string(reply, got) == "GRV5V");
}

TEST_CASE("bootstrap: a barrier does not wait for a rank that an arrived rank found dead") {
  // Rank 2 never arrives. Rank 1 found it dead; rank 0 (not its neighbour)
  // learns it from rank 1's arrival and leaves at once.
  const std::uint16_t port = free_port();
  const auto timeout = std::chrono::duration<double>(10.0);
  bootstrap b0(0, 3, "127.0.0.1", port, timeout), b1(1, 3, "127.0.0.1", port, timeout);
  const auto t0 = clock_type::now();
  std::thread rank1([&] { b1.barrier("end", std::vector<int>{2}); });
  b0.barrier("end", std::vector<int>{});
  rank1.join();
  CHECK(clock_type::now() - t0 < 5s);

  // Nobody found it dead: the wait ends at the timeout, naming it.
  const std::uint16_t port2 = free_port();
  bootstrap c0(0, 2, "127.0.0.1", port2, std::chrono::duration<double>(0.5));
  CHECK_THROWS_WITH_AS(c0.barrier("end", std::vector<int>{}), doctest::Contains("waiting for rank(s) 1 to reach barrier 'end'"),
                       timeout_error);
}

TEST_CASE("bootstrap: a barrier name used again is a new barrier") {
  const std::uint16_t port = free_port();
  const auto timeout = std::chrono::duration<double>(10.0);
  bootstrap b0(0, 2, "127.0.0.1", port, timeout), b1(1, 2, "127.0.0.1", port, timeout);
  std::atomic<bool> late{false};
  std::thread rank1([&] {
    b1.barrier("sync");
    std::this_thread::sleep_for(300ms);
    late = true;
    b1.barrier("sync");  // rank 0 must not be through the second one before this
  });
  b0.barrier("sync");
  b0.barrier("sync");
  CHECK(late.load());
  rank1.join();
  // A key longer than the rendezvous takes is refused by name, not sent.
  CHECK_THROWS_WITH_AS(b1.put(std::string(5000, 'k'), {}), doctest::Contains("exceeds the 4096 byte limit"), config_error);
}

TEST_CASE("ucx: UCX_TLS from the environment or a ucx.conf is kept; left unset, sysv is left out") {
  require_ucx();
  // UCX reads ucx.conf when it loads, so each case runs gossip-info (which
  // prints the transport's describe()) in a process of its own.
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  REQUIRE(n > 0);
  const std::string exe(self, static_cast<std::size_t>(n));
  const std::string info = exe.substr(0, exe.rfind('/')) + "/../tools/gossip-info";
  REQUIRE_MESSAGE(::access(info.c_str(), X_OK) == 0, info);
  char dir[] = "/tmp/gossip-ucxconf-XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  const std::string conf = std::string(dir) + "/ucx.conf";
  const auto here = [&](const char* env_tls, const char* file_tls) {
    std::string cmd = "env -u UCX_TLS -u UCX_CONFIG_DIR";
    if (env_tls) cmd += fmt::format(" UCX_TLS='{}'", env_tls);
    if (file_tls) {
      FILE* f = std::fopen(conf.c_str(), "w");
      REQUIRE(f != nullptr);
      std::fprintf(f, "UCX_TLS=%s\n", file_tls);
      std::fclose(f);
      cmd += fmt::format(" UCX_CONFIG_DIR='{}'", dir);
    }
    cmd += " '" + info + "'";
    std::string out;
    if (FILE* p = ::popen(cmd.c_str(), "r")) {
      char buf[4096];
      for (std::size_t got; (got = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, got);
      CHECK(::pclose(p) == 0);
    }
    const auto at = out.find("      here: UCX ");
    return at == std::string::npos ? out : out.substr(at, out.find('\n', at) - at);
  };
  CHECK_MESSAGE(here(nullptr, nullptr).find("UCX_TLS=^sysv (unset: all but sysv)") != std::string::npos, here(nullptr, nullptr));
  CHECK_MESSAGE(here(nullptr, "tcp,self").find("UCX_TLS=tcp,self,") != std::string::npos, here(nullptr, "tcp,self"));
  CHECK_MESSAGE(here("posix,self", "tcp").find("UCX_TLS=posix,self,") != std::string::npos, here("posix,self", "tcp"));
  CHECK_MESSAGE(here("all", nullptr).find("UCX_TLS=all,") != std::string::npos, here("all", nullptr));
  std::remove(conf.c_str());
  ::rmdir(dir);
}

TEST_CASE("ucx: 2 and 4 processes exchange models bit for bit (eager and rendezvous sizes)") {
  require_ucx();
  for (const char* tls : {"tcp", "tcp/listener", "posix,self"}) {
    for (int world : {2, 4}) {
      // 1 KiB-ish messages go eager; 1 MiB ones use rendezvous straight into the inbox slot.
      for (std::size_t elements : {std::size_t{300}, std::size_t{1} << 18}) {
        CAPTURE(tls);
        CAPTURE(world);
        CAPTURE(elements);
        const std::uint16_t port = free_port();
        const int rounds = elements > 1000 ? 6 : 20;
        check_all_ok(run_procs(world, tls, 60, [&](int r) { return exchange(r, world, port, elements, rounds); }));
      }
    }
  }
}

TEST_CASE("ucx: endpoints go through listeners over tcp for models from 256 KiB, by worker address otherwise, and a listener that cannot serve is refused") {
  require_ucx();
  // Automatic: listeners over tcp alone for rendezvous-sized models; a
  // wildcard rendezvous address names no route to listen on.
  struct want {
    const char* tls;
    std::size_t elements;
    const char* address;
    bool listening;
  };
  for (const want& w : {want{"tcp", 300, "127.0.0.1", false}, want{"tcp", std::size_t{1} << 18, "127.0.0.1", true},
                        want{"tcp/worker", std::size_t{1} << 18, "127.0.0.1", false}, want{"tcp/listener", 300, "127.0.0.1", true},
                        want{"posix,self", std::size_t{1} << 18, "127.0.0.1", false}, want{"tcp", std::size_t{1} << 18, "0.0.0.0", false}}) {
    CAPTURE(w.tls);
    CAPTURE(w.elements);
    CAPTURE(w.address);
    const std::uint16_t port = free_port();
    check_all_ok(run_procs(2, w.tls, 60, [&](int r) {
      direct d(r, 2, port, w.elements, 0, {}, w.address);
      d.attach();
      if (d.t.listening() != w.listening) throw error(fmt::format("rank {}: listening() = {}", r, d.t.listening()));
      for (std::uint64_t s = 0; s < 4; ++s)
        for (auto st : d.post_step(s, d.others))
          if (st != post_status::ok) throw error(fmt::format("rank {}: post failed at step {}", r, s));
      d.receive_until(4, 20s);
      d.t.flush(20s);
      final_barrier(*d.boot, "end", {0, 1});
      return 0;
    }));
  }
  // Refused, naming what chose the listener and what to do.
  struct refusal {
    const char* tls;
    const char* address;
    ucx_connect connect;
    std::vector<std::string> says;
  };
  for (const refusal& f : {refusal{"posix,self/listener", "127.0.0.1", ucx_connect::automatic, {"GOSSIP_UCX_CONNECT=listener", "UCX_TLS=posix,self", "add tcp"}},
                           refusal{"tcp/bogus", "127.0.0.1", ucx_connect::automatic, {"GOSSIP_UCX_CONNECT='bogus'", "auto, worker or listener"}},
                           refusal{"tcp", "0.0.0.0", ucx_connect::listener, {"ucx_connect::listener", "0.0.0.0", "GOSSIP_MASTER_ADDR"}}}) {
    CAPTURE(f.tls);
    const std::uint16_t port = free_port();
    check_all_ok(run_procs(2, f.tls, 60, [&](int r) {
      direct d(r, 2, port, 300, 0, {.connect = f.connect}, f.address);
      try {
        d.attach();
      } catch (const config_error& e) {
        for (const auto& part : f.says)
          if (std::string(e.what()).find(part) == std::string::npos) throw error(fmt::format("rank {}: '{}' not in: {}", r, part, e.what()));
        final_barrier(*d.boot, "refused", {0, 1});
        return 0;
      }
      throw error(fmt::format("rank {}: attach accepted it", r));
    }));
  }
}

TEST_CASE("ucx: a layout mismatch is refused on both sides") {
  require_ucx();
  const std::uint16_t port = free_port();
  const auto out = run_procs(2, "tcp", 30, [&](int r) {
    direct d(r, 2, port, 100, r == 1 ? 1 : 0);
    int rc = 2;
    try {
      d.attach();
    } catch (const layout_error& e) {
      const std::string what = e.what();
      rc = what.find("rank 0") != std::string::npos && what.find("rank 1") != std::string::npos && what.find("'w'") != std::string::npos
               ? 0
               : 3;
      if (rc != 0) std::fprintf(stderr, "rank %d: unexpected message: %s\n", r, e.what());
    }
    final_barrier(*d.boot, "mismatch", {0, 1});
    return rc;
  });
  check_all_ok(out);
}

TEST_CASE("ucx: kill -9 of one rank; the others see it in dead_peers() and continue") {
  require_ucx();
  for (const char* tls : {"tcp", "tcp/listener", "posix,self"}) {
    CAPTURE(tls);
    const std::uint16_t port = free_port();
    const auto out = run_procs(3, tls, 60, [&](int r) {
      direct d(r, 3, port, 256);
      d.attach();
      std::uint64_t s = 0;
      for (; s < 5; ++s) {
        (void)d.post_step(s, d.others);
        d.poll_once();
        std::this_thread::sleep_for(5ms);
      }
      d.receive_until(5 * 2, 20s);  // everyone heard everyone
      final_barrier(*d.boot, "ready", {0, 1, 2});
      if (r == 2) ::raise(SIGKILL);

      // Survivors keep going until rank 2 is reported dead, then a few more rounds.
      const int other = 1 - r;
      bool dead = false;
      int after = 0;
      const auto deadline = clock_type::now() + 20s;
      while (after < 10) {
        if (clock_type::now() > deadline) throw timeout_error(fmt::format("rank {}: rank 2's death not reported within 20 s", r));
        (void)d.post_step(s++, d.others);  // to rank 2: ok until detected, then peer_dead
        std::vector<received> dp(3);
        const std::size_t n = d.t.dead_peers(dp);
        for (std::size_t i = 0; i < n; ++i) {
          if (dp[i].sender != 2) throw error(fmt::format("rank {}: rank {} reported dead", r, dp[i].sender));
          dead = true;
        }
        if (dead) ++after;
        d.poll_once();
        std::this_thread::sleep_for(10ms);
      }
      // After the report, posts to rank 2 fail fast and rank `other` still gets everything.
      if (d.t.post(2, {d.send[0].data(), sizeof(wire_header) + 256 * 4}, s) != post_status::peer_dead)
        throw error(fmt::format("rank {}: a post to dead rank 2 did not return peer_dead", r));
      d.t.flush(std::chrono::duration<double>(10.0));
      d.receive_until(0, 1s);
      // The other survivor posted its steps 0..want-1 to us: every one arrives.
      d.boot->put(fmt::format("posted/{}", r),
                  bootstrap::blob(reinterpret_cast<const std::byte*>(&s), reinterpret_cast<const std::byte*>(&s) + 8));
      const auto b = d.boot->get(fmt::format("posted/{}", other), "the other survivor's step count");
      std::uint64_t want = 0;
      std::memcpy(&want, b.data(), 8);
      const auto until = clock_type::now() + 20s;
      while (d.next_step[static_cast<std::size_t>(other)] < want) {
        if (clock_type::now() > until)
          throw timeout_error(
              fmt::format("rank {}: only {} of {} messages from rank {}", r, d.next_step[static_cast<std::size_t>(other)], want, other));
        d.poll_once();
        std::this_thread::sleep_for(1ms);
      }
      final_barrier(*d.boot, "survivors", {0, 1});
      d.t.leave();
      return 0;
    });
    REQUIRE(out.size() == 3);
    CHECK(out[2].signal == SIGKILL);
    for (int r = 0; r < 2; ++r) {
      INFO("rank " << r << " exited=" << out[static_cast<std::size_t>(r)].exited << " code=" << out[static_cast<std::size_t>(r)].code);
      CHECK((out[static_cast<std::size_t>(r)].exited && out[static_cast<std::size_t>(r)].code == 0));
    }
  }
}

TEST_CASE("ucx: a stopped peer that holds our sends is found dead by the liveness probe; a live one that pauses is not") {
  // Over shared memory UCX never reports a peer whose process is stopped (or
  // ended before its endpoint connected): the sends it holds would hold the
  // sender's buffers until every wait on them timed out. A target that leaves
  // a ping unanswered for half of timeout_s is declared dead instead; one whose
  // progress thread answers is alive, however long its engine pauses.
  require_ucx();
  for (const char* tls : {"posix,self", "tcp", "tcp/listener"}) {
    CAPTURE(tls);
    const std::uint16_t port = free_port();
    const auto out = run_procs(3, tls, 60, [&](int r) {
      direct d(r, 3, port, std::size_t{1} << 18);  // 1 MiB: rendezvous, held until the receiver answers
      d.timeout_s = 2;  // probe after 0.5 s held (and 2 s of running: rank 2 is never heard from), dead after 1 s unanswered
      d.attach();
      d.publish_pid();
      final_barrier(*d.boot, "ready", {0, 1, 2});
      if (r == 2) {
        ::raise(SIGSTOP);  // rank 0 SIGCONTs us at the end
        d.t.leave();
        return 0;
      }
      std::this_thread::sleep_for(300ms);  // rank 2 is stopped by now
      if (r == 1) {
        // Rank 0's sends fill our inbox and then wait on us for 3 s (longer
        // than timeout_s): our progress thread answers its probes meanwhile.
        std::this_thread::sleep_for(3s);
      }
      const auto t0 = clock_type::now();
      bool dead = false;
      std::uint64_t s = 0;
      while (!dead || s < 6) {
        if (clock_type::now() - t0 > 15s) throw timeout_error(fmt::format("rank {}: rank 2 not found dead within 15 s", r));
        (void)d.post_step(s++, d.others);  // waits (polling) for its buffer: rank 2 holds it until found dead
        std::vector<received> dp(3);
        const std::size_t n = d.t.dead_peers(dp);
        for (std::size_t i = 0; i < n; ++i) {
          if (dp[i].sender != 2) throw error(fmt::format("rank {}: rank {} reported dead", r, dp[i].sender));
          dead = true;
        }
      }
      // Our last sends complete once the other survivor merges them, and it
      // may still be sending to us: merge until both are done.
      const auto until = clock_type::now() + 20s;
      const auto merge_until = [&](const auto& done, const char* what) {
        while (!done()) {
          if (clock_type::now() > until) throw timeout_error(fmt::format("rank {}: {} within 20 s", r, what));
          d.poll_once();
          std::this_thread::sleep_for(1ms);
        }
      };
      merge_until([&] { return !d.t.busy(d.send[0].data()) && !d.t.busy(d.send[1].data()); }, "our sends did not complete");
      d.boot->put(fmt::format("done/{}", r), {});
      merge_until([&] { return d.boot->try_get(fmt::format("done/{}", 1 - r)).has_value(); }, "the other survivor was not done");
      final_barrier(*d.boot, "survivors", {0, 1});
      if (r == 0) ::kill(d.pid_of(2), SIGCONT);
      d.t.leave();
      return 0;
    });
    REQUIRE(out.size() == 3);
    check_all_ok(out);
  }
}

TEST_CASE("ucx: two live ranks that found each other dead settle every share between them exactly, from each other's record") {
  // Rank 1 stops (SIGSTOP) while 4 MiB rendezvous messages run both ways;
  // rank 0's probe declares it dead and closes the endpoint, then lets it go
  // on, and rank 1 finds rank 0 gone. A message under way then can complete
  // at its sender and fail at its receiver: with the shares that failed at
  // each end alone, the weight it carried vanished uncounted. Each rank
  // publishes what it took from the other, and each reads the other's
  // record: what it posted minus what it handed back must equal what the
  // other took, to the last bit of rounding, whichever messages failed where.
  require_ucx();
  const std::uint16_t port = free_port();
  const auto out = run_procs(2, "tcp", 90, [&](int r) {
    direct d(r, 2, port, std::size_t{1} << 20);  // 4 MiB: rendezvous, under way when rank 1 stops
    // Rank 0's probe gives up on the stopped rank 1 after about 2 s; rank 1,
    // resumed, finds rank 0 gone from its reset connection long before its
    // own probe would (a rank 0 found unresponsive is not asked about).
    d.timeout_s = r == 0 ? 2 : 8;
    d.attach();
    d.publish_pid();
    final_barrier(*d.boot, "ready", {0, 1});
    const int other = 1 - r;
    double posted = 0, handed_back = 0, taken = 0;
    bool reported = false, settled = false, resumed = false;
    std::optional<clock_type::time_point> reported_at;
    clock_type::time_point continued_at{};
    const auto deadline = clock_type::now() + 60s;
    for (std::uint64_t s = 0;; ++s) {
      if (clock_type::now() > deadline)
        throw timeout_error(fmt::format("rank {}: reported {}, settled {} after 60 s", r, reported, settled));
      if (r == 1 && s == 12) {  // rank 0 SIGCONTs us once it found us dead
        d.boot->put("stopping", {});
        ::raise(SIGSTOP);
        d.boot->put("resumed", {});
      }
      if (!reported) {
        auto& buf = d.send[s % 2];
        if (!d.t.busy(buf.data())) {
          const auto st = d.post_step(s, d.others);
          if (st[0] == post_status::ok) posted += static_cast<double>(s) + 0.25;
        }
      }
      const std::size_t n = d.t.collect(0, d.got);
      for (std::size_t i = 0; i < n; ++i) taken += d.got[i].weight;
      d.t.release(0);
      std::vector<received> dp(2);
      const std::size_t k = d.t.dead_peers(dp);
      for (std::size_t i = 0; i < k; ++i) {
        if (dp[i].sender != other) throw error(fmt::format("rank {}: rank {} reported dead", r, dp[i].sender));
        if (dp[i].departed) throw error(fmt::format("rank {}: rank {} reported departed", r, other));
        handed_back += dp[i].weight;
        reported = true;
        settled = settled || dp[i].settled;
        if (!reported_at) reported_at = clock_type::now();
      }
      // Until rank 1 says it runs again (on a loaded machine the probe may
      // find it dead before it stops itself, and one SIGCONT would come early).
      if (r == 0 && !resumed && reported_at && clock_type::now() - *reported_at > 1s && clock_type::now() - continued_at > 100ms) {
        continued_at = clock_type::now();
        if (d.boot->try_get("resumed"))
          resumed = true;
        else if (d.boot->try_get("stopping"))
          ::kill(d.pid_of(1), SIGCONT);
      }
      if (settled && !d.boot->try_get(fmt::format("settled/{}", r))) d.boot->put(fmt::format("settled/{}", r), {});
      if (settled && d.boot->try_get(fmt::format("settled/{}", other))) break;
      std::this_thread::sleep_for(2ms);
    }
    const auto put_num = [&](const std::string& key, double v) {
      d.boot->put(key, bootstrap::blob(reinterpret_cast<const std::byte*>(&v), reinterpret_cast<const std::byte*>(&v) + sizeof v));
    };
    const auto get_num = [&](const std::string& key) {
      const auto b = d.boot->get(key, key);
      double v = 0;
      std::memcpy(&v, b.data(), sizeof v);
      return v;
    };
    put_num(fmt::format("taken/{}", r), taken);
    const double took = get_num(fmt::format("taken/{}", other));
    if (std::abs(posted - handed_back - took) > 1e-9 * std::max(1.0, posted))
      throw error(fmt::format("rank {}: posted {} to rank {}, was handed back {}, and rank {} took {}: {} of push-sum weight unaccounted", r,
                              posted, other, handed_back, other, took, posted - handed_back - took));
    final_barrier(*d.boot, "checked", {0, 1});
    d.t.leave();
    return 0;
  });
  REQUIRE(out.size() == 2);
  check_all_ok(out);
}

TEST_CASE("ucx: leave() while a probe to a stopped peer is unanswered returns, and the worker is destroyed cleanly") {
  // The leaving rank has a ping out to the stopped peer, unanswered: it
  // closes that peer's endpoint as a dead one's, and its worker is destroyed
  // without a UCX assertion (a small message queued to a stopped peer on a
  // gracefully closed endpoint made UCX 1.13 assert in another test).
  require_ucx();
  for (const char* tls : {"tcp", "posix,self"}) {
    CAPTURE(tls);
    const std::uint16_t port = free_port();
    const auto out = run_procs(2, tls, 60, [&](int r) {
      direct d(r, 2, port, std::size_t{1} << 18);  // 1 MiB: rendezvous, held by a stopped receiver
      d.timeout_s = 4;                              // probe after 1 s held, dead after 2 s unanswered
      d.attach();
      d.publish_pid();
      // Past timeout_s of running (a target not heard from is probed only then), exchanging.
      const auto until = clock_type::now() + 4500ms;
      std::uint64_t s = 0;
      while (clock_type::now() < until) {
        (void)d.post_step(s++, d.others);
        d.poll_once();
        std::this_thread::sleep_for(20ms);
      }
      final_barrier(*d.boot, "ready", {0, 1});
      if (r == 1) {
        ::raise(SIGSTOP);  // rank 0 SIGCONTs us after its leave()
        d.t.leave();
        return 0;
      }
      const pid_t other = d.pid_of(1);
      std::this_thread::sleep_for(300ms);  // rank 1 is stopped by now
      (void)d.post_step(s++, d.others);    // held by rank 1
      std::this_thread::sleep_for(1500ms);  // the probe is out, not yet declared unanswered
      d.t.leave();
      ::kill(other, SIGCONT);
      return 0;
    });
    REQUIRE(out.size() == 2);
    check_all_ok(out);
  }
}

TEST_CASE("ucx: leave() while a peer is stopped (SIGSTOP) with sends in flight to it returns within the close bound") {
  // The graceful close of an endpoint whose peer reads nothing cannot
  // complete; past close_timeout_s the worker is destroyed with the close
  // requests still pending, which UCX must be given back first (it asserted
  // otherwise: ucp_ep.c "req->flags & UCP_REQUEST_FLAG_RELEASED", SIGABRT).
  require_ucx();
  const std::uint16_t port = free_port();
  ucx_options o;
  o.close_timeout_s = 1.0;
  const auto out = run_procs(2, "tcp", 60, [&](int r) {
    direct d(r, 2, port, std::size_t{1} << 20, 0, o);  // 4 MiB: rendezvous, stays in flight
    d.attach();
    d.publish_pid();
    final_barrier(*d.boot, "ready", {0, 1});
    if (r == 1) {
      ::raise(SIGSTOP);  // rank 0 sends, leaves, then SIGCONTs us
      d.t.leave();
      return 0;
    }
    const pid_t other = d.pid_of(1);
    std::this_thread::sleep_for(300ms);  // rank 1 is stopped by now
    for (std::uint64_t s = 0; s < 2; ++s) (void)d.post_step(s, d.others);
    const double took = d.timed_leave();
    ::kill(other, SIGCONT);
    if (took > 10) throw error(fmt::format("leave() took {:.1f} s with close_timeout_s = 1", took));
    return 0;
  });
  REQUIRE(out.size() == 2);
  check_all_ok(out);
}

TEST_CASE("ucx: leave() while a live peer that merges nothing holds our rendezvous sends returns, and the worker is destroyed cleanly") {
  // Rank 1 is alive but merges nothing (a training loop that stopped calling
  // step, or an evaluation): its inbox fills and it holds rank 0's next
  // rendezvous sends. Rank 0 then leaves (an engine destroyed by an error, or
  // a flush that timed out). A graceful close left those sends on their
  // endpoint, and UCX 1.13 aborted in ucp_worker_destroy (ucp_ep.c:437,
  // proto_reqs); they are cancelled by a forced close after the goodbye.
  require_ucx();
  for (const std::string tls : {"tcp", "tcp/worker", "posix,self"}) {
    CAPTURE(tls);
    const std::uint16_t port = free_port();
    ucx_options o;
    o.close_timeout_s = 1.0;
    const auto out = run_procs(2, tls.c_str(), 60, [&](int r) {
      direct d(r, 2, port, std::size_t{1} << 20, 0, o);  // 4 MiB: rendezvous
      d.attach();
      final_barrier(*d.boot, "ready", {0, 1});
      if (r == 1) {
        std::this_thread::sleep_for(4s);  // alive, merging nothing: two messages fill the inbox, the next are held
        std::vector<received> gone(1);
        // Rank 0 left without the drain handshake: reported as failed (not departed), from its goodbye.
        if (d.t.dead_peers(gone) != 1 || gone[0].sender != 0 || gone[0].departed) throw error("rank 1 was not told that rank 0 left");
        d.t.leave();
        return 0;
      }
      for (std::uint64_t s = 0; s < 4; ++s) (void)d.post_step(s, d.others);
      std::this_thread::sleep_for(200ms);
      if (!d.t.busy(d.send[0].data()) && !d.t.busy(d.send[1].data())) throw error("rank 0 has no send held by rank 1: the test proves nothing");
      if (const double took = d.timed_leave(); took > 10) throw error(fmt::format("leave() took {:.1f} s with close_timeout_s = 1", took));
      return 0;
    });
    REQUIRE(out.size() == 2);
    check_all_ok(out);
  }
}

TEST_CASE("ucx: two engines destroyed mid-transfer at the same moment (an error in both) do not abort") {
  // Each rank may still be receiving the other's rendezvous message when it
  // leaves, and the other force-closes its endpoint (it takes the goodbye as
  // a failure). Over shared memory nothing failed the receive on the leaving
  // side, and UCX 1.13 aborted in ucp_worker_destroy (ucp_ep.c:437,
  // proto_reqs) in about half of the runs; endpoints with a receive under way
  // are force-closed too now.
  require_ucx();
  for (const std::string tls : {"posix,self", "tcp"})
    for (int rep = 0; rep < 3; ++rep) {
      CAPTURE(tls);
      CAPTURE(rep);
      const std::uint16_t port = free_port();
      check_all_ok(run_procs(2, tls.c_str(), 60, [&](int r) {
        auto boot = std::make_shared<bootstrap>(r, 2, "127.0.0.1", port, std::chrono::duration<double>(20.0));
        test::toy_model m({std::size_t{1} << 22}, static_cast<std::uint64_t>(r + 1));  // 16 MiB: rendezvous
        {
          auto spec = test::spec_of(any_policy(policies::periodic{.every = 1}, "periodic"), "complete", "push-sum", 20);
          spec.codec.name = "none";
          engine e(m.view, r, 2, std::move(spec), ucx_transport(boot));
          // Both processes read one CLOCK_MONOTONIC: rank 0 names the moment both stop.
          std::int64_t end_ticks = 0;
          if (r == 0) {
            end_ticks = (clock_type::now() + 1500ms).time_since_epoch().count();
            boot->put("end", bootstrap::blob(reinterpret_cast<const std::byte*>(&end_ticks), reinterpret_cast<const std::byte*>(&end_ticks) + 8));
          } else {
            const auto b = boot->get("end", "the moment to stop");
            std::memcpy(&end_ticks, b.data(), 8);
          }
          const auto end = clock_type::time_point(clock_type::duration(end_ticks));
          while (clock_type::now() < end) {
            e.step({.lr = 0.1});
            std::this_thread::sleep_for(1ms);
          }
        }  // ~engine without finish(): abandon
        if (r == 0) boot->get("done", "rank 1 to be done", std::chrono::duration<double>(30.0));
        else boot->put("done", {});
        return 0;
      }));
    }
}

TEST_CASE("ucx: a message landed after its sender left leaves no request behind: the thread idles, leave() returns at once") {
  // Rank 1 merges nothing while rank 0 sends and leaves; the messages held
  // in rank 1's backlog land after rank 0's endpoint closed. UCX 1.13 then
  // completes the receive inside ucp_am_recv_data_nbx and still returns the
  // (freed) request: it was kept as under way, the progress thread polled
  // for good and rank 1's leave() waited out close_timeout_s.
  require_ucx();
  for (const std::string tls : {"tcp", "posix,self"}) {
    CAPTURE(tls);
    const std::uint16_t port = free_port();
    check_all_ok(run_procs(2, tls.c_str(), 60, [&](int r) {
      direct d(r, 2, port, std::size_t{1} << 18);  // 1 MiB: rendezvous
      d.attach();
      final_barrier(*d.boot, "ready", {0, 1});
      if (r == 0) {
        for (std::uint64_t s = 0; s < 4; ++s) (void)d.post_step(s, {1});
        std::this_thread::sleep_for(300ms);
        d.t.leave();
        d.boot->get("done", "rank 1 to be done", std::chrono::duration<double>(40.0));
        return 0;
      }
      (void)d.wait_gone();
      if (d.t.backlog() == 0) throw error("rank 1 holds no message of rank 0: the test proves nothing");
      for (int i = 0; i < 50; ++i) {
        d.poll_once();
        std::this_thread::sleep_for(2ms);
      }
      const double took = d.timed_leave();
      d.boot->put("done", {});
      if (took > 1.0) throw error(fmt::format("rank 1: leave() took {:.2f} s with nothing under way", took));
      return 0;
    }));
  }
}

TEST_CASE("ucx: a rank that leaves before its drain handshake completes, or without one, gives its sources back the weight of what it never merged") {
  // finish() reached the handshake but it did not complete (it timed out, or
  // the rendezvous was gone), or the engine never finished (destroyed by an
  // error): the rank leaves holding messages of its sources. Their push-sum
  // weight was lost without a trace (the senders' sends had completed); the
  // goodbye carries it back, to a source that counts the rank departed in the
  // first case and failed in the second.
  require_ucx();
  for (const std::string tls : {"tcp", "tcp/worker", "posix,self"})
    for (const bool handshake : {true, false}) {
      CAPTURE(tls);
      CAPTURE(handshake);
      const std::uint16_t port = free_port();
      check_all_ok(run_procs(2, tls.c_str(), 60, [&](int r) {
        direct d(r, 2, port, std::size_t{1} << 18);  // 1 MiB: two land in the slots, two wait in the backlog
        d.attach();
        final_barrier(*d.boot, "ready", {0, 1});
        if (r == 1) {
          const auto t0 = clock_type::now();
          while (d.t.backlog() < 2) {  // rank 0's four messages: merged none
            if (clock_type::now() - t0 > 20s) throw error("rank 1: rank 0's messages did not arrive");
            std::this_thread::sleep_for(1ms);
          }
          if (handshake && d.t.drained()) throw error("rank 1: drained() before rank 0 published its count");  // the handshake began
          d.t.leave();
          d.boot->put("done", {});
          return 0;
        }
        for (std::uint64_t s = 0; s < 4; ++s) (void)d.post_step(s, {1});  // weights 0.25, 1.25, 2.25, 3.25
        const received gone = d.wait_gone();
        if (gone.sender != 1 || gone.departed != handshake)
          throw error(fmt::format("rank 0: rank 1 was reported as {}", gone.departed ? "departed" : "failed"));
        if (gone.weight != 7.0) throw error(fmt::format("rank 0: {} of the weight rank 1 never merged came back, expected 7", gone.weight));
        d.boot->get("done", "rank 1 to be done");
        d.t.leave();
        return 0;
      }));
    }
}

TEST_CASE("ucx: a drain count that rank 0's full store refuses is a config error naming the key, not a rendezvous gone") {
  require_ucx();
  const std::uint16_t port = free_port();
  check_all_ok(run_procs(2, "tcp", 60, [&](int r) {
    direct d(r, 2, port, 64);
    d.attach();
    final_barrier(*d.boot, "ready", {0, 1});
    const auto refused = [&] {
      try {
        (void)d.t.drained();
      } catch (const config_error& e) {
        const std::string what = e.what();
        if (what.find(fmt::format("/drain/{}'", r)) == std::string::npos || what.find("set_store_limit") == std::string::npos)
          throw error(fmt::format("rank {}: the refusal names neither the drain key nor the limit: {}", r, what));
        return;
      }
      throw error(fmt::format("rank {}: drained() went on past a store that refused its count", r));
    };
    if (r == 0) {
      d.boot->put("flag", {});
      d.boot->set_store_limit(1);  // below what it holds: every put is refused from now on
      refused();
      const auto t0 = clock_type::now();
      while (d.boot->try_get("flag")) {  // rank 1 erases it once done (an erase needs no room)
        if (clock_type::now() - t0 > 20s) throw error("rank 0: rank 1 did not get through");
        std::this_thread::sleep_for(1ms);
      }
      // Rank 1 left without its count: a failure, not a departure (nobody waits for its count).
      if (const received gone = d.wait_gone(); gone.sender != 1 || gone.departed)
        throw error(fmt::format("rank 0: rank {} was reported as {}", gone.sender, gone.departed ? "departed" : "failed"));
      d.t.leave();
      return 0;
    }
    const auto t0 = clock_type::now();
    for (int i = 0;; ++i) {  // until rank 0 has set its limit
      try {
        d.boot->put(fmt::format("probe/{}", i), {});
      } catch (const config_error&) {
        break;
      }
      if (clock_type::now() - t0 > 20s) throw error("rank 1: rank 0's store never refused a put");
      std::this_thread::sleep_for(1ms);
    }
    refused();
    if (!d.boot->erase("flag")) throw error("rank 1: the flag was gone");
    d.t.leave();
    return 0;
  }));
}

TEST_CASE("ucx: the drain merges what a source that finished and left sent before its endpoint closed") {
  // Rank 0 is far ahead: its drain handshake completes (it waits only for
  // what is sent to it), it says goodbye and closes its endpoint, which over
  // tcp fails on rank 1 — the source is dead to rank 1 from then on. Its four
  // messages still sit in rank 1's slots and backlog: rank 1's drain must
  // merge them, not count the source out and leave their weight behind.
  require_ucx();
  const std::uint16_t port = free_port();
  check_all_ok(run_procs(2, "tcp", 60, [&](int r) {
    direct d(r, 2, port, 64);  // 256 B: eager, held by UCX for the backlog
    d.attach();
    final_barrier(*d.boot, "ready", {0, 1});
    if (r == 0) {
      for (std::uint64_t s = 0; s < 4; ++s)
        if (d.post_step(s, {1})[0] != post_status::ok) throw error("rank 0: post failed");  // weights 0.25, 1.25, 2.25, 3.25
      d.t.flush(std::chrono::duration<double>(10.0));
      const auto deadline = clock_type::now() + 20s;
      while (!d.t.drained()) {  // rank 1 sent nothing: drained once rank 1 has said so
        if (clock_type::now() > deadline) throw timeout_error("rank 0: the drain handshake did not complete");
        std::this_thread::sleep_for(1ms);
      }
      d.t.leave();
      return 0;
    }
    const auto t0 = clock_type::now();
    while (d.t.backlog() < 2) {  // two in the slots, two in the backlog, none merged
      if (clock_type::now() - t0 > 20s) throw error("rank 1: rank 0's messages did not arrive");
      std::this_thread::sleep_for(1ms);
    }
    if (d.t.drained()) throw error("rank 1: drained() before rank 0 had published its count");  // publishes rank 1's
    const received gone = d.wait_gone();
    if (gone.sender != 0 || !gone.departed) throw error("rank 1: rank 0 was not reported as departed");
    double weight = 0;
    std::size_t merged = 0;
    const auto deadline = clock_type::now() + 20s;
    while (!d.t.drained()) {
      const std::size_t n = d.t.collect(0, d.got);
      for (std::size_t i = 0; i < n; ++i) weight += d.got[i].weight;
      merged += n;
      d.t.release(0);
      if (clock_type::now() > deadline) throw timeout_error("rank 1: the drain did not complete");
      std::this_thread::sleep_for(1ms);
    }
    if (merged != 4 || weight != 7.0)
      throw error(fmt::format("rank 1: drained after merging {} of rank 0's 4 messages (weight {} of 7)", merged, weight));
    d.t.leave();
    return 0;
  }));
}

TEST_CASE("ucx: when a source's slots and backlog are full, the newest message is kept, the rest counted as dropped, their weight handed on") {
  require_ucx();
  // Full in messages (one), or in bytes of eager data (300: one message of 64 floats).
  for (const ucx_options o : {ucx_options{.backlog = 1}, ucx_options{.backlog = 1024, .backlog_bytes = 300}}) {
    CAPTURE(o.backlog);
    const std::uint16_t port = free_port();
    check_all_ok(run_procs(2, "tcp", 30, [&](int r) {
      direct d(r, 2, port, 64, 0, o);
      d.attach();
      if (r == 0) {
        for (std::uint64_t s = 0; s < 10; ++s)
          if (d.post_step(s, {1})[0] != post_status::ok) throw error("post failed");
        d.t.flush(std::chrono::duration<double>(10.0));
      } else {
        const auto deadline = clock_type::now() + 10s;
        while (d.t.counters().messages_received + d.t.counters().dropped < 9) {  // 2 landed + 7 dropped; 1 held
          if (clock_type::now() > deadline) throw timeout_error("rank 1: the 10 messages did not arrive");
          std::this_thread::sleep_for(1ms);
        }
        std::vector<std::uint64_t> steps;
        double weight = 0;
        bool gap = false;
        while (steps.size() < 3) {
          if (clock_type::now() > deadline) throw timeout_error("rank 1: the backlog was not landed after release");
          const std::size_t n = d.t.collect(0, d.got);
          for (std::size_t i = 0; i < n; ++i) steps.push_back(d.got[i].step), weight += d.got[i].weight, gap |= d.got[i].gap;
          d.t.release(0);
          std::this_thread::sleep_for(1ms);
        }
        if (steps != std::vector<std::uint64_t>{0, 1, 9} || d.t.counters().dropped != 7)
          throw error(fmt::format("rank 1: got steps {}, dropped {}", fmt::join(steps, ","), d.t.counters().dropped));
        // Message s carries weight s + 1/4: the dropped shares (steps 2..8)
        // arrive with the delivered ones, so the total is that of all ten.
        if (!gap || std::abs(weight - 47.5) > 1e-12) throw error(fmt::format("rank 1: weights delivered sum to {} (gap {}), expected 47.5", weight, gap));
      }
      final_barrier(*d.boot, "end", {0, 1});
      return 0;
    }));
  }
}

namespace {
// Periodic for the first `until` steps, silent afterwards (so the test can drain).
struct periodic_until {
  std::uint64_t until = 50;
  policies::periodic p{};
  decision decide(const gossip::signal& s) const noexcept { return s.step < until ? p.decide(s) : decision::skip(reason::not_due); }
};

// Rank r of two: trades send counts with the peer through the rendezvous, takes
// silent steps until every message the peer sent is merged, and checks that
// the two push-sum weights sum to 2 with nothing dropped. Returns the weight.
double drain_and_check_weight(engine& e, bootstrap& boot, int r) {
  const auto sent = e.stats().messages_sent;
  boot.put(fmt::format("sent/{}", r), bootstrap::blob(reinterpret_cast<const std::byte*>(&sent), reinterpret_cast<const std::byte*>(&sent) + 8));
  const auto b = boot.get(fmt::format("sent/{}", 1 - r), "the peer's send count");
  std::uint64_t expect = 0;
  std::memcpy(&expect, b.data(), 8);
  // Silent steps merge what is still on its way.
  const auto deadline = clock_type::now() + 20s;
  while (e.stats().peers.at(0).messages_received < expect) {
    if (clock_type::now() > deadline)
      throw timeout_error(fmt::format("rank {}: merged {} of {}", r, e.stats().peers.at(0).messages_received, expect));
    e.step();
    std::this_thread::sleep_for(1ms);
  }
  const double w = e.weight();
  boot.put(fmt::format("w/{}", r), bootstrap::blob(reinterpret_cast<const std::byte*>(&w), reinterpret_cast<const std::byte*>(&w) + 8));
  double other = 0;
  const auto wb = boot.get(fmt::format("w/{}", 1 - r), "the peer's weight");
  std::memcpy(&other, wb.data(), 8);
  const auto c = e.stats();
  if (std::abs(w + other - 2.0) > 1e-9 || c.dropped != 0)
    throw error(fmt::format("rank {}: weights {} + {} = {} (expected 2), dropped {}", r, w, other, w + other, c.dropped));
  return w;
}
}  // namespace

TEST_CASE("ucx: two engines, periodic push-sum over 50 steps, conserve the total weight") {
  require_ucx();
  for (const char* tls : {"tcp", "tcp/listener", "posix,self"}) {
    CAPTURE(tls);
    const std::uint16_t port = free_port();
    const auto out = run_procs(2, tls, 60, [&](int r) {
      auto boot = std::make_shared<bootstrap>(r, 2, "127.0.0.1", port, std::chrono::duration<double>(20.0));
      test::toy_model m({1000, 37}, static_cast<std::uint64_t>(r + 1));
      engine e(m.view, r, 2, test::spec_of(any_policy(periodic_until{}, "periodic-until"), "exponential", "push-sum", 20),
               ucx_transport(boot));
      for (int s = 0; s < 50; ++s) {
        for (auto& t : m.tensors)
          for (std::size_t i = 0; i < t.size(); ++i) t[i] += 0.001f * static_cast<float>((r + 1) * static_cast<int>(i % 5));
        e.step({.lr = 0.1});
        std::this_thread::sleep_for(2ms);  // "compute": lets most sends complete before the next step
      }
      e.flush();
      const auto sent = e.stats().messages_sent;
      if (sent < 10) throw error(fmt::format("rank {}: only {} of 50 sends left (send_busy {})", r, sent, e.stats().send_busy));
      const double w = drain_and_check_weight(e, *boot, r);
      const auto c = e.stats();
      if (std::getenv("GOSSIP_TEST_VERBOSE"))
        std::fprintf(stderr, "rank %d (%s): %llu sends, %llu skipped busy, weight %.17g\n", r, tls,
                     static_cast<unsigned long long>(c.sends), static_cast<unsigned long long>(c.send_busy), w);
      final_barrier(*boot, "end", {0, 1});
      e.finish(0);
      return 0;
    });
    check_all_ok(out);
  }
}

TEST_CASE("ucx: [engine] max_lead holds a fast rank back, so its push-sum weight is not given away step after step") {
  // Rank 1 "computes" 10 ms per step, rank 0 nothing. Each send halves the
  // sender's weight; running ahead, rank 0 sends many times for every share
  // it gets back. With max_lead = 2 it waits instead: its weight stays near
  // 1/8 (three sends before the first share comes back). The step is long
  // next to a delay in delivery, so that the two cases stay orders of
  // magnitude apart on a loaded machine (lead 2: 0.125 or more, lead 0:
  // 1e-3 or less, over 18 runs next to 3 busy loops on 2 cores; with 3 ms
  // steps, lead 2 fell to 0.08 there, and to 0.04 once in a full run of
  // the suite).
  require_ucx();
  for (const std::uint64_t lead : {std::uint64_t{2}, std::uint64_t{0}}) {
    CAPTURE(lead);
    const std::uint16_t port = free_port();
    const auto out = run_procs(2, "tcp", 60, [&](int r) {
      auto boot = std::make_shared<bootstrap>(r, 2, "127.0.0.1", port, std::chrono::duration<double>(20.0));
      test::toy_model m({1000}, static_cast<std::uint64_t>(r + 1));
      auto spec = test::spec_of(any_policy(periodic_until{.until = 60}, "periodic-until"), "exponential", "push-sum", 20);
      spec.settings.max_lead = lead;
      spec.settings.wait_when_busy = true;
      engine e(m.view, r, 2, std::move(spec), ucx_transport(boot));
      for (int s = 0; s < 60; ++s) {
        e.step({.lr = 0.1});
        if (r == 1) std::this_thread::sleep_for(10ms);
      }
      e.flush();
      const auto st = e.stats();
      if (std::getenv("GOSSIP_TEST_VERBOSE"))
        std::fprintf(stderr, "rank %d, max_lead %llu: weight min %.3g, %llu lead waits\n", r, static_cast<unsigned long long>(lead), st.weight_min,
                     static_cast<unsigned long long>(st.lead_waits));
      if (r == 0 && lead > 0 && st.lead_waits == 0) throw error("rank 0 never waited with max_lead = 2");
      if (r == 0 && lead > 0 && !(st.weight_min > 0.03))
        throw error(fmt::format("rank 0's weight fell to {} with max_lead = 2 ({} waits)", st.weight_min, st.lead_waits));
      if (r == 0 && lead == 0 && !(st.weight_min < 0.01))
        throw error(fmt::format("rank 0's weight stayed above {} without max_lead: the test no longer shows the lag", st.weight_min));
      final_barrier(*boot, "end", {0, 1});
      e.finish(0);
      return 0;
    });
    check_all_ok(out);
  }
}

namespace {
// Ranks over tcp under policy `never` with [engine] max_lead = 4 and a 10 s
// deadline: no model ever moves, so only the transport's step beacons say how
// far a rank's sources have come. Rank r steps steps[r] times, sleeping
// pause[r] after each; check(r, stats, seconds) judges the result.
// The lead waits of every other rank of the group (for checks whose bound
// depends on them); set before `check` runs.
std::uint64_t others_waits = 0;

// Returns whether every rank passed `check`; with `require` (the default)
// the test fails otherwise.
bool never_group(const std::vector<int>& steps, const std::vector<std::chrono::microseconds>& pause,
                 const std::function<void(int, const engine_stats&, double)>& check,
                 const std::function<void(engine_spec&)>& tweak = {}, bool require = true) {
  require_ucx();
  const int world = static_cast<int>(steps.size());
  const std::uint16_t port = free_port();
  const auto out = run_procs(world, "tcp", 60, [&](int r) {
    auto boot = std::make_shared<bootstrap>(r, world, "127.0.0.1", port, std::chrono::duration<double>(20.0));
    test::toy_model m({1000}, static_cast<std::uint64_t>(r + 1));
    auto spec = test::spec_of(policy_registry().make("never", options("test")), "exponential", "push-sum", 10);
    spec.settings.max_lead = 4;
    if (tweak) tweak(spec);
    engine e(m.view, r, world, std::move(spec), ucx_transport(boot));
    const auto t0 = clock_type::now();
    for (int s = 0; s < steps[static_cast<std::size_t>(r)]; ++s) {
      e.step({.lr = 0.1});
      std::this_thread::sleep_for(pause[static_cast<std::size_t>(r)]);
    }
    const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
    const engine_stats st = e.stats();
    e.finish(0);  // first: a rank that stops early releases the others' bound
    const std::uint64_t mine = st.lead_waits;
    boot->put(fmt::format("waits/{}", r), bootstrap::blob(reinterpret_cast<const std::byte*>(&mine), reinterpret_cast<const std::byte*>(&mine) + sizeof mine));
    others_waits = 0;
    for (int o = 0; o < world; ++o) {
      if (o == r) continue;
      const auto b = boot->get(fmt::format("waits/{}", o), "another rank's lead waits");
      std::uint64_t w = 0;
      if (b.size() == sizeof w) std::memcpy(&w, b.data(), sizeof w);
      others_waits += w;
    }
    // Rank 0 serves the rendezvous: it leaves once every rank has read.
    boot->put(fmt::format("read/{}", r), {});
    if (r == 0)
      for (int o = 1; o < world; ++o) boot->get(fmt::format("read/{}", o), "another rank to read the lead waits");
    check(r, st, seconds);
    return 0;
  });
  const bool ok = std::all_of(out.begin(), out.end(), [](const harness::child_end& c) { return c.exited && c.code == 0; });
  if (require) check_all_ok(out);
  return ok;
}
}  // namespace

TEST_CASE("ucx: step beacons let max_lead pace ranks that send no model") {
  // Rank 1 takes 3 ms per step; rank 0 must wait for it rather than run
  // ahead, and never hit its deadline.
  never_group({60, 60}, {0ms, 3ms}, [](int r, const engine_stats& st, double seconds) {
    if (st.step_beacons == 0) throw error(fmt::format("rank {} sent no step beacon", r));
    if (st.messages_sent != 0) throw error(fmt::format("rank {} sent {} models under `never`", r, st.messages_sent));
    // Rank 1 takes at least 60 x 3 ms; rank 0, held within 4 steps (plus a
    // beacon's 2) of what it heard, at least the 54 steps before that.
    if (r == 0 && (st.lead_waits == 0 || st.lead_timeouts != 0 || seconds < 0.150))
      throw error(fmt::format("rank 0 ran ahead: {} lead waits ({} timed out), 60 steps in {:.3f} s", st.lead_waits, st.lead_timeouts,
                              seconds));
  });
}

TEST_CASE("ucx: ranks that step fast send a step beacon per beacon_interval_ms, not per max_lead/2 steps, and still pace each other") {
  // 3000 steps of a few µs each: a beacon every 2 steps would wake both
  // progress threads up to 1500 times (what made a skipped step cost 1.4-3x
  // the drift pass in bench/transport). Thinned to one per 5 ms, with the
  // steps it came late added to the lead, neither rank gives up waiting.
  // Waits add beacons: the waiting rank's held one, and the one its source
  // tells when asked (its newest step, at once); twice that is allowed.
  never_group({3000, 3000}, {0ms, 0ms}, [](int r, const engine_stats& st, double seconds) {
    const double allowed = 4 + 1.2 * seconds / 0.005 + static_cast<double>(st.lead_waits + 2 * others_waits);
    if (st.lead_timeouts != 0 || static_cast<double>(st.step_beacons) > allowed || st.step_beacons > 300)
      throw error(fmt::format("rank {}: {} step beacons in {:.3f} s ({} lead waits, the other rank {}; {} timed out)", r, st.step_beacons,
                              seconds, st.lead_waits, others_waits, st.lead_timeouts));
  });
}

TEST_CASE("ucx: ranks of the same speed, with steps shorter than the beacon interval, barely wait for each other") {
  // 300 µs steps: a rank holds its beacons for up to 5 ms, so a rank that
  // runs a little ahead and waits asks its source for its newest step
  // instead of waiting for the held beacon to fall due (which cost a third
  // of the run here before asks existed). Long enough (about 0.7 s) that
  // the ranks' skewed start and a stall of a few tens of ms on a busy
  // machine stay well inside the bound.
  // Alone, about 1 % of the run goes to waits; with both cores busy with other
  // work (a build, the rest of the suite) a run sometimes waits a quarter of
  // it, as any descheduled rank makes its peer wait. One more run then: the
  // regression this guards against (a third of the run) fails both.
  const auto check = [](int r, const engine_stats& st, double seconds) {
    std::fprintf(stderr, "rank %d: %llu lead waits, %.4f s of %.3f s\n", r, static_cast<unsigned long long>(st.lead_waits), st.lead_wait_seconds, seconds);
    if (st.lead_timeouts != 0 || st.lead_wait_seconds > 0.2 * seconds)
      throw error(fmt::format("rank {}: waited {:.3f} s of {:.3f} s in {} lead waits ({} timed out)", r, st.lead_wait_seconds, seconds,
                              st.lead_waits, st.lead_timeouts));
  };
  if (!never_group({2000, 2000}, {300us, 300us}, check, {}, /*require=*/false)) {
    MESSAGE("the ranks waited more than a fifth of the run (above); once more, in case the machine was busy");
    never_group({2000, 2000}, {300us, 300us}, check);
  }
}

TEST_CASE("ucx: max_lead paces by the slowest source, not the fastest") {
  // Three ranks, each a source of the other two; rank 2 takes 3 ms per step.
  // Ranks 0 and 1 hear each other at once, but must not run ahead of rank 2:
  // a rank left behind would later pull the others back with a stale model.
  never_group({60, 60, 60}, {0ms, 0ms, 3ms}, [](int r, const engine_stats& st, double seconds) {
    // Unpaced they would take a few ms; paced, about 60 x 3 ms less what rank
    // 2 did before they started (start-up skew).
    if (r < 2 && (st.lead_waits < 5 || st.lead_timeouts != 0 || seconds < 0.060))
      throw error(fmt::format("rank {} ran ahead of its slow source: {} lead waits ({} timed out), 60 steps in {:.3f} s", r, st.lead_waits,
                              st.lead_timeouts, seconds));
  });
}

TEST_CASE("ucx: a source that finished releases max_lead's bound") {
  // Rank 1 stops after 20 steps and finishes; rank 0 goes on to 80. Its
  // finish() tells rank 0 (the largest step) not to wait for it, so rank 0
  // neither waits out its 10 s deadline nor gives up on one.
  never_group({80, 20}, {1ms, 1ms}, [](int r, const engine_stats& st, double seconds) {
    if (r == 0 && (st.lead_timeouts != 0 || seconds > 8))
      throw error(fmt::format("rank 0 waited for a finished source: {} timed-out waits, 80 steps in {:.1f} s", st.lead_timeouts, seconds));
  });
}

TEST_CASE("ucx: the default codec (auto) is int8 between processes paced by max_lead, none when they are not") {
  require_ucx();
  for (const std::uint64_t lead : {std::uint64_t{4}, std::uint64_t{0}}) {
    CAPTURE(lead);
    const std::uint16_t port = free_port();
    const auto out = run_procs(2, "tcp", 60, [&](int r) {
      auto boot = std::make_shared<bootstrap>(r, 2, "127.0.0.1", port, std::chrono::duration<double>(20.0));
      test::toy_model m({1000, 37}, 1);
      auto spec = test::spec_of(any_policy(periodic_until{}, "periodic-until"), "exponential", "push-sum", 20);
      spec.settings.max_lead = lead;
      engine e(m.view, r, 2, std::move(spec), ucx_transport(boot));
      for (int s = 0; s < 50; ++s) {
        for (auto& t : m.tensors)
          for (std::size_t i = 0; i < t.size(); ++i) t[i] += 0.001f * static_cast<float>((r + 1) * static_cast<int>(i % 5));
        e.step({.lr = 0.1});
        std::this_thread::sleep_for(2ms);
      }
      e.flush();
      drain_and_check_weight(e, *boot, r);
      const auto c = e.stats();
      const std::string want = lead > 0 ? "int8" : "none";
      // int8: about a byte a value (a scale per 256 values, a header per tensor); none: the fp32 model.
      const bool bytes_ok = lead > 0 ? c.bytes_sent * 3 < c.bytes_raw : c.bytes_sent == c.bytes_raw;
      if (c.codec != want || c.messages_sent < 5 || !bytes_ok)
        throw error(fmt::format("rank {}: codec '{}' (expected '{}'), {} messages, {} bytes of {} before the codec", r, c.codec, want,
                                c.messages_sent, c.bytes_sent, c.bytes_raw));
      final_barrier(*boot, "end", {0, 1});
      e.finish(0);
      return 0;
    });
    check_all_ok(out);
  }
}

TEST_CASE("ucx: two engines with int8, topk and lowrank codecs: weight conserved, fewer bytes after the codec, shared start when alike") {
  require_ucx();
  for (const bool alike : {false, true})
  for (const std::string codec_name : {"int8", "topk", "lowrank"}) {
    CAPTURE(codec_name);
    CAPTURE(alike);
    const std::uint16_t port = free_port();
    const auto out = run_procs(2, "tcp", 60, [&](int r) {
      auto boot = std::make_shared<bootstrap>(r, 2, "127.0.0.1", port, std::chrono::duration<double>(20.0));
      // Ranks that begin from the same model start their streams from it (no model-sized first message).
      test::toy_model m({1000, 37}, alike ? 1 : static_cast<std::uint64_t>(r + 1));
      m.view.matrix("t0", 40, 25);  // lowrank factors it; the rest go by each codec's rules
      auto spec = test::spec_of(any_policy(periodic_until{}, "periodic-until"), "exponential", "push-sum", 20);
      spec.codec.name = codec_name;
      if (codec_name == "topk") spec.codec.opts.set("ratio", 0.1);
      engine e(m.view, r, 2, std::move(spec), ucx_transport(boot));
      std::uint64_t first_bytes = 0;  // of the first message
      for (int s = 0; s < 50; ++s) {
        for (auto& t : m.tensors)
          for (std::size_t i = 0; i < t.size(); ++i) t[i] += 0.001f * static_cast<float>((r + 1) * static_cast<int>(i % 5));
        e.step({.lr = 0.1});
        if (first_bytes == 0 && e.stats().messages_sent == 1) first_bytes = e.stats().bytes_sent;
        std::this_thread::sleep_for(2ms);
      }
      e.flush();
      const auto sent = e.stats().messages_sent;
      // top-k and lowrank carry the model (the matrix in fp32) in a first message, unless both ranks began alike.
      const std::uint64_t raw = sizeof(wire_header) + 1037 * sizeof(float);
      if (codec_name != "int8" && (first_bytes == 0 || (first_bytes < raw / 2) != alike))
        throw error(fmt::format("rank {}: first message {} bytes (the model: {}), ranks began alike: {}", r, first_bytes, raw, alike));
      drain_and_check_weight(e, *boot, r);
      const auto c = e.stats();
      if (sent < 10 || !(c.bytes_sent < c.bytes_raw / 2))
        throw error(fmt::format("rank {}: {} sends, {} bytes after the codec of {} before", r, sent, c.bytes_sent, c.bytes_raw));
      if (c.peers.size() != 1 || c.peers[0].shared_start != alike)
        throw error(fmt::format("rank {}: shared_start {} with {} peers, expected {}", r, c.peers.empty() ? false : c.peers[0].shared_start,
                                c.peers.size(), alike));
      final_barrier(*boot, "end", {0, 1});
      e.finish(0);
      return 0;
    });
    check_all_ok(out);
  }
}

TEST_CASE("ucx: a codec stream whose receiver's backlog overflowed starts again from a full message; training goes on, the weight exact") {
  // Rank 1 stops merging for a second (an evaluation, a checkpoint) while
  // rank 0 sends unpaced: rank 1's backlog (4 messages) overflows and drops
  // messages of an int8 stream, which then cannot apply the changes after
  // them. Rank 1 asks rank 0 for a full message, takes the changes before it
  // out (their push-sum shares ride with it) and trains on.
  require_ucx();
  const std::uint16_t port = free_port();
  check_all_ok(run_procs(2, "tcp", 60, [&](int r) {
    auto boot = std::make_shared<bootstrap>(r, 2, "127.0.0.1", port, std::chrono::duration<double>(20.0));
    test::toy_model m({300}, static_cast<std::uint64_t>(r + 1));
    auto spec = test::spec_of(any_policy(periodic_until{.until = 1'000'000}, "periodic-until"), "exponential", "push-sum", 20);
    spec.codec.name = "int8";
    spec.settings.max_lead = 0;  // unpaced: rank 0 goes on while rank 1 merges nothing
    engine e(m.view, r, 2, std::move(spec), ucx_transport(boot, ucx_options{.backlog = 4}));
    // Both step until rank 1's stream has started again from a full message.
    bool told = false;
    const auto deadline = clock_type::now() + 30s;
    for (int s = 0;; ++s) {
      if (clock_type::now() > deadline) throw timeout_error(fmt::format("rank {}: no full message within 30 s", r));
      for (std::size_t i = 0; i < m.tensors[0].size(); ++i) m.tensors[0][i] += 0.001f * static_cast<float>((r + 1) * static_cast<int>(i % 5));
      e.step({.lr = 0.1});
      if (r == 1 && s == 50) std::this_thread::sleep_for(1s);
      if (s > 50 && s % 20 == 0) {
        if (r == 1 && !told && e.stats().codec_resyncs > 0) {
          boot->put("resynced", {});
          told = true;
        }
        if (boot->try_get("resynced")) break;
      }
      std::this_thread::sleep_for(1ms);
    }
    e.finish(0);
    const auto c = e.stats();
    for (const auto& t : m.tensors)
      for (const float v : t)
        if (!std::isfinite(v)) throw error(fmt::format("rank {}: a value is not finite", r));
    const double w = c.weight;
    boot->put(fmt::format("w/{}", r), bootstrap::blob(reinterpret_cast<const std::byte*>(&w), reinterpret_cast<const std::byte*>(&w) + 8));
    double other = 0;
    const auto wb = boot->get(fmt::format("w/{}", 1 - r), "the peer's weight");
    std::memcpy(&other, wb.data(), 8);
    if (std::abs(w + other - 2.0) > 1e-9) throw error(fmt::format("rank {}: weights {} + {} = {} (expected 2)", r, w, other, w + other));
    if (r == 1 && (c.transport_dropped == 0 || c.codec_resync_skipped == 0))
      throw error(fmt::format("rank 1: {} messages dropped by the transport, {} changes skipped: the test proves nothing", c.transport_dropped,
                              c.codec_resync_skipped));
    if (r == 0 && c.dropped == 0) throw error("rank 0: no post was refused: rank 1's request for a full message never came");
    if (std::getenv("GOSSIP_TEST_VERBOSE"))
      std::fprintf(stderr, "rank %d: resyncs %llu, skipped %llu, transport_dropped %llu, dropped %llu, weight %.17g\n", r,
                   static_cast<unsigned long long>(c.codec_resyncs), static_cast<unsigned long long>(c.codec_resync_skipped),
                   static_cast<unsigned long long>(c.transport_dropped), static_cast<unsigned long long>(c.dropped), w);
    final_barrier(*boot, "end", {0, 1});
    return 0;
  }));
}

TEST_CASE("ucx: kill -9 of one rank mid-training; the other engines finish, exit 0 and report it") {
  require_ucx();
  for (const char* tls : {"tcp", "tcp/listener", "posix,self"}) {
    CAPTURE(tls);
    const std::uint16_t port = free_port();
    const auto out = run_procs(3, tls, 90, [&](int r) {
      auto boot = std::make_shared<bootstrap>(r, 3, "127.0.0.1", port, std::chrono::duration<double>(30.0));
      test::toy_model m({2000, 100}, 1);
      engine e(m.view, r, 3, test::spec_of(any_policy(policies::periodic{.every = 2}, "periodic"), "complete", "push-sum", 30),
               ucx_transport(boot));
      for (int s = 0; s < 150; ++s) {
        if (r == 2 && s == 40) ::raise(SIGKILL);  // mid-training, no goodbye
        for (auto& v : m.tensors[0]) v += 0.001f * static_cast<float>(r + 1);
        e.step({.lr = 0.1});
        std::this_thread::sleep_for(2ms);
      }
      e.finish(0);  // drains what rank 0/1 sent each other; rank 2 is skipped once detected
      const auto& st = e.stats();
      if (st.dead_peers != std::vector<int>{2})
        throw error(fmt::format("rank {}: dead_peers = [{}], expected [2]", r, fmt::join(st.dead_peers, ", ")));
      if (st.steps != 150) throw error(fmt::format("rank {}: {} steps", r, st.steps));
      for (const auto& p : st.peers)
        if ((p.rank == 2) != p.dead) throw error(fmt::format("rank {}: peer {} dead = {}", r, p.rank, p.dead));
      return 0;
    });
    REQUIRE(out.size() == 3);
    CHECK(out[2].signal == SIGKILL);
    for (int r = 0; r < 2; ++r) {
      INFO("rank " << r << " exited=" << out[static_cast<std::size_t>(r)].exited << " code=" << out[static_cast<std::size_t>(r)].code);
      CHECK((out[static_cast<std::size_t>(r)].exited && out[static_cast<std::size_t>(r)].code == 0));
    }
  }
}

namespace {
void put_double(bootstrap& b, const std::string& key, double v) {
  b.put(key, bootstrap::blob(reinterpret_cast<const std::byte*>(&v), reinterpret_cast<const std::byte*>(&v) + sizeof v));
}
double get_double(bootstrap& b, const std::string& key, const std::string& what) {
  const auto blob = b.get(key, what);
  double v = 0;
  if (blob.size() != sizeof v) throw error(fmt::format("'{}' holds {} bytes", key, blob.size()));
  std::memcpy(&v, blob.data(), sizeof v);
  return v;
}
}  // namespace

// The observed failure: 4 ranks over the exponential topology, rank 2 killed.
// Rank 0 sends to 1 and 2 and hears from 2 and 3; when its round names 2, the
// stand-in must be 1 (a rank it is connected to), not 3.
TEST_CASE("ucx: kill -9 of rank 2 of 4 over the exponential topology; survivors keep mixing, finish and account the lost mass") {
  require_ucx();
  for (const char* tls : {"tcp", "tcp/listener", "posix,self"}) {
    CAPTURE(tls);
    const std::uint16_t port = free_port();
    const auto out = run_procs(4, tls, 90, [&](int r) {
      auto boot = std::make_shared<bootstrap>(r, 4, "127.0.0.1", port, std::chrono::duration<double>(30.0));
      test::toy_model m({3000, 100}, 1);
      engine e(m.view, r, 4, test::spec_of(any_policy(policies::periodic{.every = 1}, "periodic"), "exponential", "push-sum", 30),
               ucx_transport(boot));
      std::uint64_t sends_at_death = 0;
      auto death = clock_type::now();
      // Over shared memory the death shows through UCX keepalive (about a
      // second); sends to rank 2 stay on the wire until then. Train on for 4 s.
      for (int s = 0; s < 200 || clock_type::now() - death < 4s; ++s) {
        if (r == 2 && s == 50) ::raise(SIGKILL);  // mid-training, sends in flight, no goodbye
        if (s == 50) {
          sends_at_death = e.stats().sends;
          death = clock_type::now();
        }
        for (auto& v : m.tensors[0]) v += 0.001f * static_cast<float>(r + 1);
        e.step({.lr = 0.1});
        std::this_thread::sleep_for(2ms);
      }
      e.finish(0);
      const auto& st = e.stats();
      if (st.dead_peers != std::vector<int>{2})
        throw error(fmt::format("rank {}: dead_peers = [{}], expected [2]", r, fmt::join(st.dead_peers, ", ")));
      if (st.dead.size() != 1 || st.dead[0].rank != 2) throw error(fmt::format("rank {}: the dead list does not name rank 2", r));
      const auto& d = st.dead[0];
      if (!(d.weight_refunded >= 0 && d.weight_unconfirmed >= 0 && d.weight_estimate >= 0 && std::isfinite(st.lost_weight)))
        throw error(fmt::format("rank {}: lost-mass figures refunded {} unconfirmed {} estimate {} lost {}", r, d.weight_refunded,
                                d.weight_unconfirmed, d.weight_estimate, st.lost_weight));
      // Every survivor always has a live destination here: its sends go on.
      if (st.no_live_peer != 0 || st.sends < sends_at_death + 100)
        throw error(fmt::format("rank {}: {} sends after the death ({} with no live peer)", r, st.sends - sends_at_death, st.no_live_peer));
      for (const auto& t : m.tensors)
        for (float v : t)
          if (!std::isfinite(v)) throw error(fmt::format("rank {}: the model holds a non-finite value", r));
      // Push-sum mass: what the survivors hold plus what died with rank 2 is
      // the world's 4. The loss is real but bounded by what rank 2 could hold.
      const double w = e.weight();
      if (!(w > 0 && std::isfinite(w))) throw error(fmt::format("rank {}: weight {}", r, w));
      put_double(*boot, fmt::format("w/{}", r), w);
      put_double(*boot, fmt::format("lost/{}", r), st.lost_weight + d.weight_estimate);
      double held = 0, estimated = 0;
      for (int j : {0, 1, 3}) {
        held += get_double(*boot, fmt::format("w/{}", j), fmt::format("rank {}'s final weight", j));
        estimated += get_double(*boot, fmt::format("lost/{}", j), fmt::format("rank {}'s lost-mass estimate", j));
      }
      const double lost = 4.0 - held;
      if (std::getenv("GOSSIP_TEST_VERBOSE"))
        std::fprintf(stderr, "rank %d (%s): weight %.4f, refunded %.4f, unconfirmed %.4f, estimate %.4f; survivors hold %.4f, lost %.4f\n", r,
                     tls, w, d.weight_refunded, d.weight_unconfirmed, d.weight_estimate, held, lost);
      if (!(lost > 0 && lost < 4 && estimated > 0))
        throw error(fmt::format("rank {}: survivors hold {:.6f} of 4 (lost {:.6f}), estimates sum to {:.6f}", r, held, lost, estimated));
      final_barrier(*boot, "end", {0, 1, 3});
      return 0;
    });
    REQUIRE(out.size() == 4);
    CHECK(out[2].signal == SIGKILL);
    for (int r : {0, 1, 3}) {
      INFO("rank " << r << " exited=" << out[static_cast<std::size_t>(r)].exited << " code=" << out[static_cast<std::size_t>(r)].code
                   << " signal=" << out[static_cast<std::size_t>(r)].signal);
      CHECK((out[static_cast<std::size_t>(r)].exited && out[static_cast<std::size_t>(r)].code == 0));
    }
  }
}

// Rank 0 serves the rendezvous. When it dies the others finish training and
// leave (their drain handshake cannot happen) within a bounded time, naming it.
TEST_CASE("ucx: kill -9 of rank 0, the rendezvous holder; the others finish without hanging on it") {
  require_ucx();
  const std::uint16_t port = free_port();
  const auto out = run_procs(4, "tcp", 90, [&](int r) {
    auto boot = std::make_shared<bootstrap>(r, 4, "127.0.0.1", port, std::chrono::duration<double>(30.0));
    test::toy_model m({2000}, 1);
    engine e(m.view, r, 4, test::spec_of(any_policy(policies::periodic{.every = 1}, "periodic"), "exponential", "push-sum", 30),
             ucx_transport(boot));
    for (int s = 0; s < 150; ++s) {
      if (r == 0 && s == 40) ::raise(SIGKILL);
      for (auto& v : m.tensors[0]) v += 0.001f;
      e.step({.lr = 0.1});
      std::this_thread::sleep_for(2ms);
    }
    const auto t0 = clock_type::now();
    e.finish(0);
    const double took = std::chrono::duration<double>(clock_type::now() - t0).count();
    if (took > 15) throw error(fmt::format("rank {}: finish() took {:.1f} s with rank 0 dead", r, took));
    if (e.stats().dead_peers != std::vector<int>{0})
      throw error(fmt::format("rank {}: dead_peers = [{}], expected [0]", r, fmt::join(e.stats().dead_peers, ", ")));
    // The rendezvous is gone: a request fails fast and names rank 0's address.
    const auto t1 = clock_type::now();
    try {
      boot->put("after", {});
      throw error(fmt::format("rank {}: a put to the dead rendezvous succeeded", r));
    } catch (const transport_error& x) {
      const std::string what = x.what();
      if (what.find("rank 0") == std::string::npos || what.find(fmt::format("127.0.0.1:{}", port)) == std::string::npos)
        throw error(fmt::format("rank {}: the message does not name rank 0 and its address: {}", r, what));
    }
    if (clock_type::now() - t1 > 10s) throw error(fmt::format("rank {}: the failed put took more than 10 s", r));
    return 0;
  });
  REQUIRE(out.size() == 4);
  CHECK(out[0].signal == SIGKILL);
  for (int r : {1, 2, 3}) {
    INFO("rank " << r << " exited=" << out[static_cast<std::size_t>(r)].exited << " code=" << out[static_cast<std::size_t>(r)].code);
    CHECK((out[static_cast<std::size_t>(r)].exited && out[static_cast<std::size_t>(r)].code == 0));
  }
}


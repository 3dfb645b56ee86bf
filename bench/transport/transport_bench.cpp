// bench/transport — does the UCX transport move payloads as fast as UCX itself?
//
// 1. Throughput. Two forked ranks drive a gossip::ucx_transport directly (no
//    engine): rank 0 posts W warm-up and then N timed messages of S payload
//    bytes to rank 1 from B rotating send buffers; rank 1 collects and
//    releases them from its inbox (B = 2 send buffers and inbox depth 2 by
//    default: the engine's own). The figure is measured at the receiver:
//    payload bytes N·S divided by the time from consuming the last warm-up
//    message to consuming the last timed one — the steady streaming rate.
//    Every message's sender, step and payload stamps are checked, and the
//    last one's payload is compared word for word, before its time counts.
//    Right after each gossip run, ucx_perftest -t tag_bw runs the same size,
//    count and warm-up with the same UCX_TLS (server and client are child
//    processes), then again with -e: peer error handling on its endpoints,
//    as the transport creates them (over tcp this alone changes UCX's speed).
//    Sender and receiver sit on one CPU each, for both benchmarks. Each size
//    runs --reps times, interleaved; the table reports the best of them (the
//    run least disturbed by other work on the machine), the JSON every value.
// 2. Step cost. A real gossip::engine over ucx_transport, policy `never`, on
//    two ranks: the median of engine.step() against the median of
//    gossip::drift_pass over the same model and x̂ alone, timed alternately
//    in the same loop.
//
//   transport_bench                          # ~1 min on 2 cores: table + ./transport.json
//   transport_bench --out results --reps 7 --sizes 1M 16M
//   transport_bench --smoke --out DIR        # tiny sizes, then checks its own JSON
//   transport_bench --check DIR/transport.json
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gossip/bootstrap.hpp"
#include "gossip/gossip.hpp"
#include "gossip/transports/ucx/ucx.hpp"

namespace {

using namespace gossip;
using clock_type = std::chrono::steady_clock;
using json = nlohmann::json;

constexpr double mib = 1024.0 * 1024.0;

struct settings {
  std::vector<std::string> tls{"posix,self", "tcp"};
  std::vector<std::size_t> sizes;  // payload bytes
  int reps = 5;
  std::size_t bytes_per_run = 256u << 20;  // timed payload per run; N = clamp(bytes_per_run / S, min, max)
  std::size_t min_messages = 8, max_messages = 4096;
  int warmup = 5;
  int send_buffers = 2;  // the engine's default (engine_settings::send_buffers)
  int depth = 2;  // inbox slots per source, as the engine allocates
  std::size_t backlog = 64;
  std::string wait = "backoff";
  std::vector<std::size_t> step_elements{std::size_t{1} << 20, std::size_t{16} << 20};
  int steps = 200;
  std::string perftest = "ucx_perftest";
  std::string perftest_test = "tag_bw";
  bool perftest_eh = true;  // also run ucx_perftest -e: endpoints with peer error handling, as ucx_transport's
  double timeout_s = 60;
  std::string out = ".";
  bool smoke = false;
  std::vector<int> cpus;  // rank 0 / perftest client, rank 1 / perftest server; empty: not pinned
};

std::size_t parse_size(const std::string& s) {
  std::size_t mult = 1;
  std::string num = s;
  if (!s.empty() && (s.back() == 'K' || s.back() == 'M' || s.back() == 'G')) {
    mult = s.back() == 'K' ? 1024 : s.back() == 'M' ? 1024 * 1024 : std::size_t{1} << 30;
    num.pop_back();
  }
  const auto v = std::stoull(num) * mult;
  if (v < 64 || v % 64 != 0) throw std::invalid_argument("size '" + s + "' must be a positive multiple of 64 bytes");
  return v;
}

std::string size_name(std::size_t b) {
  if (b % (1u << 20) == 0) return fmt::format("{}M", b >> 20);
  if (b % 1024 == 0) return fmt::format("{}K", b >> 10);
  return std::to_string(b);
}

std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::uint64_t splitmix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Payload of send buffer `b`: 8-byte words of a hash of (b, word index); the
// first and last words are stamped per message (step, step ^ stamp_key), so a
// stale or misplaced buffer is caught too.
constexpr std::uint64_t stamp_key = 0x5a5a'1234'abcd'0f0full;
std::uint64_t pattern(std::uint64_t b, std::uint64_t i) noexcept { return splitmix((b << 40) ^ i); }

// ---- child processes -------------------------------------------------------

// A line-oriented pipe end with deadline-bounded reads.
class line_reader {
 public:
  explicit line_reader(int fd) : m_fd(fd) {}
  // The next line, or nothing at EOF or past the deadline.
  std::optional<std::string> next(clock_type::time_point deadline) {
    for (;;) {
      if (const auto nl = m_buf.find('\n'); nl != std::string::npos) {
        std::string line = m_buf.substr(0, nl);
        m_buf.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now()).count();
      if (left <= 0) return std::nullopt;
      pollfd p{m_fd, POLLIN, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) continue;
      char tmp[4096];
      const ssize_t n = ::read(m_fd, tmp, sizeof tmp);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return std::nullopt;
      m_buf.append(tmp, static_cast<std::size_t>(n));
    }
  }
  // Everything until EOF or the deadline.
  std::string rest(clock_type::time_point deadline) {
    std::string all;
    while (auto l = next(deadline)) all += *l + "\n";
    all += m_buf;
    m_buf.clear();
    return all;
  }

 private:
  int m_fd;
  std::string m_buf;
};

void write_line(int fd, const std::string& s) {
  const std::string l = s + "\n";
  std::size_t at = 0;
  while (at < l.size()) {
    const ssize_t n = ::write(fd, l.data() + at, l.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw error(fmt::format("bench/transport: cannot write to a child's pipe: {}", std::strerror(errno)));
    at += static_cast<std::size_t>(n);
  }
}

// Waits for `pid` until the deadline, then kills it (by PID: only our own children). Returns its exit code, or -signal.
int reap(pid_t pid, clock_type::time_point deadline) {
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    if (r < 0) return -1;
    if (clock_type::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -SIGKILL;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// How the bench's own loops wait for the transport (a free send buffer, the
// next message). `backoff` is gossip::detail::wait_for's: spin 64 times, yield
// until 256, then sleep 20 µs per try — it leaves the core to the transport's
// progress thread, which shares it when the ranks are pinned.
class waiter {
 public:
  explicit waiter(const std::string& mode) : m_mode(mode == "spin" ? 0 : mode == "yield" ? 1 : mode == "sleep" ? 2 : 3) {}
  void operator()() {
    switch (m_mode) {
      case 0: return;
      case 1: std::this_thread::yield(); return;
      case 2: std::this_thread::sleep_for(std::chrono::microseconds(20)); return;
      default:
        if (++m_tries < 64) return;
        if (m_tries < 256)
          std::this_thread::yield();
        else
          std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  void reset() noexcept { m_tries = 0; }

 private:
  int m_mode;
  unsigned m_tries = 0;
};

// Pins the calling process (and the threads it starts later) to one CPU.
void pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (::sched_setaffinity(0, sizeof set, &set) != 0)
    std::fprintf(stderr, "bench/transport: cannot pin to CPU %d: %s (running unpinned)\n", cpu, std::strerror(errno));
}

// ---- one rank --------------------------------------------------------------

struct rank_process {
  int rank;
  const settings& s;
  std::shared_ptr<bootstrap> boot;
  std::size_t max_payload = 0, message_bytes = 0;
  model_layout layout;
  std::uint64_t layout_fp = 0;
  inbox in;
  std::vector<std::unique_ptr<std::byte[]>> bufs;
  std::optional<ucx_transport> t;
  std::uint64_t seq = 0;  // messages posted (rank 0) or consumed (rank 1) so far
  std::vector<received> got;

  rank_process(int r, std::uint16_t port, const settings& st) : rank(r), s(st) {
    boot = std::make_shared<bootstrap>(r, 2, "127.0.0.1", port, std::chrono::duration<double>(s.timeout_s));
    max_payload = *std::max_element(s.sizes.begin(), s.sizes.end());
    message_bytes = (sizeof(wire_header) + max_payload + 63) / 64 * 64;
    layout = {{"payload", max_payload / sizeof(float), dtype::f32}};
    layout_fp = fingerprint(layout);
    std::vector<int> sources;
    if (r == 1) sources.push_back(0);
    in = inbox(sources, static_cast<std::size_t>(s.depth), message_bytes);
    if (r == 0)
      for (int b = 0; b < s.send_buffers; ++b) {
        bufs.push_back(std::make_unique<std::byte[]>(message_bytes));
        std::memset(bufs.back().get(), 0, message_bytes);  // touch every page before any timing
      }
    got.resize(static_cast<std::size_t>(s.depth) + 1);
    ucx_options o;
    o.backlog = s.backlog;
    t.emplace(boot, o);
    transport_setup ts;
    ts.rank = r;
    ts.world = 2;
    ts.layout = layout;
    ts.layout_fingerprint = layout_fp;
    ts.config_fingerprint = 0x7472616e73706f72ull;  // "transpor"
    ts.sources = sources;
    if (r == 0) ts.targets = {1};
    ts.message_bytes = message_bytes;
    ts.inbox = &in;
    ts.timeout = std::chrono::duration<double>(s.timeout_s);
    t->attach(ts);
  }

  clock_type::time_point deadline() const {
    return clock_type::now() + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(s.timeout_s));
  }

  // Rank 0: W + N posts of `bytes` payload, then flush. Reply: "ok".
  std::string send(std::size_t bytes, std::uint64_t count) {
    const std::size_t words = bytes / 8;
    for (std::size_t b = 0; b < bufs.size(); ++b) {  // untimed
      auto* w = reinterpret_cast<std::uint64_t*>(bufs[b].get() + sizeof(wire_header));
      for (std::size_t i = 0; i < words; ++i) w[i] = pattern(b, i);
    }
    const auto end = deadline();
    waiter wait(s.wait);
    for (std::uint64_t k = 0; k < count; ++k, ++seq) {
      std::byte* buf = bufs[seq % bufs.size()].get();
      for (wait.reset(); t->busy(buf); wait())
        if (clock_type::now() > end) return fmt::format("fail rank 0: send buffer {} still busy after {} s", seq % bufs.size(), s.timeout_s);
      wire_header h;
      h.sender = 0;
      h.step = seq;
      h.weight = 1.0;
      h.payload_bytes = bytes;
      h.layout_fingerprint = layout_fp;
      std::memcpy(buf, &h, sizeof h);
      auto* w = reinterpret_cast<std::uint64_t*>(buf + sizeof h);
      w[0] = seq;
      w[words - 1] = seq ^ stamp_key;
      for (wait.reset();; wait()) {
        const post_status st = t->post(1, {buf, sizeof h + bytes}, seq);
        if (st == post_status::ok) break;
        if (st == post_status::peer_dead) return "fail rank 0: rank 1 is dead";
        if (clock_type::now() > end) return "fail rank 0: post() stayed busy";
      }
    }
    t->flush(std::chrono::duration<double>(s.timeout_s));
    return "ok";
  }

  // Rank 1: consumes W + N messages. Reply: "ok SECONDS" (last warm-up to last timed message consumed).
  std::string receive(std::size_t bytes, std::uint64_t warmup, std::uint64_t count) {
    const std::size_t words = bytes / 8;
    const std::uint64_t first = seq, last = seq + warmup + count - 1, t0_at = seq + warmup - 1;
    clock_type::time_point t0{}, t1{};
    const auto end = deadline();
    waiter wait(s.wait);
    while (seq <= last) {
      const std::size_t n = t->collect(0, got);
      if (n == 0) {
        if (clock_type::now() > end)
          return fmt::format("fail rank 1: consumed {} of {} messages in {} s (dropped {})", seq - first, last + 1 - first, s.timeout_s,
                             t->counters().dropped);
        wait();
        continue;
      }
      wait.reset();
      const auto now = clock_type::now();
      for (std::size_t i = 0; i < n; ++i, ++seq) {
        const auto& m = got[i];
        if (m.sender != 0 || m.step != seq || m.elements * sizeof(float) != bytes)
          return fmt::format("fail rank 1: message {} came as sender {} step {} with {} bytes (expected sender 0, {} bytes): lost or reordered",
                             seq, m.sender, m.step, m.elements * sizeof(float), bytes);
        const auto* w = reinterpret_cast<const std::uint64_t*>(m.data);
        if (w[0] != seq || w[words - 1] != (seq ^ stamp_key))
          return fmt::format("fail rank 1: message {} carries the stamps of message {} / {}", seq, w[0], w[words - 1] ^ stamp_key);
        if (seq == t0_at) t0 = now;
        if (seq == last) {
          t1 = now;
          const std::uint64_t b = seq % static_cast<std::uint64_t>(s.send_buffers);
          for (std::size_t k = 1; k + 1 < words; ++k)
            if (w[k] != pattern(b, k))
              return fmt::format("fail rank 1: payload word {} of message {} is {:#x}, expected {:#x}", k, seq, w[k], pattern(b, k));
        }
      }
      t->release(0);
    }
    if (const auto c = t->counters(); c.dropped != 0) return fmt::format("fail rank 1: the transport dropped {} messages", c.dropped);
    return fmt::format("ok {:.9f}", std::chrono::duration<double>(t1 - t0).count());
  }

  // Both ranks: an engine with the `never` policy over a fresh ucx_transport.
  // Reply: "ok STEP_US DRIFT_US" (medians).
  std::string step_cost(std::size_t elements, int steps) {
    std::vector<float> x(elements);
    for (std::size_t i = 0; i < elements; ++i)
      x[i] = static_cast<float>(static_cast<double>(splitmix(i + static_cast<std::size_t>(rank) * 7919) >> 11) * 0x1p-53 - 0.5);
    model_view view;
    view.add("w", std::span<float>(x));
    engine_spec spec;
    spec.policy = any_policy(policies::never{}, "never");
    spec.topology.name = "exponential";
    spec.protocol.name = "push-sum";
    spec.settings.timeout = std::chrono::duration<double>(s.timeout_s);
    engine e(view, rank, 2, std::move(spec), ucx_transport(boot));
    // x̂ = the model at construction; move x a little so the drift is not zero.
    for (std::size_t i = 0; i < elements; i += 7) x[i] += 1e-3f;
    const float* hat = e.snapshot().data();
    volatile double sink = 0;
    std::vector<double> step_us, drift_us;
    const int warm = std::max(2, steps / 10);
    for (int k = 0; k < warm + steps; ++k) {
      // Alternate which goes first, so neither always runs right after the other.
      double ts = 0, td = 0;
      for (int half = 0; half < 2; ++half) {
        const bool do_step = (half == 0) == (k % 2 == 0);
        const auto a = clock_type::now();
        if (do_step) {
          const auto r = e.step();
          sink = sink + r.relative_drift;
          if (r.sent) return "fail: the never policy sent";
        } else {
          sink = sink + drift_pass(x.data(), hat, nullptr, elements).diff_sq;
        }
        const double us = std::chrono::duration<double, std::micro>(clock_type::now() - a).count();
        (do_step ? ts : td) = us;
      }
      if (k >= warm) {
        step_us.push_back(ts);
        drift_us.push_back(td);
      }
    }
    const auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    };
    e.finish(0);
    return fmt::format("ok {:.3f} {:.3f}", median(step_us), median(drift_us));
  }

  // Rank 0 serves the rendezvous, so it leaves last.
  void final_barrier() {
    boot->put(fmt::format("bench/end/arrive/{}", rank), {});
    boot->get(fmt::format("bench/end/arrive/{}", 1 - rank), fmt::format("rank {} at the end", 1 - rank));
    boot->put(fmt::format("bench/end/ack/{}", rank), {});
    if (rank == 0) boot->get("bench/end/ack/1", "rank 1 to acknowledge the end");
  }
};

int rank_main(int rank, std::uint16_t port, const settings& s, int cmd_fd, int res_fd) {
  try {
    rank_process p(rank, port, s);
    write_line(res_fd, "ready");
    line_reader cmds(cmd_fd);
    for (;;) {
      const auto line = cmds.next(clock_type::now() + std::chrono::seconds(600));
      if (!line || *line == "quit") break;
      std::istringstream in(*line);
      std::string op;
      in >> op;
      std::string reply;
      if (op == "xfer") {
        std::size_t bytes = 0;
        std::uint64_t warmup = 0, count = 0;
        in >> bytes >> warmup >> count;
        reply = rank == 0 ? p.send(bytes, warmup + count) : p.receive(bytes, warmup, count);
      } else if (op == "step") {
        std::size_t elements = 0;
        int steps = 0;
        in >> elements >> steps;
        reply = p.step_cost(elements, steps);
      } else {
        reply = "fail unknown command " + *line;
      }
      write_line(res_fd, reply);
      if (reply.rfind("ok", 0) != 0) return 1;
    }
    p.final_barrier();
    p.t->leave();
    return 0;
  } catch (const std::exception& e) {
    try {
      write_line(res_fd, fmt::format("fail rank {}: {}", rank, e.what()));
    } catch (...) {
    }
    return 100;
  }
}

// The two ranks of one UCX_TLS setting, forked, driven over pipes.
class rank_pair {
 public:
  rank_pair(const std::string& tls, const settings& s) : m_s(s), m_tls(tls) {
    const std::uint16_t port = free_port();
    std::fflush(nullptr);
    try {
      start(port);
      for (int r = 0; r < 2; ++r) expect_ok(r, read(r), "attach");
    } catch (...) {
      stop_now();
      throw;
    }
  }
  rank_pair(const rank_pair&) = delete;
  ~rank_pair() { stop(); }

  // Sends `cmd` to both ranks; returns their replies (rank order), throwing on a failure.
  std::array<std::string, 2> both(const std::string& cmd, const std::string& what) {
    for (int r = 0; r < 2; ++r) write_line(m_cmd[r], cmd);
    std::array<std::string, 2> out;
    for (int r = 0; r < 2; ++r) out[static_cast<std::size_t>(r)] = read(r);
    for (int r = 0; r < 2; ++r) expect_ok(r, out[static_cast<std::size_t>(r)], what);
    return out;
  }

 private:
  void start(std::uint16_t port) {
    const auto& s = m_s;
    const auto& tls = m_tls;
    for (int r = 0; r < 2; ++r) {
      int cmd[2], res[2];
      if (::pipe(cmd) != 0 || ::pipe(res) != 0) throw error(fmt::format("bench/transport: pipe: {}", std::strerror(errno)));
      const pid_t pid = ::fork();
      if (pid < 0) throw error(fmt::format("bench/transport: fork: {}", std::strerror(errno)));
      if (pid == 0) {
        ::close(cmd[1]);
        ::close(res[0]);
        for (int k = 0; k < r; ++k) {  // the other rank's pipe ends
          ::close(m_cmd[static_cast<std::size_t>(k)]);
          ::close(m_res_fd[static_cast<std::size_t>(k)]);
        }
        ::setenv("UCX_TLS", tls.c_str(), 1);
        ::setenv("UCX_NET_DEVICES", "lo", 1);
        if (!s.cpus.empty()) pin_to(s.cpus[static_cast<std::size_t>(r)]);
        ::alarm(static_cast<unsigned>(std::max(120.0, 20 * s.timeout_s)));  // never outlive a crashed driver
        std::fflush(nullptr);
        ::_exit(rank_main(r, port, s, cmd[0], res[1]));
      }
      ::close(cmd[0]);
      ::close(res[1]);
      m_pid[static_cast<std::size_t>(r)] = pid;
      m_cmd[static_cast<std::size_t>(r)] = cmd[1];
      m_res_fd[static_cast<std::size_t>(r)] = res[0];
      m_res[static_cast<std::size_t>(r)] = std::make_unique<line_reader>(res[0]);
    }
  }

  // Asks both ranks to leave, then kills (by PID) what has not exited in 15 s.
  void stop() {
    for (int r = 0; r < 2; ++r) {
      if (m_cmd[r] >= 0) {
        try {
          write_line(m_cmd[r], "quit");
        } catch (...) {
        }
        ::close(m_cmd[r]);
      }
    }
    const auto end = clock_type::now() + std::chrono::seconds(15);
    for (int r = 0; r < 2; ++r)
      if (m_pid[r] > 0) reap(m_pid[r], end);
    for (int r = 0; r < 2; ++r)
      if (m_res_fd[r] >= 0) ::close(m_res_fd[r]);
    m_cmd[0] = m_cmd[1] = m_res_fd[0] = m_res_fd[1] = -1;
    m_pid[0] = m_pid[1] = -1;
  }
  // A rank failed to start: no orderly goodbye.
  void stop_now() {
    for (int r = 0; r < 2; ++r)
      if (m_pid[r] > 0) ::kill(m_pid[r], SIGKILL);
    stop();
  }

  std::string read(int r) {
    const auto deadline = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(3 * m_s.timeout_s));
    auto l = m_res[static_cast<std::size_t>(r)]->next(deadline);
    return l ? *l : std::string("fail: no reply (the rank exited or timed out)");
  }
  void expect_ok(int r, const std::string& reply, const std::string& what) {
    if (reply.rfind("ok", 0) == 0 || reply == "ready") return;
    throw error(fmt::format("bench/transport: UCX_TLS={}, {}: rank {}: {}", m_tls, what, r, reply));
  }

  const settings& m_s;
  std::string m_tls;
  pid_t m_pid[2] = {-1, -1};
  int m_cmd[2] = {-1, -1}, m_res_fd[2] = {-1, -1};
  std::array<std::unique_ptr<line_reader>, 2> m_res;
};

// ---- ucx_perftest ----------------------------------------------------------

std::string find_on_path(const std::string& name) {
  if (name.find('/') != std::string::npos) return ::access(name.c_str(), X_OK) == 0 ? name : "";
  const char* path = std::getenv("PATH");
  std::istringstream in(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(in, dir, ':');) {
    const std::string p = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

// Is something listening on TCP `port` (any address)? Read from /proc, so the check itself connects to nothing.
bool listening(std::uint16_t port) {
  for (const char* f : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(f);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string sl, local, remote, st;
      ls >> sl >> local >> remote >> st;
      const auto colon = local.rfind(':');
      if (st == "0A" && colon != std::string::npos && std::stoul(local.substr(colon + 1), nullptr, 16) == port) return true;
    }
  }
  return false;
}

pid_t spawn(const std::string& exe, const std::vector<std::string>& args, const std::string& tls, int out_fd, bool error_handling = false) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw error(fmt::format("bench/transport: fork: {}", std::strerror(errno)));
  if (pid == 0) {
    ::setenv("UCX_TLS", tls.c_str(), 1);
    ::setenv("UCX_NET_DEVICES", "lo", 1);
    if (error_handling) {  // as ucx_transport does: shared memory takes part under peer error handling only with these
      ::setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
      ::setenv("UCX_SYSV_ERROR_HANDLING", "y", 0);
    }
    const int devnull = ::open("/dev/null", O_RDWR);
    ::dup2(devnull, 0);
    ::dup2(out_fd >= 0 ? out_fd : devnull, 1);
    ::dup2(out_fd >= 0 ? out_fd : devnull, 2);
    std::vector<char*> argv{const_cast<char*>(exe.c_str())};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(exe.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

// The client's final line: iterations, overhead (50 %, average, overall) in µs,
// bandwidth (average, overall) in MB/s where MB = 2^20 bytes, message rate
// (average, overall). Returns the average bandwidth in GB/s (1e9 bytes/s).
std::optional<double> parse_perftest(const std::string& output) {
  std::optional<double> gbps;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::vector<double> v;
    std::string tok;
    bool numeric = true;
    while (ls >> tok) {
      char* end = nullptr;
      const double d = std::strtod(tok.c_str(), &end);
      if (end == tok.c_str() || *end != '\0') {
        numeric = false;
        break;
      }
      v.push_back(d);
    }
    if (numeric && v.size() == 8) gbps = v[4] * mib / 1e9;
  }
  return gbps;
}

// One ucx_perftest run (server and client as children). Returns GB/s, or throws.
// `error_handling`: endpoints with peer error handling (-e), as ucx_transport creates them.
double perftest(const settings& s, const std::string& exe, const std::string& tls, std::size_t bytes, std::uint64_t warmup,
                std::uint64_t count, bool error_handling) {
  std::string last_output;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::uint16_t port = free_port();
    std::vector<std::string> server_args{"-p", std::to_string(port)}, client_args{
        "127.0.0.1", "-p", std::to_string(port), "-t", s.perftest_test, "-s", std::to_string(bytes), "-n", std::to_string(count), "-w",
        std::to_string(warmup), "-f"};
    if (error_handling) {
      server_args.push_back("-e");
      client_args.push_back("-e");
    }
    if (!s.cpus.empty()) {  // the same CPUs as rank 1 (receiver) and rank 0 (sender)
      server_args.insert(server_args.end(), {"-c", std::to_string(s.cpus[1])});
      client_args.insert(client_args.end(), {"-c", std::to_string(s.cpus[0])});
    }
    const pid_t server = spawn(exe, server_args, tls, -1, error_handling);
    const auto up_by = clock_type::now() + std::chrono::seconds(10);
    bool server_gone = false;
    while (!listening(port) && clock_type::now() < up_by) {
      int status = 0;
      if (::waitpid(server, &status, WNOHANG) == server) {
        server_gone = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (server_gone) {
      last_output = fmt::format("(the ucx_perftest server exited before it listened on port {})", port);
      continue;
    }
    int out[2];
    if (::pipe(out) != 0) throw error(fmt::format("bench/transport: pipe: {}", std::strerror(errno)));
    const pid_t client = spawn(exe, client_args, tls, out[1], error_handling);
    ::close(out[1]);
    const auto end = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(s.timeout_s));
    line_reader r(out[0]);
    last_output = r.rest(end);
    ::close(out[0]);
    const int rc = reap(client, end);
    reap(server, clock_type::now() + std::chrono::seconds(rc == 0 ? 5 : 0));
    if (rc == 0)
      if (const auto g = parse_perftest(last_output)) return *g;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  throw error(fmt::format("bench/transport: ucx_perftest{} (UCX_TLS={}, {} bytes) failed three times; its last output:\n{}",
                          error_handling ? " -e" : "", tls, bytes, last_output));
}

// ---- driver ----------------------------------------------------------------

// Exit 77 (skipped) when UCX cannot make a context here; probed in a child so
// that this process holds no UCX state across the forks that follow.
std::string probe_ucx(const std::string& tls) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::setenv("UCX_TLS", tls.c_str(), 1);
    ::setenv("UCX_NET_DEVICES", "lo", 1);
    const std::string why = ucx_transport::probe();
    [[maybe_unused]] auto n = ::write(fds[1], why.data(), why.size());
    ::_exit(why.empty() ? 0 : 1);
  }
  ::close(fds[1]);
  line_reader r(fds[0]);
  const std::string why = r.rest(clock_type::now() + std::chrono::seconds(30));
  ::close(fds[0]);
  const int rc = reap(pid, clock_type::now() + std::chrono::seconds(5));
  return rc == 0 ? "" : (why.empty() ? fmt::format("probe exited with {}", rc) : why);
}

// The 1-minute load average: the bench competes with whatever else runs here.
double load_average() {
  std::ifstream in("/proc/loadavg");
  double l = -1;
  in >> l;
  return l;
}

double best(const std::vector<double>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Checks the shape and arithmetic of a transport.json; returns the problems found.
std::vector<std::string> check_report(const json& j) {
  std::vector<std::string> bad;
  const auto positive = [](const json& v) { return v.is_number() && v.get<double>() > 0 && std::isfinite(v.get<double>()); };
  if (!j.contains("runs") || !j["runs"].is_array() || j["runs"].empty()) bad.push_back("'runs' is missing or empty");
  const bool have_perftest = j.value("perftest", std::string()) != "unavailable";
  for (const auto& r : j.value("runs", json::array())) {
    const std::string id = fmt::format("run {}/{}", r.value("tls", std::string("?")), r.value("bytes", 0ull));
    for (const char* k : {"tls", "bytes", "gossip_gbps", "perftest_gbps", "ratio"})
      if (!r.contains(k)) bad.push_back(fmt::format("{}: no '{}'", id, k));
    if (!r.contains("gossip_gbps") || !positive(r["gossip_gbps"])) bad.push_back(id + ": gossip_gbps is not a positive number");
    if (have_perftest) {
      if (!r.contains("perftest_gbps") || !positive(r["perftest_gbps"])) bad.push_back(id + ": perftest_gbps is not a positive number");
      if (!r.contains("ratio") || !positive(r["ratio"]))
        bad.push_back(id + ": ratio is not a positive number");
      else if (std::abs(r["ratio"].get<double>() - r["gossip_gbps"].get<double>() / r["perftest_gbps"].get<double>()) > 1e-6 * r["ratio"].get<double>())
        bad.push_back(id + ": ratio != gossip_gbps / perftest_gbps");
    }
    if (!r.value("verified", false)) bad.push_back(id + ": payloads not verified");
  }
  if (!j.contains("step_cost") || !j["step_cost"].is_array() || j["step_cost"].empty()) bad.push_back("'step_cost' is missing or empty");
  for (const auto& c : j.value("step_cost", json::array())) {
    const std::string id = fmt::format("step_cost {}", c.value("elements", 0ull));
    for (const char* k : {"elements", "step_us", "drift_us", "ratio"})
      if (!c.contains(k) || !positive(c[k])) bad.push_back(fmt::format("{}: '{}' is not a positive number", id, k));
    if (bad.empty() && std::abs(c["ratio"].get<double>() - c["step_us"].get<double>() / c["drift_us"].get<double>()) > 1e-6 * c["ratio"].get<double>())
      bad.push_back(id + ": ratio != step_us / drift_us");
  }
  return bad;
}

int check_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    fmt::print(stderr, "bench/transport: cannot read {}\n", path);
    return 1;
  }
  json j;
  try {
    j = json::parse(in);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench/transport: {} is not JSON: {}\n", path, e.what());
    return 1;
  }
  const auto bad = check_report(j);
  for (const auto& b : bad) fmt::print(stderr, "bench/transport: {}: {}\n", path, b);
  if (bad.empty()) fmt::print("{}: {} runs and {} step-cost entries, all well formed\n", path, j["runs"].size(), j["step_cost"].size());
  return bad.empty() ? 0 : 1;
}

std::uint64_t messages_for(const settings& s, std::size_t bytes) {
  return std::clamp<std::uint64_t>(s.bytes_per_run / bytes, s.min_messages, s.max_messages);
}

int run(settings& s) {
  const auto started = clock_type::now();
  const double load_before = load_average();
  for (const auto& tls : s.tls)
    if (const std::string why = probe_ucx(tls); !why.empty()) {
      fmt::print(stderr, "SKIP: UCX cannot create a context and worker with UCX_TLS={}: {}\n", tls, why);
      return 77;
    }
  const std::string perftest_exe = s.perftest == "none" ? "" : find_on_path(s.perftest);
  if (perftest_exe.empty() && s.perftest != "none") {
    if (!s.smoke)
      throw error(fmt::format("bench/transport: '{}' is not on PATH (apt-get install ucx-utils); the comparison needs it", s.perftest));
    fmt::print("ucx_perftest: not found (apt-get install ucx-utils); smoke run without the comparison\n");
  }

  fmt::print("bench/transport: UCX transport payload throughput against ucx_perftest -t {}, same UCX_TLS, UCX_NET_DEVICES=lo.\n"
             "  gossip: ranks 0 -> 1 through gossip::ucx_transport, {} send buffers, inbox depth {}, waits: {};\n"
             "          GB/s = N x S payload bytes (1e9 B/s) / time at the receiver from consuming the last of {} warm-up messages\n"
             "          to consuming the last of N timed ones; every message's stamps and the last payload are checked.\n"
             "  perftest: average bandwidth of its final line, MB/s with MB = 2^20 bytes, converted to GB/s; same N and warm-up;\n"
             "            perftest -e: the same with peer error handling on its endpoints, as the transport creates them.\n"
             "  N = clamp({} MiB / S, {}, {}); each size runs {} time(s), alternating gossip and perftest; table: best of them.\n"
             "  {}\n\n",
             s.perftest_test, s.send_buffers, s.depth, s.wait, s.warmup, s.bytes_per_run >> 20, s.min_messages, s.max_messages, s.reps,
             s.cpus.empty() ? std::string("not pinned (--pin off)")
                            : fmt::format("pinned: sender (rank 0, perftest client) on CPU {}, receiver (rank 1, perftest server) on CPU {}",
                                          s.cpus[0], s.cpus[1]));

  json runs = json::array(), step_cost = json::array();
  const unsigned cpus_here = std::max(1u, std::thread::hardware_concurrency());
  if (load_before > 0.5 * cpus_here)
    fmt::print("note: load average {:.2f} on {} CPUs before the run: other work shares these cores, and ucx_perftest (which "
               "busy-polls) suffers from it more than the transport (which sleeps when it waits); compare runs at similar load.\n\n",
               load_before, cpus_here);
  fmt::print("{:<11} {:>5} {:>5} {:>8} {:>9} {:>6} {:>9} {:>6}   {}\n", "", "", "", "gossip", "perftest", "", "perftest", "",
             "every run, GB/s");
  fmt::print("{:<11} {:>5} {:>5} {:>8} {:>9} {:>6} {:>9} {:>6}   {}\n", "UCX_TLS", "size", "N", "GB/s", "GB/s", "ratio",
             s.perftest_eh ? "-e GB/s" : "", s.perftest_eh ? "ratio" : "", "(g: gossip, p: perftest, e: perftest -e)");
  for (const auto& tls : s.tls) {
    rank_pair pair(tls, s);
    for (std::size_t bytes : s.sizes) {
      const std::uint64_t n = messages_for(s, bytes);
      std::vector<double> g, p, pe;
      for (int rep = 0; rep < s.reps; ++rep) {
        const auto replies = pair.both(fmt::format("xfer {} {} {}", bytes, s.warmup, n), fmt::format("{} messages of {} bytes", n, bytes));
        const double seconds = std::stod(replies[1].substr(3));
        g.push_back(static_cast<double>(n * bytes) / seconds / 1e9);
        if (!perftest_exe.empty()) {
          p.push_back(perftest(s, perftest_exe, tls, bytes, static_cast<std::uint64_t>(s.warmup), n, false));
          if (s.perftest_eh) pe.push_back(perftest(s, perftest_exe, tls, bytes, static_cast<std::uint64_t>(s.warmup), n, true));
        }
      }
      json r{{"tls", tls},
             {"bytes", bytes},
             {"messages", n},
             {"warmup", s.warmup},
             {"verified", true},
             {"gossip_gbps", best(g)},
             {"gossip_median_gbps", median(g)},
             {"gossip_all_gbps", g}};
      auto list = [](const char* tag, const std::vector<double>& v) {
        std::string out;
        for (double x : v) out += fmt::format(" {:.2f}", x);
        return v.empty() ? std::string() : fmt::format("  {}:{}", tag, out);
      };
      std::string row = fmt::format("{:<11} {:>5} {:>5} {:>8.2f}", tls, size_name(bytes), n, best(g));
      if (!p.empty()) {
        r["perftest_gbps"] = best(p);
        r["perftest_median_gbps"] = median(p);
        r["perftest_all_gbps"] = p;
        r["ratio"] = best(g) / best(p);
        r["median_ratio"] = median(g) / median(p);
        row += fmt::format(" {:>9.2f} {:>6.3f}", best(p), best(g) / best(p));
      } else {
        r["perftest_gbps"] = nullptr;
        r["ratio"] = nullptr;
        row += fmt::format(" {:>9} {:>6}", "-", "-");
      }
      if (!pe.empty()) {
        r["perftest_eh_gbps"] = best(pe);
        r["perftest_eh_all_gbps"] = pe;
        r["ratio_eh"] = best(g) / best(pe);
        row += fmt::format(" {:>9.2f} {:>6.3f}", best(pe), best(g) / best(pe));
      } else {
        row += fmt::format(" {:>9} {:>6}", "", "");
      }
      fmt::print("{} {}{}{}\n", row, list("g", g), list("p", p), list("e", pe));
      std::fflush(stdout);
      runs.push_back(std::move(r));
    }
    for (std::size_t elements : s.step_elements) {
      const auto replies = pair.both(fmt::format("step {} {}", elements, s.steps), fmt::format("step cost at {} elements", elements));
      for (int rank = 0; rank < 2; ++rank) {
        std::istringstream in(replies[static_cast<std::size_t>(rank)].substr(3));
        double step_us = 0, drift_us = 0;
        in >> step_us >> drift_us;
        step_cost.push_back({{"tls", tls},
                             {"rank", rank},
                             {"elements", elements},
                             {"steps", s.steps},
                             {"step_us", step_us},
                             {"drift_us", drift_us},
                             {"ratio", step_us / drift_us}});
      }
    }
  }

  fmt::print("\nstep cost: engine.step() with policy `never` over ucx_transport (2 ranks stepping together) against\n"
             "  gossip::drift_pass over the same model and x-hat alone, timed alternately in one loop; medians of {} steps.\n\n",
             s.steps);
  fmt::print("{:<11} {:>5} {:>10} {:>8} {:>10} {:>10} {:>7}\n", "UCX_TLS", "rank", "elements", "MiB", "step us", "drift us", "ratio");
  for (const auto& c : step_cost)
    fmt::print("{:<11} {:>5} {:>10} {:>8.1f} {:>10.1f} {:>10.1f} {:>7.3f}\n", c["tls"].get<std::string>(), c["rank"].get<int>(),
               c["elements"].get<std::size_t>(), static_cast<double>(c["elements"].get<std::size_t>() * sizeof(float)) / mib,
               c["step_us"].get<double>(), c["drift_us"].get<double>(), c["ratio"].get<double>());

  // The summary the task asks about: the weakest ratio at 1 MiB and above, per UCX_TLS.
  json summary = json::object();
  if (!perftest_exe.empty()) {
    fmt::print("\n");
    for (const auto& tls : s.tls) {
      double worst = 1e300;
      std::size_t at = 0;
      for (const auto& r : runs)
        if (r["tls"] == tls && r["bytes"].get<std::size_t>() >= (1u << 20) && r["ratio"].get<double>() < worst) {
          worst = r["ratio"].get<double>();
          at = r["bytes"].get<std::size_t>();
        }
      if (at == 0) continue;
      summary[tls] = {{"min_ratio_ge_1mib", worst}, {"at_bytes", at}};
      fmt::print("UCX_TLS={}: lowest gossip/perftest ratio at >= 1 MiB: {:.3f} ({}){}\n", tls, worst, size_name(at),
                 worst < 0.9 ? "  < 0.9" : "");
    }
  }
  double worst_step = 0;
  for (const auto& c : step_cost) worst_step = std::max(worst_step, c["ratio"].get<double>());
  summary["max_step_ratio"] = worst_step;
  fmt::print("highest step / drift ratio: {:.3f}\n", worst_step);

  const double elapsed = std::chrono::duration<double>(clock_type::now() - started).count();
  json report{{"bench", "transport"},
              {"perftest", perftest_exe.empty() ? "unavailable" : "ucx_perftest -t " + s.perftest_test},
              {"definition",
               {{"gossip_gbps", "payload bytes N*S / seconds at the receiver, from consuming the last warm-up message to consuming "
                                "the last timed one; 1 GB = 1e9 bytes; best of reps"},
                {"perftest_gbps", "ucx_perftest (see perftest) final 'average' bandwidth (MB/s, MB = 2^20 bytes) * 2^20 / 1e9; best of reps"},
                {"ratio", "gossip_gbps / perftest_gbps (best / best); median_ratio: median / median"},
                {"perftest_eh_gbps", "the same with ucx_perftest -e (endpoints with peer error handling, as ucx_transport creates them; "
                                     "UCX_POSIX_ERROR_HANDLING=y as it sets); ratio_eh = gossip_gbps / perftest_eh_gbps"},
                {"step_cost", "medians over steps of engine.step() (policy never) and of drift_pass over the same model, alternated"}}},
              {"settings",
               {{"tls", s.tls},
                {"reps", s.reps},
                {"bytes_per_run", s.bytes_per_run},
                {"warmup", s.warmup},
                {"send_buffers", s.send_buffers},
                {"inbox_depth", s.depth},
                {"backlog", s.backlog},
                {"wait", s.wait},
                {"cpus", s.cpus},
                {"steps", s.steps}}},
              {"runs", runs},
              {"step_cost", step_cost},
              {"summary", summary},
              {"load_average", {{"before", load_before}, {"after", load_average()}, {"cpus", cpus_here}}},
              {"seconds", elapsed}};
  std::filesystem::create_directories(s.out);
  const std::string path = (std::filesystem::path(s.out) / "transport.json").string();
  {
    std::ofstream f(path);
    f << report.dump(2) << "\n";
    if (!f) throw error(fmt::format("bench/transport: cannot write {}", path));
  }
  fmt::print("wrote {} ({:.0f} s)\n", path, elapsed);
  if (s.smoke) return check_file(path);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"UCX transport payload throughput against ucx_perftest, and the step cost of a silent engine over UCX."};
  settings s;
  std::vector<std::string> sizes{"64K", "256K", "1M", "4M", "16M", "64M"}, step_sizes;
  std::string check;
  double mib_per_run = 256;
  app.add_option("--out", s.out, "directory for transport.json");
  app.add_option("--tls", s.tls, "UCX_TLS settings to compare (each runs both sides)");
  app.add_option("--sizes", sizes, "payload sizes (K, M suffixes)");
  app.add_option("--reps", s.reps, "runs per size and side; the table shows the best")->check(CLI::Range(1, 50));
  app.add_option("--mib-per-run", mib_per_run, "timed payload per run in MiB (N = this / size, clamped)")->check(CLI::Range(0.0625, 65536.0));
  app.add_option("--min-messages", s.min_messages, "fewest timed messages per run")->check(CLI::Range(1, 1000000));
  app.add_option("--max-messages", s.max_messages, "most timed messages per run")->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", s.warmup, "warm-up messages per run (both sides)")->check(CLI::Range(1, 100000));
  app.add_option("--send-buffers", s.send_buffers, "rotating send buffers at rank 0")->check(CLI::Range(1, 64));
  app.add_option("--depth", s.depth, "inbox slots per source at rank 1 (the engine uses 2)")->check(CLI::Range(1, 64));
  app.add_option("--backlog", s.backlog, "ucx_options::backlog")->check(CLI::Range(1, 100000));
  app.add_option("--wait", s.wait, "how the bench's own loops wait: backoff (as gossip's waits: spin, yield, then 20 us sleeps), yield, sleep or spin")
      ->check(CLI::IsMember({"backoff", "yield", "sleep", "spin"}))
      ->capture_default_str();
  app.add_option("--step-elements", step_sizes, "model sizes (floats, K/M suffixes) for the step cost; default 1M 16M");
  app.add_option("--steps", s.steps, "timed steps per model size")->check(CLI::Range(3, 100000));
  app.add_option("--perftest", s.perftest, "ucx_perftest executable; none: gossip side only");
  bool no_eh = false;
  app.add_flag("--no-perftest-e", no_eh, "skip the second baseline, ucx_perftest -e (peer error handling, as the transport's endpoints)");
  app.add_option("--perftest-test", s.perftest_test, "ucx_perftest test to compare with")
      ->check(CLI::IsMember({"tag_bw", "ucp_am_bw", "stream_bw"}))
      ->capture_default_str();
  app.add_option("--timeout", s.timeout_s, "bound on every wait, seconds")->check(CLI::Range(1.0, 3600.0));
  std::string pin = "auto";
  app.add_option("--pin", pin, "CPUs for the sending and receiving side, e.g. 0,1 (the same for both benchmarks); auto: the first two "
                 "CPUs this process may use (off for --smoke); off")->capture_default_str();
  app.add_flag("--smoke", s.smoke, "tiny sizes, one rep, then check the JSON (the meson smoke test)");
  app.add_option("--check", check, "only check an existing transport.json");
  CLI11_PARSE(app, argc, argv);

  if (!check.empty()) return check_file(check);
  ::signal(SIGPIPE, SIG_IGN);  // a rank that died shows up as a failed write, not as the end of this process
  s.perftest_eh = !no_eh;
  try {
    if (s.smoke) {
      if (app.count("--sizes") == 0) sizes = {"64K", "256K"};
      if (app.count("--reps") == 0) s.reps = 1;
      if (app.count("--mib-per-run") == 0) mib_per_run = 4;
      if (app.count("--steps") == 0) s.steps = 5;
      if (step_sizes.empty()) step_sizes = {"64K"};
    }
    for (const auto& z : sizes) s.sizes.push_back(parse_size(z));
    if (!step_sizes.empty()) {
      s.step_elements.clear();
      for (const auto& z : step_sizes) s.step_elements.push_back(parse_size(z));
    }
    s.bytes_per_run = static_cast<std::size_t>(mib_per_run * mib);
    if (pin == "auto" && !s.smoke) {
      cpu_set_t allowed;
      CPU_ZERO(&allowed);
      if (::sched_getaffinity(0, sizeof allowed, &allowed) == 0)
        for (int c = 0; c < CPU_SETSIZE && s.cpus.size() < 2; ++c)
          if (CPU_ISSET(c, &allowed)) s.cpus.push_back(c);
      if (s.cpus.size() < 2) s.cpus.clear();
    } else if (pin != "off" && pin != "auto") {
      const auto comma = pin.find(',');
      if (comma == std::string::npos) throw error("bench/transport: --pin takes two CPUs, e.g. 0,1, or auto / off");
      s.cpus = {std::stoi(pin.substr(0, comma)), std::stoi(pin.substr(comma + 1))};
    }
    if (s.min_messages > s.max_messages) throw error("bench/transport: --min-messages is larger than --max-messages");
    return run(s);
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
}

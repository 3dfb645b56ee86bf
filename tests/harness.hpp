#pragma once
// One harness for the multi-process tests and benches (tests/test_ucx.cpp,
// bench/transport, bench/switch): ranks as forked processes of this machine,
// free ports, deadlines, and teardown that never leaves a child behind.
//
//     const std::uint16_t port = gossip::harness::free_port();
//     gossip::harness::child_options o;
//     o.env = {{"UCX_TLS", "tcp"}};
//     o.alarm_s = 60;  // each rank's bound; the parent waits 5 s longer, then kills
//     const auto ends = gossip::harness::run_ranks(4, o, [&](int rank) { return train(rank, port); });
//     for (const auto& e : ends) CHECK(e.ok());
//
// Every child runs under alarm(), so a hung rank ends even when the parent
// is gone; the parent waits with a deadline and then kills what is left, by
// PID and only its own children. A capability the library probes (can UCX
// make a context here?) is probed in a child, so the parent holds no library
// state across the forks that follow.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace gossip::harness {

using clock_type = std::chrono::steady_clock;

/// A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick).
// A free port below the kernel's ephemeral range where there is one: a port
// from that range, free now, may become the local port of some outgoing
// connection (another test's) before rank 0 listens on it.
inline std::uint16_t free_port() {
  const auto bound = [](std::uint16_t port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    socklen_t len = sizeof a;
    if (ok) ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    if (fd >= 0) ::close(fd);
    return ok ? ntohs(a.sin_port) : std::uint16_t{0};
  };
  unsigned low = 32768;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%u", &low) != 1) low = 32768;
    std::fclose(f);
  }
  if (low > 10100) {
    std::mt19937 pick(std::random_device{}());
    std::uniform_int_distribution<unsigned> in(10000, low - 1);
    for (int i = 0; i < 200; ++i)
      if (const auto port = bound(static_cast<std::uint16_t>(in(pick)))) return port;
  }
  return bound(0);  // the kernel's choice
}

/// "64K", "16M", "1G" or a plain byte count; must be a positive multiple of
/// `multiple`, else std::invalid_argument naming the size.
inline std::size_t parse_size(const std::string& s, std::size_t multiple) {
  std::size_t mult = 1;
  std::string num = s;
  if (!s.empty() && (s.back() == 'K' || s.back() == 'M' || s.back() == 'G')) {
    mult = s.back() == 'K' ? 1024 : s.back() == 'M' ? 1024 * 1024 : std::size_t{1} << 30;
    num.pop_back();
  }
  // Digits only: stoull would take "-64" as 2^64 − 64, and "abc" names nothing.
  if (num.empty() || num.size() > 15 || num.find_first_not_of("0123456789") != std::string::npos)
    throw std::invalid_argument("size '" + s + "' is not a byte count: digits with an optional K, M or G (e.g. 64K, 16M)");
  // Bounded before it is multiplied (no wrap-around) and allocated (no bad_alloc naming nothing).
  constexpr std::size_t max_bytes = std::size_t{1} << 34;
  if (std::stoull(num) > max_bytes / mult)
    throw std::invalid_argument("size '" + s + "' is more than 16G, the largest message size taken here");
  const auto v = std::stoull(num) * mult;
  if (v < multiple || v % multiple != 0)
    throw std::invalid_argument("size '" + s + "' must be a positive multiple of " + std::to_string(multiple) + " bytes");
  return v;
}

/// Pins the calling thread (a process: its later threads too) to one CPU.
/// Returns false, with errno set, when the kernel refuses.
inline bool pin_to_cpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return ::sched_setaffinity(0, sizeof set, &set) == 0;
}

/// How a child ended.
struct child_end {
  bool exited = false;
  int code = -1;   ///< exit status when exited
  int signal = 0;  ///< terminating signal otherwise (0: not known)

  bool ok() const noexcept { return exited && code == 0; }
  /// The exit status, or −signal (−1 when not even that is known).
  int status() const noexcept { return exited ? code : signal ? -signal : -1; }
};

/// What a forked child sets up before it runs its function.
struct child_options {
  std::vector<std::pair<std::string, std::string>> env;  ///< set in the child, replacing what is there
  unsigned alarm_s = 0;  ///< SIGALRM ends the child after this many seconds; 0: never
  int cpu = -1;          ///< pin the child to this CPU; −1: not pinned
  std::string label;     ///< names the child in the message of an exception that escapes its function
};

/// Forks a child that applies `o` and exits with fn()'s value (100 when fn
/// throws, after printing the exception on stderr). stdio is flushed first,
/// so nothing buffered is written twice. Throws std::runtime_error when fork fails.
inline pid_t fork_child(const child_options& o, const std::function<int()>& fn) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid > 0) return pid;
  if (o.alarm_s > 0) ::alarm(o.alarm_s);
  for (const auto& [k, v] : o.env) ::setenv(k.c_str(), v.c_str(), 1);
  if (o.cpu >= 0 && !pin_to_cpu(o.cpu))
    std::fprintf(stderr, "%s: cannot pin to CPU %d: %s (running unpinned)\n", o.label.empty() ? "child" : o.label.c_str(), o.cpu,
                 std::strerror(errno));
  int rc = 1;
  try {
    rc = fn();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", o.label.empty() ? "child" : o.label.c_str(), e.what());
    rc = 100;
  }
  std::fflush(nullptr);
  ::_exit(rc);
}

inline child_end end_of(int status) noexcept {
  child_end e;
  e.exited = WIFEXITED(status);
  e.code = e.exited ? WEXITSTATUS(status) : -1;
  e.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  return e;
}

/// Waits for every child until `deadline`, then kills (SIGKILL, by PID) the
/// ones still running and reaps them. Returns how each ended, in order.
inline std::vector<child_end> reap_all(std::span<const pid_t> pids, clock_type::time_point deadline) {
  std::vector<child_end> out(pids.size());
  std::vector<bool> done(pids.size(), false);
  for (std::size_t left = pids.size(); left > 0;) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      const pid_t r = ::waitpid(pids[i], &status, WNOHANG);
      if (r == pids[i] || r < 0) {
        done[i] = true;
        --left;
        if (r == pids[i]) out[i] = end_of(status);
      }
    }
    if (left == 0) break;
    if (clock_type::now() > deadline) {
      for (std::size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) ::kill(pids[i], SIGKILL);  // only our own children, by PID
      deadline = clock_type::time_point::max();  // the kill ends them: wait for that
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return out;
}

/// One child: see reap_all.
inline child_end reap(pid_t pid, clock_type::time_point deadline) { return reap_all({&pid, 1}, deadline)[0]; }

/// Runs fn(rank) in `world` forked children, each under `o` (its label gets
/// " rank R"), and waits for them: alarm_s (or 60 s when 0) plus 5 s, after
/// which what is left is killed. Returns how each rank ended.
inline std::vector<child_end> run_ranks(int world, const child_options& o, const std::function<int(int)>& fn) {
  child_options each = o;
  if (each.alarm_s == 0) each.alarm_s = 60;
  std::vector<pid_t> pids;
  try {
    for (int r = 0; r < world; ++r) {
      each.label = "rank " + std::to_string(r) + (o.label.empty() ? "" : " (" + o.label + ")");
      pids.push_back(fork_child(each, [&fn, r] { return fn(r); }));
    }
  } catch (...) {
    reap_all(pids, clock_type::now());  // the ranks that started cannot meet the missing one
    throw;
  }
  return reap_all(pids, clock_type::now() + std::chrono::seconds(each.alarm_s + 5));
}

/// Runs probe() in a child and returns what it returned: empty when the
/// capability is there, else why not. A child that crashes or outlives
/// `timeout_s` is reported as such.
inline std::string probe_in_child(const std::function<std::string()>& probe, double timeout_s = 30) {
  int fds[2];
  if (::pipe(fds) != 0) return std::string("pipe: ") + std::strerror(errno);
  pid_t pid = -1;
  try {
    pid = fork_child({}, [&] {
      ::close(fds[0]);
      const std::string why = probe();
      std::size_t at = 0;
      while (at < why.size()) {
        const ssize_t n = ::write(fds[1], why.data() + at, why.size() - at);
        if (n <= 0) break;
        at += static_cast<std::size_t>(n);
      }
      return why.empty() ? 0 : 1;
    });
  } catch (const std::exception& e) {
    ::close(fds[0]);
    ::close(fds[1]);
    return e.what();
  }
  ::close(fds[1]);
  const auto deadline = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(timeout_s));
  std::string why;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now()).count();
    if (left <= 0) break;
    pollfd p{fds[0], POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (r < 0 && errno != EINTR) break;
    if (r <= 0) continue;
    char buf[512];
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    why.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  const child_end e = reap(pid, clock_type::now() + std::chrono::seconds(5));
  if (e.ok()) return "";
  if (!why.empty()) return why;
  return e.exited ? "the probe exited with " + std::to_string(e.code) : "the probe ended by signal " + std::to_string(e.signal);
}

}  // namespace gossip::harness

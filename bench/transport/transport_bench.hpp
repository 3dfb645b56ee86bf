#pragma once
// bench/transport: what its parts share. transport_bench.cpp drives the runs
// (command line, probes, the table rows as they come); gossip_side.cpp runs
// the two ranks of ucx_transport; perftest.cpp runs ucx_perftest for the
// same sizes; report.cpp prints the step-cost table and the summary, writes
// transport.json and checks it.
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gossip/error.hpp"

namespace transport_bench {

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
  std::string connect = "auto";  // ucx_options::connect: auto, worker or listener
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

inline std::string size_name(std::size_t b) {
  if (b % (1u << 20) == 0) return fmt::format("{}M", b >> 20);
  if (b % 1024 == 0) return fmt::format("{}K", b >> 10);
  return std::to_string(b);
}

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

inline void write_line(int fd, const std::string& s) {
  const std::string l = s + "\n";
  std::size_t at = 0;
  while (at < l.size()) {
    const ssize_t n = ::write(fd, l.data() + at, l.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw gossip::error(fmt::format("bench/transport: cannot write to a child's pipe: {}", std::strerror(errno)));
    at += static_cast<std::size_t>(n);
  }
}

// The gossip side (gossip_side.cpp).

/// The two ranks of one UCX_TLS setting, forked, driven over pipes.
class rank_pair {
 public:
  rank_pair(const std::string& tls, const settings& s);
  rank_pair(const rank_pair&) = delete;
  ~rank_pair();

  /// Sends `cmd` to both ranks; returns their replies (rank order), throwing on a failure.
  std::array<std::string, 2> both(const std::string& cmd, const std::string& what);

 private:
  void start(std::uint16_t port);
  void stop();
  void stop_now();
  std::string read(int r);
  void expect_ok(int r, const std::string& reply, const std::string& what);

  const settings& m_s;
  std::string m_tls;
  pid_t m_pid[2] = {-1, -1};
  int m_cmd[2] = {-1, -1}, m_res_fd[2] = {-1, -1};
  std::array<std::unique_ptr<line_reader>, 2> m_res;
};

// The baseline (perftest.cpp).

/// `name` as found on PATH (or as given, with a slash), "" when absent.
std::string find_on_path(const std::string& name);

/// One ucx_perftest run (server and client as children). Returns GB/s, or throws.
/// `error_handling`: endpoints with peer error handling (-e), as ucx_transport creates them.
double perftest(const settings& s, const std::string& exe, const std::string& tls, std::size_t bytes, std::uint64_t warmup,
                std::uint64_t count, bool error_handling);

// The report (report.cpp).

/// The 1-minute load average: the bench competes with whatever else runs here.
double load_average();

/// What the runs measured, for the report.
struct results {
  json runs = json::array(), step_cost = json::array();
  std::string perftest_exe;  ///< "" when ucx_perftest was not run
  double load_before = -1;
  unsigned cpus = 1;
  clock_type::time_point started;
};

/// Prints the step-cost table and the summary and writes DIR/transport.json; returns its path.
std::string write_report(const settings& s, const results& r);

/// Checks the shape and arithmetic of a transport.json; returns the problems found.
std::vector<std::string> check_report(const json& j);
/// check_report on a file, printing what it finds; 0 when it is well formed.
int check_file(const std::string& path);

}  // namespace transport_bench

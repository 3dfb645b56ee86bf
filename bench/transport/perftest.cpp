// bench/transport, the baseline: ucx_perftest for the same size, count and
// warm-up as the gossip run, its server and client as child processes.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "tests/harness.hpp"
#include "transport_bench.hpp"

namespace transport_bench {

using gossip::error;
namespace harness = gossip::harness;

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

namespace {

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
  harness::child_options o;
  o.env = {{"UCX_TLS", tls}, {"UCX_NET_DEVICES", "lo"}};
  return harness::fork_child(o, [&] {
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
    return 127;
  });
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

}  // namespace

double perftest(const settings& s, const std::string& exe, const std::string& tls, std::size_t bytes, std::uint64_t warmup,
                std::uint64_t count, bool error_handling) {
  std::string last_output;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::uint16_t port = harness::free_port();
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
    const double listen_s = std::min(10.0, s.timeout_s);  // --timeout bounds this wait too
    const auto up_by = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(listen_s));
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
    if (!listening(port)) {
      harness::reap(server, clock_type::now());  // killed (by PID) and reaped
      last_output = fmt::format("(the ucx_perftest server did not listen on port {} within {} s)", port, listen_s);
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
    const int rc = harness::reap(client, end).status();
    harness::reap(server, clock_type::now() + std::chrono::seconds(rc == 0 ? 5 : 0));
    if (rc == 0)
      if (const auto g = parse_perftest(last_output)) return *g;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  throw error(fmt::format("bench/transport: ucx_perftest{} (UCX_TLS={}, {} bytes) failed three times; its last output:\n{}",
                          error_handling ? " -e" : "", tls, bytes, last_output));
}


}  // namespace transport_bench

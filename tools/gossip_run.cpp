// gossip-run: start N local ranks of a program with the libgossip environment.
//
//   gossip-run -n 4 [--config run.toml] -- ./train --epochs 2
//
// Each rank gets GOSSIP_RANK, GOSSIP_WORLD_SIZE, GOSSIP_MASTER_ADDR/PORT (a port
// free on the master address; rank 0 serves the rendezvous) and, with --config,
// GOSSIP_CONFIG. Output lines are prefixed with the rank (cut every 64 KiB).
// SIGINT/SIGTERM/SIGHUP are forwarded (a second one sends SIGKILL); ranks read /dev/null as stdin and get
// SIGTERM should gossip-run die. If a rank fails, by default (--on-failure abort) the others get
// SIGTERM, then SIGKILL after the grace period, and gossip-run exits non-zero
// naming the rank and its status. With --on-failure continue the others keep
// running: a rank killed by a signal counts as dead, and gossip-run exits 0
// when every other rank exits 0 (a rank that exits non-zero by itself is
// still an error, and its status is gossip-run's). Either way the exit report
// names every rank that did not finish, with its signal or exit status.
// Under mpirun or srun, start the program directly: bootstrap reads their
// variables instead.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <cmath>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include "cli_checks.hpp"
#include <fmt/format.h>

namespace {

volatile std::sig_atomic_t g_signal = 0;   // the last signal
volatile std::sig_atomic_t g_signals = 0;  // how many came (a second one escalates to SIGKILL)
void on_signal(int s) {
  g_signal = s;
  if (g_signals < 1000) g_signals = g_signals + 1;
}

// A port free on `address` (where rank 0 will listen), or 0 with `why` set
// (-1 when the address does not resolve).
int free_port(const std::string& address, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | AI_PASSIVE;
  addrinfo* res = nullptr;
  if (const int rc = ::getaddrinfo(address.c_str(), "0", &hints, &res); rc != 0) {
    why = fmt::format("it does not resolve: {}", ::gai_strerror(rc));
    return -1;
  }
  int port = 0;
  for (addrinfo* a = res; a && port == 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    sockaddr_storage got{};
    socklen_t len = sizeof got;
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&got), &len) == 0)
      port = ntohs(got.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&got)->sin6_port : reinterpret_cast<sockaddr_in*>(&got)->sin_port);
    else
      why = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return port;
}

struct child {
  int rank = 0;
  pid_t pid = -1;
  int out = -1, err = -1;  // read ends
  std::string out_buf, err_buf;
  bool exited = false;
  int status = 0;
};

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("status {}", status);
}

// Set when writing to our stdout or stderr failed (a closed pipe: `| head`).
bool g_out_closed = false, g_err_closed = false;

// gossip-run's own messages: a stderr that cannot be written any more (its
// reader left, or it was closed) costs the message, never the ranks' supervision.
template <class... A>
void note(fmt::format_string<A...> f, A&&... a) noexcept {
  if (g_err_closed) return;
  try {
    fmt::print(stderr, f, std::forward<A>(a)...);
  } catch (const std::exception&) {
    g_err_closed = true;
  }
}

// A line longer than this without its newline (a progress bar, a binary
// dump) is written out as it is, so that it neither grows without bound nor
// is scanned again on every read.
constexpr std::size_t max_partial_line = 64 * 1024;

// Writes complete lines of `buf` with the rank prefix, and a partial tail in
// pieces of max_partial_line; keeps the rest. Once `to` cannot be written
// (its reader left), its lines are dropped. For stdout the ranks are then
// stopped as by SIGTERM: a pipeline whose reader has gone ends, and no rank
// is left running without this process watching it. A closed stderr only
// costs its lines (as it costs gossip-run's own messages, note()).
void flush_lines(std::string& buf, int rank, FILE* to, bool all) {
  bool& closed = to == stdout ? g_out_closed : g_err_closed;
  try {
    std::size_t start = 0;
    // Every piece at most max_partial_line long, the end of a line included.
    for (std::size_t nl; !closed && (nl = buf.find('\n', start)) != std::string::npos; start = nl + 1)
      for (std::size_t at = start;; at += max_partial_line) {
        const std::size_t end = std::min(nl, at + max_partial_line);
        fmt::print(to, "[{}] {}\n", rank, std::string_view(buf).substr(at, end - at));
        if (end == nl) break;
      }
    for (; !closed && buf.size() - start > max_partial_line; start += max_partial_line)
      fmt::print(to, "[{}] {}\n", rank, std::string_view(buf).substr(start, max_partial_line));
    buf.erase(0, start);
    if (all && !buf.empty() && !closed) fmt::print(to, "[{}] {}\n", rank, buf);
    if (all || closed) buf.clear();
    if (!closed && std::fflush(to) != 0) throw std::runtime_error("flush failed");
  } catch (const std::exception&) {
    buf.clear();
    if (!closed) {
      closed = true;
      if (to == stdout && !g_signal) {  // the main loop forwards it and reports it
        g_signal = SIGTERM;
        g_signals = 1;
      }
      if (to != stderr && !g_err_closed)
        std::fprintf(stderr, "gossip-run: cannot write to stdout any more (its reader closed it); stopping the ranks\n");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Start N local ranks of a libgossip program, each with its rank's environment."};
  int n = 0;
  std::string config, master_addr = "127.0.0.1";
  int master_port = 0;
  double grace = 5.0;
  std::string on_failure = "abort";
  std::vector<std::string> command;
  app.add_option("-n,--ranks", n, "number of ranks to start")->required()->check(gossip::cli::integer_range(1, 1024));
  app.add_option("--config", config, "config file, passed to every rank as GOSSIP_CONFIG")->check(CLI::ExistingFile);
  app.add_option("--master-addr", master_addr, "rendezvous address (rank 0 serves it)")->capture_default_str();
  app.add_option("--master-port", master_port, "rendezvous port (default: a free one)")->check(gossip::cli::integer_range(0, 65535));
  app.add_option("--grace", grace, "seconds the other ranks get to stop after one fails, before SIGKILL")->capture_default_str()
      ->check(gossip::cli::number_range(0.0, 86400.0));
  app.add_option("--on-failure", on_failure,
                 "abort: stop every rank when one fails (default); continue: let the survivors finish, exit 0 if they all do, "
                 "and name the dead ranks")
      ->check(CLI::IsMember({"abort", "continue"}));
  // The program starts at the first argument that is not one of gossip-run's
  // options (or after '--'): everything from there on is its own, options
  // that gossip-run also has (-n, --config) included.
  app.prefix_command();
  app.name("gossip-run");
  app.footer("The program and its arguments follow gossip-run's options (after '--' when the program's name starts with '-'):\n"
             "  gossip-run -n 4 [OPTIONS] [--] program [its arguments...]\n");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  command = app.remaining();
  if (!command.empty() && command.front() == "--") command.erase(command.begin());
  else if (!command.empty() && command.front().starts_with('-')) {  // not gossip-run's, and before any program
    note("gossip-run: unknown option {}; the program to start and its arguments come after gossip-run's options (or after '--'); "
         "see gossip-run --help\n",
         command.front());
    return 2;
  }
  if (command.empty()) {
    note("gossip-run: no program to start: gossip-run -n N [OPTIONS] [--] program [its arguments...]\n");
    return 2;
  }

  if (master_port == 0) {
    std::string why;
    master_port = free_port(master_addr, why);
    if (master_port < 0) {
      note("gossip-run: --master-addr {}: {}; give a host name or an IP address of this machine\n", master_addr, why);
      return 1;
    }
    if (master_port == 0) {
      note("gossip-run: --master-addr {}: no free port there ({}); rank 0 listens on that address, so it must be one of this "
           "machine's, or pass --master-port\n",
           master_addr, why);
      return 1;
    }
  }
  // SIGHUP (a closed terminal or ssh session) stops the ranks as SIGTERM does.
  const int forwarded_signals[] = {SIGINT, SIGTERM, SIGHUP};
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  // A signal ignored when gossip-run started (nohup) stays ignored, for the ranks too.
  bool ignored[std::size(forwarded_signals)] = {};
  for (std::size_t i = 0; i < std::size(forwarded_signals); ++i) {
    struct sigaction was {};
    sigaction(forwarded_signals[i], nullptr, &was);
    ignored[i] = was.sa_handler == SIG_IGN;
    if (!ignored[i]) sigaction(forwarded_signals[i], &sa, nullptr);
  }
  std::signal(SIGPIPE, SIG_IGN);
  const pid_t supervisor = ::getpid();
  // What a rank leaves behind becomes this process's child when the rank
  // exits, so that it is reaped here once it ends: else it would wait, a
  // zombie still in the rank's process group, for an init that may reap late
  // (or never, in a container), and count as left running below.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  // Started with SIGCHLD ignored, the kernel would reap the ranks unasked and
  // their exits would go unseen here.
  std::signal(SIGCHLD, SIG_DFL);

  std::vector<child> kids(static_cast<std::size_t>(n));
  // Ranks started before a failure to start the next are not left running.
  const auto abandon_started = [&] {
    for (auto& k : kids)
      if (k.pid > 0) ::kill(-k.pid, SIGKILL);
    for (auto& k : kids)
      if (k.pid > 0) ::waitpid(k.pid, nullptr, 0);
  };
  for (int r = 0; r < n; ++r) {
    int po[2], pe[2];
    // Close-on-exec: no rank holds another's pipes (a rank whose reader is
    // another rank would block once gossip-run is gone).
    if (::pipe2(po, O_CLOEXEC) != 0 || ::pipe2(pe, O_CLOEXEC) != 0) {
      note("gossip-run: pipe for rank {} failed: {}; stopping the {} rank(s) started\n", r, std::strerror(errno), r);
      abandon_started();
      return 1;
    }
    // The signals stay blocked across fork, so that a child cannot take one
    // meant for gossip-run with its handler before it has reset them.
    sigset_t block, old;
    sigemptyset(&block);
    for (int s : forwarded_signals) sigaddset(&block, s);
    ::sigprocmask(SIG_BLOCK, &block, &old);
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::sigprocmask(SIG_SETMASK, &old, nullptr);
      note("gossip-run: fork of rank {} failed: {}; stopping the {} rank(s) started\n", r, std::strerror(errno), r);
      abandon_started();
      return 1;
    }
    if (pid == 0) {
      ::setpgid(0, 0);  // its own process group: signals reach what the rank starts too
      for (std::size_t i = 0; i < std::size(forwarded_signals); ++i) std::signal(forwarded_signals[i], ignored[i] ? SIG_IGN : SIG_DFL);
      std::signal(SIGPIPE, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &old, nullptr);
      // A rank does not outlive gossip-run (killed, or its terminal closed).
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != supervisor) ::_exit(128 + SIGTERM);
      // Its own process group is not the terminal's foreground one: reading
      // the terminal would stop it (SIGTTIN) for ever. Ranks read nothing.
      if (const int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC); null >= 0) ::dup2(null, STDIN_FILENO);
      ::dup2(po[1], STDOUT_FILENO);
      ::dup2(pe[1], STDERR_FILENO);
      // dup2 onto the same fd (gossip-run started with 0 or 1 closed) keeps close-on-exec: clear it.
      for (int fd : {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO}) ::fcntl(fd, F_SETFD, 0);
      ::setenv("GOSSIP_RANK", std::to_string(r).c_str(), 1);
      ::setenv("GOSSIP_WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("GOSSIP_MASTER_ADDR", master_addr.c_str(), 1);
      ::setenv("GOSSIP_MASTER_PORT", std::to_string(master_port).c_str(), 1);
      if (!config.empty()) ::setenv("GOSSIP_CONFIG", config.c_str(), 1);
      std::vector<char*> args;
      for (auto& a : command) args.push_back(a.data());
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      std::fprintf(stderr, "gossip-run: cannot start '%s': %s\n", args[0], std::strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here: a signal forwarded at once finds the group
    ::sigprocmask(SIG_SETMASK, &old, nullptr);
    ::close(po[1]);
    ::close(pe[1]);
    auto& k = kids[static_cast<std::size_t>(r)];
    k.rank = r;
    k.pid = pid;
    k.out = po[0];
    k.err = pe[0];
  }

  int failed_rank = -1, failed_status = 0, forwarded = 0, signals_seen = 0;
  const bool keep_going = on_failure == "continue";
  auto stop_at = std::chrono::steady_clock::time_point::max();
  // Each rank's process group, also of a rank that has exited: what it left
  // running stops with the others.
  auto stop_others = [&](int sig) {
    for (auto& k : kids) ::kill(-k.pid, sig);
  };
  std::size_t running = kids.size();
  std::vector<pollfd> fds;
  // After the last rank exits, output still buffered in the pipes is read for
  // a moment; a process the rank left behind must not keep us waiting.
  auto drain_until = std::chrono::steady_clock::time_point::max();
  while (running > 0 || (std::any_of(kids.begin(), kids.end(), [](const child& k) { return k.out >= 0 || k.err >= 0; }) &&
                         std::chrono::steady_clock::now() < drain_until)) {
    if (running == 0 && drain_until == std::chrono::steady_clock::time_point::max())
      drain_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    // The first signal is forwarded and the ranks get the grace period; a
    // second one (Ctrl-C again) does not wait for it.
    if (const int seen = g_signals; seen > signals_seen) {
      if (signals_seen == 0) {
        forwarded = g_signal;
        note("gossip-run: forwarding signal {} to {} rank(s) (send it again to kill them at once)\n", forwarded, running);
        stop_others(forwarded);
        stop_at = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(grace));
      }
      if (seen >= 2 && running > 0) {  // also two that came before this loop looked
        note("gossip-run: signal {} again: sending SIGKILL to {} rank(s)\n", static_cast<int>(g_signal), running);
        stop_others(SIGKILL);
        stop_at = std::chrono::steady_clock::time_point::max();
      }
      signals_seen = seen;
    }
    fds.clear();
    for (auto& k : kids) {
      if (k.out >= 0) fds.push_back({k.out, POLLIN, 0});
      if (k.err >= 0) fds.push_back({k.err, POLLIN, 0});
    }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 100);
    else ::usleep(50000);
    char buf[65536];
    for (auto& k : kids)
      for (auto* fd : {&k.out, &k.err}) {
        if (*fd < 0) continue;
        pollfd p{*fd, POLLIN, 0};
        if (::poll(&p, 1, 0) <= 0) continue;
        const ssize_t got = ::read(*fd, buf, sizeof buf);
        auto& acc = fd == &k.out ? k.out_buf : k.err_buf;
        FILE* to = fd == &k.out ? stdout : stderr;
        if (got > 0) {
          acc.append(buf, static_cast<std::size_t>(got));
          flush_lines(acc, k.rank, to, false);
        } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
          flush_lines(acc, k.rank, to, true);
          ::close(*fd);
          *fd = -1;
        }
      }
    int status = 0;
    for (pid_t pid; (pid = ::waitpid(-1, &status, WNOHANG)) > 0;) {
      for (auto& k : kids)
        if (k.pid == pid && !k.exited) {
          k.exited = true;
          k.status = status;
          --running;
          const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
          if (!ok && keep_going && !g_signal) {
            note("gossip-run: rank {} (pid {}) ended with {}; the other ranks go on (--on-failure continue)\n", k.rank, pid,
                       describe(status));
            if (WIFEXITED(status) && failed_rank < 0) {  // an error, not a death
              failed_rank = k.rank;
              failed_status = status;
            }
          } else if (!ok && failed_rank < 0 && !g_signal) {
            failed_rank = k.rank;
            failed_status = status;
            note("gossip-run: rank {} (pid {}) failed with {}; stopping the other ranks\n", k.rank, pid, describe(status));
            stop_others(SIGTERM);
            stop_at = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(grace));
          }
        }
    }
    if (running > 0 && std::chrono::steady_clock::now() > stop_at) {
      note("gossip-run: {} rank(s) still running {:.1f} s after signal {}; sending SIGKILL\n", running, grace, forwarded ? forwarded : SIGTERM);
      stop_others(SIGKILL);
      stop_at = std::chrono::steady_clock::time_point::max();
    }
  }
  for (auto& k : kids) {
    flush_lines(k.out_buf, k.rank, stdout, true);
    flush_lines(k.err_buf, k.rank, stderr, true);
  }
  // What a rank started and left running in its process group (a helper in
  // the background, a data loader it did not join) does not outlive the job:
  // SIGTERM, then SIGKILL after the grace period.
  const auto left_running = [&] {
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
    }  // every rank was reaped in the loop: these are what they left, ended since
    std::string ranks;
    for (const auto& k : kids)
      if (::kill(-k.pid, 0) == 0) ranks += fmt::format("{}{}", ranks.empty() ? "" : ", ", k.rank);
    return ranks;
  };
  // One whose exit closed the rank's pipes (ending the loop above) may not be
  // a zombie to reap yet: a moment for it.
  for (int i = 0; i < 10 && !left_running().empty(); ++i) ::usleep(10000);
  if (const std::string ranks = left_running(); !ranks.empty()) {
    note("gossip-run: stopping the processes that rank(s) {} left running (SIGTERM, SIGKILL after {:.1f} s)\n", ranks, grace);
    for (const auto& k : kids) ::kill(-k.pid, SIGTERM);
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(grace));
    while (!left_running().empty() && std::chrono::steady_clock::now() < until) ::usleep(20000);
    for (const auto& k : kids) ::kill(-k.pid, SIGKILL);
  }
  // The exit report: who finished, and who did not with how it ended.
  std::string finished, lost;
  std::size_t n_finished = 0;
  for (const auto& k : kids) {
    const bool ok = k.exited && WIFEXITED(k.status) && WEXITSTATUS(k.status) == 0;
    if (ok && ++n_finished)
      finished += fmt::format("{}{}", finished.empty() ? "" : ", ", k.rank);
    else
      lost += fmt::format("{}rank {} (pid {}, {})", lost.empty() ? "" : "; ", k.rank, k.pid, k.exited ? describe(k.status) : "still running");
  }
  if (!lost.empty())
    note("gossip-run: {} of {} ranks finished ({}); did not finish: {}\n", n_finished,
               kids.size(), finished.empty() ? "none" : "ranks " + finished, lost);
  if (keep_going && failed_rank < 0 && !g_signal) return finished.empty() ? 1 : 0;
  if (failed_rank >= 0) {
    note("gossip-run: failed: rank {} ended with {}\n", failed_rank, describe(failed_status));
    return WIFEXITED(failed_status) ? WEXITSTATUS(failed_status) : 128 + WTERMSIG(failed_status);
  }
  if (g_signal) return 128 + static_cast<int>(g_signal);
  return 0;
}

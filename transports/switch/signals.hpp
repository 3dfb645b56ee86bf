#pragma once
/// The signals a switch process answers (gossip-switch, gossip-switch-udp):
/// SIGINT and SIGTERM ask it to stop, SIGUSR1 to write its statistics now.
/// The handler only sets a flag; the serving loop reads and clears them.
///
///     gossip::sw::signals::install();
///     while (!gossip::sw::signals::stop) {
///       if (gossip::sw::signals::dump.exchange(false)) write_stats();
///       serve();
///     }
#include <signal.h>

#include <atomic>

namespace gossip::sw::signals {

inline std::atomic<bool> stop{false};  ///< SIGINT or SIGTERM arrived (the program may set it too)
inline std::atomic<bool> dump{false};  ///< SIGUSR1 arrived: write the statistics

inline void install() {
  struct sigaction sa{};
  sa.sa_handler = [](int sig) {
    if (sig == SIGUSR1)
      dump = true;
    else
      stop = true;
  };
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
}

}  // namespace gossip::sw::signals

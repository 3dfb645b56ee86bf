#pragma once
/// Bounded waiting without locks: spin briefly, then yield, then sleep in short
/// steps. Every wait in libgossip goes through here and ends in a timeout_error
/// whose message says what was waited for (and so which rank).
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "gossip/error.hpp"

namespace gossip::detail {

template <class Pred, class Describe>
void wait_for(Pred&& ready, std::chrono::duration<double> timeout, Describe&& describe) {
  if (ready()) return;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout);
  for (unsigned i = 0;; ++i) {
    if (ready()) return;
    if (i < 64) {
      continue;
    } else if (i < 256) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(i < 2048 ? 20 : 200));
    }
    if ((i & 15) == 0 && std::chrono::steady_clock::now() > deadline) {
      if (ready()) return;
      throw timeout_error(fmt::format("timed out after {:.1f} s waiting for {}", timeout.count(), describe()));
    }
  }
}

}  // namespace gossip::detail

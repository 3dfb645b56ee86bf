#pragma once
/// Bounded waiting without locks: spin briefly, then yield, then sleep in short
/// steps. Every wait in libgossip goes through here and ends in a timeout_error
/// whose message says what was waited for (and so which rank).
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "gossip/error.hpp"

namespace gossip {

/// A check that the calling thread's waits on the network run every few
/// milliseconds — engine waits (pacing, busy send buffers, finish) and the
/// bootstrap's (connecting, the rendezvous, barriers). It may throw to end
/// the wait; the exception leaves through the call that waited, as a
/// timeout_error would. None by default. The Python module installs one
/// while it waits with the GIL released, so that Ctrl-C (or any signal with
/// a Python handler) interrupts a wait instead of going unseen until it
/// times out. Per thread; returns the check it replaces.
using interrupt_check = void (*)();
interrupt_check set_interrupt_check(interrupt_check check) noexcept;

namespace detail {

/// Runs the calling thread's interrupt check, if it has one.
void check_interrupt();

template <class Pred, class Describe>
void wait_for(Pred&& ready, std::chrono::duration<double> timeout, Describe&& describe) {
  if (ready()) return;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout);
  auto checked = start;
  for (unsigned i = 0;; ++i) {
    if (ready()) return;
    if (i < 64) {
      continue;
    } else if (i < 256) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(i < 2048 ? 20 : 200));
    }
    if ((i & 15) == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (now - checked >= std::chrono::milliseconds(20)) {
        checked = now;
        check_interrupt();
      }
      if (now > deadline) {
        if (ready()) return;
        throw timeout_error(fmt::format("timed out after {:.1f} s waiting for {}", timeout.count(), describe()));
      }
    }
  }
}

}  // namespace detail

}  // namespace gossip

// The per-thread interrupt check of every network wait (gossip/wait.hpp).
// Defined once, in the library, so that the engine's header code compiled
// into a user's program and the library's own waits see the same check.
#include "gossip/wait.hpp"

namespace gossip {

namespace {
thread_local interrupt_check current_check = nullptr;
}  // namespace

interrupt_check set_interrupt_check(interrupt_check check) noexcept {
  const interrupt_check previous = current_check;
  current_check = check;
  return previous;
}

void detail::check_interrupt() {
  if (current_check) current_check();
}

}  // namespace gossip

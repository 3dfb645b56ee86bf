#pragma once
// One "error: …" line for the exception being handled, and exit status 1:
// the example's and bench/traffic's last word on anything that went wrong.
#include <cstdio>
#include <exception>
#include <new>

#include <fmt/format.h>

namespace gossip::examples {

/// Call inside a catch block.
inline int report_error() {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "error: out of memory (fewer workers, a sparser topology or a smaller model needs less)\n");
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
  }
  return 1;
}

}  // namespace gossip::examples

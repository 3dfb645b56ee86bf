#pragma once
/// Errors thrown by libgossip.
///
/// Construction and configuration throw a subclass of gossip::error whose
/// message names the file, key, rank or peer involved and what to do about it.
/// The data path never throws for an expected condition; it returns a status.
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace gossip {

class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A config file or option is malformed: names the file, key and what is expected.
class config_error : public error {
 public:
  using error::error;
};

/// Two ranks disagree on the model layout: names the ranks and the first difference.
class layout_error : public error {
 public:
  using error::error;
};

/// A transport could not reach, or lost, a peer.
class transport_error : public error {
 public:
  using error::error;
};

/// A bounded wait ran out: names the rank that was waited for.
class timeout_error : public transport_error {
 public:
  using transport_error::transport_error;
};

/// Rank 0's rendezvous answered before and refuses connections now: rank 0
/// has exited or died.
class rendezvous_gone : public transport_error {
 public:
  using transport_error::transport_error;
};

/// A dataset file is missing or corrupt: names the path and the package to install.
class data_error : public error {
 public:
  using error::error;
};

namespace detail {
[[noreturn]] inline void assert_fail(const char* expr, const char* file, int line, const std::string& msg) {
  throw error(fmt::format("libgossip internal check failed: {} ({}:{}){}{}", expr, file, line,
                          msg.empty() ? "" : ": ", msg));
}
}  // namespace detail

}  // namespace gossip

/// Invariant check that stays on in release builds; cheap enough for the step path
/// because the message is only formatted on failure.
#define GOSSIP_ASSERT(cond, ...)                                                          \
  do {                                                                                    \
    if (!(cond)) [[unlikely]]                                                             \
      ::gossip::detail::assert_fail(#cond, __FILE__, __LINE__, ::fmt::format("" __VA_ARGS__)); \
  } while (0)

#pragma once
/// What the UCX transport accepts from the wire. Free of UCX headers, so that
/// the fuzzer (fuzz/fuzz_ucx_header.cpp) and tests call it without a worker.
///
///     wire_header h;
///     const int si = gossip::detail::accept_message(header, header_length, length, source_of,
///                                                   message_bytes, layout_fingerprint, h);
///     if (si < 0) drop();   // foreign or corrupt
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "gossip/transport.hpp"

namespace gossip::detail {

/// Checks an active message (a user header of `header_length` bytes and a
/// payload of `length` bytes) against this rank's setup: `source_of[rank]` is
/// the index of each source rank or -1, `message_bytes` the size of an inbox
/// slot. Returns the sender's source index and fills `h`, or -1 when the
/// message is foreign or corrupt. A length from the wire is never trusted: an
/// accepted message fits a slot, also when the length is near SIZE_MAX (a
/// rendezvous length is what the sender claims).
inline int accept_message(const void* header, std::size_t header_length, std::size_t length, std::span<const int> source_of,
                          std::size_t message_bytes, std::uint64_t layout_fingerprint, wire_header& h) noexcept {
  if (header_length != sizeof h) return -1;
  std::memcpy(&h, header, sizeof h);
  if (h.sender < 0 || static_cast<std::size_t>(h.sender) >= source_of.size()) return -1;
  const int si = source_of[static_cast<std::size_t>(h.sender)];
  if (si < 0 || h.magic != wire_header::magic_value || h.version != wire_header::version_value || h.payload_bytes != length ||
      message_bytes < sizeof h || length > message_bytes - sizeof h || h.layout_fingerprint != layout_fingerprint)
    return -1;
  return si;
}

}  // namespace gossip::detail

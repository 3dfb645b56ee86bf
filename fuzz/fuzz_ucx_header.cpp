// The UCX transport's receive check (transports/ucx/wire.hpp) and what the
// receive path then does with an accepted message: copy the payload behind
// the header into an inbox slot of message_bytes and hand the engine
// payload_bytes / 4 floats.
//
// Input: 8 bytes of payload length (little-endian, as UCX reports it), then
// the active message's user header (its length is whatever is left). The
// setup is fixed: world of 6, sources 1, 2 and 4, slots of 48 + 4096 bytes.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "wire.hpp"

namespace {
constexpr std::size_t message_bytes = sizeof(gossip::wire_header) + 4096;
constexpr std::uint64_t layout_fp = 0x0123456789abcdefull;
constexpr std::array<int, 6> source_of = {-1, 0, 1, -1, 2, -1};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 8) return 0;
  std::uint64_t length = 0;
  std::memcpy(&length, data, 8);
  gossip::wire_header h;
  const int si = gossip::detail::accept_message(data + 8, size - 8, static_cast<std::size_t>(length), source_of, message_bytes,
                                                layout_fp, h);
  if (si < 0) return 0;
  if (si > 2 || source_of[static_cast<std::size_t>(h.sender)] != si) std::abort();
  // land(): header and payload into the slot (the payload's bytes do not matter here).
  static std::vector<std::byte> payload(message_bytes), slot(message_bytes);
  if (sizeof h + length > slot.size() || length > payload.size()) std::abort();
  std::memcpy(slot.data(), &h, sizeof h);
  std::memcpy(slot.data() + sizeof h, payload.data(), static_cast<std::size_t>(length));
  // collect(): the engine reads payload_bytes / 4 floats after the header.
  if (sizeof h + h.payload_bytes / sizeof(float) * sizeof(float) > slot.size()) std::abort();
  return 0;
}

// The codec payload checker (gossip::decode_payload) on untrusted bytes, and
// every codec's encode → decode on untrusted values.
//
// Input byte 0, bit 0: the mode.
//   0 — the rest is a payload for a model of two tensors (120 and 7 values);
//       bit 1 says whether the stream is primed. A payload is accepted or
//       refused; it is never read past its end (ASan).
//   1 — byte 1 picks a codec (none, fp16, int8, topk, randomk, lowrank with
//       the 120 values as a 10 × 12 matrix; from 6 on, topk and randomk send
//       fp16 values); the rest are the floats of two
//       successive models. Each is encoded against the sender's x̂ and
//       decoded into the receiver's: the decoder must accept what the
//       encoder wrote, and both x̂ must agree bit for bit (NaN: up to sign).
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gossip/codec.hpp"

namespace {

constexpr std::array<std::size_t, 2> counts = {120, 7};
constexpr std::array<std::size_t, 2> rows = {10, 0};
constexpr std::size_t elements = 127;

gossip::codec make(std::uint8_t pick) {
  gossip::codec_settings s;
  s.kind = static_cast<gossip::codec_kind>(pick % gossip::codec_kind_count);
  s.ratio = 0.1;
  s.half_values = (pick / gossip::codec_kind_count) % 2 == 1;
  s.block = 16;
  s.rank = 2;
  return gossip::codec(s);
}

void round_trip(std::uint8_t pick, const std::uint8_t* data, std::size_t size) {
  gossip::codec c = make(pick);
  c.prepare(120);
  std::vector<float> hat(elements, 0.0f), recv(elements, 0.0f), state(c.state_floats(120, 10) + 1);
  std::vector<std::uint64_t> words(c.payload_capacity(counts) / 8 + 1);
  auto* out = reinterpret_cast<std::byte*>(words.data());
  for (int message = 0; message < 2; ++message) {
    std::array<float, elements> x{};
    const std::size_t take = std::min(size, sizeof x);
    std::memcpy(x.data(), data, take);
    data += take, size -= take;
    gossip::codec_payload ph;
    ph.tensors = counts.size();
    ph.elements = elements;
    std::memcpy(out, &ph, sizeof ph);
    std::size_t at = sizeof ph, offset = 0;
    for (std::size_t t = 0; t < counts.size(); ++t) {
      at += c.encode(x.data() + offset, hat.data() + offset, counts[t], out + at, message == 0, 5 + t, rows[t], state.data());
      offset += counts[t];
    }
    if (at > c.payload_capacity(counts)) std::abort();
    if (!gossip::decode_payload({out, at}, counts, recv.data(), message > 0).ok()) std::abort();
    // Bit for bit, except that a NaN may come out with either sign (a compiler
    // may swap the operands of x̂ + change, and x86 keeps the first NaN's sign).
    for (std::size_t i = 0; i < elements; ++i)
      if (std::memcmp(&hat[i], &recv[i], sizeof(float)) != 0 && !(std::isnan(hat[i]) && std::isnan(recv[i]))) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  if (data[0] & 1) {
    round_trip(data[1], data + 2, size - 2);
    return 0;
  }
  const bool primed = (data[0] & 2) != 0;
  // A copy of exactly the payload's size and alignment, as a transport delivers it.
  std::vector<std::uint64_t> words((size - 1 + 7) / 8);
  std::memcpy(words.data(), data + 1, size - 1);
  std::vector<float> hat(elements, 0.0f);
  (void)gossip::decode_payload({reinterpret_cast<const std::byte*>(words.data()), size - 1}, counts, hat.data(), primed);
  return 0;
}

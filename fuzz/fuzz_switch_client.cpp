// Datagrams into a switch worker (transports/switch/client.hpp): the check
// for the switch's refusal, the classification of what arrives while an
// all-reduce or a delta waits for its chunks, and the leave's answer.
//
// Input: 5 bytes of setup, then a sequence of datagrams, each a
// little-endian 16-bit length and that many bytes (a length past the end
// takes what is left). Setup: byte 0 bit 0 sync (else async), chunk
// 1 + byte 1 % 8, window 1 + byte 2 % 4, a model of byte 3 % 64 floats,
// operation sequence byte 4 % 4. The worker is worker 2 of 4 in group 1,
// session 0x5e55. The window starts as client::run() fills it, and each
// reply frees and refills its slot as run() does.
// Checked besides memory safety (each datagram in a buffer of its own size):
// a refusal is reported exactly for another version's packet or a
// `refused` of this worker's session, and says so; a reply fits its
// datagram and the model, answers an active slot's chunk, and no chunk is
// answered twice; a rejoin only in async mode, echoing this operation; a
// sync_pending only in sync mode, for an active slot's chunk; a
// leave's answer is header only and this session's.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "client.hpp"

namespace sw = gossip::sw;

namespace {

[[noreturn]] void fail() { std::abort(); }

constexpr std::uint16_t group = 1, worker = 2;
constexpr std::uint32_t session = 0x5e55;

// What check_refusal() must throw on, from the datagram's bytes alone.
bool is_refusal(const std::byte* p, std::size_t len) {
  if (len >= 8) {
    std::uint32_t magic;
    std::memcpy(&magic, p, 4);
    if (magic == sw::packet_header::magic_value && static_cast<std::uint8_t>(p[4]) != sw::packet_header::version_value) return true;
  }
  sw::packet_header h;
  if (len != sizeof h) return false;
  std::memcpy(&h, p, sizeof h);
  return h.magic == sw::packet_header::magic_value && h.version == sw::packet_header::version_value && h.type == sw::packet_type::refused &&
         h.group == group && h.worker == worker && h.session == session;
}

void refusal(const std::byte* p, std::size_t len, const sw::client_config& cfg, bool sync, std::uint64_t n) {
  bool thrown = false;
  try {
    sw::detail::check_refusal(p, len, cfg, session, sync ? "sync" : "async", n);
  } catch (const gossip::config_error& e) {
    thrown = true;
    const std::string what = e.what();
    if (what.find("switch at 10.0.0.9:47000") != 0 || (what.find("refused") == std::string::npos && what.find("version") == std::string::npos))
      fail();
  }
  if (thrown != is_refusal(p, len)) fail();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 5) return 0;
  const bool sync = data[0] & 1;
  sw::client_config cfg;
  cfg.address = "10.0.0.9";
  cfg.group = group;
  cfg.worker = worker;
  cfg.members = 4;
  cfg.chunk = static_cast<std::uint16_t>(1 + data[1] % 8);
  cfg.window = static_cast<std::uint16_t>(1 + data[2] % 4);
  const std::uint64_t n = data[3] % 64;
  const std::uint64_t sequence = data[4] % 4;
  data += 5, size -= 5;

  // The window as run() fills it: slot s carries chunk s.
  const std::uint64_t chunks = (n + cfg.chunk - 1) / cfg.chunk;
  std::vector<sw::detail::flight> flights(cfg.window);
  std::vector<std::uint8_t> ver(cfg.window, 0);
  std::uint64_t next = 0, done = 0;
  for (std::size_t s = 0; s < flights.size() && next < chunks; ++s) flights[s] = {true, static_cast<std::uint32_t>(next++), {}, 0};
  std::vector<char> answered(chunks, 0);
  std::vector<float> out(n);
  const sw::detail::awaited awaiting{.sync = sync,
                                     .group = cfg.group,
                                     .worker = cfg.worker,
                                     .chunk = cfg.chunk,
                                     .session = session,
                                     .sequence = sequence,
                                     .n = n,
                                     .chunks = chunks,
                                     .flights = flights,
                                     .ver = ver};

  while (size >= 2) {
    std::size_t len = static_cast<std::size_t>(data[0]) | static_cast<std::size_t>(data[1]) << 8;
    data += 2, size -= 2;
    if (len > size) len = size;
    std::vector<std::byte> dgram(len);
    if (len) std::memcpy(dgram.data(), data, len);
    data += len, size -= len;
    const std::byte* p = dgram.data();

    refusal(p, len, cfg, sync, n);
    refusal(p, len, cfg, false, 0);  // as leave() checks
    if (sw::detail::leave_answered(p, len, group, worker, session)) {
      sw::packet_header h;
      std::memcpy(&h, p, sizeof h);
      if (len != sizeof h || h.type != sw::packet_type::async_reply || h.elements != 0 || h.session != session) fail();
    }

    const auto c = sw::detail::classify_reply(p, len, awaiting);
    const auto& h = c.h;
    switch (c.kind) {
      case sw::detail::datagram_kind::malformed:
      case sw::detail::datagram_kind::stale:
        continue;
      case sw::detail::datagram_kind::pending:
        // Sync only, header and bitmap, for an active slot's chunk of this operation and session.
        if (!sync || len != sw::pending_bytes || h.type != sw::packet_type::sync_pending || h.elements != 0 || h.session != session ||
            h.sequence != static_cast<std::uint32_t>(sequence) || h.group != group || h.worker != worker || c.slot >= flights.size() ||
            !flights[c.slot].active || flights[c.slot].chunk != h.chunk || h.slot != c.slot || h.flags != ver[c.slot])
          fail();
        continue;
      case sw::detail::datagram_kind::rejoin:
        if (sync || len != sizeof h || h.type != sw::packet_type::async_rejoin || h.session != session ||
            h.sequence != static_cast<std::uint32_t>(sequence) || h.group != group || h.worker != worker)
          fail();
        continue;
      case sw::detail::datagram_kind::reply:
        break;
    }
    // A reply: in the datagram, in the model, for an active slot's chunk, once.
    if (len != sw::packet_bytes(h.elements) || h.elements == 0 || h.elements > cfg.chunk || c.slot >= flights.size()) fail();
    if (c.offset + h.elements > n || c.offset != static_cast<std::uint64_t>(h.chunk) * cfg.chunk) fail();
    if (!flights[c.slot].active || flights[c.slot].chunk != h.chunk || h.chunk >= chunks || answered[h.chunk]) fail();
    if (h.session != session || h.sequence != static_cast<std::uint32_t>(sequence) || h.group != group || h.worker != worker) fail();
    if (h.type != (sync ? sw::packet_type::sync_result : sw::packet_type::async_reply)) fail();
    if (sync && (h.slot != c.slot || h.flags != ver[c.slot])) fail();
    answered[h.chunk] = 1;
    std::memcpy(out.data() + c.offset, p + sizeof(sw::packet_header), h.elements * sizeof(float));
    // What run() does next: free the slot, and send the next chunk in it.
    flights[c.slot].active = false;
    if (++done > chunks) fail();
    if (sync) {
      ver[c.slot] ^= 1;
      const std::uint64_t again = h.chunk + flights.size();
      if (again < chunks) flights[c.slot] = {true, static_cast<std::uint32_t>(again), {}, 0};
    } else if (next < chunks) {
      flights[c.slot] = {true, static_cast<std::uint32_t>(next++), {}, 0};
    }
  }
  return 0;
}

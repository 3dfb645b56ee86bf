// The bootstrap rendezvous (lib/bootstrap_detail.hpp): rank 0's server
// reading requests from anyone who connects, the store's answers, a
// client's reading of a reply's head, and the barrier's lists of dead ranks.
//
// Input: a sequence of connections, each a little-endian 16-bit length and
// that many bytes (a length past the end takes what is left), served in turn
// by one store (identity 0x5354, limited to 4096 bytes so that a full store
// is reached), as handle() serves them. The bytes of each
// connection are also read as the head of a reply (zeros past its end, as a
// client reads a reply cut short).
// Checked besides memory safety: no read past the connection, no allocation
// above twice what arrived plus one value chunk; an accepted request is
// exactly what encode_request() makes of its fields, and the store and its
// reply agree with what it asked ('S' changes nothing, 'X' only when another
// value is there, 'F' changes nothing and only past the limit, a value
// refused before it arrived (as the server admits one) is read past and
// never held and is answered 'F', 'X' or 'S', 'D' removes
// exactly the key asked); the bytes the store counts are those it holds; every reply the server sends reads back as what was
// meant; a rank list decodes to the ints it holds and encodes back.
#include <sanitizer/allocator_interface.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bootstrap_detail.hpp"

namespace rv = gossip::detail::rendezvous;

namespace {

constexpr std::uint64_t store_id = 0x5354;

// The largest allocation while `tracking` (the server's reading of one request).
bool tracking = false;
std::size_t largest = 0;
void on_malloc(const volatile void*, std::size_t size) {
  if (tracking) largest = std::max(largest, size);
}
void on_free(const volatile void*) {}

[[noreturn]] void fail() { std::abort(); }

void check_reply(const rv::blob& out, char status, std::uint64_t id, const rv::blob& value) {
  if (out.size() != rv::reply_head_bytes + value.size()) fail();
  char head[rv::reply_head_bytes];
  std::memcpy(head, out.data(), sizeof head);
  const auto h = rv::parse_reply_head(head);
  const auto want = status == 'S' ? rv::reply_kind::replaced : rv::reply_kind::ok;
  if (h.kind != want || h.status != status || h.store != id || h.length != value.size()) fail();
  if (!value.empty() && std::memcmp(out.data() + rv::reply_head_bytes, value.data(), value.size()) != 0) fail();
}

void check_ranks(const rv::blob& b) {
  const auto ranks = rv::decode_ranks(b);
  if (ranks.size() != b.size() / sizeof(int)) fail();
  const auto again = rv::encode_ranks(ranks);
  if (again.size() != ranks.size() * sizeof(int) || !std::equal(again.begin(), again.end(), b.begin())) fail();
  std::vector<char> dead(5, 0);
  rv::mark_dead(ranks, dead);
  if (dead[0]) fail();
  for (int r = 1; r < 5; ++r)
    if (dead[static_cast<std::size_t>(r)] != (std::find(ranks.begin(), ranks.end(), r) != ranks.end())) fail();
}

// The bytes a store holds by its own count (rv::put).
std::uint64_t held(const rv::store& s) {
  std::uint64_t n = 0;
  for (const auto& [k, v] : s.map) n += k.size() + v->size() + rv::entry_overhead;
  return n;
}

void serve(rv::store& store, const std::byte* p, std::size_t size) {
  std::size_t at = 0;
  const auto read = [&](void* to, std::size_t n) {
    if (n > size - at) return false;  // cut short: the client closed
    if (n) std::memcpy(to, p + at, n);
    at += n;
    return true;
  };
  rv::request req;
  largest = 0;
  tracking = true;
  // As rank 0's server refuses a put's value at once (one connection at a
  // time here, so none waits for values under way).
  const auto st = rv::read_request(read, req, [&](rv::request& r, std::uint64_t length) {
    if (r.joined != 0 && r.joined != store_id) return false;
    r.other_value = rv::holds_other_length(store, r.op == 'O', r.key, length);
    return rv::admit(store, 0, r.op == 'O', r.key, length);
  });
  tracking = false;
  if (largest > 2 * size + rv::value_chunk + 64) fail();
  if (req.refused && largest > rv::max_key + 64) fail();  // a refused value is read past, never held
  if (at > size) fail();
  if (st == rv::read_status::other_version) {
    if (at != 4 || std::memcmp(p, rv::magic, 3) != 0 || std::memcmp(p, rv::magic, 4) == 0) fail();
    check_reply(rv::encode_reply('V', 0, {}), 'V', 0, {});
    return;
  }
  if (st == rv::read_status::foreign && (at != 4 || std::memcmp(p, rv::magic, 3) == 0)) fail();
  if (st != rv::read_status::ok) return;

  // The request is what a client makes of its fields, byte for byte.
  const bool put = req.op == 'P' || req.op == 'O';
  if (!put && req.op != 'G' && req.op != 'D') fail();
  if (req.key.size() > rv::max_key || req.value.size() > rv::max_blob || (!put && !req.value.empty())) fail();
  if (req.refused && (!put || !req.value.empty() || req.refused_bytes > rv::max_blob)) fail();
  if (!req.refused) {
    const auto again = rv::encode_request(req.op, req.joined, req.key, put ? &req.value : nullptr);
    if (again.size() != at || std::memcmp(again.data(), p, at) != 0) fail();
  } else {
    // The head as a client makes it, the value's length, and the value's bytes all read.
    const rv::blob none;
    const auto head = rv::encode_request(req.op, req.joined, req.key, &none);
    const std::size_t key_end = rv::request_head_bytes + req.key.size();
    std::uint64_t length;
    std::memcpy(&length, p + key_end, 8);
    if (std::memcmp(head.data(), p, key_end) != 0 || length != req.refused_bytes || at != key_end + 8 + length) fail();
  }

  const auto look = [&] { return store.map.contains(req.key) ? std::optional<rv::blob>(*store.map.find(req.key)->second) : std::nullopt; };
  const auto before = look();
  const std::size_t entries = store.map.size();
  const std::uint64_t bytes = store.bytes;
  const rv::blob value = req.value;
  rv::value_ptr shared;
  const char status = rv::answer(store, store_id, req, shared);
  const rv::blob reply_value = shared ? *shared : rv::blob{};
  // A get hands over the stored value itself, not a copy; a reply's head and value are encode_reply's bytes.
  if (status == 'Y' && req.op == 'G' && shared != store.map.find(req.key)->second) fail();
  const auto head = rv::encode_reply_head(status, store_id, reply_value.size());
  const auto whole = rv::encode_reply(status, store_id, reply_value);
  if (!std::equal(head.begin(), head.end(), whole.begin()) || !std::equal(reply_value.begin(), reply_value.end(), whole.begin() + head.size()))
    fail();
  const auto after = look();
  const bool stranger = req.joined != 0 && req.joined != store_id;
  if (store.bytes != held(store) || store.bytes > store.limit) fail();
  switch (status) {
    case 'S':
      if (!stranger || after != before || store.map.size() != entries || !reply_value.empty()) fail();
      break;
    case 'X':
      if (stranger || req.op != 'O' || !before || after != before) fail();
      if (req.refused ? before->size() == req.refused_bytes : *before == value) fail();
      break;
    case 'F': {
      // Nothing changed, and storing it would have passed the limit (or,
      // refused before it was received, the value alone would have).
      const std::uint64_t length = req.refused ? req.refused_bytes : value.size();
      const std::uint64_t would = before ? bytes - before->size() + length : bytes + req.key.size() + length + rv::entry_overhead;
      std::uint64_t told[2] = {};
      if (reply_value.size() == sizeof told) std::memcpy(told, reply_value.data(), sizeof told);
      if (stranger || !put || after != before || store.bytes != bytes || reply_value.size() != sizeof told || told[0] != bytes ||
          told[1] != store.limit)
        fail();
      if (req.refused ? length <= store.limit && would <= store.limit : would <= store.limit || (req.op == 'O' && before)) fail();
      if (req.op == 'O' && before && before->size() != length) fail();  // another value is there, whatever the limit
      break;
    }
    case 'N':
      if (stranger || (req.op != 'G' && req.op != 'D') || before || after || !reply_value.empty()) fail();
      break;
    case 'Y':
      if (stranger) fail();
      if (req.op == 'G' && (!before || reply_value != *before || after != before)) fail();
      if (req.op == 'D' && (!before || after || !reply_value.empty() || store.map.size() != entries - 1)) fail();
      if (put && (after != value || !reply_value.empty() || (req.op == 'O' && before && *before != value))) fail();
      break;
    default:
      fail();
  }
  if (req.refused ? status == 'Y' || status == 'N' : status == 'F') fail();  // a put admitted is never refused when it is answered
  check_reply(rv::encode_reply(status, store_id, reply_value), status, store_id, reply_value);
  // A barrier reads an arrival value as the ranks its sender found dead.
  if (put) check_ranks(value);
}

// A client's reading of a reply head: zeros past what came.
void read_reply(const std::byte* p, std::size_t size) {
  char head[rv::reply_head_bytes] = {};
  if (size) std::memcpy(head, p, std::min(size, sizeof head));
  const auto h = rv::parse_reply_head(head);
  const bool ours = std::memcmp(head, rv::magic, 4) == 0;
  switch (h.kind) {
    case rv::reply_kind::other_version:
      if (ours || std::memcmp(head, rv::magic, 3) != 0 || h.version == 0) fail();
      break;
    case rv::reply_kind::foreign:
      if (ours) fail();
      break;
    case rv::reply_kind::replaced:
      if (!ours || h.status != 'S') fail();
      break;
    case rv::reply_kind::too_long:
      if (!ours || h.status == 'S' || h.length <= rv::max_blob) fail();
      break;
    case rv::reply_kind::ok:
      if (!ours || h.status == 'S' || h.length > rv::max_blob) fail();
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  __sanitizer_install_malloc_and_free_hooks(on_malloc, on_free);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  rv::store store;
  store.limit = 4096;
  while (size >= 2) {
    std::size_t len = static_cast<std::size_t>(data[0]) | static_cast<std::size_t>(data[1]) << 8;
    data += 2, size -= 2;
    if (len > size) len = size;
    // Each connection in a buffer of its own size: a read past it is caught.
    std::vector<std::byte> conn(len);
    if (len) std::memcpy(conn.data(), data, len);
    serve(store, conn.data(), conn.size());
    read_reply(conn.data(), conn.size());
    data += len, size -= len;
  }
  return 0;
}

#pragma once
// The rendezvous protocol of lib/bootstrap.cpp, byte for byte: what a client
// sends, how rank 0's server reads and answers it, what the client makes of
// the answer, and the barrier's lists of dead ranks. Free of sockets, so that
// the fuzzer (fuzz/fuzz_bootstrap.cpp) runs the server's and the client's
// parsing on bytes alone.
//
// Request (one per connection): magic "GRV5", op ('P' put, 'O' put unless
// another value is there, 'G' get, 'D' erase), u64 identity of the store the
// client joined (0: none yet), u32 key length, key; for 'P' and 'O' then u64
// value length and value.
// Reply: magic, status ('Y' found, stored or erased, 'N' not found, 'X'
// another value is there, 'F' the store is full — the value is then two u64,
// the bytes it holds or is receiving and its limit —, 'S' the client joined another store, 'V' a request of
// another version), u64 identity of the store, u64 value length, value.
// Integers are in host byte order.
//
//     rendezvous::request req;
//     if (rendezvous::read_request(read, req, admit) == rendezvous::read_status::ok)   // read(p, n): n bytes or false
//       status = rendezvous::answer(store, id, req, value);
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gossip::detail::rendezvous {

using blob = std::vector<std::byte>;  // bootstrap::blob

// Version 2: a request carries the identity of the store its client joined
// (0 before the first answer), and every answer the identity of the store
// that gave it. Version 3: operation 'O', a put that does not overwrite
// another value (answered 'X'). Version 4: nothing new here, but the UCX
// transport's ranks answer each other's liveness probes, which a rank of an
// earlier release would leave unanswered: the version keeps them apart.
// Version 5: operation 'D' (erase) and status 'F' (the store is full).
inline constexpr char magic[4] = {'G', 'R', 'V', '5'};
inline constexpr std::uint64_t max_blob = 64ull << 20;
/// The most one store holds, keys and values together, each entry counted
/// with entry_overhead bytes more: a put past it is refused ('F'), so that a
/// run that never erases what it read fails with an error that says so.
inline constexpr std::uint64_t max_store_bytes = 4ull << 30;
inline constexpr std::uint64_t entry_overhead = 64;
inline constexpr std::size_t max_key = 4096;
inline constexpr std::size_t request_head_bytes = 4 + 1 + 8 + 4;
inline constexpr std::size_t reply_head_bytes = 4 + 1 + 8 + 8;
/// A value is received (and its buffer grown) this much at a time, so that
/// a header alone (a stranger's, or a client that died) holds no more.
inline constexpr std::size_t value_chunk = std::size_t{1} << 20;

struct request {
  char op = 0;
  std::uint64_t joined = 0;  ///< the store the client joined (0: none yet)
  std::string key;
  blob value;  ///< 'P' and 'O'
  /// 'P' and 'O': the value was refused before it was received (read_request's
  /// admit) and read past without being kept; `value` is then empty and
  /// `refused_bytes` its length. answer() says 'S' to a stranger, 'X' when
  /// `other_value` (set by admit: a put once of a key that held a value of
  /// another length when it was refused), else 'F'.
  bool refused = false;
  bool other_value = false;
  std::uint64_t refused_bytes = 0;
};

enum class read_status {
  ok,
  dropped,        ///< cut short, a key or value over the limit, or an unknown op: closed unanswered
  other_version,  ///< magic "GRV" and another version: answered 'V', so that its client can say so
  foreign,        ///< not a rendezvous request: closed unanswered
};

/// Reads one request through `read(void* p, std::size_t n)`, which fills n
/// bytes or returns false. Reads no byte past the request; holds at most
/// max_key bytes of key, and of a value what arrived plus value_chunk.
/// `admit(request&, std::uint64_t length)` is asked, once a put's key
/// and value length are read, whether its value may be held: when it says
/// no, the value's bytes are read in small pieces and dropped (so that the
/// connection stays in step and the answer reaches the client) and the
/// request comes back `refused`.
template <class Read, class Admit>
read_status read_request(Read&& read, request& req, Admit&& admit) {
  char hdr[request_head_bytes];
  if (!read(hdr, 4)) return read_status::dropped;
  if (std::memcmp(hdr, magic, 4) != 0) return std::memcmp(hdr, magic, 3) == 0 ? read_status::other_version : read_status::foreign;
  if (!read(hdr + 4, sizeof hdr - 4)) return read_status::dropped;
  req.op = hdr[4];
  std::memcpy(&req.joined, hdr + 5, 8);
  std::uint32_t klen;
  std::memcpy(&klen, hdr + 13, 4);
  if (klen > max_key) return read_status::dropped;
  req.key.assign(klen, '\0');
  if (!read(req.key.data(), klen)) return read_status::dropped;
  req.value.clear();
  req.refused = false;
  req.other_value = false;
  req.refused_bytes = 0;
  if (req.op == 'P' || req.op == 'O') {
    std::uint64_t vlen;
    if (!read(&vlen, 8) || vlen > max_blob) return read_status::dropped;
    if (!admit(req, vlen)) {
      char sink[4096];
      for (std::uint64_t left = vlen; left > 0;) {
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(left, sizeof sink));
        if (!read(sink, n)) return read_status::dropped;
        left -= n;
      }
      req.refused = true;
      req.refused_bytes = vlen;
      return read_status::ok;
    }
    while (req.value.size() < vlen) {
      const std::size_t at = req.value.size(), n = static_cast<std::size_t>(std::min<std::uint64_t>(vlen - at, value_chunk));
      req.value.resize(at + n);
      if (!read(req.value.data() + at, n)) return read_status::dropped;
    }
  } else if (req.op != 'G' && req.op != 'D') {
    return read_status::dropped;
  }
  return read_status::ok;
}

/// A stored value: shared, so that a get hands it to the reply without a copy
/// (and without holding the store's lock while it is sent); a put replaces
/// the pointer, never the bytes a reply may still be sending.
using value_ptr = std::shared_ptr<const blob>;
using store_map = std::map<std::string, value_ptr, std::less<>>;

/// Rank 0's key-value store and the bytes it holds (keys, values and
/// entry_overhead per entry), bounded by `limit`.
struct store {
  store_map map;
  std::uint64_t bytes = 0;
  std::uint64_t limit = max_store_bytes;
};

enum class put_result { stored, other_value, full };

/// The bytes by which a put of a `length`-byte value under `key` grows the
/// store: 0 for a put `once` of a key that is there (it stores nothing new)
/// and for a value no longer than the one it replaces.
inline std::uint64_t put_growth(const store& s, bool once, std::string_view key, std::uint64_t length) {
  if (const auto it = s.map.find(key); it != s.map.end()) return once || length <= it->second->size() ? 0 : length - it->second->size();
  return key.size() + length + entry_overhead;
}

/// Whether the store, holding its bytes and `receiving` more that puts under
/// way were admitted with, may grow by `growth` within its limit.
inline bool fits(const store& s, std::uint64_t receiving, std::uint64_t growth) {
  return growth == 0 || (growth <= s.limit && receiving <= s.limit - growth && s.bytes <= s.limit - growth - receiving);
}

/// Whether a put of a `length`-byte value under `key` may be received while
/// other puts' values of `receiving` bytes are: its value must fit the limit
/// beside theirs, and the store must have room for it beside them (theirs
/// counted as their values only, so that two new keys admitted together may
/// still find the store full when they are answered). A put once of a key
/// that holds a value of another length (holds_other_length) is never
/// admitted: its answer is 'X' whatever its value, as the store was when it
/// was refused (request::other_value). rank 0's server refuses at once what is not
/// admitted with `receiving` 0, and makes any other put wait until it is:
/// the most a store's connections hold of values at once is its limit.
inline bool holds_other_length(const store& s, bool once, std::string_view key, std::uint64_t length) {
  const auto it = s.map.find(key);
  return once && it != s.map.end() && it->second->size() != length;
}
inline bool admit(const store& s, std::uint64_t receiving, bool once, std::string_view key, std::uint64_t length) {
  if (holds_other_length(s, once, key, length)) return false;
  return length <= s.limit && receiving <= s.limit - length && fits(s, receiving, put_growth(s, once, key, length));
}

/// Stores `value` under `key`. `once`: only when the key is new or holds the
/// same value (a request asked again after a lost reply); other_value when
/// another value is there. full (nothing changed) when the store would then
/// hold more than its limit.
inline put_result put(store& s, bool once, const std::string& key, blob value) {
  const auto it = s.map.find(key);
  if (it != s.map.end() && once) return *it->second == value ? put_result::stored : put_result::other_value;
  if (!fits(s, 0, put_growth(s, once, key, value.size()))) return put_result::full;
  if (it != s.map.end()) {
    auto stored = std::make_shared<const blob>(std::move(value));  // may throw: nothing changed yet
    s.bytes = s.bytes - it->second->size() + stored->size();
    it->second = std::move(stored);
  } else {
    const std::uint64_t need = key.size() + value.size() + entry_overhead;
    s.map.emplace(key, std::make_shared<const blob>(std::move(value)));
    s.bytes += need;
  }
  return put_result::stored;
}

/// Removes `key`; false when it was not there.
inline bool erase(store& s, std::string_view key) {
  const auto it = s.map.find(key);
  if (it == s.map.end()) return false;
  s.bytes -= it->first.size() + it->second->size() + entry_overhead;
  s.map.erase(it);
  return true;
}

/// The status with which the store `id` answers `req` (read_status::ok),
/// applying it: a client of an earlier store on this port (a run that has
/// ended) is told so ('S') and changes nothing. A found value goes to
/// `value` (the stored one, shared), and so do, for 'F', the bytes the store
/// holds (plus `receiving`, what puts under way were admitted with) and its
/// limit (two u64); otherwise `value` is made empty. Takes the request's value.
inline char answer(store& s, std::uint64_t id, request& req, value_ptr& value, std::uint64_t receiving = 0) {
  value.reset();
  if (req.joined != 0 && req.joined != id) return 'S';
  const auto full = [&] {
    const std::uint64_t held = s.bytes + receiving;
    blob v(2 * sizeof(std::uint64_t));
    std::memcpy(v.data(), &held, sizeof held);
    std::memcpy(v.data() + sizeof held, &s.limit, sizeof s.limit);
    value = std::make_shared<const blob>(std::move(v));
    return 'F';
  };
  if (req.refused) return req.other_value ? 'X' : full();
  if (req.op == 'G') {
    const auto it = s.map.find(req.key);
    if (it == s.map.end()) return 'N';
    value = it->second;
    return 'Y';
  }
  if (req.op == 'D') return erase(s, req.key) ? 'Y' : 'N';
  switch (put(s, req.op == 'O', req.key, std::move(req.value))) {
    case put_result::stored:
      return 'Y';
    case put_result::other_value:
      return 'X';
    case put_result::full:
      break;
  }
  return full();
}

/// A request as a client sends it; `value` for 'P' and 'O' only.
inline blob encode_request(char op, std::uint64_t joined, const std::string& key, const blob* value) {
  blob out(request_head_bytes + key.size() + (value ? 8 + value->size() : 0));
  const auto klen = static_cast<std::uint32_t>(key.size());
  std::memcpy(out.data(), magic, 4);
  out[4] = static_cast<std::byte>(op);
  std::memcpy(out.data() + 5, &joined, 8);
  std::memcpy(out.data() + 13, &klen, 4);
  if (!key.empty()) std::memcpy(out.data() + request_head_bytes, key.data(), key.size());
  if (value) {
    const std::uint64_t n = value->size();
    std::memcpy(out.data() + request_head_bytes + key.size(), &n, 8);
    if (n) std::memcpy(out.data() + request_head_bytes + key.size() + 8, value->data(), value->size());
  }
  return out;
}

/// A reply's head as the server sends it: magic, status, store id, and the
/// length of the value that follows.
inline std::array<std::byte, reply_head_bytes> encode_reply_head(char status, std::uint64_t id, std::uint64_t length) {
  std::array<std::byte, reply_head_bytes> out{};
  std::memcpy(out.data(), magic, 4);
  out[4] = static_cast<std::byte>(status);
  std::memcpy(out.data() + 5, &id, 8);
  std::memcpy(out.data() + 13, &length, 8);
  return out;
}

/// A reply as the server sends it: its head, then the value.
inline blob encode_reply(char status, std::uint64_t id, const blob& value) {
  const auto head = encode_reply_head(status, id, value.size());
  blob out(head.begin(), head.end());
  out.insert(out.end(), value.begin(), value.end());
  return out;
}

enum class reply_kind {
  ok,             ///< `length` bytes of value follow
  other_version,  ///< a rendezvous of another version (`version`)
  foreign,        ///< not a rendezvous's reply
  replaced,       ///< 'S': the client's store is not the one answering
  too_long,       ///< a length over max_blob
};

struct reply_head {
  reply_kind kind = reply_kind::foreign;
  char status = 0;
  char version = 0;
  std::uint64_t store = 0, length = 0;
};

/// What a client makes of the head of a reply. A reply cut short reads as
/// zeros where nothing came: another version's reply may be shorter (and
/// then look cut short), its magic says which.
inline reply_head parse_reply_head(const char (&head)[reply_head_bytes]) noexcept {
  reply_head h;
  h.version = head[3];
  h.status = head[4];
  std::memcpy(&h.store, head + 5, 8);
  std::memcpy(&h.length, head + 13, 8);
  if (std::memcmp(head, magic, 3) == 0 && head[3] != magic[3] && head[3] != 0)
    h.kind = reply_kind::other_version;
  else if (std::memcmp(head, magic, 4) != 0)
    h.kind = reply_kind::foreign;
  else if (head[4] == 'S')
    h.kind = reply_kind::replaced;
  else if (h.length > max_blob)
    h.kind = reply_kind::too_long;
  else
    h.kind = reply_kind::ok;
  return h;
}

/// A barrier's arrival value: the ranks its sender found dead.
inline blob encode_ranks(std::span<const int> ranks) {
  blob b(ranks.size() * sizeof(int));
  if (!b.empty()) std::memcpy(b.data(), ranks.data(), b.size());
  return b;
}

/// The ranks of an arrival value; a trailing partial int is ignored.
inline std::vector<int> decode_ranks(const blob& b) {
  std::vector<int> ranks(b.size() / sizeof(int));
  if (!ranks.empty()) std::memcpy(ranks.data(), b.data(), ranks.size() * sizeof(int));
  return ranks;
}

/// Marks the reported ranks dead; rank 0 (which decides) and ranks outside
/// the world of dead.size() are ignored.
inline void mark_dead(std::span<const int> ranks, std::vector<char>& dead) {
  for (const int d : ranks)
    if (d > 0 && static_cast<std::size_t>(d) < dead.size()) dead[static_cast<std::size_t>(d)] = 1;
}

}  // namespace gossip::detail::rendezvous

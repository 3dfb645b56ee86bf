// The UCX transport's rendezvous entries (transports/ucx/peer_blob.hpp):
// what another rank published for this one to connect to it.
//
// Input: byte 0 picks the mode. Even: the rest is an entry as another rank
// put it in the store; decoded, then encoded again and decoded once more.
// Odd: the rest describes a setup (FuzzedDataProvider) that is encoded and
// decoded, and then cut short and altered.
// Checked besides memory safety: an accepted entry's listener address fits
// the sockaddr_storage it is copied into (as lifecycle.cpp does), its fields
// survive encode -> decode unchanged, its encoding is no longer than the
// bytes it came from, and with whole ints in its rank lists and nothing
// behind it, is those bytes; an entry encoded from a setup decodes to that
// setup, every shorter prefix of it and a wrong magic are refused.
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "peer_blob.hpp"

namespace ub = gossip::detail::ucx_blob;

namespace {

[[noreturn]] void fail() { std::abort(); }

bool same(const ub::peer_blob& a, const ub::peer_blob& b) {
  return a.rank == b.rank && a.world == b.world && a.config_fp == b.config_fp && a.layout_fp == b.layout_fp && a.model_fp == b.model_fp &&
         a.message_bytes == b.message_bytes && a.config_settings == b.config_settings && a.sources == b.sources && a.targets == b.targets &&
         a.layout == b.layout && a.address == b.address && a.listener == b.listener && a.host == b.host;
}

gossip::transport_setup setup_of(const ub::peer_blob& p) {
  gossip::transport_setup s;
  s.rank = p.rank;
  s.world = p.world;
  s.config_fingerprint = p.config_fp;
  s.layout_fingerprint = p.layout_fp;
  s.model_fingerprint = p.model_fp;
  s.message_bytes = static_cast<std::size_t>(p.message_bytes);
  s.sources = p.sources;
  s.targets = p.targets;
  s.layout = p.layout;
  s.config_settings = p.config_settings;
  return s;
}

ub::blob encode(const ub::peer_blob& p) {
  return ub::encode(setup_of(p), p.address.data(), p.address.size(), p.listener.data(), p.listener.size(), p.host);
}

// What lifecycle.cpp does with an accepted entry's listener.
void use(const ub::peer_blob& p) {
  if (p.listener.size() > sizeof(sockaddr_storage)) fail();
  sockaddr_storage remote{};
  if (!p.listener.empty()) std::memcpy(&remote, p.listener.data(), p.listener.size());
}

void from_store(const ub::blob& b) {
  const auto p = ub::decode(b);
  if (!p) return;
  use(*p);
  const auto again = encode(*p);
  if (again.size() > b.size()) fail();
  const auto q = ub::decode(again);
  if (!q || !same(*p, *q)) fail();
  // The bytes of the rank lists are whole ints: the encoding is the entry itself, up to what lies behind it.
  std::uint64_t n_sources = 0, n_targets = 0;
  std::memcpy(&n_sources, b.data() + 44, 8);  // after magic, rank, world and four u64
  std::memcpy(&n_targets, b.data() + 52 + n_sources, 8);
  if (n_sources % sizeof(int) == 0 && n_targets % sizeof(int) == 0 && std::memcmp(again.data(), b.data(), again.size()) != 0) fail();
}

std::vector<std::byte> bytes(FuzzedDataProvider& in, std::size_t max) {
  const auto v = in.ConsumeBytes<std::uint8_t>(in.ConsumeIntegralInRange<std::size_t>(0, max));
  std::vector<std::byte> out(v.size());
  if (!v.empty()) std::memcpy(out.data(), v.data(), v.size());
  return out;
}

void from_setup(FuzzedDataProvider& in) {
  ub::peer_blob p;
  p.rank = in.ConsumeIntegral<int>();
  p.world = in.ConsumeIntegral<int>();
  p.config_fp = in.ConsumeIntegral<std::uint64_t>();
  p.layout_fp = in.ConsumeIntegral<std::uint64_t>();
  p.model_fp = in.ConsumeIntegral<std::uint64_t>();
  p.message_bytes = in.ConsumeIntegral<std::uint64_t>();
  for (auto* list : {&p.sources, &p.targets}) {
    const auto n = in.ConsumeIntegralInRange<std::size_t>(0, 16);
    for (std::size_t i = 0; i < n; ++i) list->push_back(in.ConsumeIntegral<int>());
  }
  const auto tensors = in.ConsumeIntegralInRange<std::size_t>(0, 8);
  for (std::size_t i = 0; i < tensors; ++i) {
    gossip::layout_entry e;
    e.name = in.ConsumeRandomLengthString(64);
    e.count = in.ConsumeIntegral<std::size_t>();
    e.dtype = static_cast<gossip::dtype>(in.ConsumeIntegral<std::uint8_t>());
    e.rows = in.ConsumeIntegral<std::size_t>();
    p.layout.push_back(std::move(e));
  }
  p.address = bytes(in, 512);
  p.listener = bytes(in, sizeof(sockaddr_storage));
  p.host = in.ConsumeRandomLengthString(256);
  p.config_settings = in.ConsumeRandomLengthString(1024);
  const auto b = encode(p);
  const auto q = ub::decode(b);
  if (!q || !same(p, *q)) fail();
  use(*q);
  // Any prefix is refused (every field is read), as is another magic.
  const auto cut = in.ConsumeIntegralInRange<std::size_t>(0, b.size() - 1);
  if (ub::decode(ub::blob(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(cut)))) fail();
  auto wrong = b;
  wrong[in.ConsumeIntegralInRange<std::size_t>(0, 3)] ^= std::byte{1};
  if (ub::decode(wrong)) fail();
  // Bytes behind an entry are ignored.
  auto longer = b;
  longer.push_back(std::byte{0x5a});
  const auto r = ub::decode(longer);
  if (!r || !same(p, *r)) fail();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  if (data[0] & 1) {
    FuzzedDataProvider in(data + 1, size - 1);
    from_setup(in);
    return 0;
  }
  // The entry in a buffer of its own size, as the rendezvous hands it over.
  ub::blob b(size - 1);
  if (!b.empty()) std::memcpy(b.data(), data + 1, b.size());
  from_store(b);
  return 0;
}

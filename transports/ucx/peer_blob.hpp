#pragma once
/// What a UCX rank publishes at the rendezvous for the others to connect to
/// it, and how it reads theirs: its rank, world, fingerprints, topology
/// neighbours, model layout, worker and listener addresses, host and
/// settings. Free of UCX headers, so that the fuzzer
/// (fuzz/fuzz_ucx_blob.cpp) decodes entries without a worker: another rank's
/// entry is never trusted.
///
///     const auto blob = gossip::detail::ucx_blob::encode(setup, address, address_len, listener, listener_len, host);
///     if (const auto p = gossip::detail::ucx_blob::decode(blob)) connect_to(p->address);
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "gossip/model.hpp"
#include "gossip/transport.hpp"

namespace gossip::detail::ucx_blob {

using blob = std::vector<std::byte>;  // bootstrap::blob

inline constexpr std::uint32_t magic = 0x35435547;  // "GUC5": since it carries the listener's address (GUC4: the goodbye's unmerged weight)

// Little serialiser for the rendezvous blob.
struct writer {
  blob b;
  template <class T>
  void pod(const T& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    b.insert(b.end(), p, p + sizeof v);
  }
  void bytes(const void* p, std::size_t n) {
    pod<std::uint64_t>(n);
    const auto* q = static_cast<const std::byte*>(p);
    b.insert(b.end(), q, q + n);
  }
};
struct reader {
  const blob& b;
  std::size_t at = 0;
  bool ok = true;
  template <class T>
  T pod() {
    T v{};
    if (at + sizeof v > b.size()) {
      ok = false;
      return v;
    }
    std::memcpy(&v, b.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  std::vector<std::byte> bytes() {
    const auto n = pod<std::uint64_t>();
    if (!ok || n > b.size() - at) {
      ok = false;
      return {};
    }
    std::vector<std::byte> v(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
    return v;
  }
};

struct peer_blob {
  int rank = -1, world = 0;
  std::uint64_t config_fp = 0, layout_fp = 0, model_fp = 0, message_bytes = 0;
  std::string config_settings;
  std::vector<int> sources, targets;
  model_layout layout;
  std::vector<std::byte> address;
  std::vector<std::byte> listener;  // its listener's sockaddr (at most a sockaddr_storage); empty: it does not listen
  std::string host;
};

inline blob encode(const transport_setup& s, const void* address, std::size_t address_len, const void* listener, std::size_t listener_len,
                   const std::string& host) {
  writer w;
  w.pod(magic);
  w.pod<std::int32_t>(s.rank);
  w.pod<std::int32_t>(s.world);
  w.pod(s.config_fingerprint);
  w.pod(s.layout_fingerprint);
  w.pod(s.model_fingerprint);
  w.pod<std::uint64_t>(s.message_bytes);
  w.bytes(s.sources.data(), s.sources.size() * sizeof(int));
  w.bytes(s.targets.data(), s.targets.size() * sizeof(int));
  w.pod<std::uint64_t>(s.layout.size());
  for (const auto& e : s.layout) {
    w.bytes(e.name.data(), e.name.size());
    w.pod<std::uint64_t>(e.count);
    w.pod(static_cast<std::uint8_t>(e.dtype));
    w.pod<std::uint64_t>(e.rows);
  }
  w.bytes(address, address_len);
  w.bytes(listener, listener_len);
  w.bytes(host.data(), host.size());
  w.bytes(s.config_settings.data(), s.config_settings.size());
  return std::move(w.b);
}

inline std::vector<int> ints(const std::vector<std::byte>& v) {
  std::vector<int> out(v.size() / sizeof(int));
  if (!out.empty()) std::memcpy(out.data(), v.data(), out.size() * sizeof(int));  // an empty list has no data()
  return out;
}

/// The entry, or nothing when it is not one (another magic, cut short, or a
/// listener address larger than a sockaddr_storage).
inline std::optional<peer_blob> decode(const blob& b) {
  reader r{b};
  peer_blob p;
  if (r.pod<std::uint32_t>() != magic) return std::nullopt;
  p.rank = r.pod<std::int32_t>();
  p.world = r.pod<std::int32_t>();
  p.config_fp = r.pod<std::uint64_t>();
  p.layout_fp = r.pod<std::uint64_t>();
  p.model_fp = r.pod<std::uint64_t>();
  p.message_bytes = r.pod<std::uint64_t>();
  p.sources = ints(r.bytes());
  p.targets = ints(r.bytes());
  const auto n = r.pod<std::uint64_t>();
  for (std::uint64_t i = 0; r.ok && i < n; ++i) {
    const auto name = r.bytes();
    layout_entry e;
    e.name.assign(reinterpret_cast<const char*>(name.data()), name.size());
    e.count = r.pod<std::uint64_t>();
    e.dtype = static_cast<gossip::dtype>(r.pod<std::uint8_t>());
    e.rows = r.pod<std::uint64_t>();
    p.layout.push_back(std::move(e));
  }
  p.address = r.bytes();
  p.listener = r.bytes();
  if (p.listener.size() > sizeof(sockaddr_storage)) return std::nullopt;
  const auto host = r.bytes();
  p.host.assign(reinterpret_cast<const char*>(host.data()), host.size());
  const auto settings = r.bytes();
  p.config_settings.assign(reinterpret_cast<const char*>(settings.data()), settings.size());
  if (!r.ok) return std::nullopt;
  return p;
}

}  // namespace gossip::detail::ucx_blob

#pragma once
/// Statistics of a switch process (ports + aggregator) as JSON and as text.
///
///     gossip::sw::switch_report r{.program = "gossip-switch-udp", .groups = cfgs, .agg = agg.stats()};
///     r.ports.push_back({.name = "udp0", .rx_packets = n});
///     std::fputs(r.text().c_str(), stderr);
///     r.write_json("stats.json");
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "aggregator.hpp"
#include "output_file.hpp"

namespace gossip::sw {

struct port_counters {
  std::string name;
  std::uint64_t rx_packets = 0, tx_packets = 0, rx_bytes = 0, tx_bytes = 0, rx_missed = 0, tx_failed = 0;
};

struct switch_report {
  std::string program;
  std::vector<group_config> groups;
  std::vector<port_counters> ports;
  aggregator_stats agg;
  std::uint64_t arp_replies = 0;
  double seconds = 0;

  std::string json() const {
    std::string s = fmt::format("{{\n  \"program\": \"{}\",\n  \"seconds\": {:.3f},\n  \"groups\": [", program, seconds);
    for (std::size_t i = 0; i < groups.size(); ++i) {
      const auto& g = groups[i];
      // slots are sync's shadow-copy slots, idle_s async's eviction: each is null in the other mode.
      const bool sync = g.mode == group_mode::sync;
      s += fmt::format("{}{{\"id\": {}, \"mode\": \"{}\", \"members\": {}, \"chunk\": {}, \"slots\": {}, \"elements\": {}, \"idle_s\": {}}}", i ? ", " : "",
                       g.id, to_string(g.mode), g.members, g.chunk, sync ? fmt::format("{}", g.slots) : "null", g.elements,
                       sync ? "null" : fmt::format("{}", g.idle_s));
    }
    s += "],\n  \"ports\": [";
    for (std::size_t i = 0; i < ports.size(); ++i) {
      const auto& p = ports[i];
      s += fmt::format("{}\n    {{\"name\": \"{}\", \"rx_packets\": {}, \"tx_packets\": {}, \"rx_bytes\": {}, \"tx_bytes\": {}, \"rx_missed\": {}, "
                       "\"tx_failed\": {}}}",
                       i ? "," : "", p.name, p.rx_packets, p.tx_packets, p.rx_bytes, p.tx_bytes, p.rx_missed, p.tx_failed);
    }
    s += "],\n  \"drops\": {";
    bool first = true;
    for (std::size_t i = 1; i < drop_reason_count; ++i) {
      s += fmt::format("{}\"{}\": {}", first ? "" : ", ", to_string(static_cast<drop_reason>(i)), agg.drops[i]);
      first = false;
    }
    s += fmt::format("}},\n  \"dropped\": {},\n  \"accepted\": {},\n  \"aggregations_completed\": {},\n  \"results_resent\": {},\n"
                     "  \"retransmissions_seen\": {},\n  \"pending_answered\": {},\n  \"deltas_applied\": {},\n  \"replies\": {},\n  \"evictions\": {},\n"
                     "  \"arp_replies\": {}\n}}\n",
                     agg.dropped(), agg.accepted(), agg.aggregations_completed, agg.results_resent, agg.retransmissions_seen,
                     agg.pending_answered, agg.deltas_applied, agg.replies, agg.evictions, arp_replies);
    return s;
  }

  std::string text() const {
    std::string s = fmt::format("{} statistics after {:.1f} s\n", program, seconds);
    s += fmt::format("  {:<16} {:>12} {:>12} {:>14} {:>14} {:>10} {:>10}\n", "port", "rx-pkts", "tx-pkts", "rx-bytes", "tx-bytes", "rx-missed",
                     "tx-failed");
    for (const auto& p : ports)
      s += fmt::format("  {:<16} {:>12} {:>12} {:>14} {:>14} {:>10} {:>10}\n", p.name, p.rx_packets, p.tx_packets, p.rx_bytes, p.tx_bytes,
                       p.rx_missed, p.tx_failed);
    s += fmt::format("  accepted {}  aggregations completed {}  deltas applied {}  retransmissions seen {}  results resent {}  pending answered {}  "
                     "replies {}  evictions {}{}\n",
                     agg.accepted(), agg.aggregations_completed, agg.deltas_applied, agg.retransmissions_seen, agg.results_resent,
                     agg.pending_answered, agg.replies,
                     agg.evictions, arp_replies ? fmt::format("  arp replies {}", arp_replies) : std::string());
    s += fmt::format("  dropped {}", agg.dropped());
    for (std::size_t i = 1; i < drop_reason_count; ++i)
      if (agg.drops[i]) s += fmt::format("  {} {}", to_string(static_cast<drop_reason>(i)), agg.drops[i]);
    s += "\n";
    return s;
  }

  /// Writes the JSON whole or not at all (out::write_file_whole: a full disk
  /// leaves the earlier file). False (errno set) if it could not.
  bool write_json(const std::string& path) const {
    if (path.empty()) return false;
    const int e = out::write_file_whole(path, json());
    errno = e;
    return e == 0;
  }
};

}  // namespace gossip::sw

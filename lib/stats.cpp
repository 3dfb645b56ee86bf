// JSON report and Chrome-trace output.
#include "gossip/stats.hpp"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gossip/error.hpp"

namespace gossip {
namespace {

std::string expand_rank(std::string path, int rank) {
  for (auto pos = path.find("{rank}"); pos != std::string::npos; pos = path.find("{rank}"))
    path.replace(pos, 6, std::to_string(rank));
  return path;
}

}  // namespace

void check_output_path(const std::string& path, int rank, int world, std::string_view key, std::string_view where) {
  if (path.empty()) return;
  // "[engine] stats = "x"", or the origin of a value set elsewhere: "--set engine.stats=x: stats = "x"".
  const std::string what = where == "[engine]" ? fmt::format("[engine] {} = \"{}\"", key, path) : fmt::format("{}: {} = \"{}\"", where, key, path);
  if (world > 1 && path.find("{rank}") == std::string::npos)
    throw config_error(fmt::format("{}: every one of the {} ranks would write this one file; put {{rank}} in the path, e.g. \"{}-{{rank}}.json\"",
                                   what, world, key));
  namespace fs = std::filesystem;
  const fs::path p(expand_rank(path, rank));
  if (std::error_code ec; fs::is_directory(p, ec))
    throw config_error(fmt::format("{}: {} is a directory; give the path of a file, e.g. \"{}/{}-{{rank}}.json\"", what, p.string(), p.string(), key));
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  if (std::error_code ec; !fs::is_directory(dir, ec) || ::access(dir.c_str(), W_OK) != 0)
    throw config_error(fmt::format("{}: the directory {} does not exist or is not writable; create it or change the path", what, dir.string()));
}

bool same_output_file(const std::string& a, const std::string& b, int rank) {
  if (a.empty() || b.empty()) return false;
  namespace fs = std::filesystem;
  // "./x.json", "dir/../x.json" and a link to the directory name one file.
  const auto resolved = [&](const std::string& path) {
    std::error_code ec;
    fs::path p = fs::absolute(expand_rank(path, rank), ec);
    if (ec) return fs::path(expand_rank(path, rank)).lexically_normal();
    fs::path c = fs::weakly_canonical(p, ec);
    return ec ? p.lexically_normal() : c;
  };
  return resolved(a) == resolved(b);
}

namespace {

void write_text(const std::string& path, const std::string& text, const char* what) {
  std::ofstream out(path);
  if (!out) throw error(fmt::format("cannot write the {} to '{}' (does the directory exist and is it writable?)", what, path));
  out << text << '\n';
  out.close();  // a short text sits in the stream's buffer until here: this is where a full disk shows
  if (!out) throw error(fmt::format("writing the {} to '{}' failed (disk full?)", what, path));
}

}  // namespace

// The per-peer, per-tensor and per-death records, field by field under their own names.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(peer_stats, rank, bytes_sent, bytes_raw, messages_sent, bytes_received, messages_received, dropped, dead,
                                   shared_start, weight_sent, weight_unconfirmed, last_weight_sent, last_weight_received)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(tensor_stats, name, bytes_sent, bytes_raw, last_diff_sq, max_relative)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(dead_peer, rank, step, seconds, weight_refunded, weight_unconfirmed, weight_estimate)

std::string engine_stats::to_json(int indent) const {
  nlohmann::json j;
  j["rank"] = rank;
  j["world"] = world;
  j["policy"] = policy;
  j["topology"] = topology;
  j["protocol"] = protocol;
  j["transport"] = transport;
  j["momentum"] = momentum;
  if (!momentum_merge.empty()) j["momentum_merge"] = momentum_merge;
  j["steps"] = steps;
  j["sends"] = sends;
  j["finish_rounds"] = finish_rounds;
  j["skips"] = skips;
  nlohmann::json reasons = nlohmann::json::object();
  for (std::size_t i = 0; i < by_reason.size(); ++i)
    if (by_reason[i]) reasons[to_string(static_cast<reason>(i))] = by_reason[i];
  j["decisions"] = reasons;
  j["send_busy"] = send_busy;
  j["no_live_peer"] = no_live_peer;
  j["codec"] = codec;
  j["device"] = device;
  j["bytes_sent"] = bytes_sent;
  j["bytes_raw"] = bytes_raw;
  j["messages_sent"] = messages_sent;
  j["bytes_received"] = bytes_received;
  j["messages_received"] = messages_received;
  j["dropped"] = dropped;
  j["transport_rejoins"] = transport_rejoins;
  j["transport_dropped"] = transport_dropped;
  j["codec_resyncs"] = codec_resyncs;
  j["codec_resync_skipped"] = codec_resync_skipped;
  j["relative_drift"] = {{"last", relative_drift_last},
                         {"max", relative_drift_max},
                         {"mean_at_send", relative_drift_at_send_count ? relative_drift_at_send_sum / static_cast<double>(relative_drift_at_send_count) : 0.0}};
  j["weight"] = weight;
  j["step_seconds"] = step_seconds;
  j["wait_seconds"] = wait_seconds;
  j["busy_wait_seconds"] = busy_wait_seconds;
  j["lead_waits"] = lead_waits;
  j["lead_wait_seconds"] = lead_wait_seconds;
  j["lead_timeouts"] = lead_timeouts;
  j["backlog_waits"] = backlog_waits;
  j["backlog_wait_seconds"] = backlog_wait_seconds;
  j["step_beacons"] = step_beacons;
  j["merge_age"] = merge_age;
  j["peers"] = peers;
  j["tensors"] = tensors;
  j["dead_peers"] = dead_peers;
  j["lr_mean_at_send"] = sends ? lr_at_send_sum / static_cast<double>(sends) : 0.0;
  j["weight_range"] = {weight_min, weight_max};
  j["consensus_estimate"] = {{"last", consensus_last},
                             {"mean", consensus_steps ? consensus_sum / static_cast<double>(consensus_steps) : 0.0},
                             {"steps", consensus_steps}};
  j["sends_per_window"] = {{"window_steps", send_window_steps}, {"sends", sends_per_window}};
  j["dead"] = dead;
  j["lost_weight"] = lost_weight;
  // Tensor and peer names come from the user: bytes that are not UTF-8 become U+FFFD rather than an exception at finish().
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

void engine_stats::count_send_window(std::uint64_t step) noexcept {
  if (sends_per_window.capacity() < send_window_capacity) return;  // not prepared by an engine
  std::uint64_t w = step / send_window_steps;
  while (w >= send_window_capacity) {  // fold pairs of windows: the window doubles
    const std::size_t n = sends_per_window.size();
    for (std::size_t i = 0; i < n; ++i) sends_per_window[i / 2] = (i % 2 ? sends_per_window[i / 2] : 0) + sends_per_window[i];
    sends_per_window.resize((n + 1) / 2);
    send_window_steps *= 2;
    w = step / send_window_steps;
  }
  if (sends_per_window.size() <= w) sends_per_window.resize(w + 1, 0);  // within the reserved capacity
  ++sends_per_window[w];
}

void write_stats_file(const std::string& path, const engine_stats& stats) {
  write_text(expand_rank(path, stats.rank), stats.to_json(), "stats report");
}

void write_chrome_trace(const std::string& path, int rank, const std::vector<trace_event>& events, std::string_view codec,
                        double start_unix_us) {
  nlohmann::json list = nlohmann::json::array();
  list.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", rank}, {"args", {{"name", fmt::format("rank {}", rank)}}}});
  for (const auto& e : events) {
    nlohmann::json ev = {{"name", e.sent ? "send" : "skip"},
                         {"cat", "decision"},
                         {"pid", 0},
                         {"tid", rank},
                         {"ts", start_unix_us + e.t_us},
                         {"args",
                          {{"step", e.step},
                           {"reason", to_string(e.why)},
                           {"outcome", to_string(e.outcome)},
                           {"value", e.value},
                           {"threshold", e.threshold},
                           {"targets", e.targets},
                           {"bytes", e.bytes},
                           {"lr", e.lr},
                           {"weight", e.weight},
                           {"consensus", std::isnan(e.consensus) ? nlohmann::json() : nlohmann::json(e.consensus)}}}};
    if (e.sent) {
      ev["args"]["codec"] = codec;
      ev["args"]["ratio"] = e.bytes_raw ? static_cast<double>(e.bytes) / static_cast<double>(e.bytes_raw) : 1.0;
      ev["ph"] = "X";
      ev["dur"] = e.dur_us;
    } else {
      ev["ph"] = "i";
      ev["s"] = "t";
    }
    list.push_back(std::move(ev));
  }
  const nlohmann::json trace = {{"traceEvents", std::move(list)},
                                {"displayTimeUnit", "ms"},
                                {"otherData", {{"rank", rank}, {"start_unix_us", start_unix_us}}}};
  write_text(expand_rank(path, rank), trace.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), "trace");
}

}  // namespace gossip

// bench/transport, the report: the step-cost table, the summary and
// transport.json, and the check of a transport.json that --smoke and --check run.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "../output.hpp"
#include "transport_bench.hpp"

namespace transport_bench {

using gossip::error;

double load_average() {
  std::ifstream in("/proc/loadavg");
  double l = -1;
  in >> l;
  return l;
}

std::string write_report(const settings& s, const results& r) {
  fmt::print("\nstep cost: engine.step() with policy `never` over ucx_transport (2 ranks stepping together, default settings:\n"
             "  [engine] max_lead = 4) against gossip::drift_pass over the same model and x-hat alone, timed alternately in one\n"
             "  loop; medians of {} steps. unpaced: the step less the time it waited for the other rank (max_lead holds the\n"
             "  faster rank to the slower one's pace); waits: steps that waited; beacons: step beacons sent; quiet: the median\n"
             "  of the steps that did not wait over the median of their drift passes (a wait lets the other rank evict this\n"
             "  one's model from a shared cache, which the step's pass pays for after it).\n\n",
             s.steps);
  fmt::print("{:<11} {:>5} {:>10} {:>8} {:>10} {:>10} {:>7} {:>8} {:>6} {:>8} {:>7}\n", "UCX_TLS", "rank", "elements", "MiB", "step us",
             "drift us", "ratio", "unpaced", "waits", "beacons", "quiet");
  for (const auto& c : r.step_cost) {
    const auto q = c.find("ratio_quiet");
    fmt::print("{:<11} {:>5} {:>10} {:>8.1f} {:>10.1f} {:>10.1f} {:>7.3f} {:>8.3f} {:>6} {:>8} {:>7}\n", c["tls"].get<std::string>(),
               c["rank"].get<int>(), c["elements"].get<std::size_t>(),
               static_cast<double>(c["elements"].get<std::size_t>() * sizeof(float)) / mib, c["step_us"].get<double>(),
               c["drift_us"].get<double>(), c["ratio"].get<double>(), c.value("ratio_unpaced", 0.0), c.value("lead_waits", 0ull),
               c.value("step_beacons", 0ull), q != c.end() && q->is_number() ? fmt::format("{:.3f}", q->get<double>()) : std::string("-"));
  }

  // The summary: the weakest ratio at 1 MiB and above, per UCX_TLS.
  json summary = json::object();
  if (!r.perftest_exe.empty()) {
    fmt::print("\n");
    for (const auto& tls : s.tls) {
      double worst = 1e300;
      std::size_t at = 0;
      for (const auto& run : r.runs)
        if (run["tls"] == tls && run["bytes"].get<std::size_t>() >= (1u << 20) && run["ratio"].get<double>() < worst) {
          worst = run["ratio"].get<double>();
          at = run["bytes"].get<std::size_t>();
        }
      // Every size: the weakest best-of and median ratios, and what the transport holds per peer.
      double worst_best = 1e300, worst_median = 1e300;
      std::size_t at_best = 0, at_median = 0, held = 0;
      for (const auto& run : r.runs) {
        if (run["tls"] != tls) continue;
        held = std::max(held, run.value("transport_bytes_per_peer", std::size_t{0}));
        if (run["ratio"].get<double>() < worst_best) worst_best = run["ratio"].get<double>(), at_best = run["bytes"].get<std::size_t>();
        if (run["median_ratio"].get<double>() < worst_median)
          worst_median = run["median_ratio"].get<double>(), at_median = run["bytes"].get<std::size_t>();
      }
      if (at_best != 0) {
        summary[tls] = {{"min_ratio", worst_best}, {"min_ratio_at_bytes", at_best}, {"min_median_ratio", worst_median},
                        {"min_median_ratio_at_bytes", at_median}, {"transport_bytes_per_peer", held}};
        fmt::print("UCX_TLS={}: lowest ratio {:.3f} ({}), lowest median ratio {:.3f} ({}); the transport holds {:.1f} KiB per peer\n", tls,
                   worst_best, size_name(at_best), worst_median, size_name(at_median), static_cast<double>(held) / 1024);
      }
      if (at == 0) continue;
      summary[tls]["min_ratio_ge_1mib"] = worst;
      summary[tls]["at_bytes"] = at;
      fmt::print("UCX_TLS={}: lowest gossip/perftest ratio at >= 1 MiB: {:.3f} ({}){}\n", tls, worst, size_name(at),
                 worst < 0.9 ? "  < 0.9" : "");
    }
  }
  double worst_step = 0, worst_unpaced = 0, worst_quiet = 0;
  for (const auto& c : r.step_cost) {
    worst_step = std::max(worst_step, c["ratio"].get<double>());
    worst_unpaced = std::max(worst_unpaced, c.value("ratio_unpaced", 0.0));
    if (const auto q = c.find("ratio_quiet"); q != c.end() && q->is_number()) worst_quiet = std::max(worst_quiet, q->get<double>());
  }
  summary["max_step_ratio"] = worst_step;
  summary["max_step_ratio_unpaced"] = worst_unpaced;
  summary["max_step_ratio_quiet"] = worst_quiet;
  fmt::print("highest step / drift ratio: {:.3f} (less the waits for the other rank: {:.3f}; steps that did not wait: {:.3f})\n", worst_step,
             worst_unpaced, worst_quiet);

  const double elapsed = std::chrono::duration<double>(clock_type::now() - r.started).count();
  json report{{"bench", "transport"},
              {"perftest", r.perftest_exe.empty() ? "unavailable" : "ucx_perftest -t " + s.perftest_test},
              {"definition",
               {{"gossip_gbps", "payload bytes N*S / seconds at the receiver, from consuming the last warm-up message to consuming "
                                "the last timed one; 1 GB = 1e9 bytes; best of reps"},
                {"perftest_gbps", "ucx_perftest (see perftest) final 'average' bandwidth (MB/s, MB = 2^20 bytes) * 2^20 / 1e9; best of reps"},
                {"ratio", "gossip_gbps / perftest_gbps (best / best); median_ratio: median / median"},
                {"transport_bytes_per_peer", "ucx_transport::held_bytes_per_peer() at the sender: staging buffers and send "
                                             "bookkeeping per target peer (the inbox slots, the engine's, not counted)"},
                {"perftest_eh_gbps", "the same with ucx_perftest -e (endpoints with peer error handling, as ucx_transport creates them; "
                                     "UCX_POSIX_ERROR_HANDLING=y as it sets); ratio_eh = gossip_gbps / perftest_eh_gbps"},
                {"step_cost", "medians over steps of engine.step() (policy never, default settings) and of drift_pass over the same "
                              "model, alternated; unpaced_us: median of each step less the time it waited for the other rank "
                              "(max_lead); ratio_unpaced = unpaced_us / drift_us; ratio_quiet: median of the quiet_steps steps "
                              "that did not wait over the median of their drift passes (null when every step waited)"}}},
              {"settings",
               {{"tls", s.tls},
                {"reps", s.reps},
                {"bytes_per_run", s.bytes_per_run},
                {"warmup", s.warmup},
                {"send_buffers", s.send_buffers},
                {"inbox_depth", s.depth},
                {"backlog", s.backlog},
                {"connect", s.connect},
                {"wait", s.wait},
                {"cpus", s.cpus},
                {"steps", s.steps}}},
              {"runs", r.runs},
              {"step_cost", r.step_cost},
              {"summary", summary},
              {"load_average", {{"before", r.load_before}, {"after", load_average()}, {"cpus", r.cpus}}},
              {"seconds", elapsed}};
  gossip::bench::prepare_out_dir(s.out);
  const std::string path = (std::filesystem::path(s.out) / "transport.json").string();
  gossip::bench::write_file(path, report.dump(2));
  fmt::print("wrote {} ({:.0f} s)\n", path, elapsed);
  return path;
}

std::vector<std::string> check_report(const json& j) {
  std::vector<std::string> bad;
  const auto positive = [](const json& v) { return v.is_number() && v.get<double>() > 0 && std::isfinite(v.get<double>()); };
  if (!j.contains("runs") || !j["runs"].is_array() || j["runs"].empty()) bad.push_back("'runs' is missing or empty");
  const bool have_perftest = j.value("perftest", std::string()) != "unavailable";
  for (const auto& r : j.value("runs", json::array())) {
    const std::string id = fmt::format("run {}/{}", r.value("tls", std::string("?")), r.value("bytes", 0ull));
    for (const char* k : {"tls", "bytes", "gossip_gbps", "perftest_gbps", "ratio"})
      if (!r.contains(k)) bad.push_back(fmt::format("{}: no '{}'", id, k));
    if (!r.contains("gossip_gbps") || !positive(r["gossip_gbps"])) bad.push_back(id + ": gossip_gbps is not a positive number");
    if (have_perftest) {
      if (!r.contains("perftest_gbps") || !positive(r["perftest_gbps"])) bad.push_back(id + ": perftest_gbps is not a positive number");
      if (!r.contains("ratio") || !positive(r["ratio"]))
        bad.push_back(id + ": ratio is not a positive number");
      else if (r.contains("gossip_gbps") && positive(r["gossip_gbps"]) && r.contains("perftest_gbps") && positive(r["perftest_gbps"]) &&
               std::abs(r["ratio"].get<double>() - r["gossip_gbps"].get<double>() / r["perftest_gbps"].get<double>()) > 1e-6 * r["ratio"].get<double>())
        bad.push_back(id + ": ratio != gossip_gbps / perftest_gbps");
    }
    if (!r.value("verified", false)) bad.push_back(id + ": payloads not verified");
  }
  if (!j.contains("step_cost") || !j["step_cost"].is_array() || j["step_cost"].empty()) bad.push_back("'step_cost' is missing or empty");
  for (const auto& c : j.value("step_cost", json::array())) {
    const std::string id = fmt::format("step_cost {}", c.value("elements", 0ull));
    for (const char* k : {"elements", "step_us", "drift_us", "ratio", "unpaced_us", "ratio_unpaced"})
      if (!c.contains(k) || !positive(c[k])) bad.push_back(fmt::format("{}: '{}' is not a positive number", id, k));
    if (bad.empty() && std::abs(c["ratio"].get<double>() - c["step_us"].get<double>() / c["drift_us"].get<double>()) > 1e-6 * c["ratio"].get<double>())
      bad.push_back(id + ": ratio != step_us / drift_us");
  }
  return bad;
}

int check_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    fmt::print(stderr, "bench/transport: cannot read {}\n", path);
    return 1;
  }
  json j;
  try {
    j = json::parse(in);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench/transport: {} is not JSON: {}\n", path, e.what());
    return 1;
  }
  std::vector<std::string> bad;
  try {
    bad = check_report(j);
  } catch (const json::exception& e) {  // a field of another type than a report has (an array for the whole, a number for tls…)
    bad = {fmt::format("not a transport report: {}", e.what())};
  }
  for (const auto& b : bad) fmt::print(stderr, "bench/transport: {}: {}\n", path, b);
  if (bad.empty()) fmt::print("{}: {} runs and {} step-cost entries, all well formed\n", path, j["runs"].size(), j["step_cost"].size());
  return bad.empty() ? 0 : 1;
}

}  // namespace transport_bench

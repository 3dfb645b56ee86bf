// bench/traffic — the founding experiment: how much traffic does drift-triggered
// gossip save at equal accuracy, and does it beat a fixed period that sends the
// same bytes?
//
// For each seed, the same schedule and data: `never` (local SGD, a control),
// `periodic` every step (the gossip-SGD baseline), the adaptive policy of the
// config, and `periodic` at the period that sends about the adaptive run's
// bytes (the equal-traffic control). Prints a table, writes JSON and a PNG.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/trainer.hpp"

namespace {

using namespace gossip;

struct run_row {
  std::string role, policy;
  nlohmann::json options;
  std::uint64_t seed = 0, bytes_sent = 0, messages = 0;
  double accuracy = 0, local_accuracy_mean = 0, wall_s = 0;
};

nlohmann::json options_json(const options& o) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : o.values())
    std::visit([&](const auto& x) { j[k] = x; }, v);
  return j;
}

const std::vector<option_spec>& bench_specs() {
  static const std::vector<option_spec> specs = {
      {"seeds", std::int64_t{3}, "seeds per policy"},
      {"quick_epochs", std::int64_t{2}, "epochs in --quick mode"},
      {"quick_train_limit", std::int64_t{0}, "training samples in --quick mode (0: all)"},
  };
  return specs;
}

// One run as real processes: gossip-run starts `workers` ranks of the
// Fashion-MNIST example with the bench's config and this run's policy and
// seed; rank 0 writes the report.
nlohmann::json run_processes(const std::string& config_path, const std::vector<std::string>& overrides, const component_config& policy,
                             const examples::train_settings& s, const std::string& out_dir) {
#if defined(GOSSIP_RUN_PATH) && defined(GOSSIP_FASHION_MNIST_PATH)
  const auto report = std::filesystem::absolute(std::filesystem::path(out_dir) / "run.json").string();
  std::filesystem::remove(report);
  std::string cmd = fmt::format("'{}' -n {} --config '{}' -- '{}'", GOSSIP_RUN_PATH, s.workers, config_path, GOSSIP_FASHION_MNIST_PATH);
  auto set = [&](const std::string& kv) { cmd += fmt::format(" --set '{}'", kv); };
  for (const auto& o : overrides) set(o);
  set("policy.name=" + policy.name);
  for (const auto& [k, v] : policy.opts.values()) set(fmt::format("policy.{}={}", k, to_string(v)));
  set(fmt::format("train.seed={}", s.seed));
  set(fmt::format("train.epochs={}", s.epochs));
  set(fmt::format("train.train_limit={}", s.train_limit));
  cmd += fmt::format(" --json '{}' > '{}/run.log' 2>&1", report, out_dir);
  if (std::system(cmd.c_str()) != 0 || !std::filesystem::exists(report))
    throw error(fmt::format("a run over processes failed; its output is in {}/run.log (command: {})", out_dir, cmd));
  std::ifstream in(report);
  return nlohmann::json::parse(in);
#else
  (void)config_path, (void)overrides, (void)policy, (void)s, (void)out_dir;
  throw config_error("this bench was built without the Fashion-MNIST example or gossip-run, which runs over processes need");
#endif
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Traffic reduction of drift-triggered gossip on Fashion-MNIST, with the honesty controls."};
  std::string config_path = std::string(GOSSIP_SOURCE_DIR) + "/bench/traffic/traffic.toml";
  std::string out_dir = "results";
  bool quick = false;
  int seeds = 0;
  app.add_option("-c,--config", config_path, "bench config: [policy] is the adaptive policy; [train], [transport], [bench]")->check(CLI::ExistingFile);
  app.add_option("-o,--out", out_dir, "directory for traffic.json and traffic.png");
  app.add_flag("--quick", quick, "fewer epochs (the [bench] quick_* settings): a few minutes on 2 cores");
  app.add_option("--seeds", seeds, "override [bench] seeds")->check(CLI::Range(1, 100));
  std::vector<std::string> overrides;
  app.add_option("--set", overrides, "section.key=value on top of the config, e.g. --set policy.threshold=0.1 --set train.workers=8");
  CLI11_PARSE(app, argc, argv);

  try {
    config_path = std::filesystem::absolute(config_path).string();
    config base = config::load(config_path);
    ::setenv("UCX_NET_DEVICES", "lo", 0);  // the ranks run on this machine
    for (const auto& o : overrides) base.apply_override(o);
    const auto bench = base.section("bench", bench_specs());
    const int n_seeds = seeds ? seeds : static_cast<int>(bench.integer("seeds"));
    auto settings = examples::train_settings::from(base.section("train", examples::train_option_specs()));
    if (quick) {
      settings.epochs = static_cast<int>(bench.integer("quick_epochs"));
      if (bench.integer("quick_train_limit") > 0) settings.train_limit = static_cast<std::size_t>(bench.integer("quick_train_limit"));
    }
    const auto data = examples::datasets::load(settings);
    std::filesystem::create_directories(out_dir);

    fmt::print("bench/traffic: Fashion-MNIST ({} train / {} test), {} workers, {} epochs, batch {}, {} data, topology '{}', "
               "protocol '{}', {} Gbit/s links, {} seed(s){}\n",
               data.train.size(), data.test.size(), settings.workers, settings.epochs, settings.batch, data::to_string(settings.partition),
               base.topology.name, base.protocol.name, base.transport.opts.has("bandwidth_gbps") ? to_string(base.transport.opts.values().at("bandwidth_gbps")) : "unlimited",
               n_seeds, quick ? " (quick)" : "");
    fmt::print("{:<14} {:<34} {:>4} {:>12} {:>9} {:>9} {:>9} {:>8}\n", "role", "policy", "seed", "bytes", "messages", "acc-avg", "acc-local", "wall-s");
    std::fflush(stdout);

    std::vector<run_row> rows;
    auto run = [&](const std::string& role, const component_config& policy, std::uint64_t seed) {
      config cfg = base;
      cfg.policy = policy;
      auto s = settings;
      s.seed = seed;
      const auto resolved = policy.opts.resolved(policy_registry().find(policy.name, policy.opts.where()).specs, "policy '" + policy.name + "'");
      run_row r{role, policy.name, options_json(resolved), seed};
      if (examples::runs_as_processes(cfg)) {
        const auto j = run_processes(config_path, overrides, policy, s, out_dir);
        r.bytes_sent = j.at("bytes_sent");
        r.messages = j.at("messages");
        r.accuracy = j.at("accuracy");
        r.local_accuracy_mean = j.at("local_accuracy_mean");
        r.wall_s = j.at("train_seconds");
      } else {
        const auto rep = examples::train(cfg, s, data);
        r.bytes_sent = rep.bytes_sent;
        r.messages = rep.messages;
        r.accuracy = rep.accuracy;
        r.local_accuracy_mean = rep.local_accuracy_mean;
        r.wall_s = rep.train_seconds;
      }
      std::string label = policy.name;
      for (const auto& [k, v] : resolved.values()) label += fmt::format(" {}={}", k, to_string(v));
      fmt::print("{:<14} {:<34} {:>4} {:>12} {:>9} {:>8.2f}% {:>8.2f}% {:>8.1f}\n", role, label.substr(0, 34), seed, r.bytes_sent, r.messages,
                 100 * r.accuracy, 100 * r.local_accuracy_mean, r.wall_s);
      std::fflush(stdout);
      rows.push_back(r);
      return r;
    };
    auto periodic = [](std::int64_t every) {
      component_config c{"periodic", options("bench [periodic]")};
      c.opts.set("every", every);
      return c;
    };

    std::map<std::string, std::vector<run_row>> by_role;
    for (int i = 0; i < n_seeds; ++i) {
      const auto seed = settings.seed + static_cast<std::uint64_t>(i);
      by_role["never"].push_back(run("never", {"never", options("bench [never]")}, seed));
      by_role["periodic-1"].push_back(run("periodic-1", periodic(1), seed));
      by_role["adaptive"].push_back(run("adaptive", base.policy, seed));
    }
    auto mean = [](const std::vector<run_row>& v, auto field) {
      double s = 0;
      for (const auto& r : v) s += static_cast<double>(r.*field);
      return v.empty() ? 0.0 : s / static_cast<double>(v.size());
    };
    const double bytes_p1 = mean(by_role["periodic-1"], &run_row::bytes_sent);
    const double bytes_ad = mean(by_role["adaptive"], &run_row::bytes_sent);
    const auto period = std::max<std::int64_t>(1, std::llround(bytes_p1 / std::max(bytes_ad, 1.0)));
    for (int i = 0; i < n_seeds; ++i) by_role["equal-traffic"].push_back(run("equal-traffic", periodic(period), settings.seed + static_cast<std::uint64_t>(i)));

    const double acc_p1 = mean(by_role["periodic-1"], &run_row::accuracy);
    const double acc_ad = mean(by_role["adaptive"], &run_row::accuracy);
    const double acc_eq = mean(by_role["equal-traffic"], &run_row::accuracy);
    const double bytes_eq = mean(by_role["equal-traffic"], &run_row::bytes_sent);
    const double wall_p1 = mean(by_role["periodic-1"], &run_row::wall_s);
    const double wall_ad = mean(by_role["adaptive"], &run_row::wall_s);

    nlohmann::json j;
    j["dataset"] = "fashion-mnist";
    j["workers"] = settings.workers;
    j["epochs"] = settings.epochs;
    j["batch"] = settings.batch;
    j["partition"] = std::string(data::to_string(settings.partition));
    j["topology"] = base.topology.name;
    j["protocol"] = base.protocol.name;
    j["transport"] = {{"name", base.transport.name},
                      {"options", base.transport.name == "loopback" ? options_json(base.transport.opts.resolved(loopback_option_specs(), "transport"))
                                                                    : options_json(base.transport.opts)}};
    j["quick"] = quick;
    j["seeds"] = n_seeds;
    j["equal_traffic_period"] = period;
    j["runs"] = nlohmann::json::array();
    for (const auto& r : rows)
      j["runs"].push_back({{"role", r.role}, {"policy", r.policy}, {"options", r.options}, {"seed", r.seed}, {"bytes_sent", r.bytes_sent},
                           {"messages", r.messages}, {"accuracy", r.accuracy}, {"local_accuracy_mean", r.local_accuracy_mean}, {"wall_s", r.wall_s}});
    j["summary"] = {{"traffic_reduction", 1.0 - bytes_ad / bytes_p1},
                    {"accuracy_delta_pt", 100 * (acc_ad - acc_p1)},
                    {"equal_traffic_accuracy_delta_pt", 100 * (acc_ad - acc_eq)},
                    {"equal_traffic_bytes_ratio", bytes_eq / bytes_ad},
                    {"time_reduction", 1.0 - wall_ad / wall_p1},
                    {"accuracy", {{"never", mean(by_role["never"], &run_row::accuracy)}, {"periodic_1", acc_p1}, {"adaptive", acc_ad}, {"equal_traffic", acc_eq}}}};
    const auto json_path = (std::filesystem::path(out_dir) / "traffic.json").string();
    std::ofstream(json_path) << j.dump(2) << '\n';

    const auto& sm = j["summary"];
    fmt::print("\nsummary over {} seed(s):\n", n_seeds);
    fmt::print("  traffic_reduction                {:.4f}   (adaptive sends {:.1f}x fewer bytes than periodic every step)\n",
               sm["traffic_reduction"].get<double>(), bytes_p1 / bytes_ad);
    fmt::print("  accuracy_delta_pt                {:+.2f}    (adaptive {:.2f}% vs periodic-1 {:.2f}%)\n", sm["accuracy_delta_pt"].get<double>(), 100 * acc_ad, 100 * acc_p1);
    fmt::print("  equal_traffic_accuracy_delta_pt  {:+.2f}    (vs periodic every {} steps at {:.2f}x the adaptive bytes: {:.2f}%)\n",
               sm["equal_traffic_accuracy_delta_pt"].get<double>(), period, bytes_eq / bytes_ad, 100 * acc_eq);
    fmt::print("  time_reduction                   {:.4f}   (training time, {:.1f} s vs {:.1f} s)\n", sm["time_reduction"].get<double>(), wall_ad, wall_p1);
    fmt::print("wrote {}\n", json_path);

    // The plot is drawn by a small matplotlib script; it is optional.
    const auto png = (std::filesystem::path(out_dir) / "traffic.png").string();
    const std::string cmd = fmt::format("/usr/bin/python3 '{}/tools/plot_traffic.py' '{}' '{}'", GOSSIP_SOURCE_DIR, json_path, png);
    if (std::system(cmd.c_str()) == 0)
      fmt::print("wrote {}\n", png);
    else
      fmt::print("(no PNG: {} failed; apt-get install python3-matplotlib)\n", cmd);
  } catch (const gossip::error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}

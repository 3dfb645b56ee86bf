#pragma once
// The command line and the report of the Fashion-MNIST examples: options,
// config, per-epoch table, final line and --json. examples/01_fashion_mnist
// (MLP), examples/02_fashion_mnist_cuda (the MLP on the GPU) and
// examples/03_libtorch_cnn (libtorch CNN) differ only in the model.
#include <unistd.h>

#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <cmath>
#include <string>

#include <CLI/CLI.hpp>
#include "cli_checks.hpp"
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/report_error.hpp"
#include "common/traffic_specs.hpp"
#include "common/trainer.hpp"
#include "gossip_build_config.hpp"

namespace gossip::examples {

/// What an example may add to fashion_mnist_main.
struct app_hooks {
  /// Called once the command line is read: a value ends the program with it
  /// (e.g. 77 where there is no GPU); it may complete the title.
  std::function<std::optional<int>(std::string& title)> ready;
  /// Adds keys to the --json report.
  std::function<void(nlohmann::json&)> annotate;
};

/// main() of a Fashion-MNIST example training the models `make_net` makes
/// (see mlp_factory); `title` names the run in its first line.
template <class MakeNet = mlp_factory>
int fashion_mnist_main(int argc, char** argv, const std::string& description, std::string title, const MakeNet& make_net = {},
                       const app_hooks& hooks = {}) {
  CLI::App app{description};
  std::string config_path, policy, topology, protocol, partition, json_path;
  int workers = 0, epochs = 0;
  std::int64_t seed = -1;
  double bandwidth = -1;
  app.add_option("-c,--config", config_path, "TOML file with [policy], [topology], [protocol], [transport], [codec], [engine], [train] (and bench/traffic's [bench], [baseline], checked but unused here)")->check(CLI::ExistingFile);
  // An empty value would leave the config's choice in place without a word.
  const CLI::Validator not_empty([](std::string& v) { return v.empty() ? std::string("an empty value names nothing") : std::string(); }, "");
  app.add_option("--policy", policy, "override [policy] name (" + policy_registry().names_joined() + ")")->check(not_empty);
  app.add_option("--topology", topology, "override [topology] name (" + topology_registry().names_joined() + "; switch with transport 'switch')")->check(not_empty);
  app.add_option("--protocol", protocol, "override [protocol] name (" + protocol_registry().names_joined() + ")")->check(not_empty);
  app.add_option("-n,--workers", workers, "override [train] workers")->check(gossip::cli::integer_range(1, 256));
  app.add_option("--epochs", epochs, "override [train] epochs")->check(gossip::cli::integer_range(1, 10000));
  // A value past int64 is read as its largest value: the range refuses that too.
  app.add_option("--seed", seed, "override [train] seed")->check(gossip::cli::integer_range(std::int64_t{0}, std::numeric_limits<std::int64_t>::max() - 1));
  app.add_option("--partition", partition, "override [train] partition (iid, by_label or dirichlet)")->check(not_empty);
  app.add_option("--bandwidth-gbps", bandwidth, "override [transport] bandwidth_gbps (0: unlimited)")
      ->check(gossip::cli::number_range(0.0));
  app.add_option("--json", json_path, "write the run report as JSON here")->check(not_empty);
  std::vector<std::string> overrides;
  app.add_option("--set", overrides, "section.key=value on top of the config, e.g. --set policy.threshold=0.1 --set train.train_limit=5000");
  std::string help_settings;
  for (const auto& s : train_option_specs()) help_settings += fmt::format("  {:<20} {:<10} {}\n", s.key, to_string(s.default_value), s.help);
  app.footer("[train] settings (key, default, meaning):\n" + help_settings);
  CLI11_PARSE(app, argc, argv);
  if (hooks.ready)
    if (const auto code = hooks.ready(title)) return *code;

  try {
    // gossip-run --config passes the file as GOSSIP_CONFIG.
    bool from_env = false;
    if (const char* env = std::getenv("GOSSIP_CONFIG"); env && *env) {
      if (config_path.empty()) {
        config_path = env;
        from_env = true;
      } else if (std::error_code ec; !std::filesystem::exists(env, ec)) {
        throw config_error(fmt::format("GOSSIP_CONFIG={} (gossip-run --config): no such file, and --config {} names one; give one of them",
                                       env, config_path));
      } else if (!std::filesystem::equivalent(config_path, env, ec)) {
        throw config_error(fmt::format("--config {} and GOSSIP_CONFIG={} (gossip-run --config) name different files; neither wins "
                                       "silently: give one",
                                       config_path, env));
      }
    }
    // [train] is this program's; [bench] and [baseline] are bench/traffic's, whose configs run this example too.
    const std::vector<std::string> own_sections = {"train", "bench", "baseline"};
    // Without --config, errors about a default name the defaults (not "<code>").
    // From GOSSIP_CONFIG, a missing file is named as that variable's.
    config cfg = config_path.empty() ? config::parse("", "the built-in defaults (no --config)", own_sections)
                 : from_env          ? config::from_env(own_sections)
                                     : config::load(config_path, own_sections);
    // A flag and a --set of the same key: neither silently wins.
    std::vector<std::pair<std::string, std::string>> flagged;  // (key, flag)
    const auto flag = [&](bool given, const char* name, std::string key, const std::string& value) {
      if (!given) return;
      cfg.apply_override(key + "=" + value, fmt::format("{} {}", name, value));
      flagged.emplace_back(std::move(key), name);
    };
    flag(!policy.empty(), "--policy", "policy.name", policy);
    flag(!topology.empty(), "--topology", "topology.name", topology);
    flag(!protocol.empty(), "--protocol", "protocol.name", protocol);
    flag(!(bandwidth < 0), "--bandwidth-gbps", "transport.bandwidth_gbps", fmt::format("{}", bandwidth));
    flag(workers != 0, "--workers", "train.workers", fmt::format("{}", workers));
    flag(epochs != 0, "--epochs", "train.epochs", fmt::format("{}", epochs));
    flag(seed >= 0, "--seed", "train.seed", fmt::format("{}", seed));
    flag(!partition.empty(), "--partition", "train.partition", partition);
    for (const auto& o : overrides) {
      const std::string key = config::override_target(o);
      for (const auto& [k, name] : flagged)
        if (k == key)
          throw config_error(fmt::format("--set {} and {} both set {}; give one of them", o, name, k));
      cfg.apply_override(o);
    }
    const auto settings = train_settings::from(cfg.section("train", train_option_specs()));
    // [train] average_every replaces the [policy]: a policy given on the
    // command line would change nothing.
    if (settings.average_every > 0) {
      std::string given = policy.empty() ? std::string() : fmt::format("--policy {}", policy);
      for (const auto& o : overrides)
        if (given.empty() && config::override_target(o).starts_with("policy.")) given = fmt::format("--set {}", o);
      if (!given.empty())
        throw config_error(fmt::format("{}: [train] average_every = {} trains by local SGD's schedule and does not use the [policy]; it "
                                       "would change nothing: leave it out, or set average_every = 0",
                                       given, settings.average_every));
    }
    // The bench's sections are not this program's to use, but a misspelt key is refused here as there.
    (void)cfg.section("bench", traffic_bench_specs());
    (void)cfg.section("baseline", traffic_baseline_specs());
    // A bad [policy], [topology], [protocol], [codec], [engine] or [transport]
    // key is refused now, before the header and the data: train() builds them again.
    check_components(cfg, settings);
    if constexpr (requires { make_net.check(cfg, settings); }) make_net.check(cfg, settings);

    const bool quiet = runs_as_processes(cfg) && bootstrap::identity_from_env().rank != 0;
    // Where the report goes is checked now, not after the run.
    if (!json_path.empty() && !quiet) {
      namespace fs = std::filesystem;
      const fs::path dir = fs::path(json_path).parent_path().empty() ? fs::path(".") : fs::path(json_path).parent_path();
      if (std::error_code ec; fs::is_directory(json_path, ec))
        throw config_error(fmt::format("--json {}: is a directory; give the path of a file to write the report to", json_path));
      if (std::error_code ec; !fs::is_directory(dir, ec) || ::access(dir.c_str(), W_OK) != 0)
        throw config_error(fmt::format("--json {}: cannot write the report there ({} is not a writable directory)", json_path, dir.string()));
    }
    // [train] average_every replaces the [policy] with local SGD's schedule.
    const std::string policy = settings.average_every > 0
                                   ? fmt::format("local SGD averaging every {} steps ([train] average_every; the [policy] is not used)",
                                                 settings.average_every)
                                   : fmt::format("policy '{}'", cfg.policy.name);
    if (!quiet)
      fmt::print("libgossip {} — {}, {} workers, {}, topology '{}', protocol '{}', {} data\n", GOSSIP_VERSION, title, settings.workers,
                 policy, cfg.topology.name, cfg.protocol.name, data::to_string(settings.partition));
    const auto data = datasets::load(settings);
    if constexpr (requires { make_net.check_data(data); }) make_net.check_data(data);
    if (!quiet) print_epoch_header();
    const auto report = train(cfg, settings, data, print_epoch, make_net);
    if (!report.complete) return 0;  // another rank (process mode) reports
    print_done(report);
    for (const auto& d : report.dead)
      fmt::print("dead: rank {} (host {}), last model at epoch {}: {}\n", d.rank, d.host, d.last_epoch, d.reason);
    if (!report.dead.empty())
      fmt::print("{} of {} ranks finished; push-sum weight lost with the dead: {:.4f} of {} (survivors' own estimate {:.4f})\n",
                 report.survivors, settings.workers, report.lost_weight, settings.workers, report.lost_weight_estimate);
    if (!json_path.empty()) {
      nlohmann::json j;
      if (hooks.annotate) hooks.annotate(j);
      j["accuracy"] = report.accuracy;
      j["local_accuracy_mean"] = report.local_accuracy_mean;
      j["bytes_sent"] = report.bytes_sent;
      j["messages"] = report.messages;
      j["sends"] = report.sends;
      j["steps"] = report.steps;
      j["train_seconds"] = report.train_seconds;
      if (!report.timeline.empty()) j["timeline"] = to_json(report.timeline);
      j["survivors"] = report.survivors;
      j["lost_weight"] = report.lost_weight;
      j["lost_weight_estimate"] = report.lost_weight_estimate;
      j["dead_ranks"] = nlohmann::json::array();
      for (const auto& d : report.dead)
        j["dead_ranks"].push_back({{"rank", d.rank}, {"host", d.host}, {"last_epoch", d.last_epoch}, {"reason", d.reason}});
      j["epochs"] = nlohmann::json::array();
      for (const auto& e : report.epochs) j["epochs"].push_back({{"epoch", e.epoch}, {"accuracy", e.accuracy}, {"loss", e.train_loss}});
      j["ranks"] = nlohmann::json::array();
      for (const auto& r : report.rank_stats) j["ranks"].push_back(nlohmann::json::parse(r));
      std::ofstream json_out(json_path);
      json_out << j.dump(2) << '\n';
      json_out.close();
      if (!json_out) throw config_error(fmt::format("--json {}: writing the report failed ({})", json_path, std::strerror(errno)));
    }
    // The report went to a buffer: a full disk or /dev/full shows only now.
    if (std::fflush(stdout) != 0 || std::ferror(stdout))
      throw error(fmt::format("writing the report to standard output failed ({})", std::strerror(errno)));
  } catch (const std::exception&) {  // gossip::error and anything else (out of memory among them)
    return gossip::examples::report_error();
  }
  return 0;
}

}  // namespace gossip::examples

// bench/traffic — the founding experiment: how much traffic does drift-triggered
// gossip save at equal accuracy, and does it beat the controls that send the
// same bytes?
//
// For each seed, the same schedule and data: `never` (local SGD without any
// averaging, a control), `periodic` every step (the gossip-SGD baseline), the
// adaptive policy of the config, and the equal-bytes baselines, each at the
// shortest period whose bytes do not exceed the adaptive run's:
//   equal-traffic  periodic gossip every P steps;
//   local-sgd      local SGD, averaging every H steps by `rounds` gossip
//                  rounds in a row (examples/common/local_sgd.hpp);
//   diloco         the same with an outer Nesterov step at each averaging
//                  point (DiLoCo).
// Prints a table, writes JSON and a PNG.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include <CLI/CLI.hpp>
#include "cli_checks.hpp"
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "../output.hpp"
#include "common/report_error.hpp"
#include "common/trainer.hpp"
#include "common/traffic_specs.hpp"

namespace {

using namespace gossip;

struct run_row {
  std::string role, policy;
  nlohmann::json options;
  std::uint64_t seed = 0, bytes_sent = 0, messages = 0, sends = 0, steps = 0;
  double accuracy = 0, local_accuracy_mean = 0, wall_s = 0;
  bool eligible = true;  ///< an equal-bytes baseline that sent no more than the adaptive run
  std::string momentum;
  nlohmann::json timeline;  ///< the instruments over the run (first seed, workers as threads)
};

nlohmann::json options_json(const options& o) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : o.values())
    std::visit([&](const auto& x) { j[k] = x; }, v);
  return j;
}

// How one run trains beyond its policy: local SGD and the outer optimizer.
struct variant {
  int average_every = 0, average_rounds = -1;
  double outer_lr = 1.0, outer_momentum = 0.0;
  /// [engine] momentum for this run: controls run with their optimizer's own
  /// (local) momentum, as users run them; empty keeps the config's.
  std::string momentum = "local";
  bool probe = false;  ///< record the instruments' timeline (first seed)
};

// A word single-quoted for the shell, a ' inside as '\''.
std::string shell_quoted(const std::string& word) {
  std::string q = "'";
  for (const char c : word) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// One run as real processes: gossip-run starts `workers` ranks of the
// Fashion-MNIST example with the bench's config and this run's policy and
// seed; rank 0 writes the report.
nlohmann::json run_processes(const std::string& config_path, const std::vector<std::string>& overrides, const component_config& policy,
                             const examples::train_settings& s, const std::string& momentum, const std::string& out_dir) {
#if defined(GOSSIP_RUN_PATH) && defined(GOSSIP_FASHION_MNIST_PATH)
  const auto report = std::filesystem::absolute(std::filesystem::path(out_dir) / "run.json").string();
  std::filesystem::remove(report);
  std::string cmd = fmt::format("{} -n {} --config {} -- {}", shell_quoted(GOSSIP_RUN_PATH), s.workers, shell_quoted(config_path),
                                shell_quoted(GOSSIP_FASHION_MNIST_PATH));
  // This run's own settings; the command's --set options go first, less the
  // keys set here (the example refuses a key given twice). The run's policy
  // is given whole (the adaptive run's carries the --set policy keys
  // already); a control's must not inherit them.
  // (A local-SGD run, average_every > 0, uses no [policy]: the example refuses policy keys for it.)
  std::vector<std::string> own;
  if (s.average_every == 0) {
    own.push_back("policy.name=" + policy.name);
    for (const auto& [k, v] : policy.opts.values()) own.push_back(fmt::format("policy.{}={}", k, to_string(v)));
  }
  own.push_back(fmt::format("train.seed={}", s.seed));
  own.push_back(fmt::format("train.epochs={}", s.epochs));
  own.push_back(fmt::format("train.train_limit={}", s.train_limit));
  own.push_back(fmt::format("train.average_every={}", s.average_every));
  // local SGD's rounds (the example refuses them for a run without it)
  if (s.average_every > 0) own.push_back(fmt::format("train.average_rounds={}", s.average_rounds));
  own.push_back(fmt::format("train.outer_lr={}", to_string(option_value{s.outer_lr})));
  own.push_back(fmt::format("train.outer_momentum={}", to_string(option_value{s.outer_momentum})));
  if (!momentum.empty()) own.push_back("engine.momentum=\"" + momentum + "\"");
  const auto key_of = [](std::string_view kv) { return config::override_target(kv); };
  for (const auto& o : overrides)
    if (!key_of(o).starts_with("policy.") && std::none_of(own.begin(), own.end(), [&](const std::string& kv) { return key_of(kv) == key_of(o); }))
      cmd += " --set " + shell_quoted(o);
  for (const auto& kv : own) cmd += " --set " + shell_quoted(kv);
  cmd += fmt::format(" --json {} > {} 2>&1", shell_quoted(report), shell_quoted(out_dir + "/run.log"));
  if (std::system(cmd.c_str()) != 0 || !std::filesystem::exists(report))
    throw error(fmt::format("a run over processes failed; its output is in {}/run.log (command: {})", out_dir, cmd));
  std::ifstream in(report);
  return nlohmann::json::parse(in);
#else
  (void)config_path, (void)overrides, (void)policy, (void)s, (void)momentum, (void)out_dir;
  throw config_error("this bench was built without the Fashion-MNIST example or gossip-run, which runs over processes need");
#endif
}

double mean_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}
// Sample standard deviation (n − 1); null with fewer than two values.
nlohmann::json sigma_of(const std::vector<double>& v) {
  if (v.size() < 2) return nullptr;
  const double m = mean_of(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size() - 1));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Traffic reduction of drift-triggered gossip on Fashion-MNIST, with the honesty controls."};
  std::string config_path = std::string(GOSSIP_SOURCE_DIR) + "/bench/traffic/traffic.toml";
  std::string out_dir = "results";
  bool quick = false;
  int seeds = 0;
  app.add_option("-c,--config", config_path, "bench config: [policy] is the adaptive policy; [train], [transport], [bench], [baseline] (default: bench/traffic/traffic.toml of the source tree)")
      ->check(CLI::ExistingFile);
  app.add_option("-o,--out", out_dir, "directory for traffic.json and traffic.png (created if missing)")->capture_default_str();
  app.add_flag("--quick", quick, "fewer epochs (the [bench] quick_* settings): a few minutes on 2 cores");
  app.add_option("--seeds", seeds, "override [bench] seeds (traffic.toml: 3)")->check(gossip::cli::integer_range(1, 100));
  std::vector<std::string> overrides;
  app.add_option("--set", overrides, "section.key=value on top of the config, e.g. --set policy.threshold=0.1 --set train.workers=8");
  CLI11_PARSE(app, argc, argv);

  try {
    config_path = std::filesystem::absolute(config_path).string();
    config base = config::load(config_path, {"train", "bench", "baseline"});
    ::setenv("UCX_NET_DEVICES", "lo", 0);  // the ranks run on this machine
    for (const auto& o : overrides) base.apply_override(o);
    // Each run sets [engine] momentum itself (the controls their optimizer's own): the variable would override some runs and not others.
    if (const char* m = std::getenv("GOSSIP_MOMENTUM"); m && *m)
      throw config_error(fmt::format("GOSSIP_MOMENTUM={}: bench/traffic sets [engine] momentum per run (the adaptive run from the config, the "
                                     "controls their optimizer's own); unset it, and give the adaptive run's as --set engine.momentum=…",
                                     m));
    const auto bench = base.section("bench", examples::traffic_bench_specs());
    const auto bl = base.section("baseline", examples::traffic_baseline_specs());
    const auto in_range = [](const options& o, const char* key, std::int64_t lo, std::int64_t hi) {
      const auto v = o.integer(key);
      if (v < lo || v > hi) throw config_error(fmt::format("{}: key '{}' must be in {}..{}, got {}", o.where(key), key, lo, hi, v));
      return v;
    };
    const auto bench_seeds = in_range(bench, "seeds", 1, 100);
    if (seeds && bench.has("seeds") && bench.where("seeds").starts_with("--set") && bench_seeds != seeds)
      throw config_error(fmt::format("--seeds {} and {} both set the number of seeds; neither wins silently: give one", seeds, bench.where("seeds")));
    const int n_seeds = seeds ? seeds : static_cast<int>(bench_seeds);
    const auto quick_epochs = in_range(bench, "quick_epochs", 1, 10000);
    const auto quick_limit = in_range(bench, "quick_train_limit", 0, std::int64_t{1} << 30);
    // Each run sets these itself (0 / automatic for the gossip runs, [baseline]
    // for the local-SGD and DiLoCo controls): a value given for them would be
    // dropped without a word.
    if (const auto it = base.sections.find("train"); it != base.sections.end())
      for (const char* key : {"average_every", "average_rounds", "outer_lr", "outer_momentum"})
        if (it->second.has(key))
          throw config_error(fmt::format("{}: bench/traffic sets train.{} per run (the gossip runs average by gossip alone; the local-SGD "
                                         "and DiLoCo controls take their period from the adaptive run's bytes, and [baseline] rounds, "
                                         "outer_lr and outer_momentum); leave it out",
                                         it->second.where(key), key));
    auto settings = examples::train_settings::from(base.section("train", examples::train_option_specs()));
    if (quick) {
      // --quick runs [bench] quick_epochs: train.epochs given on the command line would be dropped without a word.
      if (const auto it = base.sections.find("train");
          it != base.sections.end() && it->second.has("epochs") && it->second.where("epochs").starts_with("--set"))
        throw config_error(fmt::format("{}: --quick runs [bench] quick_epochs instead; give --set bench.quick_epochs=N (or leave out --quick)",
                                       it->second.where("epochs")));
      // Likewise train.train_limit, when [bench] quick_train_limit replaces it.
      if (const auto it = base.sections.find("train"); quick_limit > 0 && it != base.sections.end() && it->second.has("train_limit") &&
                                                       it->second.where("train_limit").starts_with("--set"))
        throw config_error(fmt::format("{}: --quick trains on [bench] quick_train_limit = {} samples instead; give --set "
                                       "bench.quick_train_limit=N (or leave out --quick)",
                                       it->second.where("train_limit"), quick_limit));
      settings.epochs = static_cast<int>(quick_epochs);
      if (quick_limit > 0) settings.train_limit = static_cast<std::size_t>(quick_limit);
    }
    if (settings.workers < 2) {
      const auto it = base.sections.find("train");
      throw config_error(fmt::format("{}: bench/traffic compares how workers gossip, which takes at least 2 of them; got {}",
                                     it != base.sections.end() && it->second.has("workers") ? it->second.where("workers") : base.source + " [train] workers",
                                     settings.workers));
    }
    std::vector<std::string> roles;
    {
      const std::string list = bl.string("roles");
      for (std::size_t at = 0; at <= list.size();) {
        const auto comma = std::min(list.find(',', at), list.size());
        if (comma == at && list.size() > 0)
          throw config_error(fmt::format("{}: an empty item in '{}'; list the baselines once each, separated by commas", bl.where("roles"), list));
        if (comma > at) {
          std::string role = list.substr(at, comma - at);
          if (std::find(roles.begin(), roles.end(), role) != roles.end())
            throw config_error(fmt::format("{}: baseline '{}' is listed twice in '{}'; list each once", bl.where("roles"), role, list));
          roles.push_back(std::move(role));
        }
        at = comma + 1;
      }
    }
    for (const auto& r : roles)
      if (r != "equal-traffic" && r != "periodic-qgm" && r != "local-sgd" && r != "diloco" && r != "staggered-qgm")
        throw config_error(
            fmt::format("{}: unknown baseline '{}' in 'roles'; known: equal-traffic, periodic-qgm, local-sgd, diloco, staggered-qgm", bl.where("roles"), r));
    // The adaptive run is what every control is measured against: it must send something.
    if (base.policy.name == "never")
      throw config_error(fmt::format("{}: policy 'never' sends nothing, so there is no traffic to compare; bench/traffic runs it as a "
                                     "control already: give an adaptive policy (gossip-info lists them)",
                                     base.policy.opts.where("name")));
    examples::train_settings rounds_probe = settings;
    const auto rounds = bl.integer("rounds");
    if (rounds == 0 || rounds < -1 || rounds > 64)
      throw config_error(fmt::format("{}: key 'rounds' must be in 1..64 (gossip rounds per average), or -1 for automatic, got {}",
                                     bl.where("rounds"), rounds));
    rounds_probe.average_rounds = static_cast<int>(rounds);
    const int avg_rounds = rounds_probe.rounds_per_average();
    const double outer_lr = bl.real("outer_lr"), outer_momentum = bl.real("outer_momentum");
    if (!(outer_lr > 0) || !std::isfinite(outer_lr))
      throw config_error(fmt::format("{}: key 'outer_lr' must be a finite number > 0, got {}", bl.where("outer_lr"), outer_lr));
    if (!(outer_momentum >= 0 && outer_momentum < 1))
      throw config_error(fmt::format("{}: key 'outer_momentum' must be in [0, 1), got {}", bl.where("outer_momentum"), outer_momentum));
    const int max_attempts = static_cast<int>(in_range(bl, "max_attempts", 1, 100));
    // The adaptive run's [policy], [engine], [topology] … as the example would
    // build them: a bad key is refused now, not after the controls that run first.
    examples::check_components(base, settings);
    gossip::bench::prepare_out_dir(out_dir);
    for (const char* file : {"traffic.json", "traffic.png", "traffic-diagnosis.png"})
      gossip::bench::check_out_file((std::filesystem::path(out_dir) / file).string(), "--out");
    const auto data = examples::datasets::load(settings);

    std::string partition_label(data::to_string(settings.partition));
    if (settings.partition == data::partition_kind::by_label) partition_label += fmt::format(" ({} classes/worker)", settings.classes_per_worker);
    if (settings.partition == data::partition_kind::dirichlet) partition_label += fmt::format(" (alpha {})", settings.dirichlet_alpha);
    fmt::print("bench/traffic: Fashion-MNIST ({} train / {} test), {} workers, {} epochs, batch {}, {} data, topology '{}', "
               "protocol '{}', {} Gbit/s links, {} seed(s){}\n",
               data.train.size(), data.test.size(), settings.workers, settings.epochs, settings.batch, partition_label,
               base.topology.name, base.protocol.name, base.transport.opts.has("bandwidth_gbps") && base.transport.opts.real("bandwidth_gbps") > 0 ? to_string(base.transport.opts.values().at("bandwidth_gbps")) : "unlimited",
               n_seeds, quick ? " (quick)" : "");
    fmt::print("{:<14} {:<34} {:>4} {:>12} {:>9} {:>9} {:>9} {:>8}\n", "role", "policy", "seed", "bytes", "messages", "acc-avg", "acc-local", "wall-s");
    std::fflush(stdout);

    std::vector<run_row> rows;
    auto run = [&](const std::string& role, const component_config& policy, std::uint64_t seed, const variant& v = {}) {
      config cfg = base;
      cfg.policy = policy;
      auto s = settings;
      s.seed = seed;
      s.average_every = v.average_every;
      s.average_rounds = v.average_rounds;
      s.outer_lr = v.outer_lr;
      s.outer_momentum = v.outer_momentum;
      if (!v.momentum.empty()) cfg.engine.set("momentum", v.momentum);
      // The instruments' timeline: about 80 points over the run, threads only.
      if (v.probe) s.probe_every = std::max(1, s.epochs * static_cast<int>(data.train.size() / static_cast<std::size_t>(s.workers * s.batch)) / 80);
      run_row r;
      r.role = role, r.policy = policy.name, r.options = nlohmann::json::object(), r.seed = seed;
      std::string label = policy.name;
      if (v.average_every > 0) {
        r.policy = role == "diloco" ? "diloco" : "local-sgd";
        r.options = {{"every", v.average_every}, {"rounds", s.rounds_per_average()}};
        if (role == "diloco") r.options["outer_lr"] = v.outer_lr, r.options["outer_momentum"] = v.outer_momentum;
        label = fmt::format("{} every={} rounds={}", r.policy, v.average_every, s.rounds_per_average());
      } else {
        const auto resolved = policy.opts.resolved(policy_registry().find(policy.name, policy.opts.where()).specs, "policy '" + policy.name + "'");
        r.options = options_json(resolved);
        for (const auto& [k, val] : resolved.values()) label += fmt::format(" {}={}", k, to_string(val));
      }
      // A run that fails (a model gone NaN under a setting that diverges)
      // stops the bench; the error says which of its runs it was.
      try {
        if (examples::runs_as_processes(cfg)) {
          const auto j = run_processes(config_path, overrides, policy, s, v.momentum, out_dir);
          r.bytes_sent = j.at("bytes_sent");
          r.messages = j.at("messages");
          r.sends = j.value("sends", std::uint64_t{0});
          r.steps = j.value("steps", std::uint64_t{0});
          r.accuracy = j.at("accuracy");
          r.local_accuracy_mean = j.at("local_accuracy_mean");
          r.wall_s = j.at("train_seconds");
        } else {
          const auto rep = examples::train(cfg, s, data);
          r.bytes_sent = rep.bytes_sent;
          r.messages = rep.messages;
          r.sends = rep.sends;
          r.steps = rep.steps;
          r.accuracy = rep.accuracy;
          r.local_accuracy_mean = rep.local_accuracy_mean;
          r.wall_s = rep.train_seconds;
          if (!rep.timeline.empty()) r.timeline = examples::to_json(rep.timeline);
        }
      } catch (const gossip::error& e) {
        throw gossip::error(fmt::format("the {} run ({}, seed {}): {}", role, label, seed, e.what()));
      }
      r.momentum = v.momentum.empty() ? cfg.engine.has("momentum") ? cfg.engine.string("momentum") : "auto (default)" : v.momentum;
      fmt::print("{:<14} {:<34} {:>4} {:>12} {:>9} {:>8.2f}% {:>8.2f}% {:>8.1f}\n", role, label.substr(0, 34), seed, r.bytes_sent, r.messages,
                 100 * r.accuracy, 100 * r.local_accuracy_mean, r.wall_s);
      std::fflush(stdout);
      rows.push_back(r);
      return rows.size() - 1;
    };
    auto periodic = [](std::int64_t every) {
      component_config c{"periodic", options("bench [periodic]")};
      c.opts.set("every", every);
      return c;
    };
    auto seed_of = [&](int i) { return settings.seed + static_cast<std::uint64_t>(i); };

    // Rows by role, in seed order (for an equal-bytes baseline: its eligible attempt).
    std::map<std::string, std::vector<std::size_t>> by_role;
    for (int i = 0; i < n_seeds; ++i) {
      by_role["never"].push_back(run("never", {"never", options("bench [never]")}, seed_of(i)));
      by_role["periodic-1"].push_back(run("periodic-1", periodic(1), seed_of(i)));
      by_role["adaptive"].push_back(run("adaptive", base.policy, seed_of(i), variant{.momentum = "", .probe = i == 0}));
    }
    auto field = [&](const std::string& role, auto member) {
      std::vector<double> v;
      for (auto i : by_role[role]) v.push_back(static_cast<double>(rows[i].*member));
      return v;
    };
    const double bytes_p1 = mean_of(field("periodic-1", &run_row::bytes_sent));
    const double bytes_ad = mean_of(field("adaptive", &run_row::bytes_sent));
    // Every comparison is relative to these two: a run that sent nothing has no traffic to compare.
    if (!(bytes_p1 > 0))
      throw error(fmt::format("periodic every step sent nothing in {} workers' runs: topology '{}' gave no rank a peer to send to, so "
                              "there is no gossip to compare; choose a topology that connects the workers",
                              settings.workers, base.topology.name));
    if (!(bytes_ad > 0))
      throw error(fmt::format("the adaptive policy '{}' sent nothing in any of its {} run(s), so there is no traffic to compare; give it "
                              "settings that send (a lower threshold, or max_interval > 0), e.g. --set policy.threshold=…",
                              base.policy.name, n_seeds));
    // Periodic-1 sends at every training step: its runs give the bytes of one
    // send (all peers of one worker) and the training steps per worker.
    const auto& p1 = rows[by_role["periodic-1"].front()];
    const double bytes_per_send = p1.sends ? static_cast<double>(p1.bytes_sent) / static_cast<double>(p1.sends) : 0.0;
    const std::int64_t steps_per_worker = static_cast<std::int64_t>(p1.steps) / settings.workers;
    auto predicted = [&](std::int64_t every, std::int64_t sends_per_point) {
      return bytes_per_send * static_cast<double>(settings.workers) * static_cast<double>(sends_per_point * (steps_per_worker / every));
    };
    // The shortest period whose predicted bytes do not exceed the adaptive run's.
    auto shortest_period = [&](std::int64_t sends_per_point) {
      std::int64_t every = sends_per_point;
      while (every <= steps_per_worker && predicted(every, sends_per_point) > bytes_ad) ++every;
      return every;
    };

    struct baseline_result {
      std::string role;
      std::int64_t every = 0;
      int rounds = 0;
      int attempts = 0;
      bool eligible = false;
      bool never_exchanges = false;  // no period within the run fits the adaptive run's bytes: it would be `never`
    };
    std::vector<baseline_result> baselines;
    for (const auto& role : roles) {
      const bool gossip = role == "equal-traffic" || role == "periodic-qgm" || role == "staggered-qgm";
      const std::int64_t per_point = gossip ? 1 : avg_rounds;
      baseline_result b{role, shortest_period(per_point), gossip ? 0 : avg_rounds};
      for (b.attempts = 1;; ++b.attempts, ++b.every) {
        std::vector<std::size_t> idx;
        for (int i = 0; i < n_seeds; ++i) {
          if (role == "equal-traffic")
            idx.push_back(run(role, periodic(b.every), seed_of(i), variant{.probe = i == 0}));
          else if (role == "periodic-qgm")  // the fixed period with the adaptive run's quasi-global momentum
            idx.push_back(run(role, periodic(b.every), seed_of(i), variant{.momentum = "quasi-global"}));
          else if (role == "staggered-qgm") {  // the same, ranks taking turns
            auto p = periodic(b.every);
            p.opts.set("stagger", true);
            idx.push_back(run(role, p, seed_of(i), variant{.momentum = "quasi-global"}));
          }
          else
            idx.push_back(run(role, periodic(1), seed_of(i),
                              variant{.average_every = static_cast<int>(b.every), .average_rounds = avg_rounds,
                                      .outer_lr = role == "diloco" ? outer_lr : 1.0, .outer_momentum = role == "diloco" ? outer_momentum : 0.0}));
        }
        // Totals over the seeds, in integers: a control that sent exactly the
        // adaptive run's bytes is "no more", whatever the rounding of a mean.
        std::uint64_t bytes = 0, bytes_ad_total = 0;
        for (auto i : idx) bytes += rows[i].bytes_sent;
        for (auto i : by_role["adaptive"]) bytes_ad_total += rows[i].bytes_sent;
        // A period longer than the run never exchanges: that is the `never` control, not this one.
        b.never_exchanges = b.every > steps_per_worker;
        b.eligible = bytes <= bytes_ad_total && !b.never_exchanges;
        for (auto i : idx) rows[i].eligible = b.eligible;
        if (b.eligible || b.never_exchanges || b.attempts >= max_attempts) {
          by_role[role] = idx;
          break;
        }
        fmt::print("({} every {} sent {:.0f} bytes, more than the adaptive run's {:.0f}: trying every {})\n", role, b.every,
                   static_cast<double>(bytes) / n_seeds, bytes_ad, b.every + 1);
      }
      baselines.push_back(b);
    }

    const auto acc_ad_seeds = field("adaptive", &run_row::accuracy);
    auto deltas = [&](const std::string& role) {
      const auto other = field(role, &run_row::accuracy);
      std::vector<double> d;
      for (std::size_t i = 0; i < other.size() && i < acc_ad_seeds.size(); ++i) d.push_back(100 * (acc_ad_seeds[i] - other[i]));
      return d;
    };
    const double acc_p1 = mean_of(field("periodic-1", &run_row::accuracy));
    const double acc_ad = mean_of(acc_ad_seeds);
    const double wall_p1 = mean_of(field("periodic-1", &run_row::wall_s));
    const double wall_ad = mean_of(field("adaptive", &run_row::wall_s));
    // The best equal-bytes baseline: highest mean accuracy among those that sent no more than the adaptive run.
    const baseline_result* best = nullptr;
    for (const auto& b : baselines)
      if (b.eligible && (!best || mean_of(field(b.role, &run_row::accuracy)) > mean_of(field(best->role, &run_row::accuracy)))) best = &b;

    nlohmann::json j;
    j["dataset"] = "fashion-mnist";
    j["workers"] = settings.workers;
    j["epochs"] = settings.epochs;
    j["train_limit"] = settings.train_limit;  // training samples used (0: all)
    j["batch"] = settings.batch;
    j["partition"] = std::string(data::to_string(settings.partition));
    if (settings.partition == data::partition_kind::by_label) j["classes_per_worker"] = settings.classes_per_worker;
    if (settings.partition == data::partition_kind::dirichlet) j["dirichlet_alpha"] = settings.dirichlet_alpha;
    j["topology"] = base.topology.name;
    j["protocol"] = base.protocol.name;
    j["transport"] = {{"name", base.transport.name},
                      {"options", base.transport.name == "loopback" ? options_json(base.transport.opts.resolved(loopback_option_specs(), "transport"))
                                                                    : options_json(base.transport.opts)}};
    // The config's [engine] settings (each run's momentum is in its row), and the
    // command's --set options as given.
    j["engine"] = options_json(base.engine.resolved(engine_option_specs(), "engine"));
    j["overrides"] = overrides;
    j["quick"] = quick;
    j["seeds"] = n_seeds;
    j["steps_per_worker"] = steps_per_worker;
    for (const auto& b : baselines) {
      if (b.role == "equal-traffic") j["equal_traffic_period"] = b.every;
      if (b.role == "local-sgd") j["local_sgd_every"] = b.every;
      if (b.role == "diloco") j["diloco_every"] = b.every;
    }
    j["average_rounds"] = avg_rounds;
    j["diloco"] = {{"outer_lr", outer_lr}, {"outer_momentum", outer_momentum}, {"nesterov", true}};
    j["runs"] = nlohmann::json::array();
    for (const auto& r : rows) {
      nlohmann::json jr = {{"role", r.role}, {"policy", r.policy}, {"options", r.options}, {"seed", r.seed}, {"bytes_sent", r.bytes_sent},
                           {"messages", r.messages}, {"sends", r.sends}, {"accuracy", r.accuracy}, {"local_accuracy_mean", r.local_accuracy_mean},
                           {"wall_s", r.wall_s}};
      if (r.role != "never" && r.role != "periodic-1" && r.role != "adaptive") jr["eligible"] = r.eligible;
      jr["momentum"] = r.momentum;
      if (!r.timeline.is_null()) jr["timeline"] = r.timeline;
      j["runs"].push_back(jr);
    }
    nlohmann::json sm;
    sm["traffic_reduction"] = 1.0 - bytes_ad / bytes_p1;
    sm["accuracy_delta_pt"] = mean_of(deltas("periodic-1"));
    sm["accuracy_delta_sigma_pt"] = sigma_of(deltas("periodic-1"));
    sm["equal_traffic_best"] = best ? nlohmann::json(best->role) : nlohmann::json(nullptr);
    sm["equal_traffic_accuracy_delta_pt"] = best ? nlohmann::json(mean_of(deltas(best->role))) : nlohmann::json(nullptr);
    sm["equal_traffic_delta_sigma_pt"] = best ? sigma_of(deltas(best->role)) : nlohmann::json(nullptr);
    sm["equal_traffic_bytes_ratio"] = best ? nlohmann::json(mean_of(field(best->role, &run_row::bytes_sent)) / bytes_ad) : nlohmann::json(nullptr);
    sm["time_reduction"] = 1.0 - wall_ad / wall_p1;
    sm["baselines"] = nlohmann::json::object();
    for (const auto& b : baselines) {
      nlohmann::json jb = {{"every", b.every}, {"eligible", b.eligible}, {"never_exchanges", b.never_exchanges}, {"attempts", b.attempts},
                           {"bytes_ratio", mean_of(field(b.role, &run_row::bytes_sent)) / bytes_ad},
                           {"accuracy", mean_of(field(b.role, &run_row::accuracy))},
                           {"accuracy_delta_pt", mean_of(deltas(b.role))}, {"accuracy_delta_sigma_pt", sigma_of(deltas(b.role))}};
      if (b.rounds) jb["rounds"] = b.rounds;
      sm["baselines"][b.role] = jb;
    }
    sm["accuracy"] = {{"never", mean_of(field("never", &run_row::accuracy))}, {"periodic_1", acc_p1}, {"adaptive", acc_ad}};
    for (const auto& b : baselines) {
      std::string key = b.role;
      std::replace(key.begin(), key.end(), '-', '_');
      sm["accuracy"][key] = mean_of(field(b.role, &run_row::accuracy));
    }
    j["summary"] = sm;
    const auto json_path = (std::filesystem::path(out_dir) / "traffic.json").string();
    gossip::bench::write_file(json_path, j.dump(2));

    auto pm = [](const nlohmann::json& sig) { return sig.is_null() ? std::string() : fmt::format(" ± {:.2f}", sig.get<double>()); };
    fmt::print("\nsummary over {} seed(s) (± is the standard deviation of the per-seed difference):\n", n_seeds);
    fmt::print("  traffic_reduction                {:.4f}   (adaptive sends {:.1f}x fewer bytes than periodic every step)\n",
               sm["traffic_reduction"].get<double>(), bytes_p1 / bytes_ad);
    fmt::print("  accuracy_delta_pt                {:+.2f}{}    (adaptive {:.2f}% vs periodic-1 {:.2f}%)\n", sm["accuracy_delta_pt"].get<double>(),
               pm(sm["accuracy_delta_sigma_pt"]), 100 * acc_ad, 100 * acc_p1);
    for (const auto& b : baselines) {
      const auto& jb = sm["baselines"][b.role];
      fmt::print("  vs {:<14} every {:>4}{}  {:+.2f}{}    ({:.2f}% at {:.2f}x the adaptive bytes{})\n", b.role, b.every,
                 b.rounds ? fmt::format(" ({} rounds)", b.rounds) : std::string(), jb["accuracy_delta_pt"].get<double>(),
                 pm(jb["accuracy_delta_sigma_pt"]), 100 * jb["accuracy"].get<double>(), jb["bytes_ratio"].get<double>(),
                 b.eligible           ? ""
                 : b.never_exchanges ? fmt::format(", longer than the run's {} steps, so it never exchanges: not compared", steps_per_worker)
                                     : ", overshoots: not compared");
    }
    if (best)
      fmt::print("  equal_traffic_accuracy_delta_pt  {:+.2f}{}    (vs the best equal-bytes baseline, {})\n",
                 sm["equal_traffic_accuracy_delta_pt"].get<double>(), pm(sm["equal_traffic_delta_sigma_pt"]), best->role);
    fmt::print("  time_reduction                   {:.4f}   (training time, {:.1f} s vs {:.1f} s)\n", sm["time_reduction"].get<double>(), wall_ad, wall_p1);
    fmt::print("wrote {}\n", json_path);

    // The plot is drawn by a small matplotlib script; it is optional.
    const auto png = (std::filesystem::path(out_dir) / "traffic.png").string();
    const auto plot = [&](const char* script, const std::string& out) {
      const std::string cmd = fmt::format("/usr/bin/python3 {} {} {}", shell_quoted(fmt::format("{}/tools/{}", GOSSIP_SOURCE_DIR, script)),
                                          shell_quoted(json_path), shell_quoted(out));
      if (std::system(cmd.c_str()) == 0)
        fmt::print("wrote {}\n", out);
      else if (std::system("/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1") != 0)
        fmt::print("(no {}: matplotlib is missing: apt-get install python3-matplotlib)\n", out);
      else
        fmt::print("(no {}: {} failed; its error is above)\n", out, cmd);
    };
    plot("plot_traffic.py", png);
    // The instruments (consensus distance, sends, push-sum weights) of the first seed's runs; threads only.
    if (std::any_of(rows.begin(), rows.end(), [](const run_row& r) { return !r.timeline.is_null(); }))
      plot("plot_diagnosis.py", (std::filesystem::path(out_dir) / "traffic-diagnosis.png").string());
  } catch (const std::exception&) {  // gossip::error and anything else (out of memory among them)
    return gossip::examples::report_error();
  }
  return 0;
}

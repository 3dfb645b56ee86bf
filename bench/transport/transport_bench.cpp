// bench/transport — does the UCX transport move payloads as fast as UCX itself?
//
// 1. Throughput (gossip_side.cpp against perftest.cpp). Two forked ranks drive a gossip::ucx_transport directly (no
//    engine): rank 0 posts W warm-up and then N timed messages of S payload
//    bytes to rank 1 from B rotating send buffers; rank 1 collects and
//    releases them from its inbox (B = 2 send buffers and inbox depth 2 by
//    default: the engine's own). The figure is measured at the receiver:
//    payload bytes N·S divided by the time from consuming the last warm-up
//    message to consuming the last timed one — the steady streaming rate.
//    Every message's sender, step and payload stamps are checked, and the
//    last one's payload is compared word for word, before its time counts.
//    Right after each gossip run, ucx_perftest -t tag_bw runs the same size,
//    count and warm-up with the same UCX_TLS (server and client are child
//    processes), then again with -e: peer error handling on its endpoints,
//    as the transport creates them (over tcp this alone changes UCX's speed).
//    Sender and receiver sit on one CPU each, for both benchmarks. Each size
//    runs --reps times, interleaved; the table reports the best of them (the
//    run least disturbed by other work on the machine), the JSON every value.
// 2. Step cost (gossip_side.cpp). A real gossip::engine over ucx_transport, policy `never`, on
//    two ranks: the median of engine.step() against the median of
//    gossip::drift_pass over the same model and x̂ alone, timed alternately
//    in the same loop.
//
//   transport_bench                          # ~1 min on 2 cores: table + ./transport.json
//   transport_bench --out results --reps 7 --sizes 1M 16M
//   transport_bench --smoke --out DIR        # tiny sizes, then checks its own JSON
//
// This file drives the runs and prints the table rows as they come;
// report.cpp prints the rest and writes transport.json.
#include <sched.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "gossip/transports/ucx/ucx.hpp"
#include "tests/harness.hpp"
#include "cli_checks.hpp"
#include "../output.hpp"
#include "transport_bench.hpp"

namespace transport_bench {
namespace {

using gossip::error;

// Exit 77 (skipped) when UCX cannot make a context here; probed in a child so
// that this process holds no UCX state across the forks that follow.
std::string probe_ucx(const std::string& tls) {
  return gossip::harness::probe_in_child([&] {
    ::setenv("UCX_TLS", tls.c_str(), 1);
    ::setenv("UCX_NET_DEVICES", "lo", 1);
    return gossip::ucx_transport::probe();
  });
}

double best(const std::vector<double>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

std::uint64_t messages_for(const settings& s, std::size_t bytes) {
  return std::clamp<std::uint64_t>(s.bytes_per_run / bytes, s.min_messages, s.max_messages);
}

// UCX_TLS names UCX 1.13 knows (transports and their aliases). A name not
// among them is a typo, an error; a known one this machine lacks is a SKIP.
void check_tls_names(const std::string& tls) {
  static constexpr std::string_view known[] = {
      "all",     "sm",       "shm",      "mm",       "posix",    "sysv",     "xpmem",   "knem",     "cma",       "self",
      "tcp",     "ib",       "rc",       "rc_v",     "rc_x",     "rc_verbs", "rc_mlx5", "ud",       "ud_v",      "ud_x",
      "ud_verbs", "ud_mlx5", "dc",       "dc_x",     "dc_mlx5",  "cuda",     "cuda_copy", "cuda_ipc", "gdr_copy", "rocm",
      "rocm_copy", "rocm_ipc", "rocm_gdr", "ugni",   "ugni_rdma", "ugni_udt", "ugni_smsg"};
  std::string_view rest = tls;
  if (rest.starts_with('^')) rest.remove_prefix(1);  // "^name": every transport but those
  if (rest.empty()) throw gossip::config_error(fmt::format("--tls '{}': empty; give UCX_TLS values such as posix,self or tcp", tls));
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    std::string_view name = rest.substr(0, comma);
    if (name.ends_with(":aux")) name.remove_suffix(4);
    if (std::find(std::begin(known), std::end(known), name) == std::end(known))
      throw gossip::config_error(fmt::format("--tls {}: '{}' is not a UCX transport name (e.g. posix, self, tcp, sm, cma, all)", tls, name));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
  }
}

int run(settings& s) {
  const auto started = clock_type::now();
  const double load_before = load_average();
  for (const auto& tls : s.tls) check_tls_names(tls);
  for (const auto& tls : s.tls)
    if (const std::string why = probe_ucx(tls); !why.empty()) {
      fmt::print(stderr, "SKIP: UCX cannot create a context and worker with UCX_TLS={}: {}\n", tls, why);
      return 77;
    }
  results res;
  res.started = started;
  res.load_before = load_before;
  const std::string perftest_exe = res.perftest_exe = s.perftest == "none" ? "" : find_on_path(s.perftest);
  if (perftest_exe.empty() && s.perftest != "none") {
    if (!s.smoke)
      throw error(fmt::format("bench/transport: '{}' is not on PATH (apt-get install ucx-utils); the comparison needs it", s.perftest));
    fmt::print("ucx_perftest: not found (apt-get install ucx-utils); smoke run without the comparison\n");
  }

  fmt::print("bench/transport: UCX transport payload throughput against ucx_perftest -t {}, same UCX_TLS, UCX_NET_DEVICES=lo.\n"
             "  gossip: ranks 0 -> 1 through gossip::ucx_transport, {} send buffers, inbox depth {}, waits: {};\n"
             "          GB/s = N x S payload bytes (1e9 B/s) / time at the receiver from consuming the last of {} warm-up messages\n"
             "          to consuming the last of N timed ones; every message's stamps and the last payload are checked.\n"
             "  perftest: average bandwidth of its final line, MB/s with MB = 2^20 bytes, converted to GB/s; same N and warm-up;\n"
             "            perftest -e: the same with peer error handling on its endpoints, as the transport creates them.\n"
             "  N = clamp({} MiB / S, {}, {}); each size runs {} time(s), alternating gossip and perftest; table: best of them,\n"
             "  best ratio = best gossip / best perftest, median ratio = median gossip / median perftest.\n"
             "  A fresh pair of ranks per size, with a model of that size; L after the size: their endpoints went through\n"
             "  listeners (ucx_options::connect, which is {}), else by worker address.\n"
             "  {}\n\n",
             s.perftest_test, s.send_buffers, s.depth, s.wait, s.warmup, s.bytes_per_run >> 20, s.min_messages, s.max_messages, s.reps, s.connect,
             s.cpus.empty() ? std::string("not pinned (--pin off)")
                            : fmt::format("pinned: sender (rank 0, perftest client) on CPU {}, receiver (rank 1, perftest server) on CPU {}",
                                          s.cpus[0], s.cpus[1]));

  json& runs = res.runs;
  json& step_cost = res.step_cost;
  const unsigned cpus_here = res.cpus = std::max(1u, std::thread::hardware_concurrency());
  if (load_before > 0.5 * cpus_here)
    fmt::print("note: load average {:.2f} on {} CPUs before the run: other work shares these cores, and ucx_perftest (which "
               "busy-polls) suffers from it more than the transport (which sleeps when it waits); compare runs at similar load.\n\n",
               load_before, cpus_here);
  fmt::print("{:<11} {:>5}  {:>5} {:>8} {:>9} {:>6} {:>6} {:>9} {:>6}   {}\n", "", "", "", "gossip", "perftest", "best", "median",
             "perftest", "", "every run, GB/s");
  fmt::print("{:<11} {:>5}  {:>5} {:>8} {:>9} {:>6} {:>6} {:>9} {:>6}   {}\n", "UCX_TLS", "size", "N", "GB/s", "GB/s", "ratio", "ratio",
             s.perftest_eh ? "-e GB/s" : "", s.perftest_eh ? "ratio" : "", "(g: gossip, p: perftest, e: perftest -e)");
  for (const auto& tls : s.tls) {
    for (std::size_t bytes : s.sizes) {
      // A pair of ranks per size, whose model is that size: the transport
      // chooses its endpoints by the message size (ucx_connect::automatic),
      // as an engine with a model of that size would.
      settings one = s;
      one.sizes = {bytes};
      rank_pair pair(tls, one);
      const std::uint64_t n = messages_for(s, bytes);
      std::vector<double> g, p, pe;
      std::size_t held = 0;
      bool listening = false;
      for (int rep = 0; rep < s.reps; ++rep) {
        const auto replies = pair.both(fmt::format("xfer {} {} {}", bytes, s.warmup, n), fmt::format("{} messages of {} bytes", n, bytes));
        std::istringstream rx(replies[1].substr(3)), tx(replies[0].substr(3));
        double seconds = 0;
        std::size_t rx_held = 0, tx_held = 0;
        int tx_listening = 0;
        rx >> seconds >> rx_held;
        tx >> tx_held >> tx_listening;
        held = std::max(rx_held, tx_held);  // the larger side: the receiver's backlog
        listening = tx_listening != 0;
        g.push_back(static_cast<double>(n * bytes) / seconds / 1e9);
        if (!perftest_exe.empty()) {
          p.push_back(perftest(s, perftest_exe, tls, bytes, static_cast<std::uint64_t>(s.warmup), n, false));
          if (s.perftest_eh) pe.push_back(perftest(s, perftest_exe, tls, bytes, static_cast<std::uint64_t>(s.warmup), n, true));
        }
      }
      json r{{"tls", tls},
             {"bytes", bytes},
             {"messages", n},
             {"warmup", s.warmup},
             {"verified", true},
             {"gossip_gbps", best(g)},
             {"gossip_median_gbps", median(g)},
             {"gossip_all_gbps", g},
             {"transport_bytes_per_peer", held},
             {"endpoints", listening ? "listener" : "worker_address"}};
      auto list = [](const char* tag, const std::vector<double>& v) {
        std::string out;
        for (double x : v) out += fmt::format(" {:.2f}", x);
        return v.empty() ? std::string() : fmt::format("  {}:{}", tag, out);
      };
      std::string row = fmt::format("{:<11} {:>5}{} {:>5} {:>8.2f}", tls, size_name(bytes), listening ? "L" : " ", n, best(g));
      if (!p.empty()) {
        r["perftest_gbps"] = best(p);
        r["perftest_median_gbps"] = median(p);
        r["perftest_all_gbps"] = p;
        r["ratio"] = best(g) / best(p);
        r["median_ratio"] = median(g) / median(p);
        row += fmt::format(" {:>9.2f} {:>6.3f} {:>6.3f}", best(p), best(g) / best(p), median(g) / median(p));
      } else {
        r["perftest_gbps"] = nullptr;
        r["ratio"] = nullptr;
        row += fmt::format(" {:>9} {:>6} {:>6}", "-", "-", "-");
      }
      if (!pe.empty()) {
        r["perftest_eh_gbps"] = best(pe);
        r["perftest_eh_all_gbps"] = pe;
        r["ratio_eh"] = best(g) / best(pe);
        row += fmt::format(" {:>9.2f} {:>6.3f}", best(pe), best(g) / best(pe));
      } else {
        row += fmt::format(" {:>9} {:>6}", "", "");
      }
      fmt::print("{} {}{}{}\n", row, list("g", g), list("p", p), list("e", pe));
      std::fflush(stdout);
      runs.push_back(std::move(r));
    }
    if (s.step_elements.empty()) continue;
    settings smallest = s;  // the step cost builds its own engines: this pair's transport carries nothing
    smallest.sizes = {*std::min_element(s.sizes.begin(), s.sizes.end())};
    rank_pair pair(tls, smallest);
    for (std::size_t elements : s.step_elements) {
      const auto replies = pair.both(fmt::format("step {} {}", elements, s.steps), fmt::format("step cost at {} elements", elements));
      for (int rank = 0; rank < 2; ++rank) {
        std::istringstream in(replies[static_cast<std::size_t>(rank)].substr(3));
        double step_us = 0, drift_us = 0, unpaced_us = 0, quiet_step_us = 0, quiet_drift_us = 0;
        std::uint64_t lead_waits = 0, beacons = 0, quiet_steps = 0;
        in >> step_us >> drift_us >> unpaced_us >> lead_waits >> beacons >> quiet_step_us >> quiet_drift_us >> quiet_steps;
        const json quiet_ratio = quiet_steps > 0 ? json(quiet_step_us / quiet_drift_us) : json(nullptr);
        step_cost.push_back({{"tls", tls},
                             {"rank", rank},
                             {"elements", elements},
                             {"steps", s.steps},
                             {"step_us", step_us},
                             {"drift_us", drift_us},
                             {"ratio", step_us / drift_us},
                             {"unpaced_us", unpaced_us},
                             {"ratio_unpaced", unpaced_us / drift_us},
                             {"lead_waits", lead_waits},
                             {"step_beacons", beacons},
                             {"quiet_steps", quiet_steps},
                             {"ratio_quiet", quiet_ratio}});
      }
    }
  }

  const std::string path = write_report(s, res);
  if (s.smoke) return check_file(path);
  return 0;
}

}  // namespace
}  // namespace transport_bench

using namespace transport_bench;
using gossip::error;
namespace harness = gossip::harness;

int main(int argc, char** argv) {
  CLI::App app{"UCX transport payload throughput against ucx_perftest, and the step cost of a silent engine over UCX."};
  app.option_defaults()->always_capture_default();  // --help shows every default
  settings s;
  std::vector<std::string> sizes{"64K", "256K", "1M", "4M", "16M", "64M"}, step_sizes;
  std::string check;
  double mib_per_run = 256;
  app.add_option("--out", s.out, "directory for transport.json");
  app.add_option("--tls", s.tls, "UCX_TLS settings to compare (each runs both sides; default: posix,self and tcp)")->default_str("");
  app.add_option("--sizes", sizes, "payload sizes in bytes, multiples of 64 (K, M, G suffixes)");
  app.add_option("--reps", s.reps, "runs per size and side; the table shows the best")->check(gossip::cli::integer_range(1, 50));
  app.add_option("--mib-per-run", mib_per_run, "timed payload per run in MiB (N = this / size, clamped)")->check(gossip::cli::number_range(0.0625, 65536.0));
  app.add_option("--min-messages", s.min_messages, "fewest timed messages per run")->check(gossip::cli::integer_range(1, 1000000));
  app.add_option("--max-messages", s.max_messages, "most timed messages per run")->check(gossip::cli::integer_range(1, 1000000));
  app.add_option("--warmup", s.warmup, "warm-up messages per run (both sides)")->check(gossip::cli::integer_range(1, 100000));
  app.add_option("--send-buffers", s.send_buffers, "rotating send buffers at rank 0")->check(gossip::cli::integer_range(1, 64));
  app.add_option("--depth", s.depth, "inbox slots per source at rank 1 (the engine uses 2)")->check(gossip::cli::integer_range(1, 64));
  app.add_option("--backlog", s.backlog, "ucx_options::backlog")->check(gossip::cli::integer_range(1, 100000));
  app.add_option("--connect", s.connect, "ucx_options::connect: auto (listeners when UCX_TLS is tcp only), worker (worker addresses) or listener")
      ->check(CLI::IsMember({"auto", "worker", "listener"}))
      ;
  app.add_option("--wait", s.wait, "how the bench's own loops wait: backoff (as gossip's waits: spin, yield, then 20 us sleeps), yield, sleep or spin")
      ->check(CLI::IsMember({"backoff", "yield", "sleep", "spin"}))
      ;
  app.add_option("--step-elements", step_sizes, "model sizes in floats, multiples of 64 (K, M, G suffixes) for the step cost; default 1M 16M")->default_str("");
  app.add_option("--steps", s.steps, "timed steps per model size")->check(gossip::cli::integer_range(3, 100000));
  app.add_option("--perftest", s.perftest, "ucx_perftest executable; none: gossip side only");
  bool no_eh = false;
  app.add_flag("--no-perftest-e", no_eh, "skip the second baseline, ucx_perftest -e (peer error handling, as the transport's endpoints)");
  app.add_option("--perftest-test", s.perftest_test, "ucx_perftest test to compare with")
      ->check(CLI::IsMember({"tag_bw", "ucp_am_bw", "stream_bw"}))
      ;
  app.add_option("--timeout", s.timeout_s, "bound on every wait, seconds")->check(gossip::cli::number_range(1.0, 3600.0));
  std::string pin = "auto";
  app.add_option("--pin", pin, "CPUs for the sending and receiving side, e.g. 0,1 (the same for both benchmarks); auto: the first two "
                 "CPUs this process may use (off for --smoke); off");
  app.add_flag("--smoke", s.smoke, "tiny sizes, one rep, then check the JSON (the meson smoke test)");
  app.add_option("--check", check, "only check an existing transport.json");
  CLI11_PARSE(app, argc, argv);

  if (!check.empty()) return check_file(check);
  ::signal(SIGPIPE, SIG_IGN);  // a rank that died shows up as a failed write, not as the end of this process
  s.perftest_eh = !no_eh;
  try {
    if (s.smoke) {
      if (app.count("--sizes") == 0) sizes = {"64K", "256K"};
      if (app.count("--reps") == 0) s.reps = 1;
      if (app.count("--mib-per-run") == 0) mib_per_run = 4;
      if (app.count("--steps") == 0) s.steps = 5;
      if (step_sizes.empty()) step_sizes = {"64K"};
    }
    // Errors name the option; a size counts bytes, a step size floats.
    const auto parsed = [](const std::string& option, const std::string& z, const char* unit) {
      try {
        return harness::parse_size(z, 64);
      } catch (const std::invalid_argument& e) {
        std::string why = e.what();
        if (const auto b = why.find(" bytes"); b != std::string::npos) why.replace(b, 6, std::string(" ") + unit);
        if (const auto c = why.find("a byte count"); c != std::string::npos) why.replace(c, 12, std::string("a count of ") + unit);
        throw std::invalid_argument(option + ": " + why);
      }
    };
    for (const auto& z : sizes) s.sizes.push_back(parsed("--sizes", z, "bytes"));
    if (!step_sizes.empty()) {
      s.step_elements.clear();
      for (const auto& z : step_sizes) {
        // A count of floats, not bytes: each rank holds the model, its x̂ and the step's copies.
        s.step_elements.push_back(parsed("--step-elements", z, "floats"));
        if (s.step_elements.back() > (std::size_t{1} << 30))
          throw std::invalid_argument("--step-elements " + z + ": more than 1G floats (4 GiB a model, held several times by each rank)");
      }
    }
    s.bytes_per_run = static_cast<std::size_t>(mib_per_run * mib);
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    const bool known = ::sched_getaffinity(0, sizeof allowed, &allowed) == 0;
    if (pin == "auto" && !s.smoke) {
      if (known)
        for (int c = 0; c < CPU_SETSIZE && s.cpus.size() < 2; ++c)
          if (CPU_ISSET(c, &allowed)) s.cpus.push_back(c);
      if (s.cpus.size() < 2) s.cpus.clear();
    } else if (pin != "off" && pin != "auto") {
      const auto comma = pin.find(',');
      if (comma == std::string::npos) throw error("bench/transport: --pin takes two CPUs, e.g. 0,1, or auto / off");
      const auto cpu = [&](const std::string& t) {
        if (t.empty() || t.size() > 4 || t.find_first_not_of("0123456789") != std::string::npos)
          throw error(fmt::format("bench/transport: --pin {}: '{}' is not a CPU number; give two, e.g. 0,1, or auto / off", pin, t));
        return std::stoi(t);
      };
      s.cpus = {cpu(pin.substr(0, comma)), cpu(pin.substr(comma + 1))};
      // Refused here, before anything runs: a rank would only warn and run unpinned, and ucx_perftest -c would fail.
      for (const int c : s.cpus)
        if (known && (c >= CPU_SETSIZE || !CPU_ISSET(c, &allowed))) {
          std::string list;
          for (int a = 0; a < CPU_SETSIZE; ++a)
            if (CPU_ISSET(a, &allowed)) list += fmt::format("{}{}", list.empty() ? "" : " ", a);
          throw error(fmt::format("bench/transport: --pin {}: CPU {} is not one this process may run on (it may use: {}); "
                                  "give two of those, or auto / off", pin, c, list));
        }
    }
    if (s.min_messages > s.max_messages) throw error("bench/transport: --min-messages is larger than --max-messages");
    if (!s.out.empty()) {
      gossip::bench::prepare_out_dir(s.out);
      gossip::bench::check_out_file((std::filesystem::path(s.out) / "transport.json").string(), "--out");
    }
    return run(s);
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
}


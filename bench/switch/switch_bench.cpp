// bench/switch — all-reduce through an aggregation switch: the Keio
// comparison. N workers (threads of this process, each with its own kernel
// UDP socket, optionally each inside its own network namespace) all-reduce
// buffers of 4 KiB to 64 MiB through whatever serves the group at --address:
// gossip-switch (DPDK), or gossip-switch-udp on the host or in the switch's
// position. Every result is checked against the reference sum before its time
// counts.
//
//   switch_bench run --mode host-udp --workers 2 --address 127.0.0.1 --out host.json
//   switch_bench report host.json dpdk.json --out switch.json
//
// bench/switch/run.sh sets up the namespaces, starts each aggregator in turn
// and runs both steps.
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <random>

#include "cli_checks.hpp"
#include "../output.hpp"
#include "client.hpp"
#include "tests/harness.hpp"

namespace {

using namespace gossip::sw;

float value(std::size_t i, int worker, int rep) noexcept {
  return static_cast<float>((i * 7 + static_cast<std::size_t>(worker) * 13 + static_cast<std::size_t>(rep)) % 101);
}

struct run_options {
  std::string mode = "host-udp", address = "127.0.0.1", netns_prefix, out;
  int workers = 2, reps = 3;
  std::uint16_t port = default_port, group = 1, chunk = default_chunk, window = 128;
  std::vector<std::string> sizes{"4K", "64K", "1M", "16M", "64M"};
  std::vector<int> cpus;
  double timeout = 60, rto_ms = 5;
};

void enter(const run_options& o, int w);

int run(const run_options& o) {
  if (!o.out.empty()) gossip::bench::check_out_file(o.out, "--out");
  std::vector<std::size_t> sizes;
  for (const auto& s : o.sizes) sizes.push_back(gossip::harness::parse_size(s, 4));
  const int n = o.workers;
  // times[size][rep][worker]
  std::vector<std::vector<std::vector<double>>> times(sizes.size(), std::vector<std::vector<double>>(static_cast<std::size_t>(o.reps),
                                                                                                    std::vector<double>(static_cast<std::size_t>(n))));
  std::vector<std::vector<char>> correct(sizes.size(), std::vector<char>(static_cast<std::size_t>(n), 1));
  std::vector<std::vector<std::uint64_t>> retransmits(sizes.size(), std::vector<std::uint64_t>(static_cast<std::size_t>(n)));
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::barrier sync(n);

  auto worker = [&](int w) {
    const auto wi = static_cast<std::size_t>(w);
    bool dropped = false;
    try {
      enter(o, w);
      client c({.address = o.address, .port = o.port, .group = o.group, .worker = static_cast<std::uint16_t>(w),
                .members = static_cast<std::uint16_t>(n), .chunk = o.chunk, .window = o.window, .rto_s = o.rto_ms / 1000,
                .timeout_s = o.timeout});
      for (std::size_t si = 0; si < sizes.size(); ++si) {
        const std::size_t elems = sizes[si] / 4;
        std::vector<float> in(elems), out(elems);
        const auto before = c.counters().retransmits;
        for (int rep = -1; rep < o.reps; ++rep) {  // rep −1: warm-up, untimed
          const int tag = rep + 1 + static_cast<int>(si) * 17;
          for (std::size_t i = 0; i < elems; ++i) in[i] = value(i, w, tag);
          sync.arrive_and_wait();
          const auto t0 = std::chrono::steady_clock::now();
          c.allreduce(in, out);
          const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          bool ok = true;
          for (std::size_t i = 0; i < elems && ok; ++i) {
            float ref = 0;
            for (int k = 0; k < n; ++k) ref += value(i, k, tag);
            ok = out[i] == ref;
          }
          if (!ok) correct[si][wi] = 0;
          if (rep >= 0) times[si][static_cast<std::size_t>(rep)][wi] = s;
        }
        retransmits[si][wi] = c.counters().retransmits - before;
      }
    } catch (const std::exception& e) {
      errors[wi] = e.what();
      dropped = true;
      sync.arrive_and_drop();
    }
    (void)dropped;
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < n; ++w) threads.emplace_back(worker, w);
  for (auto& t : threads) t.join();
  for (int w = 0; w < n; ++w)
    if (!errors[static_cast<std::size_t>(w)].empty()) {
      fmt::print(stderr, "switch_bench: worker {}: {}\n", w, errors[static_cast<std::size_t>(w)]);
      return 1;
    }

  nlohmann::json j;
  j["runs"] = nlohmann::json::array();
  for (std::size_t si = 0; si < sizes.size(); ++si) {
    // One all-reduce takes as long as its slowest worker; the median over reps.
    std::vector<double> per_rep;
    for (const auto& rep : times[si]) per_rep.push_back(*std::max_element(rep.begin(), rep.end()));
    std::sort(per_rep.begin(), per_rep.end());
    const double sec = per_rep[per_rep.size() / 2];
    std::uint64_t rt = 0;
    bool ok = true;
    for (int w = 0; w < n; ++w) {
      rt += retransmits[si][static_cast<std::size_t>(w)];
      ok = ok && correct[si][static_cast<std::size_t>(w)];
    }
    const double elems = static_cast<double>(sizes[si] / 4);
    j["runs"].push_back({{"mode", o.mode}, {"workers", n}, {"bytes", sizes[si]}, {"seconds", ok ? sec : 0.0},
                         {"elements_per_s", ok ? elems / sec : 0.0}, {"retransmits", rt}, {"correct", ok}, {"reps", o.reps}});
    fmt::print("{:<12} {:>3} {:>10} {:>10.4f} {:>14.3e} {:>10} {:>8}\n", o.mode, n, sizes[si], sec, elems / sec, rt, ok ? "yes" : "NO");
    std::fflush(stdout);
  }
  if (!o.out.empty()) gossip::bench::write_file(o.out, j.dump(2));
  for (const auto& r : j["runs"])
    if (!r["correct"].get<bool>()) return 1;
  return 0;
}

void enter(const run_options& o, int w) {
  if (!o.cpus.empty()) gossip::harness::pin_to_cpu(o.cpus[static_cast<std::size_t>(w) % o.cpus.size()]);  // best effort
  if (o.netns_prefix.empty()) return;
  const auto path = fmt::format("/var/run/netns/{}{}", o.netns_prefix, w);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0)
    throw std::runtime_error(fmt::format("worker {}: cannot enter network namespace {}: {}", w, path, std::strerror(errno)));
  ::close(fd);
}

// Async exactly-once check: every worker pushes `pushes` deltas whose values
// are multiples of the group size, then (after all are done) a zero delta that
// reads S/n back: it must equal the sum of every delta / n, exactly.
int async_check(const run_options& o, std::size_t elements, int pushes) {
  const int n = o.workers;
  std::barrier sync(n);
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::uint64_t> rt(static_cast<std::size_t>(n));
  auto delta = [&](std::size_t i, int w, int k) { return static_cast<float>(n * static_cast<int>((i * 3 + static_cast<std::size_t>(w) * 5 + static_cast<std::size_t>(k) * 7) % 11)); };
  std::vector<std::thread> threads;
  for (int w = 0; w < n; ++w)
    threads.emplace_back([&, w] {
      try {
        enter(o, w);
        client c({.address = o.address, .port = o.port, .group = o.group, .worker = static_cast<std::uint16_t>(w),
                  .members = static_cast<std::uint16_t>(n), .chunk = o.chunk, .window = o.window, .rto_s = o.rto_ms / 1000,
                  .timeout_s = o.timeout});
        std::vector<float> d(elements), avg(elements);
        for (int k = 0; k < pushes; ++k) {
          for (std::size_t i = 0; i < elements; ++i) d[i] = delta(i, w, k);
          c.push_delta(d, avg);
        }
        sync.arrive_and_wait();
        std::fill(d.begin(), d.end(), 0.0f);
        c.push_delta(d, avg);
        for (std::size_t i = 0; i < elements; ++i) {
          double ref = 0;
          for (int v = 0; v < n; ++v)
            for (int k = 0; k < pushes; ++k) ref += delta(i, v, k);
          if (avg[i] != static_cast<float>(ref / n)) {
            errors[static_cast<std::size_t>(w)] = fmt::format("element {}: S/n = {}, expected {} (a delta was lost or applied twice)", i, avg[i], ref / n);
            break;
          }
        }
        rt[static_cast<std::size_t>(w)] = c.counters().retransmits;
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(w)] = e.what();
        sync.arrive_and_drop();
      }
    });
  for (auto& t : threads) t.join();
  int rc = 0;
  for (int w = 0; w < n; ++w)
    if (!errors[static_cast<std::size_t>(w)].empty()) {
      fmt::print(stderr, "switch_bench async-check: worker {}: {}\n", w, errors[static_cast<std::size_t>(w)]);
      rc = 1;
    }
  std::uint64_t total = 0;
  for (auto r : rt) total += r;
  fmt::print("async-check: {} workers x {} deltas of {} values: {} (retransmits {})\n", n, pushes, elements, rc ? "WRONG" : "exact", total);
  return rc;
}

// Throws malformed and foreign packets at the aggregator from worker 0's
// place; prints how many of each, as JSON, so a test can match them against
// the switch's drop counters.
int fuzz(const run_options& o, int count, std::uint16_t elements_hint) {
  enter(o, 0);
  std::map<std::string, int> sent;
  auto open = [&](std::uint16_t port) {
    const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    ::inet_pton(AF_INET, o.address.c_str(), &a.sin_addr);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("fuzz: connect failed");
    return fd;
  };
  const int fd = open(o.port), other = open(static_cast<std::uint16_t>(o.port + 1));
  std::mt19937_64 rng(12345);
  std::vector<std::byte> p(1400);
  for (int i = 0; i < count; ++i) {
    packet_header h{.type = packet_type::sync_contribution, .group = o.group, .worker = 0, .slot = 0, .elements = elements_hint, .chunk = 0, .sequence = 1};
    std::size_t len = packet_bytes(elements_hint);
    std::string kind;
    switch (rng() % 9) {
      case 0: kind = "random"; len = 1 + rng() % 1300; for (std::size_t k = 0; k < len; ++k) p[k] = std::byte(rng() & 0xff); if (len >= 4) std::memset(p.data(), 0, 4); break;
      case 1: kind = "truncated"; len = rng() % sizeof(packet_header) + 1; std::memcpy(p.data(), &h, std::min(len, sizeof h)); break;
      case 2: kind = "short_payload"; std::memcpy(p.data(), &h, sizeof h); len = sizeof h + 4 * (rng() % elements_hint); break;
      case 3: kind = "oversized"; std::memcpy(p.data(), &h, sizeof h); len = std::min<std::size_t>(1400, packet_bytes(elements_hint) + 4 + 4 * (rng() % 40)); break;
      case 4: kind = "foreign_group"; h.group = static_cast<std::uint16_t>(o.group + 1000); std::memcpy(p.data(), &h, sizeof h); break;
      case 5: kind = "bad_worker"; h.worker = 64; std::memcpy(p.data(), &h, sizeof h); break;
      case 6: kind = "bad_version"; h.version = 9; std::memcpy(p.data(), &h, sizeof h); break;
      case 7: kind = "bad_elements"; h.elements = 0; std::memcpy(p.data(), &h, sizeof h); len = sizeof h; break;
      default: kind = "wrong_port"; std::memcpy(p.data(), &h, sizeof h); break;
    }
    const ssize_t r = ::send(kind == "wrong_port" ? other : fd, p.data(), len, 0);
    if (r == static_cast<ssize_t>(len)) ++sent[kind];
    if (i % 16 == 15) std::this_thread::sleep_for(std::chrono::microseconds(200));  // keep af_packet lossless
  }
  ::close(fd);
  ::close(other);
  nlohmann::json j = sent;
  int total = 0;
  for (const auto& [k, v] : sent) total += v;
  j["total"] = total;
  fmt::print("{}\n", j.dump());
  return 0;
}

int report(const std::vector<std::string>& inputs, const std::string& out) {
  nlohmann::json all;
  all["runs"] = nlohmann::json::array();
  if (!out.empty()) gossip::bench::check_out_file(out, "--out");
  for (const auto& p : inputs) {
    std::ifstream f(p);
    if (!f) {
      fmt::print(stderr, "switch_bench report: cannot read {}\n", p);
      return 1;
    }
    // What `run` writes: {"runs": [{"mode", "workers", "bytes", "seconds", "elements_per_s", "retransmits", "correct"}, …]}.
    const auto j = nlohmann::json::parse(f, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("runs") || !j["runs"].is_array())
      throw gossip::error(fmt::format("{}: not the JSON that `switch_bench run --out` writes (an object with a \"runs\" array)", p));
    for (const auto& r : j["runs"]) {
      static constexpr const char* counts[] = {"workers", "bytes", "retransmits"};
      static constexpr const char* numbers[] = {"seconds", "elements_per_s"};
      const bool typed = r.is_object() && r.contains("mode") && r["mode"].is_string() && r.contains("correct") && r["correct"].is_boolean() &&
                         std::all_of(std::begin(counts), std::end(counts), [&](const char* k) { return r.contains(k) && r[k].is_number_unsigned(); }) &&
                         std::all_of(std::begin(numbers), std::end(numbers), [&](const char* k) { return r.contains(k) && r[k].is_number(); });
      if (!typed)
        throw gossip::error(fmt::format("{}: a run without mode, workers, bytes, seconds, elements_per_s, retransmits (counts: integers "
                                        ">= 0) and correct: {}",
                                        p, r.dump()));
      all["runs"].push_back(r);
    }
  }
  std::map<std::pair<int, std::uint64_t>, std::map<std::string, double>> rate;
  bool all_correct = true;
  fmt::print("{:<12} {:>7} {:>10} {:>10} {:>14} {:>11} {:>8}\n", "mode", "workers", "bytes", "seconds", "elements/s", "retransmits", "correct");
  for (const auto& r : all["runs"]) {
    fmt::print("{:<12} {:>7} {:>10} {:>10.4f} {:>14.3e} {:>11} {:>8}\n", r["mode"].get<std::string>(), r["workers"].get<int>(),
               r["bytes"].get<std::uint64_t>(), r["seconds"].get<double>(), r["elements_per_s"].get<double>(), r["retransmits"].get<std::uint64_t>(),
               r["correct"].get<bool>() ? "yes" : "NO");
    all_correct = all_correct && r["correct"].get<bool>();
    if (r["correct"].get<bool>()) rate[{r["workers"].get<int>(), r["bytes"].get<std::uint64_t>()}][r["mode"].get<std::string>()] = r["elements_per_s"].get<double>();
  }
  // Speed-up of each aggregator over the host process, per size, and the geometric mean.
  nlohmann::json by_size = nlohmann::json::object(), by_size_udp = nlohmann::json::object();
  double log_sum = 0, log_sum_udp = 0;
  int count = 0, count_udp = 0;
  for (const auto& [key, modes] : rate) {
    const auto host = modes.find("host-udp");
    if (host == modes.end() || host->second <= 0) continue;
    const std::string k = fmt::format("{}x{}", key.first, key.second);
    if (auto d = modes.find("switch-dpdk"); d != modes.end()) {
      by_size[k] = d->second / host->second;
      log_sum += std::log(d->second / host->second);
      ++count;
    }
    if (auto u = modes.find("switch-udp"); u != modes.end()) {
      by_size_udp[k] = u->second / host->second;
      log_sum_udp += std::log(u->second / host->second);
      ++count_udp;
    }
  }
  // null: no size had both runs to compare.
  all["summary"] = {{"speedup_vs_host", count ? nlohmann::json(std::exp(log_sum / count)) : nlohmann::json(nullptr)},
                    {"speedup_vs_host_by_run", by_size},
                    {"switch_udp_speedup_vs_host", count_udp ? nlohmann::json(std::exp(log_sum_udp / count_udp)) : nlohmann::json(nullptr)},
                    {"switch_udp_speedup_vs_host_by_run", by_size_udp},
                    {"all_correct", all_correct}};
  const auto shown = [](const nlohmann::json& v) { return v.is_null() ? std::string("- (no size has both runs)") : fmt::format("{:.3f}", v.get<double>()); };
  fmt::print("\nspeedup_vs_host (geometric mean of gossip-switch / host-udp elements/s): {}\n", shown(all["summary"]["speedup_vs_host"]));
  fmt::print("switch_udp_speedup_vs_host (kernel process in the switch's position / host-udp): {}\n",
             shown(all["summary"]["switch_udp_speedup_vs_host"]));
  fmt::print("all results correct: {}\n", all_correct ? "yes" : "NO");
  if (!out.empty()) {
    gossip::bench::write_file(out, all.dump(2));
    fmt::print("wrote {}\n", out);
  }
  return all_correct ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"All-reduce through gossip-switch vs the same protocol aggregated by kernel-UDP processes."};
  app.name("switch_bench");
  app.option_defaults()->always_capture_default();  // --help shows every default
  app.require_subcommand(1);
  run_options o;
  auto* r = app.add_subcommand("run", "run N workers against the aggregator at --address and write their timings");
  r->add_option("--mode", o.mode, "label of what serves the group: switch-dpdk, switch-udp or host-udp");
  r->add_option("-n,--workers", o.workers, "workers (threads, one socket each)")->check(gossip::cli::integer_range(1, 64));
  r->add_option("--address", o.address, "the aggregator's IPv4 address");
  r->add_option("--port", o.port, "its UDP port");
  r->add_option("--group", o.group, "group id (a sync group of --workers members)");
  r->add_option("--chunk", o.chunk, "float32 values per packet (the group's chunk)");
  r->add_option("--window", o.window, "packets in flight per worker (the group's slots)");
  r->add_option("--sizes", o.sizes, "buffer sizes, e.g. 4K 64K 1M 16M 64M");
  r->add_option("--reps", o.reps, "timed repetitions per size (after one warm-up)")->check(gossip::cli::integer_range(1, 1000));
  r->add_option("--netns-prefix", o.netns_prefix, "worker i enters network namespace <prefix><i>");
  r->add_option("--cpus", o.cpus, "pin worker i to cpus[i % len]")->default_str("");
  r->add_option("--timeout", o.timeout, "seconds before an all-reduce gives up")->check(gossip::cli::number_range(0.001, 86400));
  r->add_option("--rto-ms", o.rto_ms, "first retransmission timeout")->check(gossip::cli::number_range(0.01, 60000));
  r->add_option("-o,--out", o.out, "JSON output");
  std::vector<std::string> inputs;
  std::string out;
  auto* rep = app.add_subcommand("report", "merge run outputs into one table and JSON with speedup_vs_host");
  rep->add_option("inputs", inputs, "JSON files written by run")->default_str("")->required();
  rep->add_option("-o,--out", out, "merged JSON output");
  std::size_t async_elements = 1000;
  int pushes = 20, fuzz_count = 1000;
  auto* ac = app.add_subcommand("async-check", "async group: every delta applied exactly once (checked through S/n)");
  auto* fz = app.add_subcommand("fuzz", "send malformed and foreign packets; print how many of each as JSON");
  for (auto* sc : {ac, fz}) {
    sc->add_option("-n,--workers", o.workers, "workers");
    sc->add_option("--address", o.address, "the aggregator's IPv4 address");
    sc->add_option("--port", o.port, "its UDP port");
    sc->add_option("--group", o.group, "group id");
    sc->add_option("--chunk", o.chunk, "float32 values per packet");
    sc->add_option("--window", o.window, "packets in flight");
    sc->add_option("--netns-prefix", o.netns_prefix, "worker i enters network namespace <prefix><i>");
    sc->add_option("--timeout", o.timeout, "seconds before giving up")->check(gossip::cli::number_range(0.001, 86400));
    sc->add_option("--rto-ms", o.rto_ms, "first retransmission timeout")->check(gossip::cli::number_range(0.01, 60000));
  }
  ac->add_option("--elements", async_elements, "model size (the group's elements)");
  ac->add_option("--pushes", pushes, "deltas per worker");
  fz->add_option("--count", fuzz_count, "packets to send");
  CLI11_PARSE(app, argc, argv);
  try {
    if (r->parsed()) return run(o);
    if (ac->parsed()) return async_check(o, async_elements, pushes);
    if (fz->parsed()) return fuzz(o, fuzz_count, o.chunk);
    return report(inputs, out);
  } catch (const std::exception& e) {
    fmt::print(stderr, "switch_bench: {}\n", e.what());
    return 1;
  }
}

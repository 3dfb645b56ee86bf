// bench/codec — encode + decode bandwidth of every codec against memcpy of the
// same bytes, in one run, at several model sizes.
//
//     build/bench/codec --out DIR          # 1, 16 and 64 MiB; DIR/codec.json
//     build/bench/codec --sizes 1 --repeats 3
//
// One measurement is what a send and its receipt cost on the step path: the
// sender encodes x − x̂ and updates its x̂, the receiver checks the payload and
// updates its own x̂. Bandwidth counts the fp32 model bytes (4 per value), so
// it compares directly with memcpy of the model. Before any speed is
// reported, each run checks that sender and receiver x̂ agree bit for bit and
// that the reconstruction error is within the codec's bound. lowrank sees the
// model as one matrix of --rows rows, warm-started as in a running stream
// (its check: the residual does not grow; its cost grows with --rank).
//
// traffic-share: memcpy's bytes (read and write the model: 2M for a model of
// M bytes) over the fewest bytes the codec's encode + decode must read and
// write, counted in values: what the codec would reach if it moved its bytes
// at memcpy's rate. fp16/int8: x, x̂ read and x̂ written on each side, the
// message written and read (5M + 2B for a message of B bytes); topk: x and
// x̂ read once to select, then 20 bytes per kept value and the message
// (2M + 20k + 2B); randomk: only the kept values (20k + 2B); lowrank: x and x̂
// read, both x̂ read and written (6M + 2B). A measured vs-memcpy near the
// share means the codec runs at memory speed; well below it, it computes.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_checks.hpp"
#include "../output.hpp"
#include "gossip/codec.hpp"
#include "gossip/error.hpp"
#include "codec_detail.hpp"  // the kernels' instruction sets

namespace {

using clock_type = std::chrono::steady_clock;

struct sample_stats {
  double mean = 0, sd = 0, min = 0, max = 0;
};
sample_stats summarize(const std::vector<double>& v) {
  sample_stats s;
  if (v.empty()) return s;
  for (double x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  for (double x : v) s.sd += (x - s.mean) * (x - s.mean);
  s.sd = v.size() > 1 ? std::sqrt(s.sd / static_cast<double>(v.size() - 1)) : 0.0;
  s.min = *std::min_element(v.begin(), v.end());
  s.max = *std::max_element(v.begin(), v.end());
  return s;
}

// The largest |x − x̂| / |x − x̂₀| allowed after one message, per codec
// (sparse codecs: checked on the kept values only, which arrive exactly).
void check(const std::string& name, const std::vector<float>& x, const std::vector<float>& base, const std::vector<float>& sender,
           const std::vector<float>& receiver, std::size_t block) {
  if (std::memcmp(sender.data(), receiver.data(), sender.size() * sizeof(float)) != 0)
    throw gossip::error(fmt::format("codec {}: sender and receiver x̂ differ after one message", name));
  const std::size_t n = x.size();
  if (name == "fp16") {
    for (std::size_t i = 0; i < n; ++i)
      if (std::fabs(x[i] - sender[i]) > std::fabs(x[i] - base[i]) * 0x1p-11f + 1e-6f)
        throw gossip::error(fmt::format("codec fp16: value {} off by more than 2^-11 of its change", i));
  } else if (name == "int8") {
    for (std::size_t b0 = 0; b0 < n; b0 += block) {
      const std::size_t e = std::min(n, b0 + block);
      float amax = 0;
      for (std::size_t i = b0; i < e; ++i) amax = std::max(amax, std::fabs(x[i] - base[i]));
      for (std::size_t i = b0; i < e; ++i)
        if (std::fabs(x[i] - sender[i]) > amax / 254.0f * 1.001f + 1e-6f)
          throw gossip::error(fmt::format("codec int8: value {} off by more than max/254 of its block", i));
    }
  } else if (name == "lowrank") {
    double before = 0, after = 0;
    for (std::size_t i = 0; i < n; ++i) {
      before += (static_cast<double>(x[i]) - base[i]) * (static_cast<double>(x[i]) - base[i]);
      after += (static_cast<double>(x[i]) - sender[i]) * (static_cast<double>(x[i]) - sender[i]);
    }
    if (!(after <= before)) throw gossip::error("codec lowrank: the residual grew after one message");
  } else {
    for (std::size_t i = 0; i < n; ++i)
      if (sender[i] != base[i] && sender[i] != base[i] + (x[i] - base[i]))
        throw gossip::error(fmt::format("codec {}: kept value {} did not arrive exactly", name, i));
  }
}

}  // namespace

namespace {
// The codecs the bench times, in its table's order.
const std::vector<std::string> codec_names = {"fp16", "int8", "topk", "randomk", "lowrank"};
int run(const std::vector<double>& sizes_mib, int repeats, const std::string& out_dir, double ratio, std::int64_t rank, std::int64_t rows,
        const std::string& isa, const std::vector<std::string>& codecs);
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench/codec: encode + decode bandwidth of each codec vs memcpy of the same bytes"};
  std::vector<double> sizes_mib = {1, 16, 64};
  int repeats = 7;
  std::string out_dir;
  double ratio = 0.01;
  std::int64_t rank = 4, rows = 1024;
  app.add_option("--sizes", sizes_mib, "model sizes in MiB (fp32)")->capture_default_str();
  app.add_option("--repeats", repeats, "timed repeats per size and codec (after one warm-up)")->capture_default_str()->check(gossip::cli::integer_range(1, 1000));
  app.add_option("--ratio", ratio, "topk/randomk ratio")->capture_default_str()->check(gossip::cli::number_range(1e-6, 1.0));
  app.add_option("--rank", rank, "lowrank rank")->capture_default_str()->check(gossip::cli::integer_range(1, 256));
  app.add_option("--rows", rows, "lowrank: rows of the model seen as one matrix (must divide every size)")->capture_default_str()->check(gossip::cli::integer_range(1, 1 << 20));
  app.add_option("--out", out_dir, "write DIR/codec.json (empty: no file)")->capture_default_str();
  std::string isa = "best";
  app.add_option("--isa", isa, "instruction set of the fp16, int8 and topk kernels: best (this CPU's), avx512, avx2, scalar, or all "
                               "(each this CPU has, fp16/int8/topk only below the best, in one run)")
      ->check(CLI::IsMember({"best", "avx512", "avx2", "scalar", "all"}));
  std::vector<std::string> codecs = codec_names;
  app.add_option("--codecs", codecs, "the codecs to time (default: all five)")->check(CLI::IsMember(codec_names));
  CLI11_PARSE(app, argc, argv);
  try {
    return run(sizes_mib, repeats, out_dir, ratio, rank, rows, isa, codecs);
  } catch (const std::exception&) {  // gossip::error and anything else (out of memory among them)
    return gossip::bench::report_error("the largest of --sizes needs about six copies of the model; pick smaller sizes");
  }
}

namespace {
int run(const std::vector<double>& sizes_mib, int repeats, const std::string& out_dir, double ratio, std::int64_t rank, std::int64_t rows,
        const std::string& isa, const std::vector<std::string>& codecs) {
  using gossip::detail::codec_isa;
  const codec_isa best_isa = gossip::detail::codec_isa_best();
  const auto isa_name = [](codec_isa l) { return l == codec_isa::avx512 ? "avx512" : l == codec_isa::avx2 ? "avx2" : "scalar"; };
  std::vector<codec_isa> levels;
  if (isa == "all") {
    for (int l = static_cast<int>(best_isa); l >= 0; --l) levels.push_back(static_cast<codec_isa>(l));
  } else if (isa == "best") {
    levels = {best_isa};
  } else {
    const codec_isa want = isa == "avx512" ? codec_isa::avx512 : isa == "avx2" ? codec_isa::avx2 : codec_isa::scalar;
    if (want > best_isa)
      throw gossip::config_error(fmt::format("--isa {}: this CPU's codec kernels go up to {}; pick that, a lower one, best or all", isa,
                                             isa_name(best_isa)));
    levels = {want};
  }
  // Every size is checked before the first is timed.
  for (const double mib : sizes_mib) {
    const double values = mib * 1024 * 1024 / sizeof(float);
    if (!(mib > 0) || !(mib <= 4096) || values < 1)
      throw gossip::config_error(fmt::format("--sizes {}: a model size must be a number of MiB in (0, 4096] holding at least one value", mib));
    const bool lowrank = std::find(codecs.begin(), codecs.end(), "lowrank") != codecs.end();
    if (lowrank && static_cast<std::size_t>(values) % static_cast<std::size_t>(rows) != 0)
      throw gossip::config_error(fmt::format("--rows {} (lowrank's rows, default 1024) does not divide a model of {} values ({} MiB); pick "
                                             "rows that divide every size, or leave lowrank out of --codecs",
                                             rows, static_cast<std::size_t>(values), mib));
  }
  if (!out_dir.empty()) {
    gossip::bench::prepare_out_dir(out_dir);
    gossip::bench::check_out_file((std::filesystem::path(out_dir) / "codec.json").string(), "--out");
  }

  struct codec_case {
    std::string name;
    gossip::component_config cfg;
  };
  std::vector<codec_case> cases;
  for (const std::string& n : codec_names) {
    if (std::find(codecs.begin(), codecs.end(), n) == codecs.end()) continue;
    gossip::component_config c{n, gossip::options("bench [codec]")};
    if (n == "topk" || n == "randomk") c.opts.set("ratio", ratio);
    if (n == "lowrank") c.opts.set("rank", rank);
    cases.push_back({n, c});
  }

  // Each codec once per level of kernels it has (int8 up to AVX-512, fp16
  // and topk up to AVX2, randomk and lowrank none: shown as "-").
  struct codec_run {
    codec_isa level;  // in use
    std::string label;
    const codec_case* cc;
  };
  std::vector<codec_run> runs;
  for (const auto& cc : cases) {
    const auto kind = gossip::make_codec(cc.cfg).settings().kind;
    std::vector<codec_isa> seen;
    for (const codec_isa level : levels) {
      const codec_isa k = gossip::detail::kernel_isa(kind, level);
      if (std::find(seen.begin(), seen.end(), k) != seen.end()) continue;
      seen.push_back(k);
      const bool kernels = gossip::detail::kernel_isa(kind, codec_isa::avx512) != codec_isa::scalar;
      runs.push_back({level, kernels ? isa_name(k) : "-", &cc});
    }
  }
  std::stable_sort(runs.begin(), runs.end(), [&](const codec_run& a, const codec_run& b) { return a.level > b.level; });

  nlohmann::json results = nlohmann::json::array();
  fmt::print("{:>8} {:<8} {:<7} {:>11} {:>11} {:>13} {:>13} {:>12} {:>7} {:>9} {:>13}\n", "MiB", "codec", "isa", "encode-ms", "decode-ms", "codec-GB/s",
             "memcpy-GB/s", "vs-memcpy", "best", "bytes-out", "traffic-share");
  for (const double mib : sizes_mib) {
    const auto n = static_cast<std::size_t>(mib * 1024 * 1024 / sizeof(float));
    std::mt19937_64 g(42);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    // x̂₀: the model at the last send; x: after some training steps (a change of ~1 %).
    std::vector<float> base(n), x(n);
    for (std::size_t i = 0; i < n; ++i) {
      base[i] = dist(g);
      x[i] = base[i] + 0.01f * dist(g);
    }
    std::vector<float> sender(n), receiver(n), copy(n);
    const auto matrix_rows = static_cast<std::size_t>(rows);
    for (const auto& run : runs) {
      const codec_case& cc = *run.cc;
      gossip::detail::use_codec_isa(run.level);
      auto c = gossip::make_codec(cc.cfg);
      const std::size_t mrows = cc.name == "lowrank" ? matrix_rows : 0;
      c.prepare(n, mrows ? mrows + n / mrows : gossip::codec::any_side);
      const std::size_t cap = c.segment_capacity(n);
      std::vector<std::uint64_t> wire((cap + 7) / 8);
      auto* out = reinterpret_cast<std::byte*>(wire.data());
      // A running stream's state: its first (absolute) message seeded it.
      std::vector<float> state(c.state_floats(n, mrows));
      (void)c.encode(x.data(), copy.data(), n, out, true, 1, mrows, state.data());
      std::vector<double> enc_s, dec_s, codec_gbps, memcpy_gbps, vs;
      double best_codec = INFINITY, best_memcpy = INFINITY;
      std::size_t bytes = 0;
      for (int r = -1; r < repeats; ++r) {
        std::memcpy(sender.data(), base.data(), n * sizeof(float));
        std::memcpy(receiver.data(), base.data(), n * sizeof(float));
        const auto t0 = clock_type::now();
        bytes = c.encode(x.data(), sender.data(), n, out, false, static_cast<std::uint64_t>(r + 2), mrows, state.data());
        const auto t1 = clock_type::now();
        const auto st = gossip::decode_segment({out, bytes}, receiver.data(), n, true);
        const auto t2 = clock_type::now();
        if (!st.ok()) throw gossip::error(fmt::format("codec {}: its own message was refused: {}", cc.name, st.problem));
        const auto t3 = clock_type::now();
        std::memcpy(copy.data(), x.data(), n * sizeof(float));
        const auto t4 = clock_type::now();
        if (copy[n / 2] != x[n / 2]) throw gossip::error("memcpy check failed");
        if (r < 0) {
          check(cc.name, x, base, sender, receiver, c.settings().block);
          continue;  // warm-up
        }
        const double e = std::chrono::duration<double>(t1 - t0).count(), d = std::chrono::duration<double>(t2 - t1).count();
        const double m = std::chrono::duration<double>(t4 - t3).count();
        const double model_bytes = static_cast<double>(n * sizeof(float));
        enc_s.push_back(e);
        dec_s.push_back(d);
        codec_gbps.push_back(model_bytes / (e + d) / 1e9);
        memcpy_gbps.push_back(model_bytes / m / 1e9);
        vs.push_back(m / (e + d));
        best_codec = std::min(best_codec, e + d);
        best_memcpy = std::min(best_memcpy, m);
      }
      const auto es = summarize(enc_s), ds = summarize(dec_s), cs = summarize(codec_gbps), ms = summarize(memcpy_gbps), v = summarize(vs);
      const double bytes_ratio = static_cast<double>(bytes) / static_cast<double>(n * sizeof(float));
      const double model = static_cast<double>(n * sizeof(float)), msg = static_cast<double>(bytes);
      const double kept_bytes = 20.0 * static_cast<double>(c.kept(n));
      const double moved = cc.name == "topk"      ? 2 * model + kept_bytes + 2 * msg
                           : cc.name == "randomk" ? kept_bytes + 2 * msg
                           : cc.name == "lowrank" ? 6 * model + 2 * msg
                                                  : 5 * model + 2 * msg;
      const double traffic_share = 2 * model / moved;
      const double best = best_memcpy / best_codec;
      fmt::print("{:>8g} {:<8} {:<7} {:>11.3f} {:>11.3f} {:>8.2f}±{:<4.2f} {:>8.2f}±{:<4.2f} {:>6.2f}±{:<5.2f} {:>7.2f} {:>9.4f} {:>13.2f}\n",
                 mib, cc.name, run.label, es.mean * 1e3, ds.mean * 1e3, cs.mean, cs.sd, ms.mean, ms.sd, v.mean, v.sd, best, bytes_ratio, traffic_share);
      auto js = [](const sample_stats& s) { return nlohmann::json{{"mean", s.mean}, {"sd", s.sd}, {"min", s.min}, {"max", s.max}}; };
      results.push_back({{"mib", mib},
                         {"codec", cc.name},
                         {"isa", run.label == "-" ? nlohmann::json() : nlohmann::json(run.label)},
                         {"options", cc.name == "int8"      ? nlohmann::json{{"block", c.settings().block}}
                                     : cc.name == "fp16"    ? nlohmann::json::object()
                                     : cc.name == "lowrank" ? nlohmann::json{{"rank", c.settings().rank}, {"rows", mrows}}
                                                            : nlohmann::json{{"ratio", c.settings().ratio}}},
                         {"encode_s", js(es)},
                         {"decode_s", js(ds)},
                         {"codec_gbps", js(cs)},
                         {"memcpy_gbps", js(ms)},
                         {"ratio_to_memcpy", js(v)},
                         {"ratio_to_memcpy_best", best},
                         {"encoded_bytes", bytes},
                         {"bytes_moved", moved},
                         {"traffic_share", traffic_share},
                         {"bytes_ratio", bytes_ratio}});
    }
  }
  fmt::print("(GB/s of the fp32 model; vs-memcpy = memcpy time / (encode + decode time), mean±sd over {} repeats; best = fastest memcpy /\n"
             " fastest encode + decode; bytes-out = encoded / fp32 bytes; traffic-share = memcpy's bytes / the bytes the codec must move)\n",
             repeats);
  if (!out_dir.empty()) {
    const auto path = (std::filesystem::path(out_dir) / "codec.json").string();
    gossip::bench::write_file(path, nlohmann::json{{"bench", "codec"}, {"repeats", repeats}, {"results", results}}.dump(2));
    fmt::print("wrote {}\n", path);
  }
  return 0;
}
}  // namespace

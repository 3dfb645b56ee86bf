#pragma once
// engine_settings and engine_spec from a config: [engine] keys checked and
// narrowed, the policy built through its registry, the codec checked against
// the transport (included by engine-inl.hpp).
#include <array>
#include <cstdint>
#include <utility>
#include <string_view>

#include "gossip/engine.hpp"

namespace gossip {

namespace detail {

// The [engine] settings with a range, in one place: engine_settings::from()
// checks a config's values against it before narrowing them (so 2^32 + 2 is
// refused rather than read as 2), check() the fields of settings filled in code.
struct engine_range {
  std::string_view key, field;  // the config key, the engine_settings member
  bool integer;
  double lo, hi;
  bool lo_open, hi_open;  // lo, hi themselves are outside the range
  std::string_view expected;
  double (*value)(const engine_settings&);
  bool admits(double v) const noexcept { return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi); }
};

// A deadline is steady_clock::now() + timeout in nanoseconds: bounded (a year) so that it cannot overflow.
inline constexpr std::array<engine_range, 7> engine_ranges{{
    {"timeout_s", "timeout", false, 0, 365.0 * 24 * 3600, true, false, "> 0 and at most 31536000 seconds (a year)",
     [](const engine_settings& s) { return s.timeout.count(); }},
    {"send_buffers", "send_buffers", true, 1, 16, false, false, "in 1..16", [](const engine_settings& s) { return double(s.send_buffers); }},
    // Preallocated when the engine is built, about 72 bytes an event: 1e8 is 7 GB per rank.
    {"trace_capacity", "trace_capacity", true, 0, 1e8, false, false, "in 0..100000000 (events preallocated per rank, about 72 bytes each)",
     [](const engine_settings& s) { return double(s.trace_capacity); }},
    {"trace_skips_every", "trace_skips_every", true, 1, std::numeric_limits<int>::max(), false, false, ">= 1",
     [](const engine_settings& s) { return double(s.trace_skips_every); }},
    {"finish_rounds", "finish_rounds", true, -1, std::numeric_limits<int>::max(), false, false, ">= 0, or -1 for automatic",
     [](const engine_settings& s) { return double(s.finish_rounds); }},
    {"max_lead", "max_lead", true, 0, double(std::int64_t{1} << 40), false, false, "in 0..2^40 (0: off)",
     [](const engine_settings& s) { return double(s.max_lead); }},
    {"momentum_beta", "momentum_beta", false, 0, 1, false, true, "in [0, 1)",
     [](const engine_settings& s) { return double(s.momentum_beta); }},
}};

inline const engine_range& engine_range_of(std::string_view key) {
  for (const auto& r : engine_ranges)
    if (r.key == key) return r;
  GOSSIP_ASSERT(false, "no range for [engine] key {}", key);
  return engine_ranges[0];
}

}  // namespace detail

inline engine_settings engine_settings::from(const options& o) {
  // The key's value, checked against its range before it is narrowed.
  const auto checked = [&](std::string_view key) -> double {
    const auto& r = detail::engine_range_of(key);
    if (r.integer) {
      const std::int64_t v = o.integer(key);
      if (!r.admits(static_cast<double>(v)))
        throw config_error(fmt::format("{}: key '{}' must be {}, got {}", o.where(key), key, r.expected, v));
      return static_cast<double>(v);
    }
    const double v = o.real(key);
    if (!r.admits(v))
      throw config_error(fmt::format("{}: key '{}' must be {}, got {}", o.where(key), key, r.expected, v));
    return v;
  };
  engine_settings s;
  s.timeout = std::chrono::duration<double>(checked("timeout_s"));
  s.send_buffers = static_cast<int>(checked("send_buffers"));
  s.trace_path = o.string("trace");
  s.trace_where = o.where("trace");
  checked("trace_capacity");
  s.trace_capacity = static_cast<std::size_t>(o.integer("trace_capacity"));  // exact: any int64 >= 0
  s.trace_skips_every = static_cast<int>(checked("trace_skips_every"));
  s.stats_path = o.string("stats");
  s.stats_where = o.where("stats");
  s.finish_rounds = static_cast<int>(checked("finish_rounds"));
  s.wait_when_busy = o.boolean("wait_when_busy");
  s.same_step_merge = o.boolean("same_step_merge");
  s.in_flight_makeup = o.boolean("in_flight_makeup");
  s.numerator_steps = o.boolean("numerator_steps");
  s.max_lead = static_cast<std::uint64_t>(checked("max_lead"));
  // A key that names one of three choices, or an error that lists them.
  const auto choice = [&]<class E>(std::string_view key, const std::array<std::pair<std::string_view, E>, 3>& choices) {
    const std::string v = o.string(key);
    for (const auto& [name, value] : choices)
      if (v == name) return value;
    throw config_error(fmt::format("{}: key '{}' must be \"{}\", \"{}\" or \"{}\", got \"{}\"", o.where(key), key, choices[0].first,
                                   choices[1].first, choices[2].first, v));
  };
  using mode = engine_settings::momentum_mode;
  s.momentum = choice("momentum", std::array<std::pair<std::string_view, mode>, 3>{
                                      {{"auto", mode::automatic}, {"quasi-global", mode::quasi_global}, {"local", mode::local}}});
  s.momentum_beta = static_cast<float>(checked("momentum_beta"));
  using merge = engine_settings::merge_momentum;
  s.momentum_merge = choice("momentum_merge", std::array<std::pair<std::string_view, merge>, 3>{
                                                  {{"auto", merge::automatic}, {"full", merge::full}, {"spread", merge::spread}}});
  // Named with where each key was set; check_with() refuses the same for settings filled in code.
  if (const char* other = s.numerator_conflict())
    throw config_error(fmt::format("{}: [engine] numerator_steps = true counts every optimizer step in full already; set {} to false",
                                   o.where("numerator_steps", other), other));
  return s;
}

inline const char* engine_settings::numerator_conflict() const noexcept {
  return !numerator_steps ? nullptr : in_flight_makeup ? "in_flight_makeup" : same_step_merge ? "same_step_merge" : nullptr;
}

inline void engine_settings::check_with(std::string_view transport, bool lockstep, std::string_view who) const {
  if (same_step_merge && !lockstep)
    throw config_error(fmt::format("{}: [engine] same_step_merge = true needs a transport whose ranks run in lockstep (loopback); "
                                   "transport '{}' merges messages as they arrive, with no step to merge them in: set it to false",
                                   who, transport));
  if (const char* other = numerator_conflict())
    throw config_error(fmt::format("{}: [engine] numerator_steps = true counts every optimizer step in full already; set {} to false", who,
                                   other));
}

inline void engine_settings::check_outputs(int rank, int world) const {
  check_output_path(stats_path, rank, world, "stats", stats_where);
  check_output_path(trace_path, rank, world, "trace", trace_where);
  if (same_output_file(stats_path, trace_path, rank))
    throw config_error(fmt::format("{}: [engine] stats = '{}' and trace = '{}' name the same file{}, and one would overwrite the other; "
                                   "give each a path of its own",
                                   stats_where == trace_where ? stats_where : stats_where + " and " + trace_where, stats_path, trace_path,
                                   world > 1 ? fmt::format(" for rank {}", rank) : std::string()));
}

inline void engine_settings::check() const {
  for (const auto& r : detail::engine_ranges)
    if (const double v = r.value(*this); !r.admits(v))
      throw config_error(fmt::format("engine_settings::{} must be {}, got {} (the config key [engine] {})", r.field, r.expected, v, r.key));
}

namespace detail {
/// A protocol that sums in the network needs a transport that aggregates (the
/// switch), and that transport sums nothing else: either way round the models
/// would be merged as what they are not.
inline void check_protocol_carrier(std::string_view protocol, bool aggregated, std::string_view transport, bool aggregates, std::string_view who) {
  if (aggregated && !aggregates)
    throw config_error(fmt::format("{}: protocol '{}' sums in the network and needs transport 'switch', not '{}'; over '{}' use push-sum, "
                                   "pairwise or stale-copy",
                                   who, protocol, transport, transport));
  if (!aggregated && aggregates)
    throw config_error(fmt::format("{}: transport '{}' sums what the ranks send and carries protocol 'switch-aggregate' only, not '{}'", who,
                                   transport, protocol));
}

/// numerator_steps and in_flight_makeup correct a push-sum sender's share in
/// flight, on host models; under another protocol, or for a model in device
/// memory, they would be ignored, so they are refused. `where(key)` names
/// where each was set.
template <class Where>
void refuse_outside_push_sum(const engine_settings& s, std::string_view protocol, bool device, const Where& where) {
  for (const auto& [on, key] : {std::pair{s.numerator_steps, "numerator_steps"}, std::pair{s.in_flight_makeup, "in_flight_makeup"}}) {
    if (on && protocol != "push-sum")
      throw config_error(fmt::format("{}: [engine] {} = true applies to protocol 'push-sum' (it corrects for the weight a send hands on), "
                                     "not to '{}': set it to false or use push-sum",
                                     where(key), key, protocol));
    if (on && device)
      throw config_error(fmt::format("{}: [engine] {} = true is not implemented for models in device memory: set it to false", where(key), key));
  }
}
}  // namespace detail

inline engine_spec engine_spec::from(const config& cfg) {
  engine_spec s;
  s.policy = policy_registry().make(cfg.policy.name, cfg.policy.opts);
  s.topology = cfg.topology;
  s.protocol = cfg.protocol;
  s.codec = cfg.codec;
  const gossip::codec c = make_codec(cfg.codec);  // an unknown name or key is refused here, with the file and key
  (void)protocol_registry().make(cfg.protocol.name, cfg.protocol.opts);  // and a protocol's (gamma's range), once rather than per rank
  if (c.compresses() && !c.automatic() && cfg.transport.name == "switch")
    throw config_error(fmt::format("{}: codec '{}' cannot be used with transport 'switch': the switch adds fp32 values and cannot sum "
                                   "compressed messages; set [codec] name = \"none\"",
                                   cfg.codec.opts.where(), cfg.codec.name));
  if (c.settings().step > 0 && cfg.protocol.name == "stale-copy")
    throw config_error(fmt::format("{}: [codec] step applies to the merges of push-sum and pairwise; protocol 'stale-copy' moves by "
                                   "[protocol] gamma instead (e.g. gamma = 0.1 with topk or randomk): set that, and leave step out",
                                   cfg.codec.opts.where("step")));
  // The transports whose keys the library knows: loopback's (ranges when the
  // fabric is built) and UCX's, which has none (UCX reads UCX_* variables).
  if (cfg.transport.name == "loopback") (void)cfg.transport.opts.resolved(loopback_option_specs(), "transport 'loopback'");
  if (cfg.transport.name == "ucx" && !cfg.transport.opts.values().empty()) {
    const auto& key = cfg.transport.opts.values().begin()->first;
    throw config_error(fmt::format("{}: transport 'ucx' takes no settings (key '{}'); UCX reads UCX_* environment variables, e.g. UCX_TLS, "
                                   "UCX_NET_DEVICES",
                                   cfg.transport.opts.where(key), key));
  }
  // The switch's protocol and topology mean nothing without the switch in the path.
  if (cfg.transport.name != "switch") {
    if (cfg.protocol.name == "switch-aggregate")
      throw config_error(fmt::format("{}: protocol 'switch-aggregate' needs transport 'switch' (the aggregation switch), but [transport] "
                                     "name is '{}'; over it use push-sum, pairwise or stale-copy",
                                     cfg.protocol.opts.where("name"), cfg.transport.name));
    if (cfg.topology.name == "switch")
      throw config_error(fmt::format("{}: topology 'switch' (every member of a switch group) needs transport 'switch', but [transport] "
                                     "name is '{}'; over it use e.g. exponential, ring or complete",
                                     cfg.topology.opts.where("name"), cfg.transport.name));
  }
  // The switch protocol's mode follows the policy unless the config names one,
  // in [protocol] or in [transport] (either one: the other follows it).
  if (s.protocol.name == "switch-aggregate") {
    const auto request = requested_switch_mode(cfg);
    const std::string& requested = request.mode;
    const bool staggered = staggered_policy(cfg.policy);
    if (staggered && requested == "sync")
      throw config_error(fmt::format("{}: mode 'sync' needs every member to send at the same steps, but policy 'periodic' has stagger = true; "
                                     "use mode = \"async\" or \"auto\", or stagger = false", request.where));
    // The shipped policies that decide on each member from what it alone sees:
    // their members post different numbers of all-reduces, and a sync round
    // would wait for the ones that never come.
    for (const std::string_view own : {"drift", "drift-lr", "drift-history", "budget", "adacomm"})
      if (requested == "sync" && cfg.policy.name == own)
        throw config_error(fmt::format("{}: mode 'sync' needs every member to send at the same steps, but policy '{}' decides on each "
                                       "member from its own drift or loss; use mode = \"async\" or \"auto\" (async for it), or a "
                                       "policy with a shared schedule (periodic, consensus)",
                                       request.where, own));
    s.protocol.opts.set("mode", switch_mode(requested, cfg.policy.name, staggered));
  }
  const options engine = cfg.engine.resolved(engine_option_specs(), "[engine]");
  s.settings = engine_settings::from(engine);
  detail::refuse_outside_push_sum(s.settings, s.protocol.name, false, [&](const char* key) { return engine.where(key); });
  s.config_settings = cfg.shared_settings();
  s.config_fingerprint = cfg.fingerprint();
  return s;
}

}  // namespace gossip

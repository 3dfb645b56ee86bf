// Registries of the shipped topologies and protocols.
#include <utility>
#include <vector>

#include "gossip/config.hpp"
#include "gossip/protocol.hpp"
#include "gossip/topology.hpp"

namespace gossip {

topology_registry_t& topology_registry() {
  static topology_registry_t r = [] {
    topology_registry_t t("topology");
    t.add({"ring", "both ring neighbours every round", {}, [](const options&, int rank, int world) {
             return topology(topologies::ring(rank, world), rank, world, "ring");
           }});
    t.add({"exponential", "one peer per round, 2^k hops ahead, k cycling (SGP's time-varying exponential graph)", {},
           [](const options&, int rank, int world) {
             return topology(topologies::exponential(rank, world), rank, world, "exponential");
           }});
    t.add({"random", "one uniformly random peer per round, identical on every rank for a seed",
           {{"seed", std::int64_t{1}, "seed shared by all ranks"}},
           [](const options& o, int rank, int world) {
             return topology(topologies::random(rank, world, static_cast<std::uint64_t>(o.integer("seed"))), rank, world, "random");
           }});
    t.add({"complete", "every other rank every round", {}, [](const options&, int rank, int world) {
             return topology(topologies::complete(rank, world), rank, world, "complete");
           }});
    t.add({"edges", "an explicit edge list",
           {{"edges", int_list{}, "flattened pairs [a0, b0, a1, b1, …] or nested [[a, b], …]"},
            {"directed", false, "edges go one way (a sends to b) instead of both; a path must still lead from every rank to every other"}},
           [](const options& o, int rank, int world) {
             const auto& flat = o.integers("edges");
             if ((flat.empty() && world > 1) || flat.size() % 2 != 0)  // a world of one has no edge to list
               throw config_error(fmt::format("{}: key 'edges' must list pairs of ranks, e.g. [[0, 1], [1, 2]]; got {} integers",
                                              o.where("edges"), flat.size()));
             std::vector<std::pair<int, int>> list;
             for (std::size_t i = 0; i < flat.size(); i += 2) {
               // Checked before narrowing to int: 2^32 + 1 is not rank 1.
               if (flat[i] < 0 || flat[i] >= world || flat[i + 1] < 0 || flat[i + 1] >= world)
                 throw config_error(fmt::format("{}: edge [{}, {}] is invalid for a world of {} ranks (ranks are 0..{}, no self-loops)",
                                                o.where("edges"), flat[i], flat[i + 1], world, world - 1));
               list.emplace_back(static_cast<int>(flat[i]), static_cast<int>(flat[i + 1]));
             }
             return topology(topologies::edges(rank, world, list, o.boolean("directed"), o.where("edges")), rank, world, "edges");
           }});
    return t;
  }();
  return r;
}

protocol_registry_t& protocol_registry() {
  static protocol_registry_t r = [] {
    protocol_registry_t p("protocol");
    p.add({"push-sum", "halve (x, w), ship one half, receivers add; unbiased under any skipping", {},
           [](const options&) { return protocol(protocol::kind::push_sum, 1.0, "push-sum"); }});
    p.add({"pairwise", "average with each received model", {},
           [](const options&) { return protocol(protocol::kind::pairwise, 1.0, "pairwise"); }});
    p.add({"stale-copy", "CHOCO-style: mix with the latest copy of every neighbour",
           {{"gamma", 1.0, "consensus step size (0 < gamma <= 1)"}},
           [](const options& o) {
             const double g = o.real("gamma");
             if (!(g > 0 && g <= 1)) throw config_error(fmt::format("{}: key 'gamma' must be in (0, 1], got {}", o.where("gamma"), g));
             return protocol(protocol::kind::stale_copy, g, "stale-copy");
           }});
    p.add({"switch-aggregate", "through an aggregation switch: all-reduce (sync) or shared aggregate of deltas (async); transport 'switch'",
           {{"mode", std::string("auto"), "sync, async, or auto (periodic and consensus: sync; others: async)"},
            {"gamma", 1.0, "step towards the group average (0 < gamma <= 1)"}},
           [](const options& o) {
             const double g = o.real("gamma");
             if (!(g > 0 && g <= 1)) throw config_error(fmt::format("{}: key 'gamma' must be in (0, 1], got {}", o.where("gamma"), g));
             const auto& m = o.string("mode");
             check_switch_mode(m, o.where("mode"));
             // "auto" reaching here was not resolved from a config's policy (engine built in code): async.
             return protocol(protocol::kind::switch_aggregate, g, "switch-aggregate",
                             m == "sync" ? protocol::payload::model : protocol::payload::delta);
           }});
    return p;
  }();
  return r;
}

const std::vector<option_spec>& engine_option_specs() {
  static const std::vector<option_spec> specs = {
      {"timeout_s", 60.0, "bound on every wait for a peer, in seconds (> 0, at most a year)", "GOSSIP_TIMEOUT_S"},
      {"send_buffers", std::int64_t{2}, "send buffers for transports that send from them in the background (1..16)", ""},
      {"trace", std::string{}, "write a Chrome-trace/Perfetto JSON of decisions here ({rank} is replaced)", "GOSSIP_TRACE"},
      {"trace_capacity", std::int64_t{100000}, "events kept at most per rank (preallocated; 0..100000000)", ""},
      {"trace_skips_every", std::int64_t{1}, "record every n-th skipped step (sends are always recorded)", ""},
      {"stats", std::string{}, "write the JSON stats report here at finish() ({rank} is replaced)", "GOSSIP_STATS"},
      {"finish_rounds", std::int64_t{-1}, "forced exchange rounds in finish(); -1: 2*ceil(log2 world)", ""},
      {"wait_when_busy", false, "when the policy fires but every send buffer is still on the wire, wait (true) or skip the send (false)",
       "GOSSIP_WAIT_WHEN_BUSY"},
      {"same_step_merge", false,
       "lockstep transports (loopback): merge a step's messages before step() returns instead of at the next step, so the push-sum "
       "share a send gave away is back before the next optimizer step (gossip every tau steps otherwise learns at 1 - 1/(2 tau) of "
       "the rate)",
       ""},
      {"in_flight_makeup", false,
       "push-sum: the step after a send adds what its share missed while in flight (the optimizer step before the target merged "
       "it), so gossip every tau steps learns at the full rate instead of 1 - 1/(2 tau); fused into the next merge or drift pass "
       "(host models; nothing to make up with same_step_merge)",
       ""},
      {"numerator_steps", false,
       "push-sum: every optimizer step counts in full in the rank's push-sum numerator whatever its weight (as Stochastic Gradient "
       "Push), so shares in flight for any number of steps cost the ranks' average nothing; below weight 1/2 a step counts at 2w (z "
       "moves at most twice the optimizer's step); keeps x_{t-1} (one more model copy); host models; not with in_flight_makeup or "
       "same_step_merge",
       ""},
      {"momentum", std::string("auto"),
       "momentum buffers the model registered: quasi-global (rebuilt from the model's actual displacement, gossip included), local (left "
       "alone), or auto (quasi-global where ranks merge in lockstep: loopback threads, the switch's sync all-reduce; local over "
       "asynchronous exchanges (UCX, the switch's async aggregate), for a fixed period of 1 between peers and under stale-copy; host and "
       "device models alike)",
       "GOSSIP_MOMENTUM"},
      {"max_lead", std::int64_t{4},
       "wait at a step while this rank is more than max_lead steps ahead of its slowest live source, as heard in the step beacons the "
       "transport sends every max_lead/2 steps and in model headers (0: never; peer-to-peer transports only): bounds how far processes "
       "drift apart, and with it stale merges and push-sum weight skew. A wait that reaches timeout_s gives up and training goes on "
       "unpaced",
       "GOSSIP_MAX_LEAD"},
      {"momentum_beta", 0.9, "β of quasi-global momentum, in [0, 1): use the optimizer's momentum factor", ""},
      {"momentum_merge", std::string("auto"),
       "how much of a merge quasi-global momentum carries on: full (Lin et al.), spread (a merge after tau steps counts "
       "min(1, 1/(2*(1-beta)*tau)) of it; stable for any fixed period), or auto (full for a closed-loop policy, "
       "consensus; spread for every other)",
       ""},
  };
  return specs;
}

const std::vector<option_spec>& loopback_option_specs() {
  static const std::vector<option_spec> specs = {
      {"bandwidth_gbps", 0.0, "emulated per-rank link bandwidth in Gbit/s (0: unlimited, else 0.001..1e6)", "GOSSIP_LOOPBACK_GBPS"},
      {"latency_us", 0.0, "emulated one-way latency in microseconds (0..1e7; 0: none)", "GOSSIP_LOOPBACK_LATENCY_US"},
  };
  return specs;
}

}  // namespace gossip

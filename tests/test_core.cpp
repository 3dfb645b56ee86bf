#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "gossip/did_you_mean.hpp"
#include "cli_checks.hpp"
#include "output_file.hpp"
#include "gossip/gossip.hpp"

using namespace gossip;

TEST_CASE("options are checked against their specs") {
  const std::vector<option_spec> specs = {{"threshold", 0.1, "fire above"}, {"every", std::int64_t{1}, "period"}, {"relative", true, "rel"}};
  options o("run.toml [policy]");
  o.set("threshold", std::int64_t{2});
  auto r = o.resolved(specs, "policy 'drift'");
  CHECK(r.real("threshold") == 2.0);  // an integer is widened to a number
  CHECK(r.integer("every") == 1);
  CHECK(r.boolean("relative"));

  options bad("run.toml [policy]");
  bad.set("treshold", 0.5);
  CHECK_THROWS_WITH_AS(bad.resolved(specs, "policy 'drift'"),
                       "run.toml [policy]: unknown key 'treshold' for policy 'drift' (did you mean 'threshold'?); known keys: threshold, every, relative",
                       config_error);
  options far("run.toml [policy]");
  far.set("colour", 0.5);
  CHECK_THROWS_WITH_AS(far.resolved(specs, "policy 'drift'"),
                       "run.toml [policy]: unknown key 'colour' for policy 'drift'; known keys: threshold, every, relative", config_error);
  options typed("run.toml [policy]");
  typed.set("every", std::string("often"));
  CHECK_THROWS_WITH_AS(typed.resolved(specs, "policy 'drift'"),
                       "run.toml [policy]: key 'every' of policy 'drift' must be an integer (default 1), got string \"often\"", config_error);
}

TEST_CASE("an environment variable overrides the file for specs that name one") {
  const std::vector<option_spec> specs = {{"timeout_s", 60.0, "bound", "GOSSIP_TEST_TIMEOUT"}};
  ::setenv("GOSSIP_TEST_TIMEOUT", "2.5", 1);
  options o("x");
  o.set("timeout_s", 10.0);
  CHECK(o.resolved(specs, "[engine]").real("timeout_s") == 2.5);
  ::setenv("GOSSIP_TEST_TIMEOUT", "soon", 1);
  CHECK_THROWS_WITH_AS(o.resolved(specs, "[engine]"), doctest::Contains("GOSSIP_TEST_TIMEOUT=soon (for key 'timeout_s'): expected a number"), config_error);
  // Decimal, as TOML writes numbers: spaces on either side and a '+' are taken, hex is not.
  for (const char* text : {" 5", "5 ", "+5", "5e0"}) {
    ::setenv("GOSSIP_TEST_TIMEOUT", text, 1);
    CHECK(o.resolved(specs, "[engine]").real("timeout_s") == 5.0);
  }
  for (const char* text : {"0x10", "5s", " "}) {  // (an empty variable counts as unset)
    ::setenv("GOSSIP_TEST_TIMEOUT", text, 1);
    CHECK_THROWS_AS(o.resolved(specs, "[engine]"), config_error);
  }
  const std::vector<option_spec> counts = {{"max_lead", std::int64_t{4}, "bound", "GOSSIP_TEST_LEAD"}};
  options c("x");
  for (const char* text : {" 3", "3 ", "+3"}) {
    ::setenv("GOSSIP_TEST_LEAD", text, 1);
    CHECK(c.resolved(counts, "[engine]").integer("max_lead") == 3);
  }
  for (const char* text : {"0x10", "3.0", "3 4"}) {
    ::setenv("GOSSIP_TEST_LEAD", text, 1);
    CHECK_THROWS_AS(c.resolved(counts, "[engine]"), config_error);
  }
  ::unsetenv("GOSSIP_TEST_LEAD");
  // The variable overrides the file, but not a command-line override that says otherwise.
  ::setenv("GOSSIP_TEST_TIMEOUT", "2.5", 1);
  options cli("x");
  cli.set("timeout_s", 10.0, "--set engine.timeout_s=10");
  CHECK_THROWS_WITH_AS(cli.resolved(specs, "[engine]"),
                       doctest::Contains("--set engine.timeout_s=10 and environment variable GOSSIP_TEST_TIMEOUT=2.5 both set key 'timeout_s'"),
                       config_error);
  cli.set("timeout_s", 2.5, "--set engine.timeout_s=2.5");
  CHECK(cli.resolved(specs, "[engine]").where("timeout_s") == "--set engine.timeout_s=2.5");
  ::unsetenv("GOSSIP_TEST_TIMEOUT");
  // A value from the environment is blamed on the environment, not on the file.
  ::setenv("GOSSIP_TIMEOUT_S", "-1", 1);
  CHECK_THROWS_WITH_AS(engine_spec::from(config::parse("[engine]\ntimeout_s = 5\n", "run.toml")),
                       "environment variable GOSSIP_TIMEOUT_S=-1: key 'timeout_s' must be > 0 and at most 31536000 seconds (a year), got -1", config_error);
  ::unsetenv("GOSSIP_TIMEOUT_S");
}

TEST_CASE("config files: sections, components and application sections") {
  const auto cfg = config::parse(R"(
[policy]
name = "drift"
threshold = 0.05
[topology]
name = "edges"
edges = [[0, 1], [1, 2]]
[train]
epochs = 3
)", "run.toml", {"train"});
  CHECK(cfg.policy.name == "drift");
  CHECK(cfg.policy.opts.real("threshold") == 0.05);
  CHECK(cfg.topology.opts.integers("edges") == int_list{0, 1, 1, 2});
  const std::vector<option_spec> train = {{"epochs", std::int64_t{1}, "epochs"}, {"batch", std::int64_t{32}, "batch"}};
  const auto t = cfg.section("train", train);
  CHECK(t.integer("epochs") == 3);
  CHECK(t.integer("batch") == 32);
  CHECK(cfg.fingerprint() == config::parse("[policy]\nname = \"drift\"\n[topology]\nname = \"edges\"\nedges = [[0, 1], [1, 2]]\n", "b").fingerprint());
  CHECK(cfg.fingerprint() != config::parse("[policy]\nname = \"periodic\"\n", "c").fingerprint());
}

TEST_CASE("malformed config files name the file, the key and what is expected") {
  CHECK_THROWS_WITH_AS(config::parse("[policy\nname = 1", "bad.toml"), doctest::Contains("bad.toml:1:"), config_error);
  CHECK_THROWS_WITH_AS(config::parse("[policy]\nname = 3\n", "bad.toml"), "bad.toml [policy]: key 'name' must be a string", config_error);
  CHECK_THROWS_WITH_AS(config::parse("threshold = 3\n", "bad.toml"),
                       "bad.toml: top-level key 'threshold' must be inside a section; known sections: policy, topology, protocol, transport, codec, engine",
                       config_error);
  CHECK_THROWS_WITH_AS(config::load("/nonexistent/run.toml"), doctest::Contains("/nonexistent/run.toml: cannot open the config file"), config_error);
  CHECK_THROWS_WITH_AS(config::load("/tmp"), "/tmp: is a directory, not a config file; give the path of a .toml file", config_error);
  // A GOSSIP_CONFIG left pointing nowhere is named as the variable.
  ::setenv("GOSSIP_CONFIG", "/nonexistent/run.toml", 1);
  CHECK_THROWS_WITH_AS(config::from_env(), doctest::Contains("GOSSIP_CONFIG=/nonexistent/run.toml: no such file"), config_error);
  ::unsetenv("GOSSIP_CONFIG");
  // A device read without end stops at 1 MiB instead of filling memory.
  CHECK_THROWS_WITH_AS(config::load("/dev/zero"), doctest::Contains("/dev/zero: more than 1048576 bytes"), config_error);
  CHECK_THROWS_WITH_AS(config::parse("[[policy]]\nname = \"drift\"\n", "bad.toml"),
                       "bad.toml: [[policy]] is a list of tables; write it once as [policy]", config_error);
  // A nested list is a pair (edges): [[0, 1, 2], [3]] would otherwise be read as the pairs (0, 1), (2, 3).
  CHECK_THROWS_WITH_AS(config::parse("[topology]\nname = \"edges\"\nedges = [[0, 1, 2], [3]]\n", "bad.toml"),
                       doctest::Contains("bad.toml [topology]: key 'edges' holds a nested list of 3 values"), config_error);
  // Only edges takes pairs; elsewhere, or mixed with integers, nested lists are refused rather than flattened.
  CHECK_THROWS_WITH_AS(config::parse("[policy]\nx = [[256]]\n", "bad.toml"), doctest::Contains("key 'x' holds nested lists; only [topology] edges"),
                       config_error);
  CHECK_THROWS_WITH_AS(config::parse("[train]\nhidden = [[1, 2]]\n", "bad.toml", {"train"}), doctest::Contains("key 'hidden' holds nested lists"),
                       config_error);
  CHECK_THROWS_WITH_AS(config::parse("[topology]\nname = \"edges\"\nedges = [[0, 1], 2, 3]\n", "bad.toml"),
                       doctest::Contains("key 'edges' mixes integers and nested lists"), config_error);

  const auto unknown = config::parse("[policy]\nname = \"sometimes\"\n", "run.toml");
  CHECK_THROWS_WITH_AS(engine_spec::from(unknown),
                       "run.toml [policy]: unknown policy 'sometimes'; known policies: periodic, drift, drift-lr, consensus, drift-history, budget, adacomm, never",
                       config_error);
  const auto typed = config::parse("[policy]\nname = \"drift\"\nthreshold = \"high\"\n", "run.toml");
  CHECK_THROWS_WITH_AS(engine_spec::from(typed), doctest::Contains("run.toml [policy]: key 'threshold' of policy 'drift' must be a number"), config_error);
  const auto engine_bad = config::parse("[engine]\ntimeout_s = -1\n", "run.toml");
  CHECK_THROWS_WITH_AS(engine_spec::from(engine_bad), "run.toml [engine]: key 'timeout_s' must be > 0 and at most 31536000 seconds (a year), got -1", config_error);
  // Found by fuzz/fuzz_config: an infinite timeout overflowed every wait's deadline, and
  // integers were narrowed before their range check (2^32 + 2 buffers read as 2).
  CHECK_THROWS_WITH_AS(engine_spec::from(config::parse("[engine]\ntimeout_s = inf\n", "run.toml")),
                       doctest::Contains("key 'timeout_s' must be > 0 and at most 31536000 seconds (a year), got inf"), config_error);
  CHECK_THROWS_WITH_AS(engine_spec::from(config::parse("[engine]\nsend_buffers = 4294967298\n", "run.toml")),
                       "run.toml [engine]: key 'send_buffers' must be in 1..16, got 4294967298", config_error);
  CHECK_THROWS_WITH_AS(engine_spec::from(config::parse("[engine]\ntrace_capacity = -1\n", "run.toml")),
                       "run.toml [engine]: key 'trace_capacity' must be in 0..100000000 (events preallocated per rank, about 72 bytes each), got -1",
                       config_error);
  CHECK_THROWS_AS(engine_spec::from(config::parse("[engine]\nfinish_rounds = 4294967296\n", "run.toml")), config_error);
  // The switch's protocol and topology are refused without the switch transport.
  CHECK_THROWS_WITH_AS(engine_spec::from(config::parse("[protocol]\nname = \"switch-aggregate\"\n", "run.toml")),
                       doctest::Contains("run.toml [protocol]: protocol 'switch-aggregate' needs transport 'switch'"), config_error);
  CHECK_THROWS_WITH_AS(engine_spec::from(config::parse("[topology]\nname = \"switch\"\n[transport]\nname = \"ucx\"\n", "run.toml")),
                       doctest::Contains("run.toml [topology]: topology 'switch' (every member of a switch group) needs transport 'switch', but "
                                         "[transport] name is 'ucx'"),
                       config_error);
  const auto engine_key = config::parse("[engine]\ntimeuot_s = 1\n", "run.toml");
  CHECK_THROWS_WITH_AS(engine_spec::from(engine_key), doctest::Contains("unknown key 'timeuot_s' for [engine] (did you mean 'timeout_s'?); known keys: timeout_s,"), config_error);
}

TEST_CASE("layouts: the first difference is named") {
  model_layout a{{"w", 10, dtype::f32}, {"b", 2, dtype::f32}};
  CHECK_FALSE(layout_difference(a, a));
  auto b = a;
  b[1].name = "bias";
  CHECK(*layout_difference(a, b) == "tensor #1 is named 'b' here but 'bias' there");
  b = a;
  b[0].dtype = dtype::f16;
  CHECK(*layout_difference(a, b) == "tensor #0 'w' is f32 here but f16 there");
  b = a;
  a[0].rows = 2;  // a 2x5 weight against a 5x2 one: the same count, a different shape
  b[0].rows = 5;
  CHECK(*layout_difference(a, b) == "tensor #0 'w' is a matrix of 2 rows x 5 columns here but a matrix of 5 rows x 2 columns there");
  CHECK(fingerprint(a) != fingerprint(b));
  b[0].rows = 0;
  CHECK(*layout_difference(a, b) == "tensor #0 'w' is a matrix of 2 rows x 5 columns here but not declared a matrix there");
  a[0].rows = 0;
  b = a;
  b.pop_back();
  CHECK(*layout_difference(a, b) == "the model has 2 tensors here but 1 there (first unmatched: 'b')");
  CHECK_THROWS_WITH_AS(check_layouts(a, 0, b, 3), doctest::Contains("model layout of rank 0 does not match rank 3"), layout_error);
  CHECK(fingerprint(a) == fingerprint(model_layout(a)));
  CHECK(fingerprint(a) != fingerprint(b));
}

TEST_CASE("model_view refuses ambiguous tensors") {
  std::vector<float> x(3);
  model_view v;
  v.add("w", x);
  CHECK_THROWS_WITH_AS(v.add("w", x), doctest::Contains("tensor name 'w' is used twice"), error);
  CHECK_THROWS_WITH_AS(v.add("", x), doctest::Contains("empty name"), error);
  CHECK(v.bytes() == 12);
  // The same memory twice would be merged twice at every exchange.
  CHECK_THROWS_WITH_AS(v.add("w2", x), doctest::Contains("tensor 'w2' shares memory with tensor 'w'"), error);
  CHECK_THROWS_WITH_AS(v.add("tail", std::span<float>(x).subspan(2)), doctest::Contains("shares memory with tensor 'w'"), error);
  std::vector<float> y(4);
  v.add("a", std::span<float>(y).first(2)).add("b", std::span<float>(y).subspan(2));  // adjacent, not overlapping
  v.add("empty", std::span<float>(y).first(0));
  CHECK(v.size() == 4);
  CHECK_THROWS_WITH_AS(v.momentum("a", std::span<float>(y).subspan(2)), doctest::Contains("momentum buffer of tensor 'a' shares memory with tensor 'b'"),
                       error);
  std::vector<float> m(3);
  v.momentum("a", std::span<float>(m).first(2));
  v.momentum("a", std::span<float>(m).first(2));  // registered again: the same tensor's buffer
  CHECK_THROWS_WITH_AS(v.momentum("b", std::span<float>(m).subspan(1)),
                       doctest::Contains("momentum buffer of tensor 'b' shares memory with the momentum buffer of tensor 'a'"), error);
  CHECK_THROWS_WITH_AS(v.add("c", std::span<float>(m).subspan(1)), doctest::Contains("tensor 'c' shares memory with the momentum buffer of tensor 'a'"),
                       error);
}

TEST_CASE("model_view: many small tensors, each checked against all the others") {
  // One value per tensor, adjacent in one block: the checks are by sorted
  // ranges and a name index, so a model of many tiny tensors registers at once.
  constexpr std::size_t n = 100000;
  std::vector<float> x(n), m(n);
  model_view v;
  for (std::size_t i = 0; i < n; ++i) v.add(fmt::format("t{}", i), std::span<float>(x).subspan(i, 1));
  for (std::size_t i = 0; i < n; ++i) v.momentum(fmt::format("t{}", i), std::span<float>(m).subspan(i, 1));
  CHECK(v.size() == n);
  CHECK(v.find("t54321") == std::optional<std::size_t>(54321));
  CHECK_FALSE(v.find("t100000"));
  CHECK(v[54321].momentum == &m[54321]);
  // An overlap in the middle of the block names the tensor it hits.
  CHECK_THROWS_WITH_AS(v.add("late", std::span<float>(x).subspan(54321, 1)), doctest::Contains("shares memory with tensor 't54321'"), error);
  CHECK_THROWS_WITH_AS(v.add("wide", std::span<float>(m).subspan(70000, 5)),
                       doctest::Contains("shares memory with the momentum buffer of tensor 't7000"), error);
  CHECK_THROWS_WITH_AS(v.momentum("t1", std::span<float>(x).subspan(99999, 1)), doctest::Contains("shares memory with tensor 't99999'"), error);
  CHECK_THROWS_WITH_AS(v.momentum("nope", std::span<float>(x).first(1)), doctest::Contains("no tensor has that name"), error);
}

TEST_CASE("an integer key given a float with nothing after the point says how to write it") {
  auto cfg = config::parse("[codec]\nname = \"lowrank\"\nrank = 4.0\n", "run.toml");
  CHECK_THROWS_WITH_AS((void)engine_spec::from(cfg),
                       doctest::Contains("run.toml [codec]: key 'rank' of codec 'lowrank' must be an integer (default 4), got the float 4.0; write "
                                         "it without the point (4)"),
                       config_error);
  options o("here");
  o.set("n", 3.0);
  CHECK_THROWS_WITH_AS((void)o.integer("n"), doctest::Contains("got the float 3.0; write it without the point (3)"), config_error);
  o.set("m", 3.5);
  CHECK_THROWS_WITH_AS((void)o.integer("m"), doctest::Contains("must be an integer, got number 3.5"), config_error);
}

TEST_CASE("command-line overrides: section.key=value in TOML syntax") {
  auto cfg = config::parse("[policy]\nname = \"drift\"\nthreshold = 0.05\n[train]\nepochs = 3\n", "run.toml", {"train"});
  cfg.apply_override("policy.threshold=0.1");
  cfg.apply_override("train.epochs=1");
  cfg.apply_override("train.partition=by_label");  // a bare word is a string
  cfg.apply_override("topology.name=ring");
  cfg.apply_override("engine.timeout_s=5");
  CHECK(cfg.policy.opts.real("threshold") == 0.1);
  CHECK(cfg.sections.at("train").integer("epochs") == 1);
  CHECK(cfg.sections.at("train").string("partition") == "by_label");
  CHECK(cfg.topology.name == "ring");
  CHECK(cfg.engine.real("timeout_s") == 5.0);
  // Switching the policy drops the file's settings for the old one; a --set
  // key stays, and the new policy refuses it by name if it has no such key.
  cfg.apply_override("policy.name=periodic");
  CHECK(cfg.policy.name == "periodic");
  CHECK(cfg.policy.opts.where("threshold") == "--set policy.threshold=0.1");
  CHECK_THROWS_WITH_AS(engine_spec::from(cfg), doctest::Contains("--set policy.threshold=0.1: unknown key 'threshold' for policy 'periodic'"),
                       config_error);
  auto from_file = config::parse("[policy]\nname = \"drift\"\nthreshold = 0.05\n", "run.toml");
  from_file.apply_override("policy.name=periodic");
  CHECK_FALSE(from_file.policy.opts.has("threshold"));
  CHECK_NOTHROW((void)engine_spec::from(from_file));
  // A --set key stays, whatever the order of the --set options: the new
  // component takes it, or refuses it by name, as it would the other order;
  // the old component's keys from the file go.
  auto order = config::parse("[policy]\nname = \"drift\"\nthreshold = 0.05\n", "run.toml");
  order.apply_override("policy.every=5");
  order.apply_override("policy.name=periodic");
  CHECK(order.policy.opts.has("every"));
  CHECK_NOTHROW((void)engine_spec::from(order));
  auto other_order = config::parse("[policy]\nname = \"drift\"\n", "run.toml");
  other_order.apply_override("policy.name=drift");  // the file's name again: no switch
  other_order.apply_override("policy.every=5");
  CHECK_THROWS_WITH_AS(engine_spec::from(other_order), doctest::Contains("--set policy.every=5: unknown key 'every' for policy 'drift'"),
                       config_error);
  auto file = config::parse("[policy]\nname = \"drift\"\nthreshold = 0.05\nmax_interval = 9\n", "run.toml");
  file.apply_override("policy.threshold=0.2");
  file.apply_override("policy.name=drift-lr");  // the file's max_interval goes with drift; drift-lr refuses the --set threshold
  CHECK_FALSE(file.policy.opts.has("max_interval"));
  CHECK_THROWS_WITH_AS(engine_spec::from(file), doctest::Contains("--set policy.threshold=0.2: unknown key 'threshold' for policy 'drift-lr'"),
                       config_error);
  auto kept = config::parse("[policy]\nname = \"drift\"\nthreshold = 0.05\n", "run.toml");
  kept.apply_override("policy.threshold=0.2");
  kept.apply_override("policy.name=consensus");  // consensus has a threshold: the --set value stays
  CHECK(kept.policy.opts.real("threshold") == 0.2);
  auto bogus = config::parse("", "run.toml");
  bogus.apply_override("policy.name=bogus");
  CHECK_THROWS_WITH_AS(engine_spec::from(bogus), doctest::Contains("--set policy.name=bogus: unknown policy 'bogus'"), config_error);
  CHECK_THROWS_WITH_AS(cfg.apply_override("threshold=0.1"), doctest::Contains("expected section.key=value"), config_error);
  CHECK_THROWS_WITH_AS(cfg.apply_override(" .threshold=0.1"), doctest::Contains("expected section.key=value"), config_error);
  CHECK_THROWS_WITH_AS(cfg.apply_override("policy.name=3"), doctest::Contains("a component name must be a string"), config_error);
  // One value per --set: a second line would set a key nobody named (and nothing would read it).
  CHECK_THROWS_WITH_AS(cfg.apply_override("policy.every=3\nname = \"drift\""), doctest::Contains("must be a single TOML value"), config_error);
  CHECK_THROWS_WITH_AS(cfg.apply_override("train.partition=iid\"\nx = \"y"), doctest::Contains("the value is not valid TOML"), config_error);
  CHECK_THROWS_WITH_AS(cfg.apply_override("train.partition=iid'\nx = 'y"), doctest::Contains("the value is not valid TOML"), config_error);
  // A number or an array TOML does not take is a mistake in the value, not a word.
  for (const char* bad : {"policy.threshold=1e400", "policy.threshold=.5", "train.epochs=99999999999999999999", "train.hidden=[8", "engine.stats={a"})
    CHECK_THROWS_WITH_AS(cfg.apply_override(bad), doctest::Contains("the value is not valid TOML ("), config_error);
  cfg.apply_override("train.address=10.77.0.1");  // not a number: a word
  CHECK(cfg.sections.at("train").string("address") == "10.77.0.1");
  cfg.apply_override("train.word=infinity");  // nor is this, though strtod reads it
  CHECK(cfg.sections.at("train").string("word") == "infinity");
  // A bare word is taken as written: a backslash stays one.
  cfg.apply_override("train.data_dir=/data/a\\nb");
  CHECK(cfg.sections.at("train").string("data_dir") == "/data/a\\nb");
  CHECK(cfg.policy.name == "periodic");
  CHECK_FALSE(cfg.policy.opts.has("every"));  // the refused override changed nothing
  // Spaces around the key and the value, as in a file, are not part of them.
  cfg.apply_override(" train.seed = 4 ");
  CHECK(cfg.sections.at("train").integer("seed") == 4);
  // The same key twice with different values: neither silently wins; the same value again is no conflict.
  cfg.apply_override("train.seed=4");
  CHECK_THROWS_WITH_AS(cfg.apply_override("train.seed=5"), "--set train.seed=5: train.seed was set already by --set train.seed=4; give it once",
                       config_error);
  cfg.apply_override("train.seed=4.0");  // the same number
  CHECK_THROWS_AS(cfg.apply_override("train.seed=4.5"), config_error);
  CHECK_THROWS_WITH_AS(cfg.apply_override("policy.name=drift"),
                       "--set policy.name=drift: policy.name was set already by --set policy.name=periodic; give it once", config_error);
  CHECK(cfg.policy.name == "periodic");
}

TEST_CASE("settings every rank must share: the refusal names the first that differs") {
  const auto a = config::parse("[topology]\nname = \"ring\"\n", "a.toml");
  const auto b = config::parse("[topology]\nname = \"exponential\"\n", "b.toml");
  const auto c = config::parse("[topology]\nname = \"ring\"\n[codec]\nname = \"int8\"\n", "c.toml");
  CHECK(a.shared_settings() != b.shared_settings());
  CHECK(a.fingerprint() != b.fingerprint());
  CHECK(std::string(settings_mismatch("rank 0", "rank 1", a.fingerprint(), b.fingerprint(), a.shared_settings(), b.shared_settings()).what())
            .find("(topology.name is \"ring\" here but \"exponential\" on rank 1)") != std::string::npos);
  CHECK(std::string(settings_mismatch("rank 0", "rank 2", a.fingerprint(), c.fingerprint(), a.shared_settings(), c.shared_settings()).what())
            .find("(codec.name is not set here but \"int8\" on rank 2)") != std::string::npos);
  // Settings filled in code carry no text: the fingerprints are named.
  CHECK(std::string(settings_mismatch("rank 0", "rank 1", 1, 2, "", b.shared_settings()).what())
            .find("(fingerprints 0000000000000001 vs 0000000000000002)") != std::string::npos);
}

TEST_CASE("engine_spec::from checks the keys of the transports the library knows") {
  CHECK_THROWS_WITH_AS(engine_spec::from(config::parse("[transport]\nname = \"loopback\"\nbandwith_gbps = 1.0\n", "run.toml")),
                       doctest::Contains("unknown key 'bandwith_gbps' for transport 'loopback' (did you mean 'bandwidth_gbps'?)"), config_error);
  CHECK_THROWS_WITH_AS(engine_spec::from(config::parse("[transport]\nname = \"ucx\"\ntls = \"tcp\"\n", "run.toml")),
                       doctest::Contains("run.toml [transport]: transport 'ucx' takes no settings (key 'tls')"), config_error);
  CHECK_NOTHROW(engine_spec::from(config::parse("[transport]\nname = \"mine\"\nanything = 1\n", "run.toml")));  // a program's own transport
}

TEST_CASE("momentum_beta follows the training loop's momentum unless set, and must then agree") {
  auto absent = config::parse("[policy]\nname = \"periodic\"\n", "run.toml");
  absent.follow_momentum(0.8, "[train] momentum");
  CHECK(absent.engine.real("momentum_beta") == doctest::Approx(0.8));
  CHECK(absent.engine.where("momentum_beta") == "[train] momentum");
  CHECK(engine_spec::from(absent).settings.momentum_beta == doctest::Approx(0.8f));
  auto same = config::parse("[engine]\nmomentum_beta = 0.9\n", "run.toml");
  same.follow_momentum(0.9, "[train] momentum");
  CHECK(same.engine.where("momentum_beta") == "run.toml [engine]");
  auto other = config::parse("[engine]\nmomentum_beta = 0.5\n", "run.toml");
  CHECK_THROWS_WITH_AS(other.follow_momentum(0.9, "the optimizer's momentum"),
                       doctest::Contains("run.toml [engine]: momentum_beta = 0.5 but the optimizer's momentum is 0.9"), config_error);
  other.apply_override("engine.momentum_beta=0.7");
  CHECK_THROWS_WITH_AS(other.follow_momentum(0.9, "[train] momentum"), doctest::Contains("--set engine.momentum_beta=0.7: momentum_beta = 0.7"),
                       config_error);
}

TEST_CASE("unknown sections are refused with the known ones, and a close one is suggested") {
  CHECK_THROWS_WITH_AS(config::parse("[enigne]\ntimeout_s = 5\n", "run.toml"),
                       doctest::Contains("run.toml: unknown section [enigne] (did you mean [engine]?); known sections: policy, topology, "
                                         "protocol, transport, codec, engine"),
                       config_error);
  CHECK_THROWS_WITH_AS(config::parse("[trian]\nepochs = 5\n", "run.toml", {"train", "bench"}),
                       "run.toml: unknown section [trian] (did you mean [train]?); known sections: policy, topology, protocol, transport, "
                       "codec, engine, train, bench",
                       config_error);
  CHECK_THROWS_WITH_AS(config::parse("[nosuch]\nkey = 1\n", "run.toml", {"train"}),
                       "run.toml: unknown section [nosuch]; known sections: policy, topology, protocol, transport, codec, engine, train", config_error);
  // A program's own section is refused by a program that does not read it.
  CHECK_THROWS_WITH_AS(config::parse("[train]\nepochs = 5\n", "run.toml"), doctest::Contains("unknown section [train]"), config_error);
  CHECK_THROWS_WITH_AS(config::load("/nonexistent/run.toml", {"train"}), doctest::Contains("cannot open"), config_error);

  // Reading a section the program did not declare is a mistake in the program.
  const auto cfg = config::parse("[policy]\nname = \"drift\"\n", "run.toml");
  const std::vector<option_spec> train = {{"epochs", std::int64_t{1}, "epochs"}};
  CHECK_THROWS_WITH_AS(cfg.section("train", train), doctest::Contains("run.toml: section [train] is read but was not declared"), config_error);
  CHECK(config({"train"}).section("train", train).integer("epochs") == 1);
}

TEST_CASE("--set: unknown sections and keys name the override") {
  auto cfg = config::parse("[policy]\nname = \"drift\"\n[train]\nepochs = 3\n", "run.toml", {"train"});
  CHECK_THROWS_WITH_AS(cfg.apply_override("nosuch.key=1"),
                       "--set nosuch.key=1: unknown section [nosuch]; known sections: policy, topology, protocol, transport, codec, engine, train",
                       config_error);
  CHECK_THROWS_WITH_AS(cfg.apply_override("polcy.threshold=0.1"), doctest::Contains("--set polcy.threshold=0.1: unknown section [polcy] (did you mean [policy]?)"),
                       config_error);
  CHECK_THROWS_WITH_AS(cfg.apply_override("train.epochs=\"three"), doctest::Contains("--set train.epochs=\"three: "), config_error);

  // Keys are checked when their section is read, and the message names the
  // override rather than the file.
  cfg.apply_override("policy.thresold=0.1");
  CHECK_THROWS_WITH_AS(engine_spec::from(cfg),
                       doctest::Contains("--set policy.thresold=0.1: unknown key 'thresold' for policy 'drift' (did you mean 'threshold'?); known keys: "),
                       config_error);
  // A range error names the override, not the file that holds another value.
  auto range = config::parse("[policy]\nname = \"drift\"\nthreshold = 0.05\n[engine]\ntimeout_s = 5\n", "run.toml");
  range.apply_override("policy.threshold=-1");
  CHECK_THROWS_WITH_AS(engine_spec::from(range), doctest::Contains("--set policy.threshold=-1: key 'threshold' of policy 'drift'"), config_error);
  range = config::parse("[policy]\nname = \"drift\"\nthreshold = 0.05\n[engine]\ntimeout_s = 5\n", "run.toml");
  range.apply_override("engine.timeout_s=-1");
  CHECK_THROWS_WITH_AS(engine_spec::from(range), "--set engine.timeout_s=-1: key 'timeout_s' must be > 0 and at most 31536000 seconds (a year), got -1", config_error);
  auto engine_cfg = config::parse("[engine]\ntimeout_s = 5\n", "run.toml");
  engine_cfg.apply_override("engine.timeuot_s=1");
  CHECK_THROWS_WITH_AS(engine_spec::from(engine_cfg),
                       doctest::Contains("--set engine.timeuot_s=1: unknown key 'timeuot_s' for [engine] (did you mean 'timeout_s'?)"), config_error);

  auto app = config::parse("[train]\nepochs = 3\n", "run.toml", {"train"});
  const std::vector<option_spec> train = {{"epochs", std::int64_t{1}, "epochs"}, {"batch", std::int64_t{32}, "batch"}};
  app.apply_override("train.bacth=64");
  CHECK_THROWS_WITH_AS(app.section("train", train),
                       "--set train.bacth=64: unknown key 'bacth' for [train] (did you mean 'batch'?); known keys: epochs, batch", config_error);
  app.apply_override("train.epochs=\"many\"");
  app.apply_override("train.batch=8");
  CHECK_THROWS_WITH_AS(app.section("train", train), doctest::Contains("--set train.bacth=64"), config_error);
  auto typed = config::parse("[train]\nepochs = 3\n", "run.toml", {"train"});
  typed.apply_override("train.epochs=\"many\"");
  CHECK_THROWS_WITH_AS(typed.section("train", train), doctest::Contains("--set train.epochs=\"many\": key 'epochs' of [train] must be an integer"),
                       config_error);
  // A file's own key still names the file.
  auto file_key = config::parse("[train]\nepoch = 3\n", "run.toml", {"train"});
  CHECK_THROWS_WITH_AS(file_key.section("train", train), doctest::Contains("run.toml [train]: unknown key 'epoch' for [train] (did you mean 'epochs'?)"),
                       config_error);
}

TEST_CASE("did you mean: edit distance with swapped letters as one edit") {
  CHECK(detail::edit_distance("enigne", "engine") == 1);
  CHECK(detail::edit_distance("trian", "train") == 1);
  CHECK(detail::edit_distance("", "abc") == 3);
  const std::vector<std::string> known = {"policy", "topology", "protocol", "transport", "engine"};
  CHECK(detail::closest("protocl", known) == "protocol");
  CHECK(detail::closest("nosuch", known).empty());
  CHECK(detail::closest("x", std::vector<std::string>{"y"}).empty());  // too short to guess
}

namespace {
int interrupt_calls = 0;
struct interrupted {};
void interrupt_on_third_call() {
  if (++interrupt_calls == 3) throw interrupted{};
}
}  // namespace

TEST_CASE("a wait runs the thread's interrupt check, which can end it; the check is per thread") {
  interrupt_calls = 0;
  const auto previous = gossip::set_interrupt_check(&interrupt_on_third_call);
  const bool none_before = previous == nullptr;
  CHECK(none_before);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(gossip::detail::wait_for([] { return false; }, std::chrono::seconds(30), [] { return std::string("nothing"); }),
                  interrupted);
  CHECK(interrupt_calls == 3);
  // Checks come about every 20 ms: three of them long before the 30 s timeout.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  // Another thread's waits run no check of this thread's.
  std::thread([] {
    CHECK_THROWS_AS(gossip::detail::wait_for([] { return false; }, std::chrono::milliseconds(100), [] { return std::string("nothing"); }),
                    gossip::timeout_error);
  }).join();
  CHECK(interrupt_calls == 3);
  const bool restored_ours = gossip::set_interrupt_check(previous) == &interrupt_on_third_call;
  CHECK(restored_ours);
  CHECK_THROWS_AS(gossip::detail::wait_for([] { return false; }, std::chrono::milliseconds(100), [] { return std::string("nothing"); }),
                  gossip::timeout_error);
  CHECK(interrupt_calls == 3);
}

TEST_CASE("command-line checks say what is wrong with a value, after the option's name") {
  auto parse = [](const CLI::Validator& check, const std::string& value) -> std::string {
    CLI::App app;
    std::int64_t n = 0;
    double x = 0;
    const bool integer = check.get_description().rfind("INT", 0) == 0;
    if (integer) app.add_option("--n", n)->check(check);
    else app.add_option("--x", x)->check(check);
    const std::string flag = integer ? "--n" : "--x";
    std::vector<std::string> args{value, flag};  // CLI11 parses a reversed vector
    try {
      app.parse(args);
    } catch (const CLI::ParseError& e) {
      return e.what();
    }
    return integer ? fmt::format("ok {}", n) : fmt::format("ok {}", x);
  };
  const auto ints = gossip::cli::integer_range(std::int64_t{1}, std::int64_t{256});
  CHECK(parse(ints, "8") == "ok 8");
  CHECK(parse(ints, "abc") == "--n: abc is not a number: give an integer in [1, 256]");
  CHECK(parse(ints, "1.5") == "--n: 1.5 is not an integer: give an integer in [1, 256]");
  CHECK(parse(ints, "0") == "--n: 0 is outside [1, 256]");
  CHECK(parse(ints, "1e2") == "--n: 1e2 is not written as an integer: write 100");
  CHECK(parse(ints, "99999999999999999999") == "--n: 99999999999999999999 is outside [1, 256]");
  const auto reals = gossip::cli::number_range(0.0, 1.0);
  CHECK(parse(reals, "0.5") == "ok 0.5");
  CHECK(parse(reals, "nan") == "--x: nan is not a finite number: give a number in [0, 1]");
  CHECK(parse(reals, "2") == "--x: 2 is outside the range: give a number in [0, 1]");
  CHECK(parse(reals, "x") == "--x: x is not a number: give a number in [0, 1]");
  CHECK(parse(gossip::cli::number_range(0.0), "inf") == "--x: inf is not a finite number: give a number >= 0");
}

TEST_CASE("a program's result file is written whole: through symbolic links, dangling ones too, and into a stream's path") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / fmt::format("gossip-output-{}", ::getpid());
  fs::create_directories(dir);
  const auto read = [](const fs::path& p) {
    std::ifstream f(p);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  // A regular file is replaced whole; nothing is left beside it.
  const auto file = (dir / "r.json").string();
  CHECK(gossip::out::write_file_whole(file, "first") == 0);
  CHECK(gossip::out::write_file_whole(file, "second") == 0);
  CHECK(read(file) == "second\n");
  // A link to it is written through and stays a link.
  fs::create_symlink("r.json", dir / "link.json");
  CHECK(gossip::out::write_file_whole((dir / "link.json").string(), "third") == 0);
  CHECK(fs::is_symlink(dir / "link.json"));
  CHECK(read(file) == "third\n");
  // A dangling link: its target is created, the link kept.
  fs::create_symlink("later.json", dir / "dangling.json");
  CHECK(gossip::out::write_file_whole((dir / "dangling.json").string(), "fourth") == 0);
  CHECK(fs::is_symlink(dir / "dangling.json"));
  CHECK(read(dir / "later.json") == "fourth\n");
  // A missing directory: the errno, and no partial file anywhere.
  CHECK(gossip::out::write_file_whole((dir / "no" / "x.json").string(), "x") == ENOENT);
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++entries;
  CHECK(entries == 4);  // r.json, link.json, dangling.json, later.json
  // A stream's path is written into, appending, never renamed over: here
  // /dev/fd/N of a file opened for appending, as `>> log` gives stdout.
  const auto log = (dir / "log.txt").string();
  {
    std::ofstream(log) << "earlier\n";
  }
  const int fd = ::open(log.c_str(), O_WRONLY | O_APPEND);
  REQUIRE(fd >= 0);
  CHECK(gossip::out::write_file_whole(fmt::format("/dev/fd/{}", fd), "appended") == 0);
  ::close(fd);
  CHECK(read(log) == "earlier\nappended\n");
  fs::remove_all(dir);
}

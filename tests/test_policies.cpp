// Policies on synthetic drift traces: signals are built by hand and a tiny
// stand-in for the engine (sim below) does the bookkeeping around decide().
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gossip/policies/adacomm.hpp"
#include "gossip/policies/budget.hpp"
#include "gossip/policies/consensus.hpp"
#include "gossip/policies/drift.hpp"
#include "gossip/policies/drift_history.hpp"
#include "gossip/policies/drift_lr.hpp"
#include "gossip/policies/never.hpp"
#include "gossip/policies/periodic.hpp"
#include "gossip/policy.hpp"

using gossip::decision;
using gossip::outcome;
using gossip::reason;
namespace gp = gossip::policies;

namespace {

constexpr double no_value = std::numeric_limits<double>::quiet_NaN();
constexpr double infinity = std::numeric_limits<double>::infinity();

// What the engine does around a policy at each step: steps_since_send counts
// the current step (1 on the first step after a send), bytes_sent grows by
// bytes_per_send on every firing, and observe() sees the outcome.
struct sim {
  std::uint64_t step = 0;
  std::uint64_t since = 0;
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_per_send = 1000;
  std::vector<std::uint64_t> fired;  // steps at which the policy fired
  std::vector<decision> decisions;
  std::vector<gossip::signal> signals;    // what the policy saw at each step
  std::vector<outcome> outcomes;  // what it was told afterwards

  // `fill` sets the drift fields of a gossip::signal whose bookkeeping fields are set.
  template <class P, class Fill>
  decision advance(P& p, Fill&& fill) {
    gossip::signal s;
    s.step = step;
    s.steps_since_send = ++since;
    s.bytes_sent = bytes_sent;
    s.bytes_per_send = bytes_per_send;
    fill(s);
    const decision d = p.decide(s);
    if (d.send) {
      bytes_sent += bytes_per_send;
      since = 0;
      fired.push_back(step);
    }
    const outcome o{.step = step,
                    .sent = d.send,
                    .bytes = d.send ? bytes_per_send : 0,
                    .bytes_sent = bytes_sent,
                    .bytes_per_send = bytes_per_send};
    if constexpr (gossip::observing_policy<P>) p.observe(o);
    decisions.push_back(d);
    signals.push_back(s);
    outcomes.push_back(o);
    ++step;
    return d;
  }

  template <class P, class Fill>
  void run(P& p, std::uint64_t steps, Fill&& fill) {
    for (std::uint64_t i = 0; i < steps; ++i) advance(p, fill);
  }
};

bool is_fire_reason(reason r) { return r == reason::threshold || r == reason::max_interval || r == reason::period; }

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// The message of the config_error `f` throws, or a marker that fails every
// `contains` check below when it throws nothing (or something else).
std::string config_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const gossip::config_error& e) {
    return e.what();
  } catch (...) {
    return "(threw something other than gossip::config_error)";
  }
  return "(no exception)";
}

gossip::options opts() { return gossip::options("test.toml [policy]"); }

gossip::any_policy make(std::string_view name, const gossip::options& o = opts()) {
  return gossip::policy_registry().make(name, o);
}

// Resolves `o` against P's specs and builds it, as the registry would.
template <class P>
P build(const gossip::options& o = opts()) {
  const auto specs = P::specs();
  return P::from_options(o.resolved(specs, "policy"));
}

std::vector<std::uint64_t> first_n(const std::vector<std::uint64_t>& v, std::size_t n) {
  return {v.begin(), v.begin() + static_cast<std::ptrdiff_t>(std::min(n, v.size()))};
}

std::vector<std::uint64_t> range_step(std::uint64_t first, std::uint64_t step, std::uint64_t last) {
  std::vector<std::uint64_t> v;
  for (std::uint64_t i = first; i <= last; i += step) v.push_back(i);
  return v;
}

}  // namespace

// ---------------------------------------------------------------- periodic

TEST_CASE("periodic: every = 1 fires at every step") {
  auto p = build<gp::periodic>();
  CHECK(p.every == 1);
  sim e;
  e.run(p, 20, [](gossip::signal&) {});
  CHECK(e.fired == range_step(0, 1, 19));
  for (const auto& d : e.decisions) {
    CHECK(d.why == reason::period);
    CHECK(d.value == 1);
    CHECK(d.threshold == 1);
  }
}

TEST_CASE("periodic: every = 3 fires on the 3rd, 6th, ... step whatever the drift") {
  gp::periodic p{.every = 3};
  sim e;
  // Huge drift on skipped steps, none on the due ones: drift must not matter.
  e.run(p, 12, [](gossip::signal& s) { s.diff_sq = s.steps_since_send < 3 ? 1e30 : 0.0; });
  CHECK(e.fired == std::vector<std::uint64_t>{2, 5, 8, 11});
  CHECK(e.decisions[0].why == reason::not_due);
  CHECK(e.decisions[0].value == 1);
  CHECK(e.decisions[0].threshold == 3);
  CHECK(e.decisions[1].why == reason::not_due);
  CHECK(e.decisions[2].why == reason::period);
  CHECK(e.decisions[2].value == 3);
}

TEST_CASE("policies built in code are checked as a config's are") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS(gossip::any_policy(gp::periodic{.every = 0, .stagger = true}), "policy 'periodic': every must be an integer >= 1, got 0",
                       gossip::config_error);
  CHECK_THROWS_WITH_AS(gossip::any_policy(gp::drift{.threshold = nan}), "policy 'drift': threshold must be a finite number > 0, got nan",
                       gossip::config_error);
  CHECK_THROWS_AS(gossip::any_policy(gp::drift{.threshold = -0.1}), gossip::config_error);
  CHECK_THROWS_WITH_AS(gossip::any_policy(gp::drift_lr{.c0 = 0}), "policy 'drift-lr': c0 must be a finite number > 0, got 0", gossip::config_error);
  CHECK_THROWS_AS(gossip::any_policy(gp::drift_lr{.min_interval = 0}), gossip::config_error);
  gp::consensus c;
  c.threshold = nan;
  CHECK_THROWS_WITH_AS(gossip::any_policy(c, "consensus"), "policy 'consensus': threshold must be a number in (0, 1000000], got nan", gossip::config_error);
  c = gp::consensus{};
  c.min_interval = 5;
  c.max_interval = 2;
  CHECK_THROWS_WITH_AS(gossip::any_policy(c, "consensus"), "policy 'consensus': max_interval must be 0 or an integer >= min_interval (5), got 2", gossip::config_error);
  // The policies with constructors state their ranges once too.
  CHECK_THROWS_WITH_AS(gp::adacomm(20, 19), "policy 'adacomm': tau_max must be an integer >= tau0 (20), got 19", gossip::config_error);
  CHECK_THROWS_WITH_AS(gp::budget(0.5, 0.01, 0.05, 0), "policy 'budget': min_interval must be an integer >= 1, got 0", gossip::config_error);
  CHECK_THROWS_WITH_AS(gp::drift_history(1.0, 0), "policy 'drift-history': window must be an integer in [1, 256], got 0", gossip::config_error);
  // The defaults pass.
  CHECK_NOTHROW(gossip::any_policy(gp::periodic{}));
  CHECK_NOTHROW(gossip::any_policy(gp::drift{}));
  CHECK_NOTHROW(gossip::any_policy(gp::drift_lr{}));
  CHECK_NOTHROW(gossip::any_policy(gp::consensus{}));
}

TEST_CASE("periodic: options") {
  CHECK(build<gp::periodic>(opts().set("every", std::int64_t{5})).every == 5);
  for (std::int64_t bad : {0, -3}) {
    const auto msg = config_error_of([&] { build<gp::periodic>(opts().set("every", bad)); });
    CHECK(contains(msg, "test.toml [policy]"));
    CHECK(contains(msg, "'every'"));
    CHECK(contains(msg, ">= 1"));
    CHECK(contains(msg, std::to_string(bad)));
  }
}

// ---------------------------------------------------------------- drift

TEST_CASE("drift: fires at the first step whose relative drift strictly exceeds the threshold") {
  // Relative drift grows by exactly 1/128 per step since the last send and the
  // threshold is 3/128 (all exact in binary), so the third step ties and must
  // skip; the fourth fires.
  gp::drift p{.threshold = 3.0 / 128, .relative = true};
  sim e;
  e.run(p, 12, [](gossip::signal& s) {
    const double r = static_cast<double>(s.steps_since_send) / 128;
    s.ref_sq = 4;
    s.diff_sq = 4 * r * r;
  });
  CHECK(e.fired == std::vector<std::uint64_t>{3, 7, 11});
  CHECK_FALSE(e.decisions[2].send);
  CHECK(e.decisions[2].why == reason::below_threshold);
  CHECK(e.decisions[2].value == e.decisions[2].threshold);  // the tie
  CHECK(e.decisions[3].why == reason::threshold);
  CHECK(e.decisions[3].value == 4.0 / 128);
  CHECK(e.decisions[3].threshold == 3.0 / 128);
}

TEST_CASE("drift: relative = false compares ‖x − x̂‖, not ‖x − x̂‖/‖x̂‖") {
  // ‖x̂‖ = 1000, so the relative drift is 1000x smaller than the absolute one.
  auto trace = [](gossip::signal& s) {
    const double d = static_cast<double>(s.steps_since_send) / 128;
    s.ref_sq = 1e6;
    s.diff_sq = d * d;
  };
  gp::drift absolute{.threshold = 3.0 / 128, .relative = false};
  sim a;
  a.run(absolute, 12, trace);
  CHECK(a.fired == std::vector<std::uint64_t>{3, 7, 11});

  gp::drift relative{.threshold = 3.0 / 128, .relative = true};
  sim r;
  r.run(relative, 12, trace);
  CHECK(r.fired.empty());
}

TEST_CASE("drift: max_interval forces a send when the drift stays small") {
  auto tiny = [](gossip::signal& s) {
    s.ref_sq = 1;
    s.diff_sq = 1e-12;
  };
  gp::drift p{.threshold = 0.01, .relative = true, .max_interval = 7};
  sim e;
  e.run(p, 21, tiny);
  CHECK(e.fired == std::vector<std::uint64_t>{6, 13, 20});
  CHECK(e.decisions[6].why == reason::max_interval);
  CHECK(e.decisions[6].value == 7);
  CHECK(e.decisions[6].threshold == 7);
  CHECK(e.decisions[5].why == reason::below_threshold);

  gp::drift unbounded{.threshold = 0.01, .relative = true, .max_interval = 0};
  sim u;
  u.run(unbounded, 500, tiny);
  CHECK(u.fired.empty());
}

TEST_CASE("drift: a threshold crossing is reported as such even when max_interval is also due") {
  gp::drift p{.threshold = 0.01, .relative = true, .max_interval = 2};
  gossip::signal s;
  s.steps_since_send = 5;
  s.ref_sq = 1;
  s.diff_sq = 0.25;
  const auto d = p.decide(s);
  CHECK(d.send);
  CHECK(d.why == reason::threshold);
  CHECK(d.value == 0.5);
}

TEST_CASE("drift: x̂ = 0 gives an infinite relative drift") {
  gp::drift p;
  gossip::signal s;
  s.steps_since_send = 1;
  s.ref_sq = 0;
  s.diff_sq = 1e-20;
  CHECK(p.decide(s).send);
  CHECK(p.decide(s).value == infinity);
  s.diff_sq = 0;
  CHECK_FALSE(p.decide(s).send);
}

TEST_CASE("drift: options") {
  const auto d = build<gp::drift>(opts().set("threshold", 0.5).set("relative", false).set("max_interval", std::int64_t{9}));
  CHECK(d.threshold == 0.5);
  CHECK_FALSE(d.relative);
  CHECK(d.max_interval == 9);
  const auto def = build<gp::drift>();
  CHECK(def.threshold == 0.01);
  CHECK(def.relative);
  CHECK(def.max_interval == 0);
  for (double bad : {0.0, -1.0, no_value, infinity}) {
    INFO("threshold = " << bad);
    const auto msg = config_error_of([&] { build<gp::drift>(opts().set("threshold", bad)); });
    CHECK(contains(msg, "test.toml [policy]"));
    CHECK(contains(msg, "'threshold'"));
    CHECK(contains(msg, "> 0"));
  }
  const auto msg = config_error_of([] { build<gp::drift>(opts().set("max_interval", std::int64_t{-1})); });
  CHECK(contains(msg, "'max_interval'"));
  CHECK(contains(msg, "-1"));
}

// ---------------------------------------------------------------- drift-lr

TEST_CASE("drift-lr: fires when ‖x − x̂‖² strictly exceeds c0·lr²") {
  const gp::drift_lr p{.c0 = 2.0, .epsilon = 0.0, .min_interval = 1};
  gossip::signal s;
  s.steps_since_send = 1;
  s.lr = 0.5;  // c0·lr² = 0.5 exactly
  s.diff_sq = 0.5;
  auto d = p.decide(s);
  CHECK_FALSE(d.send);
  CHECK(d.why == reason::below_threshold);
  CHECK(d.value == 0.5);
  CHECK(d.threshold == 0.5);
  s.diff_sq = std::nextafter(0.5, 1.0);
  d = p.decide(s);
  CHECK(d.send);
  CHECK(d.why == reason::threshold);
  CHECK(d.value == s.diff_sq);
  CHECK(d.threshold == 0.5);
}

TEST_CASE("drift-lr: never fires twice within min_interval") {
  const gp::drift_lr p{.c0 = 1.0, .epsilon = 0.0, .min_interval = 4};
  sim e;
  e.run(p, 40, [](gossip::signal& s) {
    s.lr = 0.1;
    s.diff_sq = 1e6;  // always far over the threshold
  });
  CHECK(e.fired == range_step(3, 4, 39));
  CHECK(e.decisions[0].why == reason::min_interval);
  CHECK(e.decisions[0].value == 1);
  CHECK(e.decisions[0].threshold == 4);
  CHECK(e.decisions[2].why == reason::min_interval);
}

TEST_CASE("drift-lr: c_t = c0·(1 + step)^epsilon rises with the step") {
  const gp::drift_lr p{.c0 = 1.5, .epsilon = 0.5, .min_interval = 1};
  gossip::signal s;
  s.steps_since_send = 1;
  s.lr = 2;
  s.diff_sq = 1;
  s.step = 3;  // c_t = 1.5·2 = 3, threshold 12
  CHECK(p.decide(s).threshold == doctest::Approx(12.0));
  s.step = 8;  // c_t = 1.5·3 = 4.5, threshold 18
  CHECK(p.decide(s).threshold == doctest::Approx(18.0));
  s.step = 0;  // c_t = c0
  CHECK(p.decide(s).threshold == doctest::Approx(6.0));
}

TEST_CASE("drift-lr: lr = 0 fires on any nonzero drift") {
  const gp::drift_lr p;
  gossip::signal s;
  s.steps_since_send = 1;
  s.lr = 0;
  s.diff_sq = 1e-300;
  CHECK(p.decide(s).send);
  CHECK(p.decide(s).threshold == 0);
  s.diff_sq = 0;
  CHECK_FALSE(p.decide(s).send);
}

TEST_CASE("drift-lr keeps firing after a learning-rate decay; a fixed absolute threshold starves") {
  // SGD near a minimum: the model wanders in a noise ball whose radius scales
  // with the learning rate, so ‖x − x̂‖² = lr²·min(k, 20) after k steps. The
  // learning rate drops 10x at step 100.
  auto trace = [](gossip::signal& s) {
    s.lr = s.step < 100 ? 0.1 : 0.01;
    s.ref_sq = 1;
    s.diff_sq = s.lr * s.lr * static_cast<double>(std::min<std::uint64_t>(s.steps_since_send, 20));
  };
  auto sends_in = [](const sim& e, std::uint64_t from, std::uint64_t to) {
    return std::count_if(e.fired.begin(), e.fired.end(), [&](std::uint64_t t) { return t >= from && t < to; });
  };

  // Both are tuned to send every 5th step before the decay: 0.01·k > 0.045 and
  // √(0.01·k) > 0.215 both first hold at k = 5.
  gp::drift fixed{.threshold = 0.215, .relative = false};
  sim f;
  f.run(fixed, 300, trace);
  CHECK(first_n(f.fired, 3) == std::vector<std::uint64_t>{4, 9, 14});
  CHECK(sends_in(f, 0, 100) == 20);
  CHECK(sends_in(f, 100, 300) == 0);  // √(1e-4·20) ≈ 0.045 < 0.215 forever

  gp::drift_lr scaled{.c0 = 4.5, .epsilon = 0.0, .min_interval = 1};
  sim s;
  s.run(scaled, 300, trace);
  CHECK(first_n(s.fired, 3) == std::vector<std::uint64_t>{4, 9, 14});
  CHECK(sends_in(s, 0, 100) == 20);
  CHECK(sends_in(s, 100, 300) == 40);  // still every 5th step
  CHECK(std::find(s.fired.begin(), s.fired.end(), 104) != s.fired.end());
}

TEST_CASE("drift-lr: options") {
  const auto p = build<gp::drift_lr>(opts().set("c0", 3.0).set("epsilon", 0.25).set("min_interval", std::int64_t{2}));
  CHECK(p.c0 == 3.0);
  CHECK(p.epsilon == 0.25);
  CHECK(p.min_interval == 2);
  CHECK(contains(config_error_of([] { build<gp::drift_lr>(opts().set("c0", 0.0)); }), "'c0'"));
  CHECK(contains(config_error_of([] { build<gp::drift_lr>(opts().set("epsilon", -0.1)); }), "'epsilon'"));
  const auto msg = config_error_of([] { build<gp::drift_lr>(opts().set("min_interval", std::int64_t{0})); });
  CHECK(contains(msg, "'min_interval'"));
  CHECK(contains(msg, ">= 1"));
}

// ---------------------------------------------------------------- consensus

TEST_CASE("consensus: fires when ‖x − x̂‖/‖x̂‖·w^balance strictly exceeds threshold·(lr/lr_max)^lr_exponent") {
  gp::consensus p;
  p.threshold = 0.1;
  p.lr_exponent = 0.5;
  p.balance = 1;
  p.max_interval = 0;
  auto sig = [](double rel, double lr, double w) {
    gossip::signal s;
    s.steps_since_send = 5;
    s.ref_sq = 1;
    s.diff_sq = rel * rel;
    s.lr = lr;
    s.weight = w;
    return s;
  };
  // At the largest learning rate the threshold is `threshold` itself (strict).
  CHECK_FALSE(p.decide(sig(0.1, 0.5, 1)).send);
  CHECK(p.decide(sig(0.1001, 0.5, 1)).send);
  CHECK(p.lr_max() == 0.5);
  // After a 100x decay it is threshold·0.01^0.5 = 0.01.
  const auto d = p.decide(sig(0.0101, 0.005, 1));
  CHECK(d.send);
  CHECK(d.why == reason::threshold);
  CHECK(d.threshold == doctest::Approx(0.01));
  CHECK_FALSE(p.decide(sig(0.0099, 0.005, 1)).send);
  // A light rank waits, a heavy one hurries.
  CHECK_FALSE(p.decide(sig(0.15, 0.5, 0.5)).send);  // 0.075 < 0.1
  CHECK(p.decide(sig(0.06, 0.5, 2.0)).send);        // 0.12 > 0.1
  // A rate above the largest seen raises the reference, never the threshold.
  CHECK(p.threshold_at(0.7) == doctest::Approx(0.1));
}

TEST_CASE("consensus: lr_exponent 0 and balance 0 make it the fixed relative threshold of 'drift'") {
  gp::consensus c;
  c.threshold = 0.05;
  c.lr_exponent = 0;
  c.balance = 0;
  c.max_interval = 40;
  const gp::drift d{.threshold = 0.05, .relative = true, .max_interval = 40};
  sim a, b;
  auto fill = [](gossip::signal& s) {
    s.lr = s.step < 100 ? 0.1 : 0.001;
    s.weight = 0.1 + 0.5 * static_cast<double>(s.step % 7);  // ignored with balance 0
    s.diff_sq = s.lr * s.lr * static_cast<double>(s.steps_since_send * s.steps_since_send);
    s.ref_sq = 1;
  };
  a.run(c, 300, fill);
  b.run(d, 300, fill);
  CHECK(a.fired.size() > 10);
  CHECK(a.fired == b.fired);
}

TEST_CASE("consensus: sends keep going after a learning-rate decay where 'drift' starves") {
  // Drift per step proportional to lr: ‖x − x̂‖ = lr·steps_since_send.
  auto fill = [](gossip::signal& s) {
    s.lr = s.step < 200 ? 0.01 : 0.001;
    s.diff_sq = s.lr * s.lr * static_cast<double>(s.steps_since_send * s.steps_since_send);
    s.ref_sq = 1;
  };
  gp::consensus c;
  c.threshold = 0.05;
  c.max_interval = 0;
  const gp::drift d{.threshold = 0.05, .relative = true, .max_interval = 0};
  sim a, b;
  a.run(c, 400, fill);
  b.run(d, 400, fill);
  auto after = [](const sim& e) { return std::count_if(e.fired.begin(), e.fired.end(), [](auto t) { return t >= 200; }); };
  // Before the decay both fire every 6 steps (0.06 > 0.05).
  CHECK(a.fired.front() == 5);
  CHECK(b.fired.front() == 5);
  // After it, drift needs 51 steps per send; consensus (threshold 0.05·0.1^0.5 ≈ 0.0158) 16.
  CHECK(after(b) == 200 / 51);
  CHECK(after(a) >= 200 / 17);
}

TEST_CASE("consensus: min_interval holds, max_interval fires") {
  gp::consensus c;
  c.min_interval = 3;
  c.max_interval = 10;
  sim e;
  e.run(c, 30, [](gossip::signal& s) {
    s.diff_sq = s.step < 12 ? 1.0 : 0.0;  // huge drift, then none
    s.ref_sq = 1;
    s.lr = 0.1;
  });
  CHECK(e.fired == std::vector<std::uint64_t>{2, 5, 8, 11, 21});
  CHECK(e.decisions[0].why == reason::min_interval);
  CHECK(e.decisions[21].why == reason::max_interval);
}

TEST_CASE("consensus: with a shared schedule every member fires at the same steps, paced by the group's drift") {
  // The group's drift grows by `rate` per step since the last round; the
  // all-reduce reports it at the step after each round.
  auto member = [](double rate, double own_drift, bool decay) {
    gp::consensus c;
    c.threshold = 0.1;
    c.max_interval = 100;
    sim e;
    double group_sq = std::numeric_limits<double>::quiet_NaN();
    std::uint64_t previous_since = 0;
    e.run(c, 200, [&](gossip::signal& s) {
      s.shared_schedule = true;
      s.lr = decay && s.step >= 100 ? 0.001 : 0.1;
      const double r = decay && s.step >= 100 ? rate / 100 : rate;
      if (!e.fired.empty() && e.fired.back() + 1 == s.step) {  // the last round's reply: the drift it was posted with
        const double d = r * static_cast<double>(previous_since);
        group_sq = d * d;
      }
      s.group_drift_sq = group_sq;
      s.diff_sq = own_drift * own_drift;  // a member's own drift plays no part
      s.ref_sq = 1;
      previous_since = s.steps_since_send;
    });
    return e;
  };
  const sim a = member(0.01, 0.0, false);
  // Rounds from step 0, the interval doubling while the drift allows,
  // then every 11 steps (0.01·11 > 0.1).
  REQUIRE(a.fired.size() > 8);
  CHECK(std::vector<std::uint64_t>(a.fired.begin(), a.fired.begin() + 7) == std::vector<std::uint64_t>{0, 2, 6, 14, 25, 36, 47});
  CHECK(a.decisions[0].why == reason::period);
  CHECK(a.decisions[25].why == reason::threshold);
  // Members whose own drift differs decide alike.
  CHECK(member(0.01, 5.0, false).fired == a.fired);
  CHECK(member(0.01, 1e-9, false).fired == a.fired);
  // A ten times faster drift: rounds every 2 steps at most (0.1·2 > 0.1), never
  // sooner than half the last interval.
  const sim fast = member(0.1, 0.0, false);
  for (std::size_t i = 4; i < fast.fired.size(); ++i) CHECK(fast.fired[i] - fast.fired[i - 1] == 2);
  // After a 100x decay (drift per step too) the threshold is 0.01 and the
  // drift 0.0001 per step: the interval grows to 100 steps, doubling per round.
  const sim d = member(0.01, 0.0, true);
  // The last round before the decay, then every one after it.
  const auto first_late = std::find_if(d.fired.begin(), d.fired.end(), [](auto t) { return t >= 100; });
  REQUIRE(first_late != d.fired.begin());
  const std::vector<std::uint64_t> rounds(first_late - 1, d.fired.end());
  REQUIRE(rounds.size() >= 4);
  for (std::size_t i = 2; i < rounds.size(); ++i)
    CHECK(rounds[i] - rounds[i - 1] == std::min<std::uint64_t>(2 * (rounds[i - 1] - rounds[i - 2]), 100));
}

TEST_CASE("consensus: options") {
  const auto p = build<gp::consensus>(opts().set("threshold", 0.2).set("lr_exponent", 1.0).set("balance", 2.0).set("max_interval", std::int64_t{0}));
  CHECK(p.threshold == 0.2);
  CHECK(p.lr_exponent == 1.0);
  CHECK(p.balance == 2.0);
  CHECK(p.max_interval == 0);
  CHECK(contains(config_error_of([] { build<gp::consensus>(opts().set("threshold", 0.0)); }), "'threshold'"));
  CHECK(contains(config_error_of([] { build<gp::consensus>(opts().set("lr_exponent", 3.0)); }), "[0, 2]"));
  CHECK(contains(config_error_of([] { build<gp::consensus>(opts().set("balance", -1.0)); }), "'balance'"));
  CHECK(contains(config_error_of([] { build<gp::consensus>(opts().set("min_interval", std::int64_t{5}).set("max_interval", std::int64_t{2})); }),
                 "key 'max_interval' of policy 'consensus' must be 0 or an integer >= min_interval (5), got 2"));
}

// ---------------------------------------------------------------- drift-history

TEST_CASE("drift-history asks the engine for ‖x_t − x_{t−1}‖²; nothing else does") {
  CHECK(gossip::policy_wants_step_change<gp::drift_history>());
  CHECK(make("drift-history").wants_step_change());
  for (const auto* name : {"periodic", "drift", "drift-lr", "budget", "adacomm", "never"}) {
    INFO(name);
    CHECK_FALSE(make(name).wants_step_change());
  }
}

TEST_CASE("drift-history: without history it skips until `window` steps, then fires max_interval") {
  gp::drift_history p(1.0, 10);
  sim e;
  e.run(p, 30, [](gossip::signal& s) {
    s.step_sq = no_value;  // the engine has no predecessor yet
    s.diff_sq = 1e9;
  });
  CHECK(e.fired == std::vector<std::uint64_t>{9, 19, 29});
  CHECK(e.decisions[0].why == reason::below_threshold);
  CHECK(e.decisions[0].threshold == infinity);
  CHECK(e.decisions[9].why == reason::max_interval);
  CHECK(e.decisions[9].value == 10);
  CHECK(e.decisions[9].threshold == 10);
  CHECK(p.history() == 0);
}

TEST_CASE("drift-history: noise fires after ~xi·window steps, steady motion after ~√(xi·window)") {
  // Every step moves the model by ‖Δ‖² = 1, so the threshold is xi·window·1 = 10.
  SUBCASE("random walk: ‖x − x̂‖² = k") {
    gp::drift_history p(1.0, 10);
    sim e;
    e.run(p, 33, [](gossip::signal& s) {
      s.step_sq = 1;
      s.diff_sq = static_cast<double>(s.steps_since_send);
    });
    CHECK(e.fired == std::vector<std::uint64_t>{10, 21, 32});  // k = 11; k = 10 ties and skips
    CHECK(e.decisions[9].why == reason::below_threshold);
    CHECK(e.decisions[9].value == 10);
    CHECK(e.decisions[9].threshold == 10);
    CHECK(e.decisions[10].why == reason::threshold);
  }
  SUBCASE("steady motion: ‖x − x̂‖² = k²") {
    gp::drift_history p(1.0, 10);
    sim e;
    e.run(p, 12, [](gossip::signal& s) {
      s.step_sq = 1;
      const auto k = static_cast<double>(s.steps_since_send);
      s.diff_sq = k * k;
    });
    CHECK(e.fired == std::vector<std::uint64_t>{3, 7, 11});  // k = 4: 16 > 10 > 9
  }
  SUBCASE("xi scales the threshold") {
    gp::drift_history p(2.5, 10);
    sim e;
    e.run(p, 26, [](gossip::signal& s) {
      s.step_sq = 1;
      s.diff_sq = static_cast<double>(s.steps_since_send);
    });
    CHECK(e.fired == std::vector<std::uint64_t>{25});  // k > 25
  }
}

TEST_CASE("drift-history: the mean covers only the last `window` step changes, and skips NaN") {
  gp::drift_history p(1.0, 2);
  gossip::signal s;
  s.steps_since_send = 1;
  s.diff_sq = 0;
  auto threshold_after = [&](double step_sq) {
    s.step_sq = step_sq;
    return p.decide(s).threshold;
  };
  CHECK(threshold_after(100) == 200);  // [100]
  CHECK(threshold_after(1) == 101);    // [100, 1]
  CHECK(threshold_after(no_value) == 101);  // not recorded
  CHECK(threshold_after(infinity) == 101);  // not recorded either
  CHECK(p.history() == 2);
  CHECK(threshold_after(1) == 2);  // [1, 1]: 100 fell out
  CHECK(threshold_after(3) == 4);  // [1, 3]
  CHECK(p.mean_step_sq() == 2);
}

TEST_CASE("drift-history: a model that has stopped moving never fires") {
  gp::drift_history p(1.0, 4);
  sim e;
  e.run(p, 100, [](gossip::signal& s) {
    s.step_sq = 0;
    s.diff_sq = 0;
  });
  CHECK(e.fired.empty());
}

TEST_CASE("drift-history: options") {
  const auto p = build<gp::drift_history>(opts().set("xi", 0.5).set("window", std::int64_t{256}));
  CHECK(p.xi() == 0.5);
  CHECK(p.window() == 256);
  for (std::int64_t bad : {0, 257, -1}) {
    INFO("window = " << bad);
    const auto msg = config_error_of([&] { build<gp::drift_history>(opts().set("window", bad)); });
    CHECK(contains(msg, "'window'"));
    CHECK(contains(msg, "[1, 256]"));
    CHECK(contains(msg, std::to_string(bad)));
  }
  CHECK(contains(config_error_of([] { build<gp::drift_history>(opts().set("xi", 0.0)); }), "'xi'"));
}

// ---------------------------------------------------------------- budget

TEST_CASE("budget: observe() moves the threshold by (1 + gain) toward the byte target") {
  gp::budget p(0.5, 1.0, 0.25);
  // After step 0 the target is 0.5·1·100 = 50 bytes.
  p.observe(outcome{.step = 0, .sent = true, .bytes = 100, .bytes_sent = 100, .bytes_per_send = 100});
  CHECK(p.threshold() == 1.25);  // over: raise it
  p.observe(outcome{.step = 0, .sent = false, .bytes = 0, .bytes_sent = 0, .bytes_per_send = 100});
  CHECK(p.threshold() == 1.0);  // under: lower it
  p.observe(outcome{.step = 0, .sent = false, .bytes = 0, .bytes_sent = 50, .bytes_per_send = 100});
  CHECK(p.threshold() == 1.0);  // on target: hold
  // After step 3 the target is 0.5·4·100 = 200 bytes.
  p.observe(outcome{.step = 3, .sent = false, .bytes = 0, .bytes_sent = 100, .bytes_per_send = 100});
  CHECK(p.threshold() == 0.8);
}

TEST_CASE("budget: decide() fires on relative drift strictly over threshold()") {
  const gp::budget p(0.1, 0.5);
  gossip::signal s;
  s.steps_since_send = 1;
  s.ref_sq = 1;
  s.diff_sq = 0.25;  // relative drift 0.5
  auto d = p.decide(s);
  CHECK_FALSE(d.send);
  CHECK(d.why == reason::below_threshold);
  CHECK(d.value == 0.5);
  CHECK(d.threshold == 0.5);
  s.diff_sq = 0.36;
  d = p.decide(s);
  CHECK(d.send);
  CHECK(d.why == reason::threshold);
}

TEST_CASE("budget: converges to its byte fraction on a long run") {
  // The relative drift grows linearly between sends and resets on a send, at a
  // rate the policy does not know; it starts from a threshold 10-100x off.
  for (double fraction : {0.05, 0.1, 0.25, 0.5}) {
    for (double rate : {1e-4, 1e-3, 3e-2}) {
      CAPTURE(fraction);
      CAPTURE(rate);
      gp::budget p(fraction);
      sim e;
      std::uint64_t bytes_at_half = 0;
      const std::uint64_t steps = 20000;
      for (std::uint64_t i = 0; i < steps; ++i) {
        e.advance(p, [&](gossip::signal& s) {
          const double r = rate * static_cast<double>(s.steps_since_send);
          s.ref_sq = 1;
          s.diff_sq = r * r;
        });
        if (i + 1 == steps / 2) bytes_at_half = e.bytes_sent;
      }
      const double baseline = static_cast<double>(steps * e.bytes_per_send);
      const double achieved = static_cast<double>(e.bytes_sent) / baseline;
      CHECK(achieved >= 0.9 * fraction);
      CHECK(achieved <= 1.1 * fraction);
      // Also in steady state, not only on average over the run.
      const double second_half = static_cast<double>(e.bytes_sent - bytes_at_half) / (baseline / 2);
      CHECK(second_half >= 0.9 * fraction);
      CHECK(second_half <= 1.1 * fraction);
    }
  }
}

TEST_CASE("budget: never fires twice within min_interval, even when it is under budget") {
  gp::budget p(1.0, 1e-6, 0.05, 3);
  sim e;
  e.run(p, 300, [](gossip::signal& s) {
    s.ref_sq = 1;
    s.diff_sq = 1;
  });
  CHECK(e.fired == range_step(2, 3, 299));
  CHECK(e.decisions[1].why == reason::min_interval);
  CHECK(e.decisions[1].value == 2);
  CHECK(e.decisions[1].threshold == 3);
}

TEST_CASE("budget: a long quiet stretch cannot drive the threshold to zero") {
  gp::budget p(0.1);
  sim e;
  e.run(p, 2000, [](gossip::signal& s) {
    s.ref_sq = 1;
    s.diff_sq = 0;  // the model does not move: it never fires, so it is under budget
  });
  CHECK(e.fired.empty());
  CHECK(p.threshold() == gp::budget::min_threshold);
  // Once over budget it climbs back.
  p.observe(outcome{.step = 0, .sent = true, .bytes = 1000, .bytes_sent = 1000, .bytes_per_send = 1000});
  CHECK(p.threshold() > gp::budget::min_threshold);
}

TEST_CASE("budget: options") {
  const auto p = build<gp::budget>(opts()
                                       .set("fraction", 0.25)
                                       .set("initial_threshold", 0.5)
                                       .set("gain", 0.1)
                                       .set("min_interval", std::int64_t{4}));
  CHECK(p.fraction() == 0.25);
  CHECK(p.threshold() == 0.5);
  CHECK(p.gain() == 0.1);
  CHECK(p.min_interval() == 4);
  for (double bad : {2.0, 0.0, -0.5, no_value}) {
    INFO("fraction = " << bad);
    const auto msg = config_error_of([&] { build<gp::budget>(opts().set("fraction", bad)); });
    CHECK(contains(msg, "'fraction'"));
    CHECK(contains(msg, "(0, 1]"));
  }
  CHECK(contains(config_error_of([] { build<gp::budget>(opts().set("gain", 0.0)); }), "'gain'"));
  CHECK(contains(config_error_of([] { build<gp::budget>(opts().set("initial_threshold", -1.0)); }),
                 "'initial_threshold'"));
  CHECK(contains(config_error_of([] { build<gp::budget>(opts().set("min_interval", std::int64_t{0})); }),
                 "'min_interval'"));
}

// ---------------------------------------------------------------- adacomm

TEST_CASE("adacomm: without a loss it is periodic with tau0") {
  gp::adacomm p(10, 100, 0.9);
  sim e;
  e.run(p, 30, [](gossip::signal& s) { s.lr = 0.1; });
  CHECK(e.fired == std::vector<std::uint64_t>{9, 19, 29});
  CHECK(e.decisions[9].why == reason::period);
  CHECK(e.decisions[9].value == 10);
  CHECK(e.decisions[9].threshold == 10);
  CHECK(e.decisions[8].why == reason::not_due);
  CHECK(p.period() == 10);
}

TEST_CASE("adacomm: the period follows ceil(sqrt(lr0·F/(lr·F0))·tau0) (no smoothing)") {
  gp::adacomm p(10, 100, 0.0);  // F is the latest loss
  gossip::signal s;
  s.steps_since_send = 1;
  auto period_at = [&](double lr, double loss) {
    s.lr = lr;
    s.loss = loss;
    const auto d = p.decide(s);
    CHECK(d.threshold == static_cast<double>(p.period()));
    return p.period();
  };
  CHECK(period_at(0.5, 4) == 10);        // reference: lr0 = 0.5, F0 = 4
  CHECK(period_at(0.5, 1) == 5);         // sqrt(1/4)·10
  CHECK(period_at(0.5, 2) == 8);         // ceil(sqrt(1/2)·10) = ceil(7.07), rounded up
  CHECK(period_at(0.5, 0.25) == 3);      // ceil(sqrt(1/16)·10) = ceil(2.5)
  CHECK(period_at(0.125, 4) == 20);      // lr quartered: sqrt(4)·10
  CHECK(period_at(0.125, 1) == 10);      // sqrt(0.5·1/(0.125·4))·10
  CHECK(period_at(0.5, 400) == 100);     // sqrt(100)·10 = tau_max exactly
  CHECK(period_at(0.5, 1e6) == 100);     // clamped to tau_max
  CHECK(period_at(0.5, 1e-8) == 1);      // never below 1
  CHECK(period_at(0.0, 1) == 10);        // lr = 0: tau0
  CHECK(period_at(0.5, 1) == 5);         // the reference point did not move
}

TEST_CASE("adacomm: the period stays >= 1 even when the ratio underflows to 0") {
  gp::adacomm p(10, 100, 0.0);
  gossip::signal s;
  s.steps_since_send = 1;
  s.lr = 1e-300;
  s.loss = 4;
  (void)p.decide(s);  // reference: lr0 = 1e-300
  s.lr = 1;
  s.loss = 1e-300;  // lr0·F = 1e-600 → 0
  const auto d = p.decide(s);
  CHECK(p.period() == 1);
  CHECK(d.send);
  CHECK(d.threshold == 1);
}

TEST_CASE("adacomm: F is an exponential moving average of the loss") {
  gp::adacomm p(10, 100, 0.5);
  gossip::signal s;
  s.steps_since_send = 1;
  s.lr = 0.5;
  auto period_at = [&](double loss) {
    s.loss = loss;
    (void)p.decide(s);
    return p.period();
  };
  CHECK(period_at(4) == 10);  // F = F0 = 4
  CHECK(period_at(1) == 8);   // F = 2.5:   ceil(10·sqrt(0.625))  = ceil(7.91)
  CHECK(p.loss_average() == 2.5);
  CHECK(period_at(1) == 7);   // F = 1.75:  ceil(10·sqrt(0.4375)) = ceil(6.61)
  CHECK(period_at(1) == 6);   // F = 1.375: ceil(10·sqrt(0.34375)) = ceil(5.86)
  CHECK(period_at(no_value) == 6);  // no loss this step: F kept
  CHECK(period_at(0) == 6);    // a nonpositive loss is not used
  CHECK(p.loss_average() == 1.375);
}

TEST_CASE("adacomm: a falling loss shortens the gap between sends") {
  gp::adacomm p(10, 100, 0.0);
  sim e;
  e.run(p, 40, [](gossip::signal& s) {
    s.lr = 0.5;
    s.loss = s.step < 10 ? 4.0 : 1.0;  // period 10, then 5
  });
  CHECK(e.fired == std::vector<std::uint64_t>{9, 14, 19, 24, 29, 34, 39});
}

TEST_CASE("adacomm: the reference point is the first step with both a loss and a positive lr") {
  gp::adacomm p(10, 100, 0.0);
  gossip::signal s;
  s.steps_since_send = 1;
  s.loss = 9;
  s.lr = 0;  // warm-up: not a reference
  (void)p.decide(s);
  CHECK_FALSE(p.has_reference());
  CHECK(p.period() == 10);
  s.loss = 4;
  s.lr = 0.5;
  (void)p.decide(s);
  CHECK(p.has_reference());
  s.loss = 1;
  (void)p.decide(s);
  CHECK(p.period() == 5);  // relative to F0 = 4, not 9
}

TEST_CASE("adacomm: options") {
  const auto p = build<gp::adacomm>(opts().set("tau0", std::int64_t{4}).set("tau_max", std::int64_t{4}));
  CHECK(p.tau0() == 4);
  CHECK(p.tau_max() == 4);
  auto msg = config_error_of([] { build<gp::adacomm>(opts().set("tau0", std::int64_t{0})); });
  CHECK(contains(msg, "'tau0'"));
  msg = config_error_of([] { build<gp::adacomm>(opts().set("tau0", std::int64_t{20}).set("tau_max", std::int64_t{19})); });
  CHECK(contains(msg, "'tau_max'"));
  CHECK(contains(msg, "19"));
  // tau0 set elsewhere than tau_max: the message names both places.
  msg = config_error_of([] { build<gp::adacomm>(opts().set("tau0", std::int64_t{200}, "--set policy.tau0=200")); });
  CHECK(contains(msg, "(and 'tau0' from --set policy.tau0=200): key 'tau_max' of policy 'adacomm' must be an integer >= tau0 (200), got 100"));
  for (double bad : {1.0, -0.1}) {
    INFO("smoothing = " << bad);
    msg = config_error_of([&] { build<gp::adacomm>(opts().set("smoothing", bad)); });
    CHECK(contains(msg, "'smoothing'"));
    CHECK(contains(msg, "[0, 1)"));
  }
}

// ---------------------------------------------------------------- never

TEST_CASE("never: never fires") {
  gp::never p;
  sim e;
  e.run(p, 1000, [](gossip::signal& s) {
    s.ref_sq = 0;
    s.diff_sq = 1e300;
    s.lr = 1;
    s.loss = 1;
  });
  CHECK(e.fired.empty());
  for (const auto& d : e.decisions) CHECK(d.why == reason::never);
}

// ---------------------------------------------------------------- registry

TEST_CASE("registry: holds the eight shipped policies under their config names") {
  const auto& reg = gossip::policy_registry();
  CHECK(reg.kind() == "policy");
  CHECK(reg.names_joined() == "periodic, drift, drift-lr, consensus, drift-history, budget, adacomm, never");
  for (const auto& e : reg.entries()) {
    INFO(e.name);
    CHECK_FALSE(e.help.empty());
    for (const auto& spec : e.specs) CHECK_FALSE(spec.help.empty());
    CHECK(make(e.name).name() == e.name);
  }
  // Options reach the policy: every = 3 fires on the third step only.
  auto p = make("periodic", opts().set("every", std::int64_t{3}));
  sim e;
  e.run(p, 3, [](gossip::signal&) {});
  CHECK(e.fired == std::vector<std::uint64_t>{2});
}

namespace {

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double uniform(std::uint64_t& state) { return static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53; }

// A fixed pseudo-random trace, played as the engine would around `p`: the model
// takes random steps whose size follows a decaying learning rate, the drift
// accumulates until a send resets it, the loss falls noisily and is sometimes
// missing, and step_sq is supplied only to a policy that asks for it. `copy`,
// if given, receives a copy of `p` taken just before step `copy_at`.
sim conformance_run(gossip::any_policy& p, std::uint64_t steps, gossip::any_policy* copy = nullptr,
                    std::uint64_t copy_at = 0) {
  std::uint64_t rng = 42;
  double diff_sq = 0;
  sim e;
  for (std::uint64_t i = 0; i < steps; ++i) {
    if (copy && i == copy_at) *copy = p;
    e.advance(p, [&](gossip::signal& s) {
      s.lr = s.step < 500 ? 0.1 : 0.01;
      const double step_sq = s.lr * s.lr * (uniform(rng) + 0.01);
      diff_sq = (s.steps_since_send == 1 ? 0.0 : diff_sq) + step_sq * (1 + uniform(rng));
      s.diff_sq = diff_sq;
      s.ref_sq = 1 + uniform(rng);
      s.step_sq = p.wants_step_change() && s.step > 0 ? step_sq : no_value;
      s.loss = s.step % 7 == 3 ? no_value : 2.0 * std::exp(-static_cast<double>(s.step) / 300) + 0.1 * uniform(rng);
      s.round = s.step;
      s.seconds_since_send = 0.01 * static_cast<double>(s.steps_since_send);
    });
  }
  return e;
}

bool same(const decision& a, const decision& b) {
  auto eq = [](double x, double y) { return x == y || (std::isnan(x) && std::isnan(y)); };
  return a.send == b.send && a.why == b.why && eq(a.value, b.value) && eq(a.threshold, b.threshold);
}

}  // namespace

TEST_CASE("conformance: every registered policy is deterministic and its reasons match its decisions") {
  constexpr std::uint64_t steps = 1000;
  constexpr std::uint64_t copy_at = 500;
  for (const auto& entry : gossip::policy_registry().entries()) {
    INFO("policy " << entry.name);
    sim first, second;
    std::vector<decision> resumed;
    CHECK_NOTHROW({
      auto a = make(entry.name);
      auto b = make(entry.name);
      gossip::any_policy copy;
      first = conformance_run(a, steps, &copy, copy_at);
      second = conformance_run(b, steps);
      // A copy taken mid-run carries the policy's state: fed the rest of the
      // same trace, it must decide exactly as the original did.
      for (std::uint64_t i = copy_at; i < steps; ++i) {
        resumed.push_back(copy.decide(first.signals[i]));
        copy.observe(first.outcomes[i]);
      }
    });
    REQUIRE(first.decisions.size() == steps);
    REQUIRE(second.decisions.size() == steps);
    REQUIRE(resumed.size() == steps - copy_at);
    std::uint64_t sends = 0, mismatches = 0, inconsistent = 0;
    for (std::uint64_t i = 0; i < steps; ++i) {
      const auto& d = first.decisions[i];
      mismatches += !same(d, second.decisions[i]);
      if (i >= copy_at) mismatches += !same(d, resumed[i - copy_at]);
      inconsistent += d.send != is_fire_reason(d.why);
      sends += d.send;
    }
    CHECK(mismatches == 0);
    CHECK(inconsistent == 0);
    if (entry.name == "never") CHECK(sends == 0);
    if (entry.name == "periodic") CHECK(sends == steps);
  }
}

// ---------------------------------------------------------------- bad input

TEST_CASE("bad input: an unknown policy name lists the known ones") {
  const auto msg = config_error_of([] { make("gossip-magic"); });
  CHECK(contains(msg, "test.toml [policy]"));
  CHECK(contains(msg, "'gossip-magic'"));
  for (const auto* name : {"periodic", "drift", "drift-lr", "consensus", "drift-history", "budget", "adacomm", "never"})
    CHECK(contains(msg, name));
}

TEST_CASE("bad input: an unknown key lists the policy's keys") {
  const auto msg = config_error_of([] { make("drift", opts().set("treshold", 0.1)); });
  CHECK(contains(msg, "test.toml [policy]"));
  CHECK(contains(msg, "'treshold'"));
  CHECK(contains(msg, "threshold, relative, max_interval"));
  CHECK(contains(config_error_of([] { make("never", opts().set("every", std::int64_t{2})); }), "(none)"));
}

TEST_CASE("bad input: a value of the wrong type names the key and the expected type") {
  auto msg = config_error_of([] { make("drift", opts().set("threshold", std::string("high"))); });
  CHECK(contains(msg, "'threshold'"));
  CHECK(contains(msg, "number"));
  CHECK(contains(msg, "\"high\""));
  msg = config_error_of([] { make("periodic", opts().set("every", 2.5)); });
  CHECK(contains(msg, "'every'"));
  CHECK(contains(msg, "integer"));
  // An integer where a number is expected is fine.
  CHECK_NOTHROW(make("drift", opts().set("threshold", std::int64_t{1})));
  // Every key of every policy refuses a string (and a string key would refuse an integer).
  for (const auto& e : gossip::policy_registry().entries())
    for (const auto& spec : e.specs) {
      INFO(e.name << "." << spec.key);
      const gossip::option_value wrong = std::holds_alternative<std::string>(spec.default_value)
                                             ? gossip::option_value(std::int64_t{1})
                                             : gossip::option_value(std::string("high"));
      msg = config_error_of([&] { make(e.name, opts().set(spec.key, wrong)); });
      CHECK(contains(msg, "'" + spec.key + "'"));
      CHECK(contains(msg, std::string(gossip::option_type_name(spec.default_value))));
    }
}

TEST_CASE("bad input: out-of-range values are refused with the key, the value and what is allowed") {
  struct bad_case {
    const char* policy;
    const char* key;
    gossip::option_value value;
    const char* shown;    // how the bad value appears in the message
    const char* allowed;  // what the message says is allowed
  };
  const bad_case cases[] = {
      {"drift", "threshold", -1.0, "-1", "> 0"},
      {"periodic", "every", std::int64_t{0}, "0", ">= 1"},
      {"budget", "fraction", 2.0, "2", "(0, 1]"},
      {"drift", "max_interval", std::int64_t{-5}, "-5", ">= 0"},
      {"drift-lr", "c0", -2.0, "-2", "> 0"},
      {"drift-lr", "min_interval", std::int64_t{0}, "0", ">= 1"},
      {"drift-history", "window", std::int64_t{1000}, "1000", "[1, 256]"},
      {"drift-history", "xi", -1.0, "-1", "> 0"},
      {"budget", "gain", -0.5, "-0.5", "> 0"},
      {"adacomm", "tau0", std::int64_t{0}, "0", ">= 1"},
      {"adacomm", "smoothing", 1.5, "1.5", "[0, 1)"},
      {"consensus", "threshold", -0.1, "-0.1", "(0, "},
      {"consensus", "lr_exponent", 2.5, "2.5", "[0, 2]"},
  };
  for (const auto& c : cases) {
    INFO(c.policy << "." << c.key);
    const auto msg = config_error_of([&] { make(c.policy, opts().set(c.key, c.value)); });
    CHECK(contains(msg, "test.toml [policy]"));
    CHECK(contains(msg, std::string("'") + c.key + "'"));
    CHECK(contains(msg, std::string("got ") + c.shown));
    CHECK(contains(msg, c.allowed));
  }
}

TEST_CASE("periodic: with stagger the ranks take turns, each still every `every` steps") {
  for (int rank = 0; rank < 4; ++rank) {
    const gp::periodic p{.every = 8, .stagger = true};
    sim e;
    e.run(p, 40, [&](gossip::signal& s) { s.rank = rank, s.world = 4; });
    INFO("rank ", rank);
    const std::uint64_t first = 7 - 2 * static_cast<std::uint64_t>(rank);
    CHECK(e.fired == std::vector<std::uint64_t>{first, first + 8, first + 16, first + 24, first + 32});
  }
}

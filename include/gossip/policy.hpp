#pragma once
/// Policies decide *when* a rank sends its model.
///
/// A policy is any type with `decision decide(const signal&) noexcept`, and
/// optionally `void observe(const outcome&) noexcept` (called after every step
/// with what was actually sent). Policies are pure and deterministic given
/// their inputs, never touch the network, and must not allocate in decide().
///
///     struct every_third {
///       gossip::decision decide(const gossip::signal& s) const noexcept {
///         return s.steps_since_send >= 3 ? gossip::decision::fire(gossip::reason::period)
///                                        : gossip::decision::skip(gossip::reason::not_due);
///       }
///     };
///     static_assert(gossip::policy<every_third>);
///
/// A policy that needs ‖x_t − x_{t−1}‖² in signal::step_sq declares
/// `static constexpr bool wants_step_change = true;` and the engine then keeps
/// the previous model and measures it inside the same fused drift pass.
///
/// A policy that fires on the model's own movement since its last send, so
/// that any lasting displacement soon makes it send, declares
/// `static constexpr bool closed_loop = true;`. Quasi-global momentum then
/// carries merges on in full ([engine] momentum_merge = "auto").
///
/// A policy that sends on a fixed schedule of every k steps, whatever it
/// sees, says so with `std::uint64_t fixed_period() const noexcept` (k). With
/// k = 1 between peers, [engine] momentum = "auto" keeps the optimizer's
/// momentum local: merges every step leave little shard bias to correct.
#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "gossip/registry.hpp"
#include "gossip/signal.hpp"

namespace gossip {

template <class P>
concept policy = requires(P& p, const signal& s) {
  { p.decide(s) } noexcept -> std::same_as<decision>;
};

template <class P>
concept observing_policy = policy<P> && requires(P& p, const outcome& o) {
  { p.observe(o) } noexcept;
};

template <class P>
constexpr bool policy_closed_loop() noexcept {
  if constexpr (requires { P::closed_loop; })
    return P::closed_loop;
  else
    return false;
}

/// The period of a policy that sends every k steps whatever it sees (k), or 0.
template <class P>
constexpr std::uint64_t policy_fixed_period(const P& p) noexcept {
  if constexpr (requires(P& q) { q.fixed_period(); }) {
    static_assert(requires { { p.fixed_period() } noexcept -> std::same_as<std::uint64_t>; },
                  "a policy's fixed_period() must be `std::uint64_t fixed_period() const noexcept`");
    return p.fixed_period();
  } else {
    return 0;
  }
}

template <class P>
constexpr bool policy_wants_step_change() noexcept {
  if constexpr (requires { P::wants_step_change; })
    return P::wants_step_change;
  else
    return false;
}

/// Type-erased policy, so a config file can choose one at run time.
class any_policy {
 public:
  any_policy() = default;

  template <policy P>
    requires(!std::same_as<std::remove_cvref_t<P>, any_policy>)
  any_policy(P p, std::string name = {}) {
    // Settings a config would refuse are refused from code too (check()).
    if constexpr (requires(const P& q) { q.check(); }) p.check();
    m_self = std::make_unique<model<P>>(std::move(p));
    m_name = std::move(name);
  }

  any_policy(const any_policy& o) : m_self(o.m_self ? o.m_self->clone() : nullptr), m_name(o.m_name) {}
  any_policy& operator=(const any_policy& o) {
    if (this != &o) *this = any_policy(o);
    return *this;
  }
  any_policy(any_policy&&) noexcept = default;
  any_policy& operator=(any_policy&&) noexcept = default;

  explicit operator bool() const noexcept { return m_self != nullptr; }
  decision decide(const signal& s) noexcept { return m_self->decide(s); }
  void observe(const outcome& o) noexcept { m_self->observe(o); }
  bool wants_step_change() const noexcept { return m_self && m_self->wants_step_change(); }
  bool closed_loop() const noexcept { return m_self && m_self->closed_loop(); }
  std::uint64_t fixed_period() const noexcept { return m_self ? m_self->fixed_period() : 0; }
  const std::string& name() const noexcept { return m_name; }

 private:
  struct concept_t {
    virtual ~concept_t() = default;
    virtual decision decide(const signal&) noexcept = 0;
    virtual void observe(const outcome&) noexcept = 0;
    virtual bool wants_step_change() const noexcept = 0;
    virtual bool closed_loop() const noexcept = 0;
    virtual std::uint64_t fixed_period() const noexcept = 0;
    virtual std::unique_ptr<concept_t> clone() const = 0;
  };
  template <class P>
  struct model final : concept_t {
    explicit model(P p) : m_p(std::move(p)) {}
    decision decide(const signal& s) noexcept override { return m_p.decide(s); }
    void observe(const outcome& o) noexcept override {
      if constexpr (observing_policy<P>) m_p.observe(o);
    }
    bool wants_step_change() const noexcept override { return policy_wants_step_change<P>(); }
    bool closed_loop() const noexcept override { return policy_closed_loop<P>(); }
    std::uint64_t fixed_period() const noexcept override { return policy_fixed_period(m_p); }
    std::unique_ptr<concept_t> clone() const override { return std::make_unique<model>(*this); }
    P m_p;
  };
  std::unique_ptr<concept_t> m_self;
  std::string m_name;
};

using policy_registry_t = registry<any_policy>;

/// The process-wide policy registry, with the shipped policies already in it.
policy_registry_t& policy_registry();

}  // namespace gossip

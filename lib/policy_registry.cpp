#include <string>

#include "gossip/policies/adacomm.hpp"
#include "gossip/policies/budget.hpp"
#include "gossip/policies/consensus.hpp"
#include "gossip/policies/drift.hpp"
#include "gossip/policies/drift_history.hpp"
#include "gossip/policies/drift_lr.hpp"
#include "gossip/policies/never.hpp"
#include "gossip/policies/periodic.hpp"
#include "gossip/policy.hpp"

namespace gossip {

namespace {

// Every shipped policy carries its config name, help line, option table and
// from_options(), so its registry line is the same one line for all of them.
template <class P>
policy_registry_t::entry entry_for() {
  return {std::string(P::config_name), std::string(P::help), P::specs(),
          [](const options& o) { return any_policy(P::from_options(o), std::string(P::config_name)); }};
}

}  // namespace

policy_registry_t& policy_registry() {
  // Function-local static: filled on first use, so it is ready even when called
  // from another translation unit's static initialiser.
  static policy_registry_t r = [] {
    policy_registry_t reg("policy");
    reg.add(entry_for<policies::periodic>());
    reg.add(entry_for<policies::drift>());
    reg.add(entry_for<policies::drift_lr>());
    reg.add(entry_for<policies::consensus>());
    reg.add(entry_for<policies::drift_history>());
    reg.add(entry_for<policies::budget>());
    reg.add(entry_for<policies::adacomm>());
    reg.add(entry_for<policies::never>());
    return reg;
  }();
  return r;
}

}  // namespace gossip

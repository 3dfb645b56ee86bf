#pragma once
/// libgossip: exchange models with peers only when it pays.
///
/// The umbrella header: the engine, every shipped policy, topology, protocol
/// and the loopback transport.
#include "gossip/bootstrap.hpp"
#include "gossip/config.hpp"
#include "gossip/drift.hpp"
#include "gossip/engine.hpp"
#include "gossip/error.hpp"
#include "gossip/model.hpp"
#include "gossip/options.hpp"
#include "gossip/policy.hpp"
#include "gossip/protocol.hpp"
#include "gossip/signal.hpp"
#include "gossip/stats.hpp"
#include "gossip/topology.hpp"
#include "gossip/transport.hpp"
#include "gossip/policies/adacomm.hpp"
#include "gossip/policies/budget.hpp"
#include "gossip/policies/consensus.hpp"
#include "gossip/policies/drift.hpp"
#include "gossip/policies/drift_history.hpp"
#include "gossip/policies/drift_lr.hpp"
#include "gossip/policies/never.hpp"
#include "gossip/policies/periodic.hpp"
#include "gossip/transports/loopback/loopback.hpp"

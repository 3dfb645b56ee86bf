#pragma once
/// Configuration: a TOML file, or the same structure built in code.
///
///     # run.toml
///     [policy]
///     name = "consensus"
///     threshold = 0.1
///     [topology]
///     name = "exponential"
///     [transport]
///     name = "loopback"
///     bandwidth_gbps = 1.0
///
///     auto cfg = gossip::config::load("run.toml");
///
/// Each section's keys are checked against the chosen component's option
/// table; an application can keep its own sections ([train], …) in the same
/// file and read them with section(name, specs), checked the same way.
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gossip/options.hpp"

namespace gossip {

struct component_config {
  std::string name;
  options opts;
};

struct config {
  std::string source = "<code>";
  component_config policy{"consensus", options("<code> [policy]")};
  component_config topology{"exponential", options("<code> [topology]")};
  component_config protocol{"push-sum", options("<code> [protocol]")};
  component_config transport{"loopback", options("<code> [transport]")};
  options engine{"<code> [engine]"};
  std::map<std::string, options, std::less<>> sections;  ///< every other section, unchecked until read

  /// Reads a TOML file; errors name the file, the key and what was expected.
  static config load(const std::string& path);
  /// Parses TOML text; `source` names it in messages.
  static config parse(std::string_view text, const std::string& source = "<string>");

  /// Applies "section.key=value" (value in TOML syntax: 3, 0.5, true, "ring",
  /// [1, 2]) on top of the file, e.g. from a --set command-line option. Setting
  /// `policy.name` (or topology/protocol/transport) switches the component and
  /// drops the options of the old one.
  void apply_override(std::string_view assignment);

  /// An application section checked against `specs` (missing section: all defaults).
  options section(std::string_view name, std::span<const option_spec> specs) const;

  /// Fingerprint of the settings every rank must share (component names and options).
  std::uint64_t fingerprint() const;
};

/// Engine settings ([engine] section), with environment overrides.
const std::vector<option_spec>& engine_option_specs();
/// Loopback transport settings ([transport] with name = "loopback").
const std::vector<option_spec>& loopback_option_specs();

}  // namespace gossip

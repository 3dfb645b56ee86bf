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
///     auto cfg = gossip::config::load("run.toml", {"train"});   // a program with its own [train]
///
/// Each section's keys are checked against the chosen component's option
/// table. A program may keep its own sections ([train], …) in the same file:
/// it names them when loading and reads them with section(name, specs),
/// checked the same way. Any other section, in the file or in an override,
/// is refused with the known ones (a misspelt [enigne] is not ignored).
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

/// True for policy `periodic` with stagger = true: ranks send at different steps.
inline bool staggered_policy(const component_config& policy) {
  return policy.name == "periodic" && policy.opts.has("stagger") && policy.opts.boolean("stagger");
}

struct config {
  std::string source = "<code>";
  component_config policy{"consensus", options("<code> [policy]")};
  component_config topology{"exponential", options("<code> [topology]")};
  component_config protocol{"push-sum", options("<code> [protocol]")};
  component_config transport{"loopback", options("<code> [transport]")};
  component_config codec{"auto", options("<code> [codec]")};  ///< see gossip/codec.hpp
  options engine{"<code> [engine]"};
  /// The program's own sections, besides policy, topology, protocol,
  /// transport, codec and engine; load(), parse() and apply_override() refuse others.
  std::vector<std::string> app_sections;
  std::map<std::string, options, std::less<>> sections;  ///< the app_sections present, unchecked until read
  /// Components whose name apply_override() switched, and which override did:
  /// a second one that names another is refused.
  std::map<std::string, std::string, std::less<>> name_overrides;

  config() = default;
  /// All defaults, taking the program's own sections: config({"train"}).
  explicit config(std::vector<std::string> app_sections) : app_sections(std::move(app_sections)) {}

  /// Reads a TOML file; errors name the file, the section or key and what was
  /// expected. `app_sections`: the sections this program reads besides the
  /// library's (e.g. {"train"}).
  static config load(const std::string& path, std::vector<std::string> app_sections = {});
  /// The config a launcher names: the file in GOSSIP_CONFIG (set by
  /// `gossip-run --config FILE`), else all defaults. Errors name the file.
  static config from_env(std::vector<std::string> app_sections = {});
  /// Parses TOML text; `source` names it in messages.
  static config parse(std::string_view text, const std::string& source = "<string>", std::vector<std::string> app_sections = {});

  /// Applies "section.key=value" (value in TOML syntax: 3, 0.5, true, "ring",
  /// [1, 2]) on top of the file, e.g. from a --set command-line option: errors
  /// about it, now or when its section is read, name "--set section.key=value".
  /// Setting `policy.name` (or topology/protocol/transport/codec) switches the
  /// component and drops the file's options for the old one; options set by
  /// apply_override stay, in either order, and the new component refuses
  /// those it does not have when the section is resolved. `origin` names
  /// the override in messages instead (e.g. "--policy drift", for a
  /// program's own flag that sets a key).
  void apply_override(std::string_view assignment, std::string_view origin = {});
  /// The "section.key" an apply_override() assignment sets, with the spaces
  /// around each part left out as apply_override() leaves them; empty when
  /// it is not of the form section.key=value.
  static std::string override_target(std::string_view assignment);

  /// A section of the program's own, checked against `specs` (absent: all
  /// defaults). `name` must be one of app_sections.
  options section(std::string_view name, std::span<const option_spec> specs) const;

  /// policy, topology, protocol, transport, codec, engine, then app_sections.
  std::vector<std::string> known_sections() const;

  /// The settings every rank must share, one "section.key=value" per line
  /// (topology, protocol and transport with their options, the codec when
  /// set, the policy's name); fingerprint() hashes it.
  std::string shared_settings() const;
  /// Fingerprint of shared_settings(): ranks with different ones refuse to connect.
  std::uint64_t fingerprint() const;

  /// Makes [engine] momentum_beta follow the training loop's momentum factor
  /// `beta` (> 0), named by `origin` in messages ("[train] momentum", "the
  /// optimizer's momentum"): quasi-global momentum rebuilds the optimizer's
  /// buffers with it. Sets it when absent; a config_error naming where it was
  /// set when it differs.
  void follow_momentum(double beta, std::string_view origin);
};

/// The fingerprint of a settings text as config::shared_settings() writes it
/// (an application that appends settings of its own, one "section.key=value"
/// line each, to engine_spec::config_settings fingerprints the whole with it).
std::uint64_t settings_fingerprint(std::string_view settings) noexcept;

/// The error for two ranks whose shared settings differ (`my_name`, `their_name`:
/// "rank 0", "rank 1 (host h)"). It names the first setting that differs when
/// both shared_settings() texts are known (`topology.name is "ring" here but
/// "exponential" on rank 1`), else the fingerprints (settings filled in code).
config_error settings_mismatch(std::string_view my_name, std::string_view their_name, std::uint64_t my_fingerprint,
                               std::uint64_t their_fingerprint, std::string_view mine, std::string_view theirs);

/// Refuses a switch-aggregate mode other than auto, sync or async, naming `where`.
void check_switch_mode(std::string_view mode, std::string_view where);
/// The switch mode a config names, and where: [protocol] mode, or with the
/// switch transport [transport] mode (either one: the other follows it);
/// "auto" when neither names one. Each named mode is checked, and two
/// different named modes are refused, naming where each was set.
struct switch_mode_request {
  std::string mode = "auto";
  std::string where;
};
switch_mode_request requested_switch_mode(const config& cfg);

/// Engine settings ([engine] section), with environment overrides.
const std::vector<option_spec>& engine_option_specs();
/// Loopback transport settings ([transport] with name = "loopback").
const std::vector<option_spec>& loopback_option_specs();

}  // namespace gossip

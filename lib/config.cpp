// TOML → gossip::config, with errors that name the file, the key and what to do.
#include "gossip/config.hpp"

#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "gossip/error.hpp"

namespace gossip {
namespace {

option_value to_value(const toml::node& n, const std::string& where, const std::string& key) {
  if (auto v = n.as_boolean()) return v->get();
  if (auto v = n.as_integer()) return static_cast<std::int64_t>(v->get());
  if (auto v = n.as_floating_point()) return v->get();
  if (auto v = n.as_string()) return v->get();
  if (auto a = n.as_array()) {
    int_list out;
    for (const auto& e : *a) {
      if (auto i = e.as_integer()) {
        out.push_back(i->get());
      } else if (auto inner = e.as_array()) {
        for (const auto& x : *inner) {
          auto j = x.as_integer();
          if (!j) throw config_error(fmt::format("{}: key '{}' must hold integers (or pairs of integers)", where, key));
          out.push_back(j->get());
        }
      } else {
        throw config_error(fmt::format("{}: key '{}' must hold integers (or pairs of integers)", where, key));
      }
    }
    return out;
  }
  throw config_error(fmt::format("{}: key '{}' has a type this config does not take (use a boolean, integer, number, string, or array of integers)",
                                 where, key));
}

options to_options(const toml::table& t, const std::string& where, bool skip_name) {
  options o(where);
  for (const auto& [k, v] : t) {
    const std::string key(k.str());
    if (skip_name && key == "name") continue;
    if (v.is_table())
      throw config_error(fmt::format("{}: key '{}' is a table; nested tables are not used here", where, key));
    o.set(key, to_value(v, where, key));
  }
  return o;
}

component_config to_component(const toml::table& t, const std::string& where, const std::string& fallback) {
  component_config c{fallback, options(where)};
  if (auto n = t.get("name")) {
    auto s = n->as_string();
    if (!s) throw config_error(fmt::format("{}: key 'name' must be a string", where));
    c.name = s->get();
  }
  c.opts = to_options(t, where, true);
  return c;
}

}  // namespace

config config::parse(std::string_view text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    throw config_error(fmt::format("{}:{}:{}: {}", source, b.line, b.column, e.description()));
  }
  config c;
  c.source = source;
  const auto where = [&](std::string_view section) { return fmt::format("{} [{}]", source, section); };
  for (const auto& [k, v] : root) {
    const std::string section(k.str());
    auto* t = v.as_table();
    if (!t)
      throw config_error(fmt::format("{}: top-level key '{}' must be a section ([{}]); known sections: policy, topology, protocol, "
                                     "transport, engine, and any of the application's",
                                     source, section, section));
    if (section == "policy")
      c.policy = to_component(*t, where(section), c.policy.name);
    else if (section == "topology")
      c.topology = to_component(*t, where(section), c.topology.name);
    else if (section == "protocol")
      c.protocol = to_component(*t, where(section), c.protocol.name);
    else if (section == "transport")
      c.transport = to_component(*t, where(section), c.transport.name);
    else if (section == "engine")
      c.engine = to_options(*t, where(section), false);
    else
      c.sections.emplace(section, to_options(*t, where(section), false));
  }
  return c;
}

config config::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw config_error(fmt::format("{}: cannot open the config file (does it exist and is it readable?)", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

void config::apply_override(std::string_view assignment) {
  const std::string text(assignment);
  const auto eq = text.find('=');
  const auto dot = text.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq || dot == 0 || dot + 1 == eq)
    throw config_error(fmt::format("override '{}': expected section.key=value, e.g. policy.threshold=0.05 or train.epochs=2", text));
  const std::string section = text.substr(0, dot), key = text.substr(dot + 1, eq - dot - 1), value = text.substr(eq + 1);
  const std::string where = fmt::format("override '{}'", text);
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value, where);
  } catch (const toml::parse_error&) {
    // A bare word is taken as a string, so policy.name=drift works without quotes.
    try {
      parsed = toml::parse("v = \"" + value + "\"", where);
    } catch (const toml::parse_error& e) {
      throw config_error(fmt::format("{}: the value is not valid TOML ({})", where, e.description()));
    }
  }
  component_config* comp = section == "policy" ? &policy : section == "topology" ? &topology : section == "protocol" ? &protocol
                         : section == "transport" ? &transport : nullptr;
  const toml::node& v = *parsed.get("v");
  if (comp && key == "name") {
    auto str = v.as_string();
    if (!str) throw config_error(fmt::format("{}: a component name must be a string", where));
    if (str->get() != comp->name) *comp = {str->get(), options(fmt::format("{} [{}]", source, section))};
    return;
  }
  options& target = comp ? comp->opts : section == "engine" ? engine
                  : sections.try_emplace(section, options(fmt::format("{} [{}]", source, section))).first->second;
  target.set(key, to_value(v, where, key));
}

options config::section(std::string_view name, std::span<const option_spec> specs) const {
  auto it = sections.find(name);
  if (it == sections.end()) return options(fmt::format("{} [{}]", source, name)).resolved(specs, fmt::format("[{}]", name));
  return it->second.resolved(specs, fmt::format("[{}]", name));
}

std::uint64_t config::fingerprint() const {
  std::string s;
  for (const auto* c : {&topology, &protocol, &transport}) {
    s += c->name + "{";
    for (const auto& [k, v] : c->opts.values()) s += k + "=" + to_string(v) + ";";
    s += "}";
  }
  s += policy.name;
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

}  // namespace gossip

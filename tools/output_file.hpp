#pragma once
/// How the programs (the benches, the switch programs) write a result file:
/// whole or not at all.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace gossip::out {

/// Writes `text` and a newline to `given`: into a file beside its target
/// first, renamed over the target once whole, so that a full disk leaves an
/// earlier file as it was and never a truncated one. A symbolic link is
/// written through (its target is replaced). A path that exists and is not a
/// regular file (/dev/stdout on a terminal or a pipe, a FIFO) is written
/// straight into: that is asked of the path as given, since /dev/stdout on a
/// pipe resolves to a name ("pipe:[…]") that is no file at all. Returns 0, or
/// the errno of the step that failed.
inline int write_file_whole(const std::string& given, std::string_view text) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (const auto st = fs::status(given, ec); !ec && fs::exists(st) && !fs::is_regular_file(st)) {
    std::ofstream direct(given);
    direct << text << '\n';
    direct.close();
    return direct ? 0 : (errno ? errno : EIO);
  }
  const fs::path canonical = fs::weakly_canonical(given, ec);
  const std::string path = ec ? given : canonical.string();
  const std::string partial = fmt::format("{}.partial-{}", path, ::getpid());
  std::ofstream out(partial);
  out << text << '\n';
  out.close();
  int failed = out ? 0 : (errno ? errno : EIO);
  if (!failed && std::rename(partial.c_str(), path.c_str()) != 0) failed = errno;
  if (failed) std::remove(partial.c_str());
  return failed;
}

}  // namespace gossip::out

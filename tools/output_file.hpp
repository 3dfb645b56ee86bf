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
/// written through (its target is replaced or created, the link kept).
/// A stream's path (/dev/stdout, /dev/stderr, /dev/fd/N, under /proc:
/// whatever the stream is, even a file a shell redirected it to) and any
/// other path that exists and is not a regular file (a FIFO) is written
/// straight into, appending: that is asked of the path as given, since
/// /dev/stdout resolves to a pipe's "pipe:[…]" or to the file behind the
/// stream, which a rename would replace. Returns 0, or the errno of the step
/// that failed.
inline int write_file_whole(const std::string& given, std::string_view text) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto failure = [] { return errno ? errno : EIO; };
  const auto st = fs::status(given, ec);
  const bool stream = given.starts_with("/dev/std") || given.starts_with("/dev/fd/") || given.starts_with("/proc/");
  if (stream || (!ec && fs::exists(st) && !fs::is_regular_file(st))) {
    errno = 0;
    std::ofstream direct(given, std::ios::app);
    direct << text << '\n';
    direct.close();
    return direct ? 0 : failure();
  }
  // The target: links followed to the end, a dangling one's target too
  // (weakly_canonical keeps a link whose target is missing as it is).
  fs::path target = given;
  for (int hops = 0; hops < 40 && fs::is_symlink(fs::symlink_status(target, ec)); ++hops) {
    const fs::path to = fs::read_symlink(target, ec);
    if (ec) break;
    target = to.is_absolute() ? to : target.parent_path() / to;
  }
  const fs::path canonical = fs::weakly_canonical(target, ec);
  const std::string path = ec ? target.string() : canonical.string();
  const std::string partial = fmt::format("{}.partial-{}", path, ::getpid());
  errno = 0;
  std::ofstream out(partial);
  out << text << '\n';
  out.close();
  int failed = out ? 0 : failure();
  if (!failed && std::rename(partial.c_str(), path.c_str()) != 0) failed = errno;
  if (failed) std::remove(partial.c_str());
  return failed;
}

}  // namespace gossip::out

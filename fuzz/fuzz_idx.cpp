// The IDX reader (examples/common/data.cpp, gossip::data::read_idx) on a pair of
// files, gzipped or not. Every rejection must be a gossip::data_error; an
// accepted dataset must be consistent (sizes, labels < 10, pixels in [0, 1]).
//
// Input: a 16-bit little-endian length of the images file, the images file,
// then the labels file (whatever is left). The files are memfds named by
// /proc/self/fd paths, rewritten for every input.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/data.hpp"
#include "gossip/error.hpp"

namespace {

struct memfile {
  int fd = -1;
  std::string path;
  explicit memfile(const char* name) : fd(::memfd_create(name, 0)), path("/proc/self/fd/" + std::to_string(fd)) {
    if (fd < 0) std::abort();
  }
  void write(const std::uint8_t* p, std::size_t n) const {
    if (::ftruncate(fd, 0) != 0) std::abort();
    for (std::size_t done = 0; done < n;) {
      const auto w = ::pwrite(fd, p + done, n - done, static_cast<off_t>(done));
      if (w <= 0) std::abort();
      done += static_cast<std::size_t>(w);
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const memfile images("idx-images"), labels("idx-labels");
  if (size < 2) return 0;
  std::size_t n = static_cast<std::size_t>(data[0]) | static_cast<std::size_t>(data[1]) << 8;
  data += 2, size -= 2;
  if (n > size) n = size;
  images.write(data, n);
  labels.write(data + n, size - n);
  try {
    const auto ds = gossip::data::read_idx(images.path, labels.path);
    if (ds.images.size() != ds.size() * ds.features() || ds.rows < 1 || ds.cols < 1) std::abort();
    for (auto l : ds.labels)
      if (l >= 10) std::abort();
    for (float x : ds.images)
      if (!(x >= 0.0f && x <= 1.0f)) std::abort();
  } catch (const gossip::data_error&) {
  }
  return 0;
}

#pragma once
/// The drift pass: ‖x − x̂‖² and ‖x̂‖² (and optionally ‖x − x_prev‖², updating
/// x_prev) in one pass over memory.
///
///     gossip::drift_sums d = gossip::drift_pass(x.data(), x_hat.data(), nullptr, x.size());
///     double relative = std::sqrt(d.diff_sq / d.ref_sq);
///
/// The tensor is read as four interleaved streams (its four quarters), one
/// 64-byte line of each input per stream and iteration, with a software
/// prefetch a few lines ahead: a single sequential stream leaves one core far
/// below what the memory system delivers once the model is larger than the
/// last-level cache (measured +25 to +40 % on a 256 MiB model). Sums are kept
/// in SIMD float accumulators for a short block and then added into doubles,
/// so large models keep their precision: each float accumulator lane sums at
/// most 256 non-negative terms.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <Eigen/Core>

namespace gossip {

struct drift_sums {
  double diff_sq = 0;
  double ref_sq = 0;
  double step_sq = 0;
};

/// Quasi-global momentum (Lin et al., ICML 2021), fused into the drift pass:
/// with d = (x_{t−1} − x_t)/lr, the displacement of the last step including
/// what gossip merged in, m̂ ← β·m̂ + (1 − β)·d, and the optimizer's own
/// momentum buffer is set to m̂. Its next step then builds on a momentum that
/// points where the consensus goes, not where this rank's shard pulls.
///
/// The displacement splits into the optimizer's own step, lr·v (v the
/// velocity it left in its buffer), and what the merges moved, Δ:
/// d = v − merge_share·Δ/lr. merge_share = 1 is Lin et al.'s rule, made for
/// gossip every step; momentum then carries each merge on for β/(1 − β) = 9
/// times its size. When merges are τ steps apart and nothing reacts to the
/// overshoot, the models swing past each other: on label-skewed shards
/// (8 workers), periodic every 10, 14 and 30 steps fell to 61 %, 49 % and
/// 14 % (every 7: fine). qgm_merge_share() gives the share for a merge τ
/// steps after the previous one; a policy that fires on drift closes the
/// loop itself and does better with the full merge
/// (engine_settings::momentum_merge).
struct qgm_args {
  float* mhat = nullptr;    ///< m̂, the engine's
  float* buffer = nullptr;  ///< the optimizer's momentum buffer: read as v, overwritten with m̂
  float inv_lr = 0, beta = 0.9f;
  float merge_share = 1.0f;  ///< the weight of the merged displacement (1: no merge, or the full merge)
};

/// The share of a merge's displacement Δ that quasi-global momentum carries
/// on, for a merge τ steps after the previous one:
///
///     merge_share = min(1, 1 / (2·(1 − β)·τ))
///
/// Fed into m̂, share·Δ/lr moves the model by about β·(1 − β)·τ·share·Δ over
/// the τ steps to the next merge (m̂ decays as β + (1 − β)·β per step, since
/// the optimizer's buffer starts each step from β·m̂: a memory of
/// 1/(1 − β)² = 100 steps at β = 0.9, far beyond τ). A merge takes a rank to
/// a pairwise average; carrying on by more than the merge itself before the
/// next one swaps the pair's sides, and with one peer per round
/// (exponential graph) the swings grow: with 1/((1 − β)·τ), a carry of
/// 0.9·Δ, consensus distance exploded on label-skewed shards at some periods
/// (8 workers, periodic every 13: 63 % against 79 % at every 14) and in a
/// quadratic model of 8 ranks (tests/test_drift.cpp). Half of that, a carry
/// of 0.45·Δ per interval, keeps a factor 2 from the edge: periodic every
/// 7 … 40 then falls smoothly with the period (80.2 % … 73.6 %), every one
/// above local momentum.
inline float qgm_merge_share(float beta, std::uint64_t tau) noexcept {
  if (tau == 0) return 1.0f;
  return std::min(1.0f, 1.0f / (2.0f * (1.0f - beta) * static_cast<float>(tau)));
}

namespace detail {

inline constexpr std::size_t drift_line = 16;         // floats per stream and iteration (one cache line)
inline constexpr std::size_t drift_streams = 4;       // interleaved quarters of the tensor
inline constexpr std::size_t drift_block = 64;        // iterations between float → double flushes
inline constexpr std::size_t drift_prefetch = 512;    // floats ahead (2 KiB) of each stream

inline void drift_prefetch_at(const float* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

// Pairwise sum of a line's packets (1, 2 or 4 of them).
template <std::size_t count, typename packet>
[[gnu::always_inline]] inline packet line_sum(const packet* v) noexcept {
  namespace ei = Eigen::internal;
  if constexpr (count == 1) return v[0];
  else if constexpr (count == 2) return ei::padd(v[0], v[1]);
  else {
    static_assert(count % 2 == 0, "a line of an odd number of packets");
    return ei::padd(line_sum<count / 2>(v), line_sum<count / 2>(v + count / 2));
  }
}

// Never inlined: one compiled loop per instantiation, shared by the engine's
// step and every caller of drift_pass in the program (the linker keeps one
// copy). Inlined into each caller, the same source compiled to loops whose
// speed differed by 10–20 % from one call site to another (the engine's step
// against a caller's own pass, bench/transport's step cost at 64K–1M floats),
// so a skipped step cost more than the pass it is made of.
//
// with_makeup: x first becomes x + makeup·(x − ref), written to `out` (x's
// own memory), and the rest of the pass measures that (drift_pass_made_up).
template <bool with_prev, bool with_qgm = false, bool with_makeup = false, bool makeup_from_prev = false>
[[gnu::noinline]] inline drift_sums drift_pass_impl(const float* x, const float* ref, float* prev, std::size_t n, const qgm_args& q = {},
                                                    float* out = nullptr, float makeup = 0) noexcept {
  namespace ei = Eigen::internal;
  using packet = typename ei::packet_traits<float>::type;
  constexpr std::size_t width = static_cast<std::size_t>(ei::packet_traits<float>::size);
  constexpr std::size_t per_line = drift_line / width;
  static_assert(drift_line % width == 0, "a SIMD packet wider than 16 floats");

  drift_sums s;
  static_assert(with_prev || !with_qgm, "quasi-global momentum needs x_{t−1}");
  static_assert(with_prev || !makeup_from_prev, "a make-up from x_{t−1} needs it");
  // d = −e/lr when merge_share is 1; else v − share·(e/lr + v) = (1 − share)·v − share·e/lr.
  [[maybe_unused]] const packet own = ei::pset1<packet>(1.0f - q.merge_share), shared = ei::pset1<packet>(q.merge_share * q.inv_lr),
                                beta = ei::pset1<packet>(q.beta), rest = ei::pset1<packet>(1.0f - q.beta);
  [[maybe_unused]] const packet extra = ei::pset1<packet>(makeup);
  const std::size_t quarter = n / (drift_streams * drift_line) * drift_line;
  for (std::size_t block = 0; block < quarter; block += drift_block * drift_line) {
    const std::size_t end = std::min(quarter, block + drift_block * drift_line);
    packet diff[drift_streams], refs[drift_streams], step[drift_streams];
    for (std::size_t k = 0; k < drift_streams; ++k) diff[k] = refs[k] = step[k] = ei::pset1<packet>(0.0f);
    for (std::size_t j = block; j < end; j += drift_line) {
      const bool ahead = j + drift_prefetch < quarter;
      for (std::size_t k = 0; k < drift_streams; ++k) {
        const std::size_t at = k * quarter + j;
        if (ahead) {
          drift_prefetch_at(x + at + drift_prefetch);
          drift_prefetch_at(ref + at + drift_prefetch);
          if constexpr (with_prev) drift_prefetch_at(prev + at + drift_prefetch);
        }
        // The line's squares are summed as a tree and added to the stream's
        // accumulator once: one dependent add per line, not one per packet.
        packet dl[per_line], rl[per_line], sl[per_line];
        for (std::size_t p = 0; p < per_line; ++p) {
          packet xv = ei::ploadu<packet>(x + at + p * width);
          const packet rv = ei::ploadu<packet>(ref + at + p * width);
          if constexpr (with_makeup) {
            if constexpr (makeup_from_prev)
              xv = ei::pmadd(extra, ei::psub(xv, ei::ploadu<packet>(prev + at + p * width)), xv);
            else
              xv = ei::pmadd(extra, ei::psub(xv, rv), xv);
            ei::pstoreu(out + at + p * width, xv);
          }
          const packet d = ei::psub(xv, rv);
          dl[p] = ei::pmul(d, d);
          rl[p] = ei::pmul(rv, rv);
          if constexpr (with_prev) {
            const packet e = ei::psub(xv, ei::ploadu<packet>(prev + at + p * width));
            sl[p] = ei::pmul(e, e);
            ei::pstoreu(prev + at + p * width, xv);
            if constexpr (with_qgm) {
              const std::size_t i = at + p * width;
              const packet dv = ei::psub(ei::pmul(own, ei::ploadu<packet>(q.buffer + i)), ei::pmul(e, shared));
              const packet m = ei::pmadd(beta, ei::ploadu<packet>(q.mhat + i), ei::pmul(rest, dv));
              ei::pstoreu(q.mhat + i, m);
              ei::pstoreu(q.buffer + i, m);
            }
          }
        }
        diff[k] = ei::padd(diff[k], line_sum<per_line>(dl));
        refs[k] = ei::padd(refs[k], line_sum<per_line>(rl));
        if constexpr (with_prev) step[k] = ei::padd(step[k], line_sum<per_line>(sl));
      }
    }
    for (std::size_t k = 0; k < drift_streams; ++k) {
      s.diff_sq += static_cast<double>(ei::predux(diff[k]));
      s.ref_sq += static_cast<double>(ei::predux(refs[k]));
      if constexpr (with_prev) s.step_sq += static_cast<double>(ei::predux(step[k]));
    }
  }
  // The rest: fewer than 64 elements past the four quarters.
  for (std::size_t i = drift_streams * quarter; i < n; ++i) {
    if constexpr (with_makeup) out[i] = x[i] + makeup * (x[i] - (makeup_from_prev ? prev[i] : ref[i]));  // out is x
    const double xv = x[i], rv = ref[i];
    s.diff_sq += (xv - rv) * (xv - rv);
    s.ref_sq += rv * rv;
    if constexpr (with_prev) {
      const double e = xv - static_cast<double>(prev[i]);
      s.step_sq += e * e;
      prev[i] = x[i];
      if constexpr (with_qgm) {
        const float dv = (1.0f - q.merge_share) * q.buffer[i] - q.merge_share * q.inv_lr * static_cast<float>(e);
        q.mhat[i] = q.beta * q.mhat[i] + (1.0f - q.beta) * dv;
        q.buffer[i] = q.mhat[i];
      }
    }
  }
  return s;
}

}  // namespace detail

/// Sums of one mixing pass: ‖m − z‖² and ‖z‖², z as it was before the pass.
struct mix_sums {
  double diff_sq = 0;
  double ref_sq = 0;
};

namespace detail {
template <bool with_makeup>
inline mix_sums mix_pass_impl(float* z, const float* m, float b, std::size_t n, const float* ref, float makeup) noexcept {
  namespace ei = Eigen::internal;
  using packet = typename ei::packet_traits<float>::type;
  constexpr std::size_t width = static_cast<std::size_t>(ei::packet_traits<float>::size);
  constexpr std::size_t block = 1024;
  mix_sums s;
  const packet bv = ei::pset1<packet>(b);
  [[maybe_unused]] const packet cv = ei::pset1<packet>(makeup);
  const std::size_t vec_end = n / width * width;
  for (std::size_t start = 0; start < vec_end; start += block) {
    const std::size_t end = std::min(vec_end, start + block);
    packet diff = ei::pset1<packet>(0.0f), refs = ei::pset1<packet>(0.0f);
    for (std::size_t i = start; i < end; i += width) {
      packet zv = ei::ploadu<packet>(z + i);
      if constexpr (with_makeup) zv = ei::pmadd(cv, ei::psub(zv, ei::ploadu<packet>(ref + i)), zv);
      const packet d = ei::psub(ei::ploadu<packet>(m + i), zv);
      diff = ei::pmadd(d, d, diff);
      refs = ei::pmadd(zv, zv, refs);
      ei::pstoreu(z + i, ei::pmadd(bv, d, zv));
    }
    s.diff_sq += static_cast<double>(ei::predux(diff));
    s.ref_sq += static_cast<double>(ei::predux(refs));
  }
  for (std::size_t i = vec_end; i < n; ++i) {
    if constexpr (with_makeup) z[i] = z[i] + makeup * (z[i] - ref[i]);
    const double zv = z[i], d = static_cast<double>(m[i]) - zv;
    s.diff_sq += d * d;
    s.ref_sq += zv * zv;
    z[i] = z[i] + b * (m[i] - z[i]);
  }
  return s;
}
}  // namespace detail

/// The merge of one received model, z ← z + b·(m − z), measuring on the way
/// how far apart the two models were: the distance a consensus estimate needs
/// costs no pass of its own. Same blocking as drift_pass (float lanes flushed
/// into doubles every 1024 elements).
inline mix_sums mix_pass(float* z, const float* m, float b, std::size_t n) noexcept {
  return detail::mix_pass_impl<false>(z, m, b, n, nullptr, 0);
}

/// mix_pass after z ← z + makeup·(z − ref), in the same pass (the sums measure
/// the made-up z): see drift_pass_made_up.
inline mix_sums mix_pass_made_up(float* z, const float* m, float b, std::size_t n, const float* ref, float makeup) noexcept {
  return detail::mix_pass_impl<true>(z, m, b, n, ref, makeup);
}

/// z ← z + makeup·(z − ref) alone, where no other pass can take it.
inline void make_up(float* z, const float* ref, std::size_t n, float makeup) noexcept {
  detail::mix_pass_impl<true>(z, ref, 0.0f, n, ref, makeup);
}

/// x: current model, ref: x̂. When `prev` is non-null, also measures
/// ‖x − prev‖² and then copies x into prev (fused into the same pass).
/// `prev` may not overlap x or ref.
inline drift_sums drift_pass(const float* x, const float* ref, float* prev, std::size_t n) noexcept {
  return prev ? detail::drift_pass_impl<true>(x, ref, prev, n) : detail::drift_pass_impl<false>(x, ref, nullptr, n);
}

/// drift_pass with prev, and the quasi-global momentum update of `q` (whose
/// mhat and buffer cover the same n elements) in the same pass.
inline drift_sums drift_pass(const float* x, const float* ref, float* prev, std::size_t n, const qgm_args& q) noexcept {
  return detail::drift_pass_impl<true, true>(x, ref, prev, n, q);
}

/// drift_pass (with `q` when non-null) of x after x ← x + makeup·(x − ref),
/// written in the same pass: the push-sum make-up for the share that a send
/// left in flight during the optimizer step after it
/// (engine_settings::in_flight_makeup).
inline drift_sums drift_pass_made_up(float* x, const float* ref, float* prev, std::size_t n, float makeup, const qgm_args* q = nullptr) noexcept {
  if (q) return detail::drift_pass_impl<true, true, true>(x, ref, prev, n, *q, x, makeup);
  return prev ? detail::drift_pass_impl<true, false, true>(x, ref, prev, n, {}, x, makeup)
              : detail::drift_pass_impl<false, false, true>(x, ref, nullptr, n, {}, x, makeup);
}

/// drift_pass with prev (and `q` when non-null) of x after
/// x ← x + makeup·(x − prev), written in the same pass: the push-sum
/// correction that counts the optimizer step since x_{t−1} at weight 1
/// (engine_settings::numerator_steps).
inline drift_sums drift_pass_stepped(float* x, const float* ref, float* prev, std::size_t n, float makeup, const qgm_args* q = nullptr) noexcept {
  if (q) return detail::drift_pass_impl<true, true, true, true>(x, ref, prev, n, *q, x, makeup);
  return detail::drift_pass_impl<true, false, true, true>(x, ref, prev, n, {}, x, makeup);
}

}  // namespace gossip

// torchscope's CPU float32 reductions: every statistic of a tensor in one pass over it.
//
// Built once per machine by torchscope._kernels (g++ with torch's headers, -O3
// -march=native) and loaded with torch.ops.load_library. Two ops:
//   stats(x, dead_units) -> float64 (8,): MEAN, STD, MIN, MAX, NORM, ZEROS, NANS, INFS;
//       with dead_units, a tensor of 2+ dims and at least kMinPlane elements per (sample,
//       channel), (9,): a ninth slot DEAD counts the channels (dim 1) that are zero
//       everywhere.
//   norm(x) -> float64 (): the L2 norm.
// x is a contiguous float32 CPU tensor of any shape with at least 2 elements.
// And these over a list of tensors (a model's parameters; any sizes, empty ones too), in
// one parallel pass that splits the list's elements evenly among threads:
//   copy_norms(xs) -> (copies, float64 (n,)): a copy of each and its norm, one read.
//   diff_norms(a, b) -> float64 (n,): the norm of each a[i] - b[i] (float32 differences, as
//       a subtraction would round them), without writing the differences.
//   norms(xs) -> float64 (n,): the norm of each (a model's gradients or weights).
//   norms_into(xs, out, largest): the same norms written into out (a float64 (n,) row the
//       caller keeps, such as a ring's), and their largest into largest (float64, one
//       element; NaN where a norm is): a training step's NaN/Inf check in one call that
//       allocates nothing.
//
// Why it is fast and still exact where it must be: the data is read in spans of at most
// 1024 elements. A span's sums run in float32 vector lanes (32 elements per lane at most,
// so the rounding stays near float32's own; the same 32 on every CPU, see kStep) and go to
// float64 at the span's end, by a fixed tree (lane_sum); min, max and the zero count are
// exact in any precision. A span whose float32 sum of squares is not finite (it holds NaN
// or Inf, or squares past float32's range) or underflows (tiny values) is read again in
// float64, element by element, where NaN and Inf are counted exactly. So the common,
// finite span costs about one vector instruction per statistic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// The CPU's own vector width: 16 float32 lanes with AVX-512, 8 with AVX/AVX2, 4 otherwise
// (SSE2, NEON). A vector wider than the target's registers is lowered by GCC lane by lane
// through the stack: measured on an AVX2 CPU (Zen 3), 16-lane vectors made `stats` cost
// 20 reads of its tensor and `norm` 3; 8 lanes, 1.9 and 1.1 (1.1 and 1.0 once `stats`
// kept its accumulators in the registers, see stats_span).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
// Each loop step reads kStep elements as kWays vectors, one accumulator each: lane j of way
// w sums the elements at w * kLanes + j of every step, so on every CPU each float32 lane
// sums the same 32 elements of a span, in the same order.
constexpr int kStep = 32;
constexpr int kWays = kStep / kLanes;
constexpr int64_t kSpan = 1024;
constexpr float kTiny = 1e-30f;  // below this a float32 sum of squares may have underflowed
// Dead units in the pass only for channels of at least this many elements per sample: it
// walks (sample, channel) planes, and short planes walk slower than one flat pass plus an
// eager per-channel max (the caller's fallback).
constexpr int64_t kMinPlane = 64;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

// The float64 sum of a span's kWays float32 accumulators, taken as kStep values (element
// e = w * kLanes + j: the same e on every CPU, see kStep), by a fixed pairwise tree over e
// (e with e + 16, then e + 8, ...): the same additions in the same order on every CPU,
// which the compiler turns into a few vector instructions, where 32 dependent scalar
// additions per span cost a fifth of `norm` (AVX2).
__attribute__((always_inline)) inline double lane_sum(const vf* v) {
  float f[kStep];
  static_assert(sizeof(f) == kWays * sizeof(vf), "kWays vectors hold kStep floats");
  std::memcpy(f, v, sizeof(f));
  double d[kStep];
  for (int e = 0; e < kStep; ++e) d[e] = f[e];
#pragma GCC unroll 8
  for (int h = kStep / 2; h >= 1; h /= 2)
    for (int e = 0; e < h; ++e) d[e] += d[e + h];
  return d[0];
}

struct Acc {
  double s1 = 0, s2 = 0;  // sums of d = x - k and of d * d
  float mn = std::numeric_limits<float>::infinity();
  float mx = -std::numeric_limits<float>::infinity();
  int64_t zeros = 0, nans = 0, infs = 0;
};

// The exact path: float64 sums, NaN and Inf counted; min/max skip NaN (a NaN count makes
// both NaN at the end, as aminmax does).
void slow_span(const float* p, int64_t n, double k, Acc& a) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = p[i];
    const double d = static_cast<double>(v) - k;
    a.s1 += d;
    a.s2 += d * d;
    a.zeros += v == 0.f;
    if (std::isnan(v)) {
      a.nans++;
      continue;
    }
    a.infs += std::isinf(v);
    a.mn = std::min(a.mn, v);
    a.mx = std::max(a.mx, v);
  }
}

// One span; returns its zero count, or -1 when it held NaN/Inf (so it is not all zero).
// Without a shift (most data: mean near zero) the differences are the values themselves:
// one subtraction per vector less.
template <bool kShift>
int64_t stats_span(const float* p, int64_t n, float kf, double k, Acc& a) {
  const vf kv = vf{} + kf;
  // The sums keep one accumulator per way (each lane its own 32 elements, see kStep); min,
  // max and the zero count are exact in any order, so they keep one for all the ways: five
  // per way would not fit AVX2's 16 registers: the accumulators spilled to the stack, and
  // every loop step waited on its own stores.
  vf s1[kWays], s2[kWays];
#pragma GCC unroll 8
  for (int w = 0; w < kWays; ++w) {
    s1[w] = vf{};
    s2[w] = vf{};
  }
  vf mn_v = vf{} + std::numeric_limits<float>::infinity(), mx_v = -mn_v;
  vi z = vi{};
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    vf x[kWays];
#pragma GCC unroll 8
    for (int w = 0; w < kWays; ++w) {
      x[w] = load(p + i + w * kLanes);
      const vf d = kShift ? x[w] - kv : x[w];
      s1[w] += d;
      s2[w] += d * d;
      z -= x[w] == 0;  // a true compare is -1 in every lane
    }
    // The ways' minimum and maximum by a tree: one dependent step per loop step. A NaN
    // may spoil them; its span is then read again (slow_span), and they are not used.
    vf lo = x[0], hi = x[0];
#pragma GCC unroll 8
    for (int w = 1; w < kWays; ++w) {
      lo = x[w] < lo ? x[w] : lo;
      hi = x[w] > hi ? x[w] : hi;
    }
    mn_v = lo < mn_v ? lo : mn_v;
    mx_v = hi > mx_v ? hi : mx_v;
  }
  double t1 = lane_sum(s1), t2 = lane_sum(s2);
  float mn = mn_v[0], mx = mx_v[0];
  int64_t zc = 0;
  for (int j = 0; j < kLanes; ++j) {
    mn = std::min(mn, mn_v[j]);
    mx = std::max(mx, mx_v[j]);
    zc += z[j];
  }
  for (; i < n; ++i) {  // the tail: fewer than 32 elements
    const float v = p[i], d = v - kf;
    t1 += d;
    t2 += static_cast<double>(d) * d;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    zc += v == 0.f;
  }
  const bool constant = mn == kf && mx == kf;  // every d is exactly 0
  if (!std::isfinite(t2) || (t2 < kTiny && !constant)) {
    slow_span(p, n, k, a);
    return -1;
  }
  a.s1 += t1;
  a.s2 += t2;
  a.zeros += zc;
  a.mn = std::min(a.mn, mn);
  a.mx = std::max(a.mx, mx);
  return zc;
}

int64_t workers(int64_t items, int64_t per_worker) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items / per_worker));
}

void check(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu() &&
                  x.numel() >= 2,
              "torchscope native reductions take a contiguous float32 CPU tensor");
}

at::Tensor stats(const at::Tensor& x, bool dead_units) {
  check(x);
  const int64_t n = x.numel();
  const float* p = x.const_data_ptr<float>();
  const int64_t channels = x.dim() >= 2 ? x.size(1) : 0;
  const int64_t inner = channels ? n / (x.size(0) * channels) : 0;  // per (sample, channel)
  const bool dead = dead_units && channels && inner >= kMinPlane;
  // The shift k: 0 when the first span's mean lies within 4 standard deviations of zero,
  // so that every difference x - k is x itself, exactly (a shift with low bits would
  // round x - k the same way across a binade and bias the mean). Only a mean far from
  // zero is shifted out, to keep the centred sum of squares from cancelling; most x then
  // lie within a factor of 2 of k, where x - k is exact too.
  double h1 = 0, h2 = 0;
  const int64_t head = std::min(n, kSpan);
  for (int64_t i = 0; i < head; ++i) {
    h1 += p[i];
    h2 += static_cast<double>(p[i]) * p[i];
  }
  const double hm = h1 / static_cast<double>(head);
  const double hvar = std::max(h2 / static_cast<double>(head) - hm * hm, 0.0);
  const bool shift = std::isfinite(hm) && std::isfinite(hvar) && std::fabs(hm) < 1e30 &&
                     hm * hm > 16.0 * hvar;
  const float kf = shift ? static_cast<float>(hm) : 0.f;
  const double k = kf;  // the shift both paths use, exactly
  const auto span = shift ? stats_span<true> : stats_span<false>;

  const int64_t planes = dead ? n / inner : 0;
  const int64_t nw = dead ? workers(planes, std::max<int64_t>(1, 32768 / inner))
                          : workers(n, 32768);
  std::vector<Acc> acc(nw);
  std::vector<uint8_t> alive(dead ? nw * channels : 0, 0);
  at::parallel_for(0, nw, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      Acc& a = acc[w];
      if (dead) {
        uint8_t* live = alive.data() + w * channels;
        for (int64_t q = planes * w / nw; q < planes * (w + 1) / nw; ++q) {
          const float* plane = p + q * inner;
          bool all_zero = true;
          for (int64_t o = 0; o < inner; o += kSpan) {
            const int64_t m = std::min(kSpan, inner - o);
            all_zero &= span(plane + o, m, kf, k, a) == m;
          }
          live[q % channels] |= !all_zero;
        }
      } else {
        // Span-aligned ranges, so that no span is split between workers.
        const int64_t lo = n * w / nw / kSpan * kSpan;
        const int64_t hi = w + 1 == nw ? n : n * (w + 1) / nw / kSpan * kSpan;
        for (int64_t o = lo; o < hi; o += kSpan) span(p + o, std::min(kSpan, hi - o), kf, k, a);
      }
    }
  });
  Acc t;
  for (const Acc& a : acc) {
    t.s1 += a.s1;
    t.s2 += a.s2;
    t.zeros += a.zeros;
    t.nans += a.nans;
    t.infs += a.infs;
    t.mn = std::min(t.mn, a.mn);
    t.mx = std::max(t.mx, a.mx);
  }
  const double nd = static_cast<double>(n);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const double ss = std::max(t.s2 - t.s1 * t.s1 / nd, 0.0);  // centred sum of squares
  const double sq = std::max(t.s2 + 2.0 * k * t.s1 + nd * k * k, 0.0);  // sum of x^2
  int64_t dead_count = -1;
  if (dead) {
    dead_count = 0;
    for (int64_t c = 0; c < channels; ++c) {
      bool live = false;
      for (int64_t w = 0; w < nw; ++w) live |= alive[w * channels + c] != 0;
      dead_count += !live;
    }
  }
  at::Tensor out = at::empty({dead ? 9 : 8}, x.options().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  o[0] = k + t.s1 / nd;                                     // MEAN
  o[1] = t.nans + t.infs ? nan : std::sqrt(ss / (nd - 1));  // STD (unbiased)
  // + 0.0: a zero bound is +0 whichever sign the lanes kept (their order differs by CPU).
  o[2] = t.nans ? nan : t.mn + 0.0;                         // MIN
  o[3] = t.nans ? nan : t.mx + 0.0;                         // MAX
  o[4] = t.nans ? nan : t.infs ? inf : std::sqrt(sq);       // NORM
  o[5] = static_cast<double>(t.zeros) / nd;                 // ZEROS (fraction)
  o[6] = static_cast<double>(t.nans);                       // NANS
  o[7] = static_cast<double>(t.infs);                       // INFS
  if (dead) o[8] = static_cast<double>(dead_count);         // DEAD
  return out;
}

// The sum of squares of one span, float32 lanes then float64; exact float64 when the
// float32 sum is not finite, or may have underflowed (below kTiny, or 0 over values that
// are not all zero).
double norm_span(const float* p, int64_t n) {
  vf sq[kWays];
#pragma GCC unroll 8
  for (int w = 0; w < kWays; ++w) sq[w] = vf{};
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
#pragma GCC unroll 8
    for (int w = 0; w < kWays; ++w) {
      const vf x = load(p + i + w * kLanes);
      sq[w] += x * x;
    }
  }
  double s = lane_sum(sq);
  for (; i < n; ++i) s += static_cast<double>(p[i]) * p[i];
  if (std::isfinite(s) && s >= kTiny) return s;
  if (s == 0) {  // all zero (a dead unit's gradient), or squares that underflowed to 0
    bool zero = true;
    for (int64_t j = 0; j < n; ++j) zero &= p[j] == 0.f;
    if (zero) return 0;
  }
  double exact = 0;  // NaN and Inf propagate: the norm is NaN or Inf, as eager's is
  for (int64_t j = 0; j < n; ++j) exact += static_cast<double>(p[j]) * p[j];
  return exact;
}

// The squares of a - b over one span, as norm_span (the differences rounded to float32).
double diff_span(const float* a, const float* b, int64_t n) {
  vf sq[kWays];
#pragma GCC unroll 8
  for (int w = 0; w < kWays; ++w) sq[w] = vf{};
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
#pragma GCC unroll 8
    for (int w = 0; w < kWays; ++w) {
      const vf d = load(a + i + w * kLanes) - load(b + i + w * kLanes);
      sq[w] += d * d;
    }
  }
  double s = lane_sum(sq);
  for (; i < n; ++i) {
    const float d = a[i] - b[i];
    s += static_cast<double>(d) * d;
  }
  if (std::isfinite(s) && s >= kTiny) return s;
  if (s == 0) {  // unchanged (a parameter without an update), or differences that underflowed
    bool same = true;
    for (int64_t j = 0; j < n; ++j) same &= a[j] == b[j];
    if (same) return 0;
  }
  double exact = 0;  // NaN and Inf propagate
  for (int64_t j = 0; j < n; ++j) {
    const float d = a[j] - b[j];
    exact += static_cast<double>(d) * d;
  }
  return exact;
}

// A list's elements cut into pieces of at most kPiece elements of one tensor each, so
// that one parallel_for over the pieces balances a few large tensors and many small ones.
constexpr int64_t kPiece = 16 * kSpan;
struct Piece {
  int64_t tensor, lo, hi;
};

void check_list(at::TensorList xs) {
  for (const at::Tensor& x : xs)
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                "torchscope native reductions take contiguous float32 CPU tensors");
}

std::vector<Piece> pieces_of(at::TensorList xs) {
  check_list(xs);
  std::vector<Piece> out;
  for (int64_t t = 0; t < static_cast<int64_t>(xs.size()); ++t) {
    const at::Tensor& x = xs[t];
    for (int64_t lo = 0; lo < x.numel(); lo += kPiece)
      out.push_back({t, lo, std::min(x.numel(), lo + kPiece)});
  }
  return out;
}

// Runs span_fn(piece) -> sum of squares for every piece in parallel; the per-tensor norms
// into o[0..n).
template <typename F>
void norms_of_pieces_into(int64_t n, const std::vector<Piece>& pieces, F span_fn, double* o) {
  std::vector<double> part(pieces.size(), 0.0);
  const int64_t np = static_cast<int64_t>(pieces.size());
  // Threads only when there is enough work to repay waking them.
  at::parallel_for(0, np, np < 4 ? std::max<int64_t>(np, 1) : 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) part[i] = span_fn(pieces[i]);
  });
  std::fill(o, o + n, 0.0);
  for (int64_t i = 0; i < np; ++i) o[pieces[i].tensor] += part[i];
  for (int64_t t = 0; t < n; ++t) o[t] = std::sqrt(o[t]);
}

template <typename F>
at::Tensor norms_of_pieces(int64_t n, const std::vector<Piece>& pieces, F span_fn) {
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  norms_of_pieces_into(n, pieces, span_fn, out.data_ptr<double>());
  return out;
}

std::tuple<std::vector<at::Tensor>, at::Tensor> copy_norms(at::TensorList xs) {
  const auto pieces = pieces_of(xs);
  std::vector<at::Tensor> copies;
  copies.reserve(xs.size());
  for (const at::Tensor& x : xs) copies.push_back(at::empty_like(x));
  at::Tensor out = norms_of_pieces(static_cast<int64_t>(xs.size()), pieces, [&](const Piece& c) {
    const float* p = xs[c.tensor].const_data_ptr<float>();
    float* q = copies[c.tensor].data_ptr<float>();
    double s = 0;
    for (int64_t o = c.lo; o < c.hi; o += kSpan) {
      const int64_t m = std::min(kSpan, c.hi - o);
      std::memcpy(q + o, p + o, m * sizeof(float));
      s += norm_span(q + o, m);  // the copy, just written: read from the cache
    }
    return s;
  });
  return {copies, out};
}

at::Tensor diff_norms(at::TensorList a, at::TensorList b) {
  TORCH_CHECK(a.size() == b.size(), "diff_norms takes two lists of one length");
  for (size_t t = 0; t < a.size(); ++t)
    TORCH_CHECK(a[t].sizes() == b[t].sizes(), "diff_norms takes tensors of equal shapes");
  check_list(b);
  const auto pieces = pieces_of(a);
  return norms_of_pieces(static_cast<int64_t>(a.size()), pieces, [&](const Piece& c) {
    const float* p = a[c.tensor].const_data_ptr<float>();
    const float* q = b[c.tensor].const_data_ptr<float>();
    double s = 0;
    for (int64_t o = c.lo; o < c.hi; o += kSpan)
      s += diff_span(p + o, q + o, std::min(kSpan, c.hi - o));
    return s;
  });
}

double norm_piece(at::TensorList xs, const Piece& c) {
  const float* p = xs[c.tensor].const_data_ptr<float>();
  double s = 0;
  for (int64_t o = c.lo; o < c.hi; o += kSpan) s += norm_span(p + o, std::min(kSpan, c.hi - o));
  return s;
}

at::Tensor norms(at::TensorList xs) {
  return norms_of_pieces(static_cast<int64_t>(xs.size()), pieces_of(xs),
                         [&](const Piece& c) { return norm_piece(xs, c); });
}

void norms_into(at::TensorList xs, const at::Tensor& out, const at::Tensor& largest) {
  const int64_t n = static_cast<int64_t>(xs.size());
  TORCH_CHECK(out.scalar_type() == at::kDouble && out.device().is_cpu() && out.is_contiguous() &&
                  out.numel() == n,
              "norms_into writes into a contiguous float64 CPU tensor of one element per tensor");
  TORCH_CHECK(largest.scalar_type() == at::kDouble && largest.device().is_cpu() &&
                  largest.numel() == 1,
              "norms_into writes the largest norm into one float64 CPU element");
  double* o = out.data_ptr<double>();
  norms_of_pieces_into(n, pieces_of(xs), [&](const Piece& c) { return norm_piece(xs, c); }, o);
  double most = -std::numeric_limits<double>::infinity();  // an empty list's largest
  for (int64_t t = 0; t < n; ++t) {
    if (std::isnan(o[t])) {
      most = o[t];
      break;
    }
    most = std::max(most, o[t]);
  }
  *largest.data_ptr<double>() = most;
}

at::Tensor norm(const at::Tensor& x) {
  check(x);
  const int64_t n = x.numel();
  const float* p = x.const_data_ptr<float>();
  const int64_t nw = workers(n, 32768);
  std::vector<double> part(nw, 0.0);
  at::parallel_for(0, nw, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t lo = n * w / nw / kSpan * kSpan;
      const int64_t hi = w + 1 == nw ? n : n * (w + 1) / nw / kSpan * kSpan;
      for (int64_t o = lo; o < hi; o += kSpan) part[w] += norm_span(p + o, std::min(kSpan, hi - o));
    }
  });
  double s = 0;
  for (double v : part) s += v;
  return at::scalar_tensor(std::sqrt(s), x.options().dtype(at::kDouble));
}

}  // namespace

TORCH_LIBRARY(TORCHSCOPE_NAMESPACE, m) {
  m.def("stats(Tensor x, bool dead_units) -> Tensor");
  m.def("norm(Tensor x) -> Tensor");
  m.def("copy_norms(Tensor[] xs) -> (Tensor[], Tensor)");
  m.def("diff_norms(Tensor[] a, Tensor[] b) -> Tensor");
  m.def("norms(Tensor[] xs) -> Tensor");
  m.def("norms_into(Tensor[] xs, Tensor(a!) out, Tensor(b!) largest) -> ()");
}

TORCH_LIBRARY_IMPL(TORCHSCOPE_NAMESPACE, CPU, m) {
  m.impl("stats", &stats);
  m.impl("norm", &norm);
  m.impl("copy_norms", &copy_norms);
  m.impl("diff_norms", &diff_norms);
  m.impl("norms", &norms);
  m.impl("norms_into", &norms_into);
}

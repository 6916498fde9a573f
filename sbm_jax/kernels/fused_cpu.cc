// SBM attention fused with its sampler, for XLA:CPU through the XLA FFI.
//
// One call handles G graphs (one per (example, head)). Per graph, per query row i, the
// kernel draws the row's edges from the SBM (fastRG, row by row), collapses duplicates,
// thins them to the bernoulli law, adds the forced edges, and attends over them; the
// backward call draws the same edges again from the same counter-based random numbers
// (Philox4x32-10 keyed by the graph's seed, counters (row, index, stream)) instead of
// storing them, as flash attention regenerates its dropout mask. Nothing edge-sized
// exists outside one row's scratch, and the work follows the draws.
//
// Per row i with N_i draws (drawn by the caller, Poisson(c_i sum_j (p_ij + delta))):
//   * each draw picks a key cluster v by inverse CDF over the row's K = kc + 1 weights
//     (Y S)_iv * sum_j z_jv (and delta * #real keys for the exploration cluster, whose
//     keys are uniform over the real ones), then a key inside v by inverse CDF of z_.v:
//     first a chunk of 64 keys (double CDF over chunks, bracketed by a guide table),
//     then the key inside the chunk (float sums of the chunk's weights, in order);
//   * draws are collapsed by a bitmap over the keys, which also sorts them;
//   * bernoulli law: a collapsed pair is kept with probability r / (1 - exp(-c_i r)),
//     r = p_ij + delta (p computed only when the uniform is above 1 / c_i); the forced
//     pairs |i - j| <= forced_half (real keys) are always kept;
//   * attention: scores q_i . k_j / sqrt(d), softmax over the row's edges (float32),
//     dropout on the normalised weights (keep mask keyed by (row, col)), output and
//     log-normaliser.
// The backward call recomputes each row's edges, scores and weights from the kept
// log-normaliser and returns dq, dk, dv and the straight-through gradients of the mask
// to Y S and Z (the estimator `ste`: 0 paper eq. 9, 1 the released code's clipped one,
// 2 ours with probes of absent pairs).
//
// Threads: graphs are processed in parallel, one per thread; graphs left over (fewer
// than the threads) are split by rows, with private key-side gradient accumulators.
// Scratch (per thread: the graph's search tables, one row's buffers, accumulators) is
// taken from a pool that persists across calls; SbmFusedScratchBytes reports its size.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sbm_fused {

constexpr int64_t kChunk = 16;  // keys per chunk of a cluster's key CDF
constexpr uint32_t kStreamDraw = 0, kStreamThin = 1, kStreamProbe = 2, kStreamDrop = 3;
constexpr int kLawBernoulli = 0, kLawPoisson = 1;
constexpr int kStePaper = 0, kSteReference = 1, kStePairs = 2;
constexpr double kTwoM32 = 1.0 / 4294967296.0;
constexpr int64_t kDrawBlock = 1024;  // Philox blocks generated at a time (2 draws each)
constexpr int64_t kPad = 8;           // +inf entries after each CDF (one search window)
constexpr int64_t kAhead = 16;        // draws between a key search's prefetch and its use
constexpr int64_t kEdgeAhead = 4;     // edges between a row gather's prefetch and its use

// ---- Philox4x32-10 (Salmon et al., Random123) ----------------------------------------

static inline void philox(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1, uint32_t c2,
                          uint32_t c3, uint32_t out[4]) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += W0;
      k1 += W1;
    }
    const uint64_t p0 = static_cast<uint64_t>(M0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(M1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

#if defined(__AVX512F__)
// 16 Philox4x32-10 blocks at once: lane l has counter (c0, c1[l], c2, 0).
static inline void mulhilo16(__m512i a, __m512i m, __m512i* hi, __m512i* lo) {
  const __m512i pe = _mm512_mul_epu32(a, m);
  const __m512i po = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  *lo = _mm512_mask_blend_epi32(0xAAAA, pe, _mm512_slli_epi64(po, 32));
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(pe, 32), po);
}

static inline void philox16(uint32_t k0, uint32_t k1, uint32_t c0, __m512i c1, uint32_t c2, __m512i* x0,
                            __m512i* x1, __m512i* x2, __m512i* x3) {
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  __m512i a = _mm512_set1_epi32(static_cast<int>(c0)), b = c1;
  __m512i c = _mm512_set1_epi32(static_cast<int>(c2)), d = _mm512_setzero_si512();
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    __m512i hi0, lo0, hi1, lo1;
    mulhilo16(a, m0, &hi0, &lo0);
    mulhilo16(c, m1, &hi1, &lo1);
    const __m512i na = _mm512_xor_si512(_mm512_xor_si512(hi1, b), _mm512_set1_epi32(static_cast<int>(k0)));
    const __m512i nc = _mm512_xor_si512(_mm512_xor_si512(hi0, d), _mm512_set1_epi32(static_cast<int>(k1)));
    a = na;
    b = lo1;
    c = nc;
    d = lo0;
  }
  *x0 = a;
  *x1 = b;
  *x2 = c;
  *x3 = d;
}
#endif

// Philox blocks (c0, start + b, c2, 0) for b in [0, count), the four words in four arrays.
static inline void philox_blocks(uint32_t k0, uint32_t k1, uint32_t c0, int64_t start, uint32_t c2,
                                 int64_t count, uint32_t* o0, uint32_t* o1, uint32_t* o2, uint32_t* o3) {
  int64_t b = 0;
#if defined(__AVX512F__)
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; b + 16 <= count; b += 16) {
    const __m512i c1 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(start + b)), lanes);
    __m512i x0, x1, x2, x3;
    philox16(k0, k1, c0, c1, c2, &x0, &x1, &x2, &x3);
    _mm512_storeu_si512(o0 + b, x0);
    _mm512_storeu_si512(o1 + b, x1);
    _mm512_storeu_si512(o2 + b, x2);
    _mm512_storeu_si512(o3 + b, x3);
  }
#endif
  for (; b < count; ++b) {
    uint32_t x[4];
    philox(k0, k1, c0, static_cast<uint32_t>(start + b), c2, 0, x);
    o0[b] = x[0];
    o1[b] = x[1];
    o2[b] = x[2];
    o3[b] = x[3];
  }
}

// The first word of Philox block (c0, c1[e], c2, 0) for each e.
static inline void philox_first(uint32_t k0, uint32_t k1, uint32_t c0, const int32_t* c1, uint32_t c2,
                                int64_t count, uint32_t* out) {
  int64_t e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= count; e += 16) {
    __m512i x0, x1, x2, x3;
    philox16(k0, k1, c0, _mm512_loadu_si512(c1 + e), c2, &x0, &x1, &x2, &x3);
    _mm512_storeu_si512(out + e, x0);
  }
#endif
  for (; e < count; ++e) {
    uint32_t x[4];
    philox(k0, k1, c0, static_cast<uint32_t>(c1[e]), c2, 0, x);
    out[e] = x[0];
  }
}

// A float in [0, 1) from the top 24 bits (what jax.random.uniform does with float32).
static inline float unit_float(uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }

// ---- sizes and options -----------------------------------------------------------------

struct Dims {
  int64_t G, n, m, d, dv, kc;
};

struct Opts {
  int law;
  int64_t forced_half;  // -1: no forced edges
  float drop_rate;
  int ste;
  int64_t probes;
  int threads;
};

// One graph's inputs (pointers into the batched buffers).
struct Graph {
  const float *q, *k, *v, *ys, *z, *c;
  const int32_t* counts;
  const uint8_t *qm, *km;
  float delta;
  uint32_t key0, key1, dkey0, dkey1;
};

static inline float dot(const float* a, const float* b, int64_t len) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t x = 0;
  for (; x + 16 <= len; x += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + x), _mm512_loadu_ps(b + x), acc);
  if (x < len) {
    const __mmask16 k = static_cast<__mmask16>((1u << (len - x)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + x), _mm512_maskz_loadu_ps(k, b + x), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t x = 0; x < len; ++x) acc += a[x] * b[x];
  return acc;
#endif
}

static inline void prefetch_row(const float* row, int64_t len) {
  for (int64_t x = 0; x < len; x += 16) __builtin_prefetch(row + x);
}

// y += a * x
static inline void axpy(float a, const float* x, float* y, int64_t len) {
#if defined(__AVX512F__)
  const __m512 va = _mm512_set1_ps(a);
  int64_t t = 0;
  for (; t + 16 <= len; t += 16)
    _mm512_storeu_ps(y + t, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + t), _mm512_loadu_ps(y + t)));
  if (t < len) {
    const __mmask16 k = static_cast<__mmask16>((1u << (len - t)) - 1u);
    _mm512_mask_storeu_ps(y + t, k, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(k, x + t), _mm512_maskz_loadu_ps(k, y + t)));
  }
#else
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) y[t] += a * x[t];
#endif
}

// ---- scratch ---------------------------------------------------------------------------

// A bump layout over one block of bytes; with base == nullptr it only measures.
struct Bump {
  uint8_t* base;
  size_t off = 0;
  template <class T>
  T* take(int64_t count) {
    off = (off + 63) & ~static_cast<size_t>(63);
    T* p = base ? reinterpret_cast<T*>(base + off) : nullptr;
    off += sizeof(T) * static_cast<size_t>(std::max<int64_t>(count, 1));
    return p;
  }
};

// One graph's search tables.
struct Tables {
  float* zc;        // [kc][nc * 16] cumulative weight inside each chunk of 16 keys
  double* ccdf;     // [kc][nc + 1 + kPad] cumulative weight of the chunks, +inf padded
  int32_t* cguide;  // [kc][nc] first chunk whose CDF passes g * total / nc
  double* zsum;     // [kc] total weight of each cluster (ccdf[v][nc])
  int32_t* real;    // [m] the real keys, in order
  int64_t mreal = 0, nc = 0;
};

// One thread's row buffers (and key-side accumulators for row-split backward passes).
struct Rows {
  uint64_t* bits;    // [ceil(m / 64)] the row's draws, collapsed
  int32_t* cols;     // [m] the row's edges, sorted
  float* s;          // [m] their scores
  uint32_t* u;       // [4 * kDrawBlock] random words (draws, thinning, dropout, probes)
  int32_t *dcl, *dat;  // [2 * kDrawBlock] each draw's cluster, guide entry / chunk
  double* duk;       // [2 * kDrawBlock] each draw's key uniform
  double* rcdf;      // [K + 1 + kPad] the row's cluster CDF, +inf padded
  int32_t* rguide;   // [K] its guide table
  float* vec;        // [max(d, dv, kc)] x 3: row accumulators
  float* acc;        // [m * (d + dv + kc)] key-side gradient accumulators (or nullptr)
};

struct Slot {
  Tables t;
  Rows r;
};

static void layout(const Dims& D, bool with_acc, Bump& b, Slot& s) {
  const int64_t nc = (D.m + kChunk - 1) / kChunk, K = D.kc + 1;
  s.t.zc = b.take<float>(D.kc * nc * kChunk);
  s.t.ccdf = b.take<double>(D.kc * (nc + 1 + kPad));
  s.t.cguide = b.take<int32_t>(D.kc * nc);
  s.t.zsum = b.take<double>(D.kc);
  s.t.real = b.take<int32_t>(D.m);
  s.t.nc = nc;
  s.r.bits = b.take<uint64_t>((D.m + 63) / 64);
  s.r.cols = b.take<int32_t>(D.m);
  s.r.s = b.take<float>(D.m);
  s.r.u = b.take<uint32_t>(4 * std::max(kDrawBlock, D.m));
  s.r.dcl = b.take<int32_t>(2 * kDrawBlock);
  s.r.dat = b.take<int32_t>(2 * kDrawBlock);
  s.r.duk = b.take<double>(2 * kDrawBlock);
  s.r.rcdf = b.take<double>(K + 1 + kPad);
  s.r.rguide = b.take<int32_t>(K);
  s.r.vec = b.take<float>(3 * std::max({D.d, D.dv, D.kc}));
  s.r.acc = with_acc ? b.take<float>(D.m * (D.d + D.dv + D.kc)) : nullptr;
}

static size_t slot_bytes(const Dims& D, bool with_acc) {
  Bump b{nullptr};
  Slot s;
  layout(D, with_acc, b, s);
  return b.off + 64;
}

// A pool of scratch blocks that persists across calls (no page faults per call).
class Pool {
 public:
  std::vector<uint8_t*> acquire(int count, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint8_t*> out;
    for (int i = 0; i < count; ++i) {
      Block blk;
      auto it = std::find_if(free_.begin(), free_.end(), [&](const Block& x) { return x.bytes >= bytes; });
      if (it != free_.end()) {
        blk = *it;
        free_.erase(it);
      } else {
        blk.bytes = bytes;
        blk.data.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) & ~size_t{63})), Deleter());
        if (!blk.data) return {};
      }
      out.push_back(blk.data.get());
      used_.push_back(std::move(blk));
    }
    return out;
  }
  void release(const std::vector<uint8_t*>& blocks) {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint8_t* p : blocks) {
      auto it = std::find_if(used_.begin(), used_.end(), [&](const Block& x) { return x.data.get() == p; });
      if (it != used_.end()) {
        free_.push_back(std::move(*it));
        used_.erase(it);
      }
    }
  }

 private:
  struct Deleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  struct Block {
    size_t bytes = 0;
    std::shared_ptr<uint8_t> data;
    Block() = default;
  };
  std::mutex mu_;
  std::vector<Block> free_, used_;
};

static Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: threads may outlive static destruction
  return *p;
}

// ---- search tables ---------------------------------------------------------------------

static void build_tables(const Dims& D, const Graph& g, Tables& t) {
  const int64_t m = D.m, kc = D.kc, nc = t.nc, width = nc * kChunk;
  int64_t mreal = 0;
  for (int64_t j = 0; j < m; ++j)
    if (g.km[j]) t.real[mreal++] = static_cast<int32_t>(j);
  t.mreal = mreal;
  // Memberships cluster-major (padded keys and keys past m weigh 0), one block of keys at
  // a time; then each chunk of 16 becomes its inclusive cumulative sum.
  constexpr int64_t JB = 16;
  for (int64_t j0 = 0; j0 < width; j0 += JB) {
    for (int64_t v = 0; v < kc; ++v) {
      float* dst = t.zc + v * width;
      for (int64_t j = j0; j < j0 + JB; ++j)
        dst[j] = (j < m && g.km[j]) ? std::max(g.z[j * kc + v], 0.0f) : 0.0f;
    }
  }
  for (int64_t v = 0; v < kc; ++v) {
    float* w = t.zc + v * width;
    double* cdf = t.ccdf + v * (nc + 1 + kPad);
    cdf[0] = 0.0;
    for (int64_t c = 0; c < nc; ++c) {
      float part = 0.0f;
      for (int64_t j = c * kChunk; j < (c + 1) * kChunk; ++j) {
        part += w[j];
        w[j] = part;
      }
      cdf[c + 1] = cdf[c] + static_cast<double>(part);
    }
    const double total = cdf[nc];
    for (int64_t x = 1; x <= kPad; ++x) cdf[nc + x] = INFINITY;
    t.zsum[v] = total;
    int32_t* guide = t.cguide + v * nc;
    int64_t c = 0;
    for (int64_t q = 0; q < nc; ++q) {
      const double thr = total * static_cast<double>(q) / static_cast<double>(nc);
      while (c < nc - 1 && cdf[c + 1] <= thr) ++c;
      guide[q] = static_cast<int32_t>(c);
    }
  }
}

// s + the number of entries cdf[s + 1 .. s + 8] at or below target: the entries at or
// below it are a prefix (cdf never decreases), and cdf is padded with +inf.
static inline int64_t window_count(const double* cdf, int64_t s, double target) {
#if defined(__AVX512F__)
  const __mmask8 k = _mm512_cmp_pd_mask(_mm512_loadu_pd(cdf + s + 1), _mm512_set1_pd(target), _CMP_LE_OQ);
  return s + __builtin_popcount(static_cast<unsigned>(k));
#else
  int64_t c = s;
  for (int64_t x = 1; x <= kPad; ++x) c += cdf[s + x] <= target ? 1 : 0;
  return c;
#endif
}

// First index v in [0, len) with cdf[v + 1] > target (cdf[0] = 0, cdf[len] = total >
// target, +inf padded), from the guide table's entry `start` for target = u * total: the
// answer is at least start - 1 (rounding of the guide index can overshoot by one), so
// counting the boundaries at or below target from there finds it, without branches but
// for the rare bracket wider than one window.
static inline int64_t search_from(const double* cdf, int64_t start, double target) {
  int64_t s = start > 0 ? start - 1 : 0;
  int64_t c = window_count(cdf, s, target);
  while (c - s == kPad) {
    s = c;
    c = window_count(cdf, s, target);
  }
  return c;
}

static inline int64_t guide_index(double u, int64_t len) {
  return std::min(static_cast<int64_t>(u * static_cast<double>(len)), len - 1);
}

// The key of cluster v at uniform u: a chunk by the chunks' CDF (from the guide table's
// chunk `start`), then the first key of the chunk whose cumulative weight passes the rest
// (a count over 16 floats).
static inline int64_t pick_key_from(const Dims& D, const Tables& t, int64_t v, double u, int64_t start) {
  const int64_t nc = t.nc;
  const double* cdf = t.ccdf + v * (nc + 1 + kPad);
  const double target = u * cdf[nc];
  const int64_t c = search_from(cdf, start, target);
  const float rest = static_cast<float>(target - cdf[c]);
  const float* w = t.zc + v * nc * kChunk + c * kChunk;
  int below = 0;
#pragma omp simd reduction(+ : below)
  for (int x = 0; x < kChunk; ++x) below += w[x] <= rest ? 1 : 0;
  if (below < kChunk) return c * kChunk + below;
  // Only by rounding at the chunk's end: its last key of positive weight.
  for (int64_t x = kChunk - 1; x > 0; --x)
    if (w[x] > w[x - 1]) return std::min(D.m - 1, c * kChunk + x);
  return std::min(D.m - 1, c * kChunk);
}

// ---- one row's edges ---------------------------------------------------------------------

// Draws row i's edges into r.cols (sorted, collapsed, thinned, forced edges added) and
// returns their number. r.bits must be all zero on entry; it is left all zero.
static int64_t row_edges(const Dims& D, const Opts& O, const Graph& g, const Tables& t, Rows& r,
                         int64_t i) {
  if (!g.qm[i]) return 0;
  const int64_t m = D.m, kc = D.kc, K = kc + 1, nw = (m + 63) / 64;
  uint64_t* bits = r.bits;
  const int64_t draws = g.counts[i];
  const float* ysi = g.ys + i * kc;
  int64_t flo = 1, fhi = 0;  // the forced keys [flo, fhi]
  if (O.forced_half >= 0) {
    flo = std::max<int64_t>(0, i - O.forced_half);
    fhi = std::min<int64_t>(m - 1, i + O.forced_half);
  }
  if (draws > 0 && t.mreal > 0) {
    double* rc = r.rcdf;
    rc[0] = 0.0;
    for (int64_t v = 0; v < kc; ++v) rc[v + 1] = rc[v] + static_cast<double>(std::max(ysi[v], 0.0f)) * t.zsum[v];
    rc[K] = rc[kc] + static_cast<double>(g.delta) * static_cast<double>(t.mreal);
    for (int64_t x = 1; x <= kPad; ++x) rc[K + x] = INFINITY;
    const double total = rc[K];
    if (total > 0.0) {
      int32_t* guide = r.rguide;
      int64_t v = 0;
      for (int64_t q = 0; q < K; ++q) {
        const double thr = total * static_cast<double>(q) / static_cast<double>(K);
        while (v < K - 1 && rc[v + 1] <= thr) ++v;
        guide[q] = static_cast<int32_t>(v);
      }
      const double mreal = static_cast<double>(t.mreal);
      const int64_t nc = t.nc;
      uint32_t *u0 = r.u, *u1 = u0 + kDrawBlock, *u2 = u1 + kDrawBlock, *u3 = u2 + kDrawBlock;
      int32_t* cl = r.dcl;
      int32_t* at = r.dat;
      double* uk = r.duk;
      const int64_t blocks = (draws + 1) / 2;
      for (int64_t b0 = 0; b0 < blocks; b0 += kDrawBlock) {
        const int64_t nb = std::min(kDrawBlock, blocks - b0);
        philox_blocks(g.key0, g.key1, static_cast<uint32_t>(i), b0, kStreamDraw, nb, u0, u1, u2, u3);
        const int64_t nd = std::min(2 * nb, draws - 2 * b0);
        // Stage 1: each draw's cluster (the row's CDF is in L1) and the guide entry of its
        // key search, prefetched. The stages let the cache misses of many draws overlap.
        for (int64_t h = 0; h < nd; ++h) {
          const uint32_t wc = (h & 1) ? u2[h >> 1] : u0[h >> 1];
          const uint32_t wk = (h & 1) ? u3[h >> 1] : u1[h >> 1];
          const double uc = wc * kTwoM32;
          const int64_t c = search_from(rc, guide[guide_index(uc, K)], uc * total);
          cl[h] = static_cast<int32_t>(c);
          uk[h] = wk * kTwoM32;
          if (c < kc) {
            const int64_t q = std::min(static_cast<int64_t>(uk[h] * static_cast<double>(nc)), nc - 1);
            at[h] = static_cast<int32_t>(c * nc + q);
            __builtin_prefetch(t.cguide + at[h]);
          }
        }
        // Stages 2 and 3, software-pipelined: draw h + kAhead reads its guided chunk and
        // prefetches the chunk's CDF entries and cumulative weights while draw h, whose
        // lines were prefetched kAhead draws ago, finds its key.
        auto stage2 = [&](int64_t h) {
          const int64_t c = cl[h];
          if (c == kc) return;
          const int64_t chunk = t.cguide[at[h]];
          at[h] = static_cast<int32_t>(chunk);
          __builtin_prefetch(t.ccdf + c * (nc + 1 + kPad) + chunk);
          __builtin_prefetch(t.zc + (c * nc + chunk) * kChunk);
        };
        for (int64_t h = 0; h < std::min(kAhead, nd); ++h) stage2(h);
        for (int64_t h = 0; h < nd; ++h) {
          if (h + kAhead < nd) stage2(h + kAhead);
          const int64_t c = cl[h];
          int64_t j;
          if (c == kc) {
            j = t.real[std::min(static_cast<int64_t>(uk[h] * mreal), t.mreal - 1)];
          } else {
            j = pick_key_from(D, t, c, uk[h], at[h]);
          }
          bits[j >> 6] |= uint64_t{1} << (j & 63);
        }
      }
    }
  }
  for (int64_t j = flo; j <= fhi; ++j)
    if (g.km[j]) bits[j >> 6] |= uint64_t{1} << (j & 63);
  // Collapse: the set bits in order.
  int64_t cand = 0;
  int32_t* cols = r.cols;
  for (int64_t w = 0; w < nw; ++w) {
    uint64_t word = bits[w];
    if (!word) continue;
    bits[w] = 0;
    while (word) {
      cols[cand++] = static_cast<int32_t>(w * 64 + __builtin_ctzll(word));
      word &= word - 1;
    }
  }
  if (O.law != kLawBernoulli) return cand;
  // Bernoulli thinning of the sampled (not forced) pairs: a pair whose uniform is below
  // 1 / c_i is kept without p_ij; the others' membership rows are prefetched first.
  const double ci = g.c[i];
  uint32_t* uu = r.u;
  int32_t* need = reinterpret_cast<int32_t*>(r.u + D.m);
  philox_first(g.key0, g.key1, static_cast<uint32_t>(i), cols, kStreamThin, cand, uu);
  int64_t needs = 0;
  for (int64_t e = 0; e < cand; ++e) {
    const int64_t j = cols[e];
    if ((j < flo || j > fhi) && uu[e] * kTwoM32 * ci >= 1.0) {
      need[needs++] = static_cast<int32_t>(e);
      const float* row = g.z + j * kc;
      for (int64_t x = 0; x < kc; x += 16) __builtin_prefetch(row + x);
    }
  }
  for (int64_t h = 0; h < needs; ++h) {
    const int64_t e = need[h];
    const int64_t j = cols[e];
    const double u = uu[e] * kTwoM32;
    const double rate = static_cast<double>(dot(ysi, g.z + j * kc, kc)) + g.delta;
    const double cr = ci * rate;
    const double kp = cr > 1e-7 ? rate / -std::expm1(-cr) : 1.0 / ci;
    if (u >= kp) cols[e] = -1;  // thinned out
  }
  int64_t count = 0;
  for (int64_t e = 0; e < cand; ++e) {
    cols[count] = cols[e];
    count += cols[e] >= 0 ? 1 : 0;
  }
  return count;
}

static inline float drop_factor(const Opts& O, const Graph& g, int64_t i, int64_t j) {
  if (O.drop_rate <= 0.0f) return 1.0f;
  uint32_t x[4];
  philox(g.dkey0, g.dkey1, static_cast<uint32_t>(i), static_cast<uint32_t>(j), kStreamDrop, 0, x);
  return unit_float(x[0]) < 1.0f - O.drop_rate ? 1.0f / (1.0f - O.drop_rate) : 0.0f;
}

// ---- forward and backward of one row ---------------------------------------------------

struct FwdOut {
  float *out, *lse;
};

static int64_t forward_row(const Dims& D, const Opts& O, const Graph& g, const Tables& t, Rows& r,
                           int64_t i, FwdOut o) {
  const int64_t d = D.d, dv = D.dv;
  const int64_t count = row_edges(D, O, g, t, r, i);
  float* out = o.out + i * dv;
  if (count == 0) {
    std::fill(out, out + dv, 0.0f);
    o.lse[i] = 0.0f;
    return 0;
  }
  const float inv = 1.0f / std::sqrt(static_cast<float>(d));
  const float* qi = g.q + i * d;
  float mx = -INFINITY;
  for (int64_t e = 0; e < count; ++e) {
    if (e + kEdgeAhead < count) {
      prefetch_row(g.k + static_cast<int64_t>(r.cols[e + kEdgeAhead]) * d, d);
      prefetch_row(g.v + static_cast<int64_t>(r.cols[e + kEdgeAhead]) * dv, dv);
    }
    const float s = dot(qi, g.k + static_cast<int64_t>(r.cols[e]) * d, d) * inv;
    r.s[e] = s;
    mx = std::max(mx, s);
  }
  float* acc = r.vec;
  std::fill(acc, acc + dv, 0.0f);
  float l = 0.0f;
  for (int64_t e = 0; e < count; ++e) {
    const float w = std::exp(r.s[e] - mx);
    l += w;
    const int64_t j = r.cols[e];
    const float wd = w * drop_factor(O, g, i, j);
    if (wd != 0.0f) axpy(wd, g.v + j * dv, acc, dv);
  }
  const float invl = 1.0f / l;
  for (int64_t x = 0; x < dv; ++x) out[x] = acc[x] * invl;
  o.lse[i] = mx + std::log(l);
  return count;
}

struct BwdIo {
  const float *out, *lse, *dout;
  float dnum;                  // cotangent of the edge count (the density term), paper/reference
  float *dq, *dys;             // row-side gradients of this graph
  float *dk, *dv, *dz;         // key-side gradients (the graph's outputs or an accumulator)
};

static void backward_row(const Dims& D, const Opts& O, const Graph& g, const Tables& t, Rows& r,
                         int64_t i, const BwdIo& io) {
  const int64_t d = D.d, dv = D.dv, kc = D.kc;
  if (!g.qm[i]) return;
  const int64_t count = row_edges(D, O, g, t, r, i);
  const float inv = 1.0f / std::sqrt(static_cast<float>(d));
  const float* qi = g.q + i * d;
  const float* doi = io.dout + i * dv;
  const float* ysi = g.ys + i * kc;
  const float lse = io.lse[i];
  const float big_d = dot(doi, io.out + i * dv, dv);
  float* dq = r.vec;                              // [d]
  float* dys = r.vec + std::max({d, dv, kc});     // [kc]
  std::fill(dq, dq + d, 0.0f);
  std::fill(dys, dys + kc, 0.0f);
  for (int64_t e = 0; e < count; ++e) {
    const int64_t j = r.cols[e];
    if (e + kEdgeAhead < count) {
      const int64_t jn = r.cols[e + kEdgeAhead];
      prefetch_row(g.k + jn * d, d);
      prefetch_row(g.v + jn * dv, dv);
      prefetch_row(g.z + jn * kc, kc);
      prefetch_row(io.dk + jn * d, d);
      prefetch_row(io.dv + jn * dv, dv);
      prefetch_row(io.dz + jn * kc, kc);
    }
    const float* kj = g.k + j * d;
    const float* vj = g.v + j * dv;
    const float s = dot(qi, kj, d) * inv;
    r.s[e] = s;
    const float w = std::exp(s - lse);
    float dp = dot(doi, vj, dv);
    float wz = w;
    if (O.drop_rate > 0.0f) {
      const float zf = drop_factor(O, g, i, j);
      dp *= zf;
      wz = w * zf;
    }
    const float da = w * (dp - big_d);
    axpy(da, kj, dq, d);
    axpy(da * inv, qi, io.dk + j * d, d);
    if (wz != 0.0f) axpy(wz, doi, io.dv + j * dv, dv);
    float dm;
    if (O.ste == kStePaper) {
      dm = da * s + io.dnum;
    } else if (O.ste == kSteReference) {
      dm = std::min(1.0f, std::max(-1.0f, da + io.dnum));
    } else {
      dm = da;
    }
    if (dm != 0.0f) {
      axpy(dm, g.z + j * kc, dys, kc);
      axpy(dm, ysi, io.dz + j * kc, kc);
    }
  }
  if (O.ste == kStePairs && t.mreal > 0) {
    // Absent pairs, from probes drawn uniformly from the real keys (every key once when
    // the probes are at least the keys): the gain of adding the pair.
    const bool all = O.probes >= D.m;
    const int64_t num = all ? D.m : O.probes;
    const float weight = all ? 1.0f : static_cast<float>(t.mreal) / static_cast<float>(O.probes);
    uint32_t x[4] = {0, 0, 0, 0};
    for (int64_t p = 0; p < num; ++p) {
      int64_t j;
      if (all) {
        j = p;
        if (!g.km[j]) continue;
      } else {
        if ((p & 3) == 0)
          philox(g.key0, g.key1, static_cast<uint32_t>(i), static_cast<uint32_t>(p >> 2), kStreamProbe, 0, x);
        const int64_t u = static_cast<int64_t>(x[p & 3] * kTwoM32 * static_cast<double>(t.mreal));
        j = t.real[std::min(u, t.mreal - 1)];
      }
      if (std::binary_search(r.cols, r.cols + count, static_cast<int32_t>(j))) continue;
      const float* vj = g.v + j * dv;
      float sigma = 1.0f;
      if (count > 0) {
        const float s = dot(qi, g.k + j * d, d) * inv;
        sigma = 1.0f / (1.0f + std::exp(-(s - lse)));
      }
      const float gain = sigma * (dot(doi, vj, dv) - big_d) * weight;
      if (gain != 0.0f) {
        axpy(gain, g.z + j * kc, dys, kc);
        axpy(gain, ysi, io.dz + j * kc, kc);
      }
    }
  }
  float* dqo = io.dq + i * d;
  for (int64_t x = 0; x < d; ++x) dqo[x] = dq[x] * inv;
  float* dyo = io.dys + i * kc;
  for (int64_t x = 0; x < kc; ++x) dyo[x] = dys[x];
}

// ---- batched drivers ---------------------------------------------------------------------

struct Inputs {
  const float *q, *k, *v, *ys, *z, *c, *delta;
  const int32_t* counts;
  const uint8_t *qm, *km;
  const uint32_t *seeds, *dseeds;
};

static Graph graph_at(const Dims& D, const Inputs& in, int64_t gi) {
  Graph g;
  g.q = in.q + gi * D.n * D.d;
  g.k = in.k + gi * D.m * D.d;
  g.v = in.v + gi * D.m * D.dv;
  g.ys = in.ys + gi * D.n * D.kc;
  g.z = in.z + gi * D.m * D.kc;
  g.c = in.c + gi * D.n;
  g.counts = in.counts + gi * D.n;
  g.qm = in.qm + gi * D.n;
  g.km = in.km + gi * D.m;
  g.delta = in.delta[gi];
  g.key0 = in.seeds[2 * gi];
  g.key1 = in.seeds[2 * gi + 1];
  g.dkey0 = in.dseeds ? in.dseeds[2 * gi] : 0u;
  g.dkey1 = in.dseeds ? in.dseeds[2 * gi + 1] : 0u;
  return g;
}

// Runs fn(thread) on `threads` threads (the caller is thread 0) and joins them.
template <class F>
static void on_threads(int threads, F&& fn) {
  std::vector<std::thread> pool_threads;
  for (int t = 1; t < threads; ++t) pool_threads.emplace_back([&fn, t] { fn(t); });
  fn(0);
  for (auto& th : pool_threads) th.join();
}

constexpr int64_t kRowsPerTask = 32;

struct Scratch {
  std::vector<uint8_t*> blocks;
  std::vector<Slot> slots;
  size_t bytes = 0;
  Scratch(const Dims& D, int threads, bool with_acc) {
    bytes = slot_bytes(D, with_acc);
    blocks = pool().acquire(threads, bytes);
    for (uint8_t* p : blocks) {
      Bump b{p};
      Slot s;
      layout(D, with_acc, b, s);
      std::memset(s.r.bits, 0, sizeof(uint64_t) * ((D.m + 63) / 64));
      slots.push_back(s);
    }
  }
  bool ok(int threads) const { return static_cast<int>(blocks.size()) == threads; }
  ~Scratch() { pool().release(blocks); }
};

static void forward_all(const Dims& D, const Opts& O, const Inputs& in, float* out, float* lse,
                        int32_t* edges, Scratch& sc) {
  auto rows = [&](int64_t gi, const Tables& t, Rows& r, int64_t lo, int64_t hi) {
    const Graph g = graph_at(D, in, gi);
    FwdOut o{out + gi * D.n * D.dv, lse + gi * D.n};
    int64_t total = 0;
    for (int64_t i = lo; i < hi; ++i) total += forward_row(D, O, g, t, r, i, o);
    return total;
  };
  auto clip = [](int64_t x) { return static_cast<int32_t>(std::min<int64_t>(x, INT32_MAX)); };
  int64_t g0 = 0;
  const int threads = O.threads;
  if (threads > 1) {  // rounds of one graph per thread
    for (; D.G - g0 >= threads; g0 += threads)
      on_threads(threads, [&](int t) {
        Slot& s = sc.slots[t];
        build_tables(D, graph_at(D, in, g0 + t), s.t);
        edges[g0 + t] = clip(rows(g0 + t, s.t, s.r, 0, D.n));
      });
  }
  for (; g0 < D.G; ++g0) {  // the graphs left over, rows split over the threads
    build_tables(D, graph_at(D, in, g0), sc.slots[0].t);
    std::atomic<int64_t> next{0}, total{0};
    on_threads(threads, [&](int t) {
      for (;;) {
        const int64_t lo = next.fetch_add(kRowsPerTask);
        if (lo >= D.n) break;
        total.fetch_add(rows(g0, sc.slots[0].t, sc.slots[t].r, lo, std::min(D.n, lo + kRowsPerTask)));
      }
    });
    edges[g0] = clip(total.load());
  }
}

static void backward_all(const Dims& D, const Opts& O, const Inputs& in, const float* out,
                         const float* lse, const float* dout, const float* dnum, float* dq,
                         float* dk, float* dv, float* dys, float* dz, Scratch& sc) {
  const int64_t n = D.n, m = D.m, d = D.d, dvd = D.dv, kc = D.kc;
  auto io_for = [&](int64_t gi) {
    BwdIo io;
    io.out = out + gi * n * dvd;
    io.lse = lse + gi * n;
    io.dout = dout + gi * n * dvd;
    io.dnum = dnum[gi];
    io.dq = dq + gi * n * d;
    io.dys = dys + gi * n * kc;
    io.dk = dk + gi * m * d;
    io.dv = dv + gi * m * dvd;
    io.dz = dz + gi * m * kc;
    return io;
  };
  auto zero_graph = [&](int64_t gi) {
    std::fill(dq + gi * n * d, dq + (gi + 1) * n * d, 0.0f);
    std::fill(dys + gi * n * kc, dys + (gi + 1) * n * kc, 0.0f);
    std::fill(dk + gi * m * d, dk + (gi + 1) * m * d, 0.0f);
    std::fill(dv + gi * m * dvd, dv + (gi + 1) * m * dvd, 0.0f);
    std::fill(dz + gi * m * kc, dz + (gi + 1) * m * kc, 0.0f);
  };
  auto whole = [&](int64_t gi, Slot& s) {
    zero_graph(gi);
    const Graph g = graph_at(D, in, gi);
    build_tables(D, g, s.t);
    const BwdIo io = io_for(gi);
    for (int64_t i = 0; i < n; ++i) backward_row(D, O, g, s.t, s.r, i, io);
  };
  int64_t g0 = 0;
  const int threads = O.threads;
  if (threads > 1) {
    for (; D.G - g0 >= threads; g0 += threads)
      on_threads(threads, [&](int t) { whole(g0 + t, sc.slots[t]); });
  }
  if (threads == 1) {
    for (; g0 < D.G; ++g0) whole(g0, sc.slots[0]);
  }
  for (; g0 < D.G; ++g0) {
    zero_graph(g0);
    const Graph g = graph_at(D, in, g0);
    build_tables(D, g, sc.slots[0].t);
    const int64_t key_len = m * (d + dvd + kc);
    for (int t = 1; t < threads; ++t) std::fill(sc.slots[t].r.acc, sc.slots[t].r.acc + key_len, 0.0f);
    std::atomic<int64_t> next{0};
    on_threads(threads, [&](int t) {
      BwdIo io = io_for(g0);
      if (t > 0) {  // private key-side accumulators, summed below
        io.dk = sc.slots[t].r.acc;
        io.dv = io.dk + m * d;
        io.dz = io.dv + m * dvd;
      }
      for (;;) {
        const int64_t lo = next.fetch_add(kRowsPerTask);
        if (lo >= n) break;
        for (int64_t i = lo; i < std::min(n, lo + kRowsPerTask); ++i)
          backward_row(D, O, g, sc.slots[0].t, sc.slots[t].r, i, io);
      }
    });
    const BwdIo io = io_for(g0);
    for (int t = 1; t < threads; ++t) {
      const float* a = sc.slots[t].r.acc;
      for (int64_t x = 0; x < m * d; ++x) io.dk[x] += a[x];
      for (int64_t x = 0; x < m * dvd; ++x) io.dv[x] += a[m * d + x];
      for (int64_t x = 0; x < m * kc; ++x) io.dz[x] += a[m * (d + dvd) + x];
    }
  }
}

static bool needs_acc(const Dims& D, int threads) { return threads > 1 && D.G % threads != 0; }

}  // namespace sbm_fused

// ---- FFI handlers ------------------------------------------------------------------------

using namespace sbm_fused;

static int64_t lead_count(ffi::AnyBuffer b, size_t trailing) {
  auto d = b.dimensions();
  int64_t g = 1;
  for (size_t a = 0; a + trailing < d.size(); ++a) g *= d[a];
  return g;
}

static int64_t dim_from_end(ffi::AnyBuffer b, size_t back) {
  auto d = b.dimensions();
  return back <= d.size() ? d[d.size() - back] : -1;
}

// Every operand's shape against q's graphs and sizes (reading past a buffer would corrupt
// memory, so nothing runs on a mismatch).
static ffi::Error dims_of(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer ys,
                         ffi::AnyBuffer z, ffi::AnyBuffer c, ffi::AnyBuffer counts, ffi::AnyBuffer qmask,
                         ffi::AnyBuffer kmask, ffi::AnyBuffer delta, ffi::AnyBuffer seeds,
                         ffi::AnyBuffer dseeds, Dims* D) {
  if (q.dimensions().size() < 2)
    return ffi::Error::InvalidArgument("sbm fused: q must be [..., rows, features]");
  D->G = lead_count(q, 2);
  D->n = dim_from_end(q, 2);
  D->d = dim_from_end(q, 1);
  D->m = dim_from_end(k, 2);
  D->dv = dim_from_end(v, 1);
  D->kc = dim_from_end(ys, 1);
  const bool ok = lead_count(k, 2) == D->G && dim_from_end(k, 1) == D->d &&
                  lead_count(v, 2) == D->G && dim_from_end(v, 2) == D->m &&
                  lead_count(ys, 2) == D->G && dim_from_end(ys, 2) == D->n &&
                  lead_count(z, 2) == D->G && dim_from_end(z, 2) == D->m && dim_from_end(z, 1) == D->kc &&
                  lead_count(c, 1) == D->G && dim_from_end(c, 1) == D->n &&
                  lead_count(counts, 1) == D->G && dim_from_end(counts, 1) == D->n &&
                  lead_count(qmask, 1) == D->G && dim_from_end(qmask, 1) == D->n &&
                  lead_count(kmask, 1) == D->G && dim_from_end(kmask, 1) == D->m &&
                  lead_count(delta, 0) == D->G && lead_count(seeds, 1) == D->G &&
                  dim_from_end(seeds, 1) == 2 && lead_count(dseeds, 1) == D->G &&
                  dim_from_end(dseeds, 1) == 2 && D->n > 0 && D->m > 0 && D->kc > 0;
  if (!ok) return ffi::Error::InvalidArgument("sbm fused: operand shapes do not match q's graphs and sizes");
  return ffi::Error::Success();
}

static Opts opts_of(int64_t law, int64_t forced_half, float drop_rate, int64_t ste, int64_t probes,
                    int64_t threads) {
  Opts O;
  O.law = static_cast<int>(law);
  O.forced_half = forced_half;
  O.drop_rate = drop_rate;
  O.ste = static_cast<int>(ste);
  O.probes = probes;
  O.threads = static_cast<int>(std::max<int64_t>(1, threads));
  return O;
}

static ffi::Error FusedForward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer ys,
                               ffi::AnyBuffer z, ffi::AnyBuffer c, ffi::AnyBuffer counts,
                               ffi::AnyBuffer qmask, ffi::AnyBuffer kmask, ffi::AnyBuffer delta,
                               ffi::AnyBuffer seeds, ffi::AnyBuffer dseeds, int64_t law,
                               int64_t forced_half, float drop_rate, int64_t ste, int64_t probes,
                               int64_t threads, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> edges) {
  Dims D;
  if (auto err = dims_of(q, k, v, ys, z, c, counts, qmask, kmask, delta, seeds, dseeds, &D); err.failure())
    return err;
  Opts O = opts_of(law, forced_half, drop_rate, ste, probes, threads);
  O.threads = static_cast<int>(std::min<int64_t>(O.threads, std::max<int64_t>(1, D.G * D.n)));
  Inputs in{q.typed_data<float>(), k.typed_data<float>(),     v.typed_data<float>(),
            ys.typed_data<float>(), z.typed_data<float>(),    c.typed_data<float>(),
            delta.typed_data<float>(), counts.typed_data<int32_t>(), qmask.typed_data<uint8_t>(),
            kmask.typed_data<uint8_t>(), seeds.typed_data<uint32_t>(), dseeds.typed_data<uint32_t>()};
  Scratch sc(D, O.threads, false);
  if (!sc.ok(O.threads)) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "sbm fused: out of memory for scratch");
  forward_all(D, O, in, out->typed_data<float>(), lse->typed_data<float>(), edges->typed_data<int32_t>(), sc);
  return ffi::Error::Success();
}

static ffi::Error FusedBackward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer ys,
                                ffi::AnyBuffer z, ffi::AnyBuffer c, ffi::AnyBuffer counts,
                                ffi::AnyBuffer qmask, ffi::AnyBuffer kmask, ffi::AnyBuffer delta,
                                ffi::AnyBuffer seeds, ffi::AnyBuffer dseeds, ffi::AnyBuffer out,
                                ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dnum,
                                int64_t law, int64_t forced_half, float drop_rate, int64_t ste,
                                int64_t probes, int64_t threads, ffi::Result<ffi::AnyBuffer> dq,
                                ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                ffi::Result<ffi::AnyBuffer> dys, ffi::Result<ffi::AnyBuffer> dz) {
  Dims D;
  if (auto err = dims_of(q, k, v, ys, z, c, counts, qmask, kmask, delta, seeds, dseeds, &D); err.failure())
    return err;
  if (lead_count(out, 2) != D.G || dim_from_end(out, 2) != D.n || dim_from_end(out, 1) != D.dv ||
      lead_count(lse, 1) != D.G || dim_from_end(lse, 1) != D.n || lead_count(dout, 2) != D.G ||
      dim_from_end(dout, 2) != D.n || dim_from_end(dout, 1) != D.dv || lead_count(dnum, 0) != D.G)
    return ffi::Error::InvalidArgument("sbm fused: out, lse, dout or dnum do not match q's graphs");
  Opts O = opts_of(law, forced_half, drop_rate, ste, probes, threads);
  O.threads = static_cast<int>(std::min<int64_t>(O.threads, std::max<int64_t>(1, D.G * D.n)));
  Inputs in{q.typed_data<float>(), k.typed_data<float>(),     v.typed_data<float>(),
            ys.typed_data<float>(), z.typed_data<float>(),    c.typed_data<float>(),
            delta.typed_data<float>(), counts.typed_data<int32_t>(), qmask.typed_data<uint8_t>(),
            kmask.typed_data<uint8_t>(), seeds.typed_data<uint32_t>(), dseeds.typed_data<uint32_t>()};
  Scratch sc(D, O.threads, needs_acc(D, O.threads));
  if (!sc.ok(O.threads)) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "sbm fused: out of memory for scratch");
  backward_all(D, O, in, out.typed_data<float>(), lse.typed_data<float>(), dout.typed_data<float>(),
               dnum.typed_data<float>(), dq->typed_data<float>(), dk->typed_data<float>(),
               dv->typed_data<float>(), dys->typed_data<float>(), dz->typed_data<float>(), sc);
  return ffi::Error::Success();
}

// The graphs as dense [G, n, m] masks (tests): the same row routine as the kernels.
static ffi::Error FusedGraph(ffi::AnyBuffer ys, ffi::AnyBuffer z, ffi::AnyBuffer c, ffi::AnyBuffer counts,
                             ffi::AnyBuffer qmask, ffi::AnyBuffer kmask, ffi::AnyBuffer delta,
                             ffi::AnyBuffer seeds, int64_t law, int64_t forced_half,
                             ffi::Result<ffi::AnyBuffer> mask) {
  Dims D;
  if (ys.dimensions().size() < 2)
    return ffi::Error::InvalidArgument("sbm fused graph: ys must be [..., rows, clusters]");
  D.G = lead_count(ys, 2);
  D.n = dim_from_end(ys, 2);
  D.kc = dim_from_end(ys, 1);
  D.m = dim_from_end(z, 2);
  D.d = D.dv = 1;
  const bool ok = lead_count(z, 2) == D.G && dim_from_end(z, 1) == D.kc && lead_count(c, 1) == D.G &&
                  dim_from_end(c, 1) == D.n && lead_count(counts, 1) == D.G &&
                  dim_from_end(counts, 1) == D.n && lead_count(qmask, 1) == D.G &&
                  dim_from_end(qmask, 1) == D.n && lead_count(kmask, 1) == D.G &&
                  dim_from_end(kmask, 1) == D.m && lead_count(delta, 0) == D.G &&
                  lead_count(seeds, 1) == D.G && dim_from_end(seeds, 1) == 2 && D.n > 0 && D.m > 0;
  if (!ok) return ffi::Error::InvalidArgument("sbm fused graph: operand shapes do not match ys's graphs");
  Opts O = opts_of(law, forced_half, 0.0f, kStePaper, 0, 1);
  Inputs in{nullptr, nullptr, nullptr, ys.typed_data<float>(), z.typed_data<float>(), c.typed_data<float>(),
            delta.typed_data<float>(), counts.typed_data<int32_t>(), qmask.typed_data<uint8_t>(),
            kmask.typed_data<uint8_t>(), seeds.typed_data<uint32_t>(), nullptr};
  Scratch sc(D, 1, false);
  if (!sc.ok(1)) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "sbm fused: out of memory for scratch");
  uint8_t* mk = mask->typed_data<uint8_t>();
  std::memset(mk, 0, static_cast<size_t>(D.G * D.n * D.m));
  for (int64_t gi = 0; gi < D.G; ++gi) {
    Graph g = graph_at(D, in, gi);
    Slot& s = sc.slots[0];
    build_tables(D, g, s.t);
    for (int64_t i = 0; i < D.n; ++i) {
      const int64_t count = row_edges(D, O, g, s.t, s.r, i);
      for (int64_t e = 0; e < count; ++e) mk[(gi * D.n + i) * D.m + s.r.cols[e]] = 1;
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SbmFusedForward, FusedForward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // ys
                                  .Arg<ffi::AnyBuffer>()  // z
                                  .Arg<ffi::AnyBuffer>()  // c
                                  .Arg<ffi::AnyBuffer>()  // counts
                                  .Arg<ffi::AnyBuffer>()  // qmask
                                  .Arg<ffi::AnyBuffer>()  // kmask
                                  .Arg<ffi::AnyBuffer>()  // delta
                                  .Arg<ffi::AnyBuffer>()  // seeds
                                  .Arg<ffi::AnyBuffer>()  // dseeds
                                  .Attr<int64_t>("law")
                                  .Attr<int64_t>("forced_half")
                                  .Attr<float>("drop_rate")
                                  .Attr<int64_t>("ste")
                                  .Attr<int64_t>("probes")
                                  .Attr<int64_t>("threads")
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>()   // lse
                                  .Ret<ffi::AnyBuffer>());  // edges

XLA_FFI_DEFINE_HANDLER_SYMBOL(SbmFusedBackward, FusedBackward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // ys
                                  .Arg<ffi::AnyBuffer>()  // z
                                  .Arg<ffi::AnyBuffer>()  // c
                                  .Arg<ffi::AnyBuffer>()  // counts
                                  .Arg<ffi::AnyBuffer>()  // qmask
                                  .Arg<ffi::AnyBuffer>()  // kmask
                                  .Arg<ffi::AnyBuffer>()  // delta
                                  .Arg<ffi::AnyBuffer>()  // seeds
                                  .Arg<ffi::AnyBuffer>()  // dseeds
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // dnum
                                  .Attr<int64_t>("law")
                                  .Attr<int64_t>("forced_half")
                                  .Attr<float>("drop_rate")
                                  .Attr<int64_t>("ste")
                                  .Attr<int64_t>("probes")
                                  .Attr<int64_t>("threads")
                                  .Ret<ffi::AnyBuffer>()   // dq
                                  .Ret<ffi::AnyBuffer>()   // dk
                                  .Ret<ffi::AnyBuffer>()   // dv
                                  .Ret<ffi::AnyBuffer>()   // dys
                                  .Ret<ffi::AnyBuffer>());  // dz

XLA_FFI_DEFINE_HANDLER_SYMBOL(SbmFusedGraph, FusedGraph,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // ys
                                  .Arg<ffi::AnyBuffer>()  // z
                                  .Arg<ffi::AnyBuffer>()  // c
                                  .Arg<ffi::AnyBuffer>()  // counts
                                  .Arg<ffi::AnyBuffer>()  // qmask
                                  .Arg<ffi::AnyBuffer>()  // kmask
                                  .Arg<ffi::AnyBuffer>()  // delta
                                  .Arg<ffi::AnyBuffer>()  // seeds
                                  .Attr<int64_t>("law")
                                  .Attr<int64_t>("forced_half")
                                  .Ret<ffi::AnyBuffer>());  // mask

// Bytes of scratch one call holds (per thread, times threads), for memory accounting.
extern "C" int64_t SbmFusedScratchBytes(int64_t G, int64_t n, int64_t m, int64_t d, int64_t dv,
                                        int64_t kc, int64_t threads, int64_t backward) {
  Dims D{G, n, m, d, dv, kc};
  const int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, std::max<int64_t>(1, G * n))));
  return static_cast<int64_t>(slot_bytes(D, backward && needs_acc(D, t)) * t);
}

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
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sbm_fused {

constexpr int64_t kChunk = 16;  // keys per chunk of a cluster's key CDF
constexpr uint32_t kStreamDraw = 0, kStreamThin = 1, kStreamProbe = 2, kStreamDrop = 3, kStreamDense = 4;
// A row is drawn pair by pair (one uniform per real key against min(1, p + delta), or
// 1 - exp(-(p + delta)) under the poisson law: the same law) when its draws exceed this
// share of the real keys, where a draw costs more than the pairs it would save, or when
// its bernoulli oversampling exceeds kDenseOversample (a row bound above 0.995, where
// c = -log(1 - q) / q grows without limit).
constexpr double kDenseShare = 0.25;
constexpr double kDenseOversample = 5.3;
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

// ---- phase timers (read with SbmFusedPhaseNanos; for profiling the kernel) ---------------

enum Phase { kTables = 0, kDraws, kResolve, kCollapse, kSortKeys, kAttendForward, kAttendBackward, kPhases };
static std::atomic<int64_t> g_phase_ns[kPhases];
static std::atomic<bool> g_timing{false};

struct PhaseTimer {
  Phase phase;
  std::chrono::steady_clock::time_point t0;
  bool on;
  explicit PhaseTimer(Phase p) : phase(p), on(g_timing.load(std::memory_order_relaxed)) {
    if (on) t0 = std::chrono::steady_clock::now();
  }
  ~PhaseTimer() {
    if (on)
      g_phase_ns[phase].fetch_add(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
          std::memory_order_relaxed);
  }
};

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
  double* rtot;     // [n] each row's total cluster weight (row_total)
  float* crun;      // [kChunk][kc] one chunk's running sums while the tables are built
  float* zero;      // [kc] zeros (a padded key's memberships)
  int64_t mreal = 0, nc = 0;
};

// Rows per block: their collapse bitmaps stay near 256 KiB, and at most 256 rows.
static int64_t block_rows_max(const Dims& D) {
  return std::max<int64_t>(1, std::min<int64_t>({256, D.n, std::max<int64_t>(16, (int64_t{1} << 21) / D.m)}));
}

// Edge slots of a block: rows join a block while their bounds fit (one row always does).
static int64_t block_edge_cap(const Dims& D) { return std::max<int64_t>(int64_t{1} << 16, 2 * D.m); }

constexpr int64_t kDrawCap = 16384;  // draws resolved per cluster-sorted batch

static inline int64_t pow2_at_least(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// The largest v with cdf[v] <= target, by a branchless binary search over `len` (a power
// of two) entries, cdf[0] = 0 <= target, +inf past the end: the first v with
// cdf[v + 1] > target, zero-weight entries skipped.
static inline int64_t bisect(const double* cdf, int64_t len, double target) {
  int64_t v = 0;
  for (int64_t step = len >> 1; step >= 1; step >>= 1) v = cdf[v + step] <= target ? v + step : v;
  return v;
}

// One thread's buffers for a block of query rows.
struct Block {
  int64_t rows_max = 0, ecap = 0;
  uint64_t* bits;    // [rows_max][nw] each row's draws, collapsed
  double* rcdf;      // [pow2_at_least(K + 1 + kPad)] a row's cluster CDF, +inf padded
  int32_t* rguide;   // [K] its guide table
  uint32_t* u;       // [4 * kDrawBlock] Philox words of a row's draws
  int32_t* dcl;      // [kDrawCap] pending draws: cluster, local row, key word
  uint16_t* drow;
  uint32_t* dword;
  uint16_t* srow;    // [kDrawCap] the pending draws sorted by cluster
  uint32_t* sword;
  int32_t* ccount;   // [K + 1]
  int32_t* rptr;     // [rows_max + 1] each row's first edge (row-major, keys sorted)
  int32_t* rcols;    // [ecap]
  uint32_t* uu;      // [max(ecap, m)] thinning and dropout words
  int32_t* need;     // [m] the candidates whose thinning needs p
  int32_t* kend;     // [m] after the key sort: end of key j's edges (start: kend[j - 1])
  uint16_t* krow;    // [ecap] the local row of each key-sorted edge
  float* ks;         // [ecap] its score (forward)
  float* kz;         // [ecap] its dropout factor
  float *rmax, *rl, *rlse, *rD;  // [rows_max]
  float* racc;       // [rows_max][max(d, dv)] the output sum (forward), dq (backward)
  float* rdys;       // [rows_max][kc] dys (backward)
  float* kacc;       // [d + dv + kc] one key's dk, dv, dz
  uint8_t* dense;    // [rows_max] whether each row is drawn pair by pair
  float* acc;        // [m][d + dv + kc] key-side gradients of a row-split graph (or null)
};

struct Slot {
  Tables t;
  Block b;
};

static void layout(const Dims& D, bool with_acc, Bump& b, Slot& s) {
  const int64_t nc = (D.m + kChunk - 1) / kChunk, K = D.kc + 1, nw = (D.m + 63) / 64;
  s.t.zc = b.take<float>(D.kc * nc * kChunk);
  s.t.ccdf = b.take<double>(D.kc * (nc + 1 + kPad));
  s.t.cguide = b.take<int32_t>(D.kc * nc);
  s.t.zsum = b.take<double>(D.kc);
  s.t.real = b.take<int32_t>(D.m);
  s.t.rtot = b.take<double>(D.n);
  s.t.crun = b.take<float>(kChunk * D.kc);
  s.t.zero = b.take<float>(D.kc);
  s.t.nc = nc;
  Block& k = s.b;
  k.rows_max = block_rows_max(D);
  k.ecap = block_edge_cap(D);
  k.bits = b.take<uint64_t>(k.rows_max * nw);
  k.rcdf = b.take<double>(pow2_at_least(K + 1 + kPad));
  k.rguide = b.take<int32_t>(K);
  k.u = b.take<uint32_t>(4 * kDrawBlock);
  k.dcl = b.take<int32_t>(kDrawCap);
  k.drow = b.take<uint16_t>(kDrawCap);
  k.dword = b.take<uint32_t>(kDrawCap);
  k.srow = b.take<uint16_t>(kDrawCap);
  k.sword = b.take<uint32_t>(kDrawCap);
  k.ccount = b.take<int32_t>(K + 1);
  k.rptr = b.take<int32_t>(k.rows_max + 1);
  k.rcols = b.take<int32_t>(k.ecap);
  k.uu = b.take<uint32_t>(std::max(k.ecap, D.m));
  k.need = b.take<int32_t>(D.m);
  k.kend = b.take<int32_t>(D.m);
  k.krow = b.take<uint16_t>(k.ecap);
  k.ks = b.take<float>(k.ecap);
  k.kz = b.take<float>(k.ecap);
  k.rmax = b.take<float>(k.rows_max);
  k.rl = b.take<float>(k.rows_max);
  k.rlse = b.take<float>(k.rows_max);
  k.rD = b.take<float>(k.rows_max);
  k.racc = b.take<float>(k.rows_max * std::max(D.d, D.dv));
  k.rdys = b.take<float>(k.rows_max * D.kc);
  k.kacc = b.take<float>(D.d + D.dv + D.kc);
  k.dense = b.take<uint8_t>(k.rows_max);
  k.acc = with_acc ? b.take<float>(D.m * (D.d + D.dv + D.kc)) : nullptr;
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
  PhaseTimer timer(kTables);
  const int64_t m = D.m, kc = D.kc, nc = t.nc, width = nc * kChunk;
  int64_t mreal = 0;
  for (int64_t j = 0; j < m; ++j)
    if (g.km[j]) t.real[mreal++] = static_cast<int32_t>(j);
  t.mreal = mreal;
  // Each chunk of 16 keys becomes every cluster's inclusive cumulative sums (padded keys
  // and keys past m weigh 0): the sums run over the chunk's keys with the clusters side
  // by side (a key's memberships are one contiguous row, so the adds vectorise across
  // clusters and no cluster waits on its own previous add), each cluster's in the same
  // order as one cluster at a time; then they are written cluster-major.
  float* run = t.crun;
  std::fill(t.zero, t.zero + kc, 0.0f);
  for (int64_t c = 0; c < nc; ++c) {
    for (int64_t x = 0; x < kChunk; ++x) {
      const int64_t j = c * kChunk + x;
      const float* zj = (j < m && g.km[j]) ? g.z + j * kc : t.zero;
      const float* prev = x ? run + (x - 1) * kc : t.zero;
      float* cur = run + x * kc;
#pragma omp simd
      for (int64_t v = 0; v < kc; ++v) cur[v] = prev[v] + std::max(zj[v], 0.0f);
    }
    for (int64_t v = 0; v < kc; ++v) {
      float* dst = t.zc + v * width + c * kChunk;
      for (int64_t x = 0; x < kChunk; ++x) dst[x] = run[x * kc + v];
    }
  }
  for (int64_t v = 0; v < kc; ++v) {
    const float* w = t.zc + v * width;
    double* cdf = t.ccdf + v * (nc + 1 + kPad);
    cdf[0] = 0.0;
    for (int64_t c = 0; c < nc; ++c) cdf[c + 1] = cdf[c] + static_cast<double>(w[c * kChunk + kChunk - 1]);
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
  // Row i's total cluster weight, sum_v (Y S)_iv sum_j z_jv + delta * #real keys (its
  // expected draws over c_i, the row CDF's total), for kRowLanes rows at once, each row's
  // sum in its own lane and in order: independent chains, not one dependent add per term.
  constexpr int64_t kRowLanes = 8;
  const double mreal_delta = static_cast<double>(g.delta) * static_cast<double>(mreal);
  for (int64_t i0 = 0; i0 < D.n; i0 += kRowLanes) {
    const int64_t lanes = std::min(kRowLanes, D.n - i0);
    const float* ys = g.ys + i0 * kc;
    double tot[kRowLanes] = {};
    for (int64_t v = 0; v < kc; ++v) {
      const double zv = t.zsum[v];
      for (int64_t r = 0; r < kRowLanes; ++r)
        if (r < lanes) tot[r] += static_cast<double>(std::max(ys[r * kc + v], 0.0f)) * zv;
    }
    for (int64_t r = 0; r < lanes; ++r) t.rtot[i0 + r] = g.qm[i0 + r] ? tot[r] + mreal_delta : 0.0;
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

// ---- a block of rows: edges ------------------------------------------------------------

static inline void set_bit(uint64_t* bits, int64_t j) { bits[j >> 6] |= uint64_t{1} << (j & 63); }

// The bound on a row's edges that decides the blocks: its draws plus its forced pairs,
// at most the keys.
// Whether row i is drawn pair by pair: decided from its expected draws, never from its
// drawn count (a choice that depended on the count would condition each way's draw on
// it and bias the law).
static inline bool dense_row(const Graph& g, const Tables& t, int64_t i) {
  return g.c[i] * t.rtot[i] > kDenseShare * static_cast<double>(t.mreal) || g.c[i] > kDenseOversample;
}

static inline int64_t edge_bound(const Dims& D, const Opts& O, const Graph& g, const Tables& t, int64_t i) {
  if (!g.qm[i]) return 0;
  if (dense_row(g, t, i)) return t.mreal;
  const int64_t forced = O.forced_half >= 0 ? 2 * O.forced_half + 1 : 0;
  return std::min<int64_t>(D.m, static_cast<int64_t>(g.counts[i]) + forced);
}

// The row blocks of a graph: rows [starts[b], starts[b + 1]). Rows join a block while the
// block has at most rows_max rows and the sum of their edge bounds fits its edge slots.
// offs[b] is the sum of the edge bounds of the rows before block b: where the block's
// edges go in the edge cache (offs[b + 1] <= the cache's slots: it fits).
struct Blocks {
  std::vector<int64_t> starts, offs;
  size_t count() const { return starts.size() - 1; }
};

static Blocks blocks_of(const Dims& D, const Opts& O, const Graph& g, const Tables& t) {
  const int64_t rows_max = block_rows_max(D), ecap = block_edge_cap(D);
  Blocks bl;
  bl.starts.push_back(0);
  bl.offs.push_back(0);
  int64_t rows = 0, edges = 0;
  for (int64_t i = 0; i < D.n; ++i) {
    const int64_t e = edge_bound(D, O, g, t, i);
    if (rows > 0 && (rows == rows_max || edges + e > ecap)) {
      bl.starts.push_back(i);
      bl.offs.push_back(bl.offs.back() + edges);
      rows = 0;
      edges = 0;
    }
    ++rows;
    edges += e;
  }
  bl.starts.push_back(D.n);
  bl.offs.push_back(bl.offs.back() + edges);
  return bl;
}

// One graph's edge cache: the forward pass keeps the edges of every block that fits in
// `slots` (from cols[offs[b]]; row i's edges at cols[rows[2 i]], rows[2 i + 1] of them,
// or a count of -1 for the rows of the blocks that do not fit); the backward pass reads
// a block's rows from there when every one of them was kept, whatever its own blocks,
// and draws the block again otherwise. slots == 0: no cache.
struct EdgeCache {
  int32_t* cols = nullptr;
  int32_t* rows = nullptr;
  int64_t slots = 0;
  bool holds(int64_t off_end) const { return slots > 0 && off_end <= slots; }
  bool kept(int64_t r0, int64_t r1) const {
    if (slots <= 0) return false;
    for (int64_t i = r0; i < r1; ++i)
      if (rows[2 * i + 1] < 0) return false;
    return true;
  }
};

// The pending draws, sorted by cluster, each resolved to its key (the cluster's tables
// stay in cache across its draws) and set in its row's bitmap.
static void resolve_draws(const Dims& D, const Tables& t, Block& b, int64_t pending) {
  PhaseTimer timer(kResolve);
  const int64_t kc = D.kc, nc = t.nc, nw = (D.m + 63) / 64;
  int32_t* cnt = b.ccount;
  std::fill(cnt, cnt + kc + 1, 0);
  for (int64_t h = 0; h < pending; ++h) ++cnt[b.dcl[h] + 1];
  for (int64_t v = 0; v < kc; ++v) cnt[v + 1] += cnt[v];
  for (int64_t h = 0; h < pending; ++h) {
    const int64_t at = cnt[b.dcl[h]]++;
    b.srow[at] = b.drow[h];
    b.sword[at] = b.dword[h];
  }
  // Per cluster: each draw's guided chunk (the guide table is hot), then its key, with
  // the chunk's CDF entry and cumulative weights prefetched kAhead draws before use.
  int64_t h0 = 0;
  for (int64_t v = 0; v < kc; ++v) {
    const int64_t h1 = cnt[v];  // cnt[v] is now the end of cluster v's draws
    if (h1 == h0) continue;
    const int32_t* guide = t.cguide + v * nc;
    const double* cdf = t.ccdf + v * (nc + 1 + kPad);
    const float* zc = t.zc + v * nc * kChunk;
    for (int64_t h = h0; h < h1; ++h) b.dcl[h] = guide[guide_index(b.sword[h] * kTwoM32, nc)];
    for (int64_t h = h0; h < std::min(h1, h0 + kAhead); ++h) {
      __builtin_prefetch(cdf + b.dcl[h]);
      __builtin_prefetch(zc + b.dcl[h] * kChunk);
    }
    for (int64_t h = h0; h < h1; ++h) {
      if (h + kAhead < h1) {
        __builtin_prefetch(cdf + b.dcl[h + kAhead]);
        __builtin_prefetch(zc + b.dcl[h + kAhead] * kChunk);
      }
      const int64_t j = pick_key_from(D, t, v, b.sword[h] * kTwoM32, b.dcl[h]);
      set_bit(b.bits + static_cast<int64_t>(b.srow[h]) * nw, j);
    }
    h0 = h1;
  }
}

// Row i drawn pair by pair: real key j is present with probability min(1, p_ij + delta)
// (bernoulli) or 1 - exp(-(p_ij + delta)) (poisson), against the float uniform of the
// first Philox word of counter (i, j, dense stream); sets the row's bits.
static void sample_dense_row(const Dims& D, const Opts& O, const Graph& g, const Tables& t, uint64_t* bits,
                             int64_t i) {
  (void)t;
  const int64_t m = D.m, kc = D.kc;
  const float* ysi = g.ys + i * kc;
  const float delta = g.delta;
  alignas(64) float prob[16];
  alignas(64) uint32_t words[16];
  for (int64_t j0 = 0; j0 < m; j0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, m - j0);
    for (int64_t x = 0; x < cnt; ++x) {
      const int64_t j = j0 + x;
      if (!g.km[j]) {
        prob[x] = 0.0f;
        continue;
      }
      const float rate = dot(ysi, g.z + j * kc, kc) + delta;
      prob[x] = O.law == kLawBernoulli ? std::min(1.0f, rate) : -std::expm1(-rate);
    }
#if defined(__AVX512F__)
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i x0, x1, x2, x3;
    philox16(g.key0, g.key1, static_cast<uint32_t>(i), _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j0)), lanes),
             kStreamDense, &x0, &x1, &x2, &x3);
    _mm512_store_si512(words, x0);
#else
    for (int64_t x = 0; x < cnt; ++x) {
      uint32_t w[4];
      philox(g.key0, g.key1, static_cast<uint32_t>(i), static_cast<uint32_t>(j0 + x), kStreamDense, 0, w);
      words[x] = w[0];
    }
#endif
    for (int64_t x = 0; x < cnt; ++x)
      if (unit_float(words[x]) < prob[x]) set_bit(bits, j0 + x);
  }
}

// Draws the edges of rows [r0, r1) into the block's row-major CSR (rptr, rcols: each
// row's keys sorted, collapsed, thinned, forced pairs added); returns their number. The
// graph of a row depends only on (seed, row): not on the blocks or the threads.
static int64_t sample_block(const Dims& D, const Opts& O, const Graph& g, const Tables& t, Block& b,
                            int64_t r0, int64_t r1) {
  const int64_t m = D.m, kc = D.kc, K = kc + 1, nw = (m + 63) / 64;
  int64_t pending = 0;
  auto draws_timer = std::make_unique<PhaseTimer>(kDraws);  // includes resolve (subtract it)
  for (int64_t i = r0; i < r1; ++i) {
    b.dense[i - r0] = 0;
    if (!g.qm[i]) continue;
    uint64_t* bits = b.bits + (i - r0) * nw;
    const int64_t draws = g.counts[i];
    if (t.mreal > 0 && dense_row(g, t, i)) {
      b.dense[i - r0] = 1;  // drawn pair by pair below
    } else if (draws > 0 && t.mreal > 0) {
      const float* ysi = g.ys + i * kc;
      double* rc = b.rcdf;
      const int64_t len = pow2_at_least(K + 1 + kPad);
      rc[0] = 0.0;
      for (int64_t v = 0; v < kc; ++v) rc[v + 1] = rc[v] + static_cast<double>(std::max(ysi[v], 0.0f)) * t.zsum[v];
      rc[K] = rc[kc] + static_cast<double>(g.delta) * static_cast<double>(t.mreal);
      for (int64_t x = K + 1; x < len; ++x) rc[x] = INFINITY;
      const double total = rc[K];
      // Many draws: a guide table over the row's CDF (O(K) to build, then about one
      // window compare per draw); few: a branchless bisection per draw.
      const bool guided = draws >= K;
      if (guided) {
        int64_t v = 0;
        for (int64_t q = 0; q < K; ++q) {
          const double thr = total * static_cast<double>(q) / static_cast<double>(K);
          while (v < K - 1 && rc[v + 1] <= thr) ++v;
          b.rguide[q] = static_cast<int32_t>(v);
        }
      }
      if (total > 0.0) {
        const double mreal = static_cast<double>(t.mreal);
        uint32_t *u0 = b.u, *u1 = u0 + kDrawBlock, *u2 = u1 + kDrawBlock, *u3 = u2 + kDrawBlock;
        const int64_t blocks = (draws + 1) / 2;
        for (int64_t b0 = 0; b0 < blocks; b0 += kDrawBlock) {
          const int64_t nb = std::min(kDrawBlock, blocks - b0);
          philox_blocks(g.key0, g.key1, static_cast<uint32_t>(i), b0, kStreamDraw, nb, u0, u1, u2, u3);
          const int64_t nd = std::min(2 * nb, draws - 2 * b0);
          for (int64_t h = 0; h < nd; ++h) {
            const uint32_t wc = (h & 1) ? u2[h >> 1] : u0[h >> 1];
            const uint32_t wk = (h & 1) ? u3[h >> 1] : u1[h >> 1];
            const double uc = wc * kTwoM32;
            const int64_t c = guided ? search_from(rc, b.rguide[guide_index(uc, K)], uc * total)
                                     : bisect(rc, len, uc * total);
            if (c == kc) {  // the exploration cluster: uniform over the real keys
              set_bit(bits, t.real[std::min(static_cast<int64_t>(wk * kTwoM32 * mreal), t.mreal - 1)]);
              continue;
            }
            b.dcl[pending] = static_cast<int32_t>(c);
            b.drow[pending] = static_cast<uint16_t>(i - r0);
            b.dword[pending] = wk;
            if (++pending == kDrawCap) {
              resolve_draws(D, t, b, pending);
              pending = 0;
            }
          }
        }
      }
    }
    if (O.forced_half >= 0) {
      const int64_t lo = std::max<int64_t>(0, i - O.forced_half), hi = std::min<int64_t>(m - 1, i + O.forced_half);
      for (int64_t j = lo; j <= hi; ++j)
        if (g.km[j]) set_bit(bits, j);
    }
  }
  if (pending > 0) resolve_draws(D, t, b, pending);
  for (int64_t i = r0; i < r1; ++i)
    if (b.dense[i - r0]) sample_dense_row(D, O, g, t, b.bits + (i - r0) * nw, i);
  draws_timer.reset();
  // Collapse each row's bitmap (clearing it) and thin its sampled pairs.
  PhaseTimer collapse_timer(kCollapse);
  int64_t count = 0;
  b.rptr[0] = 0;
  for (int64_t i = r0; i < r1; ++i) {
    const int64_t lr = i - r0;
    int32_t* cols = b.rcols + count;
    int64_t cand = 0;
    if (g.qm[i]) {
      uint64_t* bits = b.bits + lr * nw;
      for (int64_t w = 0; w < nw; ++w) {
        uint64_t word = bits[w];
        if (!word) continue;
        bits[w] = 0;
        while (word) {
          cols[cand++] = static_cast<int32_t>(w * 64 + __builtin_ctzll(word));
          word &= word - 1;
        }
      }
    }
    if (cand > 0 && O.law == kLawBernoulli && !b.dense[lr]) {
      // A sampled pair whose uniform is below 1 / c_i is kept without p_ij; the others'
      // membership rows are prefetched, then each is kept with r / (1 - exp(-c_i r)).
      int64_t flo = 1, fhi = 0;
      if (O.forced_half >= 0) {
        flo = i - O.forced_half;
        fhi = i + O.forced_half;
      }
      const double ci = g.c[i];
      const float* ysi = g.ys + i * kc;
      uint32_t* uu = b.uu;
      philox_first(g.key0, g.key1, static_cast<uint32_t>(i), cols, kStreamThin, cand, uu);
      int64_t needs = 0;
      for (int64_t e = 0; e < cand; ++e) {
        const int64_t j = cols[e];
        if ((j < flo || j > fhi) && uu[e] * kTwoM32 * ci >= 1.0) {
          b.need[needs++] = static_cast<int32_t>(e);
          prefetch_row(g.z + j * kc, kc);
        }
      }
      for (int64_t h = 0; h < needs; ++h) {
        const int64_t e = b.need[h], j = cols[e];
        const double u = uu[e] * kTwoM32;
        const double rate = static_cast<double>(dot(ysi, g.z + j * kc, kc)) + g.delta;
        const double cr = ci * rate;
        const double kp = cr > 1e-7 ? rate / -std::expm1(-cr) : 1.0 / ci;
        if (u >= kp) cols[e] = -1;  // thinned out
      }
      int64_t kept = 0;
      for (int64_t e = 0; e < cand; ++e) {
        cols[kept] = cols[e];
        kept += cols[e] >= 0 ? 1 : 0;
      }
      cand = kept;
    }
    count += cand;
    b.rptr[lr + 1] = static_cast<int32_t>(count);
  }
  return count;
}

// The block's edges grouped by key (a counting sort): key j's edges are
// [kend[j - 1], kend[j]) (from 0 for j = 0), in row order, each with its local row.
static void sort_by_key(const Dims& D, Block& b, int64_t rows) {
  PhaseTimer timer(kSortKeys);
  int32_t* kend = b.kend;
  std::fill(kend, kend + D.m, 0);
  const int64_t total = b.rptr[rows];
  for (int64_t e = 0; e < total; ++e) ++kend[b.rcols[e]];
  int64_t run = 0;
  for (int64_t j = 0; j < D.m; ++j) {  // kend[j]: start of key j for now
    const int64_t c = kend[j];
    kend[j] = static_cast<int32_t>(run);
    run += c;
  }
  for (int64_t lr = 0; lr < rows; ++lr)
    for (int64_t e = b.rptr[lr]; e < b.rptr[lr + 1]; ++e) b.krow[kend[b.rcols[e]]++] = static_cast<uint16_t>(lr);
}

// Dropout factors of key j's edges (keep / (1 - rate), keyed by (row, key)).
static inline void drop_factors(const Opts& O, const Graph& g, int64_t r0, const uint16_t* krow, int64_t j,
                                int64_t count, float* out) {
  const float scale = 1.0f / (1.0f - O.drop_rate), keep = 1.0f - O.drop_rate;
  for (int64_t e = 0; e < count; ++e) {
    uint32_t x[4];
    philox(g.dkey0, g.dkey1, static_cast<uint32_t>(r0 + krow[e]), static_cast<uint32_t>(j), kStreamDrop, 0, x);
    out[e] = unit_float(x[0]) < keep ? scale : 0.0f;
  }
}

// ---- a block of rows: forward and backward ------------------------------------------------

// The two passes of a block's forward attention, key by key (each key's row read once per
// block): scores and each row's maximum, then weights and the weighted sums of values.
// CD, CDV, CKC: the head, value and cluster widths when known at compile time (0: read
// from D), so that the common sizes' loops are unrolled.
template <int64_t CD, int64_t CDV, int64_t CKC>
static void forward_keys(const Dims& D, const Opts& O, const Graph& g, Block& b, int64_t r0, float inv) {
  const int64_t d = CD ? CD : D.d, dv = CDV ? CDV : D.dv, m = D.m;
  const int64_t acc_w = std::max(d, dv);
  int64_t start = 0;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t end = b.kend[j];
    if (end == start) continue;
    const float* kj = g.k + j * d;
    for (int64_t e = start; e < end; ++e) {
      const int64_t lr = b.krow[e];
      const float s = dot(g.q + (r0 + lr) * d, kj, d) * inv;
      b.ks[e] = s;
      b.rmax[lr] = std::max(b.rmax[lr], s);
    }
    start = end;
  }
  start = 0;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t end = b.kend[j];
    if (end == start) continue;
    const float* vj = g.v + j * dv;
    if (O.drop_rate > 0.0f) drop_factors(O, g, r0, b.krow + start, j, end - start, b.kz + start);
    for (int64_t e = start; e < end; ++e) {
      const int64_t lr = b.krow[e];
      const float w = std::exp(b.ks[e] - b.rmax[lr]);
      b.rl[lr] += w;
      const float wd = O.drop_rate > 0.0f ? w * b.kz[e] : w;
      if (wd != 0.0f) axpy(wd, vj, b.racc + lr * acc_w, dv);
    }
    start = end;
  }
}

template <int64_t V>
using Int = std::integral_constant<int64_t, V>;

// fn(Int<d>, Int<dv>, Int<kc>) with the sizes as compile-time constants where they are
// common ones (head widths 32 and 64 with 128 clusters), else Int<0>s.
template <class F>
static void dispatch_sizes(const Dims& D, F&& fn) {
  if (D.d == 32 && D.dv == 32 && D.kc == 128) return fn(Int<32>{}, Int<32>{}, Int<128>{});
  if (D.d == 64 && D.dv == 64 && D.kc == 128) return fn(Int<64>{}, Int<64>{}, Int<128>{});
  if (D.d == 16 && D.dv == 16 && D.kc == 128) return fn(Int<16>{}, Int<16>{}, Int<128>{});
  return fn(Int<0>{}, Int<0>{}, Int<0>{});
}

struct FwdOut {
  float *out, *lse;
};

static int64_t forward_block(const Dims& D, const Opts& O, const Graph& g, const Tables& t, Block& b,
                             int64_t r0, int64_t r1, FwdOut o, const EdgeCache& cache, int64_t off0,
                             int64_t off1) {
  const int64_t d = D.d, dv = D.dv, rows = r1 - r0;
  const int64_t edges = sample_block(D, O, g, t, b, r0, r1);
  if (cache.holds(off1)) {  // edges <= the block's bounds, off1 - off0
    std::copy(b.rcols, b.rcols + edges, cache.cols + off0);
    for (int64_t lr = 0; lr < rows; ++lr) {
      cache.rows[2 * (r0 + lr)] = static_cast<int32_t>(off0 + b.rptr[lr]);
      cache.rows[2 * (r0 + lr) + 1] = b.rptr[lr + 1] - b.rptr[lr];
    }
  } else if (cache.slots > 0) {
    for (int64_t i = r0; i < r1; ++i) {  // drawn again in the backward pass
      cache.rows[2 * i] = 0;
      cache.rows[2 * i + 1] = -1;
    }
  }
  sort_by_key(D, b, rows);
  PhaseTimer timer(kAttendForward);
  const float inv = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t acc_w = std::max(d, dv);
  std::fill(b.rmax, b.rmax + rows, -INFINITY);
  std::fill(b.rl, b.rl + rows, 0.0f);
  std::fill(b.racc, b.racc + rows * acc_w, 0.0f);
  dispatch_sizes(D, [&](auto cd, auto cdv, auto ckc) {
    forward_keys<decltype(cd)::value, decltype(cdv)::value, decltype(ckc)::value>(D, O, g, b, r0, inv);
  });
  for (int64_t lr = 0; lr < rows; ++lr) {
    float* out = o.out + (r0 + lr) * dv;
    if (b.rl[lr] > 0.0f) {
      const float invl = 1.0f / b.rl[lr];
      for (int64_t x = 0; x < dv; ++x) out[x] = b.racc[lr * acc_w + x] * invl;
      o.lse[r0 + lr] = b.rmax[lr] + std::log(b.rl[lr]);
    } else {
      std::fill(out, out + dv, 0.0f);
      o.lse[r0 + lr] = 0.0f;
    }
  }
  return edges;
}

struct BwdIo {
  const float *out, *lse, *dout;
  float dnum;           // cotangent of the edge count (the density term), paper/reference
  float *dq, *dys;      // row-side gradients of this graph
  float *dk, *dv, *dz;  // key-side gradients (the graph's outputs or an accumulator)
};

// A block's backward attention and straight-through gradients, key by key: each key's
// k, v and z rows read once, its dk, dv, dz summed over its edges and added once; each
// edge's row-side terms into the block's row accumulators. CD, CDV, CKC as in
// forward_keys.
template <int64_t CD, int64_t CDV, int64_t CKC>
static void backward_keys(const Dims& D, const Opts& O, const Graph& g, Block& b, int64_t r0, const BwdIo& io,
                          float inv) {
  const int64_t d = CD ? CD : D.d, dv = CDV ? CDV : D.dv, kc = CKC ? CKC : D.kc, m = D.m;
  const int64_t acc_w = std::max(d, dv);
  float *dk_j = b.kacc, *dv_j = b.kacc + d, *dz_j = b.kacc + d + dv;
  int64_t start = 0;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t end = b.kend[j];
    if (end == start) continue;
    const float* kj = g.k + j * d;
    const float* vj = g.v + j * dv;
    const float* zj = g.z + j * kc;
    std::fill(b.kacc, b.kacc + d + dv + kc, 0.0f);
    if (O.drop_rate > 0.0f) drop_factors(O, g, r0, b.krow + start, j, end - start, b.kz + start);
    for (int64_t e = start; e < end; ++e) {
      const int64_t lr = b.krow[e], i = r0 + lr;
      const float* qi = g.q + i * d;
      const float* doi = io.dout + i * dv;
      const float s = dot(qi, kj, d) * inv;
      const float w = std::exp(s - b.rlse[lr]);
      float dp = dot(doi, vj, dv), wz = w;
      if (O.drop_rate > 0.0f) {
        dp *= b.kz[e];
        wz = w * b.kz[e];
      }
      const float da = w * (dp - b.rD[lr]);
      axpy(da, kj, b.racc + lr * acc_w, d);
      axpy(da * inv, qi, dk_j, d);
      if (wz != 0.0f) axpy(wz, doi, dv_j, dv);
      float dm;
      if (O.ste == kStePaper) {
        dm = da * s + io.dnum;
      } else if (O.ste == kSteReference) {
        dm = std::min(1.0f, std::max(-1.0f, da + io.dnum));
      } else {
        dm = da;
      }
      if (dm != 0.0f) {
        axpy(dm, zj, b.rdys + lr * kc, kc);
        axpy(dm, g.ys + i * kc, dz_j, kc);
      }
    }
    axpy(1.0f, dk_j, io.dk + j * d, d);
    axpy(1.0f, dv_j, io.dv + j * dv, dv);
    axpy(1.0f, dz_j, io.dz + j * kc, kc);
    start = end;
  }
}

static void backward_block(const Dims& D, const Opts& O, const Graph& g, const Tables& t, Block& b,
                           int64_t r0, int64_t r1, const BwdIo& io, const EdgeCache& cache) {
  const int64_t d = D.d, dv = D.dv, kc = D.kc, m = D.m, rows = r1 - r0;
  if (cache.kept(r0, r1)) {  // the forward pass kept these rows' edges
    b.rptr[0] = 0;
    for (int64_t lr = 0; lr < rows; ++lr) {
      const int32_t* at = cache.rows + 2 * (r0 + lr);
      std::copy(cache.cols + at[0], cache.cols + at[0] + at[1], b.rcols + b.rptr[lr]);
      b.rptr[lr + 1] = b.rptr[lr] + at[1];
    }
  } else {
    sample_block(D, O, g, t, b, r0, r1);
  }
  sort_by_key(D, b, rows);
  PhaseTimer timer(kAttendBackward);
  const float inv = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t acc_w = std::max(d, dv);
  for (int64_t lr = 0; lr < rows; ++lr) {
    const int64_t i = r0 + lr;
    b.rlse[lr] = io.lse[i];
    b.rD[lr] = dot(io.dout + i * dv, io.out + i * dv, dv);
  }
  std::fill(b.racc, b.racc + rows * acc_w, 0.0f);
  std::fill(b.rdys, b.rdys + rows * kc, 0.0f);
  dispatch_sizes(D, [&](auto cd, auto cdv, auto ckc) {
    backward_keys<decltype(cd)::value, decltype(cdv)::value, decltype(ckc)::value>(D, O, g, b, r0, io, inv);
  });
  if (O.ste == kStePairs && t.mreal > 0) {
    // Absent pairs, from probes drawn uniformly from the real keys (every key once when
    // the probes are at least the keys): the gain of adding the pair to its row.
    const bool all = O.probes >= m;
    const int64_t num = all ? m : O.probes;
    const float weight = all ? 1.0f : static_cast<float>(t.mreal) / static_cast<float>(O.probes);
    for (int64_t lr = 0; lr < rows; ++lr) {
      const int64_t i = r0 + lr;
      if (!g.qm[i]) continue;
      const int32_t *c0 = b.rcols + b.rptr[lr], *c1 = b.rcols + b.rptr[lr + 1];
      const float* qi = g.q + i * d;
      const float* doi = io.dout + i * dv;
      const float* ysi = g.ys + i * kc;
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
        if (std::binary_search(c0, c1, static_cast<int32_t>(j))) continue;
        float sigma = 1.0f;
        if (c1 > c0) {
          const float s = dot(qi, g.k + j * d, d) * inv;
          sigma = 1.0f / (1.0f + std::exp(-(s - b.rlse[lr])));
        }
        const float gain = sigma * (dot(doi, g.v + j * dv, dv) - b.rD[lr]) * weight;
        if (gain != 0.0f) {
          axpy(gain, g.z + j * kc, b.rdys + lr * kc, kc);
          axpy(gain, ysi, io.dz + j * kc, kc);
        }
      }
    }
  }
  // dq and dys may be the buffers of q and ys (the Python side aliases them): a row's q
  // and ys are read only while its own block runs (tables and block starts are built from
  // ys before any block), and its dq and dys are written here, at the block's end.
  for (int64_t lr = 0; lr < rows; ++lr) {
    const int64_t i = r0 + lr;
    float* dqo = io.dq + i * d;
    for (int64_t x = 0; x < d; ++x) dqo[x] = b.racc[lr * acc_w + x] * inv;
    std::copy(b.rdys + lr * kc, b.rdys + (lr + 1) * kc, io.dys + i * kc);
  }
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
  g.q = in.q ? in.q + gi * D.n * D.d : nullptr;
  g.k = in.k ? in.k + gi * D.m * D.d : nullptr;
  g.v = in.v ? in.v + gi * D.m * D.dv : nullptr;
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

struct Scratch {
  std::vector<uint8_t*> blocks;
  std::vector<Slot> slots;
  Scratch(const Dims& D, int threads, bool with_acc) {
    const size_t bytes = slot_bytes(D, with_acc);
    blocks = pool().acquire(threads, bytes);
    for (uint8_t* p : blocks) {
      Bump b{p};
      Slot s;
      layout(D, with_acc, b, s);
      std::memset(s.b.bits, 0, sizeof(uint64_t) * s.b.rows_max * ((D.m + 63) / 64));
      slots.push_back(s);
    }
  }
  bool ok(int threads) const { return static_cast<int>(blocks.size()) == threads; }
  ~Scratch() { pool().release(blocks); }
};

// Graphs run in rounds of one per thread (each thread its own tables); the graphs left
// over (fewer than the threads) one at a time, their row blocks shared out to the threads,
// which read one set of tables. whole(gi, slot) runs a graph; part(gi, thread, slot,
// tables, blocks, b) block b of one; after(gi) follows a shared graph.
template <class Whole, class Part, class After>
static void for_graphs(const Dims& D, const Opts& O, const Inputs& in, Scratch& sc, Whole whole, Part part,
                       After after) {
  const int threads = O.threads;
  int64_t g0 = 0;
  if (threads > 1) {
    for (; D.G - g0 >= threads; g0 += threads) on_threads(threads, [&](int t) { whole(g0 + t, sc.slots[t]); });
  }
  for (; g0 < D.G; ++g0) {
    if (threads == 1) {
      whole(g0, sc.slots[0]);
      continue;
    }
    const Graph g = graph_at(D, in, g0);
    build_tables(D, g, sc.slots[0].t);
    const Blocks bl = blocks_of(D, O, g, sc.slots[0].t);
    const int64_t nblocks = static_cast<int64_t>(bl.count());
    std::atomic<int64_t> next{0};
    on_threads(threads, [&](int t) {
      for (int64_t blk; (blk = next.fetch_add(1)) < nblocks;) part(g0, t, sc.slots[t], sc.slots[0].t, bl, blk);
    });
    after(g0);
  }
}

// Graph gi's part of a call's edge cache ([G, slots] columns, [G, n, 2] rows' (start, count)).
static EdgeCache cache_of(const Dims& D, const EdgeCache& all, int64_t gi) {
  if (all.slots <= 0) return EdgeCache{};
  return EdgeCache{all.cols + gi * all.slots, all.rows + gi * 2 * D.n, all.slots};
}

static void forward_all(const Dims& D, const Opts& O, const Inputs& in, float* out, float* lse,
                        int32_t* edges, const EdgeCache& cache_all, Scratch& sc) {
  auto clip = [](int64_t x) { return static_cast<int32_t>(std::min<int64_t>(x, INT32_MAX)); };
  auto fout = [&](int64_t gi) { return FwdOut{out + gi * D.n * D.dv, lse + gi * D.n}; };
  std::vector<std::atomic<int64_t>> totals(static_cast<size_t>(D.G));
  for (auto& x : totals) x.store(0);
  auto whole = [&](int64_t gi, Slot& s) {
    const Graph g = graph_at(D, in, gi);
    build_tables(D, g, s.t);
    const Blocks bl = blocks_of(D, O, g, s.t);
    const EdgeCache cache = cache_of(D, cache_all, gi);
    int64_t total = 0;
    for (size_t b = 0; b < bl.count(); ++b)
      total += forward_block(D, O, g, s.t, s.b, bl.starts[b], bl.starts[b + 1], fout(gi), cache, bl.offs[b],
                             bl.offs[b + 1]);
    edges[gi] = clip(total);
  };
  auto part = [&](int64_t gi, int, Slot& s, const Tables& t, const Blocks& bl, int64_t b) {
    totals[gi].fetch_add(forward_block(D, O, graph_at(D, in, gi), t, s.b, bl.starts[b], bl.starts[b + 1],
                                       fout(gi), cache_of(D, cache_all, gi), bl.offs[b], bl.offs[b + 1]));
  };
  auto after = [&](int64_t gi) { edges[gi] = clip(totals[gi].load()); };
  for_graphs(D, O, in, sc, whole, part, after);
}

static void backward_all(const Dims& D, const Opts& O, const Inputs& in, const float* out,
                         const float* lse, const float* dout, const float* dnum, float* dq,
                         float* dk, float* dv, float* dys, float* dz, const EdgeCache& cache_all,
                         Scratch& sc) {
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
  auto zero_keys = [](float* a, int64_t len) { std::fill(a, a + len, 0.0f); };
  auto whole = [&](int64_t gi, Slot& s) {
    const BwdIo io = io_for(gi);
    zero_keys(io.dk, m * d);
    zero_keys(io.dv, m * dvd);
    zero_keys(io.dz, m * kc);
    const Graph g = graph_at(D, in, gi);
    build_tables(D, g, s.t);
    const Blocks bl = blocks_of(D, O, g, s.t);
    const EdgeCache cache = cache_of(D, cache_all, gi);
    for (size_t b = 0; b < bl.count(); ++b)
      backward_block(D, O, g, s.t, s.b, bl.starts[b], bl.starts[b + 1], io, cache);
  };
  // A shared graph: thread 0 adds into the outputs, the others into their accumulators.
  auto part = [&](int64_t gi, int t, Slot& s, const Tables& tab, const Blocks& bl, int64_t b) {
    BwdIo io = io_for(gi);
    if (t > 0) {
      io.dk = s.b.acc;
      io.dv = io.dk + m * d;
      io.dz = io.dv + m * dvd;
    }
    backward_block(D, O, graph_at(D, in, gi), tab, s.b, bl.starts[b], bl.starts[b + 1], io,
                   cache_of(D, cache_all, gi));
  };
  auto after = [&](int64_t gi) {
    const BwdIo io = io_for(gi);
    for (int t = 1; t < O.threads; ++t) {
      const float* a = sc.slots[t].b.acc;
      for (int64_t x = 0; x < m * d; ++x) io.dk[x] += a[x];
      for (int64_t x = 0; x < m * dvd; ++x) io.dv[x] += a[m * d + x];
      for (int64_t x = 0; x < m * kc; ++x) io.dz[x] += a[m * (d + dvd) + x];
    }
  };
  // Key-side outputs and accumulators start at zero for the graphs that are shared.
  const int64_t shared_from = O.threads > 1 ? (D.G / O.threads) * O.threads : D.G;
  for (int64_t gi = shared_from; gi < D.G; ++gi) {
    const BwdIo io = io_for(gi);
    zero_keys(io.dk, m * d);
    zero_keys(io.dv, m * dvd);
    zero_keys(io.dz, m * kc);
  }
  if (shared_from < D.G) {
    // Accumulators are zeroed before each shared graph (after() has read them).
    auto after_and_clear = [&](int64_t gi) {
      after(gi);
      for (int t = 1; t < O.threads; ++t) zero_keys(sc.slots[t].b.acc, m * (d + dvd + kc));
    };
    for (int t = 1; t < O.threads; ++t) zero_keys(sc.slots[t].b.acc, m * (d + dvd + kc));
    for_graphs(D, O, in, sc, whole, part, after_and_clear);
  } else {
    for_graphs(D, O, in, sc, whole, part, after);
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

static Inputs inputs_of(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer ys,
                        ffi::AnyBuffer z, ffi::AnyBuffer c, ffi::AnyBuffer counts, ffi::AnyBuffer qmask,
                        ffi::AnyBuffer kmask, ffi::AnyBuffer delta, ffi::AnyBuffer seeds, ffi::AnyBuffer dseeds) {
  return Inputs{q.typed_data<float>(),      k.typed_data<float>(),        v.typed_data<float>(),
                ys.typed_data<float>(),     z.typed_data<float>(),        c.typed_data<float>(),
                delta.typed_data<float>(),  counts.typed_data<int32_t>(), qmask.typed_data<uint8_t>(),
                kmask.typed_data<uint8_t>(), seeds.typed_data<uint32_t>(), dseeds.typed_data<uint32_t>()};
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

// The edge cache's buffers ([G, slots] and [G, n, 2] int32) against the graphs; with
// slots == 0 they are placeholders and unread.
static ffi::Error cache_from(const Dims& D, int64_t slots, ffi::AnyBuffer cols, ffi::AnyBuffer rows,
                             EdgeCache* cache) {
  *cache = EdgeCache{};
  if (slots <= 0) return ffi::Error::Success();
  if (lead_count(cols, 1) != D.G || dim_from_end(cols, 1) != slots || lead_count(rows, 2) != D.G ||
      dim_from_end(rows, 2) != D.n || dim_from_end(rows, 1) != 2)
    return ffi::Error::InvalidArgument("sbm fused: the edge cache does not match the graphs and cache_slots");
  *cache = EdgeCache{cols.typed_data<int32_t>(), rows.typed_data<int32_t>(), slots};
  return ffi::Error::Success();
}

static ffi::Error FusedForward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer ys,
                               ffi::AnyBuffer z, ffi::AnyBuffer c, ffi::AnyBuffer counts,
                               ffi::AnyBuffer qmask, ffi::AnyBuffer kmask, ffi::AnyBuffer delta,
                               ffi::AnyBuffer seeds, ffi::AnyBuffer dseeds, int64_t law,
                               int64_t forced_half, float drop_rate, int64_t ste, int64_t probes,
                               int64_t threads, int64_t cache_slots, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> edges,
                               ffi::Result<ffi::AnyBuffer> cache_cols, ffi::Result<ffi::AnyBuffer> cache_rows) {
  Dims D;
  if (auto err = dims_of(q, k, v, ys, z, c, counts, qmask, kmask, delta, seeds, dseeds, &D); err.failure())
    return err;
  Opts O = opts_of(law, forced_half, drop_rate, ste, probes, threads);
  O.threads = static_cast<int>(std::min<int64_t>(O.threads, std::max<int64_t>(1, D.G * D.n)));
  const Inputs in = inputs_of(q, k, v, ys, z, c, counts, qmask, kmask, delta, seeds, dseeds);
  EdgeCache cache;
  if (auto err = cache_from(D, cache_slots, *cache_cols, *cache_rows, &cache); err.failure()) return err;
  // The same scratch as the backward call's, so the two share the pool's blocks.
  Scratch sc(D, O.threads, needs_acc(D, O.threads));
  if (!sc.ok(O.threads)) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "sbm fused: out of memory for scratch");
  forward_all(D, O, in, out->typed_data<float>(), lse->typed_data<float>(), edges->typed_data<int32_t>(), cache,
              sc);
  return ffi::Error::Success();
}

static ffi::Error FusedBackward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer ys,
                                ffi::AnyBuffer z, ffi::AnyBuffer c, ffi::AnyBuffer counts,
                                ffi::AnyBuffer qmask, ffi::AnyBuffer kmask, ffi::AnyBuffer delta,
                                ffi::AnyBuffer seeds, ffi::AnyBuffer dseeds, ffi::AnyBuffer out,
                                ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dnum,
                                ffi::AnyBuffer cache_cols, ffi::AnyBuffer cache_rows, int64_t law,
                                int64_t forced_half, float drop_rate, int64_t ste, int64_t probes,
                                int64_t threads, int64_t cache_slots, ffi::Result<ffi::AnyBuffer> dq,
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
  const Inputs in = inputs_of(q, k, v, ys, z, c, counts, qmask, kmask, delta, seeds, dseeds);
  EdgeCache cache;
  if (auto err = cache_from(D, cache_slots, cache_cols, cache_rows, &cache); err.failure()) return err;
  Scratch sc(D, O.threads, needs_acc(D, O.threads));
  if (!sc.ok(O.threads)) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "sbm fused: out of memory for scratch");
  backward_all(D, O, in, out.typed_data<float>(), lse.typed_data<float>(), dout.typed_data<float>(),
               dnum.typed_data<float>(), dq->typed_data<float>(), dk->typed_data<float>(),
               dv->typed_data<float>(), dys->typed_data<float>(), dz->typed_data<float>(), cache, sc);
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
  Slot& s = sc.slots[0];
  for (int64_t gi = 0; gi < D.G; ++gi) {
    const Graph g = graph_at(D, in, gi);
    build_tables(D, g, s.t);
    const Blocks bl = blocks_of(D, O, g, s.t);
    for (size_t b = 0; b < bl.count(); ++b) {
      const int64_t r0 = bl.starts[b], r1 = bl.starts[b + 1];
      sample_block(D, O, g, s.t, s.b, r0, r1);
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t e = s.b.rptr[i - r0]; e < s.b.rptr[i - r0 + 1]; ++e)
          mk[(gi * D.n + i) * D.m + s.b.rcols[e]] = 1;
    }
  }
  return ffi::Error::Success();
}

// The operands the forward and backward calls share (q, k, v, ys, z, c, counts, qmask,
// kmask, delta, seeds, dseeds), and their attributes.
template <class B>
static auto graph_args(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>();
}

template <class B>
static auto option_attrs(B&& b) {
  return std::forward<B>(b)
      .template Attr<int64_t>("law")
      .template Attr<int64_t>("forced_half")
      .template Attr<float>("drop_rate")
      .template Attr<int64_t>("ste")
      .template Attr<int64_t>("probes")
      .template Attr<int64_t>("threads")
      .template Attr<int64_t>("cache_slots");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SbmFusedForward, FusedForward,
                              option_attrs(graph_args(ffi::Ffi::Bind()))
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>()   // lse
                                  .Ret<ffi::AnyBuffer>()   // edges
                                  .Ret<ffi::AnyBuffer>()   // cache columns
                                  .Ret<ffi::AnyBuffer>());  // cache rows (start, count)

XLA_FFI_DEFINE_HANDLER_SYMBOL(SbmFusedBackward, FusedBackward,
                              option_attrs(graph_args(ffi::Ffi::Bind())
                                               .Arg<ffi::AnyBuffer>()    // out
                                               .Arg<ffi::AnyBuffer>()    // lse
                                               .Arg<ffi::AnyBuffer>()    // dout
                                               .Arg<ffi::AnyBuffer>()    // dnum
                                               .Arg<ffi::AnyBuffer>()    // cache columns
                                               .Arg<ffi::AnyBuffer>())  // cache rows (start, count)
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

// Phase timers: start (on != 0) or stop them, and read the nanoseconds summed over
// threads since the last read into out[kPhases] (tables, draws incl. resolve, resolve,
// collapse and thinning, key sort, forward attention, backward attention).
extern "C" void SbmFusedPhaseNanos(int64_t on, int64_t* out) {
  g_timing.store(on != 0);
  for (int p = 0; p < kPhases; ++p) out[p] = g_phase_ns[p].exchange(0);
}

// Bytes of scratch one call holds (per thread, times threads), for memory accounting.
extern "C" int64_t SbmFusedScratchBytes(int64_t G, int64_t n, int64_t m, int64_t d, int64_t dv,
                                        int64_t kc, int64_t threads, int64_t backward) {
  (void)backward;  // forward and backward calls hold the same scratch
  Dims D{G, n, m, d, dv, kc};
  const int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, std::max<int64_t>(1, G * n))));
  return static_cast<int64_t>(slot_bytes(D, needs_acc(D, t)) * t);
}

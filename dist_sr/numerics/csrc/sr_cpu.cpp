// Keyed FP32 -> BF16 rounding on the CPU, one pass, bitwise equal to dist_sr.numerics.reference.
//
// The contract (dist_sr/numerics/key.py): element with global index i takes the 16 bits
// (h_q >> 16*(i&3)) & 0xFFFF of h_q = mix(key + (q+1)*GAMMA), q = i >> 2. On a little-endian
// machine eight consecutive hashes, stored as 64 bytes, *are* the 32 random uint16 of 32
// consecutive elements, so the main loop hashes 8 blocks and then runs a plain 32-lane
// add/shift/narrow that the compiler vectorises. Partial blocks at either end go scalar.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;
constexpr int64_t kChunk = 32;          // elements per vector body (8 hashes)
constexpr int64_t kGrain = 1 << 14;     // chunks per task: ~2 MiB of input

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the 8-hash trick needs little-endian");

// Outputs at least this large are written with non-temporal (streaming) stores: a plain store
// first reads the destination line into the cache (2 extra bytes per element on a 2-byte output),
// which is the whole difference between a one-pass SR step and torch's own fused AdamW. Smaller
// outputs stay in the cache for whoever reads them next.
constexpr int64_t kStreamMin = int64_t(1) << 20;

// Store one chunk's 32 BF16 values (64 bytes): streaming when asked and the line is aligned.
inline void store_chunk(uint16_t* dst, const uint16_t* src, bool stream) {
#if defined(__AVX512F__)
  if (stream && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_loadu_si512(src));
    return;
  }
#elif defined(__AVX__)
  if (stream && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 16),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16)));
    return;
  }
#endif
  std::memcpy(dst, src, 64);
}

// Streaming stores are weakly ordered: fence before a task ends so every thread's output is
// visible once parallel_for returns.
inline void stream_fence(bool stream) {
#if defined(__AVX512F__) || defined(__AVX__)
  if (stream) _mm_sfence();
#else
  (void)stream;
#endif
}

inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

// The 8 block hashes of one chunk (blocks q+1 .. q+8 of the stream, 32 elements). Written as
// independent multiplies so the compiler vectorizes them; measured on a CPU without AVX-512
// (Zen 3, no 64-bit vector multiply), this beat scalar or repeated-addition hashing by 1.2-1.7x.
inline void hash8(uint64_t key, uint64_t q, uint64_t* __restrict__ h) {
  for (int t = 0; t < 8; ++t) h[t] = mix(key + (q + t + 1) * kGamma);
}

inline uint32_t bits_for(uint64_t key, uint64_t i) {
  return static_cast<uint32_t>(mix(key + ((i >> 2) + 1) * kGamma) >> (16 * (i & 3))) & 0xFFFFu;
}

inline uint16_t round_one(uint32_t b, uint32_t r) {
  const bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? uint16_t(0x7FC0) : static_cast<uint16_t>((b + r) >> 16);
}

inline uint32_t nearest_bits(uint32_t b) { return 0x7FFFu + ((b >> 16) & 1u); }

// Rounds n elements; x[j] has global index offset + j.
void sr_span(const uint32_t* x, uint16_t* out, int64_t n, uint64_t key, int64_t offset) {
  const int64_t head = std::min<int64_t>(n, (kChunk - offset % kChunk) % kChunk);
  for (int64_t j = 0; j < head; ++j) out[j] = round_one(x[j], bits_for(key, offset + j));
  const int64_t chunks = (n - head) / kChunk;
  const int64_t first_block = (offset + head) / 4;  // global block index of the first full chunk
  const bool stream = n >= kStreamMin;
  at::parallel_for(0, chunks, kGrain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      uint64_t h[8];
      const uint64_t q = static_cast<uint64_t>(first_block + c * 8);
      hash8(key, q, h);
      uint16_t r[kChunk];
      std::memcpy(r, h, sizeof(r));
      const uint32_t* xs = x + head + c * kChunk;
      uint16_t o[kChunk];
      for (int k = 0; k < kChunk; ++k) o[k] = round_one(xs[k], r[k]);
      store_chunk(out + head + c * kChunk, o, stream);
    }
    stream_fence(stream);
  });
  for (int64_t j = head + chunks * kChunk; j < n; ++j) out[j] = round_one(x[j], bits_for(key, offset + j));
}

void rne_span(const uint32_t* x, uint16_t* out, int64_t n) {
  at::parallel_for(0, n, kGrain * kChunk, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) out[j] = round_one(x[j], nearest_bits(x[j]));
  });
}

void check_pair(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "dist_sr CPU kernel: tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "dist_sr CPU kernel: x must be float32");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, "dist_sr CPU kernel: out must be bfloat16");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "dist_sr CPU kernel: tensors must be contiguous");
  TORCH_CHECK(x.numel() == out.numel(), "dist_sr CPU kernel: x and out differ in numel");
}

void round_one_tensor(const at::Tensor& x, at::Tensor& out, bool keyed, uint64_t key, int64_t offset) {
  check_pair(x, out);
  const auto* xb = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  auto* ob = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  if (keyed) {
    sr_span(xb, ob, x.numel(), key, offset);
  } else {
    rne_span(xb, ob, x.numel());
  }
}

// A strided shard: x is [rows, row_len] contiguous, and its element (r, c) is element
// offset + r * row_stride + c of the full parameter (e.g. a column shard of a 2-D weight). Each
// row is a contiguous span of the parameter, rounded in place with no copy.
void round_rows(const at::Tensor& x, at::Tensor out, int64_t key, int64_t offset, int64_t row_len,
                int64_t row_stride) {
  check_pair(x, out);
  TORCH_CHECK(row_len > 0 && x.numel() % row_len == 0, "dist_sr CPU kernel: numel is not a multiple of row_len");
  TORCH_CHECK(row_stride >= row_len, "dist_sr CPU kernel: row_stride must be >= row_len");
  const auto* xb = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  auto* ob = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t rows = x.numel() / row_len;
  const int64_t grain = std::max<int64_t>(1, (kGrain * kChunk) / row_len);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      sr_span(xb + r * row_len, ob + r * row_len, row_len, static_cast<uint64_t>(key), offset + r * row_stride);
    }
  });
}

// key arrives as int64 (pybind has no uint64 on every platform); the bits are the same.
void round_tensor(const at::Tensor& x, at::Tensor out, bool keyed, int64_t key, int64_t offset) {
  round_one_tensor(x, out, keyed, static_cast<uint64_t>(key), offset);
}

void round_tensors(const std::vector<at::Tensor>& xs, std::vector<at::Tensor> outs, bool keyed,
                   const std::vector<int64_t>& keys, const std::vector<int64_t>& offsets) {
  TORCH_CHECK(xs.size() == outs.size() && (!keyed || (xs.size() == keys.size() && xs.size() == offsets.size())),
              "dist_sr CPU kernel: list lengths differ");
  for (size_t t = 0; t < xs.size(); ++t) {
    round_one_tensor(xs[t], outs[t], keyed, keyed ? static_cast<uint64_t>(keys[t]) : 0,
                     keyed ? offsets[t] : 0);
  }
}


// ---- fused AdamW + keyed SR ------------------------------------------------------------------
// One pass over FP32 shadow, FP32 moments and the (BF16 or FP32) gradient; writes the shadow,
// the moments and the rounded BF16 working weight. Every operation is a separate IEEE-rounded
// step in this order (no FMA contraction: built with -ffp-contract=off), which the pure-torch
// reference in dist_sr/numerics/fused.py and the Triton kernel repeat exactly:
//   g = grad * grad_scale
//   m = m + (1 - beta1) * (g - m)
//   v = v * beta2 + ((1 - beta2) * g) * g
//   s = s * (1 - lr * wd)
//   s = s + (-step_size * m) / (sqrt(v) * rbc2 + eps)      rbc2 = 1 / sqrt(1 - beta2^t)
//   w = SR(s)
struct AdamWArgs {
  float one_minus_beta1, beta2, one_minus_beta2, decay, neg_step_size, rbc2, eps, grad_scale;
};

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename G>
inline float load_grad(const G* g, int64_t j);
template <>
inline float load_grad<float>(const float* g, int64_t j) { return g[j]; }
template <>
inline float load_grad<uint16_t>(const uint16_t* g, int64_t j) { return bf16_to_float(g[j]); }

// grad_scale is applied unconditionally: multiplying by 1.0f is exact, so this equals the
// reference's "scale only when != 1" and keeps the loop free of branches.
template <typename G>
inline uint32_t adamw_one(float* __restrict__ s, float* __restrict__ m, float* __restrict__ v,
                          const G* __restrict__ g, int64_t j, const AdamWArgs& a) {
  const float gj = load_grad(g, j) * a.grad_scale;
  float mj = m[j];
  mj = mj + a.one_minus_beta1 * (gj - mj);
  const float vj = v[j] * a.beta2 + (a.one_minus_beta2 * gj) * gj;
  float sj = s[j] * a.decay;
  const float denom = std::sqrt(vj) * a.rbc2 + a.eps;
  sj = sj + (a.neg_step_size * mj) / denom;
  m[j] = mj;
  v[j] = vj;
  s[j] = sj;
  uint32_t bits;
  std::memcpy(&bits, &sj, 4);
  return bits;
}

template <typename G>
void adamw_span(float* __restrict__ s, float* __restrict__ m, float* __restrict__ v, const G* __restrict__ g,
                uint16_t* __restrict__ out, int64_t n, bool keyed, uint64_t key, int64_t offset, const AdamWArgs& a) {
  auto scalar = [&](int64_t j) {
    const uint32_t b = adamw_one(s, m, v, g, j, a);
    out[j] = round_one(b, keyed ? bits_for(key, offset + j) : nearest_bits(b));
  };
  const int64_t head = std::min<int64_t>(n, (kChunk - offset % kChunk) % kChunk);
  for (int64_t j = 0; j < head; ++j) scalar(j);
  const int64_t chunks = (n - head) / kChunk;
  const int64_t first_block = (offset + head) / 4;
  const bool stream = n >= kStreamMin;
  at::parallel_for(0, chunks, kGrain / 4, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t base = head + c * kChunk;
      float* __restrict__ sc = s + base;
      float* __restrict__ mc = m + base;
      float* __restrict__ vc = v + base;
      const G* __restrict__ gc = g + base;
      uint32_t b[kChunk];
      for (int k = 0; k < kChunk; ++k) b[k] = adamw_one(sc, mc, vc, gc, k, a);
      uint16_t r[kChunk];
      if (keyed) {
        uint64_t h[8];
        const uint64_t q = static_cast<uint64_t>(first_block + c * 8);
        hash8(key, q, h);
        std::memcpy(r, h, sizeof(r));
      } else {
        for (int k = 0; k < kChunk; ++k) r[k] = static_cast<uint16_t>(nearest_bits(b[k]));
      }
      uint16_t o[kChunk];
      for (int k = 0; k < kChunk; ++k) o[k] = round_one(b[k], r[k]);
      store_chunk(out + base, o, stream);
    }
    stream_fence(stream);
  });
  for (int64_t j = head + chunks * kChunk; j < n; ++j) scalar(j);
}

void adamw_sr(at::Tensor shadow, at::Tensor exp_avg, at::Tensor exp_avg_sq, const at::Tensor& grad,
              at::Tensor out, bool keyed, int64_t key, int64_t offset, double one_minus_beta1, double beta2,
              double one_minus_beta2, double decay, double neg_step_size, double rbc2, double eps,
              double grad_scale) {
  for (const auto* t : {&shadow, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "dist_sr fused AdamW: shadow and moments must be contiguous float32 CPU tensors");
    TORCH_CHECK(t->numel() == shadow.numel(), "dist_sr fused AdamW: numel mismatch");
  }
  TORCH_CHECK(grad.numel() == shadow.numel() && grad.is_contiguous() && grad.device().is_cpu() &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16),
              "dist_sr fused AdamW: grad must be a contiguous float32 or bfloat16 CPU tensor of the shadow's numel");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.numel() == shadow.numel(),
              "dist_sr fused AdamW: out must be a contiguous bfloat16 tensor of the shadow's numel");
  // the constants arrive computed in double by dist_sr.numerics.fused.AdamWHyper.scalars()
  AdamWArgs a{static_cast<float>(one_minus_beta1), static_cast<float>(beta2), static_cast<float>(one_minus_beta2),
              static_cast<float>(decay), static_cast<float>(neg_step_size), static_cast<float>(rbc2),
              static_cast<float>(eps), static_cast<float>(grad_scale)};
  auto* s = shadow.data_ptr<float>();
  auto* m = exp_avg.data_ptr<float>();
  auto* v = exp_avg_sq.data_ptr<float>();
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint64_t k = static_cast<uint64_t>(key);
  if (grad.scalar_type() == at::kFloat) {
    adamw_span(s, m, v, grad.data_ptr<float>(), o, shadow.numel(), keyed, k, offset, a);
  } else {
    adamw_span(s, m, v, reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>()), o, shadow.numel(), keyed,
               k, offset, a);
  }
}

// ---- pure-BF16 AdamW + keyed SR (arXiv 2502.20566) ----------------------------------------------
// The same arithmetic with no FP32 master: s = float(p) and p <- SR(s) in place with the param's
// key. Moments are FP32, or BF16 read as FP32 and written back as SR(m), SR(v) with their own keys
// (kp, km, kv: the keys of "name", "name#exp_avg", "name#exp_avg_sq").
inline float load_f(const float* x, int64_t j) { return x[j]; }
inline float load_f(const uint16_t* x, int64_t j) { return bf16_to_float(x[j]); }
inline uint32_t f_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

template <typename G, typename M>
inline void adamw_pure_one(uint16_t* __restrict__ p, M* __restrict__ m, M* __restrict__ v, const G* __restrict__ g,
                           int64_t j, const AdamWArgs& a, uint32_t& pb, uint32_t& mb, uint32_t& vb) {
  const float gj = load_grad(g, j) * a.grad_scale;
  float mj = load_f(m, j);
  mj = mj + a.one_minus_beta1 * (gj - mj);
  float vj = load_f(v, j);
  vj = vj * a.beta2 + (a.one_minus_beta2 * gj) * gj;
  float sj = bf16_to_float(p[j]) * a.decay;
  sj = sj + (a.neg_step_size * mj) / (std::sqrt(vj) * a.rbc2 + a.eps);
  pb = f_bits(sj);
  mb = f_bits(mj);
  vb = f_bits(vj);
}

template <typename M>
inline void store_moment(M* x, int64_t j, uint32_t bits, uint32_t r);
template <>
inline void store_moment<float>(float* x, int64_t j, uint32_t bits, uint32_t) { std::memcpy(x + j, &bits, 4); }
template <>
inline void store_moment<uint16_t>(uint16_t* x, int64_t j, uint32_t bits, uint32_t r) { x[j] = round_one(bits, r); }

template <typename G, typename M>
void adamw_pure_span(uint16_t* __restrict__ p, M* __restrict__ m, M* __restrict__ v, const G* __restrict__ g,
                     int64_t n, bool keyed, uint64_t kp, uint64_t km, uint64_t kv, int64_t offset, const AdamWArgs& a) {
  constexpr bool kMomBf16 = std::is_same<M, uint16_t>::value;
  auto scalar = [&](int64_t j) {
    uint32_t pb, mb, vb;
    adamw_pure_one(p, m, v, g, j, a, pb, mb, vb);
    const uint64_t i = static_cast<uint64_t>(offset + j);
    p[j] = round_one(pb, keyed ? bits_for(kp, i) : nearest_bits(pb));
    store_moment(m, j, mb, keyed ? bits_for(km, i) : nearest_bits(mb));
    store_moment(v, j, vb, keyed ? bits_for(kv, i) : nearest_bits(vb));
  };
  const int64_t head = std::min<int64_t>(n, (kChunk - offset % kChunk) % kChunk);
  for (int64_t j = 0; j < head; ++j) scalar(j);
  const int64_t chunks = (n - head) / kChunk;
  const int64_t first_block = (offset + head) / 4;
  auto fill = [&](uint16_t* r, uint64_t key, uint64_t q, const uint32_t* b) {
    if (keyed) {
      uint64_t h[8];
      hash8(key, q, h);
      std::memcpy(r, h, 64);
    } else {
      for (int k = 0; k < kChunk; ++k) r[k] = static_cast<uint16_t>(nearest_bits(b[k]));
    }
  };
  at::parallel_for(0, chunks, kGrain / 4, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t base = head + c * kChunk;
      // local restrict pointers: through the closure's captured pointers the compiler must assume
      // a store may change them, and leaves the store loops scalar
      uint16_t* __restrict__ pc = p + base;
      M* __restrict__ mc = m + base;
      M* __restrict__ vc = v + base;
      const G* __restrict__ gc = g + base;
      uint32_t pb[kChunk], mb[kChunk], vb[kChunk];
      for (int k = 0; k < kChunk; ++k) adamw_pure_one(pc, mc, vc, gc, k, a, pb[k], mb[k], vb[k]);
      const uint64_t q = static_cast<uint64_t>(first_block + c * 8);
      uint16_t r[kChunk];
      fill(r, kp, q, pb);
      for (int k = 0; k < kChunk; ++k) pc[k] = round_one(pb[k], r[k]);
      if (kMomBf16) {
        fill(r, km, q, mb);
        for (int k = 0; k < kChunk; ++k) store_moment(mc, k, mb[k], r[k]);
        fill(r, kv, q, vb);
        for (int k = 0; k < kChunk; ++k) store_moment(vc, k, vb[k], r[k]);
      } else {
        for (int k = 0; k < kChunk; ++k) store_moment(mc, k, mb[k], 0);
        for (int k = 0; k < kChunk; ++k) store_moment(vc, k, vb[k], 0);
      }
    }
  });
  for (int64_t j = head + chunks * kChunk; j < n; ++j) scalar(j);
}

template <typename G>
void adamw_pure_dispatch_m(at::Tensor& p, at::Tensor& m, at::Tensor& v, const G* g, bool keyed, uint64_t kp,
                           uint64_t km, uint64_t kv, int64_t offset, const AdamWArgs& a) {
  auto* pp = reinterpret_cast<uint16_t*>(p.data_ptr<at::BFloat16>());
  if (m.scalar_type() == at::kFloat) {
    adamw_pure_span(pp, m.data_ptr<float>(), v.data_ptr<float>(), g, p.numel(), keyed, kp, km, kv, offset, a);
  } else {
    adamw_pure_span(pp, reinterpret_cast<uint16_t*>(m.data_ptr<at::BFloat16>()),
                    reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>()), g, p.numel(), keyed, kp, km, kv, offset, a);
  }
}

AdamWArgs args_from(const std::vector<double>& c, size_t t, double grad_scale) {
  const double* x = c.data() + 8 * t;  // one row of dist_sr.numerics.fused.AdamWHyper.scalars() per tensor
  return AdamWArgs{static_cast<float>(x[0]), static_cast<float>(x[1]), static_cast<float>(x[2]),
                   static_cast<float>(x[3]), static_cast<float>(x[4]), static_cast<float>(x[5]),
                   static_cast<float>(x[6]), static_cast<float>(grad_scale)};
}

// Many tensors in one call. Shadow flavour (outs non-empty): p, m, v FP32, outs BF16. Pure flavour
// (outs empty): p BF16 updated in place, m and v both FP32 or both BF16. grads BF16 or FP32.
// consts: 8 doubles per tensor; keys: 3 per tensor (param, exp_avg, exp_avg_sq).
void adamw_many(std::vector<at::Tensor> ps, std::vector<at::Tensor> ms, std::vector<at::Tensor> vs,
                const std::vector<at::Tensor>& gs, std::vector<at::Tensor> outs, bool keyed,
                const std::vector<int64_t>& keys, const std::vector<int64_t>& offsets, const std::vector<double>& consts,
                double grad_scale) {
  const size_t count = ps.size();
  const bool pure = outs.empty();
  TORCH_CHECK(ms.size() == count && vs.size() == count && gs.size() == count && (pure || outs.size() == count) &&
                  keys.size() == 3 * count && offsets.size() == count && consts.size() == 8 * count,
              "dist_sr fused AdamW: list lengths differ");
  for (size_t t = 0; t < count; ++t) {
    const int64_t n = ps[t].numel();
    const auto md = ms[t].scalar_type();
    for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&ps[t], &ms[t], &vs[t], &gs[t]}) {
      TORCH_CHECK(x->device().is_cpu() && x->is_contiguous() && x->numel() == n,
                  "dist_sr fused AdamW: tensors must be contiguous CPU tensors of one numel");
    }
    TORCH_CHECK(vs[t].scalar_type() == md && (md == at::kFloat || (pure && md == at::kBFloat16)),
                "dist_sr fused AdamW: moments must both be float32 (or both bfloat16 for a BF16 parameter)");
    TORCH_CHECK(gs[t].scalar_type() == at::kFloat || gs[t].scalar_type() == at::kBFloat16,
                "dist_sr fused AdamW: grad must be float32 or bfloat16");
    TORCH_CHECK(ps[t].scalar_type() == (pure ? at::kBFloat16 : at::kFloat),
                "dist_sr fused AdamW: param must be float32 (with an out) or bfloat16 (updated in place)");
    const AdamWArgs a = args_from(consts, t, grad_scale);
    const uint64_t kp = static_cast<uint64_t>(keys[3 * t]), km = static_cast<uint64_t>(keys[3 * t + 1]),
                   kv = static_cast<uint64_t>(keys[3 * t + 2]);
    const bool g32 = gs[t].scalar_type() == at::kFloat;
    const auto* g16 = reinterpret_cast<const uint16_t*>(gs[t].data_ptr());
    if (pure) {
      if (g32) {
        adamw_pure_dispatch_m(ps[t], ms[t], vs[t], gs[t].data_ptr<float>(), keyed, kp, km, kv, offsets[t], a);
      } else {
        adamw_pure_dispatch_m(ps[t], ms[t], vs[t], g16, keyed, kp, km, kv, offsets[t], a);
      }
      continue;
    }
    TORCH_CHECK(outs[t].scalar_type() == at::kBFloat16 && outs[t].is_contiguous() && outs[t].numel() == n,
                "dist_sr fused AdamW: out must be a contiguous bfloat16 tensor of the shadow's numel");
    auto* o = reinterpret_cast<uint16_t*>(outs[t].data_ptr<at::BFloat16>());
    float *s = ps[t].data_ptr<float>(), *m = ms[t].data_ptr<float>(), *v = vs[t].data_ptr<float>();
    if (g32) {
      adamw_span(s, m, v, gs[t].data_ptr<float>(), o, n, keyed, kp, offsets[t], a);
    } else {
      adamw_span(s, m, v, g16, o, n, keyed, kp, offsets[t], a);
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("round_tensor", &round_tensor, "keyed or nearest FP32->BF16 rounding into out");
  m.def("round_tensors", &round_tensors, "round_tensor over lists, one call");
  m.def("round_rows", &round_rows, "keyed rounding of a strided shard given as rows of the full parameter");
  m.def("adamw_sr", &adamw_sr, "fused AdamW step on FP32 shadow/moments + keyed rounding into BF16 out");
  m.def("adamw_many", &adamw_many, "fused AdamW + keyed rounding over lists (FP32 shadows or pure BF16 params)");
}

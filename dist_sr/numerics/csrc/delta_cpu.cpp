// Grid-step delta coding of 16-bit weight versions (dist_sr.numerics.delta; the reference there is
// the specification, this is its fast path).
//
// A change is d = (new - old) mod 2^16 on the raw codes, read as a signed step s. Every change
// costs one sign bit (s < 0) and moves the held code by one step that way; a change with |s| > 1
// is also an escape: the LEB128 gap to it from the previous escape's index, then the rest
// r = s -+ 1 zigzag-coded minus one. Where the changes are is either a bitmap (bit i of the
// little-endian byte stream: element i changed) or the LEB128 gaps between changed indices
// (idx_j - idx_{j-1} - 1, with idx_{-1} = -1). The encoder reads each version once (AVX-512
// compares into masks); the sign stream, the gaps and the escapes are written from those masks in
// one short serial pass over n / 64 words. Applying walks the same masks and updates only the
// changed elements in place.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif
#if defined(__BMI2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGrain = 1 << 12;  // words per parallel task (256K elements)

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the bitmap is read as little-endian words");

// Masks of one 64-element word: changed, minus (s < 0), escape (changed, s not +-1).
inline void word_masks(const uint16_t* a, const uint16_t* b, int64_t len, uint64_t& m, uint64_t& q, uint64_t& e) {
#if defined(__AVX512BW__)
  if (len == 64) {
    const __m512i one = _mm512_set1_epi16(1), ones = _mm512_set1_epi16(-1);
    uint64_t mm = 0, qq = 0, pp = 0;
    for (int h = 0; h < 2; ++h) {
      const __m512i va = _mm512_loadu_si512(a + 32 * h), vb = _mm512_loadu_si512(b + 32 * h);
      const __m512i d = _mm512_sub_epi16(vb, va);
      mm |= uint64_t(_mm512_cmpneq_epi16_mask(va, vb)) << (32 * h);
      qq |= uint64_t(_mm512_movepi16_mask(d)) << (32 * h);
      pp |= uint64_t(_mm512_cmpeq_epi16_mask(d, one) | _mm512_cmpeq_epi16_mask(d, ones)) << (32 * h);
    }
    m = mm, q = qq, e = mm & ~pp;
    return;
  }
#endif
  m = q = e = 0;
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t d = uint16_t(b[j] - a[j]);
    m |= uint64_t(d != 0) << j;
    q |= uint64_t(d >> 15) << j;
    e |= uint64_t(d != 0 && d != 1 && d != 0xFFFF) << j;
  }
}

// The bits of x at the set positions of mask, packed to the low end.
inline uint64_t extract(uint64_t x, uint64_t mask) {
#if defined(__BMI2__)
  return _pext_u64(x, mask);
#else
  uint64_t r = 0;
  int k = 0;
  for (; mask; mask &= mask - 1, ++k) r |= ((x >> __builtin_ctzll(mask)) & 1u) << k;
  return r;
#endif
}

// The low popcount(mask) bits of x, spread to the set positions of mask.
inline uint64_t deposit(uint64_t x, uint64_t mask) {
#if defined(__BMI2__)
  return _pdep_u64(x, mask);
#else
  uint64_t r = 0;
  int k = 0;
  for (; mask; mask &= mask - 1, ++k) r |= ((x >> k) & 1u) << __builtin_ctzll(mask);
  return r;
#endif
}

// Appends bits to a little-endian bit stream.
struct BitWriter {
  uint8_t* out;
  int64_t pos = 0;  // bytes written
  uint64_t acc = 0;
  int fill = 0;
  void put(uint64_t bits, int count) {  // count <= 64
    if (count == 0) return;
    acc |= bits << fill;
    const int total = fill + count;
    if (total >= 64) {
      std::memcpy(out + pos, &acc, 8);
      pos += 8;
      acc = fill ? bits >> (64 - fill) : 0;
      fill = total - 64;
    } else {
      fill = total;
    }
  }
  void flush() {
    for (; fill > 0; fill -= 8, acc >>= 8) out[pos++] = uint8_t(acc);
    fill = 0;
  }
};

// Reads a little-endian bit stream of nbytes bytes; bits past the end read as 0.
struct BitReader {
  const uint8_t* in;
  int64_t nbytes;
  int64_t bit = 0;
  uint64_t take(int count) {  // count <= 64
    if (count == 0) return 0;
    const int64_t byte = bit >> 3;
    const int shift = int(bit & 7);
    uint64_t lo = 0, hi = 0;
    if (byte + 9 <= nbytes) {
      std::memcpy(&lo, in + byte, 8);
      hi = in[byte + 8];
    } else {
      uint8_t tmp[9] = {0};
      const int64_t avail = nbytes - byte;
      if (avail > 0) std::memcpy(tmp, in + byte, size_t(std::min<int64_t>(avail, 9)));
      std::memcpy(&lo, tmp, 8);
      hi = tmp[8];
    }
    uint64_t v = lo >> shift;
    if (shift) v |= hi << (64 - shift);
    bit += count;
    return count == 64 ? v : v & ((uint64_t(1) << count) - 1);
  }
};

inline int varint_len(uint64_t g) {
  int n = 1;
  while (g >= 0x80) g >>= 7, ++n;
  return n;
}

inline void put_varint(uint8_t* out, int64_t& at, uint64_t g) {
  while (g >= 0x80) out[at++] = uint8_t(g | 0x80), g >>= 7;
  out[at++] = uint8_t(g);
}

inline uint64_t get_varint(const uint8_t* in, int64_t nb, int64_t& at) {
  uint64_t g = 0;
  for (int s = 0;; s += 7) {
    TORCH_CHECK(at < nb && s < 64, "dist_sr delta: a truncated or overlong varint");
    const uint8_t byte = in[at++];
    g |= uint64_t(byte & 0x7F) << s;
    if (!(byte & 0x80)) return g;
  }
}

// The escape's rest r = s - sign(s) (non-zero), zigzag-coded minus one.
inline uint64_t escape_code(uint16_t d) {
  const int32_t s = int16_t(d), r = s > 0 ? s - 1 : s + 1;
  return (uint64_t(uint32_t(r) << 1) ^ uint64_t(int64_t(r >> 31) & 0xFFFFFFFF)) - 1;
}

inline uint16_t escape_rest(uint64_t z) {
  const uint64_t u = z + 1;
  return uint16_t((u & 1) ? ~(u >> 1) : (u >> 1));
}

const uint16_t* codes(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.element_size() == 2,
              "dist_sr delta: ", what, " must be a contiguous CPU tensor of 16-bit elements");
  return static_cast<const uint16_t*>(t.data_ptr());
}

// -> (positions uint8, signs uint8, escapes uint8, layout, changed, escape count).
// layout: 0 bitmap, 1 gaps; force < 0 picks the smaller.
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t> encode(const at::Tensor& old_t,
                                                                                    const at::Tensor& new_t,
                                                                                    int64_t force) {
  TORCH_CHECK(old_t.numel() == new_t.numel(), "dist_sr delta: the two versions differ in size (", old_t.numel(),
              " vs ", new_t.numel(), ")");
  const uint16_t* a = codes(old_t, "the old version");
  const uint16_t* b = codes(new_t, "the new version");
  const int64_t n = old_t.numel(), words = (n + 63) / 64;
  std::vector<uint64_t> m(words), q(words), e(words);
  std::vector<int64_t> block_changed((words + kGrain - 1) / kGrain), block_escapes(block_changed.size());
  at::parallel_for(0, int64_t(block_changed.size()), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      int64_t c = 0, x = 0;
      const int64_t w1 = std::min(words, (blk + 1) * kGrain);
      for (int64_t w = blk * kGrain; w < w1; ++w) {
        const int64_t len = std::min<int64_t>(64, n - 64 * w);
        word_masks(a + 64 * w, b + 64 * w, len, m[w], q[w], e[w]);
        c += __builtin_popcountll(m[w]);
        x += __builtin_popcountll(e[w]);
      }
      block_changed[blk] = c, block_escapes[blk] = x;
    }
  });
  int64_t changed = 0, escapes = 0;
  for (size_t i = 0; i < block_changed.size(); ++i) changed += block_changed[i], escapes += block_escapes[i];
  // one serial pass over the masks: signs, escapes and (when they could be smaller than the
  // bitmap) the gaps; then the smaller layout
  const int64_t bitmap_bytes = (n + 7) / 8;
  const bool try_gaps = force == 1 || (force < 0 && changed < bitmap_bytes);
  const auto u8 = at::TensorOptions().dtype(at::kByte);
  at::Tensor signs = at::empty({(changed + 7) / 8 + 8}, u8);  // 8 bytes of slack for whole-word stores
  at::Tensor esc = at::empty({13 * escapes}, u8);             // at most 10 + 3 varint bytes each
  std::vector<uint8_t> gaps(try_gaps ? size_t(changed + 1024) : 0);
  uint8_t* ep = esc.data_ptr<uint8_t>();
  BitWriter sw{signs.data_ptr<uint8_t>()};
  int64_t prev = -1, gp = 0, eat = 0, prev_escape = -1;
  for (int64_t w = 0; w < words; ++w) {
    const uint64_t mw = m[w];
    if (!mw) continue;
    sw.put(extract(q[w], mw), __builtin_popcountll(mw));
    for (uint64_t x = e[w]; x; x &= x - 1) {
      const int64_t i = 64 * w + __builtin_ctzll(x);
      put_varint(ep, eat, uint64_t(i - prev_escape - 1));
      put_varint(ep, eat, escape_code(uint16_t(b[i] - a[i])));
      prev_escape = i;
    }
    if (try_gaps) {
      if (gp + 64 * 10 > int64_t(gaps.size())) gaps.resize(2 * gaps.size() + 64 * 10);
      uint8_t* gw = gaps.data();
      for (uint64_t x = mw; x; x &= x - 1) {
        const int64_t i = 64 * w + __builtin_ctzll(x);
        const uint64_t g = uint64_t(i - prev - 1);
        prev = i;
        if (g < 0x80) gw[gp++] = uint8_t(g);
        else put_varint(gw, gp, g);
      }
    }
  }
  sw.flush();
  const int64_t layout = force >= 0 ? force : (try_gaps && gp < bitmap_bytes ? 1 : 0);
  at::Tensor positions = at::empty({layout == 0 ? bitmap_bytes : gp}, u8);
  if (positions.numel()) std::memcpy(positions.data_ptr<uint8_t>(), layout == 0 ? static_cast<const void*>(m.data())
                                                                                : static_cast<const void*>(gaps.data()),
                                     size_t(positions.numel()));
  return {positions, signs.narrow(0, 0, (changed + 7) / 8), esc.narrow(0, 0, eat).clone(), layout, changed, escapes};
}

// Applies a delta to held (in place). Checks the structure (counts, ranges); a delta that passes
// them but was damaged yields other weights, which the sync's digest catches.
void apply(at::Tensor held, int64_t layout, const at::Tensor& positions, const at::Tensor& signs,
           const at::Tensor& escapes, int64_t changed, int64_t n_escapes) {
  uint16_t* h = const_cast<uint16_t*>(codes(held, "the held version"));
  TORCH_CHECK(positions.is_contiguous() && positions.dtype() == at::kByte && signs.is_contiguous() &&
                  signs.dtype() == at::kByte && escapes.is_contiguous() && escapes.dtype() == at::kByte &&
                  n_escapes >= 0 && n_escapes <= changed,
              "dist_sr delta: malformed delta (field types)");
  const int64_t n = held.numel();
  TORCH_CHECK(signs.numel() == (changed + 7) / 8, "dist_sr delta: ", signs.numel(), " sign bytes for ", changed,
              " changes");
  const uint8_t* p = positions.data_ptr<uint8_t>();
  BitReader sr{signs.data_ptr<uint8_t>(), signs.numel()};
  int64_t seen = 0;
  if (layout == 0) {
    TORCH_CHECK(positions.numel() == (n + 7) / 8, "dist_sr delta: a bitmap of ", positions.numel(), " bytes for ", n,
                " elements");
    const int64_t words = (n + 63) / 64;
    for (int64_t w = 0; w < words; ++w) {
      const int64_t len = std::min<int64_t>(64, n - 64 * w);
      uint64_t mw = 0;
      std::memcpy(&mw, p + 8 * w, size_t((len + 7) / 8));
      if (len < 64) TORCH_CHECK((mw >> len) == 0, "dist_sr delta: bitmap bits past the last element");
      if (!mw) continue;
      const int c = __builtin_popcountll(mw);
      seen += c;
      TORCH_CHECK(seen <= changed, "dist_sr delta: the bitmap marks more than ", changed, " changes");
      const uint64_t minus = deposit(sr.take(c), mw), plus = mw & ~minus;
      uint16_t* hw = h + 64 * w;
#if defined(__AVX512BW__)
      if (len == 64) {
        const __m512i one = _mm512_set1_epi16(1);
        for (int k = 0; k < 2; ++k) {
          __m512i v = _mm512_loadu_si512(hw + 32 * k);
          v = _mm512_mask_add_epi16(v, __mmask32(plus >> (32 * k)), v, one);
          v = _mm512_mask_sub_epi16(v, __mmask32(minus >> (32 * k)), v, one);
          _mm512_storeu_si512(hw + 32 * k, v);
        }
        continue;
      }
#endif
      for (uint64_t x = mw; x; x &= x - 1) {
        const int j = __builtin_ctzll(x);
        hw[j] = uint16_t(hw[j] + (((minus >> j) & 1u) ? 0xFFFFu : 1u));
      }
    }
  } else {
    TORCH_CHECK(layout == 1, "dist_sr delta: unknown layout ", layout);
    const int64_t nb = positions.numel();
    int64_t i = -1, at = 0;
    uint64_t sbuf = 0;
    int sleft = 0;
    while (at < nb) {
      const uint8_t first = p[at];
      uint64_t g;
      if (first < 0x80) g = first, ++at;
      else g = get_varint(p, nb, at);
      if (g >= uint64_t(n - 1 - i)) TORCH_CHECK(false, "dist_sr delta: a change past the last element");
      i += 1 + int64_t(g);
      if (sleft == 0) {
        if (seen >= changed) TORCH_CHECK(false, "dist_sr delta: more than ", changed, " gaps");
        sleft = int(std::min<int64_t>(64, changed - seen));
        sbuf = sr.take(sleft);
      }
      h[i] = uint16_t(h[i] + ((sbuf & 1u) ? 0xFFFFu : 1u));
      sbuf >>= 1, --sleft, ++seen;
    }
    if (sleft) TORCH_CHECK(false, "dist_sr delta: ", seen, " changes where the header says ", changed);
  }
  TORCH_CHECK(seen == changed, "dist_sr delta: ", seen, " changes where the header says ", changed);
  if (changed % 8)
    TORCH_CHECK((signs.data_ptr<uint8_t>()[changed / 8] >> (changed % 8)) == 0,
                "dist_sr delta: sign bits past the last change");
  const uint8_t* ep = escapes.data_ptr<uint8_t>();
  const int64_t eb = escapes.numel();
  int64_t at = 0, i = -1;
  for (int64_t k = 0; k < n_escapes; ++k) {
    const uint64_t g = get_varint(ep, eb, at);
    TORCH_CHECK(g < uint64_t(n) && i + 1 + int64_t(g) < n, "dist_sr delta: an escape past the last element");
    i += 1 + int64_t(g);
    const uint64_t z = get_varint(ep, eb, at);
    TORCH_CHECK(z < 0xFFFF, "dist_sr delta: an escape beyond the 16-bit range");
    h[i] = uint16_t(h[i] + escape_rest(z));
  }
  TORCH_CHECK(at == eb, "dist_sr delta: ", eb - at, " bytes after the last escape");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode", &encode, "grid-step delta of two 16-bit versions");
  m.def("apply", &apply, "apply a grid-step delta in place");
}

/* Vector helpers shared by the engine's C kernels: 16-float vectors (GCC/Clang vector
   extensions, mapped by the compiler to AVX-512, AVX2 or whatever the CPU has), a lane select
   and a vector exp. Part of tinker_sr (engine/native.py). */
#ifndef TSR_VEC_H
#define TSR_VEC_H
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define VL 16

static inline v16 vload(const float *p) { return *(const v16 *)p; }
static inline void vstore(float *p, v16 x) { *(v16 *)p = x; }
static inline v16 vset1(float x) { return (v16){x,x,x,x,x,x,x,x,x,x,x,x,x,x,x,x}; }

/* x exactly as computed: an empty asm that "may change" x in memory, so the compiler cannot
   fuse the operation that made x into a later add (GNU C contracts a * b + c into one fused
   multiply-add, rounded once: a sum that must equal two separate ops needs the barrier). */
static inline v16 vkeep(v16 x) { __asm__("" : "+m"(x)); return x; }
static inline float fkeep(float x) { __asm__("" : "+m"(x)); return x; }

typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
static inline v16 vsel(vi16 mask, v16 a, v16 b) { /* mask ? a : b, lane-wise */
  return (v16)(((vi16)a & mask) | ((vi16)b & ~mask));
}
/* exp for a vector, |rel err| ~ 2e-7 (Cephes expf): a clamp to [lo, hi], n = round(x / ln 2),
   a degree-7 polynomial in r = x - n ln 2 (ln 2 in two parts), times 2^n. NaN stays NaN.
   With AVX-512 the clamps are min/max and 2^n is one vscalefps (14 instructions instead of 31:
   the exp pass of a softmax ran in 0.57 instead of 0.86 ms per 256 x 32,000 chunk), and
   results below FLT_MIN are subnormals as torch's exp gives them; values are otherwise
   bit-identical to the generic version (the same operations in the same order, rounded at the
   same points as GCC contracts the generic one), which flushes them to 0 (x < -87.3). Above
   88.72 both give +inf, as expf does (a silu or sigmoid of a gate under -88.7 is then -0 and
   0, as torch's; the generic version clamps 88.38-88.72 to 2.4e38). */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline v16 vexp(v16 x) {
  /* max/min return their second operand when either is NaN: x goes second. -110: 2^n then
     rounds to 0 whatever the polynomial (exp(-inf) is exactly 0). */
  __m512 v = _mm512_max_ps(_mm512_set1_ps(-110.0f), (__m512)x);
  v = _mm512_min_ps(_mm512_set1_ps(100.0f), v); /* over 88.72: 2^n overflows to inf, as expf */
  const __m512 magic = _mm512_set1_ps(12582912.0f); /* 1.5 * 2^23: round to nearest */
  __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), magic), magic);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.0f));
  return (v16)_mm512_scalef_ps(y, n);
}
#else
static inline v16 vexp(v16 x) {
  const v16 hi = vset1(88.3762626647949f), lo = vset1(-87.3365478515625f);
  v16 xc = vsel(x > hi, hi, vsel(x < lo, lo, x));
  v16 fx = xc * vset1(1.44269504088896341f);
  const v16 magic = vset1(12582912.0f); /* 1.5 * 2^23: round to nearest */
  v16 n = (fx + magic) - magic;
  v16 r = xc - n * vset1(0.693359375f) + n * vset1(2.12194440e-4f);
  v16 y = vset1(1.9875691500E-4f);
  y = y * r + vset1(1.3981999507E-3f);
  y = y * r + vset1(8.3334519073E-3f);
  y = y * r + vset1(4.1665795894E-2f);
  y = y * r + vset1(1.6666665459E-1f);
  y = y * r + vset1(5.0000001201E-1f);
  y = y * r * r + r + vset1(1.0f);
  vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  v16 e = vsel(x < lo, vset1(0.f), y * (v16)bits);
  return vsel(x > vset1(88.72283935546875f), vset1(__builtin_inff()), e); /* expf overflows */
}
#endif

/* Horizontal max / sum of a vector's lanes (a fixed tree order). */
static inline float vhmax(v16 x) {
  v16 y = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = vsel(y > x, y, x);
  y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x = vsel(y > x, y, x);
  y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x = vsel(y > x, y, x);
  y = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  x = vsel(y > x, y, x);
  return x[0];
}
static inline float vhsum(v16 x) {
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}

/* bfloat16 <-> float: a bfloat16 is the upper half of a float. Rounding to nearest even, and
   NaN to 0x7FC0, as torch's conversion (c10::BFloat16). With AVX512_BF16 a vector whose lanes
   are all neither NaN nor subnormal converts in one instruction (VCVTNEPS2BF16: the same
   rounding, but it flushes subnormal inputs to zero and keeps a NaN's sign, so those vectors
   take the arithmetic form): the same bits either way, ~25 % off the bf16 kernels' time. */
typedef uint16_t vh16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vu16 __attribute__((vector_size(64), aligned(4)));
static inline v16 vload_bf16(const uint16_t *p) {
  return (v16)(__builtin_convertvector(*(const vh16 *)p, vu16) << 16);
}
static inline vh16 vto_bf16(v16 x) {
#if defined(__AVX512BF16__)
  if (__builtin_expect(_mm512_fpclass_ps_mask((__m512)x, 0xA1) == 0, 1)) /* NaN, subnormal */
    return (vh16)_mm512_cvtneps_pbh((__m512)x);
#endif
  vu16 u = (vu16)x, nan = (vu16)(x != x);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return __builtin_convertvector((u & ~nan) | (0x7FC0u & nan), vh16);
}
static inline void vstore_bf16(uint16_t *p, v16 x) { *(vh16 *)p = vto_bf16(x); }
static inline float bf16_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t float_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return f != f ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* x rounded to the nearest bfloat16 (ties to even), kept as a float: the value a store to
   bfloat16 and a load back would give. */
static inline v16 vround_bf16(v16 x) {
  return (v16)(__builtin_convertvector(vto_bf16(x), vu16) << 16);
}

/* Element `j` past `p` (a float or a bfloat16 array) as 16 floats / stored from them. */
static inline __attribute__((always_inline)) v16 vload_as(const void *p, int64_t j, int bf16) {
  return bf16 ? vload_bf16((const uint16_t *)p + j) : vload((const float *)p + j);
}
static inline __attribute__((always_inline)) void vstore_as(void *p, int64_t j, v16 x, int bf16) {
  if (bf16)
    vstore_bf16((uint16_t *)p + j, x);
  else
    vstore((float *)p + j, x);
}

#endif

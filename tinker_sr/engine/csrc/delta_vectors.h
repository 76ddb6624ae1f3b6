/* Vectors for the gated delta rule's backward (csrc/delta_rule.c): GCC's and clang's vector
   extensions at the CPU's own width, 64 bytes with AVX-512 and 32 otherwise (the build is
   -march=native), loads and stores, two-input shuffles and vsums, the sums of a vector's lanes
   of vectors at once. Part of tinker_sr (engine/native.py builds it into delta_rule's
   library). */
#ifndef TSR_DELTA_VECTORS_H
#define TSR_DELTA_VECTORS_H
#include <stdint.h>
#include <string.h>

#define VINLINE static inline __attribute__((always_inline))

#ifdef TSR_RULE_VECTOR_BYTES /* a test's build of the other width */
#define VBYTES TSR_RULE_VECTOR_BYTES
#elif defined(__AVX512F__)
#define VBYTES 64
#else
#define VBYTES 32
#endif
#define MOST_VECTORS (512 / VBYTES) /* a row of 128 float32 */
#if defined(__x86_64__) || defined(__i386__)
#define KEEP_IN_REGISTER(x) __asm__("" : "+v"(x))
#else /* the vectors run on x86 only (AVX2, AVX-512) */
#define KEEP_IN_REGISTER(x) (void)(x)
#endif
#define DEFINE_VECTORS(T, SUF)                                                                 \
  typedef T vec_##SUF __attribute__((vector_size(VBYTES)));                                    \
  enum { LANES_##SUF = VBYTES / sizeof(T) };                                                   \
  VINLINE vec_##SUF vload_##SUF(const T *p) {                                                  \
    vec_##SUF x;                                                                               \
    memcpy(&x, p, sizeof x);                                                                   \
    return x;                                                                                  \
  }                                                                                            \
  VINLINE void vstore_##SUF(T *p, vec_##SUF x) { memcpy(p, &x, sizeof x); }                    \
  /* x as computed: GNU C contracts a * b + c into one fused multiply-add, and with two        \
     products in a sum it may fuse either; an empty asm holding x in a register (no            \
     instruction) keeps x's product rounded on its own, as a separate step rounds it */        \
  VINLINE vec_##SUF vround_##SUF(vec_##SUF x) {                                                \
    KEEP_IN_REGISTER(x);                                                                       \
    return x;                                                                                  \
  }

DEFINE_VECTORS(float, f32)
DEFINE_VECTORS(double, f64)

/* SHUFFLE2(SUF, a, b, i...): lane j is (a's lanes, then b's)[i_j]. */
typedef int32_t mask_f32 __attribute__((vector_size(VBYTES)));
typedef int64_t mask_f64 __attribute__((vector_size(VBYTES)));
#if defined(__clang__)
#define SHUFFLE2(SUF, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE2(SUF, a, b, ...) __builtin_shuffle(a, b, (mask_##SUF){__VA_ARGS__})
#endif

/* Lane i: the sum of x[i]'s lanes, for x[0 .. lanes - 1] (16 float32 or 8 float64 at 64
   bytes, 8 or 4 at 32): a transposing tree (pairs of vectors to one of half-rows each, then
   quarter-rows, ...; a fixed order), its lanes in bit-reversed row order put back by a last
   shuffle: ~3 operations per row where summing each row's lanes alone takes ~8. */

/* vsums for vectors of 8 lanes (float64 at 64 bytes, float32 at 32) */
#define DEFINE_VSUMS8(SUF)                                                                     \
  VINLINE vec_##SUF vsums_##SUF(const vec_##SUF *x) {                                          \
    vec_##SUF y[4], z[2], f;                                                                   \
    for (int p = 0; p < 4; p++)                                                                \
      y[p] = SHUFFLE2(SUF, x[2 * p], x[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11) +                 \
             SHUFFLE2(SUF, x[2 * p], x[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15);                \
    for (int p = 0; p < 2; p++)                                                                \
      z[p] = SHUFFLE2(SUF, y[2 * p], y[2 * p + 1], 0, 1, 8, 9, 4, 5, 12, 13) +                 \
             SHUFFLE2(SUF, y[2 * p], y[2 * p + 1], 2, 3, 10, 11, 6, 7, 14, 15);                \
    f = SHUFFLE2(SUF, z[0], z[1], 0, 8, 2, 10, 4, 12, 6, 14) +                                 \
        SHUFFLE2(SUF, z[0], z[1], 1, 9, 3, 11, 5, 13, 7, 15);                                  \
    return SHUFFLE2(SUF, f, f, 0, 4, 2, 6, 1, 5, 3, 7);                                        \
  }

#if VBYTES == 64
VINLINE vec_f32 vsums_f32(const vec_f32 *x) {
  vec_f32 y[8], z[4], w[2], f;
  for (int p = 0; p < 8; p++)
    y[p] = SHUFFLE2(f32, x[2 * p], x[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                    22, 23) +
           SHUFFLE2(f32, x[2 * p], x[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                    29, 30, 31);
  for (int p = 0; p < 4; p++)
    z[p] = SHUFFLE2(f32, y[2 * p], y[2 * p + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25,
                    26, 27) +
           SHUFFLE2(f32, y[2 * p], y[2 * p + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                    30, 31);
  for (int p = 0; p < 2; p++)
    w[p] = SHUFFLE2(f32, z[2 * p], z[2 * p + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                    28, 29) +
           SHUFFLE2(f32, z[2 * p], z[2 * p + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                    30, 31);
  f = SHUFFLE2(f32, w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
      SHUFFLE2(f32, w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return SHUFFLE2(f32, f, f, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

DEFINE_VSUMS8(f64)
#else /* 32 bytes */
DEFINE_VSUMS8(f32)

VINLINE vec_f64 vsums_f64(const vec_f64 *x) {
  vec_f64 y[2], f;
  for (int p = 0; p < 2; p++)
    y[p] = SHUFFLE2(f64, x[2 * p], x[2 * p + 1], 0, 1, 4, 5) +
           SHUFFLE2(f64, x[2 * p], x[2 * p + 1], 2, 3, 6, 7);
  f = SHUFFLE2(f64, y[0], y[1], 0, 4, 2, 6) + SHUFFLE2(f64, y[0], y[1], 1, 5, 3, 7);
  return SHUFFLE2(f64, f, f, 0, 2, 1, 3);
}
#endif

#endif

/* Qwen3's per-head q/k RMSNorm + RoPE, one (batch, position, head) row at a time, for rows.c
   (float32 activations) and rows_bf16.c (bf16 ones, `bf16` != 0: read and written as
   bfloat16, computed in float32). Always inlined with a constant `bf16`, each file's
   parallel loop gets its own code; float32 rows compute exactly what they did before the
   bf16 kernels shared this code.

   The rows read (and write) one (batch, position)'s heads at a time: a slice of a q/k/v
   projection row, whose rows lie 4 KB or more apart, so every row starts a new page and the
   hardware's stream prefetch, which stays inside a page, found nothing to follow: they ran at
   ~22 GB/s. Each row's slice is prefetched ROW_AHEAD rows before it is used (measured, 16 x
   256 x 8 heads of 64: forward ~650 -> ~300 us, backward ~1060 -> ~650 us). */
#ifndef TSR_NORM_ROPE_H
#define TSR_NORM_ROPE_H
#include <math.h>
#include <stdint.h>

#include "vec.h"

#define ROW_AHEAD 2
#define MAX_HEAD_DIM 1024 /* the gradient's per-row buffer (engine/bf16_rows.py checks) */

/* Row i = (b, t, h) of tsr_norm_rope[_bf16] (see rows.c): optionally RMS-normalised (w !=
   NULL; r[i] gets the row's scale; bf16 rounds the normalised row to bf16 before the gain, as
   HF's RMSNorm casts back to the input's dtype), then rotated, into y [B, H, T, D]. */
static inline __attribute__((always_inline)) void norm_rope_row(
    int64_t i, const void *x, int64_t ld_outer, int64_t ld_inner, const float *w, float eps,
    const float *cos, const float *sin, void *y, float *r, int64_t B, int T, int H, int D,
    int bf16) {
  const int half = D / 2, line = bf16 ? 32 : 16; /* elements per 64-byte line */
  int64_t o = i / H, b = o / T;
  int h = (int)(i % H), t = (int)(o % T);
  int64_t xi = o * ld_outer + h * ld_inner, yi = ((b * H + h) * T + t) * D;
  const float *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
  if (h == 0 && o + ROW_AHEAD < B * T) /* see ROW_AHEAD */
    for (int j = 0; j < H * D; j += line)
      __builtin_prefetch((const char *)x + (xi + ROW_AHEAD * ld_outer + j) * (bf16 ? 2 : 4), 0, 3);
  v16 rv = vset1(1.f);
  if (w) {
    v16 acc = vset1(0.f);
    for (int j = 0; j < D; j += VL) {
      v16 v = vload_as(x, xi + j, bf16);
      acc += v * v;
    }
    float ri = 1.0f / sqrtf(vhsum(acc) / (float)D + eps);
    r[i] = ri;
    rv = vset1(ri);
  }
  for (int j = 0; j < half; j += VL) {
    v16 x1 = vload_as(x, xi + j, bf16) * rv, x2 = vload_as(x, xi + half + j, bf16) * rv;
    if (w) {
      if (bf16) {
        x1 = vround_bf16(x1);
        x2 = vround_bf16(x2);
      }
      x1 *= vload(w + j);
      x2 *= vload(w + half + j);
    }
    v16 cj = vload(c + j), sj = vload(s + j);
    vstore_as(y, yi + j, x1 * cj - x2 * sj, bf16);
    vstore_as(y, yi + half + j, x2 * cj + x1 * sj, bf16);
  }
}

/* Row i of tsr_norm_rope_backward[_bf16] (see rows.c): the inverse rotation of g's row in
   float32, then, with w, RMSNorm's input gradient, into dx's row (rounded once for bf16). */
static inline __attribute__((always_inline)) void norm_rope_grad_row(
    int64_t i, const void *g, const void *x, int64_t ld_outer, int64_t ld_inner, const float *w,
    const float *r, const float *cos, const float *sin, void *dx, int64_t dx_outer,
    int64_t dx_inner, int64_t B, int T, int H, int D, int bf16) {
  const int half = D / 2, line = bf16 ? 32 : 16, size = bf16 ? 2 : 4;
  int64_t o = i / H, b = o / T;
  int h = (int)(i % H), t = (int)(o % T);
  int64_t gi = ((b * H + h) * T + t) * D, di = o * dx_outer + h * dx_inner;
  const float *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
  if (h == 0 && o + ROW_AHEAD < B * T) { /* see ROW_AHEAD */
    for (int j = 0; j < H * D; j += line)
      __builtin_prefetch((char *)dx + (di + ROW_AHEAD * dx_outer + j) * size, 1, 3);
    if (t + ROW_AHEAD < T) /* g's H streams (one per head), too many for the hardware */
      for (int hh = 0; hh < H; hh++)
        for (int j = 0; j < D; j += line)
          __builtin_prefetch((const char *)g + (((b * H + hh) * T + t + ROW_AHEAD) * D + j) * size, 0, 3);
    if (w)
      for (int j = 0; j < H * D; j += line)
        __builtin_prefetch((const char *)x + ((o + ROW_AHEAD) * ld_outer + j) * size, 0, 3);
  }
  float u[MAX_HEAD_DIM] __attribute__((aligned(64)));
  for (int j = 0; j < half; j += VL) {
    v16 g1 = vload_as(g, gi + j, bf16), g2 = vload_as(g, gi + half + j, bf16);
    v16 cj = vload(c + j), sj = vload(s + j);
    vstore(u + j, g1 * cj + g2 * sj);
    vstore(u + half + j, g2 * cj - g1 * sj);
  }
  if (!w) {
    for (int j = 0; j < D; j += VL) vstore_as(dx, di + j, vload(u + j), bf16);
    return;
  }
  int64_t xi = o * ld_outer + h * ld_inner;
  v16 rv = vset1(r[i]), acc = vset1(0.f);
  for (int j = 0; j < D; j += VL) acc += (vload(u + j) * vload(w + j)) * (vload_as(x, xi + j, bf16) * rv);
  v16 mv = vset1(vhsum(acc) / (float)D);
  for (int j = 0; j < D; j += VL)
    vstore_as(dx, di + j, ((vload(u + j) * vload(w + j)) - (vload_as(x, xi + j, bf16) * rv) * mv) * rv, bf16);
}

#endif

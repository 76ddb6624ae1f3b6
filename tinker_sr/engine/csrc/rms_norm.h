/* RMSNorm rows for rows.c (float32) and rows_bf16.c (bf16 mixed precision: a bf16 sublayer
   output added to the float32 residual stream, the normalised row written in bf16, its
   gradient read in bf16). Always inlined with constant dtype flags: each kernel gets its own
   loop, and the float32 ones compute exactly what they did before the bf16 ones shared this
   code. A bf16 operand converts exactly to float32 and a bf16 result is the float32 one rounded
   once, so the bf16 kernels give the float32 kernels' values on the widened operands. */
#ifndef TSR_RMS_NORM_H
#define TSR_RMS_NORM_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vec.h"

static inline __attribute__((always_inline)) float scalar_as(const void *p, int64_t j, int bf16) {
  return bf16 ? bf16_float(((const uint16_t *)p)[j]) : ((const float *)p)[j];
}
static inline __attribute__((always_inline)) void scalar_store_as(void *p, int64_t j, float x,
                                                                  int bf16) {
  if (bf16)
    ((uint16_t *)p)[j] = float_bf16(x);
  else
    ((float *)p)[j] = x;
}

/* Row i: out = x r w, r = 1 / sqrt(mean(x^2) + eps) written to r[i]; with y, h = x + y first
   (written to h, and normalised). */
static inline __attribute__((always_inline)) void rms_norm_unit(
    int64_t i, const float *x, const void *y, const float *w, float *h, void *out, float *r,
    int n, float eps, int y_bf16, int out_bf16) {
  const float *xi = x + i * n;
  int64_t row = i * n;
  if (y) {
    float *hi = h + row;
    int j = 0;
    for (; j + VL <= n; j += VL) vstore(hi + j, vload(xi + j) + vload_as(y, row + j, y_bf16));
    for (; j < n; j++) hi[j] = xi[j] + scalar_as(y, row + j, y_bf16);
    xi = hi;
  }
  v16 acc = vset1(0.f);
  int j = 0;
  for (; j + VL <= n; j += VL) {
    v16 v = vload(xi + j);
    acc += v * v;
  }
  float ss = vhsum(acc);
  /* The tails (n % 16 != 0) keep every product whole (`fkeep`): whether the compiler fuses a
     product into the sum after it may differ between the float32 and bf16 copies of this code,
     and the two must agree bit for bit. */
  for (; j < n; j++) ss += fkeep(xi[j] * xi[j]);
  float ri = 1.0f / sqrtf(ss / (float)n + eps);
  v16 rv = vset1(ri);
  for (j = 0; j + VL <= n; j += VL) vstore_as(out, row + j, vload(xi + j) * rv * vload(w + j), out_bf16);
  for (; j < n; j++) scalar_store_as(out, row + j, xi[j] * ri * w[j], out_bf16);
  r[i] = ri;
}

/* Row i of dx = r (g w - x r mean(g w x r)), plus `add` (the residual path's gradient) where
   given, as autograd would sum the two: each product is kept whole before the sum (`vkeep`),
   so no fused multiply-add changes its rounding. dx_low (optional): dx rounded to bf16 too. */
static inline __attribute__((always_inline)) void rms_norm_grad_unit(
    int64_t i, const void *g, const float *x, const float *w, const float *r, const float *add,
    float *dx, uint16_t *dx_low, int n, int g_bf16) {
  int64_t row = i * n;
  const float *xi = x + row, *ai = add ? add + row : NULL;
  float *di = dx + row;
  float ri = r[i];
  v16 rv = vset1(ri), acc = vset1(0.f);
  int j = 0;
  for (; j + VL <= n; j += VL) acc += (vload_as(g, row + j, g_bf16) * vload(w + j)) * (vload(xi + j) * rv);
  float dot = vhsum(acc);
  for (; j < n; j++) dot += fkeep((scalar_as(g, row + j, g_bf16) * w[j]) * (xi[j] * ri));
  float mean = dot / (float)n;
  v16 mv = vset1(mean);
  for (j = 0; j + VL <= n; j += VL) {
    v16 d = ((vload_as(g, row + j, g_bf16) * vload(w + j)) - (vload(xi + j) * rv) * mv) * rv;
    d = ai ? vkeep(d) + vload(ai + j) : d;
    vstore(di + j, d);
    if (dx_low) vstore_bf16(dx_low + row + j, d);
  }
  for (; j < n; j++) {
    float d = (fkeep(scalar_as(g, row + j, g_bf16) * w[j]) - fkeep((xi[j] * ri) * mean)) * ri;
    di[j] = ai ? fkeep(d) + ai[j] : d;
    if (dx_low) dx_low[row + j] = float_bf16(di[j]);
  }
}

#endif

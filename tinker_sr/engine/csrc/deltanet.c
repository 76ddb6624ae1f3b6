/* The passes of Qwen3.5's gated DeltaNet layer around its rule (which is csrc/delta_rule.c),
   in float32 for a CPU, forward and backward. Part of tinker_sr (engine/native.py builds it
   with the machine's C compiler at first use; engine/delta_native.py calls it).

   The short causal convolution and its SiLU:
   out[b, t, c] = silu(sum_j w[j, c] x[b, t - (K - 1) + j, c]), positions before the first
   read from `init` (a decode cache's window of the last K - 1 inputs) or zero. torch runs this
   as a depthwise conv1d over [B, C, T]: the layer's q/k/v projection output [B, T, C] is
   transposed and padded into a copy, convolved, passed through silu, and transposed back for
   the heads, and backward makes the same trips the other way, its silu gradient over
   transposed strides (~6 ms a layer at 8 x 256 x 1024 channels, a tenth of that on contiguous
   rows). Here every pass reads and writes [B, T, C] rows as the projections lay them out.
   Parallel over units of TB positions of one batch row, each computed whole by one thread in
   a fixed order: results do not depend on the thread count or the schedule. Backward
   recomputes each unit's pre-activations (K multiply-adds an element) rather than keeping
   them: the gradient of the pre-activation for the unit's positions and the K - 1 after
   (which the unit's input gradients read) goes to a per-unit buffer. The weight's gradient is
   not formed (the engine never trains the convolution: LoRA adapts linear layers only).
   Layouts (float32, C-contiguous): x, out, dout, dx [B, T, C]; w [K, C] (the conv1d weight
   [C, 1, K] transposed); init [B, K - 1, C] or NULL (zeros).

   The gated RMSNorm over each value head's output y (n values a row):
   out = w * (y / sqrt(mean(y^2) + eps)) * silu(z), one pass a row where torch's eager form makes
   ~8 forward and ~12 backward passes over the [B, T, H, n] tensors, each a parallel region.
   y is read (and its gradient written) through strides, so the rule's heads-major output is
   normalised in place of a transposed copy; z, out and their gradients are contiguous. The
   weight's gradient is not formed (frozen, as the convolution's). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define TB 64 /* positions per unit */

/* Unit u's batch row b and positions [t0, t1) (per_row units of TB positions a row). */
static inline void unit_range(int64_t u, int64_t per_row, int64_t T, int64_t *b, int64_t *t0,
                              int64_t *t1) {
  *b = u / per_row;
  *t0 = (u % per_row) * TB;
  *t1 = *t0 + TB < T ? *t0 + TB : T;
}

static inline float sigmoid1(float y) { return 1.f / (1.f + expf(-y)); }
static inline v16 vsigmoid1(v16 y) { return vset1(1.f) / (vset1(1.f) + vexp(-y)); }

/* Row s of the input, s >= -(K - 1): x's own, the window's for s < 0, or NULL (zeros). */
static inline const float *input_row(const float *xb, const float *ib, int64_t s, int64_t C,
                                     int K) {
  if (s >= 0) return xb + s * C;
  return ib ? ib + (s + K - 1) * C : NULL;
}

/* pre[c] = sum_j w[j, c] x[t - (K - 1) + j, c] for one position t of one batch row. */
static void pre_activation(const float *xb, const float *ib, const float *w, int64_t t,
                           int64_t C, int K, float *pre) {
  const float *rows[16];
  for (int j = 0; j < K; j++) rows[j] = input_row(xb, ib, t - (K - 1) + j, C, K);
  int64_t c = 0;
  for (; c + VL <= C; c += VL) {
    v16 acc = vset1(0.f);
    for (int j = 0; j < K; j++)
      if (rows[j]) acc += vload(w + (int64_t)j * C + c) * vload(rows[j] + c);
    vstore(pre + c, acc);
  }
  for (; c < C; c++) {
    float acc = 0.f;
    for (int j = 0; j < K; j++)
      if (rows[j]) acc += w[(int64_t)j * C + c] * rows[j][c];
    pre[c] = acc;
  }
}

void tsr_short_conv_silu_fwd(const float *x, const float *w, const float *init, float *out,
                             int64_t B, int64_t T, int64_t C, int K, int threads) {
  int64_t per_row = (T + TB - 1) / TB, units = B * per_row;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t u = 0; u < units; u++) {
    int64_t b, t0, t1;
    unit_range(u, per_row, T, &b, &t0, &t1);
    const float *xb = x + b * T * C, *ib = init ? init + b * (int64_t)(K - 1) * C : NULL;
    for (int64_t t = t0; t < t1; t++) {
      float *o = out + (b * T + t) * C;
      pre_activation(xb, ib, w, t, C, K, o);
      int64_t c = 0;
      for (; c + VL <= C; c += VL) {
        v16 y = vload(o + c);
        vstore(o + c, y * vsigmoid1(y));
      }
      for (; c < C; c++) o[c] = o[c] * sigmoid1(o[c]);
    }
  }
}

/* dx for x's positions [t0, t1) of batch row b: dx[t, c] = sum_j w[j, c] g[t + (K - 1) - j, c]
   over the positions t + (K - 1) - j < T, with g the pre-activation's gradient, formed into
   `g` (rows t0 .. t1 + K - 2) from dout and the recomputed pre-activations. */
static void backward_unit(const float *xb, const float *w, const float *doutb, float *dxb,
                          int64_t t0, int64_t t1, int64_t T, int64_t C, int K, float *g) {
  int64_t g1 = t1 + K - 1 < T ? t1 + K - 1 : T;
  for (int64_t s = t0; s < g1; s++) {
    float *gs = g + (s - t0) * C;
    const float *d = doutb + s * C;
    pre_activation(xb, NULL, w, s, C, K, gs);
    int64_t c = 0;
    for (; c + VL <= C; c += VL) { /* silu'(y) = s (1 + y (1 - s)), as torch's silu_backward */
      v16 y = vload(gs + c), sg = vsigmoid1(y);
      vstore(gs + c, vload(d + c) * (sg * (vset1(1.f) + y * (vset1(1.f) - sg))));
    }
    for (; c < C; c++) {
      float y = gs[c], sg = sigmoid1(y);
      gs[c] = d[c] * (sg * (1.f + y * (1.f - sg)));
    }
  }
  for (int64_t t = t0; t < t1; t++) {
    float *o = dxb + t * C;
    int jmin = (int)(t + K - 1 - (g1 - 1)); /* j with t + (K - 1) - j < g1 */
    if (jmin < 0) jmin = 0;
    int64_t c = 0;
    for (; c + VL <= C; c += VL) {
      v16 acc = vset1(0.f);
      for (int j = K - 1; j >= jmin; j--)
        acc += vload(w + (int64_t)j * C + c) * vload(g + (t + K - 1 - j - t0) * C + c);
      vstore(o + c, acc);
    }
    for (; c < C; c++) {
      float acc = 0.f;
      for (int j = K - 1; j >= jmin; j--)
        acc += w[(int64_t)j * C + c] * g[(t + K - 1 - j - t0) * C + c];
      o[c] = acc;
    }
  }
}

/* Returns 0, or 1 where a unit's buffer could not be allocated (dx then incomplete). */
int tsr_short_conv_silu_bwd(const float *x, const float *w, const float *dout, float *dx,
                            int64_t B, int64_t T, int64_t C, int K, int threads) {
  int64_t per_row = (T + TB - 1) / TB, units = B * per_row;
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
    float *g = malloc((size_t)(TB + K - 1) * (size_t)C * sizeof(float));
    if (!g) failed = 1;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
      if (!g) continue;
      int64_t b, t0, t1;
      unit_range(u, per_row, T, &b, &t0, &t1);
      backward_unit(x + b * T * C, w, dout + b * T * C, dx + b * T * C, t0, t1, T, C, K, g);
    }
    free(g);
  }
  return failed;
}

/* Offset of row i = (a, b, c) of an [A, Bd, Cd, n] tensor with strides s0, s1, s2. */
static inline int64_t strided_row(int64_t i, int64_t Bd, int64_t Cd, int64_t s0, int64_t s1,
                                  int64_t s2) {
  int64_t c = i % Cd, ab = i / Cd;
  return (ab / Bd) * s0 + (ab % Bd) * s1 + c * s2;
}

/* sum(y^2) over one row of n values. */
static inline float sum_squares(const float *y, int n) {
  v16 acc = vset1(0.f);
  int j = 0;
  for (; j + VL <= n; j += VL) acc += vload(y + j) * vload(y + j);
  float ss = vhsum(acc);
  for (; j < n; j++) ss += y[j] * y[j];
  return ss;
}

/* 1 / sqrt(mean(y^2) + eps) over one row of n values. */
static inline float inv_rms(const float *y, int n, float eps) {
  return 1.f / sqrtf(sum_squares(y, n) / (float)n + eps);
}

void tsr_gated_rms_norm_fwd(const float *y, int64_t Bd, int64_t Cd, int64_t s0, int64_t s1,
                            int64_t s2, const float *z, const float *w, float *out, int64_t rows,
                            int n, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < rows; i++) {
    const float *yi = y + strided_row(i, Bd, Cd, s0, s1, s2), *zi = z + i * n;
    float *oi = out + i * n;
    float r = inv_rms(yi, n, eps);
    int j = 0;
    for (; j + VL <= n; j += VL) {
      v16 zv = vload(zi + j);
      vstore(oi + j, vload(w + j) * (vload(yi + j) * vset1(r)) * (zv * vsigmoid1(zv)));
    }
    for (; j < n; j++) oi[j] = w[j] * (yi[j] * r) * (zi[j] * sigmoid1(zi[j]));
  }
}

/* dy (y's strides) and dz (contiguous) from dout: with u = y r, h = w u, s = sigmoid(z),
   dz = dout h s (1 + z (1 - s)), du = dout silu(z) w, dy = r (du - u mean(du u)). */
void tsr_gated_rms_norm_bwd(const float *y, int64_t Bd, int64_t Cd, int64_t s0, int64_t s1,
                            int64_t s2, const float *z, const float *w, const float *dout,
                            float *dy, float *dz, int64_t rows, int n, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < rows; i++) {
    int64_t at = strided_row(i, Bd, Cd, s0, s1, s2);
    const float *yi = y + at, *zi = z + i * n, *di = dout + i * n;
    float *dyi = dy + at, *dzi = dz + i * n;
    float r = inv_rms(yi, n, eps);
    v16 dot = vset1(0.f);
    float dot_tail = 0.f;
    int j = 0;
    for (; j + VL <= n; j += VL) { /* dz, and du (into dy) with sum(du u) */
      v16 zv = vload(zi + j), sg = vsigmoid1(zv), u = vload(yi + j) * vset1(r);
      v16 wv = vload(w + j), d = vload(di + j);
      vstore(dzi + j, d * (wv * u) * (sg * (vset1(1.f) + zv * (vset1(1.f) - sg))));
      v16 du = d * (zv * sg) * wv;
      vstore(dyi + j, du);
      dot += du * u;
    }
    for (; j < n; j++) {
      float zv = zi[j], sg = sigmoid1(zv), u = yi[j] * r;
      dzi[j] = di[j] * (w[j] * u) * (sg * (1.f + zv * (1.f - sg)));
      float du = di[j] * (zv * sg) * w[j];
      dyi[j] = du;
      dot_tail += du * u;
    }
    float mean = (vhsum(dot) + dot_tail) / (float)n;
    for (j = 0; j + VL <= n; j += VL)
      vstore(dyi + j, vset1(r) * (vload(dyi + j) - vload(yi + j) * vset1(r * mean)));
    for (; j < n; j++) dyi[j] = r * (dyi[j] - yi[j] * (r * mean));
  }
}

/* The heads of the rule from the convolution's output: mixed [B, T, C] rows (q | k | v, with
   C = 2 KH Dk + H Dv) -> q, k [B, H, T, Dk] L2-normalised (x / sqrt(sum(x^2) + eps)) and
   repeated for the rep = H / KH value heads each key head serves (consecutive), and v
   [B, H, T, Dv]: heads-major, as the rule reads them, in one pass where torch's form makes a
   copy per reshape and repeat and ~4 passes per norm (and twice that back). */
static inline void scale_row(const float *x, float r, float *out, int n) {
  int j = 0;
  for (; j + VL <= n; j += VL) vstore(out + j, vload(x + j) * vset1(r));
  for (; j < n; j++) out[j] = x[j] * r;
}

static inline float inv_norm(const float *x, int n, float eps) {
  return 1.f / sqrtf(sum_squares(x, n) + eps);
}

/* Key head x's gradient dx (Dk values) from its rep value heads' gradients (rows `grads`, one
   every `stride` floats): their sum in head order g, then the norm's backward r (g - n (g . n))
   with n = x r. */
static void norm_backward(const float *x, float r, const float *grads, int64_t stride, int rep,
                          float *dx, int Dk) {
  scale_row(grads, 1.f, dx, Dk);
  for (int h = 1; h < rep; h++) {
    const float *gh = grads + h * stride;
    int j = 0;
    for (; j + VL <= Dk; j += VL) vstore(dx + j, vload(dx + j) + vload(gh + j));
    for (; j < Dk; j++) dx[j] += gh[j];
  }
  v16 dot = vset1(0.f);
  float dot_tail = 0.f;
  int j = 0;
  for (; j + VL <= Dk; j += VL) dot += vload(dx + j) * (vload(x + j) * vset1(r));
  for (; j < Dk; j++) dot_tail += dx[j] * (x[j] * r);
  float d = vhsum(dot) + dot_tail;
  for (j = 0; j + VL <= Dk; j += VL)
    vstore(dx + j, vset1(r) * (vload(dx + j) - vload(x + j) * vset1(r * d)));
  for (; j < Dk; j++) dx[j] = r * (dx[j] - x[j] * (r * d));
}

/* Both directions of the heads: forward (`out` = {q, k, v}) from mixed, or backward
   (`grads` = {dq, dk, dv}) into dmixed; the other pair NULL. */
static void heads(const float *mixed, float *const *out, const float *const *grads,
                  float *dmixed, int64_t B, int64_t T, int KH, int H, int Dk, int Dv, float eps,
                  int threads) {
  int64_t C = 2 * (int64_t)KH * Dk + (int64_t)H * Dv, per_row = (T + TB - 1) / TB;
  int rep = H / KH;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t u = 0; u < B * per_row; u++) {
    int64_t b, t0, t1;
    unit_range(u, per_row, T, &b, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
      const float *row = mixed + (b * T + t) * C;
      float *drow = grads ? dmixed + (b * T + t) * C : NULL;
      for (int which = 0; which < 2; which++)
        for (int kh = 0; kh < KH; kh++) {
          int64_t at = ((int64_t)which * KH + kh) * Dk, first = ((b * H + kh * rep) * T + t) * Dk;
          const float *x = row + at;
          float r = inv_norm(x, Dk, eps);
          if (grads)
            norm_backward(x, r, grads[which] + first, T * Dk, rep, drow + at, Dk);
          else
            for (int h = 0; h < rep; h++) scale_row(x, r, out[which] + first + h * T * Dk, Dk);
        }
      for (int h = 0; h < H; h++) {
        int64_t at = 2 * (int64_t)KH * Dk + (int64_t)h * Dv, vh = ((b * H + h) * T + t) * Dv;
        if (grads)
          scale_row(grads[2] + vh, 1.f, drow + at, Dv);
        else
          scale_row(row + at, 1.f, out[2] + vh, Dv);
      }
    }
  }
}

void tsr_deltanet_heads_fwd(const float *mixed, float *q, float *k, float *v, int64_t B,
                            int64_t T, int KH, int H, int Dk, int Dv, float eps, int threads) {
  float *const out[3] = {q, k, v};
  heads(mixed, out, NULL, NULL, B, T, KH, H, Dk, Dv, eps, threads);
}

/* dmixed [B, T, C] from dq, dk [B, H, T, Dk] and dv [B, H, T, Dv] (heads-major): per key head,
   its value heads' gradients summed in head order, then the norm's backward. */
void tsr_deltanet_heads_bwd(const float *mixed, const float *dq, const float *dk, const float *dv,
                            float *dmixed, int64_t B, int64_t T, int KH, int H, int Dk, int Dv,
                            float eps, int threads) {
  const float *const grads[3] = {dq, dk, dv};
  heads(mixed, NULL, grads, dmixed, B, T, KH, H, Dk, Dv, eps, threads);
}

/* Row-wise kernels of a bf16 mixed-precision training step (CPU autocast): the passes that
   under autocast ran as torch's eager bf16 ops, several passes each, while the products
   around them run on AMX / AVX-512 bf16 (on an AMX host they took about half the step). Each
   reads bfloat16, computes in float32 and writes bfloat16, rounding where the eager ops
   round (so values stay within a few bf16 units of theirs; see each kernel):

   - the loss's softmax statistics of a chunk of bf16 logits (`tsr_softmax_rows_bf16`),
   - Qwen3's per-head q/k RMSNorm + RoPE from the q/k/v projection's bf16 output, and its
     gradient (`tsr_norm_rope_bf16`, `tsr_norm_rope_backward_bf16`),
   - silu(gate) * up and the SwiGLU gradient (`tsr_silu_mul_bf16`, `tsr_swiglu_backward_bf16`),
   - the causal attention's mask + softmax and its gradient (`tsr_causal_softmax_bf16`, ...),
   - a decoder layer's residual add + RMSNorm, reading the bf16 sublayer output and writing the
     normalised row in bf16, and its gradient (`tsr_add_rms_norm_bf16`, ...).

   Rows are independent and each is computed whole by one thread (its sums in a fixed order):
   results do not depend on the thread count or the schedule. Part of tinker_sr
   (engine/native.py builds it; engine/bf16_rows.py calls it). A bfloat16 is passed as its
   16 bits (uint16_t). Row lengths are multiples of 16 unless a kernel says otherwise. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "norm_rope.h"
#include "rms_norm.h"
#include "softmax_row.h"
#include "vec.h"

/* Softmax statistics of bf16 logits z [rows, V] (contiguous), in place: z[i] becomes
   bf16(exp(z[i] - max_i)), total[i] the sum of the float32 exponentials and lse[i] = max_i +
   log(total[i]) (float32; softmax_row.h): the values of widening the row to float32, running
   rows.c's tsr_softmax_rows on it and rounding z back (torch's eager form: widen, amax, sub,
   exp, sum, narrow: six passes over a float32 copy), in two passes over the bf16 row. */
void tsr_softmax_rows_bf16(uint16_t *z, int64_t rows, int64_t V, float *total, float *lse,
                           int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) softmax_row(z + i * V, V, total + i, lse + i, 1);
}

/* Attention's q (or k) from the bf16 q/k/v projection output, in one pass: rows.c's
   tsr_norm_rope (the same layouts; norm_rope.h) on bf16 x and y, in float32: with w (Qwen3's
   q_norm / k_norm, float32 [D]) RMS-normalised per head (r gets the float32 scales) and
   rounded to bf16 before the gain, as HF's RMSNorm casts back to the input's dtype before
   multiplying by its weight; then rotated with the float32 cos / sin and rounded once into y
   [B, H, T, D] (bf16). D % 32 == 0. */
void tsr_norm_rope_bf16(const uint16_t *x, int64_t ld_outer, int64_t ld_inner, const float *w,
                        float eps, const float *cos, const float *sin, uint16_t *y, float *r,
                        int64_t B, int T, int H, int D, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < B * T * H; i++)
    norm_rope_row(i, x, ld_outer, ld_inner, w, eps, cos, sin, y, r, B, T, H, D, 1);
}

/* The gradient of tsr_norm_rope_bf16: rows.c's tsr_norm_rope_backward on bf16 g, x and dx,
   in float32 (x as the forward read it, r as it wrote it), rounded once. D <= 1024. */
void tsr_norm_rope_backward_bf16(const uint16_t *g, const uint16_t *x, int64_t ld_outer,
                                 int64_t ld_inner, const float *w, const float *r,
                                 const float *cos, const float *sin, uint16_t *dx,
                                 int64_t dx_outer, int64_t dx_inner, int64_t B, int T, int H,
                                 int D, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < B * T * H; i++)
    norm_rope_grad_row(i, g, x, ld_outer, ld_inner, w, r, cos, sin, dx, dx_outer, dx_inner, B, T,
                       H, D, 1);
}

/* The SwiGLU kernels read two or three rows side by side, each a few KB: every stream is
   prefetched PF_DIST elements ahead (rows.c measured why). */
#define PF_DIST 512

/* silu(x) = x / (1 + exp(-x)), as torch's CPU kernel forms it in float32. */
static inline v16 vsilu(v16 x) { return x / (vset1(1.f) + vexp(-x)); }

/* out[i, :] = bf16(bf16(silu(gate[i, :])) * up[i, :]) (torch's eager bf16 silu, then its bf16
   multiply, each rounded); out is contiguous [rows, n], n % 16 == 0. */
void tsr_silu_mul_bf16(const uint16_t *gate, int64_t ld_gate, const uint16_t *up, int64_t ld_up,
                       uint16_t *out, int64_t rows, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    const uint16_t *gi = gate + i * ld_gate, *ui = up + i * ld_up;
    uint16_t *oi = out + i * n;
    for (int j = 0; j < n; j += VL) {
      if (j + PF_DIST < n) {
        __builtin_prefetch(gi + j + PF_DIST, 0, 3);
        __builtin_prefetch(ui + j + PF_DIST, 0, 3);
      }
      vstore_bf16(oi + j, vround_bf16(vsilu(vload_bf16(gi + j))) * vload_bf16(ui + j));
    }
  }
}

/* For h = silu(gate) * up with gate_up = [gate | up] ([rows, 2n] bf16, contiguous) and dh
   [rows, n] bf16: out = [d_gate | d_up] (bf16), rounded where torch's eager bf16 backward
   rounds: d_up = bf16(bf16(silu(gate)) dh), d_gate = bf16(bf16(dh up) silu'(gate)),
   silu'(g) = sig(g) (1 + g (1 - sig(g))) in float32. `out` may be `gate_up` itself (every
   element is read before its place is written). n % 16 == 0. */
void tsr_swiglu_backward_bf16(const uint16_t *gate_up, const uint16_t *dh, uint16_t *out,
                              int64_t rows, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    const uint16_t *gi = gate_up + i * 2 * n, *ui = gi + n, *di = dh + i * n;
    uint16_t *og = out + i * 2 * n, *ou = og + n;
    for (int j = 0; j < n; j += VL) {
      if (j + PF_DIST < n) {
        __builtin_prefetch(gi + j + PF_DIST, 0, 3);
        __builtin_prefetch(ui + j + PF_DIST, 0, 3);
        __builtin_prefetch(di + j + PF_DIST, 0, 3);
      }
      v16 g = vload_bf16(gi + j), u = vload_bf16(ui + j), d = vload_bf16(di + j);
      v16 den = vset1(1.f) + vexp(-g), s = vset1(1.f) / den;
      v16 du = vround_bf16(g / den) * d; /* g / den: vsilu(g), the forward's silu */
      v16 dg = (vround_bf16(d * u) * s) * (vset1(1.f) + g * (vset1(1.f) - s));
      vstore_bf16(og + j, dg);
      vstore_bf16(ou + j, du);
    }
  }
}

/* Causal attention's probabilities from bf16 scores, in place: s holds `rows` rows of T scores
   ([B KV, G T, T] as the bf16 attention's batched products form them: row i is query i % T),
   row i's first (i % T) + 1 entries its keys. Each row becomes softmax over those entries
   (float32 statistics: max, sum of exp(x - max); each probability exp(x - max) / sum rounded
   once to bf16, as torch's bf16 softmax rounds) and zeros after them: the causal mask,
   torch's masked_fill_ and its softmax in one pass that forms no exponential past a row's
   last key. T % 16 == 0. */
void tsr_causal_softmax_bf16(uint16_t *s, int64_t rows, int T, int threads) {
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16 ninf = vset1(-INFINITY);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    uint16_t *si = s + i * T;
    int last = (int)(i % T), end = (last / VL + 1) * VL; /* vectors holding keys 0..last */
    v16 lim = vset1((float)last), mx = ninf;
    for (int j = 0; j < end; j += VL) {
      v16 x = vsel(lane + (float)j > lim, ninf, vload_bf16(si + j));
      mx = vsel(x > mx, x, mx);
    }
    v16 top = vset1(vhmax(mx)), acc = vset1(0.f);
    float e[4096] __attribute__((aligned(64))); /* T <= 4096 (bf16_rows.py checks) */
    for (int j = 0; j < end; j += VL) {
      v16 x = vsel(lane + (float)j > lim, ninf, vload_bf16(si + j));
      v16 p = vexp(x - top);
      vstore(e + j, p);
      acc += p;
    }
    v16 inv = vset1(1.f / vhsum(acc));
    for (int j = 0; j < end; j += VL) vstore_bf16(si + j, vload(e + j) * inv);
    if (end < T) memset(si + end, 0, sizeof(uint16_t) * (size_t)(T - end));
  }
}

/* Its gradient, in place of dp: ds = p (dp - sum_j p_j dp_j) per row (float32 sum, rounded
   once to bf16, as torch's bf16 softmax backward), for p from tsr_causal_softmax_bf16 (zero
   past a row's last key, so the sum and ds there need no mask: ds = 0 where p = 0). */
void tsr_causal_softmax_backward_bf16(const uint16_t *p, uint16_t *dp, int64_t rows, int T,
                                      int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    const uint16_t *pi = p + i * T;
    uint16_t *di = dp + i * T;
    int end = ((int)(i % T) / VL + 1) * VL;
    v16 acc = vset1(0.f);
    for (int j = 0; j < end; j += VL) acc += vload_bf16(pi + j) * vload_bf16(di + j);
    v16 dot = vset1(vhsum(acc));
    for (int j = 0; j < end; j += VL)
      vstore_bf16(di + j, vload_bf16(pi + j) * (vload_bf16(di + j) - dot));
    if (end < T) memset(di + end, 0, sizeof(uint16_t) * (size_t)(T - end));
  }
}

/* A decoder layer's residual add and RMSNorm under bf16 mixed precision: h = x + y (x the
   float32 residual stream, y a bf16 sublayer output; h float32) and out = bf16(h r w), the
   normalised row as the next sublayer's bf16 products read it (rms_norm.h): rows.c's
   tsr_rms_norm on y widened, with out rounded once (what autocast's cast of it gave). */
void tsr_add_rms_norm_bf16(const float *x, const uint16_t *y, const float *w, float *h,
                           uint16_t *out, float *r, int64_t rows, int n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) rms_norm_unit(i, x, y, w, h, out, r, n, eps, 1, 1);
}

/* Its gradient: rows.c's tsr_rms_norm_backward for a bf16 g (the next sublayer's bf16 input
   gradient, widened exactly), plus add (the residual path's float32 gradient), into dx
   (float32, the residual stream's) and dx_low (the same rounded to bf16: the sublayer
   output's gradient) in one pass. */
void tsr_rms_norm_backward_bf16(const uint16_t *g, const float *x, const float *w,
                                const float *r, const float *add, float *dx, uint16_t *dx_low,
                                int64_t rows, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) rms_norm_grad_unit(i, g, x, w, r, add, dx, dx_low, n, 1);
}

/* A bf16 checkpoint's residual add and RMSNorm (its weights and residual stream in bf16, no
   autocast), rounding where torch's eager bf16 ops round: h = bf16(x + y) (y NULL: h is x,
   not written), r = 1 / sqrt(mean(h^2) + eps) from h widened, out = bf16(bf16(h r) w), the
   normalised row cast to bf16 before the gain as transformers does (w is the bf16 gain
   widened, so that product is exact before its rounding). One pass over x and y writing h,
   one reading h and writing out, where the eager form takes ~6 passes. */
void tsr_add_rms_norm_bf16_stream(const uint16_t *x, const uint16_t *y, const float *w,
                                  uint16_t *h, uint16_t *out, float *r, int64_t rows, int n,
                                  float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    const uint16_t *xi = x + i * n;
    uint16_t *oi = out + i * n;
    v16 acc = vset1(0.f);
    if (y) {
      const uint16_t *yi = y + i * n;
      uint16_t *hi = h + i * n;
      for (int j = 0; j < n; j += VL) {
        v16 v = vround_bf16(vload_bf16(xi + j) + vload_bf16(yi + j));
        vstore_bf16(hi + j, v); /* already a bf16 value: stored exactly */
        acc += v * v;
      }
      xi = hi;
    } else {
      for (int j = 0; j < n; j += VL) {
        v16 v = vload_bf16(xi + j);
        acc += v * v;
      }
    }
    float ri = 1.0f / sqrtf(vhsum(acc) / (float)n + eps);
    v16 rv = vset1(ri);
    for (int j = 0; j < n; j += VL)
      vstore_bf16(oi + j, vround_bf16(vload_bf16(xi + j) * rv) * vload(w + j));
    r[i] = ri;
  }
}

/* Its gradient, as torch's eager bf16 ops compute it: gw = bf16(g w) widened, n = h r (float32),
   d = bf16(r (gw - n mean(gw n))), then d = bf16(d + add) where the residual path's bf16
   gradient `add` is given (autograd's sum of the two at h), written to dx. */
void tsr_rms_norm_backward_bf16_stream(const uint16_t *g, const uint16_t *h, const float *w,
                                       const float *r, const uint16_t *add, uint16_t *dx,
                                       int64_t rows, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    int64_t row = i * n;
    v16 rv = vset1(r[i]), acc = vset1(0.f);
    for (int j = 0; j < n; j += VL)
      acc += vround_bf16(vload_bf16(g + row + j) * vload(w + j)) * (vload_bf16(h + row + j) * rv);
    v16 mv = vset1(vhsum(acc) / (float)n);
    for (int j = 0; j < n; j += VL) {
      v16 nv = vkeep(vload_bf16(h + row + j) * rv);
      v16 gw = vround_bf16(vload_bf16(g + row + j) * vload(w + j));
      v16 d = (gw - vkeep(nv * mv)) * rv;
      if (add) d = vround_bf16(d) + vload_bf16(add + row + j);
      vstore_bf16(dx + row + j, d);
    }
  }
}

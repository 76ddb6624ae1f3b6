/* Row-wise float32 kernels of the training step, each one pass over its tensors where torch's
   eager ops take two to six: RMSNorm and its input gradient, silu(gate) * up and the SwiGLU
   gradient (both also with the down projection's LoRA product on the way: x A^T forward,
   dA backward), Qwen3's q/k RMSNorm + RoPE (forward and gradient), the loss's softmax passes, and
   a merged LoRA weight. Rows are independent and each is computed whole by one thread (its
   sums in a fixed order), so results do not depend on the thread count or the schedule.

   Part of tinker_sr (engine/native.py builds it with the machine's C compiler at first use;
   engine/compiled.py calls it). Rows are `rows` x `n` floats, row i at `p + i * ld` (unit
   stride inside a row) unless a kernel says otherwise. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* out = x * r * w, r = 1 / sqrt(mean(x^2) + eps) per row (written to r[i]). */
void tsr_rms_norm(const float *x, const float *w, float *out, float *r, int64_t rows, int n,
                  float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    const float *xi = x + i * n;
    float *oi = out + i * n;
    v16 acc = vset1(0.f);
    int j = 0;
    for (; j + VL <= n; j += VL) {
      v16 v = vload(xi + j);
      acc += v * v;
    }
    float ss = vhsum(acc);
    for (; j < n; j++) ss += xi[j] * xi[j];
    float ri = 1.0f / sqrtf(ss / (float)n + eps);
    r[i] = ri;
    v16 rv = vset1(ri);
    for (j = 0; j + VL <= n; j += VL) vstore(oi + j, vload(xi + j) * rv * vload(w + j));
    for (; j < n; j++) oi[j] = xi[j] * ri * w[j];
  }
}

/* dx = r * (g w - x r * mean(g w * x r)) per row: RMSNorm's input gradient. */
void tsr_rms_norm_backward(const float *g, const float *x, const float *w, const float *r,
                           float *dx, int64_t rows, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    const float *gi = g + i * n, *xi = x + i * n;
    float *di = dx + i * n;
    float ri = r[i];
    v16 rv = vset1(ri), acc = vset1(0.f);
    int j = 0;
    for (; j + VL <= n; j += VL) acc += (vload(gi + j) * vload(w + j)) * (vload(xi + j) * rv);
    float dot = vhsum(acc);
    for (; j < n; j++) dot += (gi[j] * w[j]) * (xi[j] * ri);
    float mean = dot / (float)n;
    v16 mv = vset1(mean);
    for (j = 0; j + VL <= n; j += VL)
      vstore(di + j, ((vload(gi + j) * vload(w + j)) - (vload(xi + j) * rv) * mv) * rv);
    for (; j < n; j++) di[j] = ((gi[j] * w[j]) - (xi[j] * ri) * mean) * ri;
  }
}

static inline v16 vsigmoid(v16 x) { return vset1(1.f) / (vset1(1.f) + vexp(-x)); }
static inline float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

/* One row of silu(gate) * up (both SwiGLU forward kernels form h through it: the same bits). */
static inline void silu_mul_row(const float *gi, const float *ui, float *oi, int n) {
  int j = 0;
  for (; j + VL <= n; j += VL) {
    v16 g = vload(gi + j);
    vstore(oi + j, g * vsigmoid(g) * vload(ui + j));
  }
  for (; j < n; j++) oi[j] = gi[j] * sigmoid(gi[j]) * ui[j];
}

/* out[i, :] = silu(gate[i, :]) * up[i, :]; out is contiguous [rows, n]. */
void tsr_silu_mul(const float *gate, int64_t ld_gate, const float *up, int64_t ld_up, float *out,
                  int64_t rows, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) silu_mul_row(gate + i * ld_gate, up + i * ld_up, out + i * n, n);
}

/* tsr_silu_mul (the same h, bit for bit) that also returns xa = h a^T [rows, r] for a [r, n]
   (the down projection's LoRA A, already scaled): the adapter's product from h while each row
   is in cache, instead of a GEMM that reads h back from memory. Two rows at a time, ranks in
   groups of 8 (each row's sums in a fixed order: independent of the thread count). */
void tsr_silu_mul_xa(const float *gate, int64_t ld_gate, const float *up, int64_t ld_up,
                     float *out, int64_t rows, int n, const float *a, int r, float *xa,
                     int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i0 = 0; i0 < rows; i0 += 2) {
    int nr = rows - i0 < 2 ? 1 : 2;
    for (int q = 0; q < nr; q++) /* h, as tsr_silu_mul writes it */
      silu_mul_row(gate + (i0 + q) * ld_gate, up + (i0 + q) * ld_up, out + (i0 + q) * n, n);
    for (int k0 = 0; k0 < r; k0 += 8) {
      int nk = r - k0 < 8 ? r - k0 : 8;
      v16 acc[2][8];
      for (int q = 0; q < 2; q++)
        for (int k = 0; k < 8; k++) acc[q][k] = vset1(0.f);
      const float *h0 = out + i0 * n, *h1 = out + (i0 + nr - 1) * n;
      int j = 0;
      for (; j + VL <= n; j += VL) {
        v16 x0 = vload(h0 + j), x1 = vload(h1 + j);
        for (int k = 0; k < nk; k++) {
          v16 w = vload(a + (int64_t)(k0 + k) * n + j);
          acc[0][k] += x0 * w;
          acc[1][k] += x1 * w;
        }
      }
      for (int q = 0; q < nr; q++)
        for (int k = 0; k < nk; k++) {
          const float *hq = out + (i0 + q) * n;
          float sum = vhsum(acc[q][k]);
          for (int jj = j; jj < n; jj++) sum += hq[jj] * a[(int64_t)(k0 + k) * n + jj];
          xa[(i0 + q) * r + k0 + k] = sum;
        }
    }
  }
}

/* For h = silu(gate) * up with gate_up = [gate | up] ([rows, 2n], contiguous) and dh [rows, n]:
   out = [d_gate | d_up], d_up = silu(gate) dh, d_gate = dh up silu'(gate),
   silu'(g) = sig(g) (1 + g (1 - sig(g))). `out` may be `gate_up` itself (every element is
   read before its place is written). */
void tsr_swiglu_backward(const float *gate_up, const float *dh, float *out, int64_t rows, int n,
                         int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    const float *gi = gate_up + i * 2 * n, *ui = gi + n, *di = dh + i * n;
    float *og = out + i * 2 * n, *ou = og + n;
    int j = 0;
    for (; j + VL <= n; j += VL) {
      v16 g = vload(gi + j), u = vload(ui + j), d = vload(di + j), s = vsigmoid(g);
      vstore(og + j, d * u * (s * (vset1(1.f) + g * (vset1(1.f) - s))));
      vstore(ou + j, g * s * d);
    }
    for (; j < n; j++) {
      float g = gi[j], u = ui[j], d = di[j], s = sigmoid(g);
      og[j] = d * u * (s * (1.f + g * (1.f - s)));
      ou[j] = g * s * d;
    }
  }
}

/* tsr_swiglu_backward (in place: out == gate_up) that also returns the down projection's LoRA
   gradient dA = yb^T h [r, n] for yb = s (dy B) [rows, r], with h = silu(gate) * up formed
   on the fly (bit-identical to tsr_silu_mul's), so backward needs neither h recomputed in
   memory nor a product that reads it. Rows go in fixed blocks of SWIGLU_BLOCK, each summing
   its rows into its own [r, n] slice of `partials` ([ceil(rows / SWIGLU_BLOCK), r, n]), four
   rows at a time; the slices are then added in block order: the result does not depend on
   the thread count. */
#define SWIGLU_BLOCK 64
void tsr_swiglu_backward_da(float *gate_up, const float *dh, int64_t rows, int n, const float *yb,
                            int r, float *partials, float *da, int threads) {
  int64_t nblocks = (rows + SWIGLU_BLOCK - 1) / SWIGLU_BLOCK;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; blk++) {
      float *acc = partials + blk * (int64_t)r * n;
      memset(acc, 0, sizeof(float) * (size_t)r * n);
      int64_t end = (blk + 1) * SWIGLU_BLOCK < rows ? (blk + 1) * SWIGLU_BLOCK : rows;
      for (int64_t i0 = blk * SWIGLU_BLOCK; i0 < end; i0 += 4) {
        int nr = end - i0 < 4 ? (int)(end - i0) : 4;
        int j = 0;
        for (; j + VL <= n; j += VL) {
          v16 h[4];
          for (int q = 0; q < nr; q++) {
            float *gi = gate_up + (i0 + q) * 2 * n, *ui = gi + n;
            const float *di = dh + (i0 + q) * n;
            v16 g = vload(gi + j), u = vload(ui + j), d = vload(di + j), sg = vsigmoid(g);
            v16 gs = g * sg;
            h[q] = gs * u;
            vstore(gi + j, d * u * (sg * (vset1(1.f) + g * (vset1(1.f) - sg))));
            vstore(ui + j, gs * d);
          }
          for (int k = 0; k < r; k++) {
            v16 a = vload(acc + (int64_t)k * n + j);
            for (int q = 0; q < nr; q++) a += vset1(yb[(i0 + q) * r + k]) * h[q];
            vstore(acc + (int64_t)k * n + j, a);
          }
        }
        for (; j < n; j++)
          for (int q = 0; q < nr; q++) {
            float *gi = gate_up + (i0 + q) * 2 * n, *ui = gi + n;
            float g = gi[j], u = ui[j], d = dh[(i0 + q) * n + j], sg = sigmoid(g), gs = g * sg;
            float hv = gs * u;
            gi[j] = d * u * (sg * (1.f + g * (1.f - sg)));
            ui[j] = gs * d;
            for (int k = 0; k < r; k++) acc[(int64_t)k * n + j] += yb[(i0 + q) * r + k] * hv;
          }
      }
    }
#pragma omp for schedule(static)
    for (int64_t e = 0; e < (int64_t)r * n; e++) {
      float sum = 0.f;
      for (int64_t blk = 0; blk < nblocks; blk++) sum += partials[blk * (int64_t)r * n + e];
      da[e] = sum;
    }
  }
}

/* Attention's q (or k) from the q/k/v projection, in one pass: for x [B, T, H, D] (row (b, t,
   h) at x + (b * T + t) * ld_outer + h * ld_inner), optionally RMS-normalised per head
   (w != NULL: Qwen3's q_norm/k_norm; r[(b * T + t) * H + h] gets the row's scale), then rotated
   (RoPE, "rotate_half" layout: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s] with c, s the first half
   of cos[t], sin[t]) and written to y [B, H, T, D], the layout attention reads. D % 32 == 0. */
void tsr_norm_rope(const float *x, int64_t ld_outer, int64_t ld_inner, const float *w, float eps,
                   const float *cos, const float *sin, float *y, float *r, int64_t B, int T, int H,
                   int D, int threads) {
  const int half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < B * T * H; i++) {
    int64_t o = i / H, b = o / T;
    int h = (int)(i % H), t = (int)(o % T);
    const float *xi = x + o * ld_outer + h * ld_inner;
    const float *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
    float *yi = y + ((b * H + h) * T + t) * D;
    v16 rv = vset1(1.f);
    if (w) {
      v16 acc = vset1(0.f);
      for (int j = 0; j < D; j += VL) {
        v16 v = vload(xi + j);
        acc += v * v;
      }
      float ri = 1.0f / sqrtf(vhsum(acc) / (float)D + eps);
      r[i] = ri;
      rv = vset1(ri);
    }
    for (int j = 0; j < half; j += VL) {
      v16 x1 = vload(xi + j) * rv, x2 = vload(xi + half + j) * rv;
      if (w) {
        x1 *= vload(w + j);
        x2 *= vload(w + half + j);
      }
      v16 cj = vload(c + j), sj = vload(s + j);
      vstore(yi + j, x1 * cj - x2 * sj);
      vstore(yi + half + j, x2 * cj + x1 * sj);
    }
  }
}

/* The gradient of tsr_norm_rope: g [B, H, T, D] contiguous -> dx [B, T, H, D] (row strides
   dx_outer per (b, t) and dx_inner per head, unit stride inside a head: a slice of the q/k/v
   gradient), the inverse rotation ([g1, g2] -> [g1 c + g2 s, g2 c - g1 s]) then, with w,
   RMSNorm's input gradient r (u w - n mean(u w n)), n = x r (x, r as the forward read and
   wrote them). */
void tsr_norm_rope_backward(const float *g, const float *x, int64_t ld_outer, int64_t ld_inner,
                            const float *w, const float *r, const float *cos, const float *sin,
                            float *dx, int64_t dx_outer, int64_t dx_inner, int64_t B, int T,
                            int H, int D, int threads) {
  const int half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < B * T * H; i++) {
    int64_t o = i / H, b = o / T;
    int h = (int)(i % H), t = (int)(o % T);
    const float *gi = g + ((b * H + h) * T + t) * D;
    const float *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
    float *di = dx + o * dx_outer + h * dx_inner;
    for (int j = 0; j < half; j += VL) {
      v16 g1 = vload(gi + j), g2 = vload(gi + half + j), cj = vload(c + j), sj = vload(s + j);
      vstore(di + j, g1 * cj + g2 * sj);
      vstore(di + half + j, g2 * cj - g1 * sj);
    }
    if (!w) continue;
    const float *xi = x + o * ld_outer + h * ld_inner;
    v16 rv = vset1(r[i]), acc = vset1(0.f);
    for (int j = 0; j < D; j += VL) acc += (vload(di + j) * vload(w + j)) * (vload(xi + j) * rv);
    v16 mv = vset1(vhsum(acc) / (float)D);
    for (int j = 0; j < D; j += VL)
      vstore(di + j, ((vload(di + j) * vload(w + j)) - (vload(xi + j) * rv) * mv) * rv);
  }
}

/* Softmax statistics of logits z [rows, V] (contiguous), in place: z[i] becomes
   exp(z[i] - max_i), total[i] its sum and lse[i] = max_i + log(total[i]) (the row's logsumexp):
   two passes over a row (a max, then exp and sum) where torch runs four. Sums run in 64 lanes
   (4 vectors), then across them, in a fixed order. V % 16 == 0. */
void tsr_softmax_rows(float *z, int64_t rows, int64_t V, float *total, float *lse, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    float *zi = z + i * V;
    /* Four running maxima: one chain of compare-and-select per vector ran the pass at half
       the speed (0.59 vs 0.28 ms per 256 x 32,000 chunk). */
    v16 m[4] = {vload(zi), vload(zi), vload(zi), vload(zi)};
    int64_t j = 0;
    for (; j + 4 * VL <= V; j += 4 * VL)
      for (int u = 0; u < 4; u++) {
        v16 v = vload(zi + j + u * VL);
        m[u] = vsel(v > m[u], v, m[u]);
      }
    for (; j < V; j += VL) {
      v16 v = vload(zi + j);
      m[0] = vsel(v > m[0], v, m[0]);
    }
    v16 m01 = vsel(m[1] > m[0], m[1], m[0]), m23 = vsel(m[3] > m[2], m[3], m[2]);
    float top = vhmax(vsel(m23 > m01, m23, m01));
    v16 t = vset1(top), acc[4] = {vset1(0.f), vset1(0.f), vset1(0.f), vset1(0.f)};
    j = 0;
    for (; j + 4 * VL <= V; j += 4 * VL)
      for (int u = 0; u < 4; u++) {
        v16 e = vexp(vload(zi + j + u * VL) - t);
        vstore(zi + j + u * VL, e);
        acc[u] += e;
      }
    for (; j < V; j += VL) {
      v16 e = vexp(vload(zi + j) - t);
      vstore(zi + j, e);
      acc[0] += e;
    }
    float sum = vhsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
    total[i] = sum;
    lse[i] = top + logf(sum);
  }
}

/* z[i] = exp(z[i] - lse[i]) * scale[i] in place: softmax(z) scaled per row (a logit gradient's
   dense part). V % 16 == 0. */
void tsr_softmax_scale_rows(float *z, int64_t rows, int64_t V, const float *lse, const float *scale,
                            int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    float *zi = z + i * V;
    v16 l = vset1(lse[i]), s = vset1(scale[i]);
    for (int64_t j = 0; j < V; j += VL) vstore(zi + j, vexp(vload(zi + j) - l) * s);
  }
}

/* A merged LoRA weight in one pass: out[n, :] = w[n, :] + sum_j (s b[n, j]) a[j, :] for w, out
   [N, K], b [N, r], a [r, K] (all contiguous): torch's addmm copied w into out and then ran a
   rank-r GEMM over it (two passes over a weight-sized tensor). */
void tsr_lora_merge(const float *w, const float *b, const float *a, float s, float *out,
                    int64_t N, int K, int r, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const float *wn = w + n * K, *bn = b + n * r;
    float *on = out + n * K;
    int k = 0;
    for (; k + VL <= K; k += VL) {
      v16 acc = vload(wn + k);
      for (int j = 0; j < r; j++) acc += vset1(s * bn[j]) * vload(a + (int64_t)j * K + k);
      vstore(on + k, acc);
    }
    for (; k < K; k++) {
      float acc = wn[k];
      for (int j = 0; j < r; j++) acc += (s * bn[j]) * a[(int64_t)j * K + k];
      on[k] = acc;
    }
  }
}

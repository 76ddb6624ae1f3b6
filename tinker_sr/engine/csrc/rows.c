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

#include "norm_rope.h"
#include "rms_norm.h"
#include "softmax_row.h"
#include "vec.h"

/* out = x * r * w per row (r written to r[i]). With y: the residual add folded in, h = x + y
   written to h and normalised (one pass where an add and the norm took two; the same bits;
   rms_norm.h). */
void tsr_rms_norm(const float *x, const float *y, const float *w, float *h, float *out, float *r,
                  int64_t rows, int n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) rms_norm_unit(i, x, y, w, h, out, r, n, eps, 0, 0);
}

/* dx = r * (g w - x r * mean(g w * x r)) per row: RMSNorm's input gradient. With add (the
   gradient reaching the norm's input by the residual path), dx = add + that, as autograd would
   sum the two (rms_norm.h). */
void tsr_rms_norm_backward(const float *g, const float *x, const float *w, const float *r,
                           const float *add, float *dx, int64_t rows, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) rms_norm_grad_unit(i, g, x, w, r, add, dx, NULL, n, 0);
}

/* The SwiGLU kernels read two or three rows side by side, each a few KB of a [gate | up] row
   whose halves lie 6 KB apart: the hardware's stream prefetch stops at every page boundary.
   Each stream is prefetched PF_DIST floats (1 KB) ahead (measured on 4096 x 1536 halves:
   silu_mul_xa ~2.9 -> ~2.6 ms, swiglu_backward_da ~2.5 -> ~2.2 ms from a cold cache). */
#define PF_DIST 256

static inline v16 vsigmoid(v16 x) { return vset1(1.f) / (vset1(1.f) + vexp(-x)); }
static inline float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

/* One row of silu(gate) * up (both SwiGLU forward kernels form h through it: the same bits). */
static inline void silu_mul_row(const float *gi, const float *ui, float *oi, int n) {
  int j = 0;
  for (; j + VL <= n; j += VL) {
    if (j + PF_DIST < n) { /* see PF_DIST */
      __builtin_prefetch(gi + j + PF_DIST, 0, 3);
      __builtin_prefetch(ui + j + PF_DIST, 0, 3);
    }
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

/* out[j] = sum over blocks b (in order) of partials[b * slot + j], j < n: the per-block partial
   sums of the kernels below, added 16 columns at a time (the same order, so the same bits, as
   one column at a time). */
static void sum_blocks(const float *partials, int64_t nblocks, int64_t slot, int64_t n, float *out) {
  int64_t j = 0;
  for (; j + VL <= n; j += VL) {
    v16 sum = vset1(0.f);
    for (int64_t b = 0; b < nblocks; b++) sum += vload(partials + b * slot + j);
    vstore(out + j, sum);
  }
  for (; j < n; j++) {
    float sum = 0.f;
    for (int64_t b = 0; b < nblocks; b++) sum += partials[b * slot + j];
    out[j] = sum;
  }
}

/* tsr_swiglu_backward_da (below the LoRA group kernels, which it can run on the way):
   tsr_swiglu_backward (in place: out == gate_up) that also returns the down projection's LoRA
   gradient dA = yb^T h [r, n] for yb = s (dy B) [rows, r], with h = silu(gate) * up formed
   on the fly (bit-identical to tsr_silu_mul's), so backward needs neither h recomputed in
   memory nor a product that reads it. Rows go in fixed blocks of SWIGLU_BLOCK, each summing
   its rows into its own [r, n] slice of `partials` ([ceil(rows / SWIGLU_BLOCK), r, n]), four
   rows at a time; the slices are then added in block order: the result does not depend on
   the thread count. */
#define SWIGLU_BLOCK 64

/* Rows i0..end of tsr_swiglu_backward_da (one block), summed into acc [r, n] (zeroed first). */
static void swiglu_block(float *gate_up, const float *dh, int64_t i0, int64_t end, int n,
                         const float *yb, int r, float *acc) {
  memset(acc, 0, sizeof(float) * (size_t)r * n);
  for (; i0 < end; i0 += 4) {
    int nr = end - i0 < 4 ? (int)(end - i0) : 4;
    int j = 0;
    for (; j + VL <= n; j += VL) {
      v16 h[4];
      for (int q = 0; q < nr; q++) {
        float *gi = gate_up + (i0 + q) * 2 * n, *ui = gi + n;
        const float *di = dh + (i0 + q) * n;
        if (j + PF_DIST < n) { /* see PF_DIST */
          __builtin_prefetch(gi + j + PF_DIST, 1, 3);
          __builtin_prefetch(ui + j + PF_DIST, 1, 3);
          __builtin_prefetch(di + j + PF_DIST, 0, 3);
        }
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

/* Attention's q (or k) from the q/k/v projection, in one pass: for x [B, T, H, D] (row (b, t,
   h) at x + (b * T + t) * ld_outer + h * ld_inner), optionally RMS-normalised per head
   (w != NULL: Qwen3's q_norm/k_norm; r[(b * T + t) * H + h] gets the row's scale), then rotated
   (RoPE, "rotate_half" layout: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s] with c, s the first half
   of cos[t], sin[t]) and written to y [B, H, T, D], the layout attention reads (norm_rope.h).
   D % 32 == 0. */
void tsr_norm_rope(const float *x, int64_t ld_outer, int64_t ld_inner, const float *w, float eps,
                   const float *cos, const float *sin, float *y, float *r, int64_t B, int T, int H,
                   int D, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < B * T * H; i++)
    norm_rope_row(i, x, ld_outer, ld_inner, w, eps, cos, sin, y, r, B, T, H, D, 0);
}

/* The gradient of tsr_norm_rope: g [B, H, T, D] contiguous -> dx [B, T, H, D] (row strides
   dx_outer per (b, t) and dx_inner per head, unit stride inside a head: a slice of the q/k/v
   gradient), the inverse rotation ([g1, g2] -> [g1 c + g2 s, g2 c - g1 s]) then, with w,
   RMSNorm's input gradient r (u w - n mean(u w n)), n = x r (x, r as the forward read and
   wrote them). D <= 1024. */
void tsr_norm_rope_backward(const float *g, const float *x, int64_t ld_outer, int64_t ld_inner,
                            const float *w, const float *r, const float *cos, const float *sin,
                            float *dx, int64_t dx_outer, int64_t dx_inner, int64_t B, int T,
                            int H, int D, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < B * T * H; i++)
    norm_rope_grad_row(i, g, x, ld_outer, ld_inner, w, r, cos, sin, dx, dx_outer, dx_inner, B, T,
                       H, D, 0);
}

/* Softmax statistics of logits z [rows, V] (contiguous), in place: z[i] becomes
   exp(z[i] - max_i), total[i] its sum and lse[i] = max_i + log(total[i]) (the row's logsumexp;
   softmax_row.h). V % 16 == 0. */
void tsr_softmax_rows(float *z, int64_t rows, int64_t V, float *total, float *lse, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; i++) softmax_row(z + i * V, V, total + i, lse + i, 0);
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

/* One row n of tsr_lora_merge, for constant w_bf16 / out_bf16 (always inlined: each pair of
   dtypes gets its own loop). */
static inline __attribute__((always_inline)) void lora_merge_row(
    const void *w, const float *b, const float *a, float s, void *out, int64_t n, int K, int r,
    int w_bf16, int out_bf16) {
  const float *bn = b + n * r;
  int64_t base = n * K;
  int k = 0;
  for (; k + VL <= K; k += VL) {
    v16 acc = vload_as(w, base + k, w_bf16);
    for (int j = 0; j < r; j++) acc += vset1(s * bn[j]) * vload(a + (int64_t)j * K + k);
    vstore_as(out, base + k, acc, out_bf16);
  }
  for (; k < K; k++) {
    float acc = w_bf16 ? bf16_float(((const uint16_t *)w)[base + k]) : ((const float *)w)[base + k];
    for (int j = 0; j < r; j++) acc += (s * bn[j]) * a[(int64_t)j * K + k];
    if (out_bf16)
      ((uint16_t *)out)[base + k] = float_bf16(acc);
    else
      ((float *)out)[base + k] = acc;
  }
}

/* A merged LoRA weight in one pass: out[n, :] = w[n, :] + sum_j (s b[n, j]) a[j, :] for w, out
   [N, K], b [N, r], a [r, K] (all contiguous; b, a float32; w and out each float32 or
   bfloat16 (w_bf16, out_bf16): accumulated in float32 and rounded once). torch's addmm copied
   w into out and then ran a rank-r GEMM over it (two passes over a weight-sized tensor); in
   bfloat16, a float32 product, its scaling, the add and the conversion were four. A float32 w
   into a bf16 out is bf16 mixed precision's merged weight: the float32 merge rounded once, in
   the pass that forms it. */
void tsr_lora_merge(const void *w, const float *b, const float *a, float s, void *out,
                    int64_t N, int K, int r, int w_bf16, int out_bf16, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; n++) {
    if (w_bf16 && out_bf16)
      lora_merge_row(w, b, a, s, out, n, K, r, 1, 1);
    else if (w_bf16)
      lora_merge_row(w, b, a, s, out, n, K, r, 1, 0);
    else if (out_bf16)
      lora_merge_row(w, b, a, s, out, n, K, r, 0, 1);
    else
      lora_merge_row(w, b, a, s, out, n, K, r, 0, 0);
  }
}

/* A LoRA group's adapter gradients, one pass over its output gradient dy and input x. A group is
   g members side by side in dy's N = off[g] columns (member m: columns off[m]..off[m+1], a
   multiple of 16 wide), each with rank r (a multiple of 8: the adapters' `rank` padded with
   zero ranks); bt [r, N] (row stride N + 16) receives the members' (s B_m)^T side by side
   (`lora_pack`, from the pointers bs). With x [rows, K] (K a multiple of 16), sa [g r, K] (row
   stride K + 16) receives the members' s A_m stacked (from the pointers as) and it computes
     xa[i, m r + k]  = x[i, :] . sa[m r + k, :]                      (s x A^T, [rows, g r])
     da[m r + k, :]  = sum over rows i of dyb[i, m r + k] x[i, :]     (dA, [g r, K])
   and without x (x == NULL) it takes xa as given; either way
     dyb[i, m r + k] = sum over member m's columns n of dy[i, n] bt[k, n]   (s dy B, [rows, g r])
     dbt[k, n]       = sum over rows i of xa[i, m(n) r + k] dy[i, n]        (dB_m^T, [r, N])
   and db [N, rank], dbt's first `rank` rows transposed: the members' dB_m stacked, each in the
   [N_m, rank] layout of its parameter.
   Each member meets only its own ranks (the block-diagonal GEMMs this replaces multiplied by
   g - 1 zero blocks as well, and read dy and x twice each). Rows go in fixed blocks of
   LORA_BLOCK, 256 columns at a time: a step's columns of the block's rows are read once from
   memory by the row products (3 rows at a time, the next 3 prefetched; bt's columns stay in
   L1) and again from cache by the sums over rows (48 columns x 8 ranks of accumulators over
   the block's rows), which land in the block's own slice of `partials`
   ([blocks, r (N + 16) + g r (K + 16)]; padded rows keep the 8 rank rows off the same cache
   sets when a width is a multiple of 1024) and are added in block order at the end: results do
   not depend on the thread count. */
#define LORA_BLOCK 64
_Static_assert(LORA_BLOCK == SWIGLU_BLOCK, "tsr_swiglu_backward_da shares the blocks");

/* Columns per step of the row products below: 8 ranks' 256 columns of bt (8 KiB) stay in L1
   while a block's rows pass over them (a whole member's width did not fit beside the rows). */
#define LORA_COLS 256

/* part[q][k] (+)= d_q[c0:c1] * bt[k, c0:c1] lane-wise for nq (1-3) rows d_q, k < 8 (bt row
   stride ldb); `ahead`: prefetch the line `ahead` floats past each row's. */
static inline __attribute__((always_inline)) void lora_row_products(
    int nq, const float *d0, const float *d1, const float *d2, const float *bt, int64_t ldb,
    int64_t c0, int64_t c1, v16 *part, int add, int64_t ahead) {
  v16 a0[8], a1[8], a2[8];
  for (int k = 0; k < 8; k++) {
    a0[k] = add ? part[k] : vset1(0.f);
    a1[k] = add && nq > 1 ? part[8 + k] : vset1(0.f);
    a2[k] = add && nq > 2 ? part[16 + k] : vset1(0.f);
  }
  for (int64_t n = c0; n < c1; n += VL) {
    v16 x0 = vload(d0 + n), x1 = nq > 1 ? vload(d1 + n) : x0, x2 = nq > 2 ? vload(d2 + n) : x0;
    if (ahead) {
      __builtin_prefetch(d0 + ahead + n);
      __builtin_prefetch(d1 + ahead + n);
      __builtin_prefetch(d2 + ahead + n);
    }
    for (int k = 0; k < 8; k++) {
      v16 b = vload(bt + k * ldb + n);
      a0[k] += x0 * b;
      if (nq > 1) a1[k] += x1 * b;
      if (nq > 2) a2[k] += x2 * b;
    }
  }
  for (int k = 0; k < 8; k++) {
    part[k] = a0[k];
    if (nq > 1) part[8 + k] = a1[k];
    if (nq > 2) part[16 + k] = a2[k];
  }
}

/* acc[k, n .. n + 16 nv) = sum over rows i0..i1 of xs[i ldx + k] d[i, n ..), k < 8: 8 ranks x
   nv vectors of accumulators in registers over all the rows. */
static inline __attribute__((always_inline)) void lora_sum_tile(
    int nv, const float *d, int64_t ldd, int64_t i0, int64_t i1, const float *xs, int ldx,
    float *acc, int64_t lda, int64_t n) {
  v16 c0[8], c1[8], c2[8];
  for (int k = 0; k < 8; k++) c0[k] = c1[k] = c2[k] = vset1(0.f);
  for (int64_t i = i0; i < i1; i++) {
    const float *di = d + i * ldd + n, *x = xs + i * ldx;
    v16 x0 = vload(di), x1 = nv > 1 ? vload(di + VL) : x0, x2 = nv > 2 ? vload(di + 2 * VL) : x0;
    for (int k = 0; k < 8; k++) {
      v16 s = vset1(x[k]);
      c0[k] += s * x0;
      if (nv > 1) c1[k] += s * x1;
      if (nv > 2) c2[k] += s * x2;
    }
  }
  for (int k = 0; k < 8; k++) {
    vstore(acc + k * lda + n, c0[k]);
    if (nv > 1) vstore(acc + k * lda + n + VL, c1[k]);
    if (nv > 2) vstore(acc + k * lda + n + 2 * VL, c2[k]);
  }
}

/* acc[k, c0:c1] = sum over rows i0..i1 of xs[i ldx + k] d[i, c0:c1], k < 8 (c1 - c0 a multiple
   of 16), 48 columns at a time. */
static void lora_sum_rows(const float *d, int64_t ldd, int64_t i0, int64_t i1, const float *xs,
                          int ldx, float *acc, int64_t lda, int64_t c0, int64_t c1) {
  int64_t n = c0;
  for (; n + 3 * VL <= c1; n += 3 * VL) lora_sum_tile(3, d, ldd, i0, i1, xs, ldx, acc, lda, n);
  if (c1 - n == 2 * VL) lora_sum_tile(2, d, ldd, i0, i1, xs, ldx, acc, lda, n);
  else if (c1 - n == VL) lora_sum_tile(1, d, ldd, i0, i1, xs, ldx, acc, lda, n);
}

/* out[i ldo + k] = d[i, c0:c1] . bt[k, c0:c1] for rows i0..i1 (at most LORA_BLOCK) of d (row
   stride ldd), k < 8: LORA_COLS columns at a time over all the rows, each lane's sum in column
   order in `part` (a row's 8 vectors), reduced across lanes at the end. With xs, each column
   step also adds acc[k, step] = sum over the rows of xs[i ldx + k] d[i, step] (`lora_sum_rows`)
   while the step's columns of the rows are in cache: d is read from memory once even when a
   block's rows do not fit in L2 (a vocabulary-wide logit gradient). */
static void lora_rows_times(const float *d, int64_t ldd, int64_t i0, int64_t i1, const float *bt,
                            int64_t ldb, int64_t c0, int64_t c1, float *out, int ldo,
                            const float *xs, int ldx, float *acc, int64_t lda) {
  v16 part[LORA_BLOCK * 8];
  for (int64_t cc = c0; cc < c1; cc += LORA_COLS) {
    int64_t ce = cc + LORA_COLS < c1 ? cc + LORA_COLS : c1;
    int add = cc > c0;
    int64_t i = i0;
    for (; i + 3 <= i1; i += 3)
      lora_row_products(3, d + i * ldd, d + (i + 1) * ldd, d + (i + 2) * ldd, bt, ldb, cc, ce,
                        part + (i - i0) * 8, add, i + 6 <= i1 ? 3 * ldd : 0);
    if (i1 - i == 2)
      lora_row_products(2, d + i * ldd, d + (i + 1) * ldd, d, bt, ldb, cc, ce, part + (i - i0) * 8, add, 0);
    else if (i1 - i == 1)
      lora_row_products(1, d + i * ldd, d, d, bt, ldb, cc, ce, part + (i - i0) * 8, add, 0);
    if (xs) lora_sum_rows(d, ldd, i0, i1, xs, ldx, acc, lda, cc, ce);
  }
  for (int64_t i = i0; i < i1; i++)
    for (int k = 0; k < 8; k++) out[i * ldo + k] = vhsum(part[(i - i0) * 8 + k]);
}

/* A LoRA group as tsr_lora_grads takes it (engine/adapter_grads.py mirrors it). */
struct tsr_lora_group {
  const int64_t *off;
  int g, r, rank;
  float s;
  const float *const *bs, *const *as;
  float *bt;
  const float *x;
  int64_t ldx;
  int K;
  float *sa, *xa, *dyb, *partials, *dbt, *db, *da;
};

/* The kernel's padded operands from the adapters as they are: bt [r, N + 16] = s B^T (member m's
   B_m [N_m, rank] in columns off[m]..off[m + 1]) and, with x, sa [g, r, K + 16] = s A_m (A_m
   [rank, K]); the ranks rank..r and the 16 padding columns zero. */
static void lora_pack(const struct tsr_lora_group *G) {
  const int64_t *off = G->off;
  const int g = G->g, r = G->r, rank = G->rank, K = G->K;
  const int64_t LD = off[g] + 16, LK = K + 16;
  for (int k = 0; k < r; k++) {
    float *row = G->bt + (int64_t)k * LD;
    for (int m = 0; m < g; m++)
      for (int64_t c = 0; c < off[m + 1] - off[m]; c++)
        row[off[m] + c] = k < rank ? G->bs[m][c * rank + k] * G->s : 0.f;
    memset(row + off[g], 0, 16 * sizeof(float));
  }
  if (G->x)
    for (int m = 0; m < g; m++)
      for (int k = 0; k < r; k++) {
        float *row = G->sa + ((int64_t)m * r + k) * LK;
        for (int j = 0; j < K; j++) row[j] = k < rank ? G->as[m][(int64_t)k * K + j] * G->s : 0.f;
        memset(row + K, 0, 16 * sizeof(float));
      }
}

static int64_t lora_slot(const struct tsr_lora_group *G) {
  return (int64_t)G->r * (G->off[G->g] + 16) + (G->x ? (int64_t)G->g * G->r * (G->K + 16) : 0);
}

/* One block of rows i0..i1 of tsr_lora_grads, into the block's slice of G->partials. */
static void lora_block(const float *dy, int64_t ldy, const struct tsr_lora_group *G, int64_t blk,
                       int64_t i0, int64_t i1) {
  const int64_t LD = G->off[G->g] + 16, LK = G->K + 16;
  const int r = G->r, gr = G->g * r;
  float *acc = G->partials + blk * lora_slot(G), *acc_a = acc + (int64_t)r * LD;
  if (G->x)
    for (int k0 = 0; k0 < gr; k0 += 8)
      lora_rows_times(G->x, G->ldx, i0, i1, G->sa + (int64_t)k0 * LK, LK, 0, G->K, G->xa + k0, gr,
                      NULL, 0, NULL, 0);
  for (int m = 0; m < G->g; m++)
    for (int k0 = 0; k0 < r; k0 += 8) {
      int c = m * r + k0;
      lora_rows_times(dy, ldy, i0, i1, G->bt + (int64_t)k0 * LD, LD, G->off[m], G->off[m + 1],
                      G->dyb + c, gr, G->xa + c, gr, acc + (int64_t)k0 * LD, LD);
    }
  if (G->x)
    for (int k0 = 0; k0 < gr; k0 += 8)
      lora_sum_rows(G->x, G->ldx, i0, i1, G->dyb + k0, gr, acc_a + (int64_t)k0 * LK, LK, 0, G->K);
}

/* The blocks' partial sums added in block order into dbt and da, then db; worksharing loops
   for the threads of the enclosing parallel region. */
static void lora_finish(const struct tsr_lora_group *G, int64_t nblocks) {
  const int64_t N = G->off[G->g], LD = N + 16, LK = G->K + 16, slot = lora_slot(G);
  const int r = G->r, gr = G->g * r;
#pragma omp for schedule(static)
  for (int k = 0; k < r + (G->x ? gr : 0); k++) {
    if (k < r)
      sum_blocks(G->partials + (int64_t)k * LD, nblocks, slot, N, G->dbt + (int64_t)k * N);
    else
      sum_blocks(G->partials + r * LD + (int64_t)(k - r) * LK, nblocks, slot, G->K,
                 G->da + (int64_t)(k - r) * G->K);
  }
#pragma omp for schedule(static)
  for (int64_t c = 0; c < N; c++) /* db [N, rank]: each member's dB_m in its own layout */
    for (int k = 0; k < G->rank; k++) G->db[c * G->rank + k] = G->dbt[(int64_t)k * N + c];
}

void tsr_lora_grads(const float *dy, int64_t ldy, int64_t rows, const struct tsr_lora_group *G,
                    int threads) {
  lora_pack(G);
  const int64_t nblocks = (rows + LORA_BLOCK - 1) / LORA_BLOCK;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; blk++) {
      int64_t i0 = blk * LORA_BLOCK, i1 = i0 + LORA_BLOCK < rows ? i0 + LORA_BLOCK : rows;
      lora_block(dy, ldy, G, blk, i0, i1);
    }
    lora_finish(G, nblocks);
  }
}

/* The SwiGLU gradient and dA of the down projection (see SWIGLU_BLOCK), and with G (NULL: none),
   in the same pass, tsr_lora_grads for the gate/up projections' group G (members gate and up,
   columns 0..n and n..2n of gate_up): each block's gradient rows [d_gate | d_up], just written
   over gate_up, go through the group's products while they are in cache, instead of a second
   pass that reads the [rows, 2n] gradient back from memory. The same blocks, sums and order as
   the two passes apart: the same bits. */
void tsr_swiglu_backward_da(float *gate_up, const float *dh, int64_t rows, int n, const float *yb,
                            int r, float *partials, float *da, const struct tsr_lora_group *G,
                            int threads) {
  if (G) lora_pack(G);
  const int64_t nblocks = (rows + SWIGLU_BLOCK - 1) / SWIGLU_BLOCK;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; blk++) {
      int64_t i0 = blk * SWIGLU_BLOCK, end = i0 + SWIGLU_BLOCK < rows ? i0 + SWIGLU_BLOCK : rows;
      swiglu_block(gate_up, dh, i0, end, n, yb, r, partials + blk * (int64_t)r * n);
      if (G) lora_block(gate_up, 2 * (int64_t)n, G, blk, i0, end);
    }
#pragma omp for schedule(static)
    for (int k = 0; k < r; k++)
      sum_blocks(partials + (int64_t)k * n, nblocks, (int64_t)r * n, n, da + (int64_t)k * n);
    if (G) lora_finish(G, nblocks);
  }
}

/* Causal self-attention (grouped-query heads) in float32 for a CPU, forward and backward,
   flash-style: scores are formed one [64 x 64] block at a time and never stored whole; the
   forward keeps a per-row logsumexp, the backward recomputes each block's probabilities.

   Part of tinker_sr (engine/native.py builds it with the machine's C compiler, at first use,
   with -O3 -march=native -fopenmp). Written with GCC/Clang vector extensions: 16-float vectors
   that the compiler maps to AVX-512, AVX2 or whatever the CPU has. Every block product goes
   through one register-blocked kernel (`gemm_nn`: blocks of 6 (then 4) rows x 64 columns of
   accumulators; `gemm_tn_from` for a transposed left operand, read in place; `gemm_nn_lower`
   for the scores of a block on the causal diagonal, which forms only the 16-column vectors
   some row of each strip sees). A block's left operand (the queries, dO) usually comes from
   memory and its rows lie 256 B-2 KB apart: each strip prefetches the next strip's rows
   (measured: the forward's Q K^T ran at ~150 GFLOP/s on one core without, ~210 with).
   Parallel over independent units (forward: a head's block of 64 queries; backward: a batch
   row's KV head, which owns its keys' and its query heads' gradients), each computed whole
   by one thread: results do not depend on the thread count or the schedule.

   Layouts (all float32, C-contiguous; Tp >= T rounded up to 64, padding zero-filled; the
   caller adds 16 so a transposed row's stride is not a power of two, which mapped every row
   of a block product's operand to the same few L1 sets):
     q   [B, H, T, D]    kt [B, KV, D, Tp] (K transposed)
     v   (b, g) rows at v + b vb + g vh, row stride vt: the V slice of the q/k/v projection's
         output read in place where T % 16 == 0 (no product then reads a row past T), else a
         zero-padded copy vp [B, KV, Tp, D] (`tsr_attention_kt`)
     o   [B, T, H, D]    (the output: heads side by side, as the output projection reads it)
     lse [B, H, Tp]      logsumexp of each query's scaled scores
   D must be a multiple of 16 and H a multiple of KV. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define BR 64   /* query rows per block */
#define BC 64   /* key rows per block */

/* A 6 x 64 block of C (+)= A B: 24 accumulators in vector registers, 4 for the row of B,
   A's entries broadcast from memory. ~250 GFLOP/s on one core of the AMD EPYC we measure on
   (operands in L1), against ~200 for a 4 x 64 block (fewer products per load of B). */
#define ROW6(M) M(0) M(1) M(2) M(3) M(4) M(5)
static inline void block_6x64(int k, const float *A, int lda, const float *B, int ldb, float *C,
                              int ldc, int accumulate) {
#define DECL(r) v16 c##r##0, c##r##1, c##r##2, c##r##3;
  ROW6(DECL)
#undef DECL
  if (accumulate) {
#define LOAD(r) c##r##0 = vload(C + (size_t)(r) * ldc); c##r##1 = vload(C + (size_t)(r) * ldc + 16); \
    c##r##2 = vload(C + (size_t)(r) * ldc + 32); c##r##3 = vload(C + (size_t)(r) * ldc + 48);
    ROW6(LOAD)
#undef LOAD
  } else {
#define ZERO(r) c##r##0 = c##r##1 = c##r##2 = c##r##3 = vset1(0.f);
    ROW6(ZERO)
#undef ZERO
  }
  for (int p = 0; p < k; p++) {
    const float *b = B + (size_t)p * ldb;
    v16 b0 = vload(b), b1 = vload(b + 16), b2 = vload(b + 32), b3 = vload(b + 48);
#define FMA(r) { v16 a = vset1(A[(size_t)(r) * lda + p]); \
    c##r##0 += a * b0; c##r##1 += a * b1; c##r##2 += a * b2; c##r##3 += a * b3; }
    ROW6(FMA)
#undef FMA
  }
#define STORE(r) vstore(C + (size_t)(r) * ldc, c##r##0); vstore(C + (size_t)(r) * ldc + 16, c##r##1); \
  vstore(C + (size_t)(r) * ldc + 32, c##r##2); vstore(C + (size_t)(r) * ldc + 48, c##r##3);
  ROW6(STORE)
#undef STORE
}

/* Rows r0..min(r1, m) of A (k floats each) toward the cache: the next 6-row strip's left
   operand (see the top of the file). */
static inline void prefetch_rows(const float *A, int lda, int r0, int r1, int m, int k) {
  for (int r = r0; r < r1 && r < m; r++)
    for (int p = 0; p < k; p += 16) __builtin_prefetch(A + (size_t)r * lda + p, 0, 3);
}

/* C[m x n] (+)= A[m x k] (lda) * B[k x n] (ldb), C ldc; n % 16 == 0. */
static void gemm_nn(int m, int n, int k, const float *A, int lda, const float *B, int ldb,
                    float *C, int ldc, int accumulate) {
  for (int j0 = 0; j0 < n; j0 += 64) {
    int nv = (n - j0) >= 64 ? 4 : (n - j0) / VL;
    int i = 0;
    if (nv == 4)
      for (; i + 6 <= m; i += 6) {
        if (j0 == 0) prefetch_rows(A, lda, i + 6, i + 12, m, k);
        block_6x64(k, A + (size_t)i * lda, lda, B + j0, ldb, C + (size_t)i * ldc + j0, ldc, accumulate);
      }
    for (; i + 4 <= m; i += 4) {
      v16 acc[4][4];
      for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++)
          acc[r][c] = (accumulate && c < nv) ? vload(C + (size_t)(i + r) * ldc + j0 + c * VL) : vset1(0.f);
      const float *a0 = A + (size_t)i * lda;
      if (nv == 4) {
        for (int p = 0; p < k; p++) {
          const float *b = B + (size_t)p * ldb + j0;
          v16 b0 = vload(b), b1 = vload(b + 16), b2 = vload(b + 32), b3 = vload(b + 48);
          for (int r = 0; r < 4; r++) {
            v16 a = vset1(a0[(size_t)r * lda + p]);
            acc[r][0] += a * b0; acc[r][1] += a * b1; acc[r][2] += a * b2; acc[r][3] += a * b3;
          }
        }
      } else {
        for (int p = 0; p < k; p++) {
          const float *b = B + (size_t)p * ldb + j0;
          for (int r = 0; r < 4; r++) {
            v16 a = vset1(a0[(size_t)r * lda + p]);
            for (int c = 0; c < nv; c++) acc[r][c] += a * vload(b + c * VL);
          }
        }
      }
      for (int r = 0; r < 4; r++)
        for (int c = 0; c < nv; c++) vstore(C + (size_t)(i + r) * ldc + j0 + c * VL, acc[r][c]);
    }
    for (; i < m; i++) {
      v16 acc[4];
      for (int c = 0; c < nv; c++) acc[c] = accumulate ? vload(C + (size_t)i * ldc + j0 + c * VL) : vset1(0.f);
      for (int p = 0; p < k; p++) {
        v16 a = vset1(A[(size_t)i * lda + p]);
        for (int c = 0; c < nv; c++) acc[c] += a * vload(B + (size_t)p * ldb + j0 + c * VL);
      }
      for (int c = 0; c < nv; c++) vstore(C + (size_t)i * ldc + j0 + c * VL, acc[c]);
    }
  }
}

/* One R x (16 nv) block of C (+)= A B, R <= 6 rows and nv <= 4 vectors, the left operand's
   entry (r, p) at A[r ar + p ap] and broadcast: block_6x64's chain of fused multiply-adds over
   p per entry. ar = lda, ap = 1: A as stored; ar = 1, ap = lda: A stored transposed ([k x m]),
   so a block's broadcasts for one p come from one row of it. `accumulate`: C's values first. */
static inline __attribute__((always_inline)) void block_rk(int R, int nv, int k, const float *A,
                                                           size_t ar, size_t ap, const float *B,
                                                           int ldb, float *C, int ldc,
                                                           int accumulate) {
  v16 c[6][4];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < nv; j++)
      c[r][j] = accumulate ? vload(C + (size_t)r * ldc + j * VL) : vset1(0.f);
  for (int p = 0; p < k; p++) {
    const float *b = B + (size_t)p * ldb;
    v16 bv[4];
    for (int j = 0; j < nv; j++) bv[j] = vload(b + j * VL);
    for (int r = 0; r < R; r++) {
      v16 av = vset1(A[r * ar + p * ap]);
      for (int j = 0; j < nv; j++) c[r][j] += av * bv[j];
    }
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < nv; j++) vstore(C + (size_t)r * ldc + j * VL, c[r][j]);
}

/* block_rk(R, nv, ...) for R and nv known only at run time (variables of those names): one
   copy specialised per pair. */
#define BLOCK_RK_NV(RR, ...) \
  switch (nv) { \
    case 4: block_rk(RR, 4, __VA_ARGS__); break; \
    case 3: block_rk(RR, 3, __VA_ARGS__); break; \
    case 2: block_rk(RR, 2, __VA_ARGS__); break; \
    default: block_rk(RR, 1, __VA_ARGS__); break; \
  }
#define BLOCK_RK(...) \
  switch (R) { \
    case 6: BLOCK_RK_NV(6, __VA_ARGS__) break; \
    case 5: BLOCK_RK_NV(5, __VA_ARGS__) break; \
    case 4: BLOCK_RK_NV(4, __VA_ARGS__) break; \
    case 3: BLOCK_RK_NV(3, __VA_ARGS__) break; \
    case 2: BLOCK_RK_NV(2, __VA_ARGS__) break; \
    default: BLOCK_RK_NV(1, __VA_ARGS__) break; \
  }

/* C = A B (n <= 64, n % 16 == 0) where only C's entries (i, j) with j <= i + shift are wanted
   (the scores of a block on the causal diagonal): each 6-row strip computes the 16-column
   vectors up to its last row's last wanted column and leaves the rest of C unwritten. The
   entries it writes are gemm_nn's, bit for bit. */
static void gemm_nn_lower(int m, int n, int k, const float *A, int lda, const float *B, int ldb,
                          float *C, int ldc, int shift) {
  for (int i = 0; i < m; i += 6) {
    int R = m - i < 6 ? m - i : 6;
    int need = i + R + shift; /* columns [0, need) */
    int nv = (need + VL - 1) / VL;
    nv = nv > n / VL ? n / VL : nv;
    if (nv <= 0) continue;
    const float *a = A + (size_t)i * lda;
    float *c = C + (size_t)i * ldc;
    prefetch_rows(A, lda, i + 6, i + 12, m, k);
    BLOCK_RK(k, a, (size_t)lda, 1, B, ldb, c, ldc, 0)
  }
}

/* gemm_nn (accumulating) for an A whose row i is zero beyond column i + shift: the blocks on
   the causal diagonal. Strips of 6 rows (gemm_nn's row block) stop their sums at the strip's
   last nonzero column rather than adding the zero terms (c + 0 * b == c), so results are the
   same bit for bit, with ~45 % fewer multiply-adds on such a block. */
static void gemm_nn_band(int m, int n, int k, const float *A, int lda, const float *B, int ldb,
                         float *C, int ldc, int shift) {
  for (int i = 0; i < m; i += 6) {
    int rows = m - i < 6 ? m - i : 6;
    int end = i + rows + shift;
    end = end < 0 ? 0 : end > k ? k : end;
    gemm_nn(rows, n, end, A + (size_t)i * lda, lda, B, ldb, C + (size_t)i * ldc, ldc, 1);
  }
}

/* Forward: q, kt, v in; o and lse out. */
int tsr_attention_forward(const float *q, const float *kt, const float *v, int64_t vb, int64_t vh,
              int64_t vt, float *o, float *lse, int B, int H, int KV, int T, int Tp, int D,
              float scale, int nthreads) {
  int nqb = (T + BR - 1) / BR;
  int units = B * H * nqb;
  int group = H / KV;
  int failed = 0;
#pragma omp parallel num_threads(nthreads)
  {
    float *S = aligned_alloc(64, sizeof(float) * BR * BC);
    float *O = aligned_alloc(64, sizeof(float) * BR * D);
    if (!S || !O) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp barrier
    if (failed) goto done_forward; /* every thread sees the flag after the barrier */
    memset(S, 0, sizeof(float) * BR * BC); /* a diagonal block leaves entries unformed */
    float m[BR] __attribute__((aligned(64))), l[BR];
#pragma omp for schedule(dynamic, 1)
    for (int u = 0; u < units; u++) {
      int qb = nqb - 1 - (u % nqb);          /* big (late) blocks first */
      int bh = u / nqb, b = bh / H, h = bh % H, g = h / group;
      int i0 = qb * BR, rows = T - i0 < BR ? T - i0 : BR;
      const float *Q = q + ((size_t)bh * T + i0) * D;
      const float *Kt = kt + ((size_t)b * KV + g) * D * Tp;
      const float *V = v + (int64_t)b * vb + (int64_t)g * vh;
      for (int r = 0; r < rows; r++) { m[r] = -INFINITY; l[r] = 0.f; }
      memset(O, 0, sizeof(float) * BR * D);
      int kend = i0 + rows; /* keys < kend */
      for (int j0 = 0; j0 < kend; j0 += BC) {
        int cols = kend - j0 < BC ? kend - j0 : BC;
        int colsp = (cols + VL - 1) / VL * VL;
        int diagonal = j0 + BC > i0; /* only the block on the diagonal needs the causal mask */
        if (diagonal) /* the scores past each strip's last key are left unformed */
          gemm_nn_lower(rows, colsp, D, Q, D, Kt + j0, Tp, S, BC, i0 - j0);
        else
          gemm_nn(rows, colsp, D, Q, D, Kt + j0, Tp, S, BC, 0);
        const v16 lane = {0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15};
        const v16 ninf = vset1(-INFINITY), sc = vset1(scale);
        float mnew[BR] __attribute__((aligned(64))), alpha[BR] __attribute__((aligned(64)));
        for (int r = 0; r < rows; r++) {
          float *s = S + r * BC;
          v16 mxv = vset1(m[r]);
          if (diagonal) {
            v16 lim = vset1((float)(i0 + r - j0)); /* keys up to column lim (inclusive) */
            for (int c = 0; c < colsp; c += VL) {
              v16 x = vsel(lane + (float)c > lim, ninf, vload(s + c) * sc);
              vstore(s + c, x);
              mxv = vsel(x > mxv, x, mxv);
            }
          } else {
            for (int c = 0; c < colsp; c += VL) {
              v16 x = vload(s + c) * sc;
              vstore(s + c, x);
              mxv = vsel(x > mxv, x, mxv);
            }
          }
          mnew[r] = vhmax(mxv);
        }
        for (int r = 0; r < rows; r += VL) { /* alpha = exp(m_old - m_new), 16 rows at once */
          v16 mo = vload(m + r), mn = vload(mnew + r);
          vstore(alpha + r, vexp(mo - mn));
        }
        for (int r = 0; r < rows; r++) {
          float *s = S + r * BC;
          v16 sum = vset1(0.f), mv = vset1(mnew[r]);
          /* On the diagonal, row r's vectors past its last key are all masked: zeros, no exp
             (the band product below reads up to its 6-row strip's last key). */
          int cend = diagonal && (i0 + r - j0) / VL * VL + VL < colsp ? (i0 + r - j0) / VL * VL + VL : colsp;
          int c = 0;
          for (; c < cend; c += VL) { v16 p = vexp(vload(s + c) - mv); vstore(s + c, p); sum += p; }
          for (; c < colsp; c += VL) vstore(s + c, vset1(0.f));
          l[r] = l[r] * alpha[r] + vhsum(sum); m[r] = mnew[r];
          if (alpha[r] != 1.f) { v16 av = vset1(alpha[r]); for (int d = 0; d < D; d += VL) vstore(O + r * D + d, vload(O + r * D + d) * av); }
        }
        if (diagonal) /* P's row r is zero beyond key column i0 + r - j0 */
          gemm_nn_band(rows, D, colsp, S, BC, V + (int64_t)j0 * vt, (int)vt, O, D, i0 - j0);
        else
          gemm_nn(rows, D, colsp, S, BC, V + (int64_t)j0 * vt, (int)vt, O, D, 1);
      }
      for (int r = 0; r < rows; r++) {
        float inv = 1.f / l[r];
        float *dst = o + (((size_t)b * T + i0 + r) * H + h) * D;
        v16 iv = vset1(inv);
        for (int d = 0; d < D; d += VL) vstore(dst + d, vload(O + r * D + d) * iv);
        lse[(size_t)bh * Tp + i0 + r] = m[r] + logf(l[r]);
      }
    }
  done_forward:
    free(S); free(O);
  }
  return failed ? -1 : 0; /* -1: out of memory for the per-thread blocks, nothing computed */
}

/* One 16 x 16 block: dst[i * ldd + j] = src[j * lds + i], in registers. Four stages, each
   exchanging one bit of the row index with the same bit of the column index between row
   pairs (i, i + b), b = 8, 4, 2, 1: 64 lane shuffles in all instead of 256 scalar moves. */
#define IDX_LO8 0,1,2,3,4,5,6,7,16,17,18,19,20,21,22,23
#define IDX_HI8 8,9,10,11,12,13,14,15,24,25,26,27,28,29,30,31
#define IDX_LO4 0,1,2,3,16,17,18,19,8,9,10,11,24,25,26,27
#define IDX_HI4 4,5,6,7,20,21,22,23,12,13,14,15,28,29,30,31
#define IDX_LO2 0,1,16,17,4,5,20,21,8,9,24,25,12,13,28,29
#define IDX_HI2 2,3,18,19,6,7,22,23,10,11,26,27,14,15,30,31
#define IDX_LO1 0,16,2,18,4,20,6,22,8,24,10,26,12,28,14,30
#define IDX_HI1 1,17,3,19,5,21,7,23,9,25,11,27,13,29,15,31
#define STAGE(b) \
  for (int i = 0; i < 16; i++) \
    if (!(i & b)) { \
      v16 lo = __builtin_shufflevector(r[i], r[i + b], IDX_LO##b); \
      v16 hi = __builtin_shufflevector(r[i], r[i + b], IDX_HI##b); \
      r[i] = lo; r[i + b] = hi; \
    }
static inline void transpose16(float *dst, int64_t ldd, const float *src, int64_t lds) {
  v16 r[16];
  for (int i = 0; i < 16; i++) r[i] = vload(src + i * lds);
  STAGE(8) STAGE(4) STAGE(2) STAGE(1)
  for (int i = 0; i < 16; i++) vstore(dst + i * ldd, r[i]);
}

/* dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols: whole 16 x 16 blocks in
   registers, the edges one float at a time. */
static void transpose(float *dst, int64_t ldd, const float *src, int64_t lds, int rows, int cols) {
  int r0 = 0;
  for (; r0 + 16 <= rows; r0 += 16) {
    int c0 = 0;
    for (; c0 + 16 <= cols; c0 += 16)
      transpose16(dst + (size_t)c0 * ldd + r0, ldd, src + (size_t)r0 * lds + c0, lds);
    for (int r = r0; r < r0 + 16; r++)
      for (int c = c0; c < cols; c++) dst[(size_t)c * ldd + r] = src[(size_t)r * lds + c];
  }
  for (int r = r0; r < rows; r++)
    for (int c = 0; c < cols; c++) dst[(size_t)c * ldd + r] = src[(size_t)r * lds + c];
}

static void transpose_into(float *dst, int Tp, const float *src, int64_t ld, int T, int D) {
  /* dst[d * Tp + t] = src[t * ld + d] for t < T; dst[d * Tp + t] = 0 for T <= t < Tp */
  transpose(dst, Tp, src, ld, T, D);
  for (int d = 0; d < D; d++) memset(dst + (size_t)d * Tp + T, 0, sizeof(float) * (Tp - T));
}

/* The forward's key operands, zero-padded: kt [N, D, Tp] = K^T from k [N, T, D] (N = B x KV)
   and, unless vp is NULL (V read in place), vp [N, Tp, D] from v, whose element (b, h, t, d)
   is at v + b sb + h sh + t st + d (any strides: the V slice of the q/k/v projection's
   output, read in place). */
void tsr_attention_kt(const float *k, float *kt, int N, int T, int Tp, int D, const float *v,
                      int64_t sb, int64_t sh, int64_t st, int KV, float *vp, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int n = 0; n < N; n++) {
    transpose_into(kt + (size_t)n * D * Tp, Tp, k + (size_t)n * T * D, D, T, D);
    if (!vp) continue;
    const float *src = v + (int64_t)(n / KV) * sb + (int64_t)(n % KV) * sh;
    float *dst = vp + (size_t)n * Tp * D;
    for (int t = 0; t < T; t++) memcpy(dst + (size_t)t * D, src + (int64_t)t * st, sizeof(float) * D);
    memset(dst + (size_t)T * D, 0, sizeof(float) * (size_t)(Tp - T) * D);
  }
}

/* C += A^T B (accumulating; A stored [k x m], lda) where A^T's row i is zero before column
   i + shift (P and dS on the diagonal, as seen from the keys; a shift <= -m: no zeros): each
   6-row strip starts its sum at the strip's first nonzero column (c + 0 * b == c: the same
   bits as the whole sum). n % 16 == 0. */
static void gemm_tn_from(int m, int n, int k, const float *A, int lda, const float *B, int ldb,
                         float *C, int ldc, int shift) {
  for (int i = 0; i < m; i += 6) {
    int R = m - i < 6 ? m - i : 6;
    int p0 = i + shift;
    p0 = p0 < 0 ? 0 : p0 > k ? k : p0;
    int kk = k - p0;
    const float *a = A + (size_t)p0 * lda + i, *b = B + (size_t)p0 * ldb;
    for (int j0 = 0; j0 < n; j0 += 64) {
      int nv = (n - j0) >= 64 ? 4 : (n - j0) / VL;
      const float *bj = b + j0;
      float *c = C + (size_t)i * ldc + j0;
      BLOCK_RK(kk, a, 1, (size_t)lda, bj, ldb, c, ldc, 1) /* A^T: the transposed block_rk */
    }
  }
}

/* One query's row of a block in backward: P = exp(S scale - lse) over the keys it sees
   (columns c <= lim, c < cols) and dS = P (dP - rowsum(dO * O)) scale, in place of S and dP;
   zeros elsewhere (vectors wholly past lim on the diagonal: no exp). */
static inline void score_grads_row(float *s, float *dp, int lim, int cols, int colsp,
                                   int diagonal, float lse, float dl, float scale) {
  const v16 lane = {0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15};
  v16 last = vset1((float)(lim < cols - 1 ? lim : cols - 1));
  v16 lr = vset1(lse), dlv = vset1(dl), sc = vset1(scale);
  int cend = diagonal && lim / VL * VL + VL < colsp ? lim / VL * VL + VL : colsp;
  int c = 0;
  for (; c < cend; c += VL) {
    v16 p = vexp(vload(s + c) * sc - lr);
    p = vsel(lane + (float)c <= last, p, vset1(0.f));
    vstore(s + c, p);
    vstore(dp + c, p * (vload(dp + c) - dlv) * sc);
  }
  for (; c < colsp; c += VL) {
    vstore(s + c, vset1(0.f));
    vstore(dp + c, vset1(0.f));
  }
}

/* Backward, in score space: each unit (a batch row's KV head) lays out K^T and V^T once in
   buffers of its own (shared by its query heads); per query head and block pair it forms
   S = Q K^T and dP = dO V^T ([queries x keys]), then P and dS in place, and accumulates
   dV += P^T dO, dK += dS^T Q (products with a transposed left operand: no block is ever
   transposed) and dQ += dS K straight into dq's rows. q [B,H,T,D], k [B,KV,T,D], v as in the
   forward, go and o [B,T,H,D] (the output's gradient and the output), lse [B,H,Tp]. Out: dq
   [B,H,T,D], dk and dv [B,KV,T,D], each sum over (query head, block) in a fixed order. */
int tsr_attention_backward(const float *q, const float *k, const float *v, int64_t vb,
              int64_t vh, int64_t vt, const float *go, const float *o, const float *lse,
              float *dq, float *dk, float *dv, int B, int H, int KV, int T, int Tp, int D,
              float scale, int nthreads) {
  int group = H / KV, units = B * KV, failed = 0;
  size_t plane = (size_t)D * Tp;
#pragma omp parallel num_threads(nthreads)
  {
    float *S = aligned_alloc(64, sizeof(float) * BR * BC);  /* S, then P */
    float *dP = aligned_alloc(64, sizeof(float) * BR * BC); /* dP, then dS */
    float *Kt = aligned_alloc(64, sizeof(float) * plane);
    float *Vt = aligned_alloc(64, sizeof(float) * plane);
    float *Dl = aligned_alloc(64, sizeof(float) * Tp);
    if (!S || !dP || !Kt || !Vt || !Dl) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp barrier
    if (failed) goto done_backward; /* every thread sees the flag after the barrier */
#pragma omp for schedule(dynamic, 1)
    for (int u = 0; u < units; u++) {
      int b = u / KV, g = u % KV;
      const float *K = k + ((size_t)b * KV + g) * T * D;
      const float *V = v + (int64_t)b * vb + (int64_t)g * vh; /* rows < T only */
      float *dK = dk + ((size_t)b * KV + g) * T * D, *dV = dv + ((size_t)b * KV + g) * T * D;
      transpose_into(Kt, Tp, K, D, T, D);
      transpose_into(Vt, Tp, V, vt, T, D);
      memset(dK, 0, sizeof(float) * T * D);
      memset(dV, 0, sizeof(float) * T * D);
      for (int h = g * group; h < (g + 1) * group; h++) {
        size_t bh = (size_t)b * H + h;
        const float *Q = q + bh * T * D, *L = lse + bh * Tp;
        const float *goh = go + ((size_t)b * T * H + h) * D, *oh = o + ((size_t)b * T * H + h) * D;
        const int64_t ldo = (int64_t)H * D;
        float *dQ = dq + bh * T * D;
        memset(dQ, 0, sizeof(float) * T * D);
        for (int t = 0; t < T; t++) {
          v16 acc = vset1(0.f);
          for (int d = 0; d < D; d += VL)
            acc += vload(goh + (size_t)t * ldo + d) * vload(oh + (size_t)t * ldo + d);
          Dl[t] = vhsum(acc);
        }
        for (int j0 = 0; j0 < T; j0 += BC) {
          int cols = T - j0 < BC ? T - j0 : BC;
          int colsp = (cols + VL - 1) / VL * VL;
          for (int i0 = (j0 / BR) * BR; i0 < T; i0 += BR) {
            int rows = T - i0 < BR ? T - i0 : BR;
            int diagonal = j0 + BC > i0;
            if (diagonal) {
              gemm_nn_lower(rows, colsp, D, Q + (size_t)i0 * D, D, Kt + j0, Tp, S, BC, i0 - j0);
              gemm_nn_lower(rows, colsp, D, goh + (size_t)i0 * ldo, (int)ldo, Vt + j0, Tp, dP, BC,
                            i0 - j0);
            } else {
              gemm_nn(rows, colsp, D, Q + (size_t)i0 * D, D, Kt + j0, Tp, S, BC, 0);
              gemm_nn(rows, colsp, D, goh + (size_t)i0 * ldo, (int)ldo, Vt + j0, Tp, dP, BC, 0);
            }
            for (int r = 0; r < rows; r++) /* query i0 + r sees keys up to j0 + lim */
              score_grads_row(S + r * BC, dP + r * BC, i0 + r - j0, cols, colsp, diagonal,
                              L[i0 + r], Dl[i0 + r], scale);
            /* dV += P^T dO, dK += dS^T Q: on the diagonal, P's and dS's column c is zero
               before query c + j0 - i0. */
            gemm_tn_from(cols, D, rows, S, BC, goh + (size_t)i0 * ldo, (int)ldo,
                         dV + (size_t)j0 * D, D, diagonal ? j0 - i0 : -BR);
            gemm_tn_from(cols, D, rows, dP, BC, Q + (size_t)i0 * D, D, dK + (size_t)j0 * D, D,
                         diagonal ? j0 - i0 : -BR);
            /* dQ += dS K; on the diagonal dS's row r is zero beyond key r + i0 - j0. */
            if (diagonal)
              gemm_nn_band(rows, D, cols, dP, BC, K + (size_t)j0 * D, D, dQ + (size_t)i0 * D, D,
                           i0 - j0);
            else
              gemm_nn(rows, D, cols, dP, BC, K + (size_t)j0 * D, D, dQ + (size_t)i0 * D, D, 1);
          }
        }
      }
    }
  done_backward:
    free(S); free(dP); free(Kt); free(Vt); free(Dl);
  }
  return failed ? -1 : 0;
}

/* Qwen3.5's gated delta rule: the chunked form's batched triangular solves and the decode step.

   Batched solves with small unit lower triangular matrices (the chunked form: `batch` systems
   of n x n, n = 64, each with m right-hand sides), in one OpenMP region.

   torch's CPU triangular solve calls the BLAS once per matrix of the batch, and MKL opens a
   parallel region in each call: with OpenMP's passive waits (engine/cpu.py) every region wakes
   the other threads, and 256 solves of 64 x 64 took ~16 ms instead of ~1.5. Here each matrix
   is solved whole by one thread by substitution, its sums in a fixed order, so results do not
   depend on the thread count or the schedule.

   Only the strictly lower part of L is read (its diagonal is taken as ones). X = L^-1 B, or
   with `transposed`, X = L^-T B (back substitution with the transpose, which the gradient
   needs). L is [batch, n, n], B and X [batch, n, m], all contiguous; X may not alias B. Zero
   coefficients are skipped: the rows the gated delta rule zeroes cost nothing.

   Part of tinker_sr (engine/native.py builds it; engine/delta_native.py calls it). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Below this many multiply-adds (about 2 n^2 m per matrix: ~0.1 ms of one core) a kernel
   runs on the calling thread alone: waking the other threads (passive OpenMP waits) would cost
   more than it saves, as for a tiny model's heads. */
#define PARALLEL_WORK (1 << 20)

#define DEFINE_SOLVE(T, NAME)                                                                  \
  void NAME(const T *L, const T *B, T *X, int64_t batch, int n, int m, int transposed,         \
            int threads) {                                                                     \
    const int parallel = (int64_t)n * n * m * batch >= PARALLEL_WORK;                          \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (parallel)")            \
    for (int64_t b = 0; b < batch; b++) {                                                      \
      const T *l = L + b * n * n;                                                              \
      const T *rhs = B + b * n * m;                                                            \
      T *x = X + b * n * m;                                                                    \
      memcpy(x, rhs, sizeof(T) * (size_t)n * (size_t)m);                                       \
      if (!transposed) {                                                                       \
        for (int i = 1; i < n; i++) {                                                          \
          T *xi = x + (int64_t)i * m;                                                          \
          for (int j = 0; j < i; j++) {                                                        \
            const T c = l[(int64_t)i * n + j];                                                 \
            const T *xj = x + (int64_t)j * m;                                                  \
            if (c != 0)                                                                        \
              for (int k = 0; k < m; k++) xi[k] -= c * xj[k];                                  \
          }                                                                                    \
        }                                                                                      \
      } else {                                                                                 \
        for (int i = n - 2; i >= 0; i--) {                                                     \
          T *xi = x + (int64_t)i * m;                                                          \
          for (int j = n - 1; j > i; j--) {                                                    \
            const T c = l[(int64_t)j * n + i];                                                 \
            const T *xj = x + (int64_t)j * m;                                                  \
            if (c != 0)                                                                        \
              for (int k = 0; k < m; k++) xi[k] -= c * xj[k];                                  \
          }                                                                                    \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
  }

DEFINE_SOLVE(float, tsr_unit_lower_solve_f32)
DEFINE_SOLVE(double, tsr_unit_lower_solve_f64)

/* The gated delta rule over whole sequences, position by position (training and prefill), for
   `pairs` (row, value head) pairs, forward and backward. Per position t of a pair:

     S' = S exp(g_t)   r = S'^T k_t   d = beta_t (v_t - r)   S = S' + k_t d^T   o_t = S^T q_t scale

   (a decay under exp(floor) is zero). The chunked (WY) form turns the positions of a chunk into
   small matrix products and triangular solves; on a CPU those run far below the machine's rate
   at these sizes (64 x 64) and every op of the form is a parallel region. Here each pair runs
   in one thread, position by position, its state in cache (16 KB at 64 x 64), and all pairs in
   one OpenMP region: a pair's results do not depend on the thread count or the pairs beside it.

   Layouts (contiguous): q, k [pairs, steps, dk]; v, out [pairs, steps, dv]; g, beta [pairs,
   steps]; state0 (NULL: zeros), final [pairs, dk, dv]; saved (NULL: none) [pairs, chunks, dk,
   dv], the state before positions 0, chunk, 2 chunk, ... for backward, which recomputes each
   chunk's states from them. dv <= 1024. Flush-to-zero and denormals-are-zero are on inside the
   kernels: the decayed state of a fast head would otherwise reach float32's subnormal range,
   whose arithmetic x86 does in slow microcode. Each pair's work is a function inlined once for
   widths of 64 and of 128 (Qwen3.5's), whose loops the compiler then unrolls, and once for any
   other width (`WIDTHS`). */
#if defined(__SSE__)
#include <xmmintrin.h>
#define FAST_DENORMALS_BEGIN                                                                   \
  const unsigned int saved_csr = _mm_getcsr();                                                 \
  _mm_setcsr(saved_csr | 0x8040u);
#define FAST_DENORMALS_END _mm_setcsr(saved_csr);
#else
#define FAST_DENORMALS_BEGIN
#define FAST_DENORMALS_END
#endif

#define INLINE static inline __attribute__((always_inline))
/* 64-byte vectors passed between inlined functions expose no ABI (GCC warns of one where the
   CPU has no AVX-512) */
#pragma GCC diagnostic ignored "-Wpsabi"

/* CALL(SUF, dk, dv) with literal widths where they are 64 or 128 (each an inlined copy). */
#define WIDTHS(CALL, SUF)                                                                      \
  do {                                                                                         \
    if (dk == 64 && dv == 64)                                                                  \
      CALL(SUF, 64, 64);                                                                       \
    else if (dk == 128 && dv == 128)                                                           \
      CALL(SUF, 128, 128);                                                                     \
    else                                                                                       \
      CALL(SUF, dk, dv);                                                                       \
  } while (0)

/* The forward takes a state's columns in blocks of COLUMN_BLOCK where they divide into them,
   else all at once (fwd_pair; a constant at the literal widths WIDTHS inlines). */
#ifndef TSR_RULE_NARROW
#define COLUMN_BLOCK 64
#else /* the forward as before session 46 (a benchmark's baseline): whole rows, 256 bits */
#define COLUMN_BLOCK 1024
#endif
#define COLUMNS_OF(DV) ((DV) % COLUMN_BLOCK == 0 ? COLUMN_BLOCK : (DV))

/* The forward and the decode step with 512-bit vectors where the CPU has them: GCC's
   auto-vectorizer prefers 256 bits on Intel's AVX-512 cores unless told, and these loops have
   no sums across a vector's lanes, so the width changes no result (measured: the forward
   0.82x at 64 x 64, with the column blocks 0.57x at 128 x 128). The backward's loops end each
   row in such sums and ran slower at 512 bits. */
#if defined(__GNUC__) && !defined(__clang__) && !defined(TSR_RULE_NARROW)
#define WIDE_VECTORS __attribute__((target("prefer-vector-width=512")))
#else
#define WIDE_VECTORS
#endif

/* Pair p of tsr_delta_rule_fwd / _bwd at widths DK x DV (their locals). */
#define FWD_PAIR(SUF, DK, DV)                                                                  \
  fwd_pair_##SUF(q + i * dk, k + i * dk, v + i * dv, g + i, beta + i, s0, out + i * dv,        \
                 final + p * size, kept, steps, DK, DV, COLUMNS_OF(DV), chunk, scale, floor,   \
                 read, delta, blk)
#define BWD_PAIR(SUF, DK, DV)                                                                  \
  bwd_pair_##SUF(q + i * dk, k + i * dk, v + i * dv, g + i, beta + i, kept, dout + i * dv,     \
                 d_final, dq + i * dk, dk_ + i * dk, dv_ + i * dv, dg + i, dbeta + i,          \
                 dstate0 + p * size, steps, DK, DV, chunk, sub, scale, floor, work)

#define DEFINE_RULE(T, EXP, SUF)                                                               \
  /* A position's r and d without advancing the state s. */                                    \
  INLINE void rule_read_##SUF(const T *restrict s, const T *restrict kt, const T *restrict vt, \
                              T decay, T bt, T *restrict read, T *restrict delta, int dk,      \
                              int dv) {                                                        \
    for (int b = 0; b < dv; b++) read[b] = 0;                                                  \
    for (int a = 0; a < dk; a++) {                                                             \
      const T *sa = s + (int64_t)a * dv;                                                       \
      const T ka = kt[a];                                                                      \
      _Pragma("omp simd") for (int b = 0; b < dv; b++) {                                       \
        const T decayed = sa[b] * decay;                                                       \
        read[b] += decayed * ka;                                                               \
      }                                                                                        \
    }                                                                                          \
    _Pragma("omp simd") for (int b = 0; b < dv; b++) delta[b] = (vt[b] - read[b]) * bt;        \
  }                                                                                            \
                                                                                               \
  /* One position: s advanced in place, o_t into ot, r and d into read and delta. The state's  \
     rows lie ld apart: dv of its columns (a column block, see fwd_pair) or all of them. */    \
  INLINE void rule_step_##SUF(T *restrict s, const T *restrict qt, const T *restrict kt,       \
                              const T *restrict vt, T decay, T bt, T *restrict ot,             \
                              T *restrict read, T *restrict delta, int dk, int dv, int64_t ld, \
                              T scale) {                                                       \
    for (int b = 0; b < dv; b++) read[b] = 0;                                                  \
    for (int a = 0; a < dk; a++) {                                                             \
      T *sa = s + (int64_t)a * ld;                                                             \
      const T ka = kt[a];                                                                      \
      _Pragma("omp simd") for (int b = 0; b < dv; b++) {                                       \
        sa[b] *= decay;                                                                        \
        read[b] += sa[b] * ka;                                                                 \
      }                                                                                        \
    }                                                                                          \
    _Pragma("omp simd") for (int b = 0; b < dv; b++) {                                         \
      delta[b] = (vt[b] - read[b]) * bt;                                                       \
      ot[b] = 0;                                                                               \
    }                                                                                          \
    for (int a = 0; a < dk; a++) {                                                             \
      T *sa = s + (int64_t)a * ld;                                                             \
      const T ka = kt[a], qa = qt[a] * scale;                                                  \
      _Pragma("omp simd") for (int b = 0; b < dv; b++) {                                       \
        sa[b] += ka * delta[b];                                                                \
        ot[b] += sa[b] * qa;                                                                   \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
                                                                                               \
  /* rule_step's state out of place and without o_t (the backward's recomputed states): next   \
     from prev, the same operations in the same order, so the same bits. */                    \
  INLINE void rule_next_##SUF(T *restrict next, const T *restrict prev, const T *restrict kt,  \
                              const T *restrict vt, T decay, T bt, T *restrict read,           \
                              T *restrict delta, int dk, int dv) {                             \
    for (int b = 0; b < dv; b++) read[b] = 0;                                                  \
    for (int a = 0; a < dk; a++) {                                                             \
      const T *pa = prev + (int64_t)a * dv;                                                    \
      T *na = next + (int64_t)a * dv;                                                          \
      const T ka = kt[a];                                                                      \
      _Pragma("omp simd") for (int b = 0; b < dv; b++) {                                       \
        na[b] = pa[b] * decay;                                                                 \
        read[b] += na[b] * ka;                                                                 \
      }                                                                                        \
    }                                                                                          \
    _Pragma("omp simd") for (int b = 0; b < dv; b++) delta[b] = (vt[b] - read[b]) * bt;        \
    for (int a = 0; a < dk; a++) {                                                             \
      T *na = next + (int64_t)a * dv;                                                          \
      const T ka = kt[a];                                                                      \
      _Pragma("omp simd") for (int b = 0; b < dv; b++) na[b] += ka * delta[b];                 \
    }                                                                                          \
  }                                                                                            \
                                                                                               \
  INLINE T rule_decay_##SUF(T gt, T floor) { return gt < floor ? (T)0 : EXP(gt); }             \
                                                                                               \
  /* n rows of w values: dst's rows ldd apart, src's lds apart (a column block in or out). */  \
  INLINE void copy_columns_##SUF(T *dst, int64_t ldd, const T *src, int64_t lds, int n, int w) { \
    for (int a = 0; a < n; a++)                                                                \
      memcpy(dst + (int64_t)a * ldd, src + (int64_t)a * lds, sizeof(T) * (size_t)w);           \
  }                                                                                            \
                                                                                               \
  /* Pair p's positions in order: s (its final state) from state0, out, the saved states.      \
     Each column of the state, with its entries of r, d and o_t, evolves on its own, so with   \
     a buffer blk (dk x w) the columns run in blocks of w, each block copied out, taken through \
     all positions while it sits in L1 (Qwen3.5's 128 x 128 state is 64 KB, a 128 x 64 block   \
     32 KB; read in place, its rows 512 B apart would share a quarter of L1's sets) and copied \
     back: the same operations in the same order per column, so the same bits as one pass of   \
     all columns a position (blk NULL). */                                                     \
  INLINE void fwd_pair_##SUF(const T *q, const T *k, const T *v, const T *g, const T *beta,    \
                             const T *state0, T *out, T *s, T *saved, int64_t steps, int dk,   \
                             int dv, int w, int chunk, T scale, T floor, T *read, T *delta,    \
                             T *blk) {                                                         \
    const int64_t size = (int64_t)dk * dv;                                                     \
    if (state0)                                                                                \
      memcpy(s, state0, sizeof(T) * (size_t)size);                                             \
    else                                                                                       \
      memset(s, 0, sizeof(T) * (size_t)size);                                                  \
    if (!blk || w >= dv) { /* whole rows (literal widths in both branches: unrolled loops) */  \
      for (int64_t t = 0; t < steps; t++) {                                                    \
        if (saved && t % chunk == 0)                                                           \
          memcpy(saved + (t / chunk) * size, s, sizeof(T) * (size_t)size);                     \
        rule_step_##SUF(s, q + t * dk, k + t * dk, v + t * dv, rule_decay_##SUF(g[t], floor),  \
                        beta[t], out + t * dv, read, delta, dk, dv, dv, scale);                \
      }                                                                                        \
      return;                                                                                  \
    }                                                                                          \
    for (int b0 = 0; b0 < dv; b0 += w) {                                                       \
      copy_columns_##SUF(blk, w, s + b0, dv, dk, w);                                           \
      for (int64_t t = 0; t < steps; t++) {                                                    \
        if (saved && t % chunk == 0)                                                           \
          copy_columns_##SUF(saved + (t / chunk) * size + b0, dv, blk, w, dk, w);              \
        rule_step_##SUF(blk, q + t * dk, k + t * dk, v + t * dv + b0,                          \
                        rule_decay_##SUF(g[t], floor), beta[t], out + t * dv + b0, read, delta, \
                        dk, w, w, scale);                                                      \
      }                                                                                        \
      copy_columns_##SUF(s + b0, dv, blk, w, dk, w);                                           \
    }                                                                                          \
  }                                                                                            \
                                                                                               \
  WIDE_VECTORS void tsr_delta_rule_fwd_##SUF(                                                  \
      const T *q, const T *k, const T *v, const T *g, const T *beta, const T *state0, T *out,  \
      T *final, T *saved, int64_t pairs, int64_t steps, int dk, int dv, int chunk, T scale,    \
      T floor, int threads) {                                                                  \
    const int64_t chunks = (steps + chunk - 1) / chunk, size = (int64_t)dk * dv;               \
    const int parallel = 4 * pairs * steps * size >= PARALLEL_WORK;                            \
    _Pragma("omp parallel num_threads(threads) if (parallel)") {                               \
      FAST_DENORMALS_BEGIN                                                                     \
      T read[1024], delta[1024];                                                               \
      T *blk = COLUMN_BLOCK < dv ? malloc(sizeof(T) * (size_t)dk * COLUMN_BLOCK) : NULL;       \
      _Pragma("omp for schedule(static)") for (int64_t p = 0; p < pairs; p++) {                \
        const int64_t i = p * steps;                                                           \
        const T *s0 = state0 ? state0 + p * size : NULL;                                       \
        T *kept = saved ? saved + p * chunks * size : NULL;                                    \
        WIDTHS(FWD_PAIR, SUF);                                                                 \
      }                                                                                        \
      free(blk);                                                                               \
      FAST_DENORMALS_END                                                                       \
    }                                                                                          \
  }

/* The backward in explicit vectors (delta_vectors.h: 64 bytes with AVX-512, 32 with AVX2).
   GCC vectorized its loops at 256 bits, each of a row's four sums in one register (a chain of
   dependent adds, then summed across its lanes alone), and each recomputed state was copied
   and then stepped in two more passes over it. Here the rows' sums are reduced a vector's
   lanes of rows at a time (vsums) and a recomputed state is made in one pass
   (rule_advance_v); session 47 measured the backward at ~0.6x the time at widths 64 and 128
   with AVX-512, ~0.7x with an AVX2 build. Without AVX2 the loops stay GCC's. */
#include "delta_vectors.h"

#if !defined(TSR_RULE_PLAIN_BACKWARD) && (VBYTES == 64 || defined(__AVX2__))
/* Does the backward run in vec_SUF: dk and dv multiples of its lanes, dv at most 128 float32
   or 64 float64 (a row's sums and reads kept in at most MOST_VECTORS vectors)? */
#define VECTORS(SUF, DK, DV)                                                                   \
  ((DK) % LANES_##SUF == 0 && (DV) % LANES_##SUF == 0 && (DV) <= MOST_VECTORS * LANES_##SUF)
#else
#define VECTORS(SUF, DK, DV) 0
#endif
#ifndef TSR_RULE_PLAIN_BACKWARD
/* The backward's recomputed state where it does not run in vectors: next from prev */
#define RULE_NEXT(SUF, next, prev, kt, vt, decay, bt, r, d, dk, dv, qt, scratch, scale)        \
  ((void)(qt), (void)(scratch), rule_next_##SUF(next, prev, kt, vt, decay, bt, r, d, dk, dv))
#else /* the backward as before session 47 (a benchmark's baseline): copied, then stepped */
#define RULE_NEXT(SUF, next, prev, kt, vt, decay, bt, r, d, dk, dv, qt, scratch, scale)        \
  do {                                                                                         \
    memcpy(next, prev, sizeof(*next) * (size_t)(dk) * (size_t)(dv));                           \
    rule_step_##SUF(next, qt, kt, vt, decay, bt, scratch, r, d, dk, dv, dv, scale);            \
  } while (0)
#endif

#define DEFINE_RULE_BACKWARD(T, EXP, SUF)                                                      \
  /* Position t back through o = S^T q scale and S = S' + k d^T, S the state after t (formed   \
     from prev, the state before it, and delta): ds gains q dO^T; writes dq and the first part \
     of dk, and ddelta, the gradient of d. */                                                  \
  INLINE void back_out_##SUF(T *restrict ds, const T *restrict prev, T decay,                  \
                             const T *restrict qt, const T *restrict kt,                       \
                             const T *restrict delta, const T *restrict dot, T *restrict dqt,  \
                             T *restrict dkt, T *restrict ddelta, int dk, int dv, T scale) {   \
    for (int b = 0; b < dv; b++) ddelta[b] = 0;                                                \
    for (int a = 0; a < dk; a++) {                                                             \
      const T *pa = prev + (int64_t)a * dv;                                                    \
      T *da = ds + (int64_t)a * dv;                                                            \
      const T ka = kt[a], qa = qt[a] * scale;                                                  \
      T dq = 0, dkk = 0;                                                                       \
      _Pragma("omp simd reduction(+ : dq, dkk)") for (int b = 0; b < dv; b++) {                \
        const T s_ab = pa[b] * decay + ka * delta[b];                                          \
        dq += s_ab * dot[b];                                                                   \
        da[b] += qa * dot[b];                                                                  \
        dkk += da[b] * delta[b];                                                               \
        ddelta[b] += da[b] * ka;                                                               \
      }                                                                                        \
      dqt[a] = dq * scale;                                                                     \
      dkt[a] = dkk;                                                                            \
    }                                                                                          \
  }                                                                                            \
                                                                                               \
  /* Through d = beta (v - r): dv, the gradient of beta, and ddelta turned into that of r. */  \
  INLINE T back_delta_##SUF(const T *vt, const T *read, T bt, T *dvt, T *ddelta, int dv) {     \
    T db = 0;                                                                                  \
    _Pragma("omp simd reduction(+ : db)") for (int b = 0; b < dv; b++) {                       \
      db += ddelta[b] * (vt[b] - read[b]);                                                     \
      dvt[b] = bt * ddelta[b];                                                                 \
      ddelta[b] = -bt * ddelta[b];                                                             \
    }                                                                                          \
    return db;                                                                                 \
  }                                                                                            \
                                                                                               \
  /* Position t back through r = S'^T k and S' = S exp(g) (prev: the state before t, dr the    \
     gradient of r): ds becomes the gradient of prev; adds to dk; returns that of the decay.   \
     With a previous position u = t - 1 (qu not NULL), its back_out runs in the same pass over \
     the rows (the state after u is prev), accumulating u's ddelta into ddu. */                \
  INLINE T back_state_##SUF(T *restrict ds, const T *restrict prev, T decay,                   \
                            const T *restrict kt, const T *restrict dr, T *restrict dkt,       \
                            const T *restrict qu, const T *restrict ku, const T *restrict du,  \
                            const T *restrict dou, T *restrict dqu, T *restrict dku,           \
                            T *restrict ddu, int dk, int dv, T scale) {                        \
    T dd = 0;                                                                                  \
    if (qu)                                                                                    \
      for (int b = 0; b < dv; b++) ddu[b] = 0;                                                 \
    for (int a = 0; a < dk; a++) {                                                             \
      const T *pa = prev + (int64_t)a * dv;                                                    \
      T *da = ds + (int64_t)a * dv;                                                            \
      const T ka = kt[a];                                                                      \
      T dkk = 0, dda = 0;                                                                      \
      if (!qu) {                                                                               \
        _Pragma("omp simd reduction(+ : dkk, dda)") for (int b = 0; b < dv; b++) {             \
          const T decayed_grad = da[b] + ka * dr[b];                                           \
          dkk += pa[b] * decay * dr[b];                                                        \
          dda += decayed_grad * pa[b];                                                         \
          da[b] = decayed_grad * decay;                                                        \
        }                                                                                      \
      } else {                                                                                 \
        const T kua = ku[a], qua = qu[a] * scale;                                              \
        T dq = 0, dkacc = 0;                                                                   \
        _Pragma("omp simd reduction(+ : dkk, dda, dq, dkacc)") for (int b = 0; b < dv; b++) {  \
          const T decayed_grad = da[b] + ka * dr[b];                                           \
          dkk += pa[b] * decay * dr[b];                                                        \
          dda += decayed_grad * pa[b];                                                         \
          const T g_after = decayed_grad * decay + qua * dou[b];                               \
          dq += pa[b] * dou[b];                                                                \
          dkacc += g_after * du[b];                                                            \
          ddu[b] += g_after * kua;                                                             \
          da[b] = g_after;                                                                     \
        }                                                                                      \
        dqu[a] = dq * scale;                                                                   \
        dku[a] = dkacc;                                                                        \
      }                                                                                        \
      dkt[a] += dkk;                                                                           \
      dd += dda;                                                                               \
    }                                                                                          \
    return dd;                                                                                 \
  }                                                                                            \
                                                                                               \
  /* A position's state recomputed in vec_##SUF (dv = n vectors, VECTORS) and read: cur, the   \
     state before it, from prev, the one before that (kp, dp, dc: that position's k, d and     \
     decay; kp NULL: cur is already there), then r and d into read and delta. One pass over the \
     state where rule_step makes two, reading one state and writing one; the same operations   \
     per entry as rule_step (the decay's product computed again), so the same bits. */         \
  INLINE void rule_advance_v_##SUF(const T *restrict prev, T *restrict cur, const T *restrict kp, \
                                   const T *restrict dp, T dc, const T *restrict kt,           \
                                   const T *restrict vt, T decay, T bt, T *restrict read,      \
                                   T *restrict delta, int dk, int dv) {                        \
    const int n = dv / LANES_##SUF;                                                            \
    vec_##SUF r[MOST_VECTORS] = {0}, d[MOST_VECTORS] = {0};                                    \
    for (int i = 0; i < n && kp; i++) d[i] = vload_##SUF(dp + i * LANES_##SUF);                \
    for (int a = 0; a < dk; a++) {                                                             \
      const T ka = kt[a], kpa = kp ? kp[a] : 0;                                                \
      _Pragma("GCC unroll 16") for (int i = 0; i < n; i++) {                                   \
        const int64_t at = (int64_t)a * dv + i * LANES_##SUF;                                  \
        vec_##SUF s;                                                                           \
        if (kp) {                                                                              \
          const vec_##SUF before = vround_##SUF(vload_##SUF(prev + at) * dc);                  \
          s = before + kpa * d[i];                                                             \
          vstore_##SUF(cur + at, s);                                                           \
        } else {                                                                               \
          s = vload_##SUF(cur + at);                                                           \
        }                                                                                      \
        const vec_##SUF decayed = s * decay;                                                   \
        r[i] += decayed * ka;                                                                  \
      }                                                                                        \
    }                                                                                          \
    for (int i = 0; i < n; i++) {                                                              \
      d[i] = (vload_##SUF(vt + i * LANES_##SUF) - r[i]) * bt;                                  \
      vstore_##SUF(read + i * LANES_##SUF, r[i]);                                              \
      vstore_##SUF(delta + i * LANES_##SUF, d[i]);                                             \
    }                                                                                          \
  }                                                                                            \
                                                                                               \
  /* back_state with a previous position (qu, ...) in vec_##SUF (VECTORS: dv is n vectors, dk  \
     a multiple of their lanes): the rows taken a vector's lanes at a time, their sums reduced \
     together (vsums); the decay's gradient kept a vector per column block until the end. */   \
  INLINE T back_state_v_##SUF(T *restrict ds, const T *restrict prev, T decay,                 \
                              const T *restrict kt, const T *restrict dr, T *restrict dkt,     \
                              const T *restrict qu, const T *restrict ku, const T *restrict du, \
                              const T *restrict dou, T *restrict dqu, T *restrict dku,         \
                              T *restrict ddu, int dk, int dv, T scale) {                      \
    enum { L = LANES_##SUF };                                                                  \
    const int n = dv / L;                                                                      \
    vec_##SUF sda[MOST_VECTORS] = {0}, ddv[MOST_VECTORS] = {0};                                \
    for (int a0 = 0; a0 < dk; a0 += L) {                                                       \
      vec_##SUF skk[L], sq[L], sku[L];                                                         \
      for (int row = 0; row < L; row++) {                                                      \
        const int a = a0 + row;                                                                \
        const T *pa = prev + (int64_t)a * dv;                                                  \
        T *da = ds + (int64_t)a * dv;                                                          \
        const T ka = kt[a], kua = ku[a], qua = qu[a] * scale;                                  \
        vec_##SUF ck = {0}, cq = {0}, cu = {0};                                                \
        _Pragma("GCC unroll 16") for (int i = 0; i < n; i++) {                                 \
          const int b = i * L;                                                                 \
          const vec_##SUF p = vload_##SUF(pa + b), r = vload_##SUF(dr + b);                    \
          const vec_##SUF o = vload_##SUF(dou + b);                                            \
          const vec_##SUF grad = vload_##SUF(da + b) + ka * r;                                 \
          const vec_##SUF after = grad * decay + qua * o;                                      \
          ck += p * r;                                                                         \
          sda[i] += grad * p;                                                                  \
          cq += p * o;                                                                         \
          cu += after * vload_##SUF(du + b);                                                   \
          ddv[i] += after * kua;                                                               \
          vstore_##SUF(da + b, after);                                                         \
        }                                                                                      \
        skk[row] = ck;                                                                         \
        sq[row] = cq;                                                                          \
        sku[row] = cu;                                                                         \
      }                                                                                        \
      vstore_##SUF(dkt + a0, vload_##SUF(dkt + a0) + vsums_##SUF(skk) * decay);                \
      vstore_##SUF(dqu + a0, vsums_##SUF(sq) * scale);                                         \
      vstore_##SUF(dku + a0, vsums_##SUF(sku));                                                \
    }                                                                                          \
    for (int i = 1; i < n; i++) sda[0] += sda[i];                                              \
    for (int i = 0; i < n; i++) vstore_##SUF(ddu + i * L, ddv[i]);                             \
    T dd = 0; /* once a position: its lanes in order */                                        \
    for (int i = 0; i < L; i++) dd += sda[0][i];                                               \
    return dd;                                                                                 \
  }                                                                                            \
                                                                                               \
  /* The positions t0 .. t0 + n - 1 back, from the state before t0 (start): their states       \
     recomputed into work (n states, then n r and d vectors), then ds taken back through them, \
     each position's second pass fused with the first of the one before it. dd: two dv. */     \
  INLINE void bwd_run_##SUF(const T *q, const T *k, const T *v, const T *g, const T *beta,     \
                            const T *start, const T *dout, T *dq, T *dk_, T *dv_, T *dg,       \
                            T *dbeta, T *ds, int64_t t0, int64_t n, int dk, int dv, T scale,   \
                            T floor, T *work, T *dd, T *scratch) {                             \
    const int64_t size = (int64_t)dk * dv;                                                     \
    T *reads = work + n * size, *deltas = reads + n * dv;                                      \
    memcpy(work, start, sizeof(T) * (size_t)size);                                             \
    for (int64_t j = 0; j < n; j++) { /* work[j]: the state before position t0 + j */          \
      const int64_t t = t0 + j;                                                                \
      const T decay = rule_decay_##SUF(g[t], floor);                                           \
      T *r = reads + j * dv, *d = deltas + j * dv;                                             \
      T *cur = work + j * size;                                                                \
      if (VECTORS(SUF, dk, dv) && j == 0) /* a literal NULL: an inlined copy without the step */ \
        rule_advance_v_##SUF(NULL, cur, NULL, NULL, 0, k + t * dk, v + t * dv, decay, beta[t], r, \
                             d, dk, dv);                                                       \
      else if (VECTORS(SUF, dk, dv))                                                           \
        rule_advance_v_##SUF(cur - size, cur, k + (t - 1) * dk, deltas + (j - 1) * dv,         \
                             rule_decay_##SUF(g[t - 1], floor), k + t * dk, v + t * dv, decay, \
                             beta[t], r, d, dk, dv);                                           \
      else if (j + 1 == n) /* the last: only its r and d are needed */                         \
        rule_read_##SUF(work + j * size, k + t * dk, v + t * dv, decay, beta[t], r, d, dk, dv); \
      else                                                                                     \
        RULE_NEXT(SUF, work + (j + 1) * size, work + j * size, k + t * dk, v + t * dv, decay,  \
                  beta[t], r, d, dk, dv, q + t * dk, scratch, scale);                          \
    }                                                                                          \
    int64_t t = t0 + n - 1;                                                                    \
    back_out_##SUF(ds, work + (n - 1) * size, rule_decay_##SUF(g[t], floor), q + t * dk,       \
                   k + t * dk, deltas + (n - 1) * dv, dout + t * dv, dq + t * dk, dk_ + t * dk, \
                   dd + ((n - 1) % 2) * dv, dk, dv, scale);                                    \
    for (int64_t j = n - 1; j >= 0; j--, t--) {                                                \
      T *dr = dd + (j % 2) * dv, *du = dd + ((j + 1) % 2) * dv;                                \
      dbeta[t] = back_delta_##SUF(v + t * dv, reads + j * dv, beta[t], dv_ + t * dv, dr, dv);  \
      const T decay = rule_decay_##SUF(g[t], floor);                                           \
      const int64_t u = t - 1; /* the position before, fused where it is in this run */        \
      const int fuse = j > 0;                                                                  \
      T ddecay;                                                                                \
      if (fuse && VECTORS(SUF, dk, dv))                                                        \
        ddecay = back_state_v_##SUF(ds, work + j * size, decay, k + t * dk, dr, dk_ + t * dk,  \
                                    q + u * dk, k + u * dk, deltas + (j - 1) * dv, dout + u * dv, \
                                    dq + u * dk, dk_ + u * dk, du, dk, dv, scale);             \
      else                                                                                     \
        ddecay = back_state_##SUF(                                                             \
          ds, work + j * size, decay, k + t * dk, dr, dk_ + t * dk, fuse ? q + u * dk : NULL,  \
          fuse ? k + u * dk : NULL, fuse ? deltas + (j - 1) * dv : NULL,                       \
          fuse ? dout + u * dv : NULL, fuse ? dq + u * dk : NULL, fuse ? dk_ + u * dk : NULL, du, \
          dk, dv, scale);                                                                      \
      dg[t] = g[t] < floor ? (T)0 : ddecay * decay;                                            \
    }                                                                                          \
  }                                                                                            \
                                                                                               \
  /* Pair p's gradients, its chunks last to first, each from the state saved before it. A      \
     chunk's states are recomputed `sub` positions at a time (work holds `sub` of them: at most \
     4 MiB; for 64 positions of 128 x 128 float32, all of them), from states before every      \
     `sub`-th position recomputed first (kept in marks) where a chunk holds more. Smaller      \
     parts that fit a 2 MiB L2 measured no faster at 128 x 128 (an extra forward pass). */     \
  INLINE void bwd_pair_##SUF(const T *q, const T *k, const T *v, const T *g, const T *beta,    \
                             const T *saved, const T *dout, const T *dfinal, T *dq, T *dk_,    \
                             T *dv_, T *dg, T *dbeta, T *ds, int64_t steps, int dk, int dv,    \
                             int chunk, int sub, T scale, T floor, T *work) {                  \
    const int64_t size = (int64_t)dk * dv, chunks = (steps + chunk - 1) / chunk;               \
    const int64_t most = (chunk + sub - 1) / sub;                                              \
    T *marks = work + sub * (size + 2 * (int64_t)dv), *cur = marks + most * size;              \
    T *ddelta = cur + size, *scratch = ddelta + 2 * dv, *read = scratch + dv, *delta = read + dv; \
    if (dfinal)                                                                                \
      memcpy(ds, dfinal, sizeof(T) * (size_t)size);                                            \
    else                                                                                       \
      memset(ds, 0, sizeof(T) * (size_t)size);                                                 \
    for (int64_t c = chunks - 1; c >= 0; c--) {                                                \
      const int64_t t0 = c * chunk, n = steps - t0 < chunk ? steps - t0 : chunk;               \
      const int64_t parts = (n + sub - 1) / sub;                                               \
      if (parts > 1) { /* the states before positions t0, t0 + sub, ... */                     \
        memcpy(cur, saved + c * size, sizeof(T) * (size_t)size);                               \
        for (int64_t j = 0; j < (parts - 1) * sub; j++) {                                      \
          const int64_t t = t0 + j;                                                            \
          if (j % sub == 0) memcpy(marks + (j / sub) * size, cur, sizeof(T) * (size_t)size);   \
          rule_step_##SUF(cur, q + t * dk, k + t * dk, v + t * dv,                             \
                          rule_decay_##SUF(g[t], floor), beta[t], scratch, read, delta, dk, dv, \
                          dv, scale);                                                          \
        }                                                                                      \
        memcpy(marks + (parts - 1) * size, cur, sizeof(T) * (size_t)size);                     \
      }                                                                                        \
      for (int64_t part = parts - 1; part >= 0; part--) {                                      \
        const int64_t a = part * sub, m = n - a < sub ? n - a : sub;                           \
        const T *start = parts > 1 ? marks + part * size : saved + c * size;                   \
        bwd_run_##SUF(q, k, v, g, beta, start, dout, dq, dk_, dv_, dg, dbeta, ds, t0 + a, m, dk, \
                      dv, scale, floor, work, ddelta, scratch);                                \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
                                                                                               \
  /* Gradients of tsr_delta_rule_fwd from those of out (dout) and of final (dfinal; NULL:      \
     zeros), with the states it saved: dq, dk [pairs, steps, dk], dv [pairs, steps, dv], dg,   \
     dbeta [pairs, steps], dstate0 [pairs, dk, dv]. Returns 0, or -1 where a thread's work     \
     buffer (up to 4 MiB of recomputed states, see bwd_pair) could not be allocated. */        \
  int tsr_delta_rule_bwd_##SUF(const T *q, const T *k, const T *v, const T *g, const T *beta,  \
                               const T *saved, const T *dout, const T *dfinal, T *dq, T *dk_,  \
                               T *dv_, T *dg, T *dbeta, T *dstate0, int64_t pairs,             \
                               int64_t steps, int dk, int dv, int chunk, T scale, T floor,     \
                               int threads) {                                                  \
    const int64_t chunks = (steps + chunk - 1) / chunk, size = (int64_t)dk * dv;               \
    const int parallel = 12 * pairs * steps * size >= PARALLEL_WORK;                           \
    int sub = chunk; /* states recomputed at a time: at most 4 MiB of them per thread */       \
    while (sub > 1 && (int64_t)sub * size * (int64_t)sizeof(T) > (1 << 22)) sub /= 2;          \
    const int64_t marks = (chunk + sub - 1) / sub;                                             \
    const size_t work_size = sizeof(T) * (size_t)(sub * (size + 2 * (int64_t)dv) +             \
                                                  (marks + 1) * size + 5 * (int64_t)dv);       \
    int failed = 0;                                                                            \
    _Pragma("omp parallel num_threads(threads) if (parallel) reduction(| : failed)") {         \
      FAST_DENORMALS_BEGIN                                                                     \
      T *work = malloc(work_size);                                                             \
      failed = work == NULL;                                                                   \
      _Pragma("omp for schedule(static)") for (int64_t p = 0; p < pairs; p++) {                \
        if (!work) continue;                                                                   \
        const int64_t i = p * steps;                                                           \
        const T *kept = saved + p * chunks * size;                                             \
        const T *d_final = dfinal ? dfinal + p * size : NULL;                                  \
        WIDTHS(BWD_PAIR, SUF);                                                                 \
      }                                                                                        \
      free(work);                                                                              \
      FAST_DENORMALS_END                                                                       \
    }                                                                                          \
    return failed ? -1 : 0;                                                                    \
  }

DEFINE_RULE(float, expf, f32)
DEFINE_RULE(double, exp, f64)
DEFINE_RULE_BACKWARD(float, expf, f32)
DEFINE_RULE_BACKWARD(double, exp, f64)

/* One decode position of the gated delta rule for `heads` (row, value head) pairs, the state
   [heads, dk, dv] advanced in place: S = S exp(g); r = S^T k; S += k (beta (v - r))^T;
   out = S^T q * scale. q, k [heads, dk], v and out [heads, dv], g and beta [heads]; all
   contiguous float32; a decay under exp(floor) is zero (the chunked form's floor, hybrid.py).
   The rule's own position (rule_step). torch's elementwise form makes five passes over the
   whole state (each a parallel region) and copies it back; here each pair's state (16 KB at
   64 x 64) is read and written twice while in cache, all in one region. Pairs are
   independent: a row's values do not depend on the rows beside it (decode batches many
   requests). dv <= 1024. */
INLINE void step_pair(const float *q, const float *k, const float *v, float decay, float bt,
                      float *s, float *out, int dk, int dv, float scale) {
  float read[1024], delta[1024];
  rule_step_f32(s, q, k, v, decay, bt, out, read, delta, dk, dv, dv, scale);
}
#define STEP_PAIR(SUF, DK, DV)                                                                 \
  step_pair(q + h * dk, k + h * dk, v + h * dv, rule_decay_f32(g[h], floor), beta[h],          \
            state + h * dk * dv, out + h * dv, DK, DV, scale)

WIDE_VECTORS void tsr_gated_delta_step(const float *q, const float *k, const float *v,
                                       const float *g, const float *beta, float *state,
                                       float *out, int64_t heads, int dk, int dv, float scale,
                                       float floor, int threads) {
  const int parallel = 2 * heads * dk * dv >= PARALLEL_WORK / 16; /* a pass is memory-bound */
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
  for (int64_t h = 0; h < heads; h++) WIDTHS(STEP_PAIR, f32);
}

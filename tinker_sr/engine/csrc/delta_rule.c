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
#include <string.h>

/* Below this many multiply-adds (about 2 n^2 m per matrix: ~0.1 ms of one core) a kernel
   runs on the calling thread alone: waking the other threads (passive OpenMP waits) would cost
   more than it saves, as for a tiny model's heads. */
#define PARALLEL_WORK (1 << 20)

#define DEFINE_SOLVE(T, NAME)                                                                   \
  void NAME(const T *L, const T *B, T *X, int64_t batch, int n, int m, int transposed,         \
            int threads) {                                                                      \
    const int parallel = (int64_t)n * n * m * batch >= PARALLEL_WORK;                          \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (parallel)")            \
    for (int64_t b = 0; b < batch; b++) {                                                       \
      const T *l = L + b * n * n;                                                               \
      const T *rhs = B + b * n * m;                                                             \
      T *x = X + b * n * m;                                                                     \
      memcpy(x, rhs, sizeof(T) * (size_t)n * (size_t)m);                                        \
      if (!transposed) {                                                                        \
        for (int i = 1; i < n; i++) {                                                           \
          T *xi = x + (int64_t)i * m;                                                           \
          for (int j = 0; j < i; j++) {                                                         \
            const T c = l[(int64_t)i * n + j];                                                  \
            const T *xj = x + (int64_t)j * m;                                                   \
            if (c != 0)                                                                         \
              for (int k = 0; k < m; k++) xi[k] -= c * xj[k];                                   \
          }                                                                                     \
        }                                                                                       \
      } else {                                                                                  \
        for (int i = n - 2; i >= 0; i--) {                                                      \
          T *xi = x + (int64_t)i * m;                                                           \
          for (int j = n - 1; j > i; j--) {                                                     \
            const T c = l[(int64_t)j * n + i];                                                  \
            const T *xj = x + (int64_t)j * m;                                                   \
            if (c != 0)                                                                         \
              for (int k = 0; k < m; k++) xi[k] -= c * xj[k];                                   \
          }                                                                                     \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
  }

DEFINE_SOLVE(float, tsr_unit_lower_solve_f32)
DEFINE_SOLVE(double, tsr_unit_lower_solve_f64)

/* One decode position of the gated delta rule for `heads` (row, value head) pairs, the state
   [heads, dk, dv] advanced in place: S = S exp(g); r = S^T k; S += k (beta (v - r))^T;
   out = S^T q * scale. q, k [heads, dk], v and out [heads, dv], g and beta [heads]; all
   contiguous float32; a decay under exp(floor) is zero (the chunked form's floor, hybrid.py).
   torch's elementwise form makes five passes over the whole state (each a
   parallel region) and copies it back; here each pair's state (16 KB at 64 x 64) is read and
   written twice while in cache, all in one region. Pairs are independent: a row's values do
   not depend on the rows beside it (decode batches many requests). dv <= 1024. */
void tsr_gated_delta_step(const float *q, const float *k, const float *v, const float *g,
                          const float *beta, float *state, float *out, int64_t heads, int dk,
                          int dv, float scale, float floor, int threads) {
  const int parallel = 2 * heads * dk * dv >= PARALLEL_WORK / 16; /* a pass is memory-bound */
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
  for (int64_t h = 0; h < heads; h++) {
    float read[1024], delta[1024], o[1024];
    float *s = state + h * dk * dv;
    const float *qh = q + h * dk, *kh = k + h * dk, *vh = v + h * dv;
    const float decay = g[h] < floor ? 0.0f : expf(g[h]), bt = beta[h];
    for (int b = 0; b < dv; b++) read[b] = 0.0f;
    for (int a = 0; a < dk; a++) {
      float *sa = s + (int64_t)a * dv;
      const float ka = kh[a];
      for (int b = 0; b < dv; b++) {
        sa[b] *= decay;
        read[b] += sa[b] * ka;
      }
    }
    for (int b = 0; b < dv; b++) {
      delta[b] = (vh[b] - read[b]) * bt;
      o[b] = 0.0f;
    }
    for (int a = 0; a < dk; a++) {
      float *sa = s + (int64_t)a * dv;
      const float ka = kh[a], qa = qh[a] * scale;
      for (int b = 0; b < dv; b++) {
        sa[b] += ka * delta[b];
        o[b] += sa[b] * qa;
      }
    }
    memcpy(out + h * dv, o, sizeof(float) * (size_t)dv);
  }
}

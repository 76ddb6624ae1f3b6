/* Batched solves with small unit lower triangular matrices (Qwen3.5's chunked gated delta rule:
   `batch` systems of n x n, n = 64, each with m right-hand sides), in one OpenMP region.

   torch's CPU triangular solve calls the BLAS once per matrix of the batch, and MKL opens a
   parallel region in each call: with OpenMP's passive waits (engine/cpu.py) every region wakes
   the other threads, and 256 solves of 64 x 64 took ~16 ms instead of ~1.5. Here each matrix
   is solved whole by one thread by substitution, its sums in a fixed order, so results do not
   depend on the thread count or the schedule.

   Only the strictly lower part of L is read (its diagonal is taken as ones). X = L^-1 B, or
   with `transposed`, X = L^-T B (back substitution with the transpose, which the gradient
   needs). L is [batch, n, n], B and X [batch, n, m], all contiguous; X may not alias B.

   Part of tinker_sr (engine/native.py builds it; engine/tri_solve.py calls it). */
#include <stdint.h>
#include <string.h>

#define DEFINE_SOLVE(T, NAME)                                                                   \
  void NAME(const T *L, const T *B, T *X, int64_t batch, int n, int m, int transposed,         \
            int threads) {                                                                      \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                          \
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

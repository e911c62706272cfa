/* The chunked path's elementwise stages on the CPU, one row of scaled logits at a time.
 *
 * Built and loaded by fastpo/kernels/cpu_rows.py (compiled with cc -O3 -march=native -ffast-math
 * -fno-finite-math-only -fopenmp, linked without -ffast-math: no flush-to-zero). Each
 * row is read while it sits in a core's L2: the statistics are two passes over the row (max,
 * then exp-sum and the entropy's sum), the gradient one more; PyTorch's eager ops need about
 * ten passes and a call each. Rows are split over OpenMP threads and every row is summed by
 * one thread in one order, so the results do not depend on the thread count. -ffast-math lets
 * the compiler vectorize the sums (reassociation) and expf (glibc's libmvec); the numbers
 * match the eager path's within fp32 rounding, not bit for bit.
 *
 * z: [rows, V] fp32, row-major, row stride ld. t: [rows] int64 targets in [0, V).
 */
#include <math.h>
#include <stdint.h>

/* glibc's vector expf and logf (libmvec) for the loops below: math.h declares them only under
 * -ffinite-math-only, which would let the compiler assume no inf or NaN logits. Built
 * without FASTPO_VECTOR_EXP (no libmvec) the loops call the scalar ones. */
#ifdef FASTPO_VECTOR_EXP
#pragma omp declare simd notinbranch
extern float expf(float);
#pragma omp declare simd notinbranch
extern float logf(float);
#endif

/* Per row r, with m the row's max and s = sum exp(z - m): mx[r] = m, log_s[r] = log s,
 * lse[r] = m + log s, ent[r] = log s - sum exp(z - m) (z - m) / s (= lse - sum softmax z),
 * lp[r] = (z[t] - m) - log s. With store_exp the row is left holding exp(z - m) (for
 * fastpo_row_dz_exp: no second exp). */
void fastpo_row_stats(float *z, int64_t rows, int64_t V, int64_t ld, const int64_t *t,
                      float *mx, float *log_sum, float *lse, float *ent, float *lp, int store_exp, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float *row = z + r * ld;
        float m = -INFINITY;
        /* the simd reduction lets the compiler use vector max (it would not otherwise: the
         * ternary's NaN semantics); a NaN row gives a NaN lse either way */
#pragma omp simd reduction(max : m)
        for (int64_t v = 0; v < V; v++)
            m = row[v] > m ? row[v] : m;
        float s = 0.0f, sx = 0.0f;
        const float zt = row[t[r]];
        if (store_exp) {
            for (int64_t v = 0; v < V; v++) {
                float x = row[v] - m;
                float e = expf(x);
                s += e;
                sx += e * x;
                row[v] = e;
            }
        } else {
            for (int64_t v = 0; v < V; v++) {
                float x = row[v] - m;
                float e = expf(x);
                s += e;
                sx += e * x;
            }
        }
        float log_s = logf(s);
        mx[r] = m;
        log_sum[r] = log_s;
        lse[r] = m + log_s;
        ent[r] = log_s - sx / s;
        lp[r] = (zt - m) - log_s;
    }
}

/* In place on z: z[r, v] becomes d loss / d logits =
 *   inv_t * (g_lp[r] * 1[v = t[r]] - p_v (g_lp[r] + g_ent[r] (log p_v + ent[r])))
 * with log p_v = (z[r, v] - shift[r]) - log_norm[r] (shift the row max and log_norm log s from
 * the statistics, or shift = lse and log_norm = 0: the first keeps log p exact to rounding
 * where the logits are large); where g_ent[r] is 0 the log p factor drops. */
void fastpo_row_dz(float *z, int64_t rows, int64_t V, int64_t ld, const int64_t *t, const float *shift,
                   const float *log_norm, const float *ent, const float *g_lp, const float *g_ent, float inv_t,
                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float *row = z + r * ld;
        const float c = shift[r], n = log_norm[r];
        const float a = -g_ent[r] * inv_t;
        const float b = -(g_lp[r] + g_ent[r] * ent[r]) * inv_t;
        if (a == 0.0f) {
            for (int64_t v = 0; v < V; v++)
                row[v] = expf((row[v] - c) - n) * b;
        } else {
            for (int64_t v = 0; v < V; v++) {
                float lp_v = (row[v] - c) - n;
                row[v] = expf(lp_v) * (a * lp_v + b);
            }
        }
        row[t[r]] += g_lp[r] * inv_t;
    }
}

/* In place on e, rows holding exp(z - m) (fastpo_row_stats with store_exp): the gradient of
 * fastpo_row_dz with p_v = e_v / s and log p_v = log e_v - log s; without an entropy term no
 * transcendental per element, with one a logf. */
void fastpo_row_dz_exp(float *e, int64_t rows, int64_t V, int64_t ld, const int64_t *t, const float *log_norm,
                       const float *ent, const float *g_lp, const float *g_ent, float inv_t, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float *row = e + r * ld;
        const float n = log_norm[r], inv_s = expf(-log_norm[r]);
        const float a = -g_ent[r] * inv_t;
        const float b = -(g_lp[r] + g_ent[r] * ent[r]) * inv_t;
        if (a == 0.0f) {
            const float bs = b * inv_s;
            for (int64_t v = 0; v < V; v++)
                row[v] *= bs;
        } else {
#pragma omp simd
            for (int64_t v = 0; v < V; v++) {
                float p = row[v] * inv_s;
                /* p = 0 (exp underflowed): 0, the limit of p log p; a NaN p stays NaN */
                row[v] = p == 0.0f ? 0.0f : p * (a * (logf(row[v]) - n) + b);
            }
        }
        row[t[r]] += g_lp[r] * inv_t;
    }
}

/* Decode attention over a paged KV cache on the CPU: one query token per row.
 *
 * Built and loaded by fastpo/kernels/cpu_attention.py (compiled.py: cc -O3 -march=native
 * -ffast-math -fno-finite-math-only -fopenmp, linked without -ffast-math). A row's keys and
 * values sit in blocks of FASTPO_KV_BLOCK tokens anywhere in the pools, listed by its block
 * table. Each (row, KV head) task reads its blocks once: the scores of its query heads
 * (block by block, keys transposed within a block so that 16 scores are one vector
 * multiply-add per head dimension), the softmax over the row's length, then the values
 * weighted by the probabilities. PyTorch's sdpa on a padded batch reads the keys several
 * times (its GEMM packs them) and every padding column.
 *
 * q, out: [R, Hq, D] fp32. kpool: [NB, Hkv, D, BLOCK] (keys, transposed within each block);
 * vpool: [NB, Hkv, BLOCK, D]. table: [R, ld] int32 block ids; lens: [R] int64 tokens per row
 * (>= 1); query head h reads KV head h / (Hq / Hkv). out = softmax(scale q.K^T) V.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 16

#ifdef FASTPO_VECTOR_EXP
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

/* Returns 0, or 1 when a task's scratch could not be allocated (out is then incomplete). */
int fastpo_paged_decode(const float *q, float *out, const float *kpool, const float *vpool, const int32_t *table,
                        int64_t ld, const int64_t *lens, int64_t R, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                        int threads) {
    const int64_t g = Hq / Hkv;
    const int64_t block = Hkv * D * BLOCK; /* floats per block of one pool */
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : failed)
    for (int64_t task = 0; task < R * Hkv; task++) {
        const int64_t r = task / Hkv, h = task % Hkv;
        const int64_t L = lens[r], nb = (L + BLOCK - 1) / BLOCK, Lp = nb * BLOCK;
        const int32_t *blocks = table + r * ld;
        float *s = malloc(sizeof(float) * (size_t)(g * Lp + D + g));
        if (s == NULL) {
            failed = 1;
            continue;
        }
        float *acc = s + g * Lp, *inv = acc + D;
        /* scores: s[j, t] = scale q_j . k_t, a block of 16 keys at a time */
        for (int64_t b = 0; b < nb; b++) {
            const float *k = kpool + (int64_t)blocks[b] * block + h * D * BLOCK;
            for (int64_t j = 0; j < g; j++) {
                const float *qj = q + (r * Hq + h * g + j) * D;
                float sc[BLOCK] = {0};
                for (int64_t d = 0; d < D; d++) {
                    const float x = qj[d];
#pragma omp simd
                    for (int t = 0; t < BLOCK; t++)
                        sc[t] += x * k[d * BLOCK + t];
                }
                float *dst = s + j * Lp + b * BLOCK;
                for (int t = 0; t < BLOCK; t++)
                    dst[t] = sc[t] * scale;
            }
        }
        /* probabilities, unnormalised: exp(s - max) (the scores past L are never used) */
        for (int64_t j = 0; j < g; j++) {
            float *sj = s + j * Lp;
            float m = -INFINITY;
#pragma omp simd reduction(max : m)
            for (int64_t t = 0; t < L; t++)
                m = sj[t] > m ? sj[t] : m;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < L; t++) {
                const float e = expf(sj[t] - m);
                sj[t] = e;
                sum += e;
            }
            inv[j] = 1.0f / sum;
        }
        /* out_j = sum_t p_jt v_t / sum_t p_jt */
        for (int64_t j = 0; j < g; j++) {
            const float *pj = s + j * Lp;
            for (int64_t d = 0; d < D; d++)
                acc[d] = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const float *v = vpool + (int64_t)blocks[b] * block + h * BLOCK * D;
                const float *p = pj + b * BLOCK;
                const int64_t n = L - b * BLOCK < BLOCK ? L - b * BLOCK : BLOCK; /* unwritten slots: never read */
                for (int64_t t = 0; t < n; t++) {
                    const float w = p[t];
#pragma omp simd
                    for (int64_t d = 0; d < D; d++)
                        acc[d] += w * v[t * D + d];
                }
            }
            float *o = out + (r * Hq + h * g + j) * D;
            for (int64_t d = 0; d < D; d++)
                o[d] = acc[d] * inv[j];
        }
        free(s);
    }
    return failed;
}

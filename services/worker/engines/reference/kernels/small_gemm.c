/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32 for a few rows M (verify steps: 2..16).
 *
 * Why: on AVX2-only CPUs (Zen3 here) MKL's sgemm for 2 <= M <= 16 reaches 5-20 GFLOPS, so a step
 * that verifies k draft tokens costs ~(1 + 0.8k)x a one-token step and speculation cannot pay.
 * With M this small the product is bound by streaming w (the whole model per step), so every w
 * element must be read from memory once and used for all M rows: the weights are walked in
 * blocks of NB rows (a block stays in L1), and for each block the rows of x are processed MB at a
 * time with MB x NB accumulators in registers (dot-product form along K, w as stored, no repack).
 *
 * Register budget (16 ymm): MB * NB accumulators + NB weight vectors + 1 x vector: 4 x 3 -> 16.
 * Per 8-wide K step: NB + MB loads and MB * NB FMAs (12 FMAs / 7 loads: FMA-bound, not load-bound).
 * The next weight block is prefetched while the current one is used, spread evenly over all
 * ceil(M / MB) passes over it: prefetching it during the first pass only left the memory bus idle
 * during the later passes (compute from L1) and the core idle while the first pass waited on
 * memory, so M = 12 ran at 1.5x its roofline (max(stream w, FMAs)); spread, the two overlap.
 * Threads: OpenMP over weight blocks (contiguous ranges per thread); the library resolves to the
 * libgomp torch already loaded (same soname), so torch.set_num_threads governs both.
 */
#include <immintrin.h>

#define MB 4
#define NB 3

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One mb x nb tile (mb <= MB, nb <= NB are compile-time constants after inlining, so the
 * accumulator arrays live in registers). kfull = K rounded down to 8; tail = mask of K % 8 lanes. */
static inline __attribute__((always_inline)) void tile(
    const int mb, const int nb, const float *x, long ldx, const float *w, long K, long kfull,
    __m256i tail, float *y, long ldy, const float *bias, const char *pf, long pf_step) {
    __m256 acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    long k = 0;
    for (; k < kfull; k += 8) {
        if (pf) {  /* this pass's share of the next weight block: pf_step bytes per 8-wide step */
            const char *p = pf + (k >> 3) * pf_step;
            _mm_prefetch(p, _MM_HINT_T0);
            if (pf_step > 64) _mm_prefetch(p + 64, _MM_HINT_T0);
        }
        __m256 wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);
        for (int i = 0; i < mb; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < K) {
        __m256 wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = _mm256_maskload_ps(w + j * K + k, tail);
        for (int i = 0; i < mb; i++) {
            __m256 xv = _mm256_maskload_ps(x + i * ldx + k, tail);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) y[i * ldy + j] = hsum(acc[i][j]) + (bias ? bias[j] : 0.0f);
}

#define TILE(a, b) tile(a, b, xm, ldx, wn, K, kfull, tail, ym, ldy, bn, pf, pf_step)
#define ROWS(b)                            \
    switch (mb) {                          \
        case 4: TILE(4, b); break;         \
        case 3: TILE(3, b); break;         \
        case 2: TILE(2, b); break;         \
        default: TILE(1, b); break;        \
    }

int seer_small_gemm_abi(void) { return 1; }

void seer_small_gemm(const float *x, long ldx, const float *w, const float *bias, float *y, long ldy,
                     long M, long N, long K, int nthreads) {
    const long kfull = K & ~7L;
    const int rem = (int)(K - kfull);
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const long nblocks = (N + NB - 1) / NB;
    /* The next block (NB * K floats) is prefetched in `passes` equal shares, one per pass over the
     * current block, each spread over that pass's K / 8 steps (at most 128 bytes a step: two lines). */
    if (M <= 0 || N <= 0) return;  /* nothing to write (and no pass to share the prefetch over) */
    const long passes = (M + MB - 1) / MB;
    const long ksteps = K > 0 ? (K + 7) / 8 : 1;  /* K = 0: y = bias (or 0), no loads at all */
    const long share = (NB * K * 4 + passes - 1) / passes;
    long pf_step = (share + ksteps - 1) / ksteps;
    if (pf_step > 128) pf_step = 128;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (long b = 0; b < nblocks; b++) {
        const long n0 = b * NB;
        const long nb = N - n0 < NB ? N - n0 : NB;
        const float *wn = w + n0 * K;
        const float *bn = bias ? bias + n0 : 0;
        for (long m0 = 0; m0 < M; m0 += MB) {
            const long mb = M - m0 < MB ? M - m0 : MB;
            const float *xm = x + m0 * ldx;
            /* Every pass over a block reads it from L1 (prefetched during the previous block);
             * meanwhile it prefetches its share of the next block (blocks are contiguous: short
             * streams the hardware prefetcher ramps up on too late). */
            const char *pf = b + 1 < nblocks ? (const char *)(wn + NB * K) + (m0 / MB) * share : 0;
            float *ym = y + m0 * ldy + n0;
            if (nb == 3) {
                ROWS(3)
            } else if (nb == 2) {
                ROWS(2)
            } else {
                ROWS(1)
            }
        }
    }
}

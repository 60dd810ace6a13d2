/* Attention of a few queries per request straight over the paged KV cache, float32 (decode and
 * draft-tree verification steps; prefill keeps PyTorch's SDPA).
 *
 * Why: the PyTorch path first gathers every request's keys and values out of the paged cache into
 * a padded [B, KV, Km, D] copy (index_select: the active cache copied once more per layer), pads
 * every request's queries to the longest draft tree of the batch and runs SDPA with a mask. Its
 * CPU flash kernel is built for long query blocks; at batch 8 with ~350 keys the gather and SDPA
 * took ~40% of a decode step. Here each request's keys and values are read where they lie, once
 * per kv head, shared by all of its query rows, with no padding and no mask tensor.
 *
 * Visibility. A request's keys are numbered by position: key j is at cache slot slots[koff[b] + j].
 * Query t (of request qreq[t]; a request's queries are contiguous, qoff[b] .. qoff[b + 1]) sees
 * keys lo[t] <= j < hi[t] (causal limit, sliding window) and key hi[t] + i for every bit i set in
 * xmask[t] (a draft node's ancestors and itself, whose keys follow the prefix; trees have at most
 * 64 nodes). Scores are float32 dot products; the softmax subtracts the row maximum; exp is a
 * polynomial with relative error < 2e-7.
 *
 * Work item = (request, kv head): rows = the request's queries x the R = H / KV query heads of
 * that kv head (GQA), processed in blocks that share every key and value load.
 * Threads: OpenMP over work items (libgomp, the runtime torch already loaded).
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

int seer_paged_attn_abi(void) { return 2; }

#define SB 3 /* rows per block in the score pass ... */
#define KB 3 /* ... times keys per step: SB * KB accumulators + KB key loads + 1 query load <= 16 ymm */
#define PF 8 /* keys fetched ahead */
#define PB 3 /* rows per block in the value pass (PB * 4 chunk accumulators + 4 loads <= 16 ymm) */

/* e^x for x <= 0 (scores minus the row maximum): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
 * p the degree-6 Taylor polynomial. Masked scores (-inf, anything below -87) give exactly 0. */
static inline __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

typedef struct {
    const float *q; /* [D] */
    float *out;     /* [D] */
    long lo, hi;
    unsigned long long xmask;
} Row;

static inline int visible(const Row *w, long j) {
    if (j >= w->lo && j < w->hi) return 1;
    const long i = j - w->hi;
    return i >= 0 && i < 64 && ((w->xmask >> i) & 1ULL);
}

/* Scores of nb rows (nb <= SB) against kb keys (kb <= KB) starting at key index j (both constants
 * after inlining): nb x kb independent accumulators, so the FMA chains along D overlap (one chain
 * per (row, key) would wait out the FMA latency at every step). */
static inline __attribute__((always_inline)) void score_tile(const int nb, const int kb, const Row *rows,
                                                              const float *kc, const long *keys, long klo, long j,
                                                              long n, long stride, long D, float scale, float *s) {
    const float *kp[KB];
    for (int k = 0; k < kb; k++) kp[k] = kc + keys[klo + j + k] * stride;
    if (j + kb + PF <= n) { /* keys lie in scattered pages: fetch ahead of the hardware prefetcher */
        for (int k = 0; k < kb; k++) {
            const char *nx = (const char *)(kc + keys[klo + j + k + PF] * stride);
            for (long b = 0; b < D * 4; b += 64) _mm_prefetch(nx + b, _MM_HINT_T0);
        }
    }
    __m256 acc[SB][KB];
    for (int i = 0; i < nb; i++)
        for (int k = 0; k < kb; k++) acc[i][k] = _mm256_setzero_ps();
    for (long c = 0; c < D; c += 8) {
        __m256 kv[KB];
        for (int k = 0; k < kb; k++) kv[k] = _mm256_loadu_ps(kp[k] + c);
        for (int i = 0; i < nb; i++) {
            const __m256 qv = _mm256_loadu_ps(rows[i].q + c);
            for (int k = 0; k < kb; k++) acc[i][k] = _mm256_fmadd_ps(qv, kv[k], acc[i][k]);
        }
    }
    for (int i = 0; i < nb; i++)
        for (int k = 0; k < kb; k++)
            s[i * n + j + k] = visible(&rows[i], klo + j + k) ? hsum(acc[i][k]) * scale : -INFINITY;
}

/* Scores of nb rows against keys klo .. klo + n: s[i * n + j]. */
static inline __attribute__((always_inline)) void scores(const int nb, const Row *rows, const float *kc,
                                                          const long *keys, long klo, long n, long stride,
                                                          long D, float scale, float *s) {
    long j = 0;
    for (; j + KB <= n; j += KB) score_tile(nb, KB, rows, kc, keys, klo, j, n, stride, D, scale, s);
    for (; j < n; j++) score_tile(nb, 1, rows, kc, keys, klo, j, n, stride, D, scale, s);
}

/* out of nb rows (nb <= PB) for cb 8-wide chunks (cb 4 or 1) starting at float c0. */
static inline __attribute__((always_inline)) void values(const int nb, const int cb, const Row *rows,
                                                          const float *vc, const long *keys, long klo, long n,
                                                          long stride, long c0, const float *p, const float *inv) {
    __m256 acc[PB][4];
    for (int i = 0; i < nb; i++)
        for (int k = 0; k < cb; k++) acc[i][k] = _mm256_setzero_ps();
    for (long j = 0; j < n; j++) {
        const float *vp = vc + keys[klo + j] * stride + c0;
        if (j + PF < n) { /* keys lie in scattered pages: fetch ahead of the hardware prefetcher */
            const char *nx = (const char *)(vc + keys[klo + j + PF] * stride + c0);
            for (int b = 0; b < cb * 32; b += 64) _mm_prefetch(nx + b, _MM_HINT_T0);
        }
        __m256 vv[4];
        for (int k = 0; k < cb; k++) vv[k] = _mm256_loadu_ps(vp + 8 * k);
        for (int i = 0; i < nb; i++) {
            const __m256 w = _mm256_broadcast_ss(p + i * n + j);
            for (int k = 0; k < cb; k++) acc[i][k] = _mm256_fmadd_ps(w, vv[k], acc[i][k]);
        }
    }
    for (int i = 0; i < nb; i++)
        for (int k = 0; k < cb; k++)
            _mm256_storeu_ps(rows[i].out + c0 + 8 * k, _mm256_mul_ps(acc[i][k], _mm256_set1_ps(inv[i])));
}

/* One (request, kv head): nrows rows over keys klo .. khi. s: scratch of nrows * (khi - klo). */
static void item(Row *rows, long nrows, const float *kc, const float *vc, const long *keys, long klo, long khi,
                 long stride, long D, float scale, float *s) {
    const long n = khi - klo;
    for (long r0 = 0; r0 < nrows; r0 += SB) {
        const long nb = nrows - r0 < SB ? nrows - r0 : SB;
        float *sb = s + r0 * n;
        switch (nb) {
            case 3: scores(3, rows + r0, kc, keys, klo, n, stride, D, scale, sb); break;
            case 2: scores(2, rows + r0, kc, keys, klo, n, stride, D, scale, sb); break;
            default: scores(1, rows + r0, kc, keys, klo, n, stride, D, scale, sb); break;
        }
    }
    /* Softmax numerators in place; the normalisation is applied to the output. */
    float inv[PB];
    float *invs = (float *)__builtin_alloca(sizeof(float) * (size_t)nrows);
    for (long r = 0; r < nrows; r++) {
        float *sr = s + r * n;
        float m = -INFINITY;
        for (long j = 0; j < n; j++) m = sr[j] > m ? sr[j] : m;
        const __m256 mv = _mm256_set1_ps(m);
        __m256 sum = _mm256_setzero_ps();
        long j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mv));
            _mm256_storeu_ps(sr + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        float tot = hsum(sum);
        if (j < n) {
            float buf[8];
            for (long i = 0; i < 8; i++) buf[i] = j + i < n ? sr[j + i] : -INFINITY;
            _mm256_storeu_ps(buf, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(buf), mv)));
            for (long i = j; i < n; i++) {
                sr[i] = buf[i - j];
                tot += buf[i - j];
            }
        }
        invs[r] = 1.0f / tot;
    }
    const int wide = D % 32 == 0;
    for (long r0 = 0; r0 < nrows; r0 += PB) {
        const long nb = nrows - r0 < PB ? nrows - r0 : PB;
        for (long i = 0; i < nb; i++) inv[i] = invs[r0 + i];
        const float *pb = s + r0 * n;
        for (long c0 = 0; c0 < D; c0 += wide ? 32 : 8) {
#define V(NB)                                                                                 \
    if (wide)                                                                                 \
        values(NB, 4, rows + r0, vc, keys, klo, n, stride, c0, pb, inv);                      \
    else                                                                                      \
        values(NB, 1, rows + r0, vc, keys, klo, n, stride, c0, pb, inv);
            switch (nb) {
                case 3: V(3) break;
                case 2: V(2) break;
                default: V(1) break;
            }
#undef V
        }
    }
}

/* q, out [T, H, D] contiguous; kc, vc: one layer's cache [slots, KV, D]; slots: each request's key
 * slots by position (request b's from koff[b]); qoff [B + 1]: the requests' queries; lo, hi, xmask
 * [T]. max_rows / max_keys bound a request's query rows (queries x R) and key span (scratch).
 * Returns 0; -1 when scratch cannot be allocated; -2 for unsupported shapes; -3 when a request
 * exceeds max_rows or max_keys (nothing is computed for it). */
int seer_paged_attn(const float *q, const float *kc, const float *vc, float *out, const long *slots,
                    const long *koff, const long *qoff, const long *lo, const long *hi,
                    const unsigned long long *xmask, long B, long H, long KV, long D, float scale,
                    long max_rows, long max_keys, int threads) {
    const long R = H / KV;
    if (R * KV != H || D % 8 != 0 || D <= 0) return -2;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && B * KV > 1)
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(max_rows * max_keys + 8));
        Row *rows = (Row *)malloc(sizeof(Row) * (size_t)(max_rows + 1));
        if (!s || !rows) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < B * KV; w++) {
            if (!s || !rows) continue;
            const long b = w / KV, g = w % KV;
            long klo = -1, khi = 0;
            const long nrows = (qoff[b + 1] - qoff[b]) * R;
            for (long t = qoff[b]; t < qoff[b + 1]; t++) {
                const long top = hi[t] + (xmask[t] ? 64 - __builtin_clzll(xmask[t]) : 0);
                klo = klo < 0 || lo[t] < klo ? lo[t] : klo;
                khi = top > khi ? top : khi;
            }
            /* Checked before anything is written: the caller's bounds size rows and the scratch. */
            if (nrows > max_rows || khi - klo > max_keys) {
#pragma omp atomic write
                failed = 2;
                continue;
            }
            long i = 0;
            for (long t = qoff[b]; t < qoff[b + 1]; t++)
                for (long r = 0; r < R; r++) {
                    const long off = (t * H + g * R + r) * D;
                    rows[i++] = (Row){q + off, out + off, lo[t], hi[t], xmask[t]};
                }
            if (nrows == 0) continue;
            item(rows, nrows, kc + g * D, vc + g * D, slots + koff[b], klo, khi, KV * D, D, scale, s);
        }
        free(s);
        free(rows);
    }
    return failed == 1 ? -1 : failed == 2 ? -3 : 0;
}

/* distgrad native statistics kernel (see distgrad/stats/native.py, which compiles and loads it).
   Built with -O3 -fno-math-errno; never -ffast-math (it would break NaN/Inf counting). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>

#define LANES 16
#define CHUNK 2048   /* fp32 lane accumulators restart every CHUNK elements */
#define BLOCK 65536  /* unit of work for threads; partials combined in order, in float64 */

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = ((uint32_t)b) << 16; float f; memcpy(&f, &u, sizeof f); return f;
}

/* out[0..6]: sum, sumsq, nan, inf, zeros, max, min of n elements; max/min skip NaN. */
#define DG_BLOCK_FN(NAME, T, LOAD)                                                         \
static void NAME(const T* restrict x, int64_t n, double* restrict out) {                  \
    double s = 0, ss = 0, cn = 0, ci = 0, cz = 0;                                          \
    float mx = -INFINITY, mn = INFINITY;                                                   \
    for (int64_t b = 0; b < n; b += CHUNK) {                                               \
        const int64_t e = n - b < CHUNK ? n - b : CHUNK;                                   \
        const T* restrict p = x + b;                                                       \
        float ls[LANES], lq[LANES], lmx[LANES], lmn[LANES];                                \
        int32_t lz[LANES], ln[LANES], li[LANES];                                           \
        for (int k = 0; k < LANES; k++) {                                                  \
            ls[k] = 0.f; lq[k] = 0.f; lmx[k] = -INFINITY; lmn[k] = INFINITY;               \
            lz[k] = 0; ln[k] = 0; li[k] = 0;                                               \
        }                                                                                  \
        int64_t i = 0;                                                                     \
        for (; i + LANES <= e; i += LANES) {                                               \
            for (int k = 0; k < LANES; k++) {                                              \
                const float v = LOAD(p[i + k]);                                            \
                ls[k] += v; lq[k] += v * v;                                                \
                lmx[k] = v > lmx[k] ? v : lmx[k];                                          \
                lmn[k] = v < lmn[k] ? v : lmn[k];                                          \
                lz[k] += (v == 0.f); ln[k] += (v != v); li[k] += (fabsf(v) == INFINITY);   \
            }                                                                              \
        }                                                                                  \
        for (; i < e; i++) {                                                               \
            const float v = LOAD(p[i]);                                                    \
            ls[0] += v; lq[0] += v * v;                                                    \
            lmx[0] = v > lmx[0] ? v : lmx[0];                                              \
            lmn[0] = v < lmn[0] ? v : lmn[0];                                              \
            lz[0] += (v == 0.f); ln[0] += (v != v); li[0] += (fabsf(v) == INFINITY);       \
        }                                                                                  \
        for (int k = 0; k < LANES; k++) {                                                  \
            s += ls[k]; ss += lq[k]; cz += lz[k]; cn += ln[k]; ci += li[k];                \
            mx = lmx[k] > mx ? lmx[k] : mx; mn = lmn[k] < mn ? lmn[k] : mn;                \
        }                                                                                  \
    }                                                                                      \
    out[0] = s; out[1] = ss; out[2] = cn; out[3] = ci; out[4] = cz; out[5] = mx; out[6] = mn; \
}

#define DG_ID(v) (v)
DG_BLOCK_FN(block_f32, float, DG_ID)
DG_BLOCK_FN(block_bf16, uint16_t, bf16_to_f32)

typedef struct {
    const int64_t *ptr, *len; const int32_t *kind; double *part; int64_t lo, hi;
} job_t;

static void run_blocks(const job_t* j) {
    for (int64_t i = j->lo; i < j->hi; i++) {
        if (j->kind[i] == 0) block_f32((const float*)(intptr_t)j->ptr[i], j->len[i], j->part + 7 * i);
        else block_bf16((const uint16_t*)(intptr_t)j->ptr[i], j->len[i], j->part + 7 * i);
    }
}

static void* worker(void* arg) { run_blocks((const job_t*)arg); return NULL; }

/* P pieces (kind 0 = float32, 1 = bfloat16; len > 0) -> out[P][8]:
   numel, sum, sumsq, nan, inf, zeros, max, -min (max and -min are NaN when nan > 0).
   Returns 0, or -1 when memory could not be allocated. */
int dg_stats(int64_t P, const int64_t* ptrs, const int64_t* lens, const int32_t* kinds,
             double* out, int32_t nthreads) {
    int64_t nb = 0, total = 0;
    for (int64_t p = 0; p < P; p++) { nb += (lens[p] + BLOCK - 1) / BLOCK; total += lens[p]; }
    int64_t* bptr = malloc(sizeof(int64_t) * (nb + 1));
    int64_t* blen = malloc(sizeof(int64_t) * (nb + 1));
    int32_t* bkind = malloc(sizeof(int32_t) * (nb + 1));
    double* part = malloc(sizeof(double) * 7 * (nb + 1));
    if (!bptr || !blen || !bkind || !part) { free(bptr); free(blen); free(bkind); free(part); return -1; }
    int64_t b = 0;
    for (int64_t p = 0; p < P; p++) {
        const int64_t esize = kinds[p] == 0 ? 4 : 2;
        for (int64_t o = 0; o < lens[p]; o += BLOCK, b++) {
            bptr[b] = ptrs[p] + o * esize;
            blen[b] = lens[p] - o < BLOCK ? lens[p] - o : BLOCK;
            bkind[b] = kinds[p];
        }
    }
    int64_t T = nthreads < 1 ? 1 : nthreads;
    if (T > total / (4 * BLOCK)) T = total / (4 * BLOCK);
    if (T < 1) T = 1;
    if (T > 64) T = 64;
    job_t jobs[64];
    pthread_t tid[64];
    int started[64];
    for (int64_t t = 0; t < T; t++) {
        jobs[t] = (job_t){bptr, blen, bkind, part, nb * t / T, nb * (t + 1) / T};
        started[t] = t > 0 && pthread_create(&tid[t], NULL, worker, &jobs[t]) == 0;
    }
    run_blocks(&jobs[0]);
    for (int64_t t = 1; t < T; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run_blocks(&jobs[t]);
    }
    b = 0;
    for (int64_t p = 0; p < P; p++) {
        double s = 0, ss = 0, cn = 0, ci = 0, cz = 0, mx = -INFINITY, mn = INFINITY;
        for (int64_t o = 0; o < lens[p]; o += BLOCK, b++) {
            const double* q = part + 7 * b;
            s += q[0]; ss += q[1]; cn += q[2]; ci += q[3]; cz += q[4];
            mx = q[5] > mx ? q[5] : mx; mn = q[6] < mn ? q[6] : mn;
        }
        double* r = out + 8 * p;
        r[0] = (double)lens[p]; r[1] = s; r[2] = ss; r[3] = cn; r[4] = ci; r[5] = cz;
        r[6] = cn > 0 ? NAN : mx; r[7] = cn > 0 ? NAN : -mn;
    }
    free(bptr); free(blen); free(bkind); free(part);
    return 0;
}

/* distgrad native kernel of the optimizer signals on CPU (see distgrad/signals/adam_native.py,
   which compiles and loads it, and distgrad/signals/adam.py for the definitions).
   Built with -O3 -fno-math-errno; never -ffast-math (NaN/Inf must propagate as in torch).
   Per piece, one pass over g (float32/bfloat16/float16), m and v (both float32 or both bfloat16):
     g = g / scale; d = v / bc; vhat += d; d = max(d, eps2) (NaN stays NaN); r = g*g / d
   sums: (sum r, #(r > theta), sign * g.m, g.g, m.m, v.v, sum vhat), every elementwise operation
   in float32 as torch does it, summed in 16 float32 lanes restarted every CHUNK elements and
   combined in float64. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>

#define LANES 16
#define CHUNK 2048   /* fp32 lane accumulators restart every CHUNK elements */
#define BLOCK 65536  /* unit of work for threads; partials combined in order, in float64 */
#define NS 7

static inline float f32_bits(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
static inline uint32_t bits_f32(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static inline float ld_f32(float x) { return x; }
static inline float ld_bf16(uint16_t b) { return f32_bits(((uint32_t)b) << 16); }
/* exact float16 -> float32 (normals, subnormals, Inf, NaN) without F16C */
static inline float ld_f16(uint16_t h) {
    const uint32_t em = h & 0x7fffu, sign = ((uint32_t)h & 0x8000u) << 16;
    const float f = f32_bits(em << 13) * 0x1p112f;
    const uint32_t u = em >= 0x7c00u ? ((em << 13) | 0x7f800000u) : bits_f32(f);
    return f32_bits(u | sign);
}

typedef struct { float scale, bc, eps2, theta, sign; } prm_t;

#define DG_ADAM_FN(NAME, TG, LG, TS, LS)                                                    \
static void NAME(const TG* restrict g, const TS* restrict m, const TS* restrict v,          \
                 int64_t n, const prm_t* q, double* restrict out) {                         \
    const float scale = q->scale, bc = q->bc, eps2 = q->eps2, theta = q->theta;            \
    double a[NS] = {0, 0, 0, 0, 0, 0, 0};                                                   \
    for (int64_t b = 0; b < n; b += CHUNK) {                                                \
        const int64_t e = n - b < CHUNK ? n - b : CHUNK;                                    \
        float lr[LANES], lgm[LANES], lgg[LANES], lmm[LANES], lvv[LANES], lvh[LANES];        \
        int32_t lc[LANES];                                                                  \
        for (int k = 0; k < LANES; k++) {                                                   \
            lr[k] = 0.f; lgm[k] = 0.f; lgg[k] = 0.f; lmm[k] = 0.f; lvv[k] = 0.f;            \
            lvh[k] = 0.f; lc[k] = 0;                                                        \
        }                                                                                   \
        int64_t i = b;                                                                      \
        for (; i + LANES <= b + e; i += LANES) {                                            \
            for (int k = 0; k < LANES; k++) {                                               \
                const float gv = LG(g[i + k]) / scale, mv = LS(m[i + k]), vv = LS(v[i + k]);\
                float d = vv / bc;                                                          \
                lvh[k] += d;                                                                \
                d = d < eps2 ? eps2 : d;                                                    \
                const float gg = gv * gv, r = gg / d;                                       \
                lr[k] += r; lc[k] += (r > theta); lgm[k] += gv * mv; lgg[k] += gg;          \
                lmm[k] += mv * mv; lvv[k] += vv * vv;                                       \
            }                                                                               \
        }                                                                                   \
        for (; i < b + e; i++) {                                                            \
            const float gv = LG(g[i]) / scale, mv = LS(m[i]), vv = LS(v[i]);                \
            float d = vv / bc;                                                              \
            lvh[0] += d;                                                                    \
            d = d < eps2 ? eps2 : d;                                                        \
            const float gg = gv * gv, r = gg / d;                                           \
            lr[0] += r; lc[0] += (r > theta); lgm[0] += gv * mv; lgg[0] += gg;              \
            lmm[0] += mv * mv; lvv[0] += vv * vv;                                           \
        }                                                                                   \
        for (int k = 0; k < LANES; k++) {                                                   \
            a[0] += lr[k]; a[1] += lc[k]; a[2] += lgm[k]; a[3] += lgg[k];                   \
            a[4] += lmm[k]; a[5] += lvv[k]; a[6] += lvh[k];                                 \
        }                                                                                   \
    }                                                                                       \
    memcpy(out, a, sizeof a);                                                               \
}

DG_ADAM_FN(adam_f32_f32, float, ld_f32, float, ld_f32)
DG_ADAM_FN(adam_bf16_f32, uint16_t, ld_bf16, float, ld_f32)
DG_ADAM_FN(adam_f16_f32, uint16_t, ld_f16, float, ld_f32)
DG_ADAM_FN(adam_f32_bf16, float, ld_f32, uint16_t, ld_bf16)
DG_ADAM_FN(adam_bf16_bf16, uint16_t, ld_bf16, uint16_t, ld_bf16)
DG_ADAM_FN(adam_f16_bf16, uint16_t, ld_f16, uint16_t, ld_bf16)

typedef struct {
    const int64_t *g, *m, *v, *len; const int32_t *kind; const prm_t* prm; double* part;
    int64_t lo, hi;
} job_t;

/* kind = gkind + 3 * skind; gkind 0 float32, 1 bfloat16, 2 float16; skind 0 float32, 1 bfloat16 */
static int run_blocks(const job_t* j) {
    for (int64_t i = j->lo; i < j->hi; i++) {
        const void *g = (const void*)(intptr_t)j->g[i], *m = (const void*)(intptr_t)j->m[i],
                   *v = (const void*)(intptr_t)j->v[i];
        double* o = j->part + NS * i;
        switch (j->kind[i]) {
        case 0: adam_f32_f32(g, m, v, j->len[i], j->prm + i, o); break;
        case 1: adam_bf16_f32(g, m, v, j->len[i], j->prm + i, o); break;
        case 2: adam_f16_f32(g, m, v, j->len[i], j->prm + i, o); break;
        case 3: adam_f32_bf16(g, m, v, j->len[i], j->prm + i, o); break;
        case 4: adam_bf16_bf16(g, m, v, j->len[i], j->prm + i, o); break;
        case 5: adam_f16_bf16(g, m, v, j->len[i], j->prm + i, o); break;
        default: for (int k = 0; k < NS; k++) o[k] = NAN;
        }
    }
    return 0;
}

static void* worker(void* arg) { run_blocks((const job_t*)arg); return NULL; }

/* P pieces (len > 0), element pointers g, m, v, kinds (see run_blocks), params[P][5]
   (scale, bc, eps2, theta, sign) -> out[P][7] (sum r, #spikes, sign * g.m, g.g, m.m, v.v,
   sum vhat). Returns 0, -1 when memory could not be allocated, -2 on an unknown kind. */
int dg_adam(int64_t P, const int64_t* gp, const int64_t* mp, const int64_t* vp, const int64_t* lens,
            const int32_t* kinds, const float* params, double* out, int32_t nthreads) {
    int64_t nb = 0, total = 0;
    for (int64_t p = 0; p < P; p++) {
        if (kinds[p] < 0 || kinds[p] > 5) return -2;
        nb += (lens[p] + BLOCK - 1) / BLOCK; total += lens[p];
    }
    int64_t *bg = malloc(sizeof(int64_t) * (nb + 1)), *bm = malloc(sizeof(int64_t) * (nb + 1));
    int64_t *bv = malloc(sizeof(int64_t) * (nb + 1)), *bl = malloc(sizeof(int64_t) * (nb + 1));
    int32_t* bk = malloc(sizeof(int32_t) * (nb + 1));
    prm_t* bp = malloc(sizeof(prm_t) * (nb + 1));
    double* part = malloc(sizeof(double) * NS * (nb + 1));
    if (!bg || !bm || !bv || !bl || !bk || !bp || !part) {
        free(bg); free(bm); free(bv); free(bl); free(bk); free(bp); free(part); return -1;
    }
    int64_t b = 0;
    for (int64_t p = 0; p < P; p++) {
        const int64_t gs = kinds[p] % 3 == 0 ? 4 : 2, ss = kinds[p] / 3 == 0 ? 4 : 2;
        const prm_t q = {params[5 * p], params[5 * p + 1], params[5 * p + 2], params[5 * p + 3],
                         params[5 * p + 4]};
        for (int64_t o = 0; o < lens[p]; o += BLOCK, b++) {
            bg[b] = gp[p] + o * gs; bm[b] = mp[p] + o * ss; bv[b] = vp[p] + o * ss;
            bl[b] = lens[p] - o < BLOCK ? lens[p] - o : BLOCK;
            bk[b] = kinds[p]; bp[b] = q;
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
        jobs[t] = (job_t){bg, bm, bv, bl, bk, bp, part, nb * t / T, nb * (t + 1) / T};
        started[t] = t > 0 && pthread_create(&tid[t], NULL, worker, &jobs[t]) == 0;
    }
    run_blocks(&jobs[0]);
    for (int64_t t = 1; t < T; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run_blocks(&jobs[t]);
    }
    b = 0;
    for (int64_t p = 0; p < P; p++) {
        double a[NS] = {0, 0, 0, 0, 0, 0, 0};
        for (int64_t o = 0; o < lens[p]; o += BLOCK, b++)
            for (int k = 0; k < NS; k++) a[k] += part[NS * b + k];
        a[2] *= params[5 * p + 4];
        memcpy(out + NS * p, a, sizeof a);
    }
    free(bg); free(bm); free(bv); free(bl); free(bk); free(bp); free(part);
    return 0;
}

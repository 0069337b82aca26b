/* distgrad native gradient-histogram kernel (see distgrad/signals/histogram_native.py, which
   compiles and loads it, and distgrad/signals/histogram.py for what the counts mean).
   One pass over each piece: the biased exponent of |x| in fp32 bits (fp32, bf16, and fp16
   widened exactly) or fp64 bits is counted into the piece's layer row, and non-zero elements
   are counted. Integer work only: no floating-point arithmetic, so no rounding and no flags. */
#include <stdint.h>
#include <string.h>

/* fp32 biased exponent of the fp16 value with bits h (sign ignored), exact: fp16 subnormals
   m * 2^-24 are fp32 normals with exponent -24 + floor(log2 m). */
static inline uint32_t fp16_exp32(uint16_t h) {
    const uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0x1F) return 255;
    if (e) return e - 15 + 127;
    if (!m) return 0;
    return (uint32_t)(127 - 24 + (31 - __builtin_clz(m)));
}

/* kinds: 0 fp32, 1 bf16, 2 fp16, 3 fp64. raw32: int64 [L * 256], raw64: int64 [L * 2048],
   nonzero: int64 [L], all accumulated into (not cleared). rows[i]: layer of piece i. */
int dg_hist(int64_t P, const int64_t* ptrs, const int64_t* lens, const int32_t* kinds, const int64_t* rows,
            int64_t* raw32, int64_t* raw64, int64_t* nonzero) {
    for (int64_t i = 0; i < P; i++) {
        const int64_t n = lens[i], r = rows[i];
        int64_t nz = 0;
        if (kinds[i] == 0 || kinds[i] == 1) {
            /* four sub-tables so that consecutive elements of one bin do not wait on each other */
            int64_t h[4][256];
            memset(h, 0, sizeof h);
            int64_t k = 0;
            if (kinds[i] == 0) {
                const uint32_t* x = (const uint32_t*)(intptr_t)ptrs[i];
                for (; k + 4 <= n; k += 4) {
                    for (int j = 0; j < 4; j++) {
                        const uint32_t u = x[k + j] & 0x7FFFFFFFu;
                        h[j][u >> 23]++;
                        nz += u != 0;
                    }
                }
                for (; k < n; k++) {
                    const uint32_t u = x[k] & 0x7FFFFFFFu;
                    h[0][u >> 23]++;
                    nz += u != 0;
                }
            } else {
                const uint16_t* x = (const uint16_t*)(intptr_t)ptrs[i];
                for (; k + 4 <= n; k += 4) {
                    for (int j = 0; j < 4; j++) {
                        const uint16_t u = x[k + j] & 0x7FFF;
                        h[j][u >> 7]++;
                        nz += u != 0;
                    }
                }
                for (; k < n; k++) {
                    const uint16_t u = x[k] & 0x7FFF;
                    h[0][u >> 7]++;
                    nz += u != 0;
                }
            }
            int64_t* t = raw32 + r * 256;
            for (int b = 0; b < 256; b++) t[b] += h[0][b] + h[1][b] + h[2][b] + h[3][b];
        } else if (kinds[i] == 2) {
            const uint16_t* x = (const uint16_t*)(intptr_t)ptrs[i];
            int64_t* t = raw32 + r * 256;
            for (int64_t k = 0; k < n; k++) {
                const uint16_t u = x[k] & 0x7FFF;
                t[fp16_exp32(u)]++;
                nz += u != 0;
            }
        } else if (kinds[i] == 3) {
            const uint64_t* x = (const uint64_t*)(intptr_t)ptrs[i];
            int64_t* t = raw64 + r * 2048;
            for (int64_t k = 0; k < n; k++) {
                const uint64_t u = x[k] & 0x7FFFFFFFFFFFFFFFull;
                t[u >> 52]++;
                nz += u != 0;
            }
        } else {
            return 1;
        }
        nonzero[r] += nz;
    }
    return 0;
}

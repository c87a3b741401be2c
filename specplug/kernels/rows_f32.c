/* float32 products over few rows for specplug's lean forward: y = x · Wᵀ + b, every row from one read of W.
 *
 * Why a kernel: on a CPU whose BLAS sums a many-row product in another order than a one-row product beyond a
 * few rows, a verify pass (k + 1 rows) or a batched step had to run in pieces of those few rows, each reading
 * the whole weight again; the step is bound by that read. Here each output element is one fixed sequence of
 * fused multiply-adds (LANES partial sums over K in order, then the lanes added in a fixed order, then the
 * tail), whatever the row count, the other rows or the threads: a row's result is its one-row product, bit
 * for bit, by construction. A fused multiply-add is exactly rounded, so the AVX2 and the portable forms agree.
 *
 * A weight stored in 16 bits (IEEE half or bfloat16; a float32 weight that one of them holds exactly, as when a
 * half or bf16 checkpoint is loaded in float32) may be read in that form and widened to float32 as it is loaded:
 * the widening is exact, so the sums and their bits are the float32 weight's, and a step bound by reading the
 * weight reads half the bytes. */
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#define LANES 8
#define BLOCK 6 /* rows that share one pass over a block of weight rows */
#define OUTS 2  /* weight rows that share each load of x: 6 x 2 accumulators, 2 weight vectors and x fit AVX2's 16
                 * registers (3 x 4 left none for x, so every multiply-add read x from memory again) */
#define LINE 64 /* bytes in a cache line */
_Static_assert(OUTS == 2, "block_dot's vector finish adds two outputs' lanes at a time");

enum { F32, HALF, BF16 }; /* how the weight is stored */

/* IEEE half to float, exactly, for machines without F16C: normals and subnormals rescaled, inf/nan kept. */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else { /* zero or subnormal: man · 2^-24, exact in float */
        float f = (float)man * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* weight element i as float32, exactly */
static inline float weight_at(const void *w, int64_t i, const int form) {
    if (form == F32) return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    if (form == HALF) return half_to_float(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX2__) && defined(__FMA__)
/* weights i..i+7 as float32, exactly */
static inline __m256 load_weights(const void *w, int64_t i, const int form) {
    if (form == F32) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
#if defined(__F16C__)
    if (form == HALF) return _mm256_cvtph_ps(h);
#else
    if (form == HALF) {
        float f[LANES];
        for (int l = 0; l < LANES; l++) f[l] = weight_at(w, i + l, HALF);
        return _mm256_loadu_ps(f);
    }
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

static inline float finish(const float *acc, const float *x, const void *w, int64_t row, int64_t from, int64_t K,
                           const int form) {
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (int64_t k = from; k < K; k++)
        s = fmaf(x[k], weight_at(w, row * K + k, form), s);
    return s;
}

/* `rows` (1..BLOCK) rows of x [*, K] against `outs` (1..OUTS) weight rows w [outs, K] stored as `form`, all three
 * constants where inlined: out[r * N + j] = x_r · w_j + bias[j]. The blocking sets only which sums share a load,
 * never the order of any one sum. `next` (or NULL): the following OUTS weight rows, fetched into the cache
 * meanwhile, since a weight larger than the cache (an LM head) otherwise streams in at the pace of the sums. */
static inline __attribute__((always_inline)) void block_dot(const int64_t rows, const int64_t outs, int64_t K,
                                                             int64_t N, const float *x, const void *w,
                                                             const float *bias, float *out, const char *next,
                                                             const int form) {
    float acc[OUTS][BLOCK][LANES] __attribute__((aligned(32)));  /* the lanes' sums, for finish */
    int64_t body = K - K % LANES;
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t size = form == F32 ? 4 : 2; /* bytes a weight */
    __m256 v[OUTS][BLOCK];
    for (int64_t j = 0; j < outs; j++)
        for (int64_t r = 0; r < rows; r++)
            v[j][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < body; k += LANES) {
        __m256 wk[OUTS];
        for (int64_t j = 0; j < outs; j++)
            wk[j] = load_weights(w, j * K + k, form);
        if (next) /* the next block's weight rows, as far into it as this block is into its own */
            for (int64_t p = 0; p < OUTS * LANES * size; p += LINE)
                _mm_prefetch(next + (OUTS * k) * size + p, _MM_HINT_T0);
        for (int64_t r = 0; r < rows; r++) {
            __m256 xr = _mm256_loadu_ps(x + r * K + k);
            for (int64_t j = 0; j < outs; j++)
                v[j][r] = _mm256_fmadd_ps(xr, wk[j], v[j][r]);
        }
    }
    if (outs == OUTS && body == K) { /* a row's OUTS sums at once: hadd adds the lane pairs finish adds */
        const __m256 none = _mm256_setzero_ps();
        float b[4] = {0}, sums[4];
        for (int64_t j = 0; j < OUTS; j++) b[j] = bias ? bias[j] : 0.0f;
        for (int64_t r = 0; r < rows; r++) {
            __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0][r], v[1][r]), none); /* lanes 1-3 and 5-7 unused */
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(sums, _mm_add_ps(s, _mm_loadu_ps(b)));
            memcpy(out + r * N, sums, OUTS * sizeof(float));
        }
        return;
    }
    for (int64_t j = 0; j < outs; j++)
        for (int64_t r = 0; r < rows; r++)
            _mm256_store_ps(acc[j][r], v[j][r]);
#else
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < body; k += LANES)
        for (int64_t j = 0; j < outs; j++)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t l = 0; l < LANES; l++)
                    acc[j][r][l] = fmaf(x[r * K + k + l], weight_at(w, j * K + k + l, form), acc[j][r][l]);
#endif
    for (int64_t j = 0; j < outs; j++)
        for (int64_t r = 0; r < rows; r++)
            out[r * N + j] = finish(acc[j][r], x + r * K, w, j, body, K, form) + (bias ? bias[j] : 0.0f);
}

#define DOT(rows, outs) block_dot(rows, outs, K, N, xm, wn, bn, out, next, form)
/* every (rows, outs) pair spelled out, so each block_dot is compiled with constant bounds */
#define FOR_ROWS(outs)                          \
    switch (rows) {                             \
        case 1: DOT(1, outs); break;            \
        case 2: DOT(2, outs); break;            \
        case 3: DOT(3, outs); break;            \
        case 4: DOT(4, outs); break;            \
        case 5: DOT(5, outs); break;            \
        default: DOT(6, outs); break;           \
    }

/* y [M, N] = x [M, K] · w [N, K]ᵀ (+ b [N], or b NULL), w stored as `form` (a constant where inlined); every
 * output element summed as block_dot sums it. */
static inline __attribute__((always_inline)) void products(int64_t M, int64_t N, int64_t K, const float *x,
                                                           const void *w, const float *b, float *y, const int form) {
    const int64_t size = form == F32 ? 4 : 2;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n += OUTS) {
        const char *wn = (const char *)w + n * K * size;
        const float *bn = b ? b + n : 0;
        int64_t outs = N - n < OUTS ? N - n : OUTS;
        /* prefetched during the first rows only: later rows find this block's weight rows in the cache */
        for (int64_t m = 0; m < M; m += BLOCK) {
            const float *xm = x + m * K;
            float *out = y + m * N + n;
            int64_t rows = M - m < BLOCK ? M - m : BLOCK;
            const char *next = m == 0 && n + 2 * OUTS <= N ? wn + OUTS * K * size : 0;
            if (outs == 1) FOR_ROWS(1)
            else FOR_ROWS(2)
        }
    }
}

void specplug_rows_f32(int64_t M, int64_t N, int64_t K, const float *x, const float *w, const float *b, float *y) {
    products(M, N, K, x, w, b, y, F32);
}

/* The same products with the weight stored in 16 bits: IEEE half (bfloat = 0) or bfloat16 (bfloat = 1). */
void specplug_rows_f32_from16(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *w, const float *b,
                              float *y, int64_t bfloat) {
    if (bfloat) products(M, N, K, x, w, b, y, BF16);
    else products(M, N, K, x, w, b, y, HALF);
}

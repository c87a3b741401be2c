/* bf16 products for specplug's lean forward: y = bf16(bf16(x) · Wᵀ + b), float32 in and out, on Intel AMX tiles
 * or, where the CPU has no AMX but AVX-512 BF16 (AMD Zen 4, Intel Cooper Lake), on vdpbf16ps dot products.
 *
 * Why a kernel: for the few rows of a decode step or a verify pass oneDNN's bf16 product costs several times
 * what reading the weight does, and over a few dozen rows it may change its summation order, so a verify pass
 * had to run in pieces that each read the whole weight again. Here every output element is one fixed sequence
 * of products whatever the row count, the other rows or the threads (AMX: tile products of 16 rows of x and 32
 * of K, K in order, from zero; AVX-512: one accumulator per element, pairs of K in order, from zero): a row's
 * result is its one-row product, bit for bit, by construction. Each form is compiled where -march=native
 * offers its instructions; specplug_product_forms says which were. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u16x __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

enum { FORM_AMX = 1, FORM_DOT = 2 };

/* Which forms this build holds: FORM_AMX | FORM_DOT. */
int64_t specplug_product_forms(void) {
    int64_t forms = 0;
#ifdef __AMX_TILE__
    forms |= FORM_AMX;
#endif
#ifdef __AVX512BF16__
    forms |= FORM_DOT;
#endif
    return forms;
}

/* Ask Linux for the AMX tile state (once per process): 0, or -1 where it is refused or absent. */
int64_t specplug_product_init(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) ? -1 : 0;
}

/* W [N, K] bf16 -> tiles [N/16][K/32][16 pairs of k][16 n][2], the layout a tile product reads (N % 16 == 0,
 * K % 32 == 0). */
void specplug_product_pack(int64_t N, int64_t K, const uint16_t *w, uint16_t *out) {
    int64_t blocks = K / 32;
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kb = 0; kb < blocks; kb++) {
            uint16_t *tile = out + (nb * blocks + kb) * 512;
            for (int64_t p = 0; p < 16; p++)
                for (int64_t n = 0; n < 16; n++)
                    for (int64_t i = 0; i < 2; i++)
                        tile[p * 32 + 2 * n + i] = w[(nb * 16 + n) * K + kb * 32 + 2 * p + i];
        }
}

/* float32 -> bf16 bits, rounded to nearest even (torch's rounding), 16 lanes. */
static inline u16x round_bits(v16 x) {
    u16x u;
    memcpy(&u, &x, sizeof u);
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
}

static inline v16 widen(u16x bits) {
    u16x u = bits << 16;
    v16 x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* x [M, K] float32 -> xb [padded, K] bf16, the padding rows zero. */
static void to_bf16(int64_t M, int64_t padded, int64_t K, const float *x, uint16_t *xb) {
    #pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < padded; m++)
        for (int64_t k = 0; k < K; k += 16) {
            h16 h = {0};
            if (m < M) {
                v16 v;
                memcpy(&v, x + m * K + k, sizeof v);
                h = __builtin_convertvector(round_bits(v), h16);
            }
            memcpy(xb + m * K + k, &h, sizeof h);
        }
}

/* One tile of results (16 rows from row m0, 16 columns from n0) into y: plus the bias, rounded to bf16. */
static inline void finish(const float *tile, int64_t rows, int64_t N, int64_t n0, const uint16_t *bias, float *y) {
    v16 b = {0};
    if (bias) {
        h16 h;
        memcpy(&h, bias + n0, sizeof h);
        b = widen(__builtin_convertvector(h, u16x));
    }
    for (int64_t r = 0; r < rows; r++) {
        v16 v;
        memcpy(&v, tile + 16 * r, sizeof v);
        v = widen(round_bits(bias ? v + b : v));
        memcpy(y + r * N + n0, &v, sizeof v);
    }
}

#ifdef __AMX_TILE__
/* The results of accumulator tile `acc` (0..3) into `tile`: tile numbers are immediates. */
static inline void store_tile(int acc, float *tile) {
    if (acc == 0) _tile_stored(0, tile, 64);
    else if (acc == 1) _tile_stored(1, tile, 64);
    else if (acc == 2) _tile_stored(2, tile, 64);
    else _tile_stored(3, tile, 64);
}

static inline void configure_tiles(void) {
    tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

#define GROUP 4 /* row tiles that share each loaded weight tile */

/* Few rows (a step, a short verify pass): up to GROUP row tiles share each weight tile, loaded once. */
static void by_groups(int64_t M, int64_t N, int64_t K, const uint16_t *xb, const uint16_t *packed,
                      const uint16_t *bias, float *y) {
    int64_t row_tiles = (M + 15) / 16, blocks = K / 32;
    #pragma omp parallel
    {
        configure_tiles();
        float tile[256];
        #pragma omp for schedule(static)
        for (int64_t nb = 0; nb < N / 16; nb++) {
            const uint16_t *w = packed + nb * blocks * 512;
            for (int64_t t0 = 0; t0 < row_tiles; t0 += GROUP) {
                int64_t n = row_tiles - t0 < GROUP ? row_tiles - t0 : GROUP;
                const uint16_t *a = xb + t0 * 16 * K;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t kb = 0; kb < blocks; kb++) { /* K in order: the one summation order of every element */
                    _tile_loadd(5, w + kb * 512, 64);
                    _tile_loadd(4, a + kb * 32, K * 2); _tile_dpbf16ps(0, 4, 5);
                    if (n > 1) { _tile_loadd(4, a + 16 * K + kb * 32, K * 2); _tile_dpbf16ps(1, 4, 5); }
                    if (n > 2) { _tile_loadd(4, a + 32 * K + kb * 32, K * 2); _tile_dpbf16ps(2, 4, 5); }
                    if (n > 3) { _tile_loadd(4, a + 48 * K + kb * 32, K * 2); _tile_dpbf16ps(3, 4, 5); }
                }
                for (int64_t t = 0; t < n; t++) {
                    store_tile((int)t, tile);
                    int64_t m0 = (t0 + t) * 16, rows = M - m0 < 16 ? M - m0 : 16;
                    finish(tile, rows, N, nb * 16, bias, y + m0 * N);
                }
            }
        }
        _tile_release();
    }
}

/* More rows: two row tiles by two column blocks, four accumulators fed by two loads of x and two of W per 32 of
 * K. Each x tile then serves two column blocks, halving what the groups' form reads of x (from L2: a long x
 * does not stay in L1) per tile product. Each accumulator still runs K in order from zero: the same bits. */
static void by_pairs(int64_t M, int64_t N, int64_t K, const uint16_t *xb, const uint16_t *packed,
                     const uint16_t *bias, float *y) {
    int64_t row_tiles = (M + 15) / 16, blocks = K / 32, col_blocks = N / 16;
    #pragma omp parallel
    {
        configure_tiles();
        float tile[256];
        #pragma omp for schedule(static)
        for (int64_t nb = 0; nb < col_blocks; nb += 2) {
            int64_t cols = col_blocks - nb < 2 ? 1 : 2;
            const uint16_t *w0 = packed + nb * blocks * 512, *w1 = w0 + blocks * 512;
            for (int64_t t0 = 0; t0 < row_tiles; t0 += 2) {
                int64_t n = row_tiles - t0 < 2 ? 1 : 2;
                const uint16_t *a = xb + t0 * 16 * K;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t kb = 0; kb < blocks; kb++) { /* accumulator 2t + c: row tile t0 + t, column block nb + c */
                    _tile_loadd(4, a + kb * 32, K * 2);
                    _tile_loadd(6, w0 + kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (cols > 1) { _tile_loadd(7, w1 + kb * 512, 64); _tile_dpbf16ps(1, 4, 7); }
                    if (n > 1) {
                        _tile_loadd(5, a + 16 * K + kb * 32, K * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        if (cols > 1) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                for (int64_t t = 0; t < n; t++)
                    for (int64_t c = 0; c < cols; c++) {
                        store_tile((int)(2 * t + c), tile);
                        int64_t m0 = (t0 + t) * 16, rows = M - m0 < 16 ? M - m0 : 16;
                        finish(tile, rows, N, (nb + c) * 16, bias, y + m0 * N);
                    }
            }
        }
        _tile_release();
    }
}

/* y [M, N] = bf16(bf16(x [M, K]) · Wᵀ + bias) with W packed by specplug_product_pack, bias bf16 [N] or NULL.
 * xb: scratch of ceil(M/16) * 16 * K bf16. Both forms give every element the same sequence of tile products. */
void specplug_product(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *packed,
                      const uint16_t *bias, float *y, uint16_t *xb) {
    to_bf16(M, (M + 15) / 16 * 16, K, x, xb);
    if ((M + 15) / 16 > 2)
        by_pairs(M, N, K, xb, packed, bias, y);
    else
        by_groups(M, N, K, xb, packed, bias, y);
}
#endif

#ifdef __AVX512BF16__
/* 6 × 4 accumulators, 4 weights and a broadcast fill 29 of the 32 vector registers: more rows per loaded weight
 * vector than 4 × 4 kept the dot products ~15% busier over a verify pass's rows. */
#define DOT_ROWS 6 /* rows of x sharing each loaded weight vector */
#define DOT_COLS 4 /* column blocks of 16 sharing each broadcast pair of x */
_Static_assert(DOT_ROWS == 6, "dot_rows' switch names each block height from 1 to DOT_ROWS");

/* R rows (from m0) by C column blocks (from nb): R·C accumulators, each from zero through the pairs of K in order,
 * so an element's sum is the same sequence of dot products whatever R and C. Constant R and C unroll. */
static inline __attribute__((always_inline)) void dot_block(int R, int C, int64_t m0, int64_t nb, int64_t N, int64_t K,
                                                            const uint16_t *xb, const uint16_t *packed,
                                                            const uint16_t *bias, float *y) {
    int64_t pairs = K / 2;
    const uint32_t *x = (const uint32_t *)(xb + m0 * K);
    const uint16_t *w = packed + nb * pairs * 32;
    __m512 acc[DOT_ROWS][2 * DOT_COLS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[DOT_COLS * 2];
        for (int c = 0; c < C; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w + (c * pairs + p) * 32);
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * pairs + p]);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    float tile[256];
    for (int c = 0; c < C; c++) {
        for (int r = 0; r < R; r++) _mm512_storeu_ps(tile + 16 * r, acc[r][c]);
        finish(tile, R, N, (nb + c) * 16, bias, y + m0 * N);
    }
}

/* All M rows by C column blocks from nb, in the fewest blocks of at most DOT_ROWS rows, sized evenly (7 rows: 3 + 4,
 * not 6 + 1, whose lone row leaves the dot products waiting on their latency). */
static inline __attribute__((always_inline)) void dot_rows(int C, int64_t M, int64_t nb, int64_t N, int64_t K,
                                                           const uint16_t *xb, const uint16_t *packed,
                                                           const uint16_t *bias, float *y) {
    int64_t blocks = (M + DOT_ROWS - 1) / DOT_ROWS;
    for (int64_t b = 0, m0 = 0; b < blocks; b++) {
        int64_t rows = (M - m0) / (blocks - b);
        switch (rows) {
            case 6: dot_block(6, C, m0, nb, N, K, xb, packed, bias, y); break;
            case 5: dot_block(5, C, m0, nb, N, K, xb, packed, bias, y); break;
            case 4: dot_block(4, C, m0, nb, N, K, xb, packed, bias, y); break;
            case 3: dot_block(3, C, m0, nb, N, K, xb, packed, bias, y); break;
            case 2: dot_block(2, C, m0, nb, N, K, xb, packed, bias, y); break;
            default: dot_block(1, C, m0, nb, N, K, xb, packed, bias, y); break;
        }
        m0 += rows;
    }
}

/* One row by 2 · DOT_COLS column blocks from nb. A function of its own: inlined beside the many-row blocks, the
 * one-row product of a decode step ran ~10% slower. */
static __attribute__((noinline)) void dot_one_row(int64_t nb, int64_t N, int64_t K, const uint16_t *xb,
                                                  const uint16_t *packed, const uint16_t *bias, float *y) {
    dot_block(1, 2 * DOT_COLS, 0, nb, N, K, xb, packed, bias, y);
}

/* The same y as specplug_product's contract, on AVX-512 BF16 dot products: the weight in the same packed layout
 * (each 16 pairs of a tile row are one 512-bit vector: 16 columns, a pair of K each). A single row takes eight
 * column blocks at a time (eight accumulators in flight), more rows up to DOT_ROWS by DOT_COLS (dot_rows). xb: M·K
 * bf16 at least. */
void specplug_product_dot(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *packed,
                          const uint16_t *bias, float *y, uint16_t *xb) {
    to_bf16(M, M, K, x, xb);
    int64_t blocks = N / 16, width = M == 1 ? 2 * DOT_COLS : DOT_COLS, groups = (blocks + width - 1) / width;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t nb = g * width, left = blocks - nb < width ? blocks - nb : width;
        if (M == 1 && left >= 2 * DOT_COLS) { dot_one_row(nb, N, K, xb, packed, bias, y); continue; }
        for (; left >= DOT_COLS; left -= DOT_COLS, nb += DOT_COLS) dot_rows(DOT_COLS, M, nb, N, K, xb, packed, bias, y);
        for (; left > 0; left--, nb++) dot_rows(1, M, nb, N, K, xb, packed, bias, y);
    }
}
#endif

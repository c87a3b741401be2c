/* Greedy ids for specplug: each float32 row's argmax, the first of equal maxima, a NaN counting as larger than
 * any number (the first NaN wins), as torch's and numpy's argmax take it.
 *
 * Why a kernel: a greedy step asks for the argmax of every scored position, and on the CPU the torch or numpy
 * route is four calls (detach, reshape, numpy, argmax), each tens of µs right after a pass has streamed the
 * weights through the caches, for a few µs of work.
 *
 * Why two passes: the row's maximum first (vectorised: AVX-512 or AVX2, whichever -march=native gives), then the
 * first index holding it, so ties resolve to the first index whatever the vector width. A row is read twice, the
 * second time from L1/L2. */
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static int64_t first_nan(const float *r, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (r[i] != r[i]) return i;
    return -1;
}

/* The maximum of r[0, *i) for the vector body *i chooses (0 where there is none), and whether it held a NaN. */
static float body_max(const float *r, int64_t n, int64_t *i, int *nan) {
#if defined(__AVX512F__)
    if (n < 16) return r[0];
    __m512 mx = _mm512_loadu_ps(r);
    __mmask16 unordered = 0;
    for (; *i + 16 <= n; *i += 16) {
        __m512 v = _mm512_loadu_ps(r + *i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
    }
    *nan = unordered != 0;
    return _mm512_reduce_max_ps(mx);
#elif defined(__AVX2__)
    if (n < 8) return r[0];
    __m256 mx = _mm256_loadu_ps(r), unordered = _mm256_setzero_ps();
    for (; *i + 8 <= n; *i += 8) {
        __m256 v = _mm256_loadu_ps(r + *i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, v);
    }
    *nan = _mm256_movemask_ps(unordered) != 0;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
#else
    (void)n, (void)i, (void)nan;
    return r[0];
#endif
}

/* The first index of r[*i, n) in the vector body holding best, or -1 (then *i is where the body ended). */
static int64_t body_first(const float *r, int64_t n, float best, int64_t *i) {
#if defined(__AVX512F__)
    __m512 target = _mm512_set1_ps(best);
    for (; *i + 16 <= n; *i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + *i), target, _CMP_EQ_OQ);
        if (hit) return *i + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    __m256 target = _mm256_set1_ps(best);
    for (; *i + 8 <= n; *i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + *i), target, _CMP_EQ_OQ));
        if (hit) return *i + __builtin_ctz(hit);
    }
#else
    (void)r, (void)n, (void)best, (void)i;
#endif
    return -1;
}

static int64_t argmax_row(const float *r, int64_t n) {
    int64_t i = 0;
    int nan = 0;
    float best = body_max(r, n, &i, &nan);
    for (; i < n; i++) {
        nan |= r[i] != r[i];
        best = r[i] > best ? r[i] : best;
    }
    if (nan) return first_nan(r, n);
    i = 0;
    int64_t hit = body_first(r, n, best, &i);
    if (hit >= 0) return hit;
    for (; i < n; i++)
        if (r[i] == best) return i;
    return 0;  /* not reached: best is one of the row's values */
}

/* out[m] = the argmax of row m of x [M, N] (N >= 1). Rows split over threads only where there is enough work:
 * a row's answer never depends on the split. */
void specplug_argmax_rows(int64_t M, int64_t N, const float *x, int64_t *out) {
    if (M * N < (1 << 16)) {
        for (int64_t m = 0; m < M; m++) out[m] = argmax_row(x + m * N, N);
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) out[m] = argmax_row(x + m * N, N);
}

/* Attention of a few queries per sequence over that sequence's cached keys and values, for specplug's lean forward.
 *
 * Why a kernel: at batch 16 a step's attention reads every row's float32 cache, one small product per query, and
 * every query of a verify pass reads it again. Here each query head is one task (OpenMP, torch's own runtime), its
 * cache read once from memory and again, for the next query of the same row, from cache.
 *
 * Why this form: a query's result depends on its own q, keys and values only, never on how many queries, rows or
 * threads share the call, so a verified position scores exactly as a one-token step at that position does. The
 * sums run in a fixed order set by the key count (lanes, then a fixed tree), with no compiler reassociation. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat(float x) { return (v16){0} + x; }

static inline v16 vmax(v16 a, v16 b) {
    i16 m = a > b, ai, bi, r;
    memcpy(&ai, &a, sizeof a); memcpy(&bi, &b, sizeof b);
    r = (m & ai) | (~m & bi);
    v16 out; memcpy(&out, &r, sizeof out);
    return out;
}

#define HALVES(op, v) \
    v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)); \
    v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)); \
    v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
static inline v16 vadd(v16 a, v16 b) { return a + b; }
static inline float hsum(v16 v) { HALVES(vadd, v) return v[0] + v[1]; }
static inline float hmax(v16 v) { HALVES(vmax, v) return v[0] > v[1] ? v[0] : v[1]; }

/* e^x lane by lane for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial of degree 7
 * (error under 2e-8), 2^n through the exponent bits; below -87 (e^x under 2^-126) it returns 2^-126-ish. */
static inline v16 vexp(v16 x) {
    x = vmax(x, splat(-87.0f));
    v16 n = (x * splat(1.44269504089f) + splat(12582912.f)) - splat(12582912.f); /* round to nearest */
    v16 r = x - n * splat(0.693145751953125f) - n * splat(1.428606765330187e-06f);
    v16 p = splat(1.f / 5040);
    p = p * r + splat(1.f / 720); p = p * r + splat(1.f / 120); p = p * r + splat(1.f / 24);
    p = p * r + splat(1.f / 6); p = p * r + splat(0.5f); p = p * r + splat(1.f); p = p * r + splat(1.f);
    i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    v16 scale; memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* softmax(q·Kᵀ) V for one query head (q scaled) over L keys and values, rows of d floats (d <= 128: chunks of 16
 * lanes, then the rest one by one). e: scratch of at least L + 16 floats. */
static inline __attribute__((always_inline)) void attend_head(const float *q, const float *K, const float *V,
                                                              int64_t L, int64_t d, float *out, float *e) {
    int64_t padded = (L + 15) & ~(int64_t)15, chunks = d / 16, rest = d % 16, tail = 16 * chunks;
    for (int64_t j = 0; j < L; j++) {
        const float *k = K + j * d;
        v16 acc = {0};
        for (int64_t i = 0; i < chunks; i++) acc += load(q + 16 * i) * load(k + 16 * i);
        float s = hsum(acc);
        for (int64_t i = tail; i < d; i++) s += q[i] * k[i];
        e[j] = s;
    }
    for (int64_t j = L; j < padded; j++) e[j] = -INFINITY;
    v16 m = splat(-INFINITY), sum = {0};
    for (int64_t j = 0; j < padded; j += 16) m = vmax(m, load(e + j));
    v16 top = splat(hmax(m));
    for (int64_t j = 0; j < padded; j += 16) store(e + j, vexp(load(e + j) - top));
    for (int64_t j = L; j < padded; j++) e[j] = 0.f; /* the padding weighs nothing */
    for (int64_t j = 0; j < padded; j += 16) sum += load(e + j);
    v16 o[8] = {{0}};
    float o_rest[16] = {0};
    for (int64_t j = 0; j < L; j++) {
        v16 p = splat(e[j]);
        const float *v = V + j * d;
        for (int64_t i = 0; i < chunks; i++) o[i] += p * load(v + 16 * i);
        for (int64_t i = 0; i < rest; i++) o_rest[i] += e[j] * v[tail + i];
    }
    float inv = 1.f / hsum(sum);
    for (int64_t i = 0; i < chunks; i++) store(out + 16 * i, o[i] * splat(inv));
    for (int64_t i = 0; i < rest; i++) out[tail + i] = o_rest[i] * inv;
}

/* Queries n = 0..N-1, each with H heads (q, out: [N, H, d], q scaled). Query n sees keys 0..len[n]-1 of its cache,
 * whose kv head g starts at kbase[n] + g * stride[n] floats (values at vbase[n] likewise); head h reads kv head
 * h / (H / G). Returns 0, or -1 for shapes it does not take (d > 128), -2 when scratch could not be allocated. */
int64_t specplug_attend(int64_t N, int64_t H, int64_t G, int64_t d, const float *q, float *out,
                        const int64_t *kbase, const int64_t *vbase, const int64_t *stride, const int64_t *len,
                        int64_t maxlen) {
    if (d <= 0 || d > 128 || G <= 0 || H % G) return -1;
    int64_t group = H / G;
    int failed = 0;
    #pragma omp parallel
    {
        float *e = malloc(sizeof(float) * (size_t)(maxlen + 16));
        if (!e) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < N * H; t++) {
            int64_t n = t / H, g = (t % H) / group;
            const float *K = (const float *)kbase[n] + g * stride[n], *V = (const float *)vbase[n] + g * stride[n];
            if (!e) continue;
            if (d == 64) attend_head(q + t * d, K, V, len[n], 64, out + t * d, e); /* constant sizes unroll */
            else if (d == 128) attend_head(q + t * d, K, V, len[n], 128, out + t * d, e);
            else attend_head(q + t * d, K, V, len[n], d, out + t * d, e);
        }
        free(e);
    }
    return failed ? -2 : 0;
}

/* Rows r = 0..R-1 in order, each with count[r] new positions: row r's come next in k and v ([N, G, d], positions
 * ks and vs floats apart, heads d apart) and go into its cache from position start[r] on, kv head g at
 * kbase[r] + g * stride[r] (vbase likewise), positions d apart. One call in place of two copies per row. */
void specplug_append(int64_t R, int64_t G, int64_t d, const float *k, const float *v, int64_t ks, int64_t vs,
                     const int64_t *kbase, const int64_t *vbase, const int64_t *stride, const int64_t *start,
                     const int64_t *count) {
    int64_t at = 0;
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < count[r]; i++, at++)
            for (int64_t g = 0; g < G; g++) {
                int64_t to = g * stride[r] + (start[r] + i) * d;
                memcpy((float *)kbase[r] + to, k + at * ks + g * d, sizeof(float) * (size_t)d);
                memcpy((float *)vbase[r] + to, v + at * vs + g * d, sizeof(float) * (size_t)d);
            }
}

/* Attention of a few queries per sequence over that sequence's cached keys and values, for specplug's lean forward.
 *
 * Why a kernel: at batch 16 a step's attention reads every row's float32 cache, one small product per query, and
 * every query of a verify pass reads it again. Here each query head is one task (OpenMP, torch's own runtime), its
 * cache read once from memory and again, for the next query of the same row, from cache.
 *
 * Why this form: a query's result depends on its own q, keys and values only, never on how many queries, rows or
 * threads share the call, so a verified position scores exactly as a one-token step at that position does. The
 * sums run in a fixed order set by the key count (lanes, then a fixed tree), with no compiler reassociation.
 *
 * Values may be kept in bf16 (the _v16 entry points): where the value projection already rounds to bf16 the cache
 * holds the very same values in half the bytes, and a step's attention waits on reading them. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat(float x) { return (v16){0} + x; }

typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16x __attribute__((vector_size(64)));

/* 16 lanes of a value row at V + at, float32 or bf16 (widened exactly) as ``bf16`` says. */
static inline v16 load_value(const void *V, int64_t at, int bf16) {
    if (!bf16) return load((const float *)V + at);
    h16 h;
    memcpy(&h, (const uint16_t *)V + at, sizeof h);
    u16x u = __builtin_convertvector(h, u16x) << 16;
    v16 v; memcpy(&v, &u, sizeof v);
    return v;
}

static inline float value_at(const void *V, int64_t at, int bf16) {
    if (!bf16) return ((const float *)V)[at];
    uint32_t u = (uint32_t)((const uint16_t *)V)[at] << 16;
    float x; memcpy(&x, &u, sizeof x);
    return x;
}

/* float32 -> bf16 bits, rounded to nearest even (torch's rounding, as product.c rounds). */
static inline uint16_t bf16_bits(float x) {
    uint32_t u; memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

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

/* Scores of q against 16 keys at once: 16 lane-wise partial sums, one per key, folded by a network whose lanes
 * pair up exactly as hsum's halves do, so each key's score has the bits hsum would give it alone. */
static inline v16 fold16(v16 *a) {
#define PAIR(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))
    v16 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = PAIR(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               PAIR(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        c[i] = PAIR(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               PAIR(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        e[i] = PAIR(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               PAIR(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return PAIR(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           PAIR(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#undef PAIR
}

/* e[j0..j0+15] = q·k for keys j0..j0+n-1 of K (n <= 16; the other lanes hold 0, to be masked by the caller). */
static inline __attribute__((always_inline)) void score_block(const float *q, const float *K, int64_t j0, int64_t n,
                                                              int64_t d, float *e) {
    int64_t chunks = d / 16, tail = 16 * chunks;
    v16 acc[16], qv[8];
    for (int64_t i = 0; i < chunks; i++) qv[i] = load(q + 16 * i);
    if (n == 16) {
        #pragma GCC unroll 16
        for (int64_t t = 0; t < 16; t++) {
            v16 a = {0};
            for (int64_t i = 0; i < chunks; i++) a += qv[i] * load(K + (j0 + t) * d + 16 * i);
            acc[t] = a;
        }
    } else
        for (int64_t t = 0; t < 16; t++) {
            v16 a = {0};
            if (t < n)
                for (int64_t i = 0; i < chunks; i++) a += qv[i] * load(K + (j0 + t) * d + 16 * i);
            acc[t] = a;
        }
    store(e + j0, fold16(acc));
    for (int64_t t = 0; t < n && tail < d; t++) {
        float s = e[j0 + t];
        for (int64_t i = tail; i < d; i++) s += q[i] * K[(j0 + t) * d + i];
        e[j0 + t] = s;
    }
}

#define GROUP 8 /* queries of a span attended together: each key and value read once for all of them */

/* softmax(q·Kᵀ) V for n <= GROUP queries of one head (q scaled, rows qs floats apart; out likewise) over the keys
 * and values of one kv head, rows of d floats (d <= 128: chunks of 16 lanes, then the rest one by one); query i
 * sees the first len[i] keys. Every sum of a query runs in an order set by its own length alone. e: scratch of at
 * least GROUP * (maxlen + 16) floats. */
static inline __attribute__((always_inline)) void attend_queries(const float *q, int64_t qs, const float *K,
                                                                 const void *V, int bf16, const int64_t *len,
                                                                 int64_t n, int64_t d, float *out, float *e,
                                                                 int64_t es) {
    int64_t chunks = d / 16, rest = d % 16, tail = 16 * chunks, most = 0;
    for (int64_t i = 0; i < n; i++) most = len[i] > most ? len[i] : most;
    for (int64_t j0 = 0; j0 < most; j0 += 16) /* a block of keys serves every query that sees it */
        for (int64_t i = 0; i < n; i++)
            if (j0 < len[i]) score_block(q + i * qs, K, j0, len[i] - j0 < 16 ? len[i] - j0 : 16, d, e + i * es);
    v16 sum[GROUP];
    for (int64_t i = 0; i < n; i++) {
        float *ei = e + i * es;
        int64_t L = len[i], padded = (L + 15) & ~(int64_t)15;
        for (int64_t j = L; j < padded; j++) ei[j] = -INFINITY;
        v16 m = splat(-INFINITY);
        for (int64_t j = 0; j < padded; j += 16) m = vmax(m, load(ei + j));
        v16 top = splat(hmax(m));
        for (int64_t j = 0; j < padded; j += 16) store(ei + j, vexp(load(ei + j) - top));
        for (int64_t j = L; j < padded; j++) ei[j] = 0.f; /* the padding weighs nothing */
        sum[i] = (v16){0};
        for (int64_t j = 0; j < padded; j += 16) sum[i] += load(ei + j);
    }
    v16 o[GROUP][8];
    float o_rest[GROUP][16];
    memset(o, 0, sizeof o[0] * (size_t)n);
    memset(o_rest, 0, sizeof o_rest[0] * (size_t)n);
    for (int64_t j0 = 0; j0 < most; j0 += 32) /* a block of values stays in L1 while every query adds it */
        for (int64_t i = 0; i < n; i++) {
            int64_t end = len[i] < j0 + 32 ? len[i] : j0 + 32;
            v16 acc[8];
            for (int64_t c = 0; c < chunks; c++) acc[c] = o[i][c];
            for (int64_t j = j0; j < end; j++) {
                float w = e[i * es + j];
                v16 p = splat(w);
                for (int64_t c = 0; c < chunks; c++) acc[c] += p * load_value(V, j * d + 16 * c, bf16);
                for (int64_t c = 0; c < rest; c++) o_rest[i][c] += w * value_at(V, j * d + tail + c, bf16);
            }
            for (int64_t c = 0; c < chunks; c++) o[i][c] = acc[c];
        }
    for (int64_t i = 0; i < n; i++) {
        float inv = 1.f / hsum(sum[i]), *oi = out + i * qs;
        for (int64_t c = 0; c < chunks; c++) store(oi + 16 * c, o[i][c] * splat(inv));
        for (int64_t c = 0; c < rest; c++) oi[tail + c] = o_rest[i][c] * inv;
    }
}

/* Spans s = 0..S-1 of consecutive queries (q, out: [N, H, d], q scaled): span s holds count[s] queries, the i-th
 * seeing keys 0..first[s] + i of its cache, whose kv head g starts at kbase[s] + g * stride[s] floats (values at
 * vbase[s] likewise, float32 or bf16 as ``bf16`` says); head h reads kv head h / (H / G). Returns 0, or -1 for
 * shapes it does not take (d > 128), -2 when scratch could not be allocated. */
static inline __attribute__((always_inline)) int64_t attend(int64_t S, int64_t H, int64_t G, int64_t d,
                                                            const float *q, float *out, const int64_t *kbase,
                                                            const int64_t *vbase, const int64_t *stride,
                                                            const int64_t *first, const int64_t *count,
                                                            int64_t maxlen, int bf16) {
    if (d <= 0 || d > 128 || G <= 0 || H % G) return -1;
    int64_t group = H / G, es = maxlen + 16, tasks = 0;
    for (int64_t s = 0; s < S; s++) tasks += (count[s] + GROUP - 1) / GROUP;
    /* a task: one head of up to GROUP consecutive queries of a span: its span, the index of its first query in
     * the span and in q */
    int64_t *task = malloc(sizeof(int64_t) * (size_t)(3 * tasks + 1));
    if (!task) return -2;
    for (int64_t s = 0, n = 0, t = 0; s < S; n += count[s], s++)
        for (int64_t i = 0; i < count[s]; i += GROUP, t++) task[3 * t] = s, task[3 * t + 1] = i, task[3 * t + 2] = n + i;
    int failed = 0;
    #pragma omp parallel
    {
        float *e = malloc(sizeof(float) * (size_t)(GROUP * es));
        if (!e) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks * H; t++) {
            const int64_t *job = task + 3 * (t / H);
            int64_t s = job[0], h = t % H, g = h / group, len[GROUP], n = 0;
            for (int64_t i = job[1]; n < GROUP && i < count[s]; i++) len[n++] = first[s] + i + 1;
            const float *K = (const float *)kbase[s] + g * stride[s];
            const void *V = bf16 ? (const void *)((const uint16_t *)vbase[s] + g * stride[s])
                                 : (const void *)((const float *)vbase[s] + g * stride[s]);
            const float *qt = q + (job[2] * H + h) * d;
            float *ot = out + (job[2] * H + h) * d;
            if (!e) continue;
            if (d == 64) attend_queries(qt, H * d, K, V, bf16, len, n, 64, ot, e, es); /* constant sizes unroll */
            else if (d == 128) attend_queries(qt, H * d, K, V, bf16, len, n, 128, ot, e, es);
            else attend_queries(qt, H * d, K, V, bf16, len, n, d, ot, e, es);
        }
        free(e);
    }
    free(task);
    return failed ? -2 : 0;
}

int64_t specplug_attend(int64_t S, int64_t H, int64_t G, int64_t d, const float *q, float *out,
                        const int64_t *kbase, const int64_t *vbase, const int64_t *stride, const int64_t *first,
                        const int64_t *count, int64_t maxlen) {
    return attend(S, H, G, d, q, out, kbase, vbase, stride, first, count, maxlen, 0);
}

/* specplug_attend over bf16 values (keys float32; strides in entries, as there). */
int64_t specplug_attend_v16(int64_t S, int64_t H, int64_t G, int64_t d, const float *q, float *out,
                            const int64_t *kbase, const int64_t *vbase, const int64_t *stride, const int64_t *first,
                            const int64_t *count, int64_t maxlen) {
    return attend(S, H, G, d, q, out, kbase, vbase, stride, first, count, maxlen, 1);
}

/* Rows r = 0..R-1 in order, each with count[r] new positions: row r's come next in k and v ([N, G, d], positions
 * ks and vs floats apart, heads d apart) and go into its cache from position start[r] on, kv head g at
 * kbase[r] + g * stride[r] (vbase likewise), positions d apart; values stored in bf16 where ``bf16`` says, each
 * rounded to nearest even as torch's copy into a bf16 cache rounds. One call in place of two copies per row. */
static inline __attribute__((always_inline)) void append(int64_t R, int64_t G, int64_t d, const float *k,
                                                         const float *v, int64_t ks, int64_t vs, const int64_t *kbase,
                                                         const int64_t *vbase, const int64_t *stride,
                                                         const int64_t *start, const int64_t *count, int bf16) {
    int64_t at = 0;
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < count[r]; i++, at++)
            for (int64_t g = 0; g < G; g++) {
                int64_t to = g * stride[r] + (start[r] + i) * d;
                const float *from = v + at * vs + g * d;
                memcpy((float *)kbase[r] + to, k + at * ks + g * d, sizeof(float) * (size_t)d);
                if (!bf16) memcpy((float *)vbase[r] + to, from, sizeof(float) * (size_t)d);
                else for (int64_t j = 0; j < d; j++) ((uint16_t *)vbase[r] + to)[j] = bf16_bits(from[j]);
            }
}

void specplug_append(int64_t R, int64_t G, int64_t d, const float *k, const float *v, int64_t ks, int64_t vs,
                     const int64_t *kbase, const int64_t *vbase, const int64_t *stride, const int64_t *start,
                     const int64_t *count) {
    append(R, G, d, k, v, ks, vs, kbase, vbase, stride, start, count, 0);
}

void specplug_append_v16(int64_t R, int64_t G, int64_t d, const float *k, const float *v, int64_t ks, int64_t vs,
                         const int64_t *kbase, const int64_t *vbase, const int64_t *stride, const int64_t *start,
                         const int64_t *count) {
    append(R, G, d, k, v, ks, vs, kbase, vbase, stride, start, count, 1);
}

/* The gated activation of specplug's lean forward: out = silu(gate) · up, of float32 rows [gate | up].
 *
 * Why a kernel: torch's form is two views, silu and a product, a few microseconds of dispatch each around well
 * under a microsecond of work on a step's rows; and with it in C a fused layer (layer.c) is one call.
 *
 * Why this form: each element is computed alone (no sums), so a row's result never depends on the other rows:
 * a verified position activates exactly as a one-token step does. silu(g) = g / (1 + e^-g), each operation
 * rounded on its own (no fused multiply-adds), e^x by a fixed polynomial; it agrees with torch's silu to a few
 * ulps, and whichever form the machine chose serves every path of a layer. */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 splat(float x) { return (v16){0} + x; }

static inline v16 clamp(v16 x, float lo, float hi) {
    i16 below = x < splat(lo), above = x > splat(hi), xi, loi, hii;
    v16 l = splat(lo), h = splat(hi);
    memcpy(&xi, &x, sizeof x); memcpy(&loi, &l, sizeof l); memcpy(&hii, &h, sizeof h);
    xi = (xi & ~below & ~above) | (loi & below) | (hii & above);
    memcpy(&x, &xi, sizeof x);
    return x;
}

/* e^x lane by lane for x in [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial of
 * degree 7 (error under 2e-8), 2^n through the exponent bits. attend.c has its own for x <= 0: each kernel is
 * one source, compiled and cached by its own text (specplug.native). */
static inline v16 vexp(v16 x) {
    x = clamp(x, -87.0f, 88.0f);
    v16 n = (x * splat(1.44269504089f) + splat(12582912.f)) - splat(12582912.f); /* round to nearest */
    v16 r = x - n * splat(0.693145751953125f) - n * splat(1.428606765330187e-06f);
    v16 p = splat(1.f / 5040);
    p = p * r + splat(1.f / 720); p = p * r + splat(1.f / 120); p = p * r + splat(1.f / 24);
    p = p * r + splat(1.f / 6); p = p * r + splat(0.5f); p = p * r + splat(1.f); p = p * r + splat(1.f);
    i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    v16 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline v16 silu_mul16(v16 g, v16 u) {
    v16 s = g / (splat(1.f) + vexp(-g));
    return s * u;
}

/* gu [N, 2·inter] (each row its gate, then its up) -> out [N, inter]. */
void specplug_silu_mul(int64_t N, int64_t inter, const float *gu, float *out) {
    int64_t body = inter - inter % 16;
    #pragma omp parallel for schedule(static) if (N * inter >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const float *g = gu + n * 2 * inter, *u = g + inter;
        float *o = out + n * inter;
        for (int64_t j = 0; j < body; j += 16) {
            v16 gv, uv;
            memcpy(&gv, g + j, sizeof gv);
            memcpy(&uv, u + j, sizeof uv);
            v16 y = silu_mul16(gv, uv);
            memcpy(o + j, &y, sizeof y);
        }
        if (body < inter) { /* the tail through the same lanes, padded: the same arithmetic per element */
            v16 gv = {0}, uv = {0};
            memcpy(&gv, g + body, sizeof(float) * (size_t)(inter - body));
            memcpy(&uv, u + body, sizeof(float) * (size_t)(inter - body));
            v16 y = silu_mul16(gv, uv);
            memcpy(o + body, &y, sizeof(float) * (size_t)(inter - body));
        }
    }
}

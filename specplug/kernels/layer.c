/* One decoder layer of specplug's lean forward over a step's rows (each row's new positions after its cached ones),
 * in two calls where the layer's torch form makes some thirty op and kernel calls.
 *
 * Why: on a step's few rows a layer's arithmetic is a fraction of its dispatch: each torch op and kernel call
 * costs microseconds of Python and allocation around under a microsecond of work, about a third of a one-row
 * step of the zoo target.
 *
 * Why this form: it calls the very kernels the torch form calls (products, RMSNorm, cache append, attention),
 * whose addresses the caller passes in, and does the rest (rotary embedding, scaling, residual sums) with one
 * rounding per operation and no contraction into fused multiply-adds, as torch's elementwise ops round. So
 * its outputs are the torch form's bit for bit, which the caller checks on the machine before using it. Where
 * the layer's activation runs on the activation kernel (silu.c) it runs here too, and the layer is one call;
 * otherwise the caller runs torch's activation between the two calls. */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <string.h>

typedef void (*tiles_fn)(int64_t, int64_t, int64_t, const float *, const void *, const void *, float *, void *);
typedef void (*rows_fn)(int64_t, int64_t, int64_t, const float *, const void *, const void *, float *);
typedef void (*rows16_fn)(int64_t, int64_t, int64_t, const float *, const void *, const void *, float *, int64_t);
typedef void (*norm_fn)(int64_t, int64_t, const float *, const float *, float, float *);
typedef void (*append_fn)(int64_t, int64_t, int64_t, const float *, const float *, int64_t, int64_t,
                          const int64_t *, const int64_t *, const int64_t *, const int64_t *, const int64_t *);
typedef int64_t (*attend_fn)(int64_t, int64_t, int64_t, int64_t, const float *, float *, const int64_t *,
                             const int64_t *, const int64_t *, const int64_t *, const int64_t *, int64_t);
typedef void (*act_fn)(int64_t, int64_t, const float *, float *);

enum { TILES = 0, ROWS = 1, ROWS_FROM_16 = 2 };

/* One product y = x Wᵀ + b by its kernel: the bf16 kernel, AMX or AVX-512 (scratch xb), the float32 rows
 * kernel, or the rows kernel reading a 16-bit copy (flag: bfloat16 rather than half). */
typedef struct {
    int64_t kind, out, in, flag;
    const void *fn, *w, *b;
} product_t;

typedef struct {
    int64_t h, heads, kv_heads, d, inter;
    double scaling, eps_in, eps_post;
    const float *w_in, *w_post;
    const void *norm, *append, *attend, *act; /* act: NULL where the caller activates in torch's form */
    product_t qkv, o, gate_up, down;
} layer_t;

static void product(const product_t *p, int64_t M, const float *x, float *y, void *xb) {
    if (p->kind == TILES) ((tiles_fn)p->fn)(M, p->out, p->in, x, p->w, p->b, y, xb);
    else if (p->kind == ROWS) ((rows_fn)p->fn)(M, p->out, p->in, x, p->w, p->b, y);
    else ((rows16_fn)p->fn)(M, p->out, p->in, x, p->w, p->b, y, p->flag);
}

/* x·cos + roll(x, d/2)·sin of one head (sin signed as the caller's table keeps it), each product and the sum
 * rounded on their own, as torch's three ops round them. */
static void rotate(const float *x, const float *c, const float *s, int64_t d, float *out) {
    int64_t half = d / 2;
    for (int64_t j = 0; j < d; j++) {
        float a = x[j] * c[j];
        float b = x[j < half ? j + half : j - half] * s[j];
        out[j] = a + b;
    }
}

/* Rows x [N, h] -> x_mid = x + o(attention) [N, h] and gu = gate_up(norm_post(x_mid)) [N, 2·inter].
 * Row r of R has count[r] of the N positions, in order, going into its cache after its length[r] entries
 * (table: R key bases, value bases, kv-head strides, lengths, counts; the caches must have room, and their
 * lengths are the caller's to advance); cos, sin [N, d] of their positions. work: N·(2h + W + 2·heads·d)
 * floats, W = (heads + 2·kv_heads)·d; xb: a product's scratch. Returns the attention kernel's status. */
int64_t specplug_layer_first(const layer_t *L, int64_t N, const float *x, const float *cos, const float *sin,
                             int64_t R, const int64_t *table, int64_t maxlen, float *x_mid, float *gu, float *work,
                             void *xb) {
    int64_t h = L->h, H = L->heads, G = L->kv_heads, d = L->d, W = (H + 2 * G) * d;
    float *xn = work, *qkv = xn + N * h, *q = qkv + N * W, *att = q + N * H * d, *o = att + N * H * d;
    float scaling = (float)L->scaling, rotated[256];
    if (d > 256) return -1;
    ((norm_fn)L->norm)(N, h, x, L->w_in, (float)L->eps_in, xn);
    product(&L->qkv, N, xn, qkv, xb);
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos + n * d, *s = sin + n * d;
        for (int64_t head = 0; head < H + G; head++) {
            float *src = qkv + n * W + head * d;
            rotate(src, c, s, d, rotated);
            if (head < H)  /* the queries, scaled once rotated: a rounding of its own, as torch's product */
                for (int64_t j = 0; j < d; j++) q[(n * H + head) * d + j] = rotated[j] * scaling;
            else
                memcpy(src, rotated, sizeof(float) * (size_t)d);
        }
    }
    const int64_t *kbase = table, *vbase = table + R, *stride = table + 2 * R, *length = table + 3 * R,
                  *count = table + 4 * R;
    ((append_fn)L->append)(R, G, d, qkv + H * d, qkv + (H + G) * d, W, W, kbase, vbase, stride, length, count);
    int64_t status = ((attend_fn)L->attend)(R, H, G, d, q, att, kbase, vbase, stride, length, count, maxlen);
    if (status) return status;
    product(&L->o, N, att, o, xb);
    for (int64_t i = 0; i < N * h; i++) x_mid[i] = x[i] + o[i];
    ((norm_fn)L->norm)(N, h, x_mid, L->w_post, (float)L->eps_post, xn);
    product(&L->gate_up, N, xn, gu, xb);
    return 0;
}

/* x_out = x_mid + down(act), act [N, inter] the activated gate times up; work: N·h floats. */
void specplug_layer_last(const layer_t *L, int64_t N, const float *x_mid, const float *act, float *x_out,
                         float *work, void *xb) {
    product(&L->down, N, act, work, xb);
    for (int64_t i = 0; i < N * L->h; i++) x_out[i] = x_mid[i] + work[i];
}

/* The whole layer where its activation is in C (L->act): specplug_layer_first, act(gu) into act [N, inter], then
 * specplug_layer_last into x_out. */
int64_t specplug_layer(const layer_t *L, int64_t N, const float *x, const float *cos, const float *sin, int64_t R,
                       const int64_t *table, int64_t maxlen, float *x_mid, float *gu, float *act, float *x_out,
                       float *work, void *xb) {
    int64_t status = specplug_layer_first(L, N, x, cos, sin, R, table, maxlen, x_mid, gu, work, xb);
    if (status) return status;
    ((act_fn)L->act)(N, L->inter, gu, act);
    specplug_layer_last(L, N, x_mid, act, x_out, work, xb);
    return 0;
}

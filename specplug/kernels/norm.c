/* RMSNorm of float32 rows for specplug's lean forward: out = x · (mean(x²) + eps)^(-1/2) · w, row by row.
 *
 * Why a kernel: on one row of a small model torch's rms_norm is several small ops, ~16 µs of dispatch for
 * under a microsecond of arithmetic, and a step makes two per layer and one more.
 *
 * Why this form: each row's sum of squares runs in one fixed order (LANES partial sums over the row in order,
 * the lanes added in a fixed tree, then the tail), so a row's result depends on that row alone, never on how
 * many rows share the call: a verified position normalises exactly as a one-token step does. */
#include <math.h>
#include <stdint.h>

#define LANES 8

void specplug_rms_norm(int64_t rows, int64_t h, const float *x, const float *w, float eps, float *out) {
    int64_t body = h - h % LANES;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * h;
        float *yr = out + r * h;
        float acc[LANES] = {0};
        for (int64_t k = 0; k < body; k += LANES)
            for (int64_t l = 0; l < LANES; l++)
                acc[l] = fmaf(xr[k + l], xr[k + l], acc[l]);
        float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (int64_t k = body; k < h; k++)
            s = fmaf(xr[k], xr[k], s);
        float scale = 1.0f / sqrtf(s / (float)h + eps);
        for (int64_t k = 0; k < h; k++)
            yr[k] = w[k] * (xr[k] * scale);
    }
}

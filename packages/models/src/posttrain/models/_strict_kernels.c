/* Fused strict linear forward for posttrain.models (see _ckernel.py).
 *
 * out[r, n] = the pairwise tree over k of x[r, k] * w[k, n], K zero-padded (+0.0) to
 * W = 2**L: level by level element i is added to element i + W/2**level, exactly as
 * _ops._tree_levels does on the materialised products. Every IEEE multiply and add is the
 * same, so every bit is the same: signed zeros, infinities, denormals, and NaN where torch
 * gives NaN (when two NaNs of different sign or payload meet, which one comes out is the
 * CPU's operand order, which neither C nor torch's own kernels fix).
 *
 * The tree that pairs i with i + half is the adjacent-pair tree over the leaves taken in
 * bit-reversed index order (the top bit of i is the bottom bit of its reversal), so the
 * products are streamed in that order, G leaves at a time summed in registers, and the
 * group sums merged through a stack of one partial sum per level as a binary counter
 * carries. Nothing bigger than that stack is written.
 *
 * Tiles: VL outputs along a "vector" dim (the SIMD lanes) times BB along a "broadcast" dim
 * (a scalar times a vector). Lanes run over the output columns for a few rows (decode), over
 * the rows for many rows (training, batched decode): whichever wastes fewer padded lanes.
 * Tails are zero-padded copies; their results are dropped.
 *
 * Compile with -ffp-contract=off and without -ffast-math: a fused multiply-add or any
 * reassociation would change the bits. Plain C, no torch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VL 16 /* lanes per tile */
#define BB 4  /* broadcast values per tile */
#define G 4   /* leaves summed in registers before the stack */
#define MAXL 40

static int64_t bitrev(int64_t j, int bits) {
    int64_t r = 0;
    for (int b = 0; b < bits; b++) r = (r << 1) | ((j >> b) & 1);
    return r;
}

/* VL lanes as one GCC/clang vector: lowered to whatever SIMD the target has (16 lanes of
 * AVX-512, two AVX registers, ...); + and * on it are the elementwise IEEE ops. */
typedef float vf __attribute__((vector_size(VL * sizeof(float))));

/* One tile: res[b] = tree_i vt[i] * st[b][i] (lanes v) for b < bb, leaves in `order`, g per
 * group. vt: K vectors of VL floats, ldv floats apart; st: [bb][K] (zero-padded rows). */
static inline __attribute__((always_inline)) void tile(const float *restrict vt, int64_t ldv,
                                                       const float *restrict st, int64_t K,
                                                       const int64_t *restrict order,
                                                       int64_t W, const int g, const int bb,
                                                       vf res[BB]) {
    vf stack[MAXL][BB];
    const vf zero = {0.0f};
    int64_t groups = W / g;
    for (int64_t c = 0; c < groups; c++) {
        vf leaf[G][BB];
        for (int t = 0; t < g; t++) {
            int64_t i = order[c * g + t];
            if (i < K) {
                vf vi;
                memcpy(&vi, vt + i * ldv, sizeof(vf)); /* an unaligned vector load */
                for (int b = 0; b < bb; b++) leaf[t][b] = vi * st[b * K + i];
            } else {
                for (int b = 0; b < bb; b++) leaf[t][b] = zero;
            }
        }
        for (int span = g; span > 1; span /= 2)
            for (int t = 0; t < span / 2; t++)
                for (int b = 0; b < bb; b++) leaf[t][b] = leaf[2 * t][b] + leaf[2 * t + 1][b];
        int level = 0;
        for (int64_t carry = c; carry & 1; carry >>= 1, level++)
            for (int b = 0; b < bb; b++) leaf[0][b] = stack[level][b] + leaf[0][b];
        for (int b = 0; b < bb; b++) stack[level][b] = leaf[0][b];
    }
    int top = 0;
    while (((int64_t)1 << top) < groups) top++;
    for (int b = 0; b < bb; b++) res[b] = stack[top][b];
}

/* The instances: G leaves a group (W >= G) or one group of W (W < G); BB broadcast values, or
 * one or two (a problem with one or two rows or columns there: no padded work). */
#define INSTANCE(name, g, bb)                                                                 \
    static void name(const float *vt, int64_t ldv, const float *st, int64_t K,                \
                     const int64_t *order, int64_t W, vf res[BB]) {                           \
        tile(vt, ldv, st, K, order, W, g, bb, res);                                           \
    }
INSTANCE(tile_g_4, G, BB)
INSTANCE(tile_g_2, G, 2)
INSTANCE(tile_g_1, G, 1)
INSTANCE(tile_w_4, (int)W, BB)

/* B1 x B2 independent problems out[p1, p2] = x[p1, p2] @ w[p1, p2] (fp32), the operands read
 * through element strides: x[p1, p2, r, k] at x + p1 * xs[0] + p2 * xs[1] + r * xs[2] + k * xs[3],
 * w[p1, p2, k, n] likewise with ws; out [B1, B2, R, N] contiguous. Returns 0; -1 if K is out of
 * range, -2 if scratch memory cannot be allocated. */
int posttrain_strict_matmul(const float *x, const int64_t *xs, const float *w, const int64_t *ws,
                            float *out, int64_t B1, int64_t B2, int64_t R, int64_t K, int64_t N) {
    if (K < 1) return -1;
    if (B1 < 1 || B2 < 1 || R < 1 || N < 1) return 0;
    int bits = 0;
    while (((int64_t)1 << bits) < K) bits++;
    if (bits >= MAXL) return -1;
    int64_t W = (int64_t)1 << bits;
    /* lanes over the columns (V = w, S = x) or over the rows (V = x^T, S = w^T): the products
     * each computes, padding included (one or two broadcast values: no padding) */
    int64_t pad_r = R <= 2 ? R : (R + BB - 1) / BB * BB;
    int64_t pad_n = N <= 2 ? N : (N + BB - 1) / BB * BB;
    int by_rows = ((R + VL - 1) / VL * VL) * pad_n < ((N + VL - 1) / VL * VL) * pad_r;
    int64_t LV = by_rows ? R : N, LB = by_rows ? N : R;
    /* per problem: V(i, v) = vsrc[i * vi + v * vv]; S(b, i) = ssrc[b * sb + i * si]; out(b, v) */
    int64_t vi = by_rows ? xs[3] : ws[2], vv = by_rows ? xs[2] : ws[3];
    int64_t sb = by_rows ? ws[3] : xs[2], si = by_rows ? ws[2] : xs[3];
    int64_t ob = by_rows ? 1 : N, ov = by_rows ? N : 1;
    int64_t nbb = (LB + BB - 1) / BB;
    void (*fn)(const float *, int64_t, const float *, int64_t, const int64_t *, int64_t, vf *) =
        W < G ? tile_w_4 : LB == 1 ? tile_g_1 : LB == 2 ? tile_g_2 : tile_g_4;
    int64_t *order = malloc((size_t)W * sizeof(int64_t));
    vf *vt = aligned_alloc(sizeof(vf), (size_t)K * sizeof(vf));
    float *st = malloc((size_t)nbb * BB * K * sizeof(float));
    if (!order || !vt || !st) {
        free(order);
        free(vt);
        free(st);
        return -2;
    }
    for (int64_t j = 0; j < W; j++) order[j] = bitrev(j, bits);
    vf res[BB];
    for (int64_t p = 0; p < B1 * B2; p++) {
        int64_t p1 = p / B2, p2 = p % B2;
        const float *xp = x + p1 * xs[0] + p2 * xs[1], *wp = w + p1 * ws[0] + p2 * ws[1];
        const float *vsrc = by_rows ? xp : wp, *ssrc = by_rows ? wp : xp;
        float *op = out + p * R * N;
        for (int64_t b = 0; b < nbb * BB; b++)
            for (int64_t i = 0; i < K; i++)
                st[b * K + i] = b < LB ? ssrc[b * sb + i * si] : 0.0f;
        for (int64_t v0 = 0; v0 < LV; v0 += VL) {
            int64_t nv = LV - v0 < VL ? LV - v0 : VL;
            /* whole lanes of contiguous vectors are read in place, others packed (zero-padded) */
            const float *vp = vsrc + v0 * vv;
            int64_t ldv = vi;
            if (nv < VL || vv != 1) {
                for (int64_t i = 0; i < K; i++)
                    for (int64_t v = 0; v < VL; v++)
                        vt[i][v] = v < nv ? vsrc[i * vi + (v0 + v) * vv] : 0.0f;
                vp = (const float *)vt;
                ldv = VL;
            }
            for (int64_t bt = 0; bt < nbb; bt++) {
                fn(vp, ldv, st + bt * BB * K, K, order, W, res);
                int64_t b0 = bt * BB;
                int64_t nb = LB - b0 < BB ? LB - b0 : BB;
                for (int64_t b = 0; b < nb; b++)
                    for (int64_t v = 0; v < nv; v++)
                        op[(b0 + b) * ob + (v0 + v) * ov] = res[b][v];
            }
        }
    }
    free(order);
    free(vt);
    free(st);
    return 0;
}

/* exp_strict elementwise over n values (torch's path: _ops._exp_torch). The same fp32 ops in
 * the same order as torch's (constants rounded to fp32 as torch rounds a Python float against
 * an fp32 tensor), so the same bits. */
void posttrain_exp_strict(const float *restrict x, int64_t n, const float *restrict coeffs,
                          float *restrict out) {
    const float inv_ln2 = 1.4426950408889634f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        v = v < -87.0f ? -87.0f : v > 88.0f ? 88.0f : v;
        float k = nearbyintf(v * inv_ln2); /* ties to even, as torch.round (default mode) */
        float r = (v - k * ln2_hi) - k * ln2_lo;
        float p = coeffs[0];
        for (int j = 1; j < 8; j++) p = p * r + coeffs[j];
        /* torch's float -> int32 of a NaN gives INT32_MIN (cvttps2dq); the shift then drops its
         * top bit (as torch's int32 shift does), so the scale is 1.0 there too */
        int32_t ki = k == k ? (int32_t)k : INT32_MIN;
        union {
            uint32_t i;
            float f;
        } scale = {.i = (uint32_t)(ki + 127) << 23};
        out[i] = p * scale.f;
    }
}

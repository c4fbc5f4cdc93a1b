/* Fused strict linear forward for posttrain.models (see _ckernel.py).
 *
 * out[r, n] = the pairwise tree over k of x[r, k] * w[k, n], K zero-padded (+0.0) to
 * W = 2**L: level by level element i is added to element i + W/2**level, exactly as
 * _ops._tree_levels does on the materialised products. Every IEEE op is the same, so
 * every bit is the same (signed zeros, infinities and NaNs included).
 *
 * The tree that pairs i with i + half is the adjacent-pair tree over the leaves taken in
 * bit-reversed index order (the top bit of i is the bottom bit of its reversal), so the
 * products are streamed in that order and reduced with a binary counter: a stack of one
 * partial sum per level, merged as a counter carries. Each merge is `earlier + later`
 * (the lower index on the left, as x[:half] + x[half:]). Nothing bigger than a stack of
 * L * RB * NB floats is written; vectorised over n.
 *
 * Compile with -ffp-contract=off and without -ffast-math: a fused multiply-add or any
 * reassociation would change the bits. Plain C, no torch headers.
 */
#include <stdint.h>
#include <stdlib.h>

#define NB 64 /* output columns per block: the vector dimension */
#define RB 4  /* rows per block: each loaded weight row serves RB rows */
#define G 4   /* leaves reduced in registers before the stack */
#define MAXL 40

static inline int64_t bitrev(int64_t j, int bits) {
    int64_t r = 0;
    for (int b = 0; b < bits; b++) {
        r = (r << 1) | ((j >> b) & 1);
    }
    return r;
}

/* One block of rb <= RB rows and nb <= NB columns (nb == NB on the fast path). */
static void block(const float *restrict x, int64_t K, const float *restrict w, int64_t N,
                  float *restrict out, const int64_t *restrict order, int64_t W, int g,
                  int rb, int nb) {
    float stack[MAXL][RB][NB];
    float leaf[G][RB][NB];
    int64_t groups = W / g;
    for (int64_t c = 0; c < groups; c++) {
        for (int t = 0; t < g; t++) {
            int64_t i = order[c * g + t];
            if (i < K) {
                const float *wi = w + i * N;
                for (int r = 0; r < rb; r++) {
                    float xv = x[r * K + i];
                    if (nb == NB) {
                        for (int n = 0; n < NB; n++) leaf[t][r][n] = wi[n] * xv;
                    } else {
                        for (int n = 0; n < nb; n++) leaf[t][r][n] = wi[n] * xv;
                        for (int n = nb; n < NB; n++) leaf[t][r][n] = 0.0f;
                    }
                }
            } else {
                for (int r = 0; r < rb; r++)
                    for (int n = 0; n < NB; n++) leaf[t][r][n] = 0.0f;
            }
        }
        /* the adjacent-pair tree over the group's g leaves, in place */
        for (int span = g; span > 1; span /= 2) {
            for (int t = 0; t < span / 2; t++)
                for (int r = 0; r < rb; r++)
                    for (int n = 0; n < NB; n++)
                        leaf[t][r][n] = leaf[2 * t + 1][r][n] + leaf[2 * t][r][n];
        }
        /* carry into the stack: earlier partial sums on the left */
        int level = 0;
        int64_t carry = c;
        while (carry & 1) {
            for (int r = 0; r < rb; r++)
                for (int n = 0; n < NB; n++)
                    leaf[0][r][n] = leaf[0][r][n] + stack[level][r][n];
            carry >>= 1;
            level++;
        }
        for (int r = 0; r < rb; r++)
            for (int n = 0; n < NB; n++) stack[level][r][n] = leaf[0][r][n];
    }
    int top = 0;
    while (((int64_t)1 << top) < groups) top++;
    for (int r = 0; r < rb; r++)
        for (int n = 0; n < nb; n++) out[r * N + n] = stack[top][r][n];
}

/* x: [R, K] rows, w: [K, N] (the weight transposed), out: [R, N]; all contiguous fp32.
 * Returns 0; -1 if K is out of range, -2 if the index scratch cannot be allocated. */
int posttrain_strict_linear(const float *x, int64_t R, int64_t K, const float *w, int64_t N,
                            float *out) {
    if (K < 1) return -1;
    int bits = 0;
    while (((int64_t)1 << bits) < K) bits++;
    if (bits >= MAXL) return -1;
    int64_t W = (int64_t)1 << bits;
    int64_t *order = malloc((size_t)W * sizeof(int64_t));
    if (!order) return -2;
    for (int64_t j = 0; j < W; j++) order[j] = bitrev(j, bits);
    int g = W < G ? (int)W : G;
    for (int64_t n0 = 0; n0 < N; n0 += NB) {
        int nb = N - n0 < NB ? (int)(N - n0) : NB;
        for (int64_t r0 = 0; r0 < R; r0 += RB) {
            int rb = R - r0 < RB ? (int)(R - r0) : RB;
            block(x + r0 * K, K, w + n0, N, out + r0 * N + n0, order, W, g, rb, nb);
        }
    }
    free(order);
    return 0;
}

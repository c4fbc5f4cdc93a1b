/* Fused strict CPU kernels for posttrain.models (see _ckernel.py): the linear's forward (this
 * comment), exp_strict, attention over key rows, RMSNorm and SiLU-and-multiply (each the bits of
 * its torch ops), and the backwards of attention and RMSNorm (deterministic, no bit contract).
 *
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

/* exp_strict of one value: the same fp32 ops in the same order as torch's path
 * (_ops._exp_torch; constants rounded to fp32 as torch rounds a Python float against an fp32
 * tensor), so the same bits. */
static inline float exp_strict1(float v, const float *restrict coeffs) {
    const float inv_ln2 = 1.4426950408889634f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
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
    return p * scale.f;
}

/* exp_strict elementwise over n values (torch's path: _ops._exp_torch). */
void posttrain_exp_strict(const float *restrict x, int64_t n, const float *restrict coeffs,
                          float *restrict out) {
    for (int64_t i = 0; i < n; i++) out[i] = exp_strict1(x[i], coeffs);
}

/* The pairwise tree over the first w (a power of two) rows of a[w][len] in place: level by
 * level row i += row i + half, as _ops._tree_levels; the sums end in row 0. */
static void tree_rows(float *restrict a, int64_t w, int64_t len) {
    /* rows i and i + half are the blocks [0, half * len) and [half * len, 2 * half * len):
     * one flat, vectorisable loop per level */
    for (int64_t half = w / 2; half >= 1; half /= 2) {
        int64_t n = half * len;
        float *restrict dst = a;
        const float *restrict src = a + n;
        for (int64_t j = 0; j < n; j++) dst[j] = dst[j] + src[j];
    }
}

static int64_t pow2_at_least(int64_t n) {
    int64_t w = 1;
    while (w < n) w <<= 1;
    return w;
}

/* Scratch of the row attention kernels: one query's key rows transposed and its head's
 * score products, probabilities and partial sums, sized for the longest query. */
struct row_scratch {
    int64_t ld; /* the row stride of kt, vt and prod: the longest query's W */
    float *kt;  /* [KVH][wd][ld]: the query's keys per kv head, kt[(kv * wd + d) * ld + c] */
    float *vt;  /* [KVH][hv][ld]: its values, transposed likewise (the backward's dp) */
    float *prod; /* [wd][ld]: q[d] * kt[d][c], then their tree over d */
    float *e;   /* [wmax]: probabilities */
    float *sum; /* [wmax] */
    float *acc; /* [wmax][hv]: p[c] * v[c][d], then their tree over c */
};

static void row_scratch_free(struct row_scratch *s) {
    free(s->kt);
    free(s->vt);
    free(s->prod);
    free(s->e);
    free(s->sum);
    free(s->acc);
}

static int row_scratch_alloc(struct row_scratch *s, int64_t wmax, int64_t wd, int64_t hv,
                             int64_t kvh) {
    size_t n = (size_t)wmax;
    s->ld = wmax;
    s->kt = malloc(n * (size_t)(wd * kvh) * sizeof(float));
    s->vt = malloc(n * (size_t)((hv > 0 ? hv : 1) * kvh) * sizeof(float));
    s->prod = malloc(n * (size_t)wd * sizeof(float));
    s->e = malloc(n * sizeof(float));
    s->sum = malloc(n * sizeof(float));
    s->acc = malloc(n * (size_t)(hv > 0 ? hv : 1) * sizeof(float));
    if (s->kt && s->vt && s->prod && s->e && s->sum && s->acc) return 0;
    row_scratch_free(s);
    return -2;
}

/* kt[d * ld + c] = k[row(c), kv, d] for the slots c in [lo, p], 0 for d >= hd. */
static void gather_keys(float *restrict kt, const float *k, const int64_t *ks, int64_t start,
                        int64_t kv, int64_t lo, int64_t p, int64_t ld, int64_t hd,
                        int64_t wd) {
    for (int64_t c = lo; c <= p; c++) {
        const float *kc = k + (start + c) * ks[0] + kv * ks[1];
        for (int64_t d = 0; d < hd; d++) kt[d * ld + c] = kc[d * ks[2]];
    }
    for (int64_t d = hd; d < wd; d++)
        for (int64_t c = lo; c <= p; c++) kt[d * ld + c] = 0.0f;
}

/* The first slot whose key (and value) rows query t must gather: only its own slot p when the
 * query before it read the same key row up to p - 1 (consecutive tokens of one packed segment:
 * their rows are already in the scratch), else every slot it sees. */
static int64_t first_to_gather(const int64_t *kstart, const int64_t *pos, int64_t t,
                               int64_t first) {
    return t > 0 && kstart[t] == kstart[t - 1] && pos[t] == pos[t - 1] + 1 ? pos[t] : first;
}

/* The probabilities p[c] of one query head over its seen slots [first, p] (0 elsewhere in
 * [0, w)), with StrictOps.attention's ops: scores as trees over d (of wd = 2**ceil(log2 hd)
 * products, the padded ones +0.0) times scale, minus their largest, exp_strict, over the tree
 * over c of the exps. The trees over d run for all slots at once, level by level (each slot's
 * pairs are its own, as in a tree per slot). */
static void row_probs(struct row_scratch *s, const float *restrict kt, const float *qh,
                      int64_t qstride, int64_t first, int64_t p, int64_t w, int64_t hd,
                      int64_t wd, float scale, const float *coeffs) {
    float *restrict prod = s->prod, *restrict e = s->e, *restrict sum = s->sum;
    int64_t ld = s->ld;
    for (int64_t d = 0; d < wd; d++) {
        float qd = d < hd ? qh[d * qstride] : 0.0f;
        float *restrict row = prod + d * ld;
        const float *restrict krow = kt + d * ld;
        if (d < hd)
            for (int64_t c = first; c <= p; c++) row[c] = qd * krow[c];
        else
            for (int64_t c = first; c <= p; c++) row[c] = 0.0f;
    }
    for (int64_t half = wd / 2; half >= 1; half /= 2) /* the tree over d, per slot */
        for (int64_t d = 0; d < half; d++) {
            float *restrict dst = prod + d * ld;
            const float *restrict src = prod + (d + half) * ld;
            for (int64_t c = first; c <= p; c++) dst[c] = dst[c] + src[c];
        }
    float top = -INFINITY;
    for (int64_t c = first; c <= p; c++) {
        float score = prod[c] * scale;
        e[c] = score;
        if (score != score)
            top = score; /* amax of a NaN is NaN */
        else if (top == top && score > top)
            top = score;
    }
    for (int64_t c = 0; c < first; c++) e[c] = 0.0f;
    for (int64_t c = first; c <= p; c++) e[c] = exp_strict1(e[c] - top, coeffs);
    for (int64_t c = p + 1; c < w; c++) e[c] = 0.0f;
    memcpy(sum, e, (size_t)w * sizeof(float));
    tree_rows(sum, w, 1);
    float denom = sum[0];
    for (int64_t c = first; c <= p; c++) e[c] = e[c] / denom;
}

static int64_t longest_window(const int64_t *pos, int64_t T) {
    int64_t wmax = 1;
    for (int64_t t = 0; t < T; t++) {
        int64_t w = pow2_at_least(pos[t] + 1);
        if (w > wmax) wmax = w;
    }
    return wmax;
}

/* Strict attention of T queries over key rows (StrictOps.attention's ops on each query, so its
 * bits): query t, head h (kv head h / (H / KVH)) sees slot c of its key row, key and value row
 * kstart[t] + c, for c <= pos[t] (and pos[t] - c < window where window > 0). Over those slots:
 * score = tree_d(q[d] * k[d], hd padded to a power of two with +0.0) * scale; z = score - the
 * largest score; e = exp_strict(z); p = e / tree_c(e); out[d] = tree_c(p * v[d]). The trees
 * over c run over the first W = 2**ceil(log2(pos[t] + 1)) slots with unseen slots exactly +0.0:
 * in the pairwise tree x + 0.0 == x, so any wider power of two (the torch path's chunk width,
 * the cache's capacity) gives the same bits. Element strides: q (t, h, d), k and v (row, kv
 * head, d); out [T, H, hv] contiguous. Returns 0; -2 if scratch memory cannot be allocated. */
int posttrain_row_attention(const float *q, const int64_t *qs, const float *k, const int64_t *ks,
                            const float *v, const int64_t *vs, const int64_t *kstart,
                            const int64_t *pos, float *out, int64_t T, int64_t H, int64_t KVH,
                            int64_t hd, int64_t hv, float scale, int64_t window,
                            const float *coeffs) {
    if (T < 1 || H < 1) return 0;
    int64_t group = H / KVH, wd = pow2_at_least(hd);
    struct row_scratch s;
    if (row_scratch_alloc(&s, longest_window(pos, T), wd, hv, KVH)) return -2;
    for (int64_t t = 0; t < T; t++) {
        int64_t p = pos[t], w = pow2_at_least(p + 1);
        int64_t first = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
        int64_t lo = first_to_gather(kstart, pos, t, first);
        for (int64_t kv = 0; kv < KVH; kv++) {
            float *kt = s.kt + kv * wd * s.ld;
            gather_keys(kt, k, ks, kstart[t], kv, lo, p, s.ld, hd, wd);
            for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
                row_probs(&s, kt, q + t * qs[0] + h * qs[1], qs[2], first, p, w, hd, wd, scale,
                          coeffs);
                float *restrict acc = s.acc;
                for (int64_t c = 0; c < w; c++) {
                    float *restrict row = acc + c * hv;
                    if (c < first || c > p) {
                        for (int64_t d = 0; d < hv; d++) row[d] = 0.0f;
                        continue;
                    }
                    float prob = s.e[c];
                    const float *vc = v + (kstart[t] + c) * vs[0] + kv * vs[1];
                    for (int64_t d = 0; d < hv; d++) row[d] = prob * vc[d * vs[2]];
                }
                tree_rows(acc, w, hv);
                memcpy(out + (t * H + h) * hv, acc, (size_t)hv * sizeof(float));
            }
        }
    }
    row_scratch_free(&s);
    return 0;
}

/* The two halves of strict RMSNorm (StrictOps.rms_norm; torch's sqrt between them, whose bits
 * are torch's own: on some CPUs it is not the correctly rounded sqrt of C).
 *
 * posttrain_rms_norm_ms: ms[r] = tree_i(x[r, i] * x[r, i], H padded to a power of two with +0.0)
 * / H + eps, for R contiguous rows of H values. The rows' trees run 16 rows side by side (one
 * vector add per level and row block): each row is reduced alone, so the blocking never
 * changes a bit. Returns 0; -2 if scratch memory cannot be allocated. */
int posttrain_rms_norm_ms(const float *x, float *ms, int64_t R, int64_t H, float eps) {
    if (R < 1 || H < 1) return 0;
    enum { RB = 16 };
    int64_t wh = pow2_at_least(H);
    float *sq = malloc((size_t)wh * RB * sizeof(float));
    if (!sq) return -2;
    const float count = (float)H;
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
        int64_t nr = R - r0 < RB ? R - r0 : RB;
        for (int64_t i = 0; i < wh; i++)
            for (int64_t r = 0; r < RB; r++) {
                float v = r < nr && i < H ? x[(r0 + r) * H + i] : 0.0f;
                sq[i * RB + r] = r < nr && i < H ? v * v : 0.0f;
            }
        tree_rows(sq, wh, RB);
        for (int64_t r = 0; r < nr; r++) ms[r0 + r] = sq[r] / count + eps;
    }
    free(sq);
    return 0;
}

/* posttrain_rms_norm_scale: out[r, i] = (x[r, i] * inv[r]) * w[r % P, i] for R contiguous rows of
 * H values (w[P][H]: a per-head weight repeats over the tokens). */
void posttrain_rms_norm_scale(const float *restrict x, const float *restrict inv,
                              const float *restrict w, float *restrict out, int64_t R, int64_t H,
                              int64_t P) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * H, *wr = w + (r % P) * H;
        float *o = out + r * H, s = inv[r];
        for (int64_t i = 0; i < H; i++) o[i] = (xr[i] * s) * wr[i];
    }
}

/* The gradient of posttrain_row_attention (no bit contract: the strict backwards promise run-to-
 * run determinism only). Per query t and head h, in order: the forward's probabilities p_c
 * recomputed with the forward's own ops (row_probs: its bits), dp_c = do . v_c (a sequential
 * sum over d), r = sum_c p_c dp_c, ds_c = p_c (dp_c - r) scale; dq = sum_c ds_c k_c;
 * dk_c += ds_c q and dv_c += p_c do for the key rows kstart[t] + c. Every sum runs in a fixed
 * order and the key rows' gradients accumulate query by query: the same bits run to run.
 * grad [T, H, hv] and dq [T, H, hd] contiguous; dk [S, KVH, hd] and dv [S, KVH, hv] contiguous,
 * zeroed by the caller; q, k, v through element strides as in the forward. Returns 0; -2 if
 * scratch memory cannot be allocated. */
int posttrain_row_attention_backward(const float *q, const int64_t *qs, const float *k,
                                     const int64_t *ks, const float *v, const int64_t *vs,
                                     const int64_t *kstart, const int64_t *pos,
                                     const float *grad, float *dq, float *dk, float *dv,
                                     int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hv,
                                     float scale, int64_t window, const float *coeffs) {
    if (T < 1 || H < 1) return 0;
    int64_t group = H / KVH, wd = pow2_at_least(hd);
    struct row_scratch s;
    if (row_scratch_alloc(&s, longest_window(pos, T), wd, hv, KVH)) return -2;
    int64_t ld = s.ld;
    for (int64_t t = 0; t < T; t++) {
        int64_t p = pos[t], w = pow2_at_least(p + 1);
        int64_t first = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
        int64_t lo = first_to_gather(kstart, pos, t, first);
        for (int64_t kv = 0; kv < KVH; kv++) {
            float *kt = s.kt + kv * wd * ld, *vt = s.vt + kv * hv * ld;
            gather_keys(kt, k, ks, kstart[t], kv, lo, p, ld, hd, wd);
            for (int64_t c = lo; c <= p; c++) { /* vt[d * ld + c] = v[row(c), kv, d] */
                const float *vc = v + (kstart[t] + c) * vs[0] + kv * vs[1];
                for (int64_t d = 0; d < hv; d++) vt[d * ld + c] = vc[d * vs[2]];
            }
            for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
                const float *qh = q + t * qs[0] + h * qs[1];
                const float *go = grad + (t * H + h) * hv;
                float *restrict gq = dq + (t * H + h) * hd;
                row_probs(&s, kt, qh, qs[2], first, p, w, hd, wd, scale, coeffs);
                float *restrict dp = s.sum, *restrict e = s.e;
                for (int64_t c = first; c <= p; c++) dp[c] = 0.0f;
                for (int64_t d = 0; d < hv; d++) {
                    float g = go[d];
                    const float *restrict vrow = vt + d * ld;
                    for (int64_t c = first; c <= p; c++) dp[c] += g * vrow[c];
                }
                float r = 0.0f;
                for (int64_t c = first; c <= p; c++) r += e[c] * dp[c];
                for (int64_t c = first; c <= p; c++) dp[c] = e[c] * (dp[c] - r) * scale;
                for (int64_t d = 0; d < hd; d++) gq[d] = 0.0f;
                for (int64_t c = first; c <= p; c++) {
                    int64_t row = kstart[t] + c;
                    float g = dp[c], pc = e[c];
                    float *restrict gk = dk + (row * KVH + kv) * hd;
                    float *restrict gv = dv + (row * KVH + kv) * hv;
                    for (int64_t d = 0; d < hd; d++) {
                        gq[d] += g * kt[d * ld + c];
                        gk[d] += g * qh[d * qs[2]];
                    }
                    for (int64_t d = 0; d < hv; d++) gv[d] += pc * go[d];
                }
            }
        }
    }
    row_scratch_free(&s);
    return 0;
}

/* Strict SiLU-and-multiply (StrictOps.silu_mul's ops, so its bits): out[r, i] =
 * (g / (1 + exp_strict(-g))) * u for g = gate[r, i], u = up[r, i]; gate and up rows ldg and ldu
 * floats apart (slices of one fused projection), out contiguous [R][I]. */
void posttrain_silu_mul(const float *restrict gate, int64_t ldg, const float *restrict up,
                        int64_t ldu, float *restrict out, int64_t R, int64_t I,
                        const float *restrict coeffs) {
    for (int64_t r = 0; r < R; r++) {
        const float *g = gate + r * ldg, *u = up + r * ldu;
        float *o = out + r * I;
        for (int64_t i = 0; i < I; i++) o[i] = (g[i] / (1.0f + exp_strict1(-g[i], coeffs))) * u[i];
    }
}

/* The gradient of strict RMSNorm (no bit contract: run-to-run determinism only), rows in
 * order: inv = 1 / sqrt(ms + eps) from the forward's ms (posttrain_rms_norm_ms, passed in with
 * eps added); gw = g * w; dx = inv * gw - x * inv^3 * mean(gw * x); dw[r % P] += g * x * inv,
 * the rows summed in order. x, g, dx contiguous [R][H]; w and dw [P][H], dw zeroed by the
 * caller. */
void posttrain_rms_norm_backward(const float *restrict x, const float *restrict w,
                                 const float *restrict ms, const float *restrict g,
                                 float *restrict dx, float *restrict dw, int64_t R, int64_t H,
                                 int64_t P) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * H, *gr = g + r * H, *wr = w + (r % P) * H;
        float *dxr = dx + r * H, *dwr = dw + (r % P) * H;
        float inv = 1.0f / sqrtf(ms[r]), dot = 0.0f;
        for (int64_t i = 0; i < H; i++) dot += gr[i] * wr[i] * xr[i];
        float coef = inv * inv * inv * (dot / (float)H);
        for (int64_t i = 0; i < H; i++) {
            dxr[i] = inv * (gr[i] * wr[i]) - xr[i] * coef;
            dwr[i] += gr[i] * xr[i] * inv;
        }
    }
}

/* Strict routed experts (the bits of the expert-by-expert strict path): (token, slot) pair
 * p = t * k + s runs expert e = ids[p]'s SwiGLU MLP on row m[t] with the strict linear above
 * and posttrain_silu_mul: gu = m[t] @ fc1[e]^T, act = silu_mul(gu[:I], gu[I:]), out[p] =
 * act @ fc2[e]^T. Every output row is reduced alone, so the grouping never changes a bit. The
 * pairs go expert by expert, ascending, each expert's in row-major order (a stable counting
 * sort); order[P] receives that order, gu[P][2I] and act[P][I] the pairs' intermediates in it
 * (what the backward reads). m [T][H], fc1 [E][2I][H], fc2 [E][H][I], out [T * k][H], all
 * contiguous. Returns 0; -1 for an expert id outside [0, E) or a bad dimension; -2 if scratch
 * memory cannot be allocated. */
int posttrain_routed_experts(const float *m, const int64_t *ids, int64_t T, int64_t k, int64_t H,
                             const float *fc1, const float *fc2, int64_t E, int64_t I,
                             int64_t *order, float *gu, float *act, float *out,
                             const float *coeffs) {
    if (T < 0 || k < 1 || H < 1 || E < 1 || I < 1) return -1;
    int64_t P = T * k;
    if (P == 0) return 0;
    int64_t *next = calloc((size_t)E + 1, sizeof(int64_t));
    float *x = malloc((size_t)P * H * sizeof(float));
    float *y = malloc((size_t)P * H * sizeof(float));
    int code = 0;
    if (!next || !x || !y) {
        code = -2;
        goto done;
    }
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] < 0 || ids[p] >= E) {
            code = -1;
            goto done;
        }
        next[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) next[e + 1] += next[e]; /* next[e]: expert e's first pair */
    for (int64_t p = 0; p < P; p++) order[next[ids[p]]++] = p;
    for (int64_t q = 0; q < P; q++) memcpy(x + q * H, m + (order[q] / k) * H, H * sizeof(float));
    const int64_t row_major[4] = {0, 0, H, 1}, act_rows[4] = {0, 0, I, 1};
    const int64_t fc1_t[4] = {0, 0, 1, H}, fc2_t[4] = {0, 0, 1, I}; /* the weights transposed */
    int64_t first = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t n = next[e] - first; /* after the sort, next[e] is one past expert e's pairs */
        if (n > 0) {
            float *g = gu + first * 2 * I, *a = act + first * I;
            code = posttrain_strict_matmul(x + first * H, row_major, fc1 + e * 2 * I * H, fc1_t,
                                           g, 1, 1, n, H, 2 * I);
            if (code) goto done;
            posttrain_silu_mul(g, 2 * I, g + I, 2 * I, a, n, I, coeffs);
            code = posttrain_strict_matmul(a, act_rows, fc2 + e * H * I, fc2_t, y + first * H, 1,
                                           1, n, I, H);
            if (code) goto done;
        }
        first = next[e];
    }
    for (int64_t q = 0; q < P; q++) memcpy(out + order[q] * H, y + q * H, H * sizeof(float));
done:
    free(next);
    free(x);
    free(y);
    return code;
}

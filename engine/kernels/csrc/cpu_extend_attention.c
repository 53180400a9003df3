/* Paged extend (prefill) attention for CPUs, bf16 and fp32: several new query tokens
 * per sequence, causal, reading K/V straight from the paged cache.
 *
 * Sequence s has q_len new tokens at positions ctx - q_len .. ctx - 1 (their K/V
 * already written); query token p sees keys 0..p. Work items are (sequence, tile of
 * 16 query tokens, kv head), later tiles (more keys) first; the G query heads that
 * share a kv head are handled together so each chunk of 16 keys is read once. Online
 * softmax (running max and denominator per token, rescaled as the max grows). bf16:
 * scores and the weighted sum of V use vdpbf16ps (weights rounded to bf16, as flash
 * attention does on GPUs) with fp32 accumulation, output rounded to nearest even;
 * fp32: the same walk with fp32 FMAs throughout. Requires D % 32 == 0, D <= 256 and
 * G <= 16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvmesh_cpu.h"

#define TILE 16
#define EXT_MAX_D 256

#ifdef KVMESH_HAVE_AVX512F
/* vis[j]: the lanes (query tokens at positions row0 + lane, lanes in `live`) that see key
 * c0 + j of a chunk of n keys; 0 for j >= n. */
static inline void visible_lanes(int c0, int n, int row0, __mmask16 live, __mmask16 *vis) {
    for (int j = 0; j < 16; j++) {
        int first = c0 + j - row0; /* first lane that sees key c0 + j */
        vis[j] = j >= n ? 0 : first <= 0 ? live : first >= 16 ? 0 : (__mmask16)(live & ~((1u << first) - 1u));
    }
}

/* One online-softmax step over 16 scores per lane: the new running max (into *mx), the factor
 * that rescales what was accumulated (returned) and the lanes that have seen a key (*seen).
 * Lanes that have seen no key yet keep max -inf: their weights and corrections are 0. */
static inline __m512 softmax_step(const __m512 *sc, __m512 *mx, __mmask16 *seen) {
    __m512 cmax = sc[0];
    for (int j = 1; j < 16; j++) cmax = _mm512_max_ps(cmax, sc[j]);
    const __m512 mnew = _mm512_max_ps(*mx, cmax);
    *seen = _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __mmask16 had = _mm512_cmp_ps_mask(*mx, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 corr = _mm512_maskz_mov_ps(had, exp16(_mm512_maskz_sub_ps(had, *mx, mnew)));
    *mx = mnew;
    return corr;
}

/* 1 / denominator per lane (1 where nothing was seen), stored to inv[16]. */
static inline void inverse_denominators(__m512 den, float *inv) {
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask(den, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.f), den)));
}
#endif

#ifdef KVMESH_HAVE_AVX512_BF16
/* One work item: query tokens [t0, t0 + nt) (nt <= 16) of a sequence, kv head h.
 *
 * The 16 query tokens of a tile live in the 16 lanes of a vector ("transposed"
 * layout): scores for key j are one vector S_j, so the causal mask, the running max
 * and the softmax are lane-wise (no horizontal reductions), q.k is accumulated over
 * pairs of dimensions with vdpbf16ps against a broadcast pair of k, and the output
 * accumulates as O[d] += P_j v[j][d] + P_j+1 v[j+1][d], again with vdpbf16ps over
 * pairs of keys. Per head, Qt[dp] holds the 16 tokens' dimension pair dp (2 bf16 in
 * each 32-bit lane) and ot[d] the 16 tokens' output dimension d. */
static void extend_tile(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *bt,
                        int q_len, int ctx, int t0, int nt, int h, int Hq, int G, int D, int block_size,
                        int64_t sb, int64_t ss, int64_t sh, float scale, uint16_t *out, uint32_t *qt,
                        __m512 *ot, uint32_t *vp, int64_t *offs) {
    const int DP = D / 2;
    const int p0 = ctx - q_len;        /* position of query token 0 */
    const int row0 = p0 + t0;          /* position of the tile's first token (lane 0) */
    const int last_key = row0 + nt;    /* keys [0, last_key) are visible to some lane */
    const __mmask16 live = mask16(nt);
    for (int g = 0; g < G; g++) {
        uint32_t *qg = qt + (int64_t)g * DP * 16;
        for (int r = 0; r < 16; r++) {
            const uint32_t *qrow = (const uint32_t *)(q + ((int64_t)(t0 + r) * Hq + (int64_t)h * G + g) * D);
            for (int dp = 0; dp < DP; dp++) qg[dp * 16 + r] = r < nt ? qrow[dp] : 0u;
        }
        for (int d = 0; d < D; d++) ot[(int64_t)g * D + d] = _mm512_setzero_ps();
    }
    for (int t = 0, blk = 0, slot = 0; t < last_key; t++) {
        offs[t] = (int64_t)bt[blk] * sb + (int64_t)slot * ss + (int64_t)h * sh;
        if (++slot == block_size) { slot = 0; blk++; }
    }
    __m512 mx[16], den[16]; /* per head (G <= 16), lanes = tokens */
    for (int g = 0; g < G; g++) {
        mx[g] = _mm512_set1_ps(-INFINITY);
        den[g] = _mm512_setzero_ps();
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    /* Word indices: interleave two vectors' 16-bit elements (pair_lo: elements 0-15,
     * pair_hi: 16-31), and interleave the two halves of one vector (lane_pairs). */
    const __m512i pair_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                             39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
    const __m512i lane_pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int c0 = 0; c0 < last_key; c0 += 16) {
        const int n = last_key - c0 < 16 ? last_key - c0 : 16;
        __mmask16 vis[16];
        visible_lanes(c0, n, row0, live, vis);
        /* V of key pairs (2jp, 2jp + 1) interleaved per dimension: vp[jp * D + d] holds both
         * keys' v[d] as one 32-bit bf16 pair (a missing odd key reads as 0). */
        const int npairs = (n + 1) / 2;
        for (int jp = 0; jp < npairs; jp++) {
            const uint16_t *va = v + offs[c0 + 2 * jp];
            const uint16_t *vb = 2 * jp + 1 < n ? v + offs[c0 + 2 * jp + 1] : NULL;
            for (int d = 0; d < D; d += 32) {
                __m512i a = _mm512_loadu_si512((const void *)(va + d));
                __m512i b = vb ? _mm512_loadu_si512((const void *)(vb + d)) : _mm512_setzero_si512();
                _mm512_storeu_si512((void *)(vp + jp * D + d), _mm512_permutex2var_epi16(a, pair_lo, b));
                _mm512_storeu_si512((void *)(vp + jp * D + d + 16), _mm512_permutex2var_epi16(a, pair_hi, b));
            }
        }
        for (int g = 0; g < G; g++) {
            const uint32_t *qg = qt + (int64_t)g * DP * 16;
            __m512 sc[16];
            for (int j0 = 0; j0 < 16; j0 += 8) {
                __m512 a[8];
                const uint32_t *kr[8];
                for (int jj = 0; jj < 8; jj++) {
                    a[jj] = _mm512_setzero_ps();
                    kr[jj] = (const uint32_t *)(k + offs[c0 + (j0 + jj < n ? j0 + jj : 0)]);
                }
                if (j0 < n)
                    for (int dp = 0; dp < DP; dp++) {
                        __m512bh qv = (__m512bh)_mm512_loadu_si512((const void *)(qg + dp * 16));
                        for (int jj = 0; jj < 8; jj++)
                            a[jj] = _mm512_dpbf16_ps(a[jj], qv, (__m512bh)_mm512_set1_epi32((int)kr[jj][dp]));
                    }
                for (int jj = 0; jj < 8; jj++)
                    sc[j0 + jj] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), vis[j0 + jj], a[jj], vscale);
            }
            __mmask16 seen;
            const __m512 corr = softmax_step(sc, &mx[g], &seen);
            const __m512 mnew = mx[g];
            __m512 sum = _mm512_setzero_ps();
            /* Weights of key pairs as bf16 pairs per lane, for vdpbf16ps against vp (as
             * flash attention does on GPUs: P rounded to bf16, accumulation in fp32). */
            __m512bh pp[8];
            for (int jp = 0; jp < 8; jp++) {
                __m512 p0 = _mm512_maskz_mov_ps(vis[2 * jp] & seen, exp16(_mm512_maskz_sub_ps(seen, sc[2 * jp], mnew)));
                __m512 p1 = _mm512_maskz_mov_ps(vis[2 * jp + 1] & seen,
                                                exp16(_mm512_maskz_sub_ps(seen, sc[2 * jp + 1], mnew)));
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                pp[jp] = (__m512bh)_mm512_permutexvar_epi16(lane_pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            }
            den[g] = _mm512_fmadd_ps(den[g], corr, sum);
            __m512 *og = ot + (int64_t)g * D;
            for (int d0 = 0; d0 < D; d0 += 16) {
                __m512 o[16];
                for (int dd = 0; dd < 16; dd++) o[dd] = _mm512_mul_ps(og[d0 + dd], corr);
                for (int jp = 0; jp < npairs; jp++) {
                    const uint32_t *vr = vp + jp * D + d0;
                    for (int dd = 0; dd < 16; dd++)
                        o[dd] = _mm512_dpbf16_ps(o[dd], pp[jp], (__m512bh)_mm512_set1_epi32((int)vr[dd]));
                }
                for (int dd = 0; dd < 16; dd++) og[d0 + dd] = o[dd];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float inv[16] __attribute__((aligned(64)));
        inverse_denominators(den[g], inv);
        float col[16] __attribute__((aligned(64)));
        for (int d = 0; d < D; d++) {
            _mm512_store_ps(col, ot[(int64_t)g * D + d]);
            for (int r = 0; r < nt; r++)
                out[((int64_t)(t0 + r) * Hq + (int64_t)h * G + g) * D + d] = f2bf(col[r] * inv[r]);
        }
    }
}
#endif

#ifdef KVMESH_HAVE_AVX512F
/* extend_tile in fp32: qt[g][d] holds the 16 tokens' dimension d (lanes = tokens), the
 * score for key j accumulates qt[d] * k[j][d] over d with the key's element broadcast,
 * and the output accumulates P_j * v[j][d] the same way; weights stay fp32. */
static void extend_tile_f32(const float *q, const float *k, const float *v, const int32_t *bt, int q_len,
                            int ctx, int t0, int nt, int h, int Hq, int G, int D, int block_size, int64_t sb,
                            int64_t ss, int64_t sh, float scale, float *out, float *qt, __m512 *ot,
                            int64_t *offs) {
    const int row0 = ctx - q_len + t0; /* position of the tile's first token (lane 0) */
    const int last_key = row0 + nt;    /* keys [0, last_key) are visible to some lane */
    const __mmask16 live = mask16(nt);
    for (int g = 0; g < G; g++) {
        float *qg = qt + (int64_t)g * D * 16;
        for (int r = 0; r < 16; r++) {
            const float *qrow = q + ((int64_t)(t0 + r) * Hq + (int64_t)h * G + g) * D;
            for (int d = 0; d < D; d++) qg[d * 16 + r] = r < nt ? qrow[d] : 0.f;
        }
        for (int d = 0; d < D; d++) ot[(int64_t)g * D + d] = _mm512_setzero_ps();
    }
    for (int t = 0, blk = 0, slot = 0; t < last_key; t++) {
        offs[t] = (int64_t)bt[blk] * sb + (int64_t)slot * ss + (int64_t)h * sh;
        if (++slot == block_size) { slot = 0; blk++; }
    }
    __m512 mx[16], den[16];
    for (int g = 0; g < G; g++) {
        mx[g] = _mm512_set1_ps(-INFINITY);
        den[g] = _mm512_setzero_ps();
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int c0 = 0; c0 < last_key; c0 += 16) {
        const int n = last_key - c0 < 16 ? last_key - c0 : 16;
        __mmask16 vis[16];
        visible_lanes(c0, n, row0, live, vis);
        const float *kr[16], *vr[16];
        for (int j = 0; j < 16; j++) {
            kr[j] = k + offs[c0 + (j < n ? j : 0)];
            vr[j] = v + offs[c0 + (j < n ? j : 0)];
        }
        for (int g = 0; g < G; g++) {
            const float *qg = qt + (int64_t)g * D * 16;
            __m512 sc[16];
            for (int j0 = 0; j0 < 16; j0 += 8) {
                __m512 a[8];
                for (int jj = 0; jj < 8; jj++) a[jj] = _mm512_setzero_ps();
                if (j0 < n)
                    for (int d = 0; d < D; d++) {
                        const __m512 qv = _mm512_load_ps(qg + d * 16);
                        for (int jj = 0; jj < 8; jj++) a[jj] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kr[j0 + jj][d]), a[jj]);
                    }
                for (int jj = 0; jj < 8; jj++)
                    sc[j0 + jj] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), vis[j0 + jj], a[jj], vscale);
            }
            __mmask16 seen;
            const __m512 corr = softmax_step(sc, &mx[g], &seen);
            const __m512 mnew = mx[g];
            __m512 sum = _mm512_setzero_ps();
            __m512 p[16];
            for (int j = 0; j < 16; j++) {
                p[j] = _mm512_maskz_mov_ps(vis[j] & seen, exp16(_mm512_maskz_sub_ps(seen, sc[j], mnew)));
                sum = _mm512_add_ps(sum, p[j]);
            }
            den[g] = _mm512_fmadd_ps(den[g], corr, sum);
            __m512 *og = ot + (int64_t)g * D;
            for (int d0 = 0; d0 < D; d0 += 16) {
                __m512 o[16];
                for (int dd = 0; dd < 16; dd++) o[dd] = _mm512_mul_ps(og[d0 + dd], corr);
                for (int j = 0; j < n; j++) {
                    const float *vrow = vr[j] + d0;
                    for (int dd = 0; dd < 16; dd++) o[dd] = _mm512_fmadd_ps(p[j], _mm512_set1_ps(vrow[dd]), o[dd]);
                }
                for (int dd = 0; dd < 16; dd++) og[d0 + dd] = o[dd];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float inv[16] __attribute__((aligned(64)));
        inverse_denominators(den[g], inv);
        float col[16] __attribute__((aligned(64)));
        for (int d = 0; d < D; d++) {
            _mm512_store_ps(col, ot[(int64_t)g * D + d]);
            for (int r = 0; r < nt; r++) out[((int64_t)(t0 + r) * Hq + (int64_t)h * G + g) * D + d] = col[r] * inv[r];
        }
    }
}
#endif

/* Runs every (sequence, query tile, kv head) item; `f32` picks the element type (q, k, v
 * and out are then float, else bf16). Returns 0 when done; -1 when this build or shape is
 * not covered and -2 when a sequence's lengths are inconsistent (0 <= q_len <= ctx <=
 * max_blocks * block_size must hold): the caller then runs the reference, which reports
 * the error. */
static int extend_attention(int f32, const void *q, const void *k, const void *v, const int32_t *block_tables,
                            int64_t bt_stride, int max_blocks, const int32_t *query_start_loc,
                            const int32_t *seq_lens, void *out, int S, int Hq, int Hkv, int D, int block_size,
                            int64_t sb, int64_t ss, int64_t sh, float scale, int num_threads) {
#ifdef KVMESH_HAVE_AVX512F
#ifndef KVMESH_HAVE_AVX512_BF16
    if (!f32) return -1;
#endif
    const int G = Hq / Hkv;
    if (D % 32 != 0 || D > EXT_MAX_D || G > 16) return -1;
    /* Items: (sequence, query tile, kv head), numbered through a prefix sum of tiles. */
    int64_t *tile_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(S + 1));
    int max_ctx = 1;
    tile_start[0] = 0;
    for (int s = 0; s < S; s++) {
        int q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len < 0 || q_len > seq_lens[s] || seq_lens[s] > (int64_t)max_blocks * block_size) {
            free(tile_start);
            return -2;
        }
        tile_start[s + 1] = tile_start[s] + (q_len + TILE - 1) / TILE;
        max_ctx = seq_lens[s] > max_ctx ? seq_lens[s] : max_ctx;
    }
    const int64_t items = tile_start[S] * Hkv;
    const size_t elem = f32 ? sizeof(float) : sizeof(uint16_t);
#pragma omp parallel num_threads(num_threads)
    {
        float *qt = (float *)aligned_alloc(64, sizeof(float) * (size_t)G * D * 16); /* fp32 size fits bf16 */
        __m512 *ot = (__m512 *)aligned_alloc(64, sizeof(__m512) * (size_t)G * D);
        uint32_t *vp = (uint32_t *)malloc(sizeof(uint32_t) * 8 * (size_t)D);
        int64_t *offs = (int64_t *)malloc(sizeof(int64_t) * (size_t)max_ctx);
        /* Later tiles see more keys: hand them out first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = items - 1; it >= 0; it--) {
            int64_t tile = it / Hkv;
            int h = (int)(it % Hkv);
            int lo = 0, hi = S; /* sequence whose tiles contain `tile` */
            while (hi - lo > 1) {
                int mid = (lo + hi) / 2;
                if (tile_start[mid] <= tile) lo = mid; else hi = mid;
            }
            const int s = lo;
            const int q0 = query_start_loc[s], q_len = query_start_loc[s + 1] - q0;
            const int t0 = (int)(tile - tile_start[s]) * TILE;
            const int nt = q_len - t0 < TILE ? q_len - t0 : TILE;
            const int32_t *bt = block_tables + (int64_t)s * bt_stride;
            const int64_t at = (int64_t)q0 * Hq * D * (int64_t)elem;
            if (f32)
                extend_tile_f32((const float *)((const char *)q + at), (const float *)k, (const float *)v, bt, q_len,
                                seq_lens[s], t0, nt, h, Hq, G, D, block_size, sb, ss, sh, scale,
                                (float *)((char *)out + at), qt, ot, offs);
#ifdef KVMESH_HAVE_AVX512_BF16
            else
                extend_tile((const uint16_t *)((const char *)q + at), (const uint16_t *)k, (const uint16_t *)v, bt,
                            q_len, seq_lens[s], t0, nt, h, Hq, G, D, block_size, sb, ss, sh, scale,
                            (uint16_t *)((char *)out + at), (uint32_t *)qt, ot, vp, offs);
#endif
        }
        free(qt);
        free(ot);
        free(vp);
        free(offs);
    }
    free(tile_start);
    return 0;
#else
    (void)f32; (void)q; (void)k; (void)v; (void)block_tables; (void)bt_stride; (void)max_blocks;
    (void)query_start_loc; (void)seq_lens; (void)out; (void)S; (void)Hq; (void)Hkv; (void)D; (void)block_size;
    (void)sb; (void)ss; (void)sh; (void)scale; (void)num_threads;
    return -1;
#endif
}

int kvmesh_extend_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                 const int32_t *block_tables, int64_t bt_stride, int max_blocks,
                                 const int32_t *query_start_loc, const int32_t *seq_lens, uint16_t *out, int S,
                                 int Hq, int Hkv, int D, int block_size, int64_t sb, int64_t ss, int64_t sh,
                                 float scale, int num_threads) {
    return extend_attention(0, q, k, v, block_tables, bt_stride, max_blocks, query_start_loc, seq_lens, out, S, Hq,
                            Hkv, D, block_size, sb, ss, sh, scale, num_threads);
}

int kvmesh_extend_attention_f32(const float *q, const float *k, const float *v, const int32_t *block_tables,
                                int64_t bt_stride, int max_blocks, const int32_t *query_start_loc,
                                const int32_t *seq_lens, float *out, int S, int Hq, int Hkv, int D, int block_size,
                                int64_t sb, int64_t ss, int64_t sh, float scale, int num_threads) {
    return extend_attention(1, q, k, v, block_tables, bt_stride, max_blocks, query_start_loc, seq_lens, out, S, Hq,
                            Hkv, D, block_size, sb, ss, sh, scale, num_threads);
}

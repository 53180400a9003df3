/* Paged attention on AMX tiles, the parts the decode (cpu_decode_amx.c) and the prefill
 * (cpu_extend_amx.c) kernels share: up to 16 query rows of one kv head go through the tile unit
 * together over segments of cached tokens,
 *
 *   scores^T [16 tokens x 16 rows] = K rows of 16 tokens (a tile loaded straight from the paged
 *       cache) . Q^T (a tile built once per item);
 *   softmax per row over the row's own tokens, 16 rows in the lanes of one vector;
 *   out [16 rows x D] += P [16 rows x 32 tokens] . V [32 tokens x D] (V rows interleaved in token
 *       pairs, the tile unit's layout; P transposed from the softmax's lanes).
 *
 * A row's scores, its softmax sums and its output tiles accumulate over the same token chunks in
 * the same order whichever rows share its item (the tile unit computes every output element from
 * its own row and column alone). Accumulation is fp32; weights are rounded to bf16 before P.V, as
 * the AVX-512 kernels and GPU paged-attention kernels do. Segments start at multiples of 32 and
 * block_size % 16 == 0 (a chunk of 16 tokens lies in one block); D is 64 or 128.
 */
#ifndef KVMESH_AMX_ATTENTION_H
#define KVMESH_AMX_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvmesh_cpu.h"

#if defined(KVMESH_HAVE_AVX512_BF16) && defined(KVMESH_HAVE_AMX)
/* A run of tokens [t0, t1) read through one block table, for the rows in `lanes`. Every segment
 * starts at a multiple of 32 and takes whole 32-token blocks of positions in the scratch. */
typedef struct {
    const int32_t *bt;
    int t0, t1;
    __mmask16 lanes;
    int64_t pos; /* its first position in the scratch */
} segment;

/* Prefetch distance in tokens (16, 32 and 48 measured within 3% of each other). */
#define PF 32
typedef struct {
    const uint16_t *k, *v;
    int64_t sb, ss, sh;
    int bs, D, G, h;
    float scale;
} cache_view;

static inline int64_t row_offset(const cache_view *c, const int32_t *bt, int t) {
    return (int64_t)bt[t / c->bs] * c->sb + (int64_t)(t % c->bs) * c->ss + (int64_t)c->h * c->sh;
}

/* Pass 1 for one segment: its tokens' scores (q.k, not yet scaled) in st[pos][16], -inf outside
 * the segment's tokens and lanes and for tokens past a lane's last[lane] (a causal prefill's query
 * rows), and each lane's running max in *vmax. qb: D / 32 Q^T tiles of 1 KB. `full`: the segment's
 * lanes are all the item's rows. */
static void segment_scores(const cache_view *c, const segment *sg, const uint32_t *qb, __m512i last, int full,
                           float *st, __m512 *vmax) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const int64_t lines = (int64_t)c->D * 2 / 64; /* cache lines of one token's row of one head */
    /* Tokens before `open` are seen by every row of the item: no mask to apply there. */
    const int open = full ? _mm512_mask_reduce_min_epi32(sg->lanes, last) : INT32_MIN;
    /* 32 tokens a pass, as two chunks of 16 in accumulators 2 and 4: the two chains of products
     * overlap in the tile unit, and each Q^T tile is loaded once for both. */
    for (int t = sg->t0; t < sg->t1; t += 32) {
        const int two = t + 16 < sg->t1;
        const uint16_t *krow0 = c->k + row_offset(c, sg->bt, t);
        const uint16_t *krow1 = two ? c->k + row_offset(c, sg->bt, t + 16) : krow0;
        /* The next chunks' K, and V for pass 3: tile loads of rows far apart stall on memory. */
        for (int u = t + PF; u < t + PF + 32 && u < sg->t1; u += 16) {
            const int64_t next = row_offset(c, sg->bt, u);
            for (int i = 0; i < 16 && u + i < sg->t1; i++)
                for (int64_t l = 0; l < lines; l++) {
                    _mm_prefetch((const char *)(c->k + next + i * c->ss) + 64 * l, _MM_HINT_T0);
                    _mm_prefetch((const char *)(c->v + next + i * c->ss) + 64 * l, _MM_HINT_T1);
                }
        }
        _tile_zero(2);
        _tile_zero(4);
        for (int kk = 0; kk < c->D / 32; kk++) {
            _tile_loadd(1, qb + 256 * kk, 64);
            _tile_loadd(0, krow0 + 32 * kk, c->ss * 2);
            _tile_dpbf16ps(2, 0, 1);
            if (two) {
                _tile_loadd(5, krow1 + 32 * kk, c->ss * 2);
                _tile_dpbf16ps(4, 5, 1);
            }
        }
        float *out = st + (sg->pos + t - sg->t0) * 16;
        _tile_stored(2, out, 64);
        if (two) _tile_stored(4, out + 256, 64);
        if (t + 32 <= sg->t1 && t + 31 <= open) {
            for (int i = 0; i < 32; i++) *vmax = _mm512_max_ps(*vmax, _mm512_loadu_ps(out + 16 * i));
            continue;
        }
        for (int i = 0; i < 32 && t + i < sg->t1; i++) {
            const __mmask16 sees = _mm512_mask_cmple_epi32_mask(sg->lanes, _mm512_set1_epi32(t + i), last);
            const __m512 x = _mm512_mask_blend_ps(sees, ninf, _mm512_loadu_ps(out + 16 * i));
            *vmax = _mm512_max_ps(*vmax, x);
            _mm512_storeu_ps(out + 16 * i, x);
        }
    }
    /* The rest of the last 32-token block carries no weight. */
    int64_t end = sg->pos + ((int64_t)(sg->t1 - sg->t0) + 31) / 32 * 32;
    for (int64_t p = sg->pos + (sg->t1 - sg->t0); p < end; p++)
        _mm512_storeu_ps(st + p * 16, ninf);
}

/* Pass 2: exp(scale * (score - max)) per lane, the lane sums (in two halves: positions of even
 * and odd index, each in order) and the weights as bf16 A tiles, pa[block][row][32 tokens]. */
static void softmax_tiles(const float *st, int64_t npos, __m512 vmax, float scale, uint16_t *pa, __m512 *vsum) {
    /* A lane with no token (a row past R) keeps max -inf; 0 keeps its weights at exp(-inf) = 0. */
    vmax = _mm512_mask_mov_ps(vmax, _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                              _mm512_setzero_ps());
    const __m512 vscale = _mm512_set1_ps(scale), shift = _mm512_mul_ps(vmax, vscale);
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < npos; p0 += 32) {
        __m512i w[16];
        for (int i = 0; i < 16; i++) {
            __m512 e0 = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(st + (p0 + 2 * i) * 16), vscale, shift));
            __m512 e1 = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(st + (p0 + 2 * i + 1) * 16), vscale, shift));
            sum0 = _mm512_add_ps(sum0, e0);
            sum1 = _mm512_add_ps(sum1, e1);
            /* lane r of w[i]: (bf16 e0[r], bf16 e1[r]), the pair of tokens 2i, 2i + 1 of row r */
            w[i] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        kvmesh_transpose16_epi32(w);
        for (int r = 0; r < 16; r++) _mm512_storeu_si512(pa + (p0 / 32) * 512 + r * 32, w[r]);
    }
    *vsum = _mm512_add_ps(sum0, sum1);
}

/* Pass 3 for one segment and 64 dimensions [d0, d0 + 64): out tiles 4-7 += P . V. vb: 4 KB. */
static void segment_pv(const cache_view *c, const segment *sg, const uint16_t *pa, int d0, uint16_t *vb) {
    const __m512i pair_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                             39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
    for (int t = sg->t0; t < sg->t1; t += 32) {
        /* Each half of the 32 tokens lies in one block (block_size % 16 == 0). */
        const int64_t half[2] = {row_offset(c, sg->bt, t), t + 16 < sg->t1 ? row_offset(c, sg->bt, t + 16) : 0};
        /* vb[dt][pair i] = dims [16 dt, 16 dt + 16) of tokens t + 2i and t + 2i + 1, interleaved;
         * a token past the segment is a zero row (its weight is 0, and its row may hold NaN). */
        for (int i = 0; i < 16; i++) {
            const int ta = t + 2 * i, tb = ta + 1;
            const uint16_t *va = c->v + half[i / 8] + (int64_t)(2 * i % 16) * c->ss + d0;
            __m512i a[2], b[2];
            for (int j = 0; j < 2; j++) {
                a[j] = ta < sg->t1 ? _mm512_loadu_si512(va + 32 * j) : _mm512_setzero_si512();
                b[j] = tb < sg->t1 ? _mm512_loadu_si512(va + c->ss + 32 * j) : _mm512_setzero_si512();
            }
            for (int j = 0; j < 2; j++) {
                _mm512_storeu_si512(vb + (2 * j) * 512 + i * 32, _mm512_permutex2var_epi16(a[j], pair_lo, b[j]));
                _mm512_storeu_si512(vb + (2 * j + 1) * 512 + i * 32, _mm512_permutex2var_epi16(a[j], pair_hi, b[j]));
            }
        }
        _tile_loadd(0, pa + ((sg->pos + t - sg->t0) / 32) * 512, 64);
        _tile_loadd(1, vb, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(1, vb + 512, 64);
        _tile_dpbf16ps(5, 0, 1);
        _tile_loadd(1, vb + 1024, 64);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(1, vb + 1536, 64);
        _tile_dpbf16ps(7, 0, 1);
    }
}

/* Scratch of one thread, sized for the largest item. */
typedef struct {
    float *st;    /* [positions][16] scores, then nothing */
    uint16_t *pa; /* [positions / 32][16][32] weights */
    uint32_t qb[4 * 256];
    uint16_t vb[4 * 512];
    float ob[16 * 64];
    segment sg[17];
} scratch;

/* One item: rows r < R (query qrow[r], D bf16 each; output orow[r]) over the segments sc->sg[0,
 * nseg), which take npos positions of the scratch; row r sees no token past last[r]. */
static void attend_rows(const cache_view *c, const uint16_t *const *qrow, uint16_t *const *orow, int R, int nseg,
                        int64_t npos, __m512i last, scratch *sc) {
    const int D = c->D;
    /* Q^T tiles: qb[kk][pair i][row r] = dims (32 kk + 2i, 32 kk + 2i + 1) of row r. */
    memset(sc->qb, 0, sizeof sc->qb);
    for (int r = 0; r < R; r++) {
        const uint32_t *qr = (const uint32_t *)qrow[r];
        for (int p = 0; p < D / 2; p++) sc->qb[(p / 16) * 256 + (p % 16) * 16 + r] = qr[p];
    }
    __m512 vmax = _mm512_set1_ps(-INFINITY), vsum = _mm512_setzero_ps();
    const __mmask16 rows = mask16(R);
    for (int i = 0; i < nseg; i++)
        segment_scores(c, &sc->sg[i], sc->qb, last, (sc->sg[i].lanes & rows) == rows, sc->st, &vmax);
    softmax_tiles(sc->st, npos, vmax, c->scale, sc->pa, &vsum);
    float inv[16];
    _mm512_storeu_ps(inv, vsum);
    for (int r = 0; r < 16; r++) inv[r] = inv[r] > 0.f ? 1.f / inv[r] : 0.f;
    for (int d0 = 0; d0 < D; d0 += 64) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int i = 0; i < nseg; i++) segment_pv(c, &sc->sg[i], sc->pa, d0, sc->vb);
        _tile_stored(4, sc->ob, 256);
        _tile_stored(5, sc->ob + 16, 256);
        _tile_stored(6, sc->ob + 32, 256);
        _tile_stored(7, sc->ob + 48, 256);
        for (int r = 0; r < R; r++) {
            const __m512 w = _mm512_set1_ps(inv[r]);
            for (int j = 0; j < 4; j++) {
                const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sc->ob + r * 64 + 16 * j), w);
                _mm256_storeu_si256((__m256i *)(orow[r] + d0 + 16 * j), (__m256i)_mm512_cvtneps_pbh(x));
            }
        }
    }
}

/* A thread's scratch for items of up to max_pos positions (NULL without memory); free with
 * scratch_free. */
static scratch *scratch_alloc(int64_t max_pos) {
    scratch *sc = (scratch *)aligned_alloc(64, (sizeof(scratch) + 63) / 64 * 64);
    if (!sc) return NULL;
    sc->st = (float *)malloc(sizeof(float) * 16 * (size_t)max_pos);
    sc->pa = (uint16_t *)malloc(sizeof(uint16_t) * 16 * (size_t)max_pos);
    if (!sc->st || !sc->pa) {
        free(sc->st), free(sc->pa), free(sc);
        return NULL;
    }
    return sc;
}

static void scratch_free(scratch *sc) {
    if (sc) free(sc->st), free(sc->pa), free(sc);
}

/* A thread's start in a parallel region: its scratch, and the tile unit configured (the previous
 * configuration saved in *before). Without memory: NULL, and *failed set for the caller to rerun
 * the call on another kernel. */
static scratch *amx_thread_begin(int64_t max_pos, kvmesh_tile_config *before, int *failed) {
    scratch *sc = scratch_alloc(max_pos);
    if (sc)
        kvmesh_amx_begin(before);
    else
        __atomic_store_n(failed, 1, __ATOMIC_RELAXED);
    return sc;
}

static void amx_thread_end(scratch *sc, const kvmesh_tile_config *before) {
    if (sc) kvmesh_amx_end(before);
    scratch_free(sc);
}

#endif /* AVX512-BF16 and AMX */
#endif

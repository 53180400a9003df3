/* bf16 paged decode attention on AMX tiles, for CPUs with AMX-BF16 (Sapphire Rapids and later).
 *
 * The AVX-512 kernel (cpu_decode_attention.c) is bound by instruction count once a shared prefix
 * sits in cache: each of a token's query rows costs two dot products and a share of a horizontal
 * sum. Here one work item is a subgroup of up to 16 / G sequences that start in the same KV block
 * (a system prompt) and one kv head; its R = n * G query rows go through the matrix unit together:
 *
 *   scores^T [16 tokens x 16 rows] = K rows of 16 tokens (a tile loaded straight from the paged
 *       cache) . Q^T (a tile built once per item);
 *   softmax per row over the row's own tokens, 16 rows in the lanes of one vector;
 *   out [16 rows x D] += P [16 rows x 32 tokens] . V [32 tokens x D] (V rows interleaved in token
 *       pairs, the tile unit's layout; P transposed from the softmax's lanes).
 *
 * The tokens of the common prefix [0, Ps) (Ps a multiple of 32 that every member holds in the
 * same blocks) are one segment for all R rows; each member's remaining tokens are a segment of its
 * own, whose other rows carry the weight 0. A row's scores, its softmax sums and its output tiles
 * accumulate over the same token chunks in the same order whichever subgroup it is in (the tile
 * unit computes every output element from its own row and column alone), so grouping changes no
 * bit of any result. Accumulation is fp32; weights are rounded to bf16 before P.V, as the AVX-512
 * kernel and GPU paged-attention kernels do.
 *
 * Requires block_size % 16 == 0 (a chunk of 16 tokens lies in one block), D in {64, 128} and
 * G <= 16. Returns -1 (nothing written) where that or the kernel's permission to use the tile
 * registers does not hold; the caller then runs the AVX-512 kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

/* Pass 1 for one segment: scaled scores of its tokens in st[pos][16] (-inf outside the segment's
 * tokens and lanes), and each lane's running max in *vmax. qb: D / 32 Q^T tiles of 1 KB. */
static void segment_scores(const cache_view *c, const segment *sg, const uint32_t *qb, float *st, __m512 *vmax) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(c->scale);
    const int64_t lines = (int64_t)c->D * 2 / 64; /* cache lines of one token's row of one head */
    for (int t = sg->t0; t < sg->t1; t += 16) {
        const int64_t off = row_offset(c, sg->bt, t);
        const uint16_t *krow = c->k + off;
        /* The next chunk's K, and V for pass 3: tile loads of rows far apart stall on memory. */
        if (t + PF < sg->t1) {
            const int64_t next = row_offset(c, sg->bt, t + PF);
            for (int i = 0; i < 16 && t + PF + i < sg->t1; i++)
                for (int64_t l = 0; l < lines; l++) {
                    _mm_prefetch((const char *)(c->k + next + i * c->ss) + 64 * l, _MM_HINT_T0);
                    _mm_prefetch((const char *)(c->v + next + i * c->ss) + 64 * l, _MM_HINT_T1);
                }
        }
        _tile_zero(2);
        for (int kk = 0; kk < c->D / 32; kk++) {
            _tile_loadd(0, krow + 32 * kk, c->ss * 2);
            _tile_loadd(1, qb + 256 * kk, 64);
            _tile_dpbf16ps(2, 0, 1);
        }
        float *out = st + (sg->pos + t - sg->t0) * 16;
        _tile_stored(2, out, 64);
        for (int i = 0; i < 16; i++) {
            __m512 s = _mm512_mask_mul_ps(ninf, t + i < sg->t1 ? sg->lanes : 0, _mm512_loadu_ps(out + 16 * i), vscale);
            *vmax = _mm512_max_ps(*vmax, s);
            _mm512_storeu_ps(out + 16 * i, s);
        }
    }
    /* The rest of the last 32-token block carries no weight. */
    int64_t end = sg->pos + ((int64_t)(sg->t1 - sg->t0) + 31) / 32 * 32;
    for (int64_t p = sg->pos + (((int64_t)(sg->t1 - sg->t0) + 15) / 16 * 16); p < end; p++)
        _mm512_storeu_ps(st + p * 16, ninf);
}

/* Pass 2: exp(score - max) per lane, the lane sums (positions in order) and the weights as bf16
 * A tiles, pa[block][row][32 tokens]. */
static void softmax_tiles(const float *st, int64_t npos, __m512 vmax, uint16_t *pa, __m512 *vsum) {
    /* A lane with no token (a row past R) keeps max -inf; 0 keeps its weights at exp(-inf) = 0. */
    vmax = _mm512_mask_mov_ps(vmax, _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                              _mm512_setzero_ps());
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < npos; p0 += 32) {
        __m512i w[16];
        for (int i = 0; i < 16; i++) {
            __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(st + (p0 + 2 * i) * 16), vmax));
            __m512 e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(st + (p0 + 2 * i + 1) * 16), vmax));
            sum = _mm512_add_ps(sum, e0);
            sum = _mm512_add_ps(sum, e1);
            /* lane r of w[i]: (bf16 e0[r], bf16 e1[r]), the pair of tokens 2i, 2i + 1 of row r */
            w[i] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        kvmesh_transpose16_epi32(w);
        for (int r = 0; r < 16; r++) _mm512_storeu_si512(pa + (p0 / 32) * 512 + r * 32, w[r]);
    }
    *vsum = sum;
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

/* One subgroup (n sequences order[0..n)) and kv head h. */
static void decode_item_amx(const cache_view *c, const uint16_t *q, const int32_t *block_tables, int64_t bt_stride,
                            const int32_t *seq_lens, const int *members, int n, int shared, int Hq, uint16_t *out,
                            scratch *sc) {
    const int G = c->G, D = c->D, R = n * G;
    /* Q^T tiles: qb[kk][pair i][row r] = dims (32 kk + 2i, 32 kk + 2i + 1) of row r. */
    memset(sc->qb, 0, sizeof sc->qb);
    for (int s = 0; s < n; s++)
        for (int g = 0; g < G; g++) {
            const uint32_t *qr = (const uint32_t *)(q + ((int64_t)members[s] * Hq + (int64_t)c->h * G + g) * D);
            for (int p = 0; p < D / 2; p++) sc->qb[(p / 16) * 256 + (p % 16) * 16 + s * G + g] = qr[p];
        }
    int nseg = 0;
    int64_t npos = 0;
    if (shared > 0) {
        sc->sg[nseg++] = (segment){block_tables + (int64_t)members[0] * bt_stride, 0, shared,
                                   (__mmask16)((1u << R) - 1u), 0};
        npos = shared;
    }
    for (int s = 0; s < n; s++) {
        const int L = seq_lens[members[s]];
        if (L <= shared) continue;
        sc->sg[nseg++] = (segment){block_tables + (int64_t)members[s] * bt_stride, shared, L,
                                   (__mmask16)(((1u << G) - 1u) << (s * G)), npos};
        npos += ((int64_t)(L - shared) + 31) / 32 * 32;
    }
    __m512 vmax = _mm512_set1_ps(-INFINITY), vsum = _mm512_setzero_ps();
    for (int i = 0; i < nseg; i++) segment_scores(c, &sc->sg[i], sc->qb, sc->st, &vmax);
    softmax_tiles(sc->st, npos, vmax, sc->pa, &vsum);
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
            uint16_t *o = out + ((int64_t)members[r / G] * Hq + (int64_t)c->h * G + r % G) * D + d0;
            const __m512 w = _mm512_set1_ps(inv[r]);
            for (int j = 0; j < 4; j++) {
                const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sc->ob + r * 64 + 16 * j), w);
                _mm256_storeu_si256((__m256i *)(o + 16 * j), (__m256i)_mm512_cvtneps_pbh(x));
            }
        }
    }
}

/* The tokens a subgroup's members hold in the same blocks, within every member's length, rounded
 * down to a multiple of 32 (a block of weights for the tile unit); 0 for a single member. */
static int common_prefix(const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, const int *members,
                         int n, int block_size) {
    if (n < 2) return 0;
    int min_len = seq_lens[members[0]];
    for (int m = 1; m < n; m++) min_len = seq_lens[members[m]] < min_len ? seq_lens[members[m]] : min_len;
    const int32_t *bt0 = block_tables + (int64_t)members[0] * bt_stride;
    const int nb = (min_len + block_size - 1) / block_size;
    int eq = 0;
    for (; eq < nb; eq++) {
        int m = 1;
        while (m < n && block_tables[(int64_t)members[m] * bt_stride + eq] == bt0[eq]) m++;
        if (m < n) break;
    }
    const int common = eq * block_size < min_len ? eq * block_size : min_len;
    return common / 32 * 32;
}

int kvmesh_decode_attention_bf16_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                     uint16_t *out, int B, int Hq, int Hkv, int D, int block_size, int64_t sb,
                                     int64_t ss, int64_t sh, float scale, int num_threads, int group_prefixes) {
    const int G = Hkv > 0 ? Hq / Hkv : 0;
    if (B < 1 || G < 1 || G > 16 || Hq != G * Hkv || (D != 64 && D != 128) || block_size % 16 != 0
        || !kvmesh_amx_permitted())
        return -1;
    for (int b = 0; b < B; b++)
        if (seq_lens[b] < 0) return -1;
    /* Subgroups: sequences in prefix-grouped order, cut where the first block changes and every
     * 16 / G members; each member alone without group_prefixes. */
    const int per = group_prefixes ? 16 / G : 1;
    int *grouped = per > 1 ? kvmesh_prefix_grouped_order(block_tables, bt_stride, B) : NULL;
    int *order = grouped ? grouped : (int *)malloc(sizeof(int) * (size_t)B);
    int *start = (int *)malloc(sizeof(int) * ((size_t)B + 1)), *shared = (int *)malloc(sizeof(int) * (size_t)B);
    if (!order || !start || !shared) {
        free(order), free(start), free(shared);
        return -1;
    }
    if (!grouped)
        for (int b = 0; b < B; b++) order[b] = b;
    int ngroups = 0;
    int64_t max_pos = 32;
    for (int i = 0; i < B;) {
        const int32_t first = block_tables[(int64_t)order[i] * bt_stride];
        int j = i + 1;
        while (j < B && j - i < per && block_tables[(int64_t)order[j] * bt_stride] == first) j++;
        const int common = common_prefix(block_tables, bt_stride, seq_lens, order + i, j - i, block_size);
        int64_t npos = common;
        for (int m = i; m < j; m++) npos += ((int64_t)(seq_lens[order[m]] - common) + 31) / 32 * 32;
        max_pos = npos > max_pos ? npos : max_pos;
        start[ngroups] = i;
        shared[ngroups++] = common;
        i = j;
    }
    start[ngroups] = B;
    const int64_t items = (int64_t)ngroups * Hkv;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        scratch *sc = (scratch *)aligned_alloc(64, (sizeof(scratch) + 63) / 64 * 64);
        float *st = (float *)malloc(sizeof(float) * 16 * (size_t)max_pos);
        uint16_t *pa = (uint16_t *)malloc(sizeof(uint16_t) * 16 * (size_t)max_pos);
        const int ok = sc && st && pa;
        kvmesh_tile_config before; /* the thread's configuration, restored after */
        if (ok) {
            sc->st = st;
            sc->pa = pa;
            kvmesh_amx_begin(&before);
        } else {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        }
        /* Every thread meets the loop (a work-sharing construct); one without scratch skips its
         * items, and the caller then reruns the whole batch on the AVX-512 kernel. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!ok) continue;
            const int gi = (int)(it / Hkv);
            cache_view c = {k, v, sb, ss, sh, block_size, D, G, (int)(it % Hkv), scale};
            decode_item_amx(&c, q, block_tables, bt_stride, seq_lens, order + start[gi], start[gi + 1] - start[gi],
                            shared[gi], Hq, out, sc);
        }
        if (ok) kvmesh_amx_end(&before);
        free(sc);
        free(st);
        free(pa);
    }
    free(order), free(start), free(shared);
    return failed ? -1 : 0;
}

#else

int kvmesh_decode_attention_bf16_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                     uint16_t *out, int B, int Hq, int Hkv, int D, int block_size, int64_t sb,
                                     int64_t ss, int64_t sh, float scale, int num_threads, int group_prefixes) {
    (void)q, (void)k, (void)v, (void)block_tables, (void)bt_stride, (void)seq_lens, (void)out, (void)B, (void)Hq;
    (void)Hkv, (void)D, (void)block_size, (void)sb, (void)ss, (void)sh, (void)scale, (void)num_threads;
    (void)group_prefixes;
    return -1;
}

#endif

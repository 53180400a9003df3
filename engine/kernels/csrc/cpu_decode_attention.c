/* Paged decode attention for CPUs: one query token per sequence, GQA, reading
 * K/V straight from the paged cache (no gathered copy).
 *
 * Work is split over (sequence, kv head) pairs. For each pair the G query heads
 * that share the kv head are processed together, so every K and V row is read
 * from memory exactly once: pass 1 computes all scores into a scratch buffer,
 * pass 2 accumulates the softmax-weighted V rows. Accumulation is fp32 for
 * every input dtype; bf16 output is rounded to nearest even.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvmesh_cpu.h"

#define MAX_G 16
#define MAX_D 256
#define MAX_QH 32 /* query heads handled by one work item */

#ifdef KVMESH_HAVE_AVX512F
/* Element offsets of tokens [0, L) of heads [h0, ...) in the paged cache, then 16 more that
 * repeat token 0: a partial last chunk reads token 0 again in its spare lanes (masked out),
 * so the score loops have no bounds checks. */
static inline void token_offsets(int64_t *offs, const int32_t *bt, int L, int block_size, int64_t sb,
                                 int64_t ss, int64_t sh, int h0) {
    for (int t = 0, blk = 0, slot = 0; t < L; t++) {
        offs[t] = (int64_t)bt[blk] * sb + (int64_t)slot * ss + (int64_t)h0 * sh;
        if (++slot == block_size) { slot = 0; blk++; }
    }
    for (int t = L; t < L + 16; t++) offs[t] = L > 0 ? offs[0] : 0;
}

/* Prefetch the rows of tokens [t0, t0 + 16) of a cache (uses offs, L and row_lines in scope). */
#define KVMESH_PREFETCH_CHUNK(base, t0)                                                        \
    for (int t_ = (t0); t_ < (t0) + 16 && t_ < L; t_++)                                        \
        for (int64_t c_ = 0; c_ < row_lines; c_++)                                             \
            _mm_prefetch((const char *)((base) + offs[t_]) + 64 * c_, _MM_HINT_T1);

/* One sequence's heads [h0, h1) in the AVX-512 paths (q and out point at that sequence's head h0;
 * sc, pb and of are the calling thread's scratch, pb unused in fp32). */
typedef void (*decode_item_fn)(const void *q, const void *k, const void *v, const int32_t *bt, int L, int G,
                               int D, int bsz, int64_t sb, int64_t ss, int64_t sh, int h0, int h1, float scale,
                               void *out, float *sc, void *pb, int64_t *of);

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The order to run a batch's sequences in: those whose first KV block is the same physical block
 * (a shared prefix, such as a system prompt) back to back, ties in batch order. A prefix's rows are
 * then read from memory by the first of them and from cache by the rest (the interleaved order a
 * scheduler produces evicts them in between). Each sequence's result does not depend on the order.
 * NULL (batch order) for batches too large for the sort key or without memory for it. */
int *kvmesh_prefix_grouped_order(const int32_t *block_tables, int64_t bt_stride, int B) {
    if (B < 2 || B >= (1 << 24)) return NULL;
    int64_t *keys = (int64_t *)malloc(sizeof(int64_t) * (size_t)B);
    int *order = (int *)malloc(sizeof(int) * (size_t)B);
    if (keys == NULL || order == NULL) {
        free(keys);
        free(order);
        return NULL;
    }
    for (int b = 0; b < B; b++) keys[b] = ((int64_t)(uint32_t)block_tables[(int64_t)b * bt_stride] << 24) | b;
    qsort(keys, (size_t)B, sizeof(int64_t), cmp_i64);
    for (int b = 0; b < B; b++) order[b] = (int)(keys[b] & ((1 << 24) - 1));
    free(keys);
    return order;
}

/* Runs a batch's work items over the threads: whole sequences (all kv heads) when there are enough
 * of them to balance the threads (contiguous reads), else one item per (sequence, kv head). Each
 * thread allocates its scratch once for the longest context: scores, offsets and, with
 * pb_elem > 0, the bf16 path's rounded weights. elem: bytes of a q/out element. */
static void run_decode_items(decode_item_fn item, size_t elem, size_t pb_elem, const void *q, const void *k,
                             const void *v, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                             void *out, int B, int Hq, int Hkv, int D, int block_size, int64_t sb, int64_t ss,
                             int64_t sh, float scale, int num_threads, int group_prefixes) {
    const int G = Hq / Hkv;
    const int heads_per_item = (B >= 4 * num_threads && Hq <= MAX_QH) ? Hkv : 1;
    const int items_per_seq = Hkv / heads_per_item;
    const int64_t items = (int64_t)B * items_per_seq;
    int max_len = 1;
    for (int b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int *order = group_prefixes ? kvmesh_prefix_grouped_order(block_tables, bt_stride, B) : NULL;
#pragma omp parallel num_threads(num_threads)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)heads_per_item * G * max_len);
        int64_t *of = (int64_t *)malloc(sizeof(int64_t) * ((size_t)max_len + 16));
        void *pb = pb_elem ? malloc(pb_elem * (size_t)heads_per_item * G * (max_len + 16)) : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int s = (int)(it / items_per_seq), h0 = (int)(it % items_per_seq) * heads_per_item;
            int b = order ? order[s] : s;
            int64_t row = ((int64_t)b * Hq + (int64_t)h0 * G) * D;
            item((const char *)q + row * elem, k, v, block_tables + (int64_t)b * bt_stride, seq_lens[b], G, D,
                 block_size, sb, ss, sh, h0, h0 + heads_per_item, scale, (char *)out + row * elem, sc, pb, of);
        }
        free(sc);
        free(of);
        free(pb);
    }
    free(order);
}
#endif

#ifdef KVMESH_HAVE_AVX512_BF16

/* bf16 path for one sequence and kv heads [h0, h1), in three passes over the context:
 * scores = q.K (vdpbf16ps, 16 tokens reduced at once), softmax over the scores (fp32,
 * denominators from the fp32 weights), then out = p.V with vdpbf16ps over pairs of
 * tokens (weights rounded to bf16, as GPU paged-attention kernels do; fp32
 * accumulators). Each pass is a stream of independent work rather than a chain of
 * dependent reductions, so it runs at instruction throughput; decode attention is
 * bound by memory, so rows are prefetched ahead of the chunk of 16 tokens being
 * computed, and a token's heads [h0, h1) sit together. Requires D % 32 == 0.
 * scratch: scores (h1 - h0) * G * L floats, pb (h1 - h0) * G * (L + 16) bf16 and
 * L + 16 int64 offsets. */
static inline __attribute__((always_inline)) void
decode_seq_avx512(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *bt, int L,
                  int G, int D, int block_size, int64_t sb, int64_t ss, int64_t sh, int h0, int h1,
                  float scale, uint16_t *out, float *scores, uint16_t *pb, int64_t *offs) {
    const int J = D / 32, H = h1 - h0, QH = H * G;
    const int64_t row_lines = ((int64_t)H * sh * 2 + 63) / 64; /* cache lines of one token's heads */
    token_offsets(offs, bt, L, block_size, sb, ss, sh, h0);

    /* Pass 1: scores[r][t] = scale * q_r . k_t, and a running max per query head. */
    __m512 vmax[MAX_QH];
    for (int r = 0; r < QH; r++) vmax[r] = _mm512_set1_ps(-INFINITY);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? L - t0 : 16;
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        /* Both K and V of the next chunk: pass 3 then finds V in L2. */
        KVMESH_PREFETCH_CHUNK(k, t0 + 16)
        KVMESH_PREFETCH_CHUNK(v, t0 + 16)
        for (int hh = 0; hh < H; hh++)
            for (int g = 0; g < G; g++) {
                const int r = hh * G + g;
                const uint16_t *qr = q + (int64_t)r * D;
                __m512bh qv[MAX_D / 32];
#pragma GCC unroll 8
                for (int j = 0; j < J; j++) qv[j] = (__m512bh)_mm512_loadu_si512((const void *)(qr + 32 * j));
                __m512 dots[16];
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++) {
                    const uint16_t *kr = k + offs[t0 + i] + hh * sh;
                    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
                    for (int j = 0; j < J; j++)
                        a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512((const void *)(kr + 32 * j)));
                    dots[i] = a;
                }
                __m512 sc = _mm512_mul_ps(kvmesh_hsum16(dots), vscale);
                vmax[r] = _mm512_mask_max_ps(vmax[r], m, vmax[r], sc);
                _mm512_mask_storeu_ps(scores + (int64_t)r * L + t0, m, sc);
            }
    }
    /* Pass 2: scores -> exp(score - max), and the denominators. */
    float inv[MAX_QH];
    const int Lp = (L + 15) / 16 * 16; /* pb row stride: whole chunks, zero past L */
    for (int r = 0; r < QH; r++) {
        __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[r]));
        __m512 sum = _mm512_setzero_ps();
        const float *sr = scores + (int64_t)r * L;
        uint16_t *pr = pb + (int64_t)r * Lp;
        for (int t0 = 0; t0 < L; t0 += 16) {
            const int n = L - t0 < 16 ? L - t0 : 16;
            const __mmask16 m = (__mmask16)((1u << n) - 1u);
            __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sr + t0), mx)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(pr + t0), (__m256i)_mm512_cvtneps_pbh(e));
        }
        float den = _mm512_reduce_add_ps(sum);
        inv[r] = den > 0.f ? 1.f / den : 0.f;
    }
    /* Pass 3: out_r = sum_t p_r[t] v_t over pairs of tokens: vdpbf16ps of the broadcast
     * weight pair (p_t, p_t+1) against v_t and v_t+1 interleaved per dimension. An odd
     * last token pairs with row offs[L] (token 0, finite) under a zero weight. */
    const __m512i pair_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                             39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
    __m512 acc[MAX_QH][MAX_D / 16];
    for (int r = 0; r < QH; r++)
        for (int j = 0; j < 2 * J; j++) acc[r][j] = _mm512_setzero_ps();
    for (int t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? L - t0 : 16;
        /* Pass 1 asked for V already, but part of it no longer sits in L2 by now (measured:
         * asking again two chunks ahead cuts a cold call by about 15%). */
        KVMESH_PREFETCH_CHUNK(v, t0 + 32)
        for (int hh = 0; hh < H; hh++) {
            __m512 o[MAX_G][MAX_D / 16];
            for (int g = 0; g < G; g++)
                for (int j = 0; j < 2 * J; j++) o[g][j] = acc[hh * G + g][j];
            for (int i = 0; i < n; i += 2) {
                const uint16_t *va = v + offs[t0 + i] + hh * sh, *vb = v + offs[t0 + i + 1] + hh * sh;
                __m512bh vp[MAX_D / 16];
                for (int j = 0; j < J; j++) {
                    __m512i a = _mm512_loadu_si512((const void *)(va + 32 * j));
                    __m512i b = _mm512_loadu_si512((const void *)(vb + 32 * j));
                    vp[2 * j] = (__m512bh)_mm512_permutex2var_epi16(a, pair_lo, b);
                    vp[2 * j + 1] = (__m512bh)_mm512_permutex2var_epi16(a, pair_hi, b);
                }
                for (int g = 0; g < G; g++) {
                    uint32_t w2;
                    memcpy(&w2, pb + (int64_t)(hh * G + g) * Lp + t0 + i, 4);
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)w2);
                    for (int j = 0; j < 2 * J; j++) o[g][j] = _mm512_dpbf16_ps(o[g][j], w, vp[j]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int j = 0; j < 2 * J; j++) acc[hh * G + g][j] = o[g][j];
        }
    }
    for (int r = 0; r < QH; r++) {
        __m512 w = _mm512_set1_ps(inv[r]);
        for (int j = 0; j < 2 * J; j++)
            _mm256_storeu_si256((__m256i *)(out + (int64_t)r * D + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][j], w)));
    }
}

/* The common (D, G) shapes get copies with constant loop bounds, so gcc keeps the
 * accumulators in registers instead of indexing stack arrays. */
#define DECODE_SPECIALIZED(DC, GC)                                                               \
    static void decode_seq_d##DC##_g##GC(const uint16_t *q, const uint16_t *k, const uint16_t *v, \
                                         const int32_t *bt, int L, int bsz, int64_t sb, int64_t ss, \
                                         int64_t sh, int h0, int h1, float scale, uint16_t *out, \
                                         float *sc, uint16_t *pb, int64_t *of) { \
        decode_seq_avx512(q, k, v, bt, L, GC, DC, bsz, sb, ss, sh, h0, h1, scale, out, sc, pb, of);      \
    }
#define DECODE_FOR_D(DC) DECODE_SPECIALIZED(DC, 1) DECODE_SPECIALIZED(DC, 2) DECODE_SPECIALIZED(DC, 3) \
    DECODE_SPECIALIZED(DC, 4) DECODE_SPECIALIZED(DC, 5) DECODE_SPECIALIZED(DC, 6) DECODE_SPECIALIZED(DC, 7) \
    DECODE_SPECIALIZED(DC, 8)
DECODE_FOR_D(64)
DECODE_FOR_D(128)

static void decode_seq_generic(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *bt,
                               int L, int G, int D, int bsz, int64_t sb, int64_t ss, int64_t sh, int h0,
                               int h1, float scale, uint16_t *out, float *sc, uint16_t *pb, int64_t *of) {
    decode_seq_avx512(q, k, v, bt, L, G, D, bsz, sb, ss, sh, h0, h1, scale, out, sc, pb, of);
}

typedef void (*decode_seq_fn)(const uint16_t *, const uint16_t *, const uint16_t *, const int32_t *, int,
                              int, int64_t, int64_t, int64_t, int, int, float, uint16_t *, float *,
                              uint16_t *, int64_t *);
#define DECODE_TABLE(DC) {decode_seq_d##DC##_g1, decode_seq_d##DC##_g2, decode_seq_d##DC##_g3, \
    decode_seq_d##DC##_g4, decode_seq_d##DC##_g5, decode_seq_d##DC##_g6, decode_seq_d##DC##_g7, decode_seq_d##DC##_g8}
static const decode_seq_fn decode_d64[8] = DECODE_TABLE(64);
static const decode_seq_fn decode_d128[8] = DECODE_TABLE(128);

static void decode_seq_dispatch(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *bt,
                                int L, int G, int D, int bsz, int64_t sb, int64_t ss, int64_t sh, int h0,
                                int h1, float scale, uint16_t *out, float *sc, uint16_t *pb, int64_t *of) {
    const decode_seq_fn *table = D == 64 ? decode_d64 : D == 128 ? decode_d128 : NULL;
    if (table != NULL && G >= 1 && G <= 8)
        table[G - 1](q, k, v, bt, L, bsz, sb, ss, sh, h0, h1, scale, out, sc, pb, of);
    else
        decode_seq_generic(q, k, v, bt, L, G, D, bsz, sb, ss, sh, h0, h1, scale, out, sc, pb, of);
}

static void decode_bf16_item(const void *q, const void *k, const void *v, const int32_t *bt, int L, int G, int D,
                             int bsz, int64_t sb, int64_t ss, int64_t sh, int h0, int h1, float scale, void *out,
                             float *sc, void *pb, int64_t *of) {
    decode_seq_dispatch((const uint16_t *)q, (const uint16_t *)k, (const uint16_t *)v, bt, L, G, D, bsz, sb, ss, sh,
                        h0, h1, scale, (uint16_t *)out, sc, (uint16_t *)pb, of);
}
#endif

#ifdef KVMESH_HAVE_AVX512F
/* fp32 path for one sequence and kv heads [h0, h1): the bf16 path's three passes with fp32
 * rows and FMAs (scores 16 tokens at a time, softmax weights kept in fp32, out = p.V by FMA
 * of the broadcast weight). Memory-bound like the bf16 path, so it prefetches the same way;
 * the portable loop below reads one row at a time and runs at about half its rate.
 * Requires D % 16 == 0. scratch: scores (h1 - h0) * G * L floats, L + 16 offsets. */
static inline __attribute__((always_inline)) void
decode_seq_f32_avx512(const float *q, const float *k, const float *v, const int32_t *bt, int L, int G, int D,
                      int block_size, int64_t sb, int64_t ss, int64_t sh, int h0, int h1, float scale,
                      float *out, float *scores, int64_t *offs) {
    const int J = D / 16, H = h1 - h0, QH = H * G;
    const int64_t row_lines = ((int64_t)H * sh * 4 + 63) / 64;
    token_offsets(offs, bt, L, block_size, sb, ss, sh, h0);
    __m512 vmax[MAX_QH];
    for (int r = 0; r < QH; r++) vmax[r] = _mm512_set1_ps(-INFINITY);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int t0 = 0; t0 < L; t0 += 16) {
        const __mmask16 m = mask16(L - t0);
        KVMESH_PREFETCH_CHUNK(k, t0 + 16)
        KVMESH_PREFETCH_CHUNK(v, t0 + 16)
        for (int hh = 0; hh < H; hh++)
            for (int g = 0; g < G; g++) {
                const int r = hh * G + g;
                __m512 qv[MAX_D / 16];
                for (int j = 0; j < J; j++) qv[j] = _mm512_loadu_ps(q + (int64_t)r * D + 16 * j);
                __m512 dots[16];
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++) {
                    const float *kr = k + offs[t0 + i] + hh * sh;
                    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
                    for (int j = 1; j < J; j++) a = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kr + 16 * j), a);
                    dots[i] = a;
                }
                __m512 sc = _mm512_mul_ps(kvmesh_hsum16(dots), vscale);
                vmax[r] = _mm512_mask_max_ps(vmax[r], m, vmax[r], sc);
                _mm512_mask_storeu_ps(scores + (int64_t)r * L + t0, m, sc);
            }
    }
    float inv[MAX_QH];
    for (int r = 0; r < QH; r++) {
        __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[r]));
        __m512 sum = _mm512_setzero_ps();
        float *sr = scores + (int64_t)r * L;
        for (int t0 = 0; t0 < L; t0 += 16) {
            const __mmask16 m = mask16(L - t0);
            __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sr + t0), mx)));
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(sr + t0, m, e);
        }
        float den = _mm512_reduce_add_ps(sum);
        inv[r] = den > 0.f ? 1.f / den : 0.f;
    }
    __m512 acc[MAX_QH][MAX_D / 16];
    for (int r = 0; r < QH; r++)
        for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();
    for (int t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? L - t0 : 16;
        KVMESH_PREFETCH_CHUNK(v, t0 + 32)
        for (int hh = 0; hh < H; hh++) {
            __m512 o[MAX_G][MAX_D / 16];
            for (int g = 0; g < G; g++)
                for (int j = 0; j < J; j++) o[g][j] = acc[hh * G + g][j];
            for (int i = 0; i < n; i++) {
                const float *vr = v + offs[t0 + i] + hh * sh;
                __m512 vv[MAX_D / 16];
                for (int j = 0; j < J; j++) vv[j] = _mm512_loadu_ps(vr + 16 * j);
                for (int g = 0; g < G; g++) {
                    const __m512 w = _mm512_set1_ps(scores[(int64_t)(hh * G + g) * L + t0 + i]);
                    for (int j = 0; j < J; j++) o[g][j] = _mm512_fmadd_ps(w, vv[j], o[g][j]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int j = 0; j < J; j++) acc[hh * G + g][j] = o[g][j];
        }
    }
    for (int r = 0; r < QH; r++) {
        const __m512 w = _mm512_set1_ps(inv[r]);
        for (int j = 0; j < J; j++) _mm512_storeu_ps(out + (int64_t)r * D + 16 * j, _mm512_mul_ps(acc[r][j], w));
    }
}

#define DECODE_F32_SPECIALIZED(DC, GC)                                                              \
    static void decode_f32_d##DC##_g##GC(const float *q, const float *k, const float *v, const int32_t *bt, \
                                         int L, int bsz, int64_t sb, int64_t ss, int64_t sh, int h0,  \
                                         int h1, float scale, float *out, float *sc, int64_t *of) {   \
        decode_seq_f32_avx512(q, k, v, bt, L, GC, DC, bsz, sb, ss, sh, h0, h1, scale, out, sc, of);   \
    }
#define DECODE_F32_FOR_D(DC) DECODE_F32_SPECIALIZED(DC, 1) DECODE_F32_SPECIALIZED(DC, 2) \
    DECODE_F32_SPECIALIZED(DC, 3) DECODE_F32_SPECIALIZED(DC, 4) DECODE_F32_SPECIALIZED(DC, 5) \
    DECODE_F32_SPECIALIZED(DC, 6) DECODE_F32_SPECIALIZED(DC, 7) DECODE_F32_SPECIALIZED(DC, 8)
DECODE_F32_FOR_D(64)
DECODE_F32_FOR_D(128)

typedef void (*decode_f32_fn)(const float *, const float *, const float *, const int32_t *, int, int, int64_t,
                              int64_t, int64_t, int, int, float, float *, float *, int64_t *);
#define DECODE_F32_TABLE(DC) {decode_f32_d##DC##_g1, decode_f32_d##DC##_g2, decode_f32_d##DC##_g3, \
    decode_f32_d##DC##_g4, decode_f32_d##DC##_g5, decode_f32_d##DC##_g6, decode_f32_d##DC##_g7, decode_f32_d##DC##_g8}
static const decode_f32_fn decode_f32_d64[8] = DECODE_F32_TABLE(64);
static const decode_f32_fn decode_f32_d128[8] = DECODE_F32_TABLE(128);

static void decode_f32_dispatch(const float *q, const float *k, const float *v, const int32_t *bt, int L, int G,
                                int D, int bsz, int64_t sb, int64_t ss, int64_t sh, int h0, int h1, float scale,
                                float *out, float *sc, int64_t *of) {
    const decode_f32_fn *table = D == 64 ? decode_f32_d64 : D == 128 ? decode_f32_d128 : NULL;
    if (table != NULL && G >= 1 && G <= 8)
        table[G - 1](q, k, v, bt, L, bsz, sb, ss, sh, h0, h1, scale, out, sc, of);
    else
        decode_seq_f32_avx512(q, k, v, bt, L, G, D, bsz, sb, ss, sh, h0, h1, scale, out, sc, of);
}

static void decode_f32_item(const void *q, const void *k, const void *v, const int32_t *bt, int L, int G, int D,
                            int bsz, int64_t sb, int64_t ss, int64_t sh, int h0, int h1, float scale, void *out,
                            float *sc, void *pb, int64_t *of) {
    (void)pb;
    decode_f32_dispatch((const float *)q, (const float *)k, (const float *)v, bt, L, G, D, bsz, sb, ss, sh, h0, h1,
                        scale, (float *)out, sc, of);
}
#endif

/* Shared body; LOAD converts one cache/query element to float. */
#define DECODE_BODY(T, LOAD, STORE)                                                            \
    int64_t pairs = (int64_t)B * Hkv;                                                          \
    int G = Hq / Hkv;                                                                          \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                 \
    for (int64_t p = 0; p < pairs; p++) {                                                      \
        int b = (int)(p / Hkv), h = (int)(p % Hkv);                                            \
        int L = seq_lens[b];                                                                   \
        const int32_t *bt = block_tables + (int64_t)b * bt_stride;                             \
        float qf[MAX_G][MAX_D];                                                                \
        float acc[MAX_G][MAX_D];                                                               \
        float mx[MAX_G], den[MAX_G];                                                           \
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)(L > 0 ? L : 1)); \
        for (int g = 0; g < G; g++) {                                                          \
            const T *qrow = q + ((int64_t)b * Hq + (int64_t)h * G + g) * D;                    \
            for (int d = 0; d < D; d++) qf[g][d] = LOAD(qrow[d]) * scale;                      \
            mx[g] = -INFINITY;                                                                 \
            den[g] = 0.f;                                                                      \
            for (int d = 0; d < D; d++) acc[g][d] = 0.f;                                       \
        }                                                                                      \
        for (int t = 0; t < L; t++) {                                                          \
            const T *kr = k + (int64_t)bt[t / block_size] * sb + (int64_t)(t % block_size) * ss \
                          + (int64_t)h * sh;                                                   \
            float kf[MAX_D];                                                                   \
            for (int d = 0; d < D; d++) kf[d] = LOAD(kr[d]);                                   \
            for (int g = 0; g < G; g++) {                                                      \
                float s = 0.f;                                                                 \
                _Pragma("omp simd reduction(+:s)")                                             \
                for (int d = 0; d < D; d++) s += qf[g][d] * kf[d];                             \
                scores[(int64_t)g * L + t] = s;                                                \
                if (s > mx[g]) mx[g] = s;                                                      \
            }                                                                                  \
        }                                                                                      \
        for (int g = 0; g < G; g++) {                                                          \
            float *sg = scores + (int64_t)g * L;                                               \
            float m = mx[g], sum = 0.f;                                                        \
            for (int t = 0; t < L; t++) { sg[t] = expf(sg[t] - m); sum += sg[t]; }             \
            den[g] = sum;                                                                      \
        }                                                                                      \
        for (int t = 0; t < L; t++) {                                                          \
            const T *vr = v + (int64_t)bt[t / block_size] * sb + (int64_t)(t % block_size) * ss \
                          + (int64_t)h * sh;                                                   \
            float vf[MAX_D];                                                                   \
            for (int d = 0; d < D; d++) vf[d] = LOAD(vr[d]);                                   \
            for (int g = 0; g < G; g++) {                                                      \
                float w = scores[(int64_t)g * L + t];                                          \
                for (int d = 0; d < D; d++) acc[g][d] += w * vf[d];                            \
            }                                                                                  \
        }                                                                                      \
        for (int g = 0; g < G; g++) {                                                          \
            T *orow = out + ((int64_t)b * Hq + (int64_t)h * G + g) * D;                        \
            float inv = den[g] > 0.f ? 1.f / den[g] : 0.f;                                     \
            for (int d = 0; d < D; d++) orow[d] = STORE(acc[g][d] * inv);                      \
        }                                                                                      \
        free(scores);                                                                          \
    }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

void kvmesh_decode_attention_f32(const float *q, const float *k, const float *v,
                                 const int32_t *block_tables, int64_t bt_stride,
                                 const int32_t *seq_lens, float *out, int B, int Hq, int Hkv, int D,
                                 int block_size, int64_t sb, int64_t ss, int64_t sh, float scale,
                                 int num_threads, int group_prefixes) {
    (void)group_prefixes; /* only the AVX-512 paths order their work */
#ifdef KVMESH_HAVE_AVX512F
    if (D % 16 == 0 && D <= MAX_D && Hq / Hkv <= MAX_G) {
        run_decode_items(decode_f32_item, sizeof(float), 0, q, k, v, block_tables, bt_stride, seq_lens, out, B, Hq,
                         Hkv, D, block_size, sb, ss, sh, scale, num_threads, group_prefixes);
        return;
    }
#endif
    DECODE_BODY(float, LOAD_F32, STORE_F32)
}

void kvmesh_decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                  const int32_t *block_tables, int64_t bt_stride,
                                  const int32_t *seq_lens, uint16_t *out, int B, int Hq, int Hkv,
                                  int D, int block_size, int64_t sb, int64_t ss, int64_t sh,
                                  float scale, int num_threads, int group_prefixes) {
    (void)group_prefixes; /* only the AVX-512 paths order their work */
#ifdef KVMESH_HAVE_AVX512_BF16
    if (D % 32 == 0 && D <= MAX_D) {
        run_decode_items(decode_bf16_item, sizeof(uint16_t), sizeof(uint16_t), q, k, v, block_tables, bt_stride,
                         seq_lens, out, B, Hq, Hkv, D, block_size, sb, ss, sh, scale, num_threads, group_prefixes);
        return;
    }
#endif
    DECODE_BODY(uint16_t, bf2f, f2bf)
}

/* One decode step of a layer: RoPE on the fused q|k|v rows (k and v written to the
 * cache), then decode attention of the rotated queries; out is [B, Hq, D]. Saves the
 * caller a round trip for q_rot and k_rot. With use_tiles the attention runs on AMX tiles
 * where cpu_decode_amx.c applies. Returns -1 without memory for q_rot. */
int kvmesh_decode_step_bf16(const uint16_t *qkv, int64_t qkv_stride, const int64_t *positions,
                            const float *cos_sin, const int64_t *slots, uint16_t *k_cache, uint16_t *v_cache,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                            uint16_t *out, int B, int Hq, int Hkv, int D, int block_size, int64_t sb,
                            int64_t ss, int64_t sh, float scale, int num_threads, int use_tiles) {
    uint16_t *q_rot = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)B * Hq * D);
    if (q_rot == NULL) return -1;
    kvmesh_rope_write_kv_bf16(qkv, qkv_stride, qkv + (int64_t)Hq * D, qkv_stride, qkv + (int64_t)(Hq + Hkv) * D,
                              qkv_stride, positions, cos_sin, slots, k_cache, v_cache, sb, ss, sh, block_size,
                              q_rot, NULL, B, Hq, Hkv, D, num_threads);
    if (!use_tiles || kvmesh_decode_attention_bf16_amx(q_rot, k_cache, v_cache, block_tables, bt_stride, seq_lens, out,
                                                       B, Hq, Hkv, D, block_size, sb, ss, sh, scale, num_threads, 1))
        kvmesh_decode_attention_bf16(q_rot, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, B, Hq, Hkv, D,
                                     block_size, sb, ss, sh, scale, num_threads, 1);
    free(q_rot);
    return 0;
}

int kvmesh_has_avx512_bf16(void) {
#ifdef KVMESH_HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

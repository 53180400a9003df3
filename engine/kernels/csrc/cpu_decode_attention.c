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

#ifdef KVMESH_HAVE_AVX512_BF16

/* bf16 path for one sequence and kv heads [h0, h1), in three passes over the context:
 * scores = q.K (vdpbf16ps, 16 tokens reduced at once), softmax over the scores, then
 * out = p.V with fp32 accumulators. Each pass is a stream of independent work rather
 * than a chain of dependent reductions, so it runs at instruction throughput; decode
 * attention is bound by memory, so the rows of the next chunk of 16 tokens are
 * prefetched while this one is computed, and a token's heads [h0, h1) sit together.
 * V rows are widened to fp32 without shuffles (even elements by a shift, odd ones by
 * a mask), so the accumulators hold each 32-element group as 16 even then 16 odd
 * elements until the final store interleaves them. Requires D % 32 == 0.
 * scratch: room for (h1 - h0) * G * L floats and L + 16 int64 offsets. */
static inline __attribute__((always_inline)) void
decode_seq_avx512(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *bt, int L,
                  int G, int D, int block_size, int64_t sb, int64_t ss, int64_t sh, int h0, int h1,
                  float scale, uint16_t *out, float *scores, int64_t *offs) {
    const int J = D / 32, H = h1 - h0, QH = H * G;
    const int64_t row_lines = ((int64_t)H * sh * 2 + 63) / 64; /* cache lines of one token's heads */
    for (int t = 0, blk = 0, slot = 0; t < L; t++) {
        offs[t] = (int64_t)bt[blk] * sb + (int64_t)slot * ss + (int64_t)h0 * sh;
        if (++slot == block_size) { slot = 0; blk++; }
    }
    /* A partial last chunk reads token 0 again in its spare lanes (masked out below), so
     * the score loop has no bounds checks. */
    for (int t = L; t < L + 16; t++) offs[t] = L > 0 ? offs[0] : 0;
#define KVMESH_PREFETCH_CHUNK(base, t0)                                                        \
    for (int t_ = (t0); t_ < (t0) + 16 && t_ < L; t_++)                                        \
        for (int64_t c_ = 0; c_ < row_lines; c_++)                                             \
            _mm_prefetch((const char *)((base) + offs[t_]) + 64 * c_, _MM_HINT_T1);

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
    for (int r = 0; r < QH; r++) {
        __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[r]));
        __m512 sum = _mm512_setzero_ps();
        float *sr = scores + (int64_t)r * L;
        for (int t0 = 0; t0 < L; t0 += 16) {
            const int n = L - t0 < 16 ? L - t0 : 16;
            const __mmask16 m = (__mmask16)((1u << n) - 1u);
            __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sr + t0), mx)));
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(sr + t0, m, e);
        }
        float den = _mm512_reduce_add_ps(sum);
        inv[r] = den > 0.f ? 1.f / den : 0.f;
    }
    /* Pass 3: out_r = sum_t p_r[t] v_t. */
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[MAX_QH][MAX_D / 16]; /* per 32-element group: [even, odd] */
    for (int r = 0; r < QH; r++)
        for (int j = 0; j < 2 * J; j++) acc[r][j] = _mm512_setzero_ps();
    for (int t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? L - t0 : 16;
        for (int hh = 0; hh < H; hh++) {
            __m512 o[MAX_G][MAX_D / 16];
            for (int g = 0; g < G; g++)
                for (int j = 0; j < 2 * J; j++) o[g][j] = acc[hh * G + g][j];
            for (int i = 0; i < n; i++) {
                __m512 ve[MAX_D / 32], vo[MAX_D / 32];
                for (int j = 0; j < J; j++) {
                    __m512i x = _mm512_loadu_si512((const void *)(v + offs[t0 + i] + hh * sh + 32 * j));
                    ve[j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
                    vo[j] = _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask));
                }
                for (int g = 0; g < G; g++) {
                    __m512 w = _mm512_set1_ps(scores[(int64_t)(hh * G + g) * L + t0 + i]);
                    for (int j = 0; j < J; j++) {
                        o[g][2 * j] = _mm512_fmadd_ps(w, ve[j], o[g][2 * j]);
                        o[g][2 * j + 1] = _mm512_fmadd_ps(w, vo[j], o[g][2 * j + 1]);
                    }
                }
            }
            for (int g = 0; g < G; g++)
                for (int j = 0; j < 2 * J; j++) acc[hh * G + g][j] = o[g][j];
        }
    }
#undef KVMESH_PREFETCH_CHUNK
    const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int r = 0; r < QH; r++) {
        __m512 w = _mm512_set1_ps(inv[r]);
        for (int j = 0; j < J; j++) {
            __m512 e = _mm512_mul_ps(acc[r][2 * j], w), od = _mm512_mul_ps(acc[r][2 * j + 1], w);
            /* Interleave back to natural order, round to nearest even (vcvtneps2bf16). */
            __m256bh lo = _mm512_cvtneps_pbh(_mm512_permutex2var_ps(e, lo_idx, od));
            __m256bh hi = _mm512_cvtneps_pbh(_mm512_permutex2var_ps(e, hi_idx, od));
            _mm256_storeu_si256((__m256i *)(out + (int64_t)r * D + 32 * j), (__m256i)lo);
            _mm256_storeu_si256((__m256i *)(out + (int64_t)r * D + 32 * j + 16), (__m256i)hi);
        }
    }
}

/* The common (D, G) shapes get copies with constant loop bounds, so gcc keeps the
 * accumulators in registers instead of indexing stack arrays. */
#define DECODE_SPECIALIZED(DC, GC)                                                               \
    static void decode_seq_d##DC##_g##GC(const uint16_t *q, const uint16_t *k, const uint16_t *v, \
                                         const int32_t *bt, int L, int bsz, int64_t sb, int64_t ss, \
                                         int64_t sh, int h0, int h1, float scale, uint16_t *out, \
                                         float *sc, int64_t *of) { \
        decode_seq_avx512(q, k, v, bt, L, GC, DC, bsz, sb, ss, sh, h0, h1, scale, out, sc, of);          \
    }
#define DECODE_FOR_D(DC) DECODE_SPECIALIZED(DC, 1) DECODE_SPECIALIZED(DC, 2) DECODE_SPECIALIZED(DC, 3) \
    DECODE_SPECIALIZED(DC, 4) DECODE_SPECIALIZED(DC, 5) DECODE_SPECIALIZED(DC, 6) DECODE_SPECIALIZED(DC, 7) \
    DECODE_SPECIALIZED(DC, 8)
DECODE_FOR_D(64)
DECODE_FOR_D(128)

static void decode_seq_generic(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *bt,
                               int L, int G, int D, int bsz, int64_t sb, int64_t ss, int64_t sh, int h0,
                               int h1, float scale, uint16_t *out, float *sc, int64_t *of) {
    decode_seq_avx512(q, k, v, bt, L, G, D, bsz, sb, ss, sh, h0, h1, scale, out, sc, of);
}

typedef void (*decode_seq_fn)(const uint16_t *, const uint16_t *, const uint16_t *, const int32_t *, int,
                              int, int64_t, int64_t, int64_t, int, int, float, uint16_t *, float *,
                              int64_t *);
#define DECODE_TABLE(DC) {decode_seq_d##DC##_g1, decode_seq_d##DC##_g2, decode_seq_d##DC##_g3, \
    decode_seq_d##DC##_g4, decode_seq_d##DC##_g5, decode_seq_d##DC##_g6, decode_seq_d##DC##_g7, decode_seq_d##DC##_g8}
static const decode_seq_fn decode_d64[8] = DECODE_TABLE(64);
static const decode_seq_fn decode_d128[8] = DECODE_TABLE(128);

static void decode_seq_dispatch(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *bt,
                                int L, int G, int D, int bsz, int64_t sb, int64_t ss, int64_t sh, int h0,
                                int h1, float scale, uint16_t *out, float *sc, int64_t *of) {
    const decode_seq_fn *table = D == 64 ? decode_d64 : D == 128 ? decode_d128 : NULL;
    if (table != NULL && G >= 1 && G <= 8)
        table[G - 1](q, k, v, bt, L, bsz, sb, ss, sh, h0, h1, scale, out, sc, of);
    else
        decode_seq_generic(q, k, v, bt, L, G, D, bsz, sb, ss, sh, h0, h1, scale, out, sc, of);
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

int kvmesh_max_g(void) { return MAX_G; }
int kvmesh_max_d(void) { return MAX_D; }

void kvmesh_decode_attention_f32(const float *q, const float *k, const float *v,
                                 const int32_t *block_tables, int64_t bt_stride,
                                 const int32_t *seq_lens, float *out, int B, int Hq, int Hkv, int D,
                                 int block_size, int64_t sb, int64_t ss, int64_t sh, float scale,
                                 int num_threads) {
    DECODE_BODY(float, LOAD_F32, STORE_F32)
}

void kvmesh_decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                  const int32_t *block_tables, int64_t bt_stride,
                                  const int32_t *seq_lens, uint16_t *out, int B, int Hq, int Hkv,
                                  int D, int block_size, int64_t sb, int64_t ss, int64_t sh,
                                  float scale, int num_threads) {
#ifdef KVMESH_HAVE_AVX512_BF16
    if (D % 32 == 0 && D <= MAX_D) {
        int G = Hq / Hkv;
        /* Whole sequences per work item when there are enough of them to balance the threads
         * (contiguous reads); otherwise one item per (sequence, kv head). */
        int heads_per_item = (B >= 4 * num_threads && Hq <= MAX_QH) ? Hkv : 1;
        int items_per_seq = Hkv / heads_per_item;
        int64_t items = (int64_t)B * items_per_seq;
        int max_len = 1;
        for (int b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
#pragma omp parallel num_threads(num_threads)
        {
            /* Per-thread scratch, reused across items: scores and row offsets. */
            float *sc = (float *)malloc(sizeof(float) * (size_t)heads_per_item * G * max_len);
            int64_t *of = (int64_t *)malloc(sizeof(int64_t) * ((size_t)max_len + 16));
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                int b = (int)(it / items_per_seq), h0 = (int)(it % items_per_seq) * heads_per_item;
                decode_seq_dispatch(q + ((int64_t)b * Hq + (int64_t)h0 * G) * D, k, v,
                                    block_tables + (int64_t)b * bt_stride, seq_lens[b], G, D, block_size,
                                    sb, ss, sh, h0, h0 + heads_per_item, scale,
                                    out + ((int64_t)b * Hq + (int64_t)h0 * G) * D, sc, of);
            }
            free(sc);
            free(of);
        }
        return;
    }
#endif
    DECODE_BODY(uint16_t, bf2f, f2bf)
}

int kvmesh_has_avx512_bf16(void) {
#ifdef KVMESH_HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

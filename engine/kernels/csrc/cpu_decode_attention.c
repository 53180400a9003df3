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

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define MAX_G 16
#define MAX_D 256

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVMESH_HAVE_AVX512_BF16 1

/* exp(x) for x <= 0 (softmax arguments): 2^(x log2 e) with a degree-6 polynomial
 * on the reduced argument; relative error ~2e-7, exp(-inf) = 0. */
static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    __m512 masked = _mm512_max_ps(x, lo);
    __m512 t = _mm512_mul_ps(masked, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n); /* f in [-0.5, 0.5]; 2^f by polynomial */
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512 r = _mm512_scalef_ps(p, n);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), r, _mm512_setzero_ps());
}

/* Sum each of 16 vectors: returns {sum(v[0]), ..., sum(v[15])}. */
static inline __m512 hsum16(__m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

static inline __m512 bf16x16_to_ps(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* bf16 path: K dot products with vdpbf16ps (no conversion), 16 tokens reduced at once,
 * vectorized exp, V accumulated in fp32. Requires D % 32 == 0. */
static void decode_pair_avx512(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                               const int32_t *bt, int L, int G, int D, int block_size,
                               int64_t sb, int64_t ss, int64_t sh, int h, float scale,
                               uint16_t *out, float *scores) {
    int J = D / 32;
    __m512bh qv[MAX_G][MAX_D / 32];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < J; j++)
            qv[g][j] = (__m512bh)_mm512_loadu_si512((const void *)(q + (int64_t)g * D + 32 * j));
    __m512 vmax[MAX_G];
    for (int g = 0; g < G; g++) vmax[g] = _mm512_set1_ps(-INFINITY);
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 acc[MAX_G][16];
    for (int t0 = 0; t0 < L; t0 += 16) {
        int n = L - t0 < 16 ? L - t0 : 16;
        for (int i = 0; i < 16; i++) {
            if (i < n) {
                int t = t0 + i;
                const uint16_t *kr = k + (int64_t)bt[t / block_size] * sb
                                     + (int64_t)(t % block_size) * ss + (int64_t)h * sh;
                for (int g = 0; g < G; g++) {
                    __m512 a = _mm512_setzero_ps();
                    for (int j = 0; j < J; j++)
                        a = _mm512_dpbf16_ps(a, qv[g][j], (__m512bh)_mm512_loadu_si512((const void *)(kr + 32 * j)));
                    acc[g][i] = a;
                }
            } else {
                for (int g = 0; g < G; g++) acc[g][i] = _mm512_setzero_ps();
            }
        }
        __mmask16 m = (__mmask16)((1u << n) - 1u);
        for (int g = 0; g < G; g++) {
            __m512 s = _mm512_mul_ps(hsum16(acc[g]), vscale);
            vmax[g] = _mm512_mask_max_ps(vmax[g], m, vmax[g], s);
            _mm512_mask_storeu_ps(scores + (int64_t)g * L + t0, m, s);
        }
    }
    float den[MAX_G];
    for (int g = 0; g < G; g++) {
        __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[g]));
        __m512 vs = _mm512_setzero_ps();
        float *sg = scores + (int64_t)g * L;
        for (int t0 = 0; t0 < L; t0 += 16) {
            int n = L - t0 < 16 ? L - t0 : 16;
            __mmask16 m = (__mmask16)((1u << n) - 1u);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + t0), vm));
            e = _mm512_maskz_mov_ps(m, e);
            vs = _mm512_add_ps(vs, e);
            _mm512_mask_storeu_ps(sg + t0, m, e);
        }
        den[g] = _mm512_reduce_add_ps(vs);
    }
    int V16 = D / 16;
    __m512 o[MAX_G][MAX_D / 16];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < V16; j++) o[g][j] = _mm512_setzero_ps();
    for (int t = 0; t < L; t++) {
        const uint16_t *vr = v + (int64_t)bt[t / block_size] * sb + (int64_t)(t % block_size) * ss
                             + (int64_t)h * sh;
        __m512 vf[MAX_D / 16];
        for (int j = 0; j < V16; j++) vf[j] = bf16x16_to_ps(vr + 16 * j);
        for (int g = 0; g < G; g++) {
            __m512 w = _mm512_set1_ps(scores[(int64_t)g * L + t]);
            for (int j = 0; j < V16; j++) o[g][j] = _mm512_fmadd_ps(w, vf[j], o[g][j]);
        }
    }
    for (int g = 0; g < G; g++) {
        float inv = den[g] > 0.f ? 1.f / den[g] : 0.f;
        float tmp[MAX_D];
        for (int j = 0; j < V16; j++) _mm512_storeu_ps(tmp + 16 * j, _mm512_mul_ps(o[g][j], _mm512_set1_ps(inv)));
        for (int d = 0; d < D; d++) out[(int64_t)g * D + d] = f32_to_bf16(tmp[d]);
    }
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
    if (D % 32 == 0) {
        int64_t pairs = (int64_t)B * Hkv;
        int G = Hq / Hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t p = 0; p < pairs; p++) {
            int b = (int)(p / Hkv), h = (int)(p % Hkv);
            int L = seq_lens[b];
            float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)(L > 0 ? L : 1));
            decode_pair_avx512(q + ((int64_t)b * Hq + (int64_t)h * G) * D, k, v,
                               block_tables + (int64_t)b * bt_stride, L, G, D, block_size, sb, ss, sh,
                               h, scale, out + ((int64_t)b * Hq + (int64_t)h * G) * D, scores);
            free(scores);
        }
        return;
    }
#endif
    DECODE_BODY(uint16_t, bf16_to_f32, f32_to_bf16)
}

int kvmesh_has_avx512_bf16(void) {
#ifdef KVMESH_HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

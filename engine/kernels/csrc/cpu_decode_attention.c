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
    DECODE_BODY(uint16_t, bf16_to_f32, f32_to_bf16)
}

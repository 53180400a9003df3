/* Fused bf16 elementwise kernels for the CPU engine: residual add + RMSNorm, RoPE
 * with the KV-cache write, and SiLU(gate) * up.
 *
 * Each one replaces a handful of torch ops (and their temporaries) per layer. They
 * round to bf16 exactly where the torch references do (every torch bf16 op computes
 * in fp32 and rounds its result to nearest even), so outputs match the references
 * bit for bit except where an fp32 reduction order (RMSNorm's mean) or exp differs
 * in the last place before a rounding. Rows are independent: large batches are
 * split over threads, small ones (decode) run on the calling thread. fp32 versions
 * of the three follow them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvmesh_cpu.h"

/* Below this many elements one thread is as fast as two (thread wake-up dominates);
 * SiLU costs an exp and a division per element, so it splits earlier. */
#define PARALLEL_MIN_ELEMS (1 << 18)
#define PARALLEL_MIN_ELEMS_SILU (1 << 15)

/* out = weight * bf16(h * rsqrt(mean(h^2) + eps)) with h = bf16(x + res) (or x without res);
 * h is stored to h_out when res is given. Rows of N elements; strides in elements. */
void kvmesh_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *res, int64_t res_stride,
                          const uint16_t *weight, uint16_t *out, uint16_t *h_out, int64_t T, int N,
                          float eps, int num_threads) {
    int nt = (int64_t)T * N >= PARALLEL_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * x_stride;
        const uint16_t *rr = res ? res + t * res_stride : NULL;
        uint16_t *hr = res ? h_out + t * N : NULL, *yr = out + t * N;
        const uint16_t *hsrc = res ? hr : xr;
        float ss;
#ifdef KVMESH_HAVE_AVX512_BF16
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < N; i += 16) {
            __mmask16 m = mask16(N - i);
            __m512 h = load16(xr + i, m);
            if (rr) {
                h = round16(_mm512_add_ps(h, load16(rr + i, m)));
                store16(hr + i, h, m);
            }
            acc = _mm512_fmadd_ps(h, h, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#else
        ss = 0.f;
        for (int i = 0; i < N; i++) {
            float h = bf2f(xr[i]);
            if (rr) {
                h = round_bf(h + bf2f(rr[i]));
                hr[i] = f2bf(h);
            }
            ss += h * h;
        }
#endif
        float rs = 1.0f / sqrtf(ss / (float)N + eps);
#ifdef KVMESH_HAVE_AVX512_BF16
        __m512 vrs = _mm512_set1_ps(rs);
        for (int i = 0; i < N; i += 16) {
            __mmask16 m = mask16(N - i);
            __m512 y = round16(_mm512_mul_ps(load16(hsrc + i, m), vrs));
            store16(yr + i, _mm512_mul_ps(load16(weight + i, m), y), m);
        }
#else
        for (int i = 0; i < N; i++) yr[i] = f2bf(bf2f(weight[i]) * round_bf(bf2f(hsrc[i]) * rs));
#endif
    }
}

/* NeoX rotation of q and k at their positions (HF: x * cos + rotate_half(x) * sin with
 * cos/sin in bf16 and every product and sum rounded), rotated k and v written to the
 * paged cache at slot_mapping (slot = block * block_size + offset), q_rot and k_rot to
 * dense outputs [T, H, D] (k_out may be NULL). cos_sin is the fp32 [positions, D]
 * table: cos | sin. */
void kvmesh_rope_write_kv_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                               const uint16_t *v, int64_t v_stride, const int64_t *positions,
                               const float *cos_sin, const int64_t *slots, uint16_t *k_cache,
                               uint16_t *v_cache, int64_t cb, int64_t cs, int64_t ch, int block_size,
                               uint16_t *q_out, uint16_t *k_out, int64_t T, int Hq, int Hkv, int D,
                               int num_threads) {
    const int half = D / 2;
    int nt = (int64_t)T * (Hq + 2 * Hkv) * D >= PARALLEL_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const float *cs_row = cos_sin + positions[t] * D;
        const int64_t slot = slots[t];
        const int64_t base = (slot / block_size) * cb + (slot % block_size) * cs;
        for (int h = 0; h < Hq + Hkv; h++) {
            const int is_q = h < Hq;
            const uint16_t *src = is_q ? q + t * q_stride + (int64_t)h * D : k + t * k_stride + (int64_t)(h - Hq) * D;
            uint16_t *dst = is_q ? q_out + (t * Hq + h) * D
                          : k_out ? k_out + (t * Hkv + (h - Hq)) * D : k_cache + base + (int64_t)(h - Hq) * ch;
#ifdef KVMESH_HAVE_AVX512_BF16
            for (int i = 0; i < half; i += 16) {
                __mmask16 m = mask16(half - i);
                __m512 c = round16(_mm512_maskz_loadu_ps(m, cs_row + i));
                __m512 s = round16(_mm512_maskz_loadu_ps(m, cs_row + half + i));
                __m512 x1 = load16(src + i, m), x2 = load16(src + half + i, m);
                /* first half: x1*cos + (-x2)*sin; second half: x2*cos + x1*sin */
                __m512 a = _mm512_add_ps(round16(_mm512_mul_ps(x1, c)),
                                         round16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s)));
                __m512 b = _mm512_add_ps(round16(_mm512_mul_ps(x2, c)), round16(_mm512_mul_ps(x1, s)));
                store16(dst + i, a, m);
                store16(dst + half + i, b, m);
            }
#else
            for (int i = 0; i < half; i++) {
                float c = round_bf(cs_row[i]), s = round_bf(cs_row[half + i]);
                float x1 = bf2f(src[i]), x2 = bf2f(src[half + i]);
                dst[i] = f2bf(round_bf(x1 * c) + round_bf(-x2 * s));
                dst[half + i] = f2bf(round_bf(x2 * c) + round_bf(x1 * s));
            }
#endif
            if (!is_q && k_out) memcpy(k_cache + base + (int64_t)(h - Hq) * ch, dst, (size_t)D * 2);
        }
        for (int h = 0; h < Hkv; h++)
            memcpy(v_cache + base + (int64_t)h * ch, v + t * v_stride + (int64_t)h * D, (size_t)D * 2);
    }
}

/* out[t, i] = bf16(bf16(silu(gu[t, i])) * gu[t, I + i]): the gate and up halves of one
 * fused projection, as F.silu(g) * u computes them in bf16. */
void kvmesh_silu_mul_bf16(const uint16_t *gu, int64_t gu_stride, uint16_t *out, int64_t T, int I,
                          int num_threads) {
    int nt = (int64_t)T * I >= PARALLEL_MIN_ELEMS_SILU ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gu + t * gu_stride, *u = g + I;
        uint16_t *o = out + t * I;
#ifdef KVMESH_HAVE_AVX512_BF16
        for (int i = 0; i < I; i += 16) {
            __mmask16 m = mask16(I - i);
            __m512 x = load16(g + i, m);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            __m512 s = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
            store16(o + i, _mm512_mul_ps(s, load16(u + i, m)), m);
        }
#else
        for (int i = 0; i < I; i++) {
            float x = bf2f(g[i]);
            o[i] = f2bf(round_bf(x / (1.f + expf(-x))) * bf2f(u[i]));
        }
#endif
    }
}

/* fp32 versions of the three kernels above: the same operations with no rounding steps
 * (torch's fp32 references round only to fp32), multiply and add kept apart as torch keeps
 * them (no contraction into FMAs), loops the compiler vectorizes. */
#define KVMESH_NO_CONTRACT __attribute__((optimize("fp-contract=off")))

KVMESH_NO_CONTRACT void kvmesh_rms_norm_f32(const float *x, int64_t x_stride, const float *res, int64_t res_stride,
                                            const float *weight, float *out, float *h_out, int64_t T, int N,
                                            float eps, int num_threads) {
    int nt = (int64_t)T * N >= PARALLEL_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * x_stride;
        float *yr = out + t * N;
        const float *hsrc = xr;
        float ss = 0.f;
        if (res) {
            const float *rr = res + t * res_stride;
            float *hr = h_out + t * N;
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < N; i++) {
                float h = xr[i] + rr[i];
                hr[i] = h;
                ss += h * h;
            }
            hsrc = hr;
        } else {
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < N; i++) ss += xr[i] * xr[i];
        }
        float rs = 1.0f / sqrtf(ss / (float)N + eps);
#pragma omp simd
        for (int i = 0; i < N; i++) yr[i] = weight[i] * (hsrc[i] * rs);
    }
}

KVMESH_NO_CONTRACT void kvmesh_rope_write_kv_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                                                 const float *v, int64_t v_stride, const int64_t *positions,
                                                 const float *cos_sin, const int64_t *slots, float *k_cache,
                                                 float *v_cache, int64_t cb, int64_t cs, int64_t ch, int block_size,
                                                 float *q_out, float *k_out, int64_t T, int Hq, int Hkv, int D,
                                                 int num_threads) {
    const int half = D / 2;
    int nt = (int64_t)T * (Hq + 2 * Hkv) * D >= PARALLEL_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_sin + positions[t] * D, *sn = c + half;
        const int64_t slot = slots[t];
        const int64_t base = (slot / block_size) * cb + (slot % block_size) * cs;
        for (int h = 0; h < Hq + Hkv; h++) {
            const int is_q = h < Hq;
            const float *src = is_q ? q + t * q_stride + (int64_t)h * D : k + t * k_stride + (int64_t)(h - Hq) * D;
            float *dst = is_q ? q_out + (t * Hq + h) * D
                       : k_out ? k_out + (t * Hkv + (h - Hq)) * D : k_cache + base + (int64_t)(h - Hq) * ch;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float x1 = src[i], x2 = src[half + i];
                dst[i] = x1 * c[i] + (-x2) * sn[i];
                dst[half + i] = x2 * c[i] + x1 * sn[i];
            }
            if (!is_q && k_out) memcpy(k_cache + base + (int64_t)(h - Hq) * ch, dst, (size_t)D * 4);
        }
        for (int h = 0; h < Hkv; h++)
            memcpy(v_cache + base + (int64_t)h * ch, v + t * v_stride + (int64_t)h * D, (size_t)D * 4);
    }
}

KVMESH_NO_CONTRACT void kvmesh_silu_mul_f32(const float *gu, int64_t gu_stride, float *out, int64_t T, int I,
                                            int num_threads) {
    int nt = (int64_t)T * I >= PARALLEL_MIN_ELEMS_SILU ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * gu_stride, *u = g + I;
        float *o = out + t * I;
#ifdef KVMESH_HAVE_AVX512F
        for (int i = 0; i < I; i += 16) {
            __mmask16 m = mask16(I - i);
            __m512 x = _mm512_maskz_loadu_ps(m, g + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
            _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
        }
#else
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
#endif
    }
}

int kvmesh_elementwise_vectorized(void) {
#ifdef KVMESH_HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

/* out[r] = index of the first maximum of row r (a NaN counts as the maximum, as in
 * torch.argmax). Rows are split over threads when there are several. */
#define KVMESH_ARGMAX(NAME, T, LOADV, TOF)                                                   \
    void NAME(const T *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int num_threads) { \
        int nt = rows * cols >= PARALLEL_MIN_ELEMS ? num_threads : 1;                        \
        _Pragma("omp parallel for schedule(static) num_threads(nt) if (nt > 1)")             \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            const T *row = x + r * stride;                                                   \
            float best = -INFINITY;                                                          \
            int64_t c = 0, at = -1;                                                          \
            ARGMAX_VECTOR_SCAN(LOADV)                                                        \
            for (; c < cols; c++) {                                                          \
                float f = TOF(row[c]);                                                       \
                if (f != f) { at = c; break; }                                               \
                if (f > best || at < 0) { best = f; at = c; }                                \
            }                                                                                \
            out[r] = at < 0 ? 0 : at;                                                        \
        }                                                                                    \
    }

#ifdef KVMESH_HAVE_AVX512_BF16
/* Whole vectors: find the row maximum (and any NaN) lane-wise, then the first lane
 * that holds it; the scalar tail continues from there with the same rules. */
#define ARGMAX_VECTOR_SCAN(LOADV)                                                            \
    {                                                                                        \
        int64_t full = cols / 16 * 16;                                                       \
        if (full > 0) {                                                                      \
            __m512 m = _mm512_set1_ps(-INFINITY);                                            \
            __mmask16 nan = 0;                                                               \
            for (int64_t i = 0; i < full && !nan; i += 16) {                                 \
                __m512 v = LOADV(row + i);                                                   \
                nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                \
                m = _mm512_max_ps(m, v);                                                     \
            }                                                                                \
            if (nan) {                                                                       \
                c = 0; /* the scalar loop below finds the first NaN */                       \
            } else {                                                                         \
                best = _mm512_reduce_max_ps(m);                                              \
                __m512 vb = _mm512_set1_ps(best);                                            \
                for (int64_t i = 0; i < full; i += 16) {                                     \
                    __mmask16 eq = _mm512_cmp_ps_mask(LOADV(row + i), vb, _CMP_EQ_OQ);        \
                    if (eq) { at = i + __builtin_ctz((unsigned)eq); break; }                 \
                }                                                                            \
                c = full;                                                                    \
            }                                                                                \
        }                                                                                    \
    }
#define LOADV_BF16(p) load16((p), 0xffff)
#define LOADV_F32(p) _mm512_loadu_ps(p)
#else
#define ARGMAX_VECTOR_SCAN(LOADV)
#endif

static inline float f32_id(float x) { return x; }

KVMESH_ARGMAX(kvmesh_argmax_bf16, uint16_t, LOADV_BF16, bf2f)
KVMESH_ARGMAX(kvmesh_argmax_f32, float, LOADV_F32, f32_id)

/* y = x @ W^T in fp32 for a few rows of x, reading W in the block-quantized form it was
 * stored in (GGUF Q4_1 or Q8_0) and dequantizing each block on the fly.
 *
 * Why: a decode step multiplies a handful of rows by every weight, so its time is the
 * time to stream the weights from memory; 4.5 or 8.5 bits per weight stream 7x or 4x
 * faster than fp32. The dequantized value is computed exactly as gguf's reference does
 * (Q4_1: fp32(d) * q, rounded, + fp32(m), rounded; Q8_0: q * fp32(d), rounded), with the
 * rounding-mode intrinsics so that no compiler fuses the multiply and the add: W is
 * bit for bit the fp32 weight the model loaded, and only the order of the sums differs
 * from a BLAS GEMM. The caller checks that once per weight (kvmesh_dequant_rows_f32).
 *
 * Layout, per output row n and block b of 32 inputs: scale[n * nb + b] (fp32 of the
 * block's fp16 d), minv[...] (Q4_1's m; unused for Q8_0), qs[(n * nb + b) * QB] the
 * block's quants (Q4_1: 16 bytes, element j in the low nibble of byte j and element
 * j + 16 in its high nibble; Q8_0: 32 int8).
 */
#include <stdint.h>

#include "kvmesh_cpu.h"

#define QK 32
#define ROWS 16 /* rows of x handled per pass over W */

enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1 };

static inline int block_bytes(int kind) { return kind == KIND_Q4_1 ? 16 : 32; }

#ifdef KVMESH_HAVE_AVX512F
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* The block's 32 weights: lanes 0-15 in *lo, 16-31 in *hi. */
static inline void dequant_block(int kind, const uint8_t *q, float d, float m, __m512 *lo, __m512 *hi) {
    const __m512 vd = _mm512_set1_ps(d);
    if (kind == KIND_Q4_1) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        const __m512 fl = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0f)));
        const __m512 fh = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        const __m512 vm = _mm512_set1_ps(m);
        *lo = _mm512_add_round_ps(_mm512_mul_round_ps(vd, fl, RN), vm, RN);
        *hi = _mm512_add_round_ps(_mm512_mul_round_ps(vd, fh, RN), vm, RN);
    } else {
        const __m512 fl = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        const __m512 fh = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
        *lo = _mm512_mul_round_ps(fl, vd, RN);
        *hi = _mm512_mul_round_ps(fh, vd, RN);
    }
}

/* Rows [m0, m0 + mr) of x (mr <= R) against output row n, with R accumulators: one
 * version per R so that few rows do not pay for sixteen accumulators. */
#define ROW_DOT(R)                                                                                          \
    static void row_dot_##R(int kind, const float *x, int64_t xs, int m0, int mr, const float *scale,      \
                            const float *minv, const uint8_t *qs, int nb, float *y, int64_t ys, int n) {   \
        __m512 acc[R];                                                                                      \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                           \
        const int qb = block_bytes(kind);                                                                   \
        for (int b = 0; b < nb; b++) {                                                                      \
            __m512 lo, hi;                                                                                  \
            const int64_t i = (int64_t)n * nb + b;                                                          \
            dequant_block(kind, qs + i * qb, scale[i], kind == KIND_Q4_1 ? minv[i] : 0.f, &lo, &hi);        \
            for (int r = 0; r < mr; r++) {                                                                  \
                const float *xr = x + (int64_t)(m0 + r) * xs + b * QK;                                      \
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), lo, acc[r]);                                  \
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), hi, acc[r]);                             \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < mr; r++) y[(int64_t)(m0 + r) * ys + n] = _mm512_reduce_add_ps(acc[r]);        \
    }
ROW_DOT(4)
ROW_DOT(8)
ROW_DOT(16)
#endif

/* Returns 0 when done, -1 when this build cannot (no AVX512F) or K is not a multiple of 32. */
int kvmesh_qlinear_f32(const float *x, int64_t x_stride, const float *scale, const float *minv, const uint8_t *qs,
                       int kind, float *y, int64_t y_stride, int M, int N, int K, int num_threads) {
#ifdef KVMESH_HAVE_AVX512F
    if (K % QK != 0 || (kind != KIND_Q4_1 && kind != KIND_Q8_0)) return -1;
    const int nb = K / QK;
    for (int m0 = 0; m0 < M; m0 += ROWS) {
        const int mr = M - m0 < ROWS ? M - m0 : ROWS;
        void (*dot)(int, const float *, int64_t, int, int, const float *, const float *, const uint8_t *, int,
                    float *, int64_t, int) = mr <= 4 ? row_dot_4 : mr <= 8 ? row_dot_8 : row_dot_16;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int n = 0; n < N; n++) dot(kind, x, x_stride, m0, mr, scale, minv, qs, nb, y, y_stride, n);
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)scale; (void)minv; (void)qs; (void)kind; (void)y; (void)y_stride; (void)M;
    (void)N; (void)K; (void)num_threads;
    return -1;
#endif
}

/* W itself, [N, K] fp32, dequantized by the same code the product uses (so a caller can
 * check it against the weight it loaded). Returns 0, or -1 as kvmesh_qlinear_f32. */
int kvmesh_dequant_rows_f32(const float *scale, const float *minv, const uint8_t *qs, int kind, float *out, int N,
                            int K) {
#ifdef KVMESH_HAVE_AVX512F
    if (K % QK != 0 || (kind != KIND_Q4_1 && kind != KIND_Q8_0)) return -1;
    const int nb = K / QK, qb = block_bytes(kind);
    for (int64_t i = 0; i < (int64_t)N * nb; i++) {
        __m512 lo, hi;
        dequant_block(kind, qs + i * qb, scale[i], kind == KIND_Q4_1 ? minv[i] : 0.f, &lo, &hi);
        _mm512_storeu_ps(out + i * QK, lo);
        _mm512_storeu_ps(out + i * QK + 16, hi);
    }
    return 0;
#else
    (void)scale; (void)minv; (void)qs; (void)kind; (void)out; (void)N; (void)K;
    return -1;
#endif
}

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
#include <stdlib.h>
#include <omp.h>

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

/* ---- bf16 products on AMX tiles ----
 *
 * The model in bf16 holds W rounded to bf16 from the fp32 dequantized weight. Here each block is
 * dequantized as above and rounded to bf16 (to nearest even: the value torch's conversion gives
 * for every weight the caller checked with kvmesh_dequant_rows_bf16), then the tile unit
 * multiplies: C^T [16 outputs x 16 rows of x] += W [16 outputs x 32 inputs] . x^T [32 inputs x 16
 * rows] per block, accumulating in fp32. The dequantizing is paid once per weight whatever M is
 * (up to 64 rows: four accumulators), so a decode step streams 6 (Q4_1) or 9 (Q8_0) bits a weight
 * instead of 16. */
#if defined(KVMESH_HAVE_AVX512_BF16) && defined(KVMESH_HAVE_AMX)
#define QMAX_ROWS 64

/* 32 weights of a block as bf16 into dst (64 bytes). A Q4_1 block has 16 values, d * k + m for
 * k < 16: computed once (as dequant_block computes each) and looked up by the nibbles. */
static inline void dequant_block_bf16(int kind, const uint8_t *q, float d, float m, uint16_t *dst) {
    __m512 lo, hi;
    if (kind == KIND_Q4_1) {
        const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 table = _mm512_add_round_ps(_mm512_mul_round_ps(_mm512_set1_ps(d), k, RN), _mm512_set1_ps(m), RN);
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        lo = _mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0f)), table);
        hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    } else {
        dequant_block(kind, q, d, m, &lo, &hi);
    }
    _mm512_store_si512((__m512i *)dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* x^T for tile loads: for row chunk c and block b, 16 pairs of inputs x 16 rows, as 32-bit
 * (input 2p, input 2p + 1) pairs; rows past M are 0. */
static void pack_xt(const uint16_t *x, int64_t xs, int M, int nb, uint32_t *xt) {
    const int chunks = (M + 15) / 16;
    memset(xt, 0, sizeof(uint32_t) * 256 * (size_t)chunks * nb);
    for (int m = 0; m < M; m++) {
        const uint16_t *row = x + (int64_t)m * xs;
        uint32_t *dst = xt + (size_t)(m / 16) * nb * 256 + m % 16;
        for (int p = 0; p < nb * 16; p++) memcpy(dst + (p / 16) * 256 + (p % 16) * 16, row + 2 * p, 4);
    }
}

/* y[m][n0 .. n0 + 16) for the rows m of chunk c, from the accumulator tile stored in acc[16][16]
 * (output-major), rounded to bf16. */
static void store_outputs(const float *acc, int c, int M, uint16_t *y, int64_t ys, int n0) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512((const __m512i *)(acc + 16 * i));
    kvmesh_transpose16_epi32(r);
    for (int i = 0; i < 16 && c * 16 + i < M; i++)
        _mm256_storeu_si256((__m256i *)(y + (int64_t)(c * 16 + i) * ys + n0),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[i])));
}

typedef struct {
    int kind, nb, chunks, M;
    const float *scale, *minv;
    const uint8_t *qs;
    const uint32_t *xt;
    uint16_t *y;
    int64_t ys;
} qjob;

/* Rows [r0, r1) of the 16 from n0 into a tile buffer laid out [block][row][32 bf16], read in
 * memory order (the rows of a tile are contiguous). (Written row by row instead, with tile loads
 * at a stride of a row, a 48-block matrix ran 1.6x slower.) */
static inline void dequant_rows(const qjob *j, int n0, int r0, int r1, uint16_t *buf) {
    const int qb = block_bytes(j->kind);
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < j->nb; b++) {
            const int64_t i = (int64_t)(n0 + r) * j->nb + b;
            dequant_block_bf16(j->kind, j->qs + i * qb, j->scale[i], j->kind == KIND_Q4_1 ? j->minv[i] : 0.f,
                               buf + (size_t)b * 512 + 32 * r);
        }
}

/* Output tiles [t0, t1) (16 outputs each) for every row of x; tiles 0-3 the accumulators of row
 * chunks 0-3, 4 W, 5-7 x^T. A software pipeline: while tile t's blocks go through the tile unit,
 * the vector units dequantize tile t + 1's into the other buffer, so the two overlap, and a tile
 * load never reads data stored a moment before (it would wait for the stores to leave the core,
 * where a vector load would have them forwarded). */
static void qlinear_tiles(const qjob *j, int t0, int t1, uint16_t *bufs[2], float *acc) {
    const int nb = j->nb, chunks = j->chunks;
    const size_t chunk = (size_t)nb * 256;
    if (t0 < t1) dequant_rows(j, 16 * t0, 0, 16, bufs[0]);
    for (int t = t0; t < t1; t++) {
        const uint16_t *cur = bufs[(t - t0) & 1];
        uint16_t *next = bufs[(t - t0 + 1) & 1];
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int b = 0; b < nb; b++) {
            if (t + 1 < t1) dequant_rows(j, 16 * (t + 1), b * 16 / nb, (b + 1) * 16 / nb, next);
            const uint32_t *xb = j->xt + (size_t)b * 256;
            _tile_loadd(4, cur + (size_t)b * 512, 64);
            _tile_loadd(5, xb, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (chunks > 1) {
                _tile_loadd(6, xb + chunk, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (chunks > 2) {
                _tile_loadd(7, xb + 2 * chunk, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (chunks > 3) {
                _tile_loadd(5, xb + 3 * chunk, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, acc, 64);
        store_outputs(acc, 0, j->M, j->y, j->ys, 16 * t);
        if (chunks > 1) {
            _tile_stored(1, acc, 64);
            store_outputs(acc, 1, j->M, j->y, j->ys, 16 * t);
        }
        if (chunks > 2) {
            _tile_stored(2, acc, 64);
            store_outputs(acc, 2, j->M, j->y, j->ys, 16 * t);
        }
        if (chunks > 3) {
            _tile_stored(3, acc, 64);
            store_outputs(acc, 3, j->M, j->y, j->ys, 16 * t);
        }
    }
}
#endif

/* y = x @ W^T for bf16 x [M, K] (M <= 64) into bf16 y, on AMX tiles. Returns 0 when done, -1 (y
 * not to be used) without AMX-BF16 or its permission, where M, N % 16 or K % 32 do not fit, or
 * without memory. */
int kvmesh_qlinear_bf16_amx(const uint16_t *x, int64_t x_stride, const float *scale, const float *minv,
                            const uint8_t *qs, int kind, uint16_t *y, int64_t y_stride, int M, int N, int K,
                            int num_threads) {
#if defined(KVMESH_HAVE_AVX512_BF16) && defined(KVMESH_HAVE_AMX)
    if (M < 1 || M > QMAX_ROWS || N % 16 != 0 || K % QK != 0 || (kind != KIND_Q4_1 && kind != KIND_Q8_0)
        || !kvmesh_amx_permitted())
        return -1;
    const int nb = K / QK, chunks = (M + 15) / 16;
    uint32_t *xt = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * 256 * (size_t)chunks * nb);
    if (!xt) return -1;
    pack_xt(x, x_stride, M, nb, xt);
    const qjob job = {kind, nb, chunks, M, scale, minv, qs, xt, y, y_stride};
    const int tiles = N / 16;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* A contiguous run of output tiles per thread, for the pipeline across them. */
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int t0 = (int)((int64_t)tiles * id / nt), t1 = (int)((int64_t)tiles * (id + 1) / nt);
        uint16_t *bufs[2] = {(uint16_t *)aligned_alloc(64, 1024 * (size_t)nb),
                             (uint16_t *)aligned_alloc(64, 1024 * (size_t)nb)};
        float *acc = (float *)aligned_alloc(64, 1024);
        if (bufs[0] && bufs[1] && acc) {
            kvmesh_tile_config before;
            kvmesh_amx_begin(&before);
            qlinear_tiles(&job, t0, t1, bufs, acc);
            kvmesh_amx_end(&before);
        } else {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        }
        free(bufs[0]);
        free(bufs[1]);
        free(acc);
    }
    free(xt);
    return failed ? -1 : 0;
#else
    (void)x; (void)x_stride; (void)scale; (void)minv; (void)qs; (void)kind; (void)y; (void)y_stride; (void)M;
    (void)N; (void)K; (void)num_threads;
    return -1;
#endif
}

/* W rounded to bf16, [N, K], by the code kvmesh_qlinear_bf16_amx uses (so a caller can check it
 * against the bf16 weight it loaded). Returns 0, or -1 where kvmesh_qlinear_bf16_amx cannot run
 * (no AMX-BF16 in this build) or for a K or kind it refuses. */
int kvmesh_dequant_rows_bf16(const float *scale, const float *minv, const uint8_t *qs, int kind, uint16_t *out,
                             int N, int K) {
#if defined(KVMESH_HAVE_AVX512_BF16) && defined(KVMESH_HAVE_AMX)
    if (K % QK != 0 || (kind != KIND_Q4_1 && kind != KIND_Q8_0)) return -1;
    const int nb = K / QK, qb = block_bytes(kind);
    uint16_t *tmp = (uint16_t *)aligned_alloc(64, 64);
    if (!tmp) return -1;
    for (int64_t i = 0; i < (int64_t)N * nb; i++) {
        dequant_block_bf16(kind, qs + i * qb, scale[i], kind == KIND_Q4_1 ? minv[i] : 0.f, tmp);
        memcpy(out + i * QK, tmp, 64);
    }
    free(tmp);
    return 0;
#else
    (void)scale; (void)minv; (void)qs; (void)kind; (void)out; (void)N; (void)K;
    return -1;
#endif
}

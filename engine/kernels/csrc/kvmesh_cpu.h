/* Helpers shared by the native CPU kernels: bf16 <-> fp32 conversion with torch's
 * rounding (to nearest even, NaN preserved); where the compiler targets AVX512F, a
 * vectorized exp and a 16-way horizontal sum, and with AVX512-BF16 16-lane versions of
 * the conversions. */
#ifndef KVMESH_CPU_H
#define KVMESH_CPU_H

#include <stdint.h>
#include <string.h>

static inline float bf2f(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void kvmesh_rope_write_kv_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                               const uint16_t *v, int64_t v_stride, const int64_t *positions,
                               const float *cos_sin, const int64_t *slots, uint16_t *k_cache,
                               uint16_t *v_cache, int64_t cb, int64_t cs, int64_t ch, int block_size,
                               uint16_t *q_out, uint16_t *k_out, int64_t T, int Hq, int Hkv, int D,
                               int num_threads);
void kvmesh_decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                  const int32_t *block_tables, int64_t bt_stride,
                                  const int32_t *seq_lens, uint16_t *out, int B, int Hq, int Hkv,
                                  int D, int block_size, int64_t sb, int64_t ss, int64_t sh,
                                  float scale, int num_threads, int group_prefixes);
/* The AMX-BF16 decode kernel (cpu_decode_amx.c): 0 when it ran, -1 when it does not apply here
 * (no AMX, another shape, no permission for the tile registers), nothing written then. */
int kvmesh_decode_attention_bf16_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                     uint16_t *out, int B, int Hq, int Hkv, int D, int block_size, int64_t sb,
                                     int64_t ss, int64_t sh, float scale, int num_threads, int group_prefixes);

/* Round an fp32 value to bf16 and back: the value a torch bf16 op would hold. */
static inline float round_bf(float f) { return bf2f(f2bf(f)); }

#if defined(__AVX512F__)
#include <immintrin.h>
#define KVMESH_HAVE_AVX512F 1

/* The order to run a batch's sequences in, grouped by first KV block (cpu_decode_attention.c);
 * malloc'd, or NULL (batch order) for fewer than 2 or too many sequences, or without memory. */
int *kvmesh_prefix_grouped_order(const int32_t *block_tables, int64_t bt_stride, int B);

/* Lanes [0, n) of 16, n <= 16. */
static inline __mmask16 mask16(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* exp(x): 2^(x log2 e) with a degree-6 polynomial on the reduced argument (relative
 * error ~2e-7); 0 below -87.3 (so exp(-inf) = 0), +inf above ~88.7 as expf. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    __m512 c = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(100.f));
    __m512 t = _mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f));
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
static inline __m512 kvmesh_hsum16(__m512 *v) {
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
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVMESH_HAVE_AVX512_BF16 1

static inline __m512 load16(const uint16_t *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store16(uint16_t *p, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
}

/* bf16-rounded value of x, kept in fp32 lanes. */
static inline __m512 round16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
#endif /* AVX512-BF16 */
/* Transposes 16 vectors of 16 32-bit lanes in place: r[c] lane i <- r[i] lane c. */
static inline void kvmesh_transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int a = 0; a < 4; a++) { /* u[4a + j], 128-bit lane k: rows 4a..4a+3 at column 4k + j */
        u[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i v = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), w = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
        __m512i x = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        __m512i y = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
        r[j] = _mm512_shuffle_i32x4(v, x, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(v, x, 0xdd);
        r[4 + j] = _mm512_shuffle_i32x4(w, y, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(w, y, 0xdd);
    }
}
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVMESH_HAVE_AMX 1

/* The tile unit's configuration (palette 1), as _tile_loadconfig / _tile_storeconfig read it. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kvmesh_tile_config;

/* Linux hands out the tile registers' state only to a process that asked for it (cpu_amx.c);
 * 1 once granted, 0 where refused. */
int kvmesh_amx_permitted(void);
/* Saves this thread's tile configuration in *saved and makes every tile 16 rows of 64 bytes;
 * kvmesh_amx_end restores it (another user, oneDNN's matmuls in torch, may skip reconfiguring
 * a thread it configured last) or releases the tiles if there was none. */
void kvmesh_amx_begin(kvmesh_tile_config *saved);
void kvmesh_amx_end(const kvmesh_tile_config *saved);
#endif /* AMX */
#endif /* AVX512F */

#endif

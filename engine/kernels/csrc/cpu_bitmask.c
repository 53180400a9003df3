/* Token bitmasks applied to logits rows in place (structured outputs).
 *
 * A mask row is ceil(cols / 32) int32 words as llguidance fills them: bit b of word w set means
 * token 32 * w + b is allowed. Every disallowed token's logit becomes -inf; allowed logits are
 * left untouched, so the result equals torch's masked_fill(~allowed, -inf) bit for bit. Logits
 * row rows[i] takes mask row i. Words are checked whole first: an all-ones word (most of a
 * free-text state) costs one compare, an all-zero word (most of a structural state) one run of
 * stores, so the cost does not depend on how the allowed tokens are scattered.
 */
#include <stdint.h>

#define KVMESH_APPLY_BITMASK(NAME, T, NEG_INF)                                                   \
    void NAME(T *logits, int64_t stride, const int32_t *mask, int64_t mask_stride,               \
              const int64_t *rows, int64_t n, int64_t cols) {                                    \
        int64_t words = (cols + 31) / 32;                                                        \
        for (int64_t i = 0; i < n; i++) {                                                        \
            T *row = logits + rows[i] * stride;                                                  \
            const uint32_t *m = (const uint32_t *)(mask + i * mask_stride);                      \
            for (int64_t w = 0; w < words; w++) {                                                \
                uint32_t word = m[w];                                                            \
                if (word == 0xffffffffu) continue;                                               \
                int64_t base = w * 32, end = cols - base < 32 ? cols - base : 32;                \
                T *x = row + base;                                                               \
                if (word == 0) {                                                                 \
                    for (int64_t b = 0; b < end; b++) x[b] = (NEG_INF);                          \
                } else {                                                                         \
                    for (int64_t b = 0; b < end; b++)                                            \
                        if (!((word >> b) & 1u)) x[b] = (NEG_INF);                               \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }

KVMESH_APPLY_BITMASK(kvmesh_apply_bitmask_bf16, uint16_t, (uint16_t)0xff80u)
KVMESH_APPLY_BITMASK(kvmesh_apply_bitmask_u32, uint32_t, 0xff800000u) /* fp32 rows, as bits */

/* bf16 paged prefill (extend) attention on AMX tiles, for CPUs with AMX-BF16.
 *
 * The AVX-512 kernel (cpu_extend_attention.c) computes a query token's scores and its weighted sum
 * of V with dot-product instructions, 16 keys at a time; here the tile unit does both for 16 query
 * rows at once (amx_attention.h). One work item is 16 / G consecutive new tokens of a sequence and
 * one kv head: its R = n * G rows (token-major, the G query heads of the kv head beside each
 * other) read each chunk of K and V once. Token t of the item, at position p, sees keys 0..p: one
 * segment of keys [0, last position], each row's scores past its own position masked to -inf.
 * Unlike the AVX-512 kernel, the softmax is not online: the item's scores are kept (16 floats per
 * key) and exponentiated once against each row's maximum.
 *
 * Requires block_size % 16 == 0, D in {64, 128} and G <= 16. Returns -1 (nothing written) where
 * that, the tile permission or memory does not hold, and -2 for inconsistent lengths (0 <= q_len
 * <= ctx <= max_blocks * block_size must hold); the caller then runs another kernel.
 */
#include <stdint.h>
#include <stdlib.h>

#include "amx_attention.h"
#include "kvmesh_cpu.h"

#if defined(KVMESH_HAVE_AVX512_BF16) && defined(KVMESH_HAVE_AMX)
/* New tokens [t0, t0 + nt) of a sequence whose first new token sits at position p0 (its q and out
 * rows from q0), kv head c->h. */
static void extend_item_amx(const cache_view *c, const uint16_t *q, const int32_t *bt, int q0, int p0, int t0,
                            int nt, int Hq, uint16_t *out, scratch *sc) {
    const int G = c->G, R = nt * G;
    const uint16_t *qrow[16];
    uint16_t *orow[16];
    int32_t last[16];
    for (int r = 0; r < 16; r++) last[r] = -1;
    for (int r = 0; r < R; r++) {
        const int tok = r / G;
        const int64_t row = ((int64_t)(q0 + t0 + tok) * Hq + (int64_t)c->h * G + r % G) * c->D;
        qrow[r] = q + row;
        orow[r] = out + row;
        last[r] = p0 + t0 + tok;
    }
    const int end = p0 + t0 + nt; /* keys [0, end) */
    sc->sg[0] = (segment){bt, 0, end, mask16(R), 0};
    attend_rows(c, qrow, orow, R, 1, ((int64_t)end + 31) / 32 * 32, _mm512_loadu_si512(last), sc);
}
#endif

int kvmesh_extend_attention_bf16_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                     const int32_t *block_tables, int64_t bt_stride, int max_blocks,
                                     const int32_t *query_start_loc, const int32_t *seq_lens, uint16_t *out, int S,
                                     int Hq, int Hkv, int D, int block_size, int64_t sb, int64_t ss, int64_t sh,
                                     float scale, int num_threads) {
#if defined(KVMESH_HAVE_AVX512_BF16) && defined(KVMESH_HAVE_AMX)
    const int G = Hkv > 0 ? Hq / Hkv : 0;
    if (S < 1 || G < 1 || G > 16 || Hq != G * Hkv || (D != 64 && D != 128) || block_size % 16 != 0
        || !kvmesh_amx_permitted())
        return -1;
    const int per = 16 / G; /* new tokens per item */
    /* Items: (sequence, tile of `per` tokens, kv head), numbered through a prefix sum of tiles. */
    int64_t *tile_start = (int64_t *)malloc(sizeof(int64_t) * ((size_t)S + 1));
    if (!tile_start) return -1;
    int64_t max_pos = 32;
    tile_start[0] = 0;
    for (int s = 0; s < S; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len < 0 || q_len > seq_lens[s] || seq_lens[s] > (int64_t)max_blocks * block_size) {
            free(tile_start);
            return -2;
        }
        tile_start[s + 1] = tile_start[s] + (q_len + per - 1) / per;
        const int64_t pos = ((int64_t)seq_lens[s] + 31) / 32 * 32;
        max_pos = pos > max_pos ? pos : max_pos;
    }
    const int64_t items = tile_start[S] * Hkv;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        kvmesh_tile_config before;
        scratch *sc = amx_thread_begin(max_pos, &before, &failed);
        /* One kv head's items one after another, so its keys and values stay in cache between
         * them; within a head, later tiles (more keys) first. A thread without scratch skips its
         * items and the caller reruns the whole call on another kernel. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!sc) continue;
            const int64_t tile = tile_start[S] - 1 - it % tile_start[S];
            int lo = 0, hi = S; /* the sequence whose tiles contain `tile` */
            while (hi - lo > 1) {
                const int mid = (lo + hi) / 2;
                if (tile_start[mid] <= tile) lo = mid; else hi = mid;
            }
            const int q0 = query_start_loc[lo], q_len = query_start_loc[lo + 1] - q0;
            const int t0 = (int)(tile - tile_start[lo]) * per;
            const int nt = q_len - t0 < per ? q_len - t0 : per;
            cache_view c = {k, v, sb, ss, sh, block_size, D, G, (int)(it / tile_start[S]), scale};
            extend_item_amx(&c, q, block_tables + (int64_t)lo * bt_stride, q0, seq_lens[lo] - q_len, t0, nt, Hq, out,
                            sc);
        }
        amx_thread_end(sc, &before);
    }
    free(tile_start);
    return failed ? -1 : 0;
#else
    (void)q, (void)k, (void)v, (void)block_tables, (void)bt_stride, (void)max_blocks, (void)query_start_loc;
    (void)seq_lens, (void)out, (void)S, (void)Hq, (void)Hkv, (void)D, (void)block_size, (void)sb, (void)ss, (void)sh;
    (void)scale, (void)num_threads;
    return -1;
#endif
}

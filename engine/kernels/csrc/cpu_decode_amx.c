/* bf16 paged decode attention on AMX tiles, for CPUs with AMX-BF16 (Sapphire Rapids and later).
 *
 * The AVX-512 kernel (cpu_decode_attention.c) is bound by instruction count once a shared prefix
 * sits in cache: each of a token's query rows costs two dot products and a share of a horizontal
 * sum. Here one work item is a subgroup of up to 16 / G sequences that start in the same KV block
 * (a system prompt) and one kv head; its R = n * G query rows go through the matrix unit together
 * (amx_attention.h). The tokens of the common prefix [0, Ps) (Ps a multiple of 32 that every
 * member holds in the same blocks) are one segment for all R rows, read once; each member's
 * remaining tokens are a segment of its own. A row's result does not depend on the rows beside
 * it, so grouping changes no bit of any result.
 *
 * Requires block_size % 16 == 0 (a chunk of 16 tokens lies in one block), D in {64, 128} and
 * G <= 16. Returns -1 (nothing written) where that or the kernel's permission to use the tile
 * registers does not hold; the caller then runs the AVX-512 kernel.
 */
#include <stdint.h>
#include <stdlib.h>

#include "amx_attention.h"
#include "kvmesh_cpu.h"

#if defined(KVMESH_HAVE_AVX512_BF16) && defined(KVMESH_HAVE_AMX)
/* One subgroup (n sequences order[0..n)) and kv head h: rows s * G + g. The tokens of the common
 * prefix [0, shared) are one segment for all rows; each member's remaining tokens are a segment of
 * its own, whose other rows carry the weight 0. */
static void decode_item_amx(const cache_view *c, const uint16_t *q, const int32_t *block_tables, int64_t bt_stride,
                            const int32_t *seq_lens, const int *members, int n, int shared, int Hq, uint16_t *out,
                            scratch *sc) {
    const int G = c->G, D = c->D, R = n * G;
    const uint16_t *qrow[16];
    uint16_t *orow[16];
    for (int r = 0; r < R; r++) {
        const int64_t row = ((int64_t)members[r / G] * Hq + (int64_t)c->h * G + r % G) * D;
        qrow[r] = q + row;
        orow[r] = out + row;
    }
    int nseg = 0;
    int64_t npos = 0;
    if (shared > 0) {
        sc->sg[nseg++] = (segment){block_tables + (int64_t)members[0] * bt_stride, 0, shared, mask16(R), 0};
        npos = shared;
    }
    for (int s = 0; s < n; s++) {
        const int L = seq_lens[members[s]];
        if (L <= shared) continue;
        sc->sg[nseg++] = (segment){block_tables + (int64_t)members[s] * bt_stride, shared, L,
                                   (__mmask16)(mask16(G) << (s * G)), npos};
        npos += ((int64_t)(L - shared) + 31) / 32 * 32;
    }
    attend_rows(c, qrow, orow, R, nseg, npos, _mm512_set1_epi32(INT32_MAX), sc);
}

/* The tokens a subgroup's members hold in the same blocks, within every member's length, rounded
 * down to a multiple of 32 (a block of weights for the tile unit); 0 for a single member. */
static int common_prefix(const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, const int *members,
                         int n, int block_size) {
    if (n < 2) return 0;
    int min_len = seq_lens[members[0]];
    for (int m = 1; m < n; m++) min_len = seq_lens[members[m]] < min_len ? seq_lens[members[m]] : min_len;
    const int32_t *bt0 = block_tables + (int64_t)members[0] * bt_stride;
    const int nb = (min_len + block_size - 1) / block_size;
    int eq = 0;
    for (; eq < nb; eq++) {
        int m = 1;
        while (m < n && block_tables[(int64_t)members[m] * bt_stride + eq] == bt0[eq]) m++;
        if (m < n) break;
    }
    const int common = eq * block_size < min_len ? eq * block_size : min_len;
    return common / 32 * 32;
}

int kvmesh_decode_attention_bf16_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                     uint16_t *out, int B, int Hq, int Hkv, int D, int block_size, int64_t sb,
                                     int64_t ss, int64_t sh, float scale, int num_threads, int group_prefixes) {
    const int G = Hkv > 0 ? Hq / Hkv : 0;
    if (B < 1 || G < 1 || G > 16 || Hq != G * Hkv || (D != 64 && D != 128) || block_size % 16 != 0
        || !kvmesh_amx_permitted())
        return -1;
    for (int b = 0; b < B; b++)
        if (seq_lens[b] < 0) return -1;
    /* Subgroups: sequences in prefix-grouped order, cut where the first block changes and every
     * 16 / G members; each member alone without group_prefixes. */
    const int per = group_prefixes ? 16 / G : 1;
    int *grouped = per > 1 ? kvmesh_prefix_grouped_order(block_tables, bt_stride, B) : NULL;
    int *order = grouped ? grouped : (int *)malloc(sizeof(int) * (size_t)B);
    int *start = (int *)malloc(sizeof(int) * ((size_t)B + 1)), *shared = (int *)malloc(sizeof(int) * (size_t)B);
    if (!order || !start || !shared) {
        free(order), free(start), free(shared);
        return -1;
    }
    if (!grouped)
        for (int b = 0; b < B; b++) order[b] = b;
    int ngroups = 0;
    int64_t max_pos = 32;
    for (int i = 0; i < B;) {
        const int32_t first = block_tables[(int64_t)order[i] * bt_stride];
        int j = i + 1;
        while (j < B && j - i < per && block_tables[(int64_t)order[j] * bt_stride] == first) j++;
        const int common = common_prefix(block_tables, bt_stride, seq_lens, order + i, j - i, block_size);
        int64_t npos = common;
        for (int m = i; m < j; m++) npos += ((int64_t)(seq_lens[order[m]] - common) + 31) / 32 * 32;
        max_pos = npos > max_pos ? npos : max_pos;
        start[ngroups] = i;
        shared[ngroups++] = common;
        i = j;
    }
    start[ngroups] = B;
    const int64_t items = (int64_t)ngroups * Hkv;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        kvmesh_tile_config before; /* the thread's configuration, restored after */
        scratch *sc = amx_thread_begin(max_pos, &before, &failed);
        /* Every thread meets the loop (a work-sharing construct); one without scratch skips its
         * items, and the caller then reruns the whole batch on the AVX-512 kernel. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!sc) continue;
            const int gi = (int)(it / Hkv);
            cache_view c = {k, v, sb, ss, sh, block_size, D, G, (int)(it % Hkv), scale};
            decode_item_amx(&c, q, block_tables, bt_stride, seq_lens, order + start[gi], start[gi + 1] - start[gi],
                            shared[gi], Hq, out, sc);
        }
        amx_thread_end(sc, &before);
    }
    free(order), free(start), free(shared);
    return failed ? -1 : 0;
}

#else

int kvmesh_decode_attention_bf16_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                     uint16_t *out, int B, int Hq, int Hkv, int D, int block_size, int64_t sb,
                                     int64_t ss, int64_t sh, float scale, int num_threads, int group_prefixes) {
    (void)q, (void)k, (void)v, (void)block_tables, (void)bt_stride, (void)seq_lens, (void)out, (void)B, (void)Hq;
    (void)Hkv, (void)D, (void)block_size, (void)sb, (void)ss, (void)sh, (void)scale, (void)num_threads;
    (void)group_prefixes;
    return -1;
}

#endif

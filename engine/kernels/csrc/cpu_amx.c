/* What the AMX kernels (cpu_decode_amx.c, cpu_qlinear.c) share: the permission to use the tile
 * registers and the one tile shape they use. */
#include "kvmesh_cpu.h"

#ifdef KVMESH_HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int kvmesh_amx_permitted(void) {
    static int state; /* 0 unknown, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

/* GCC's _tile_loadconfig / _tile_storeconfig tell the compiler they touch 8 bytes of the 64; the
 * empty asm with a memory clobber keeps the stores of the other 56 (found dropped at -O3). */
#define TILE_CONFIG_BARRIER(p) __asm__ __volatile__("" : : "r"(p) : "memory")

void kvmesh_amx_begin(kvmesh_tile_config *saved) {
    _tile_storeconfig(saved);
    TILE_CONFIG_BARRIER(saved);
    kvmesh_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    TILE_CONFIG_BARRIER(&c);
    _tile_loadconfig(&c);
}

void kvmesh_amx_end(const kvmesh_tile_config *saved) {
    TILE_CONFIG_BARRIER(saved);
    if (saved->palette != 0)
        _tile_loadconfig(saved);
    else
        _tile_release();
}
#endif

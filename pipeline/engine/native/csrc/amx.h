/* The AMX tiles for the engine's C kernels (int8_linear_cpu.c, mha_prefill_cpu.c, bf16_gemm.h): Linux hands
 * a process the tile data only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA), asked once here; and
 * the tile configuration those kernels use, every tile 16 rows x 64 bytes (palette 1; bf16_gemm.h's short
 * row blocks shorten some). The configuration is per thread and other code on the thread (oneDNN) may
 * change it, so a kernel loads it on every call and releases the tiles at its end. Include only where __AMX_TILE__ is defined (built for such a CPU). */
#ifndef DSQUANT_AMX_H
#define DSQUANT_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static volatile int amx_state;    /* 0: not asked yet, 1: granted, -1: refused */

static inline int amx_usable(void) {
    if (amx_state == 0) amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return amx_state > 0;
}

/* Tiles 0 .. short_tiles-1 ``rows`` rows, the others 16; every tile 64 bytes wide (a short row block runs
 * short tiles: their work follows their rows). */
static inline void amx_load_config_rows(int rows, int short_tiles) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = (uint8_t)(t < short_tiles ? rows : 16); cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

static inline void amx_load_config(void) { amx_load_config_rows(16, 0); }

#endif

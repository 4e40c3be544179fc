/*
 * fileio.h -- what the engine's own file formats share: little-endian fields,
 * and replacing a file atomically (write a temporary beside it, fsync,
 * rename), so a crash never leaves a half-written state or hotlist behind.
 */
#ifndef WASTE_FILEIO_H
#define WASTE_FILEIO_H

#include <stdint.h>
#include <stdio.h>

#include "waste.h"

static inline uint32_t wle32_get(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void wle32_put(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Open a new temporary file beside path (its name goes to tmp, tmpcap bytes).
 * NULL on failure, with the reason in err. */
FILE *wfile_begin(const char *path, char *tmp, size_t tmpcap, char *err, size_t errcap);

/* Finish what wfile_begin started: when ok, flush, fsync, close and rename tmp
 * over path; otherwise, or when any of that fails, close and remove tmp.
 * WASTE_E_IO names path and the reason. */
waste_status wfile_commit(FILE *f, const char *tmp, const char *path, int ok, char *err,
                          size_t errcap);

#endif

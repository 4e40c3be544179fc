/*
 * bank.h -- one MoE layer's expert bank (experts/layer-LLL.bank): header
 * validation and whole-record reads, page-aligned so O_DIRECT can work.
 */
#ifndef WASTE_BANK_H
#define WASTE_BANK_H

#include <stddef.h>
#include <stdint.h>
#include "manifest.h"

typedef struct {
    int fd;
    int direct;      /* 1 while reads bypass the page cache */
    uint32_t layer;  /* model layer index */
    uint32_t n_experts;
    uint64_t stride;
    uint64_t payload_bytes;
    char path[4096];
} wbank;

/* Check <dir>/experts/layer-LLL.bank's header and size against the
 * manifest without reading any record.  Missing: WASTE_E_IO; any mismatch:
 * WASTE_E_FORMAT. */
waste_status wbank_check(const char *dir, const wmanifest *m, uint32_t layer, char *err,
                         size_t errcap);

/* wbank_check, then keep the file open for record reads; want_direct asks
 * for O_DIRECT (silently falling back to buffered reads when refused). */
waste_status wbank_open(wbank *b, const char *dir, const wmanifest *m, uint32_t layer,
                        int want_direct, char *err, size_t errcap);

void wbank_close(wbank *b);

/* Read record `expert` whole into buf (stride bytes, 4096-aligned) and check
 * its header; verify also checks the payload's crc32.  Any failure is
 * WASTE_E_IO with the layer and expert in err. */
waste_status wbank_read(wbank *b, uint32_t expert, uint8_t *buf, int verify, char *err,
                        size_t errcap);

#endif

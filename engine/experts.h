/*
 * experts.h -- where the forward pass gets expert weights: the expert cache
 * in front of the banks, with hit/miss/byte accounting and the usage counts
 * behind the hotlist.
 */
#ifndef WASTE_EXPERTS_H
#define WASTE_EXPERTS_H

#include <stddef.h>
#include <stdint.h>
#include "bank.h"
#include "cache.h"
#include "manifest.h"

typedef struct {
    uint64_t hits, misses, bytes_read;
    double ms_io;
} wexpert_counters;

typedef struct {
    const wmanifest *m;
    wbank *banks;            /* one per MoE layer */
    uint32_t n_banks;
    wcache cache;
    uint64_t *usage;         /* routing counts per key (layer-major) */
    int verify;
    wexpert_counters token;  /* since the caller last cleared it */
    wexpert_counters total;  /* since open */
} wexperts;

/* Open every bank and make a cache of `capacity` records. */
waste_status wexperts_open(wexperts *x, const char *dir, const wmanifest *m, uint32_t capacity,
                           int policy, int direct_io, int verify, char *err, size_t errcap);
void wexperts_close(wexperts *x);

/* 1 when every bank reads with O_DIRECT. */
int wexperts_direct_io(const wexperts *x);

/* The payload of expert e of model layer `layer`, valid until the next
 * call.  One fetch counts one hit or one miss, however many tokens it
 * serves; `uses` (the tokens routed to it) goes to the routing counts behind
 * the hotlist. */
waste_status wexperts_get(wexperts *x, uint32_t layer, uint32_t expert, uint32_t uses,
                          const uint8_t **payload, char *err, size_t errcap);

/* Load the hotlist at path (ignored when unusable) and pre-load the most
 * used experts until the cache is full.  Records that fail to read are
 * skipped: they will fail again, loudly, when a token needs them. */
void wexperts_warm(wexperts *x, const char *usage_path);

waste_status wexperts_save_usage(const wexperts *x, const char *usage_path, char *err, size_t errcap);

#endif

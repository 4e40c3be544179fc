/*
 * usage.h -- the learned hotlist (usage.waste): how often each (MoE layer,
 * expert) was routed to, kept across runs so a new process can warm its
 * expert cache with the experts it will most likely need.
 *
 * File (little-endian): "WUSG", u32 version = 1, u32 n_layers,
 * u32 n_dense_layers, u32 n_experts, u64 counts[moe_layers * n_experts],
 * u32 crc32 of the counts.
 */
#ifndef WASTE_USAGE_H
#define WASTE_USAGE_H

#include <stddef.h>
#include <stdint.h>
#include "manifest.h"

/* Fill counts (moe_layers * n_experts) from path.  Returns 0 and leaves
 * counts untouched when the file is missing, damaged or for another shape:
 * a hotlist is only ever a hint. */
int wusage_load(const char *path, const wmanifest *m, uint64_t *counts);

/* Write counts to path atomically (temp file + rename). */
waste_status wusage_save(const char *path, const wmanifest *m, const uint64_t *counts, char *err,
                         size_t errcap);

/* The n_keys keys ordered from most to least used (ties: lower key);
 * 0 when out of memory. */
int wusage_rank(const uint64_t *counts, uint32_t n_keys, uint32_t *order);

#endif

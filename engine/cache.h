/*
 * cache.h -- the expert cache: `capacity` page-aligned slots of one bank
 * record each, keyed by (MoE layer, expert) flattened to one index.
 *
 * Policies:
 *   LRU  evicts the slot used longest ago.
 *   LFRU evicts the slot with the lowest use count, the least recently used
 *        of those on a tie.  Every capacity*16 lookups all counts are halved,
 *        so experts that were popular long ago lose their hold and a shift
 *        in what the conversation needs is followed within a few hundred
 *        tokens; warm-started slots begin with their (clamped) hotlist count.
 */
#ifndef WASTE_CACHE_H
#define WASTE_CACHE_H

#include <stddef.h>
#include <stdint.h>
#include "waste.h"

typedef struct {
    int32_t key;   /* -1 = empty */
    uint32_t uses; /* LFRU frequency */
    uint64_t last; /* tick of the last use */
} wcache_slot;

typedef struct {
    uint32_t capacity, n_keys;
    uint64_t stride;
    int policy;         /* waste_cache_policy */
    uint8_t *slab;      /* capacity * stride bytes, 4096-aligned */
    wcache_slot *slots;
    int32_t *slot_of;   /* per key: its slot or -1 */
    uint64_t tick;
} wcache;

waste_status wcache_init(wcache *c, uint32_t n_keys, uint32_t capacity, uint64_t stride, int policy);
void wcache_free(wcache *c);

/* The buffer holding key, counted as a use; NULL when not cached. */
uint8_t *wcache_lookup(wcache *c, uint32_t key);

/* A slot for key (the policy's victim when full), for the caller to fill.
 * uses seeds its LFRU count.  If filling fails, wcache_forget(key). */
uint8_t *wcache_claim(wcache *c, uint32_t key, uint32_t uses);
void wcache_forget(wcache *c, uint32_t key);

#endif

#include "cache.h"

#include <stdlib.h>
#include <string.h>

#define LFRU_MAX_USES 0xFFFFu

waste_status wcache_init(wcache *c, uint32_t n_keys, uint32_t capacity, uint64_t stride, int policy) {
    memset(c, 0, sizeof *c);
    c->capacity = capacity;
    c->n_keys = n_keys;
    c->stride = stride;
    c->policy = policy;
    void *slab = NULL;
    if (posix_memalign(&slab, 4096, (size_t)(capacity * stride)) != 0) return WASTE_E_OOM;
    c->slab = slab;
    c->slots = malloc(capacity * sizeof *c->slots);
    c->slot_of = malloc(n_keys * sizeof *c->slot_of);
    if (!c->slots || !c->slot_of) {
        wcache_free(c);
        return WASTE_E_OOM;
    }
    for (uint32_t i = 0; i < capacity; i++) c->slots[i] = (wcache_slot){.key = -1};
    for (uint32_t k = 0; k < n_keys; k++) c->slot_of[k] = -1;
    return WASTE_OK;
}

void wcache_free(wcache *c) {
    free(c->slab);
    free(c->slots);
    free(c->slot_of);
    memset(c, 0, sizeof *c);
}

static uint8_t *slot_buffer(const wcache *c, int32_t slot) { return c->slab + (size_t)slot * c->stride; }

static void age_counts(wcache *c) {
    for (uint32_t i = 0; i < c->capacity; i++) c->slots[i].uses /= 2;
}

static void touch(wcache *c, wcache_slot *s) {
    s->last = ++c->tick;
    if (s->uses < LFRU_MAX_USES) s->uses++;
    if (c->policy == WASTE_CACHE_LFRU && c->tick % ((uint64_t)c->capacity * 16) == 0) age_counts(c);
}

uint8_t *wcache_lookup(wcache *c, uint32_t key) {
    int32_t slot = c->slot_of[key];
    if (slot < 0) return NULL;
    touch(c, &c->slots[slot]);
    return slot_buffer(c, slot);
}

/* An empty slot if any, else the policy's victim. */
static int32_t victim(const wcache *c) {
    int32_t best = 0;
    for (uint32_t i = 0; i < c->capacity; i++) {
        const wcache_slot *s = &c->slots[i], *b = &c->slots[best];
        if (s->key < 0) return (int32_t)i;
        int less_used = c->policy == WASTE_CACHE_LFRU && s->uses != b->uses;
        if (less_used ? s->uses < b->uses : s->last < b->last) best = (int32_t)i;
    }
    return best;
}

uint8_t *wcache_claim(wcache *c, uint32_t key, uint32_t uses) {
    int32_t slot = victim(c);
    wcache_slot *s = &c->slots[slot];
    if (s->key >= 0) c->slot_of[s->key] = -1;
    s->key = (int32_t)key;
    s->uses = uses > LFRU_MAX_USES ? LFRU_MAX_USES : uses;
    s->last = ++c->tick;
    c->slot_of[key] = slot;
    return slot_buffer(c, slot);
}

void wcache_forget(wcache *c, uint32_t key) {
    int32_t slot = c->slot_of[key];
    if (slot < 0) return;
    c->slots[slot] = (wcache_slot){.key = -1};
    c->slot_of[key] = -1;
}

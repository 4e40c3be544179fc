#include "experts.h"

#include <stdlib.h>
#include <string.h>

#include "detail.h"
#include "sys.h"
#include "usage.h"

waste_status wexperts_open(wexperts *x, const char *dir, const wmanifest *m, uint32_t capacity,
                           int policy, int direct_io, int verify, char *err, size_t errcap) {
    memset(x, 0, sizeof *x);
    x->m = m;
    x->verify = verify;
    uint32_t n_keys = wmanifest_moe_layers(m) * m->n_experts;
    x->banks = calloc(wmanifest_moe_layers(m), sizeof *x->banks);
    x->usage = calloc(n_keys, sizeof *x->usage);
    if (!x->banks || !x->usage) {
        wexperts_close(x);
        return wdetail(err, errcap, WASTE_E_OOM, "out of memory for expert bookkeeping");
    }
    for (uint32_t i = 0; i < wmanifest_moe_layers(m); i++) {
        waste_status st = wbank_open(&x->banks[i], dir, m, m->n_dense_layers + i, direct_io, err, errcap);
        if (st != WASTE_OK) {
            wexperts_close(x);
            return st;
        }
        x->n_banks++;
    }
    if (wcache_init(&x->cache, n_keys, capacity, wmanifest_record_stride(m), policy) != WASTE_OK) {
        wexperts_close(x);
        return wdetail(err, errcap, WASTE_E_OOM, "out of memory for an expert cache of %u records",
                       capacity);
    }
    return WASTE_OK;
}

void wexperts_close(wexperts *x) {
    for (uint32_t i = 0; i < x->n_banks; i++) wbank_close(&x->banks[i]);
    free(x->banks);
    free(x->usage);
    wcache_free(&x->cache);
    memset(x, 0, sizeof *x);
}

int wexperts_direct_io(const wexperts *x) {
    for (uint32_t i = 0; i < x->n_banks; i++)
        if (!x->banks[i].direct) return 0;
    return 1;
}

/* Read one record into a freshly claimed slot; on failure the slot is
 * released so a damaged record is never served from the cache. */
static waste_status load_record(wexperts *x, uint32_t key, uint32_t uses, uint8_t **buf, char *err,
                                size_t errcap) {
    uint32_t bank = key / x->m->n_experts, expert = key % x->m->n_experts;
    *buf = wcache_claim(&x->cache, key, uses);
    double t0 = wsys_now_ms();
    waste_status st = wbank_read(&x->banks[bank], expert, *buf, x->verify, err, errcap);
    double ms = wsys_now_ms() - t0;
    x->token.ms_io += ms;
    x->total.ms_io += ms;
    x->token.bytes_read += x->cache.stride;
    x->total.bytes_read += x->cache.stride;
    if (st != WASTE_OK) wcache_forget(&x->cache, key);
    return st;
}

waste_status wexperts_get(wexperts *x, uint32_t layer, uint32_t expert, uint32_t uses,
                          const uint8_t **payload, char *err, size_t errcap) {
    uint32_t key = (layer - x->m->n_dense_layers) * x->m->n_experts + expert;
    x->usage[key] += uses;
    uint8_t *buf = wcache_lookup(&x->cache, key);
    if (buf) {
        x->token.hits++;
        x->total.hits++;
    } else {
        x->token.misses++;
        x->total.misses++;
        waste_status st = load_record(x, key, 1, &buf, err, errcap);
        if (st != WASTE_OK) return st;
    }
    *payload = buf + WM_RECORD_HEADER;
    return WASTE_OK;
}

void wexperts_warm(wexperts *x, const char *usage_path) {
    uint32_t n_keys = x->cache.n_keys;
    uint32_t *order = malloc((size_t)n_keys * sizeof *order);
    if (!order) return;
    if (wusage_load(usage_path, x->m, x->usage) && wusage_rank(x->usage, n_keys, order)) {
        char ignored[256];
        uint8_t *buf;
        for (uint32_t i = 0; i < n_keys && i < x->cache.capacity && x->usage[order[i]] > 0; i++) {
            uint64_t uses = x->usage[order[i]];
            load_record(x, order[i], uses > UINT32_MAX ? UINT32_MAX : (uint32_t)uses, &buf, ignored,
                        sizeof ignored);
        }
        x->token = (wexpert_counters){0};
    }
    free(order);
}

waste_status wexperts_save_usage(const wexperts *x, const char *usage_path, char *err, size_t errcap) {
    return wusage_save(usage_path, x->m, x->usage, err, errcap);
}

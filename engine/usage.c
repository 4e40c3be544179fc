#include "usage.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "detail.h"
#include "fileio.h"

#define HEADER_BYTES 20

static void header_of(const wmanifest *m, uint8_t *h) {
    memcpy(h, "WUSG", 4);
    wle32_put(h + 4, 1);
    wle32_put(h + 8, m->n_layers);
    wle32_put(h + 12, m->n_dense_layers);
    wle32_put(h + 16, m->n_experts);
}

static size_t n_keys_of(const wmanifest *m) { return (size_t)wmanifest_moe_layers(m) * m->n_experts; }

/* Counts are stored as u64 little-endian; convert element by element so the
 * file is the same on any host. */
static void encode_counts(const uint64_t *counts, size_t n, uint8_t *out) {
    for (size_t i = 0; i < n; i++) {
        wle32_put(out + 8 * i, (uint32_t)counts[i]);
        wle32_put(out + 8 * i + 4, (uint32_t)(counts[i] >> 32));
    }
}

int wusage_load(const char *path, const wmanifest *m, uint64_t *counts) {
    size_t n = n_keys_of(m), body = 8 * n, total = HEADER_BYTES + body + 4;
    uint8_t want[HEADER_BYTES];
    header_of(m, want);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    uint8_t *buf = malloc(total + 1);
    size_t got = buf ? fread(buf, 1, total + 1, f) : 0;
    fclose(f);
    int ok = got == total && memcmp(buf, want, HEADER_BYTES) == 0 &&
             wle32_get(buf + HEADER_BYTES + body) ==
                 (uint32_t)crc32(0L, buf + HEADER_BYTES, (uInt)body);
    if (ok)
        for (size_t i = 0; i < n; i++)
            counts[i] = wle32_get(buf + HEADER_BYTES + 8 * i) |
                        (uint64_t)wle32_get(buf + HEADER_BYTES + 8 * i + 4) << 32;
    free(buf);
    return ok;
}

waste_status wusage_save(const char *path, const wmanifest *m, const uint64_t *counts, char *err,
                         size_t errcap) {
    size_t n = n_keys_of(m), body = 8 * n, total = HEADER_BYTES + body + 4;
    uint8_t *buf = malloc(total);
    if (!buf) return wdetail(err, errcap, WASTE_E_OOM, "usage: out of memory");
    header_of(m, buf);
    encode_counts(counts, n, buf + HEADER_BYTES);
    wle32_put(buf + HEADER_BYTES + body, (uint32_t)crc32(0L, buf + HEADER_BYTES, (uInt)body));

    char tmp[4200];
    FILE *f = wfile_begin(path, tmp, sizeof tmp, err, errcap);
    if (!f) {
        free(buf);
        return WASTE_E_IO;
    }
    int ok = fwrite(buf, 1, total, f) == total;
    free(buf);
    return wfile_commit(f, tmp, path, ok, err, errcap);
}

typedef struct {
    uint64_t count;
    uint32_t key;
} ranked;

static int by_count_desc(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    if (x->count != y->count) return x->count > y->count ? -1 : 1;
    return x->key < y->key ? -1 : x->key > y->key;
}

int wusage_rank(const uint64_t *counts, uint32_t n_keys, uint32_t *order) {
    ranked *r = malloc((size_t)n_keys * sizeof *r);
    if (!r) return 0;
    for (uint32_t k = 0; k < n_keys; k++) r[k] = (ranked){counts[k], k};
    qsort(r, n_keys, sizeof *r, by_count_desc);
    for (uint32_t k = 0; k < n_keys; k++) order[k] = r[k].key;
    free(r);
    return 1;
}

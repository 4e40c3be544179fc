#include "checkpoint.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "detail.h"
#include "fileio.h"

#define HEADER_BYTES 24
#define VERSION 3

/* Bytes of one layer's keys (or values) for pos positions. */
static size_t plane_bytes(const wmanifest *m, uint32_t pos) {
    return (size_t)pos * wmanifest_kv_dim(m) * sizeof(uint16_t);
}

/* Bytes of one key/value head's first pos positions. */
static size_t head_bytes(const wmanifest *m, uint32_t pos) {
    return (size_t)pos * m->head_dim * sizeof(uint16_t);
}

static int write_all(FILE *f, const void *p, size_t n, uLong *crc) {
    *crc = crc32(*crc, p, (uInt)n);
    return fwrite(p, 1, n, f) == n;
}

waste_status wcheckpoint_save(const char *path, uint32_t fingerprint, const wmanifest *m,
                              const wstate *s, char *err, size_t errcap) {
    char tmp[4200];
    FILE *f = wfile_begin(path, tmp, sizeof tmp, err, errcap);
    if (!f) return WASTE_E_IO;
    uint8_t header[HEADER_BYTES], tail[4];
    memcpy(header, "WSTA", 4);
    wle32_put(header + 4, VERSION);
    wle32_put(header + 8, fingerprint);
    wle32_put(header + 12, m->n_layers);
    wle32_put(header + 16, wmanifest_kv_dim(m));
    wle32_put(header + 20, s->pos);
    uLong crc = crc32(0L, Z_NULL, 0);
    int ok = write_all(f, header, sizeof header, &crc);
    for (uint32_t l = 0; ok && l < m->n_layers; l++)
        for (int values = 0; values < 2; values++)
            for (uint32_t h = 0; ok && h < m->n_kv_heads; h++)
                ok = write_all(f, wstate_kv(s, m, values, l, h), head_bytes(m, s->pos), &crc);
    wle32_put(tail, (uint32_t)crc);
    ok = ok && fwrite(tail, 1, 4, f) == 4;
    return wfile_commit(f, tmp, path, ok, err, errcap);
}

static int read_all(FILE *f, void *p, size_t n, uLong *crc) {
    if (fread(p, 1, n, f) != n) return 0;
    *crc = crc32(*crc, p, (uInt)n);
    return 1;
}

static waste_status check_header(const uint8_t *h, uint32_t fingerprint, const wmanifest *m,
                                 const char *path, char *err, size_t errcap) {
    if (memcmp(h, "WSTA", 4) != 0)
        return wdetail(err, errcap, WASTE_E_FORMAT, "%s: not a waste state file", path);
    if (wle32_get(h + 4) != VERSION)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                       "%s: state format version %u; this engine reads version %d only", path,
                       wle32_get(h + 4), VERSION);
    if (wle32_get(h + 8) != fingerprint || wle32_get(h + 12) != m->n_layers || wle32_get(h + 16) != wmanifest_kv_dim(m))
        return wdetail(err, errcap, WASTE_E_FORMAT, "%s: saved by another model", path);
    return WASTE_OK;
}

static waste_status load(FILE *f, const char *path, uint32_t fingerprint, const wmanifest *m,
                         wstate *s, char *err, size_t errcap) {
    uint8_t header[HEADER_BYTES], tail[4];
    uLong crc = crc32(0L, Z_NULL, 0);
    struct stat st;
    if (!read_all(f, header, sizeof header, &crc))
        return wdetail(err, errcap, WASTE_E_FORMAT, "%s: truncated header", path);
    waste_status status = check_header(header, fingerprint, m, path, err, errcap);
    if (status != WASTE_OK) return status;
    uint32_t pos = wle32_get(header + 20);
    uint64_t size = HEADER_BYTES + 2ull * m->n_layers * plane_bytes(m, pos) + 4;
    if (fstat(fileno(f), &st) != 0 || (uint64_t)st.st_size != size)
        return wdetail(err, errcap, WASTE_E_FORMAT, "%s: %llu bytes, %u positions need %llu", path,
                       (unsigned long long)st.st_size, pos, (unsigned long long)size);
    if (pos > s->ctx)
        return wdetail(err, errcap, WASTE_E_ARG, "%s: holds %u positions, this context has %u", path,
                       pos, s->ctx);
    int ok = 1;
    for (uint32_t l = 0; ok && l < m->n_layers; l++)
        for (int values = 0; values < 2; values++)
            for (uint32_t h = 0; ok && h < m->n_kv_heads; h++)
                ok = read_all(f, wstate_kv(s, m, values, l, h), head_bytes(m, pos), &crc);
    if (!ok || fread(tail, 1, 4, f) != 4 || wle32_get(tail) != (uint32_t)crc)
        return wdetail(err, errcap, WASTE_E_FORMAT, "%s: damaged (checksum mismatch)", path);
    s->pos = pos;
    return WASTE_OK;
}

waste_status wcheckpoint_load(const char *path, uint32_t fingerprint, const wmanifest *m, wstate *s,
                              char *err, size_t errcap) {
    s->pos = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return wdetail(err, errcap, WASTE_E_IO, "%s: %s", path, strerror(errno));
    waste_status st = load(f, path, fingerprint, m, s, err, errcap);
    fclose(f);
    return st;
}

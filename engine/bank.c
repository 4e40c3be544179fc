#include "bank.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "detail.h"
#include "fileio.h"

static void bank_path(const char *dir, uint32_t layer, char *out, size_t cap) {
    snprintf(out, cap, "%s/experts/layer-%03u.bank", dir, layer);
}

/* Read exactly len bytes at off, retrying short reads and EINTR. */
static int pread_all(int fd, void *buf, size_t len, off_t off) {
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = pread(fd, p, len, off);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return n == 0 ? (errno = EIO, -1) : -1;
        p += n;
        off += n;
        len -= (size_t)n;
    }
    return 0;
}

static waste_status check_open_file(int fd, const char *path, const wmanifest *m, uint32_t layer,
                                    char *err, size_t errcap) {
    uint8_t h[32];
    struct stat st;
    if (fstat(fd, &st) != 0 || pread_all(fd, h, sizeof h, 0) != 0)
        return wdetail(err, errcap, WASTE_E_FORMAT, "%s: shorter than its header", path);
    uint64_t payload = wmanifest_payload_bytes(m), stride = wmanifest_record_stride(m);
    const struct { const char *name; uint32_t got; uint64_t want; } fields[] = {
        {"version", wle32_get(h + 4), 1},
        {"layer", wle32_get(h + 8), layer},
        {"n_experts", wle32_get(h + 12), m->n_experts},
        {"stride", wle32_get(h + 16), stride},
        {"payload_bytes", wle32_get(h + 20), payload},
        {"quant_group", wle32_get(h + 24), m->expert_q.group},
        {"quant_kind", wle32_get(h + 28), m->expert_q.kind == WQ_Q4_1 ? 1u : 0u},
    };
    if (memcmp(h, "WBNK", 4) != 0) return wdetail(err, errcap, WASTE_E_FORMAT, "%s: bad magic", path);
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (fields[i].got != fields[i].want)
            return wdetail(err, errcap, WASTE_E_FORMAT, "%s: header %s is %u, the manifest implies %llu",
                           path, fields[i].name, fields[i].got, (unsigned long long)fields[i].want);
    uint64_t size = WM_PAGE + (uint64_t)m->n_experts * stride;
    if ((uint64_t)st.st_size != size)
        return wdetail(err, errcap, WASTE_E_FORMAT, "%s: %llu bytes, expected %llu", path,
                       (unsigned long long)st.st_size, (unsigned long long)size);
    return WASTE_OK;
}

waste_status wbank_check(const char *dir, const wmanifest *m, uint32_t layer, char *err,
                         size_t errcap) {
    char path[4096];
    bank_path(dir, layer, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return wdetail(err, errcap, WASTE_E_IO, "%s: %s", path, strerror(errno));
    waste_status st = check_open_file(fd, path, m, layer, err, errcap);
    close(fd);
    return st;
}

/* O_DIRECT where the filesystem takes it (tmpfs, for one, refuses with
 * EINVAL); buffered otherwise. */
static int open_record_fd(const char *path, int want_direct, int *direct) {
#ifdef O_DIRECT
    if (want_direct) {
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (fd >= 0) {
            *direct = 1;
            return fd;
        }
    }
#else
    (void)want_direct;
#endif
    *direct = 0;
    return open(path, O_RDONLY | O_CLOEXEC);
}

waste_status wbank_open(wbank *b, const char *dir, const wmanifest *m, uint32_t layer,
                        int want_direct, char *err, size_t errcap) {
    waste_status st = wbank_check(dir, m, layer, err, errcap);
    if (st != WASTE_OK) return st;
    memset(b, 0, sizeof *b);
    bank_path(dir, layer, b->path, sizeof b->path);
    b->fd = open_record_fd(b->path, want_direct, &b->direct);
    if (b->fd < 0) return wdetail(err, errcap, WASTE_E_IO, "%s: %s", b->path, strerror(errno));
    b->layer = layer;
    b->n_experts = m->n_experts;
    b->stride = wmanifest_record_stride(m);
    b->payload_bytes = wmanifest_payload_bytes(m);
    return WASTE_OK;
}

void wbank_close(wbank *b) {
    if (b->fd >= 0) close(b->fd);
    b->fd = -1;
}

/* A direct read the filesystem rejects after all: reopen buffered. */
static int read_record(wbank *b, uint8_t *buf, off_t off) {
    if (pread_all(b->fd, buf, b->stride, off) == 0) return 0;
    if (!b->direct || errno != EINVAL) return -1;
    int fd = open(b->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    close(b->fd);
    b->fd = fd;
    b->direct = 0;
    return pread_all(b->fd, buf, b->stride, off);
}

waste_status wbank_read(wbank *b, uint32_t expert, uint8_t *buf, int verify, char *err,
                        size_t errcap) {
    off_t off = (off_t)(WM_PAGE + (uint64_t)expert * b->stride);
    if (read_record(b, buf, off) != 0)
        return wdetail(err, errcap, WASTE_E_IO, "layer %u expert %u: read failed: %s", b->layer,
                       expert, strerror(errno));
    if (memcmp(buf, "WEXP", 4) != 0 || wle32_get(buf + 4) != b->layer || wle32_get(buf + 8) != expert ||
        wle32_get(buf + 12) != b->payload_bytes)
        return wdetail(err, errcap, WASTE_E_IO, "layer %u expert %u: record header does not match (%s)",
                       b->layer, expert, b->path);
    if (verify) {
        uint32_t want = wle32_get(buf + 16);
        uint32_t got = (uint32_t)crc32(0L, buf + WM_RECORD_HEADER, (uInt)b->payload_bytes);
        if (got != want)
            return wdetail(err, errcap, WASTE_E_IO,
                           "layer %u expert %u: payload crc32 %08x, record says %08x (%s)", b->layer,
                           expert, got, want, b->path);
    }
    return WASTE_OK;
}

/*
 * image.c -- format detection, header-only dimensions, and dispatch to the
 * per-format decoders (png.c, gif.c, jpeg.c).
 *
 * wimg_dimensions reads only the bytes it needs (seeking over JPEG segments),
 * so checking an upload's size never loads the whole file.  wimg_decode reads
 * the whole file (up to WIMG_MAX_FILE_BYTES) and hands it to a decoder.
 */
#include "image.h"

#include "detail.h"
#include "image_codec.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

typedef enum { KIND_UNKNOWN, KIND_PNG, KIND_JPEG, KIND_GIF, KIND_WEBP } image_kind;

/* Report a header's size once it passed wimg_check_size. */
static waste_status report_size(const char *what, uint64_t w, uint64_t h, int *ow, int *oh,
                                char *err, size_t errcap) {
    waste_status st = wimg_check_size(what, w, h, 0, err, errcap);
    if (st == WASTE_OK) *ow = (int)w, *oh = (int)h;
    return st;
}

static image_kind sniff(const uint8_t *b, size_t n) {
    static const uint8_t png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    if (n >= 8 && memcmp(b, png_sig, 8) == 0) return KIND_PNG;
    if (n >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff) return KIND_JPEG;
    if (n >= 6 && (memcmp(b, "GIF87a", 6) == 0 || memcmp(b, "GIF89a", 6) == 0)) return KIND_GIF;
    if (n >= 12 && memcmp(b, "RIFF", 4) == 0 && memcmp(b + 8, "WEBP", 4) == 0) return KIND_WEBP;
    return KIND_UNKNOWN;
}

/* Open a regular file; directories, devices and missing paths are I/O errors. */
static waste_status open_image(const char *path, FILE **fp, uint64_t *size, char *err,
                               size_t errcap) {
    if (!path || !*path) return wdetail(err, errcap, WASTE_E_IO, "no image path given");
    FILE *f = fopen(path, "rb");
    if (!f)
        return wdetail(err, errcap, WASTE_E_IO, "cannot open %s: %s", path,
                         wimg_open_reason(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return wdetail(err, errcap, WASTE_E_IO, "%s is not a regular file", path);
    }
    *fp = f;
    *size = (uint64_t)st.st_size;
    return WASTE_OK;
}

/* Read exactly n bytes at off; 0 when the file is shorter. */
static int read_at(FILE *f, uint64_t off, void *buf, size_t n) {
    if (fseeko(f, (off_t)off, SEEK_SET) != 0) return 0;
    return fread(buf, 1, n, f) == n;
}

/* ---------------------------------------------------------------- headers */

static waste_status png_dimensions(FILE *f, int *w, int *h, char *err, size_t errcap) {
    uint8_t b[24]; /* signature, IHDR length and type, width, height */
    if (!read_at(f, 0, b, sizeof b))
        return wdetail(err, errcap, WASTE_E_FORMAT, "PNG is truncated before its IHDR chunk");
    if (wimg_be32(b + 8) != 13 || memcmp(b + 12, "IHDR", 4) != 0)
        return wdetail(err, errcap, WASTE_E_FORMAT, "PNG does not start with a 13-byte IHDR");
    return report_size("PNG", wimg_be32(b + 16), wimg_be32(b + 20), w, h, err, errcap);
}

static waste_status gif_dimensions(FILE *f, int *w, int *h, char *err, size_t errcap) {
    uint8_t b[10]; /* signature and the logical screen's width and height */
    if (!read_at(f, 0, b, sizeof b))
        return wdetail(err, errcap, WASTE_E_FORMAT, "GIF is truncated before its screen size");
    return report_size("GIF", wimg_le16(b + 6), wimg_le16(b + 8), w, h, err, errcap);
}

/* WebP: RIFF header, then the first chunk decides the layout.  VP8 (lossy)
 * keeps 14-bit sizes after a key-frame start code; VP8L (lossless) packs
 * 14-bit size-minus-one fields after its signature byte; VP8X (extended)
 * has 24-bit canvas sizes minus one. */
static waste_status webp_dimensions(FILE *f, uint64_t size, int *w, int *h, char *err,
                                    size_t errcap) {
    uint8_t b[30] = {0};
    size_t have = size < sizeof b ? (size_t)size : sizeof b;
    if (have < 21 || !read_at(f, 0, b, have))
        return wdetail(err, errcap, WASTE_E_FORMAT, "WebP is truncated before its first chunk");
    const uint8_t *payload = b + 20;
    uint32_t lw, lh;
    if (memcmp(b + 12, "VP8 ", 4) == 0) {
        if (have < 30)
            return wdetail(err, errcap, WASTE_E_FORMAT, "WebP VP8 frame header is truncated");
        if ((payload[0] & 1) != 0 || payload[3] != 0x9d || payload[4] != 0x01 || payload[5] != 0x2a)
            return wdetail(err, errcap, WASTE_E_FORMAT, "WebP VP8 chunk is not a key frame");
        lw = wimg_le16(payload + 6) & 0x3fff;
        lh = wimg_le16(payload + 8) & 0x3fff;
    } else if (memcmp(b + 12, "VP8L", 4) == 0) {
        if (have < 25)
            return wdetail(err, errcap, WASTE_E_FORMAT, "WebP VP8L header is truncated");
        if (payload[0] != 0x2f)
            return wdetail(err, errcap, WASTE_E_FORMAT, "WebP VP8L signature byte is wrong");
        uint32_t bits = wimg_le32(payload + 1);
        lw = (bits & 0x3fff) + 1;
        lh = ((bits >> 14) & 0x3fff) + 1;
    } else if (memcmp(b + 12, "VP8X", 4) == 0) {
        if (have < 30)
            return wdetail(err, errcap, WASTE_E_FORMAT, "WebP VP8X header is truncated");
        lw = wimg_le24(payload + 4) + 1;
        lh = wimg_le24(payload + 7) + 1;
    } else {
        return wdetail(err, errcap, WASTE_E_FORMAT, "WebP first chunk is %.4s, not VP8/VP8L/VP8X",
                         (const char *)(b + 12));
    }
    return report_size("WebP", lw, lh, w, h, err, errcap);
}

/* JPEG: walk the marker segments by their lengths until a frame header. */
static waste_status jpeg_dimensions(FILE *f, uint64_t size, int *w, int *h, char *err,
                                    size_t errcap) {
    uint64_t pos = 2; /* after SOI; every step below advances pos, so this ends */
    while (pos + 2 <= size) {
        uint8_t m[2];
        if (!read_at(f, pos, m, 2)) break;
        if (m[0] != 0xff)
            return wdetail(err, errcap, WASTE_E_FORMAT,
                             "JPEG has 0x%02x where a marker should be (offset %llu)", m[0],
                             (unsigned long long)pos);
        if (m[1] == 0xff) { /* fill byte before a marker */
            pos += 1;
            continue;
        }
        if (wimg_jpeg_standalone(m[1])) {
            pos += 2;
            continue;
        }
        if (m[1] == 0xda || m[1] == 0xd9)
            return wdetail(err, errcap, WASTE_E_FORMAT,
                             "JPEG has no frame header before its scan");
        uint8_t seg[7]; /* length, then for a frame header: precision, height, width */
        if (!read_at(f, pos + 2, seg, 2)) break;
        uint32_t len = wimg_be16(seg);
        if (len < 2)
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG segment length %u is too short",
                             len);
        if (wimg_jpeg_is_sof(m[1])) {
            if (len < 8 || !read_at(f, pos + 2, seg, sizeof seg)) break;
            return report_size("JPEG", wimg_be16(seg + 5), wimg_be16(seg + 3), w, h, err, errcap);
        }
        pos += 2 + (uint64_t)len;
    }
    return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG is truncated before its frame header");
}

waste_status wimg_dimensions(const char *path, int *w, int *h, char *err, size_t errcap) {
    FILE *f;
    uint64_t size;
    waste_status st = open_image(path, &f, &size, err, errcap);
    if (st != WASTE_OK) return st;
    uint8_t head[12];
    size_t have = size < sizeof head ? (size_t)size : sizeof head;
    if (have > 0 && !read_at(f, 0, head, have)) {
        fclose(f);
        return wdetail(err, errcap, WASTE_E_IO, "cannot read %s", path);
    }
    switch (sniff(head, have)) {
    case KIND_PNG: st = png_dimensions(f, w, h, err, errcap); break;
    case KIND_GIF: st = gif_dimensions(f, w, h, err, errcap); break;
    case KIND_WEBP: st = webp_dimensions(f, size, w, h, err, errcap); break;
    case KIND_JPEG: st = jpeg_dimensions(f, size, w, h, err, errcap); break;
    default:
        st = wdetail(err, errcap, WASTE_E_FORMAT,
                       size ? "not a PNG, JPEG, GIF or WebP file" : "empty file");
    }
    fclose(f);
    return st;
}

/* ----------------------------------------------------------------- decode */

static waste_status read_whole(const char *path, uint8_t **data, size_t *n, char *err,
                               size_t errcap) {
    FILE *f;
    uint64_t size;
    waste_status st = open_image(path, &f, &size, err, errcap);
    if (st != WASTE_OK) return st;
    if (size > WIMG_MAX_FILE_BYTES) {
        fclose(f);
        return wdetail(err, errcap, WASTE_E_FORMAT, "image file is %llu bytes; the limit is %u",
                         (unsigned long long)size, WIMG_MAX_FILE_BYTES);
    }
    uint8_t *buf = malloc(size ? (size_t)size : 1);
    if (!buf) {
        fclose(f);
        return wdetail(err, errcap, WASTE_E_OOM, "no memory to read a %llu-byte image",
                         (unsigned long long)size);
    }
    int ok = size == 0 || read_at(f, 0, buf, (size_t)size);
    fclose(f);
    if (!ok) {
        free(buf);
        return wdetail(err, errcap, WASTE_E_IO, "short read from %s", path);
    }
    *data = buf;
    *n = (size_t)size;
    return WASTE_OK;
}

waste_status wimg_decode(const char *path, wimg *out, char *err, size_t errcap) {
    uint8_t *data = NULL;
    size_t n = 0;
    waste_status st = read_whole(path, &data, &n, err, errcap);
    if (st != WASTE_OK) return st;
    wimg img = {0, 0, NULL};
    switch (sniff(data, n)) {
    case KIND_PNG: st = wimg_decode_png(data, n, &img, err, errcap); break;
    case KIND_GIF: st = wimg_decode_gif(data, n, &img, err, errcap); break;
    case KIND_JPEG: st = wimg_decode_jpeg(data, n, &img, err, errcap); break;
    case KIND_WEBP:
        st = wdetail(err, errcap, WASTE_E_UNSUPPORTED,
                       "WebP decoding is not built into the reference engine");
        break;
    default:
        st = wdetail(err, errcap, WASTE_E_FORMAT,
                       n ? "not a PNG, JPEG, GIF or WebP file" : "empty file");
    }
    free(data);
    if (st == WASTE_OK)
        *out = img;
    else
        wimg_free(&img);
    return st;
}

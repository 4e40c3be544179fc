/*
 * png.c -- PNG decoding: every colour type (0, 2, 3, 4, 6) and bit depth,
 * Adam7 interlacing, all five row filters, any number of IDAT chunks.
 *
 * The zlib stream is inflated one row at a time straight into a row buffer,
 * so memory is the RGB output plus two rows, and inflate can never produce
 * more than the exact raw size the header implies: one byte past it is an
 * error.  That makes decompression bombs harmless.  Chunk CRCs are checked.
 * Alpha (colour types 4 and 6, tRNS) is dropped; 16-bit samples keep their
 * high byte.
 */
#include "image_codec.h"
#include "detail.h"

#include <stdlib.h>
#include <string.h>
#include <zlib.h>

enum { CT_GRAY = 0, CT_RGB = 2, CT_PALETTE = 3, CT_GRAY_ALPHA = 4, CT_RGBA = 6 };

typedef struct {
    int x0, y0, dx, dy; /* first pixel and step of one interlace pass */
} png_pass;

static const png_pass ADAM7[7] = {
    {0, 0, 8, 8}, {4, 0, 8, 8}, {0, 4, 4, 8}, {2, 0, 4, 4},
    {0, 2, 2, 4}, {1, 0, 2, 2}, {0, 1, 1, 2},
};
static const png_pass NO_INTERLACE = {0, 0, 1, 1};

typedef struct {
    int w, h, depth, ctype, interlace;
    int channels; /* samples per pixel */
    size_t bpp;   /* bytes per pixel for filtering (at least 1) */
    uint8_t palette[256 * 3];
    int n_palette;

    z_stream z;
    int z_open, z_end;

    int pass;            /* index into ADAM7 (0 when not interlaced) */
    int pass_w, pass_h;  /* pixels in this pass */
    size_t rowbytes;     /* bytes of one row of this pass, without the filter byte */
    int row;             /* row within the pass */
    size_t filled;       /* bytes of the current row (filter byte included) inflated */
    int done;            /* every row of every pass decoded */
    uint8_t *cur, *prev; /* filter byte + row; prev holds the previous row's bytes */
    wimg img;
} png_dec;

static const png_pass *pass_of(const png_dec *d) {
    return d->interlace ? &ADAM7[d->pass] : &NO_INTERLACE;
}

static int extent(int size, int start, int step) {
    return size > start ? (size - start + step - 1) / step : 0;
}

/* Move to the next pass with pixels in it (or mark the image done). */
static void start_pass(png_dec *d, int pass) {
    int last = d->interlace ? 7 : 1;
    for (; pass < last; pass++) {
        d->pass = pass;
        const png_pass *p = pass_of(d);
        d->pass_w = extent(d->w, p->x0, p->dx);
        d->pass_h = extent(d->h, p->y0, p->dy);
        if (d->pass_w && d->pass_h) {
            d->rowbytes = ((size_t)d->pass_w * (size_t)d->channels * (size_t)d->depth + 7) / 8;
            d->row = 0;
            d->filled = 0;
            memset(d->prev, 0, d->rowbytes + 1); /* the row above the first is zero */
            return;
        }
    }
    d->done = 1;
}

static int paeth(int a, int b, int c) {
    int p = a + b - c, pa = abs(p - a), pb = abs(p - b), pc = abs(p - c);
    if (pa <= pb && pa <= pc) return a;
    return pb <= pc ? b : c;
}

static waste_status unfilter(png_dec *d, char *err, size_t errcap) {
    uint8_t *x = d->cur + 1;
    const uint8_t *up = d->prev + 1;
    size_t n = d->rowbytes, bpp = d->bpp;
    switch (d->cur[0]) {
    case 0: break;
    case 1:
        for (size_t i = bpp; i < n; i++) x[i] = (uint8_t)(x[i] + x[i - bpp]);
        break;
    case 2:
        for (size_t i = 0; i < n; i++) x[i] = (uint8_t)(x[i] + up[i]);
        break;
    case 3:
        for (size_t i = 0; i < n; i++)
            x[i] = (uint8_t)(x[i] + (((i >= bpp ? x[i - bpp] : 0) + up[i]) >> 1));
        break;
    case 4:
        for (size_t i = 0; i < n; i++)
            x[i] = (uint8_t)(x[i] +
                             paeth(i >= bpp ? x[i - bpp] : 0, up[i], i >= bpp ? up[i - bpp] : 0));
        break;
    default:
        return wdetail(err, errcap, WASTE_E_FORMAT, "PNG row uses unknown filter type %d",
                         d->cur[0]);
    }
    return WASTE_OK;
}

/* Sample c of pixel i of the unfiltered row, reduced to 8 bits. */
static int sample8(const png_dec *d, const uint8_t *row, size_t i, int c) {
    size_t s = i * (size_t)d->channels + (size_t)c;
    if (d->depth == 16) return row[2 * s];
    if (d->depth == 8) return row[s];
    size_t bit = s * (size_t)d->depth;
    int v = (row[bit / 8] >> (8 - d->depth - (int)(bit % 8))) & ((1 << d->depth) - 1);
    return d->ctype == CT_PALETTE ? v : v * 255 / ((1 << d->depth) - 1);
}

static waste_status emit_row(png_dec *d, char *err, size_t errcap) {
    const png_pass *p = pass_of(d);
    const uint8_t *row = d->cur + 1;
    int y = p->y0 + d->row * p->dy;
    for (int i = 0; i < d->pass_w; i++) {
        uint8_t *o = d->img.rgb + ((size_t)y * (size_t)d->w + (size_t)(p->x0 + i * p->dx)) * 3;
        if (d->ctype == CT_PALETTE) {
            int idx = sample8(d, row, (size_t)i, 0);
            if (idx >= d->n_palette)
                return wdetail(err, errcap, WASTE_E_FORMAT,
                                 "PNG pixel uses palette index %d of %d", idx, d->n_palette);
            memcpy(o, d->palette + 3 * idx, 3);
        } else if (d->ctype == CT_RGB || d->ctype == CT_RGBA) {
            for (int c = 0; c < 3; c++) o[c] = (uint8_t)sample8(d, row, (size_t)i, c);
        } else { /* grey, with or without alpha */
            o[0] = o[1] = o[2] = (uint8_t)sample8(d, row, (size_t)i, 0);
        }
    }
    return WASTE_OK;
}

/* A complete row is in cur: unfilter, write its pixels, move on. */
static waste_status finish_row(png_dec *d, char *err, size_t errcap) {
    waste_status st = unfilter(d, err, errcap);
    if (st == WASTE_OK) st = emit_row(d, err, errcap);
    if (st != WASTE_OK) return st;
    uint8_t *t = d->prev;
    d->prev = d->cur;
    d->cur = t;
    d->filled = 0;
    if (++d->row == d->pass_h) start_pass(d, d->pass + 1);
    return WASTE_OK;
}

/* Inflate one IDAT's bytes into rows.  Once every row is complete, any
 * further output is an error, so the work done is bounded by the raw size. */
static waste_status feed_idat(png_dec *d, const uint8_t *data, uint32_t len, char *err,
                              size_t errcap) {
    uint8_t overflow;
    d->z.next_in = (Bytef *)(uintptr_t)data; /* zlib's API is not const-correct */
    d->z.avail_in = len;
    while (!d->z_end) {
        uint8_t *out = d->done ? &overflow : d->cur + d->filled;
        uInt room = d->done ? 1 : (uInt)(d->rowbytes + 1 - d->filled);
        d->z.next_out = out;
        d->z.avail_out = room;
        int ret = inflate(&d->z, Z_NO_FLUSH);
        size_t produced = room - d->z.avail_out;
        if (ret != Z_OK && ret != Z_STREAM_END && ret != Z_BUF_ERROR)
            return wdetail(err, errcap, WASTE_E_FORMAT, "PNG image data is corrupt (%s)",
                             d->z.msg ? d->z.msg : "inflate failed");
        if (d->done && produced)
            return wdetail(err, errcap, WASTE_E_FORMAT,
                             "PNG image data is larger than its %dx%d header declares", d->w, d->h);
        d->filled += produced;
        if (!d->done && d->filled == d->rowbytes + 1) {
            waste_status st = finish_row(d, err, errcap);
            if (st != WASTE_OK) return st;
        }
        if (ret == Z_STREAM_END) {
            if (!d->done)
                return wdetail(err, errcap, WASTE_E_FORMAT,
                                 "PNG image data ends before the last row");
            d->z_end = 1;
        }
        if (ret == Z_BUF_ERROR || (d->z.avail_in == 0 && d->z.avail_out != 0)) break;
    }
    return WASTE_OK;
}

static waste_status read_ihdr(png_dec *d, const uint8_t *c, uint32_t len, char *err,
                              size_t errcap) {
    if (len != 13)
        return wdetail(err, errcap, WASTE_E_FORMAT, "PNG IHDR is %u bytes, not 13", len);
    uint32_t w = wimg_be32(c), h = wimg_be32(c + 4);
    waste_status st = wimg_check_size("PNG", w, h, 1, err, errcap);
    if (st != WASTE_OK) return st;
    d->w = (int)w;
    d->h = (int)h;
    d->depth = c[8];
    d->ctype = c[9];
    d->interlace = c[12];
    static const int channels[7] = {1, 0, 3, 1, 2, 0, 4};
    /* Allowed depths per colour type, as a bit mask of depths. */
    static const unsigned depths[7] = {1u << 1 | 1u << 2 | 1u << 4 | 1u << 8 | 1u << 16,
                                       0,
                                       1u << 8 | 1u << 16,
                                       1u << 1 | 1u << 2 | 1u << 4 | 1u << 8,
                                       1u << 8 | 1u << 16,
                                       0,
                                       1u << 8 | 1u << 16};
    if (d->ctype > 6 || !channels[d->ctype] || d->depth > 16 || !(depths[d->ctype] >> d->depth & 1))
        return wdetail(err, errcap, WASTE_E_FORMAT,
                         "PNG colour type %d with bit depth %d is invalid", d->ctype, d->depth);
    if (c[10] != 0 || c[11] != 0 || d->interlace > 1)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                         "PNG compression %d, filter %d or interlace %d is unknown", c[10], c[11],
                         c[12]);
    d->channels = channels[d->ctype];
    d->bpp = (size_t)(d->channels * d->depth + 7) / 8;
    return WASTE_OK;
}

static waste_status read_plte(png_dec *d, const uint8_t *c, uint32_t len, char *err,
                              size_t errcap) {
    if (len == 0 || len % 3 != 0 || len > 256 * 3)
        return wdetail(err, errcap, WASTE_E_FORMAT, "PNG palette of %u bytes is invalid", len);
    memcpy(d->palette, c, len);
    d->n_palette = (int)(len / 3);
    return WASTE_OK;
}

/* First IDAT: everything the rows need must be known now. */
static waste_status begin_image_data(png_dec *d, char *err, size_t errcap) {
    if (d->ctype == CT_PALETTE && !d->n_palette)
        return wdetail(err, errcap, WASTE_E_FORMAT, "PNG palette image has no PLTE before IDAT");
    size_t rowmax = ((size_t)d->w * (size_t)d->channels * (size_t)d->depth + 7) / 8 + 1;
    d->cur = malloc(rowmax);
    d->prev = malloc(rowmax);
    if (!d->cur || !d->prev) return wdetail(err, errcap, WASTE_E_OOM, "no memory for PNG rows");
    waste_status st = wimg_alloc(&d->img, d->w, d->h, err, errcap);
    if (st != WASTE_OK) return st;
    if (inflateInit(&d->z) != Z_OK)
        return wdetail(err, errcap, WASTE_E_OOM, "cannot start inflate");
    d->z_open = 1;
    start_pass(d, 0);
    return WASTE_OK;
}

static waste_status decode_chunks(png_dec *d, const uint8_t *data, size_t n, char *err,
                                  size_t errcap) {
    size_t pos = 8;
    int seen_ihdr = 0;
    for (;;) {
        if (n - pos < 12)
            return wdetail(err, errcap, WASTE_E_FORMAT, "PNG is truncated (no IEND chunk)");
        uint32_t len = wimg_be32(data + pos);
        const uint8_t *type = data + pos + 4, *body = data + pos + 8;
        if (len > n - pos - 12)
            return wdetail(err, errcap, WASTE_E_FORMAT,
                             "PNG chunk %.4s claims %u bytes past the end of the file",
                             (const char *)type, len);
        if ((uint32_t)crc32(0, type, len + 4) != wimg_be32(body + len))
            return wdetail(err, errcap, WASTE_E_FORMAT, "PNG chunk %.4s fails its CRC",
                             (const char *)type);
        pos += 12 + (size_t)len;
        waste_status st = WASTE_OK;
        if (!seen_ihdr) {
            if (memcmp(type, "IHDR", 4) != 0)
                return wdetail(err, errcap, WASTE_E_FORMAT, "PNG does not start with IHDR");
            st = read_ihdr(d, body, len, err, errcap);
            seen_ihdr = 1;
        } else if (memcmp(type, "PLTE", 4) == 0) {
            if (d->cur) return wdetail(err, errcap, WASTE_E_FORMAT, "PNG PLTE after image data");
            st = read_plte(d, body, len, err, errcap);
        } else if (memcmp(type, "IDAT", 4) == 0) {
            if (!d->cur) st = begin_image_data(d, err, errcap);
            if (st == WASTE_OK) st = feed_idat(d, body, len, err, errcap);
        } else if (memcmp(type, "IEND", 4) == 0) {
            if (!d->z_end)
                return wdetail(err, errcap, WASTE_E_FORMAT,
                                 "PNG image data is missing or incomplete");
            return WASTE_OK;
        } else if (!(type[0] & 0x20)) { /* lower-case first letter = ancillary, safe to skip */
            return wdetail(err, errcap, WASTE_E_UNSUPPORTED,
                             "PNG has unknown critical chunk %.4s", (const char *)type);
        }
        if (st != WASTE_OK) return st;
    }
}

waste_status wimg_decode_png(const uint8_t *data, size_t n, wimg *out, char *err, size_t errcap) {
    png_dec *d = calloc(1, sizeof *d);
    if (!d) return wdetail(err, errcap, WASTE_E_OOM, "no memory for the PNG decoder");
    waste_status st = decode_chunks(d, data, n, err, errcap);
    if (d->z_open) inflateEnd(&d->z);
    free(d->cur);
    free(d->prev);
    if (st == WASTE_OK)
        *out = d->img;
    else
        wimg_free(&d->img);
    free(d);
    return st;
}

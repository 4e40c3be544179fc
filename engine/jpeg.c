/*
 * jpeg.c -- baseline JPEG decoding (SOF0/SOF1, 8-bit, Huffman): greyscale or
 * YCbCr with any sampling factors (4:4:4, 4:2:2, 4:2:0, ...), restart
 * intervals, 8- and 16-bit quantisation tables.
 *
 * Progressive, lossless, hierarchical and arithmetic-coded files, 12-bit
 * samples, CMYK and multi-scan sequential files are WASTE_E_UNSUPPORTED.
 *
 * One MCU row is decoded at a time into per-component planes, then upsampled
 * (nearest sample: chroma is replicated, not interpolated) and converted to
 * RGB, so memory is the output plus one MCU row.  The entropy decoder reads
 * bit by bit with every byte bounds-checked; running into a marker or the end
 * of the file inside the scan is an error.
 */
#include "image_codec.h"
#include "detail.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_COMPONENTS 3
#define MAX_BLOCKS_PER_MCU 10 /* the JPEG standard's own limit */

/* Natural (row-major) index of the k-th coefficient in zigzag order. */
static const uint8_t ZIGZAG[64] = {
    0,  1,  8,  16, 9,  2,  3,  10, 17, 24, 32, 25, 18, 11, 4,  5,  12, 19, 26, 33, 40, 48,
    41, 34, 27, 20, 13, 6,  7,  14, 21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23,
    30, 37, 44, 51, 58, 59, 52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
};

typedef struct {
    int defined;
    int maxcode[17]; /* largest code of each length, -1 when none */
    int mincode[17];
    int valptr[17]; /* index in vals of the first code of each length */
    uint8_t vals[256];
} huffman;

typedef struct {
    int id, h, v, tq; /* component id, sampling factors, quantisation table */
    int td, ta;       /* DC and AC Huffman tables for the scan */
    int pred;         /* DC predictor */
    int stride;       /* plane width in samples (whole MCUs) */
    uint8_t *plane;   /* one MCU row: stride x (8*v) samples */
} component;

typedef struct {
    const uint8_t *d;
    size_t n, pos;
    uint32_t acc;
    int nbits;
} bitreader;

typedef struct {
    uint16_t quant[4][64]; /* zigzag order */
    int quant_defined[4];
    huffman dc[4], ac[4];
    int w, h, nc, hmax, vmax;
    component comp[MAX_COMPONENTS];
    int restart_interval;
    float idct[8][8]; /* idct[x][u] = C(u)/2 * cos((2x+1)u*pi/16) */
} jpeg_dec;

/* ------------------------------------------------------------- segments */

static waste_status read_dqt(jpeg_dec *j, const uint8_t *s, size_t len, char *err, size_t errcap) {
    size_t p = 0;
    while (p < len) {
        int precision = s[p] >> 4, id = s[p] & 15;
        size_t need = precision ? 128 : 64;
        if (precision > 1 || id > 3 || len - p - 1 < need)
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG quantisation table is malformed");
        p++;
        for (int k = 0; k < 64; k++)
            j->quant[id][k] = precision ? (uint16_t)wimg_be16(s + p + 2 * k) : s[p + k];
        j->quant_defined[id] = 1;
        p += need;
    }
    return WASTE_OK;
}

static waste_status read_dht(jpeg_dec *j, const uint8_t *s, size_t len, char *err, size_t errcap) {
    size_t p = 0;
    while (p < len) {
        if (len - p < 17)
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG Huffman table is truncated");
        int cls = s[p] >> 4, id = s[p] & 15;
        if (cls > 1 || id > 3)
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG Huffman table id is invalid");
        huffman *t = cls ? &j->ac[id] : &j->dc[id];
        const uint8_t *counts = s + p + 1;
        int total = 0, code = 0;
        for (int l = 1; l <= 16; l++) {
            t->valptr[l] = total;
            t->mincode[l] = code;
            code += counts[l - 1];
            total += counts[l - 1];
            t->maxcode[l] = counts[l - 1] ? code - 1 : -1;
            if (code > (1 << l))
                return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG Huffman code lengths overflow");
            code <<= 1;
        }
        if (total > 256 || (size_t)total > len - p - 17)
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG Huffman table is truncated");
        memcpy(t->vals, s + p + 17, (size_t)total);
        t->defined = 1;
        p += 17 + (size_t)total;
    }
    return WASTE_OK;
}

static waste_status read_dri(jpeg_dec *j, const uint8_t *s, size_t len, char *err, size_t errcap) {
    if (len < 2)
        return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG restart interval segment is truncated");
    j->restart_interval = (int)wimg_be16(s);
    return WASTE_OK;
}

static waste_status read_sof(jpeg_dec *j, uint8_t marker, const uint8_t *s, size_t len, char *err,
                             size_t errcap) {
    if (marker == 0xc2 || marker == 0xc6 || marker == 0xca || marker == 0xce)
        return wdetail(err, errcap, WASTE_E_UNSUPPORTED,
                         "progressive JPEG is not supported; use baseline");
    if (marker != 0xc0 && marker != 0xc1)
        return wdetail(
            err, errcap, WASTE_E_UNSUPPORTED,
            "JPEG frame type SOF%d (lossless, hierarchical or arithmetic) is not supported",
            marker - 0xc0);
    if (j->nc) return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG has more than one frame header");
    if (len < 6) return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG frame header is truncated");
    if (s[0] != 8)
        return wdetail(err, errcap, WASTE_E_UNSUPPORTED, "%d-bit JPEG is not supported", s[0]);
    int h = (int)wimg_be16(s + 1), w = (int)wimg_be16(s + 3), nc = s[5];
    waste_status st = wimg_check_size("JPEG", (uint64_t)w, (uint64_t)h, 1, err, errcap);
    if (st != WASTE_OK) return st;
    if (nc == 4) return wdetail(err, errcap, WASTE_E_UNSUPPORTED, "CMYK JPEG is not supported");
    if (nc != 1 && nc != 3)
        return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG has %d components", nc);
    if (len < 6 + 3 * (size_t)nc)
        return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG frame header is truncated");
    int blocks = 0;
    j->hmax = j->vmax = 1;
    for (int i = 0; i < nc; i++) {
        component *c = &j->comp[i];
        const uint8_t *cs = s + 6 + 3 * i;
        c->id = cs[0];
        c->h = cs[1] >> 4;
        c->v = cs[1] & 15;
        c->tq = cs[2];
        if (c->h < 1 || c->h > 4 || c->v < 1 || c->v > 4 || c->tq > 3)
            return wdetail(err, errcap, WASTE_E_FORMAT,
                             "JPEG component %d has invalid sampling or table", i);
        if (nc == 1)
            c->h = c->v = 1; /* one component: blocks are in raster order whatever it declares */
        blocks += c->h * c->v;
        if (c->h > j->hmax) j->hmax = c->h;
        if (c->v > j->vmax) j->vmax = c->v;
    }
    if (blocks > MAX_BLOCKS_PER_MCU)
        return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG MCU has %d blocks (at most %d)", blocks,
                         MAX_BLOCKS_PER_MCU);
    j->w = w;
    j->h = h;
    j->nc = nc;
    return WASTE_OK;
}

/* ------------------------------------------------------- entropy decoding */

/* Next bit of entropy-coded data (0xFF00 stuffing removed); -1 at a marker
 * or the end of the data. */
static int get_bit(bitreader *b) {
    if (b->nbits == 0) {
        if (b->pos >= b->n) return -1;
        uint8_t c = b->d[b->pos];
        if (c == 0xff) {
            if (b->pos + 1 >= b->n || b->d[b->pos + 1] != 0) return -1;
            b->pos += 2;
        } else {
            b->pos++;
        }
        b->acc = c;
        b->nbits = 8;
    }
    b->nbits--;
    return (int)(b->acc >> b->nbits) & 1;
}

static int get_bits(bitreader *b, int n, int *out) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        int bit = get_bit(b);
        if (bit < 0) return 0;
        v = v << 1 | bit;
    }
    *out = v;
    return 1;
}

/* Decode one Huffman symbol; -1 on bad data. */
static int decode_symbol(bitreader *b, const huffman *t) {
    int code = 0;
    for (int l = 1; l <= 16; l++) {
        int bit = get_bit(b);
        if (bit < 0) return -1;
        code = code << 1 | bit;
        if (t->maxcode[l] >= 0 && code <= t->maxcode[l] && code >= t->mincode[l])
            return t->vals[t->valptr[l] + code - t->mincode[l]];
    }
    return -1;
}

/* A value of s bits in JPEG's sign convention (leading 0 = negative). */
static int read_signed(bitreader *b, int s, int *out) {
    int v;
    if (!get_bits(b, s, &v)) return 0;
    *out = s && v < (1 << (s - 1)) ? v - (1 << s) + 1 : v;
    return 1;
}

/* Decode one 8x8 block's coefficients (natural order, dequantised). */
static waste_status decode_block(jpeg_dec *j, bitreader *b, component *c, float coef[64], char *err,
                                 size_t errcap) {
    const uint16_t *q = j->quant[c->tq];
    memset(coef, 0, 64 * sizeof *coef);
    int t = decode_symbol(b, &j->dc[c->td]), diff;
    if (t < 0 || t > 11 || !read_signed(b, t, &diff))
        return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG scan data is corrupt or truncated");
    c->pred += diff;
    coef[0] = (float)c->pred * q[0];
    for (int k = 1; k < 64;) {
        int rs = decode_symbol(b, &j->ac[c->ta]);
        if (rs < 0)
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG scan data is corrupt or truncated");
        int run = rs >> 4, size = rs & 15, v;
        if (size == 0) {
            if (run != 15) break; /* end of block */
            k += 16;
            continue;
        }
        k += run;
        if (k > 63 || size > 10 || !read_signed(b, size, &v))
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG scan data is corrupt or truncated");
        coef[ZIGZAG[k]] = (float)v * q[k];
        k++;
    }
    return WASTE_OK;
}

/* Separable float IDCT of one block into 8x8 samples at out (row stride). */
static void idct_block(const jpeg_dec *j, const float coef[64], uint8_t *out, int stride) {
    float tmp[64];
    for (int v = 0; v < 8; v++) /* rows of coefficients -> horizontal samples */
        for (int x = 0; x < 8; x++) {
            float s = 0;
            for (int u = 0; u < 8; u++) s += j->idct[x][u] * coef[v * 8 + u];
            tmp[v * 8 + x] = s;
        }
    for (int x = 0; x < 8; x++)
        for (int y = 0; y < 8; y++) {
            float s = 0;
            for (int v = 0; v < 8; v++) s += j->idct[y][v] * tmp[v * 8 + x];
            long p = lroundf(s + 128.0f);
            out[y * stride + x] = (uint8_t)(p < 0 ? 0 : p > 255 ? 255 : p);
        }
}

static uint8_t clamp8(float v) {
    long p = lroundf(v);
    return (uint8_t)(p < 0 ? 0 : p > 255 ? 255 : p);
}

/* Upsample and convert one decoded MCU row (image rows y0..) to RGB. */
static void emit_mcu_row(const jpeg_dec *j, int y0, wimg *img) {
    int rows = j->vmax * 8;
    if (rows > j->h - y0) rows = j->h - y0;
    for (int r = 0; r < rows; r++) {
        uint8_t *o = img->rgb + (size_t)(y0 + r) * (size_t)j->w * 3;
        for (int x = 0; x < j->w; x++, o += 3) {
            float s[MAX_COMPONENTS];
            for (int i = 0; i < j->nc; i++) {
                const component *c = &j->comp[i];
                s[i] = c->plane[(r * c->v / j->vmax) * c->stride + x * c->h / j->hmax];
            }
            if (j->nc == 1) {
                o[0] = o[1] = o[2] = (uint8_t)s[0];
            } else { /* JFIF YCbCr */
                float cb = s[1] - 128.0f, cr = s[2] - 128.0f;
                o[0] = clamp8(s[0] + 1.402f * cr);
                o[1] = clamp8(s[0] - 0.344136f * cb - 0.714136f * cr);
                o[2] = clamp8(s[0] + 1.772f * cb);
            }
        }
    }
}

/* At a restart interval: drop leftover bits, expect RSTn, reset predictors. */
static waste_status restart(jpeg_dec *j, bitreader *b, char *err, size_t errcap) {
    b->nbits = 0;
    while (b->pos + 1 < b->n && b->d[b->pos] == 0xff && b->d[b->pos + 1] == 0xff) b->pos++;
    if (b->pos + 1 >= b->n || b->d[b->pos] != 0xff || b->d[b->pos + 1] < 0xd0 ||
        b->d[b->pos + 1] > 0xd7)
        return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG restart marker is missing");
    b->pos += 2;
    for (int i = 0; i < j->nc; i++) j->comp[i].pred = 0;
    return WASTE_OK;
}

static waste_status decode_scan(jpeg_dec *j, const uint8_t *data, size_t n, size_t pos, wimg *img,
                                char *err, size_t errcap) {
    int mcu_w = 8 * j->hmax, mcu_h = 8 * j->vmax;
    int mcus_x = (j->w + mcu_w - 1) / mcu_w, mcus_y = (j->h + mcu_h - 1) / mcu_h;
    for (int i = 0; i < j->nc; i++) {
        component *c = &j->comp[i];
        c->stride = mcus_x * c->h * 8;
        c->plane = malloc((size_t)c->stride * (size_t)(c->v * 8));
        if (!c->plane) return wdetail(err, errcap, WASTE_E_OOM, "no memory for a JPEG MCU row");
        c->pred = 0;
    }
    bitreader b = {data, n, pos, 0, 0};
    long mcu = 0;
    float coef[64];
    for (int my = 0; my < mcus_y; my++) {
        for (int mx = 0; mx < mcus_x; mx++, mcu++) {
            if (j->restart_interval && mcu > 0 && mcu % j->restart_interval == 0) {
                waste_status st = restart(j, &b, err, errcap);
                if (st != WASTE_OK) return st;
            }
            for (int i = 0; i < j->nc; i++) {
                component *c = &j->comp[i];
                for (int by = 0; by < c->v; by++)
                    for (int bx = 0; bx < c->h; bx++) {
                        waste_status st = decode_block(j, &b, c, coef, err, errcap);
                        if (st != WASTE_OK) return st;
                        idct_block(j, coef,
                                   c->plane + (size_t)(by * 8) * (size_t)c->stride +
                                       (size_t)((mx * c->h + bx) * 8),
                                   c->stride);
                    }
            }
        }
        emit_mcu_row(j, my * mcu_h, img);
    }
    return WASTE_OK;
}

/* Start of scan: bind components to Huffman tables, then decode the image. */
static waste_status read_sos(jpeg_dec *j, const uint8_t *s, size_t len, const uint8_t *data,
                             size_t n, size_t scan_start, wimg *img, char *err, size_t errcap) {
    if (!j->nc) return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG scan before its frame header");
    if (len < 1 || len < 1 + 2 * (size_t)s[0] + 3)
        return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG scan header is truncated");
    if (s[0] != j->nc)
        return wdetail(err, errcap, WASTE_E_UNSUPPORTED,
                         "JPEG with one scan per component is not supported");
    for (int i = 0; i < j->nc; i++) {
        int id = s[1 + 2 * i], tables = s[2 + 2 * i];
        component *c = &j->comp[i];
        if (c->id != id)
            return wdetail(err, errcap, WASTE_E_FORMAT,
                             "JPEG scan names component %d out of frame order", id);
        c->td = tables >> 4;
        c->ta = tables & 15;
        if (c->td > 3 || c->ta > 3 || !j->dc[c->td].defined || !j->ac[c->ta].defined ||
            !j->quant_defined[c->tq])
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG scan uses an undefined table");
    }
    waste_status st = wimg_alloc(img, j->w, j->h, err, errcap);
    if (st != WASTE_OK) return st;
    return decode_scan(j, data, n, scan_start, img, err, errcap);
}

static void init_idct(jpeg_dec *j) {
    const double pi = 3.14159265358979323846;
    for (int x = 0; x < 8; x++)
        for (int u = 0; u < 8; u++)
            j->idct[x][u] = (float)((u ? 0.5 : 0.5 / sqrt(2.0)) * cos((2 * x + 1) * u * pi / 16));
}

/* Walk the segments up to the (single) scan, which is decoded in place. */
static waste_status decode_segments(jpeg_dec *j, const uint8_t *data, size_t n, wimg *img,
                                    char *err, size_t errcap) {
    size_t pos = 2;
    for (;;) {
        if (n - pos < 2)
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG is truncated before its scan");
        if (data[pos] != 0xff)
            return wdetail(err, errcap, WASTE_E_FORMAT,
                             "JPEG has 0x%02x where a marker should be", data[pos]);
        uint8_t m = data[pos + 1];
        if (m == 0xff || wimg_jpeg_standalone(m)) {
            pos += m == 0xff ? 1 : 2;
            continue;
        }
        if (m == 0xd9) return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG ends before its scan");
        if (n - pos < 4)
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG is truncated in a segment header");
        size_t len = wimg_be16(data + pos + 2);
        if (len < 2 || len - 2 > n - pos - 4)
            return wdetail(err, errcap, WASTE_E_FORMAT, "JPEG segment 0x%02x has a bad length",
                             m);
        const uint8_t *s = data + pos + 4;
        size_t body = len - 2;
        waste_status st = WASTE_OK;
        if (m == 0xda) return read_sos(j, s, body, data, n, pos + 2 + len, img, err, errcap);
        if (m == 0xdb)
            st = read_dqt(j, s, body, err, errcap);
        else if (m == 0xc4)
            st = read_dht(j, s, body, err, errcap);
        else if (m == 0xdd)
            st = read_dri(j, s, body, err, errcap);
        else if (wimg_jpeg_is_sof(m))
            st = read_sof(j, m, s, body, err, errcap);
        else if (m == 0xcc)
            st = wdetail(err, errcap, WASTE_E_UNSUPPORTED,
                           "arithmetic-coded JPEG is not supported");
        if (st != WASTE_OK) return st;
        pos += 2 + len;
    }
}

waste_status wimg_decode_jpeg(const uint8_t *data, size_t n, wimg *out, char *err, size_t errcap) {
    jpeg_dec *j = calloc(1, sizeof *j);
    if (!j) return wdetail(err, errcap, WASTE_E_OOM, "no memory for the JPEG decoder");
    init_idct(j);
    wimg img = {0, 0, NULL};
    waste_status st = decode_segments(j, data, n, &img, err, errcap);
    for (int i = 0; i < MAX_COMPONENTS; i++) free(j->comp[i].plane);
    free(j);
    if (st == WASTE_OK)
        *out = img;
    else
        wimg_free(&img);
    return st;
}

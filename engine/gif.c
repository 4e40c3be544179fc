/*
 * gif.c -- GIF decoding: the first frame only (an upload is a still
 * picture), LZW, global or local palette, interlaced or not.
 *
 * The canvas is the logical screen, filled with the background colour; the
 * frame is drawn at its offset and clipped.  Transparency is ignored.  LZW
 * output stops at exactly width*height pixels, so no code stream can make the
 * decoder write or loop beyond the frame.
 */
#include "image_codec.h"
#include "detail.h"

#include <string.h>

#define LZW_MAX_CODES 4096

/* Bits from a chain of GIF sub-blocks (length byte, then that many bytes). */
typedef struct {
    const uint8_t *data;
    size_t n, pos;    /* next byte to read */
    size_t block_end; /* end of the current sub-block */
    int ended;        /* the zero-length terminator was reached */
    uint32_t bits;
    int nbits;
} subblock_bits;

static int next_byte(subblock_bits *b, uint8_t *out) {
    while (!b->ended && b->pos == b->block_end) {
        if (b->pos >= b->n) return 0;
        size_t len = b->data[b->pos++];
        if (len == 0)
            b->ended = 1;
        else if (len > b->n - b->pos)
            return 0;
        b->block_end = b->pos + len;
    }
    if (b->ended) return 0;
    *out = b->data[b->pos++];
    return 1;
}

/* Read one LSB-first code of size bits; -1 when the data runs out. */
static int read_code(subblock_bits *b, int size) {
    while (b->nbits < size) {
        uint8_t byte;
        if (!next_byte(b, &byte)) return -1;
        b->bits |= (uint32_t)byte << b->nbits;
        b->nbits += 8;
    }
    int code = (int)(b->bits & ((1u << size) - 1));
    b->bits >>= size;
    b->nbits -= size;
    return code;
}

/* Where decoded pixels go: frame geometry, canvas, palette. */
typedef struct {
    wimg *canvas;
    int left, top, fw, fh, interlaced;
    const uint8_t *palette;
    int n_palette;
    int x, seq; /* next pixel: column and row in stream order */
    int y;      /* that row's place in the frame */
} frame_out;

/* Row of the frame that the seq-th transmitted row lands on. */
static int frame_row(int seq, int h, int interlaced) {
    static const int start[4] = {0, 4, 2, 1}, step[4] = {8, 8, 4, 2};
    if (!interlaced) return seq;
    for (int p = 0; p < 4; p++) {
        int count = h > start[p] ? (h - start[p] + step[p] - 1) / step[p] : 0;
        if (seq < count) return start[p] + seq * step[p];
        seq -= count;
    }
    return h; /* unreachable for seq < h */
}

/* Store one palette index; 1 = the frame is complete, -1 = bad index. */
static int put_pixel(frame_out *f, int index) {
    if (index >= f->n_palette) return -1;
    int cx = f->left + f->x, cy = f->top + f->y;
    if (cx < f->canvas->w && cy < f->canvas->h)
        memcpy(f->canvas->rgb + ((size_t)cy * (size_t)f->canvas->w + (size_t)cx) * 3,
               f->palette + 3 * index, 3);
    if (++f->x < f->fw) return 0;
    f->x = 0;
    if (++f->seq == f->fh) return 1;
    f->y = frame_row(f->seq, f->fh, f->interlaced);
    return 0;
}

static waste_status decode_lzw(subblock_bits *in, int min_size, frame_out *f, char *err,
                               size_t errcap) {
    uint16_t prefix[LZW_MAX_CODES];
    uint8_t suffix[LZW_MAX_CODES];
    uint8_t stack[LZW_MAX_CODES + 1];
    const int clear = 1 << min_size, eoi = clear + 1;
    int size = min_size + 1, next = clear + 2, prev = -1;
    uint8_t first = 0; /* first byte of the previous code's string */
    for (;;) {
        int code = read_code(in, size);
        if (code < 0 || code == eoi)
            return wdetail(err, errcap, WASTE_E_FORMAT, "GIF image data ends after %d of %d rows",
                             f->seq, f->fh);
        if (code == clear) {
            size = min_size + 1;
            next = clear + 2;
            prev = -1;
            continue;
        }
        if (code > next || (prev < 0 && code >= clear))
            return wdetail(err, errcap, WASTE_E_FORMAT, "GIF LZW code %d is not yet defined",
                             code);
        int depth = 0, c = code;
        if (code == next) { /* the string being defined: prev's string plus its first byte */
            stack[depth++] = first;
            c = prev;
        }
        while (c >= clear) { /* prefixes always point to lower codes, so this ends */
            stack[depth++] = suffix[c];
            c = prefix[c];
        }
        stack[depth++] = (uint8_t)c;
        first = (uint8_t)c;
        if (prev >= 0 && next < LZW_MAX_CODES) {
            prefix[next] = (uint16_t)prev;
            suffix[next] = first;
            if (++next == 1 << size && size < 12) size++;
        }
        prev = code;
        while (depth > 0) {
            int r = put_pixel(f, stack[--depth]);
            if (r < 0)
                return wdetail(err, errcap, WASTE_E_FORMAT,
                                 "GIF pixel uses palette index %d of %d", stack[depth],
                                 f->n_palette);
            if (r > 0) return WASTE_OK;
        }
    }
}

/* Skip a chain of sub-blocks starting at *pos; 0 if it runs off the end. */
static int skip_subblocks(const uint8_t *data, size_t n, size_t *pos) {
    while (*pos < n) {
        size_t len = data[(*pos)++];
        if (len == 0) return 1;
        if (len > n - *pos) return 0;
        *pos += len;
    }
    return 0;
}

waste_status wimg_decode_gif(const uint8_t *data, size_t n, wimg *out, char *err, size_t errcap) {
    if (n < 13)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                         "GIF is truncated before its screen descriptor");
    int sw = (int)wimg_le16(data + 6), sh = (int)wimg_le16(data + 8), flags = data[10],
        bg = data[11];
    waste_status st = wimg_check_size("GIF", (uint64_t)sw, (uint64_t)sh, 1, err, errcap);
    if (st != WASTE_OK) return st;
    size_t pos = 13;
    const uint8_t *global = NULL;
    int n_global = 0;
    if (flags & 0x80) {
        n_global = 2 << (flags & 7);
        if ((size_t)n_global * 3 > n - pos)
            return wdetail(err, errcap, WASTE_E_FORMAT, "GIF global colour table is truncated");
        global = data + pos;
        pos += (size_t)n_global * 3;
    }
    /* Skip extensions up to the first image descriptor. */
    for (;;) {
        if (pos >= n)
            return wdetail(err, errcap, WASTE_E_FORMAT,
                             "GIF is truncated before its first image");
        uint8_t block = data[pos++];
        if (block == 0x2c) break;
        if (block != 0x21)
            return wdetail(err, errcap, WASTE_E_FORMAT,
                             block == 0x3b ? "GIF has no image" : "GIF has unknown block 0x%02x",
                             block);
        pos++; /* extension label, then sub-blocks */
        if (pos >= n || !skip_subblocks(data, n, &pos))
            return wdetail(err, errcap, WASTE_E_FORMAT, "GIF extension block is truncated");
    }
    if (n - pos < 9)
        return wdetail(err, errcap, WASTE_E_FORMAT, "GIF image descriptor is truncated");
    frame_out f = {0};
    f.left = (int)wimg_le16(data + pos);
    f.top = (int)wimg_le16(data + pos + 2);
    f.fw = (int)wimg_le16(data + pos + 4);
    f.fh = (int)wimg_le16(data + pos + 6);
    int iflags = data[pos + 8];
    f.interlaced = (iflags & 0x40) != 0;
    pos += 9;
    st = wimg_check_size("GIF frame", (uint64_t)f.fw, (uint64_t)f.fh, 1, err, errcap);
    if (st != WASTE_OK) return st;
    f.palette = global;
    f.n_palette = n_global;
    if (iflags & 0x80) {
        f.n_palette = 2 << (iflags & 7);
        if ((size_t)f.n_palette * 3 > n - pos)
            return wdetail(err, errcap, WASTE_E_FORMAT, "GIF local colour table is truncated");
        f.palette = data + pos;
        pos += (size_t)f.n_palette * 3;
    }
    if (!f.palette) return wdetail(err, errcap, WASTE_E_FORMAT, "GIF image has no colour table");
    if (pos >= n)
        return wdetail(err, errcap, WASTE_E_FORMAT, "GIF is truncated before its image data");
    int min_size = data[pos++];
    if (min_size < 2 || min_size > 8)
        return wdetail(err, errcap, WASTE_E_FORMAT, "GIF LZW minimum code size %d is invalid",
                         min_size);

    wimg canvas;
    st = wimg_alloc(&canvas, sw, sh, err, errcap);
    if (st != WASTE_OK) return st;
    uint8_t background[3] = {0, 0, 0};
    if (global && bg < n_global) memcpy(background, global + 3 * bg, 3);
    for (size_t i = 0; i < (size_t)sw * (size_t)sh; i++) memcpy(canvas.rgb + 3 * i, background, 3);
    f.canvas = &canvas;
    subblock_bits in = {data, n, pos, pos, 0, 0, 0};
    st = decode_lzw(&in, min_size, &f, err, errcap);
    if (st != WASTE_OK) {
        wimg_free(&canvas);
        return st;
    }
    *out = canvas;
    return WASTE_OK;
}

/*
 * imgbuf.h -- decoded-image buffers and the checks every image reader shares.
 * Internal to the image code.
 *
 * It sits below both the per-format decoders (png.c, gif.c, jpeg.c) and the
 * dispatcher (image.c), so neither has to include the other to reach it.
 */
#ifndef WASTE_IMGBUF_H
#define WASTE_IMGBUF_H

#include <stddef.h>
#include <stdint.h>

#include "waste.h"

/* Largest image accepted, in pixels (width * height), and per side. */
#define WIMG_MAX_PIXELS (64u * 1024u * 1024u)
#define WIMG_MAX_SIDE 32768

/* Decoding is bounded tighter than the header check: a decoded image costs
 * 3 bytes a pixel, so 16 Mpixels (e.g. 4096 x 4096) caps the source buffer
 * at 48 MiB.  wimg_decode refuses larger images with WASTE_E_FORMAT. */
#define WIMG_DECODE_MAX_PIXELS (16u * 1024u * 1024u)

/* Largest file wimg_decode reads into memory. */
#define WIMG_MAX_FILE_BYTES (64u * 1024u * 1024u)

typedef struct {
    int w, h;
    uint8_t *rgb; /* w*h*3 bytes, row-major, owned */
} wimg;

/* A short reason for a failed open; strerror is not thread-safe everywhere. */
const char *wimg_open_reason(int err_no);

/* Zero, over-limit (WIMG_MAX_SIDE / WIMG_MAX_PIXELS) or over-decode-bound
 * (decode != 0 and more than WIMG_DECODE_MAX_PIXELS) sizes fail with
 * WASTE_E_FORMAT. */
waste_status wimg_check_size(const char *what, uint64_t w, uint64_t h, int decode, char *err,
                             size_t errcap);

/* Allocate out->rgb for w x h (size already checked). */
waste_status wimg_alloc(wimg *out, int w, int h, char *err, size_t errcap);

/* Big- and little-endian reads from a buffer the caller has bounds-checked. */
static inline uint32_t wimg_be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline uint32_t wimg_be16(const uint8_t *p) { return (uint32_t)p[0] << 8 | p[1]; }
static inline uint32_t wimg_le16(const uint8_t *p) { return (uint32_t)p[1] << 8 | p[0]; }
static inline uint32_t wimg_le24(const uint8_t *p) { return wimg_le16(p) | (uint32_t)p[2] << 16; }
static inline uint32_t wimg_le32(const uint8_t *p) { return wimg_le24(p) | (uint32_t)p[3] << 24; }

/* JPEG markers without a length field (TEM, RSTn, SOI). */
static inline int wimg_jpeg_standalone(uint8_t m) { return m == 0x01 || (m >= 0xd0 && m <= 0xd8); }
/* Frame headers: SOF0..SOF15 minus DHT (C4), JPG (C8) and DAC (CC). */
static inline int wimg_jpeg_is_sof(uint8_t m) {
    return m >= 0xc0 && m <= 0xcf && m != 0xc4 && m != 0xc8 && m != 0xcc;
}

/* Release img->rgb; safe on a zeroed or already freed image. */
void wimg_free(wimg *img);

#endif

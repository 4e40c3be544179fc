/*
 * image_codec.h -- what the per-format decoders (png.c, gif.c, jpeg.c) share
 * with image.c.  Internal to the image code.
 *
 * Each decoder receives the whole file in memory and must treat it as
 * hostile: every read is bounds-checked, dimensions pass wimg_check_size
 * before anything is allocated, and loops are bounded by the input size.
 */
#ifndef WASTE_IMAGE_CODEC_H
#define WASTE_IMAGE_CODEC_H

#include "detail.h"
#include "image.h"

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

waste_status wimg_decode_png(const uint8_t *data, size_t n, wimg *out, char *err, size_t errcap);
waste_status wimg_decode_gif(const uint8_t *data, size_t n, wimg *out, char *err, size_t errcap);
waste_status wimg_decode_jpeg(const uint8_t *data, size_t n, wimg *out, char *err, size_t errcap);

#endif

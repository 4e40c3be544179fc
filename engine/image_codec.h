/*
 * image_codec.h -- the per-format decoders (png.c, gif.c, jpeg.c), called by
 * image.c.  Internal to the image code.
 *
 * Each decoder receives the whole file in memory and must treat it as
 * hostile: every read is bounds-checked, dimensions pass wimg_check_size
 * before anything is allocated, and loops are bounded by the input size.
 */
#ifndef WASTE_IMAGE_CODEC_H
#define WASTE_IMAGE_CODEC_H

#include "imgbuf.h"

waste_status wimg_decode_png(const uint8_t *data, size_t n, wimg *out, char *err, size_t errcap);
waste_status wimg_decode_gif(const uint8_t *data, size_t n, wimg *out, char *err, size_t errcap);
waste_status wimg_decode_jpeg(const uint8_t *data, size_t n, wimg *out, char *err, size_t errcap);

#endif

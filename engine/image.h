/*
 * image.h -- image headers, decoding and the vision tower (see FORMAT.md,
 * "vision.json and vision.bin").  Internal to the engine.
 *
 * Errors follow waste.h: functions return a waste_status and, on failure,
 * write a specific reason into err (errcap bytes, always NUL-terminated).
 * Every decoder treats its input as hostile: truncated, oversized or
 * inconsistent files are errors, never out-of-bounds access or a hang.
 */
#ifndef WASTE_IMAGE_H
#define WASTE_IMAGE_H

#include "imgbuf.h"

/* Width and height from the header of a PNG, JPEG, GIF or WebP file.
 * Errors: WASTE_E_IO, WASTE_E_FORMAT (unknown format, truncated, zero or
 * absurd dimensions). */
waste_status wimg_dimensions(const char *path, int *w, int *h, char *err, size_t errcap);

/* Decode to 8-bit RGB: PNG (every colour type and depth, interlaced too),
 * GIF (first frame) and baseline JPEG.  Alpha is dropped, not composited;
 * 16-bit samples keep their high byte.  Errors: WASTE_E_IO, WASTE_E_FORMAT
 * (malformed, or beyond WIMG_DECODE_MAX_PIXELS), WASTE_E_UNSUPPORTED
 * (WebP, progressive or arithmetic-coded JPEG, CMYK), WASTE_E_OOM.
 * On failure *out is left untouched. */
waste_status wimg_decode(const char *path, wimg *out, char *err, size_t errcap);

typedef struct wvision wvision;

/* Load <dir>/vision.json and <dir>/vision.bin for a model of width hidden.
 * No vision.json: WASTE_E_UNSUPPORTED.  Malformed: WASTE_E_FORMAT. */
waste_status wvision_load(const char *dir, uint32_t hidden, wvision **out,
                          char *err, size_t errcap);

/* Bytes the tower needs when loaded, from the files alone: weights, its
 * activations, and the bounded decode of one source image (file bytes up to
 * WIMG_MAX_FILE_BYTES plus RGB up to WIMG_DECODE_MAX_PIXELS).  Not the
 * embeddings it returns: those are the image queue's.  0 when the container
 * has no tower.  Used by waste_plan_memory.  Malformed files: WASTE_E_FORMAT. */
waste_status wvision_plan(const char *dir, uint32_t hidden, uint64_t *bytes,
                          char *err, size_t errcap);

/* Encode one decoded image into *n_tokens embeddings of hidden floats each,
 * malloc'd into *embeds (caller frees).  Pure: safe to call from several
 * threads on one wvision. */
waste_status wvision_encode(const wvision *vis, const wimg *img, float **embeds,
                            size_t *n_tokens, char *err, size_t errcap);

void wvision_free(wvision *vis);

#endif

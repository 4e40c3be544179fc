/*
 * media.h -- the image queue: encoded images waiting for their media pad
 * tokens.  Each pad token in the input consumes the next embedding row.
 */
#ifndef WASTE_MEDIA_H
#define WASTE_MEDIA_H

#include <stddef.h>
#include <stdint.h>
#include "waste.h"

typedef struct {
    float *rows; /* n * hidden floats, owned */
    size_t n;
} wmedia_image;

typedef struct {
    wmedia_image *images;
    size_t count, cap;
    size_t head;      /* first image with rows left */
    size_t head_used; /* rows of images[head] already consumed */
    size_t queued;    /* rows left in the whole queue */
    size_t max_rows;  /* bound on queued rows */
    uint32_t hidden;
} wmedia;

void wmedia_init(wmedia *q, uint32_t hidden, size_t max_rows);

/* Queue n rows (takes ownership of rows on success).  Exceeding the bound:
 * WASTE_E_ARG. */
waste_status wmedia_push(wmedia *q, float *rows, size_t n, char *err, size_t errcap);

/* Copy the next row into dst and consume it; 0 when the queue is empty. */
int wmedia_take_row(wmedia *q, float *dst);

/* Copy tokens to out, each `pad` replaced by as many pads as the next
 * queued image has rows left.  More pads than images, or a short buffer
 * (needed count in *n_out): WASTE_E_ARG. */
waste_status wmedia_expand(const wmedia *q, int32_t pad, const int32_t *tokens, size_t n,
                           int32_t *out, size_t cap, size_t *n_out, char *err, size_t errcap);

void wmedia_clear(wmedia *q);

#endif

#include "media.h"

#include <stdlib.h>
#include <string.h>

#include "detail.h"

void wmedia_init(wmedia *q, uint32_t hidden, size_t max_rows) {
    memset(q, 0, sizeof *q);
    q->hidden = hidden;
    q->max_rows = max_rows;
}

waste_status wmedia_push(wmedia *q, float *rows, size_t n, char *err, size_t errcap) {
    if (n > q->max_rows - q->queued)
        return wdetail(err, errcap, WASTE_E_ARG,
                       "image queue full: %zu positions queued, this image needs %zu, the bound is %zu",
                       q->queued, n, q->max_rows);
    if (q->count == q->cap) {
        size_t cap = q->cap ? 2 * q->cap : 4;
        wmedia_image *grown = realloc(q->images, cap * sizeof *grown);
        if (!grown) return wdetail(err, errcap, WASTE_E_OOM, "out of memory for the image queue");
        q->images = grown;
        q->cap = cap;
    }
    q->images[q->count++] = (wmedia_image){rows, n};
    q->queued += n;
    return WASTE_OK;
}

int wmedia_take_row(wmedia *q, float *dst) {
    if (q->queued == 0) return 0;
    wmedia_image *img = &q->images[q->head];
    memcpy(dst, img->rows + q->head_used * q->hidden, q->hidden * sizeof *dst);
    q->queued--;
    if (++q->head_used == img->n) { /* fully consumed: its memory goes back now */
        free(img->rows);
        img->rows = NULL;
        q->head++;
        q->head_used = 0;
    }
    return 1;
}

waste_status wmedia_expand(const wmedia *q, int32_t pad, const int32_t *tokens, size_t n,
                           int32_t *out, size_t cap, size_t *n_out, char *err, size_t errcap) {
    size_t need = 0, image = q->head;
    for (size_t i = 0; i < n; i++) {
        if (tokens[i] != pad || pad < 0) {
            need++;
            continue;
        }
        if (image >= q->count)
            return wdetail(err, errcap, WASTE_E_ARG,
                           "media placeholder %zu has no queued image (%zu queued)", image - q->head + 1,
                           q->count - q->head);
        need += q->images[image].n - (image == q->head ? q->head_used : 0);
        image++;
    }
    *n_out = need;
    if (need > cap)
        return wdetail(err, errcap, WASTE_E_ARG, "output holds %zu tokens, expansion needs %zu", cap, need);
    size_t w = 0;
    image = q->head;
    for (size_t i = 0; i < n; i++) {
        if (tokens[i] != pad || pad < 0) {
            out[w++] = tokens[i];
            continue;
        }
        size_t rows = q->images[image].n - (image == q->head ? q->head_used : 0);
        for (size_t r = 0; r < rows; r++) out[w++] = pad;
        image++;
    }
    return WASTE_OK;
}

void wmedia_clear(wmedia *q) {
    for (size_t i = q->head; i < q->count; i++) free(q->images[i].rows);
    free(q->images);
    wmedia_init(q, q->hidden, q->max_rows);
}

/*
 * imgbuf.c -- size checks and RGB buffers shared by every image reader.
 */
#include "imgbuf.h"

#include <errno.h>
#include <stdlib.h>

#include "detail.h"

const char *wimg_open_reason(int err_no) {
    switch (err_no) {
    case ENOENT: return "no such file";
    case EACCES: return "permission denied";
    case EISDIR: return "is a directory";
    default: return "cannot be opened";
    }
}

waste_status wimg_check_size(const char *what, uint64_t w, uint64_t h, int decode, char *err,
                             size_t errcap) {
    unsigned long long lw = w, lh = h;
    if (w == 0 || h == 0)
        return wdetail(err, errcap, WASTE_E_FORMAT, "%s declares an empty image (%llux%llu)",
                         what, lw, lh);
    if (w > WIMG_MAX_SIDE || h > WIMG_MAX_SIDE)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                         "%s image is %llux%llu; a side may be at most %d pixels", what, lw, lh,
                         WIMG_MAX_SIDE);
    if (w * h > WIMG_MAX_PIXELS) /* both sides <= 2^15: no overflow */
        return wdetail(err, errcap, WASTE_E_FORMAT,
                         "%s image is %llux%llu; at most %u pixels are accepted", what, lw, lh,
                         WIMG_MAX_PIXELS);
    if (decode && w * h > WIMG_DECODE_MAX_PIXELS)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                         "%s image is %llux%llu; this engine decodes at most %u pixels", what, lw,
                         lh, WIMG_DECODE_MAX_PIXELS);
    return WASTE_OK;
}

waste_status wimg_alloc(wimg *out, int w, int h, char *err, size_t errcap) {
    out->w = w;
    out->h = h;
    out->rgb = malloc((size_t)w * (size_t)h * 3);
    if (!out->rgb) return wdetail(err, errcap, WASTE_E_OOM, "no memory for a %dx%d image", w, h);
    return WASTE_OK;
}

void wimg_free(wimg *img) {
    if (!img) return;
    free(img->rgb);
    img->rgb = NULL;
    img->w = img->h = 0;
}

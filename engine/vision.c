/*
 * vision.c -- the reference vision tower (FORMAT.md, "vision.json and
 * vision.bin"): resize, patchify, project, merge, project again.
 *
 * Choices the format leaves open:
 *   - bilinear resizing samples at pixel centres (src = (dst + 0.5) * W/W' -
 *     0.5, clamped to the edge), straight from the 8-bit source, without
 *     rounding the resized values back to 8 bits;
 *   - gelu is the tanh approximation;
 *   - the patch rmsnorm uses eps 1e-5.
 * The tower works one merge block at a time, so its activations are one
 * block's patches, never the whole resized image.  wvision_plan counts
 * those, the weights and the bounded source decode (the file's bytes and
 * the RGB image, both capped in image.h); the embeddings wvision_encode
 * returns belong to the caller's image queue and are counted there.
 *
 * An image never takes more than max_tokens positions: a very thin image,
 * whose short side stays at U, has its long side cut to fit.
 */
#include "image.h"
#include "detail.h"
#include "json.h"
#include "ops.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define VISION_NORM_EPS 1e-5f
#define PATH_CAP 4096

typedef struct {
    int64_t patch, merge, vhidden, max_tokens;
} vision_cfg;

struct wvision {
    vision_cfg cfg;
    uint32_t hidden;
    float *weights; /* all of vision.bin; the pointers below index into it */
    const float *patch_proj, *patch_bias, *norm, *proj, *proj_bias;
};

/* Floats in vision.bin for this config and model width. */
static uint64_t weight_count(const vision_cfg *c, uint32_t hidden) {
    uint64_t patch_in = 3 * (uint64_t)c->patch * (uint64_t)c->patch;
    uint64_t merged = (uint64_t)c->vhidden * (uint64_t)(c->merge * c->merge);
    return (uint64_t)c->vhidden * patch_in + 2 * (uint64_t)c->vhidden + (uint64_t)hidden * merged +
           hidden;
}

/* Read vision.json.  A missing file is WASTE_E_UNSUPPORTED (no tower). */
static waste_status read_config(const char *dir, uint32_t hidden, vision_cfg *cfg, char *err,
                                size_t errcap) {
    char path[PATH_CAP];
    if ((size_t)snprintf(path, sizeof path, "%s/vision.json", dir) >= sizeof path)
        return wdetail(err, errcap, WASTE_E_ARG, "model path is too long");
    struct stat st;
    if (stat(path, &st) != 0 && errno == ENOENT)
        return wdetail(err, errcap, WASTE_E_UNSUPPORTED,
                         "the container has no vision tower (no vision.json)");
    if (hidden == 0 || hidden > 65536)
        return wdetail(err, errcap, WASTE_E_ARG, "model width %u is invalid", hidden);
    json_value *root;
    waste_status s = json_load_file(path, &root, err, errcap);
    if (s != WASTE_OK) return s;
    const struct {
        const char *key;
        int64_t max; /* generous bounds that still keep every size product small */
        int64_t *field;
    } keys[] = {
        {"patch_size", 64, &cfg->patch},
        {"merge", 8, &cfg->merge},
        {"vision_hidden", 4096, &cfg->vhidden},
        {"max_tokens", 16384, &cfg->max_tokens},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        if (!json_int(json_get(root, keys[i].key), 1, keys[i].max, keys[i].field)) {
            json_free(root);
            return wdetail(err, errcap, WASTE_E_FORMAT,
                             "vision.json: %s must be an integer in 1..%lld", keys[i].key,
                             (long long)keys[i].max);
        }
    }
    json_free(root);
    return WASTE_OK;
}

/* Size of vision.bin must match the config exactly. */
static waste_status check_weights_file(const char *path, uint64_t floats, char *err,
                                       size_t errcap) {
    struct stat st;
    if (stat(path, &st) != 0)
        return wdetail(err, errcap, WASTE_E_IO, "cannot open %s: %s", path,
                         wimg_open_reason(errno));
    if ((uint64_t)st.st_size != floats * 4)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                         "vision.bin is %llu bytes; vision.json and the model width need %llu",
                         (unsigned long long)st.st_size, (unsigned long long)(floats * 4));
    return WASTE_OK;
}

/* Validate vision.json and the size of vision.bin (whose path goes to bin). */
static waste_status check_tower(const char *dir, uint32_t hidden, vision_cfg *cfg,
                                char bin[PATH_CAP], char *err, size_t errcap) {
    waste_status s = read_config(dir, hidden, cfg, err, errcap);
    if (s != WASTE_OK) return s;
    snprintf(bin, PATH_CAP, "%s/vision.bin", dir); /* fits: vision.json's path did */
    return check_weights_file(bin, weight_count(cfg, hidden), err, errcap);
}

waste_status wvision_plan(const char *dir, uint32_t hidden, uint64_t *bytes, char *err,
                          size_t errcap) {
    vision_cfg c;
    char bin[PATH_CAP];
    waste_status s = check_tower(dir, hidden, &c, bin, err, errcap);
    if (s == WASTE_E_UNSUPPORTED) {
        *bytes = 0;
        return WASTE_OK;
    }
    if (s != WASTE_OK) return s;
    uint64_t floats = weight_count(&c, hidden);
    uint64_t block_in = (uint64_t)(c.merge * c.merge) * (uint64_t)c.vhidden;
    uint64_t activations =
        3 * (uint64_t)(c.patch * c.patch) + (uint64_t)c.vhidden + block_in; /* one block */
    uint64_t resize_maps = 2 * (uint64_t)WIMG_MAX_SIDE * (sizeof(int) + sizeof(float));
    uint64_t decode = (uint64_t)WIMG_MAX_FILE_BYTES + (uint64_t)WIMG_DECODE_MAX_PIXELS * 3;
    *bytes = sizeof(wvision) + (floats + activations) * sizeof(float) + resize_maps + decode;
    return WASTE_OK;
}

/* Read n little-endian f32 values. */
static int read_floats(FILE *f, float *out, uint64_t n) {
    if (fread(out, sizeof(float), (size_t)n, f) != n) return 0;
    uint8_t *b = (uint8_t *)out;
    for (uint64_t i = 0; i < n; i++, b += 4) { /* no-op on little-endian hosts, correct on all */
        uint32_t u =
            (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
        memcpy(b, &u, 4);
    }
    return 1;
}

waste_status wvision_load(const char *dir, uint32_t hidden, wvision **out, char *err,
                          size_t errcap) {
    vision_cfg c;
    char bin[PATH_CAP];
    waste_status s = check_tower(dir, hidden, &c, bin, err, errcap);
    if (s != WASTE_OK) return s;
    uint64_t floats = weight_count(&c, hidden);
    wvision *v = calloc(1, sizeof *v);
    if (v) v->weights = malloc((size_t)floats * sizeof(float));
    if (!v || !v->weights) {
        wvision_free(v);
        return wdetail(err, errcap, WASTE_E_OOM, "no memory for %llu vision weights",
                         (unsigned long long)floats);
    }
    FILE *f = fopen(bin, "rb");
    int ok = f && read_floats(f, v->weights, floats);
    if (f) fclose(f);
    if (!ok) {
        wvision_free(v);
        return wdetail(err, errcap, WASTE_E_IO, "short read from %s", bin);
    }
    v->cfg = c;
    v->hidden = hidden;
    size_t patch_in = 3 * (size_t)(c.patch * c.patch), vh = (size_t)c.vhidden;
    v->patch_proj = v->weights;
    v->patch_bias = v->patch_proj + vh * patch_in;
    v->norm = v->patch_bias + vh;
    v->proj = v->norm + vh;
    v->proj_bias = v->proj + (size_t)hidden * vh * (size_t)(c.merge * c.merge);
    *out = v;
    return WASTE_OK;
}

void wvision_free(wvision *vis) {
    if (!vis) return;
    free(vis->weights);
    free(vis);
}

/* ------------------------------------------------------------- encoding */

/* One axis of the bilinear resize: for each output coordinate, the lower
 * source index and the weight of the upper one. */
typedef struct {
    int *lo;
    float *frac;
} axis_map;

static int axis_map_init(axis_map *m, int src, int dst) {
    m->lo = malloc((size_t)dst * sizeof *m->lo);
    m->frac = malloc((size_t)dst * sizeof *m->frac);
    if (!m->lo || !m->frac) return 0;
    double scale = (double)src / dst;
    for (int i = 0; i < dst; i++) {
        double s = (i + 0.5) * scale - 0.5;
        if (s < 0) s = 0;
        if (s > src - 1) s = src - 1;
        int lo = (int)s;
        m->lo[i] = lo;
        m->frac[i] = (float)(s - lo);
    }
    return 1;
}

static void axis_map_free(axis_map *m) {
    free(m->lo);
    free(m->frac);
}

/* Channel c of resized pixel (x, y), as a float in 0..255. */
static float bilinear(const wimg *img, const axis_map *mx, const axis_map *my, int x, int y,
                      int c) {
    int x0 = mx->lo[x], y0 = my->lo[y];
    int x1 = x0 + 1 < img->w ? x0 + 1 : x0, y1 = y0 + 1 < img->h ? y0 + 1 : y0;
    float fx = mx->frac[x], fy = my->frac[y];
    const uint8_t *p = img->rgb;
    size_t w = (size_t)img->w;
    float top = p[((size_t)y0 * w + (size_t)x0) * 3 + (size_t)c] * (1 - fx) +
                p[((size_t)y0 * w + (size_t)x1) * 3 + (size_t)c] * fx;
    float bot = p[((size_t)y1 * w + (size_t)x0) * 3 + (size_t)c] * (1 - fx) +
                p[((size_t)y1 * w + (size_t)x1) * 3 + (size_t)c] * fx;
    return top * (1 - fy) + bot * fy;
}

static float gelu(float x) {
    const float k = 0.7978845608f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

/* Resized size along one side: a multiple of U, at least U. */
static int resized_side(int side, double s, int u) {
    int n = (int)floor(side * s / u) * u;
    return n < u ? u : n;
}

/* Patch at resized pixel (x0, y0) -> normalised vision_hidden features. */
static void encode_patch(const wvision *v, const wimg *img, const axis_map *mx, const axis_map *my,
                         int x0, int y0, float *pixels, float *feat) {
    int p = (int)v->cfg.patch;
    size_t vh = (size_t)v->cfg.vhidden;
    for (int c = 0; c < 3; c++)
        for (int y = 0; y < p; y++)
            for (int x = 0; x < p; x++)
                pixels[(c * p + y) * p + x] =
                    bilinear(img, mx, my, x0 + x, y0 + y, c) / 127.5f - 1.0f;
    /* the tower is small: no pool, the caller's thread */
    wops_matvec(NULL, feat, v->patch_proj, pixels, vh, 3 * (size_t)(p * p));
    for (size_t i = 0; i < vh; i++) feat[i] = gelu(feat[i] + v->patch_bias[i]);
    wops_rmsnorm(feat, feat, v->norm, vh, VISION_NORM_EPS);
}

waste_status wvision_encode(const wvision *vis, const wimg *img, float **embeds, size_t *n_tokens,
                            char *err, size_t errcap) {
    if (!vis || !img || !img->rgb || img->w <= 0 || img->h <= 0 || img->w > WIMG_MAX_SIDE ||
        img->h > WIMG_MAX_SIDE)
        return wdetail(err, errcap, WASTE_E_ARG, "no image to encode");
    const vision_cfg *c = &vis->cfg;
    int u = (int)(c->patch * c->merge), m = (int)c->merge, p = (int)c->patch;
    double s = sqrt((double)c->max_tokens * u * u / ((double)img->w * img->h));
    if (s > 1) s = 1;
    int rw = resized_side(img->w, s, u), rh = resized_side(img->h, s, u);
    size_t gx = (size_t)(rw / u), gy = (size_t)(rh / u), max = (size_t)c->max_tokens;
    if (gx * gy > max) { /* thin image: cut the long side */
        if (gx > gy) gx = max / gy; else gy = max / gx;
        rw = (int)gx * u;
        rh = (int)gy * u;
    }
    size_t n = gx * gy;
    size_t vh = (size_t)c->vhidden, block = (size_t)(m * m) * vh, hidden = vis->hidden;

    float *out = malloc(n * hidden * sizeof *out);
    float *pixels = malloc(3 * (size_t)(p * p) * sizeof *pixels);
    float *feats = malloc(block * sizeof *feats);
    axis_map mx = {NULL, NULL}, my = {NULL, NULL};
    int ok =
        out && pixels && feats && axis_map_init(&mx, img->w, rw) && axis_map_init(&my, img->h, rh);
    if (ok) {
        for (size_t t = 0; t < n; t++) {
            size_t bx = t % gx, by = t / gx;
            for (int k = 0; k < m * m; k++) /* patches row-major within the block */
                encode_patch(vis, img, &mx, &my, (int)(bx * (size_t)u) + (k % m) * p,
                             (int)(by * (size_t)u) + (k / m) * p, pixels, feats + (size_t)k * vh);
            float *e = out + t * hidden;
            wops_matvec(NULL, e, vis->proj, feats, hidden, block);
            for (size_t i = 0; i < hidden; i++) e[i] += vis->proj_bias[i];
        }
    }
    free(pixels);
    free(feats);
    axis_map_free(&mx);
    axis_map_free(&my);
    if (!ok) {
        free(out);
        return wdetail(err, errcap, WASTE_E_OOM, "no memory to encode a %dx%d image", img->w,
                         img->h);
    }
    *embeds = out;
    *n_tokens = n;
    return WASTE_OK;
}

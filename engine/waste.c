/*
 * waste.c -- the public libwaste API: configuration, planning, lifecycle,
 * and the glue between the tokenizer, the model, the expert cache and the
 * image queue.  The numeric and I/O work lives in the modules it includes.
 */
#include "waste.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>
#include <zlib.h>

#include "checkpoint.h"
#include "detail.h"
#include "experts.h"
#include "image.h"
#include "manifest.h"
#include "media.h"
#include "model.h"
#include "prof.h"
#include "sample.h"
#include "simd.h"
#include "sys.h"
#include "tokenizer.h"

#define ENGINE_VERSION "0.6.2"
#define ENGINE_VERSION_NUMBER 602
#define CONTAINER_VERSION 1
#define DEFAULT_CTX 4096
#define DETAIL_MAX 1024
#define PATH_MAX_LEN 4096

struct waste_ctx {
    char dir[PATH_MAX_LEN];
    char usage_path[PATH_MAX_LEN];
    wmanifest m;
    wweights w;
    wstate s;
    wexperts x;
    wtok *tok;
    wvision *vision;
    wmedia media;
    wcpus cpus;
    wpool *pool;
    waste_memplan used;
    int lock_fd;
    int32_t bos, eos, media_pad;
    uint32_t fingerprint;
    char quant_summary[96];
    uint64_t tokens_generated;
    double ms_total;
    double delay_ms; /* WASTE_DELAY_MS: added per evaluated token, a slow engine's clock for tests */
    char detail[DETAIL_MAX];
    int has_detail;
};

/* Failures of calls without a ctx (open, plan) are kept per thread. */
static _Thread_local char thread_detail[DETAIL_MAX];
static _Thread_local int thread_has_detail;

/* ------------------------------------------------------------ status text */

const char *waste_strerror(waste_status status) {
    switch (status) {
    case WASTE_OK: return "success";
    case WASTE_E_IO: return "I/O error: a file is missing, short or fails its checksum";
    case WASTE_E_FORMAT: return "the container or file is malformed or of the wrong version";
    case WASTE_E_RAM_BUDGET: return "the RAM budget is below the model's floor";
    case WASTE_E_OOM: return "out of memory";
    case WASTE_E_ARG: return "invalid argument";
    case WASTE_E_UNSUPPORTED: return "not supported by this build or container";
    case WASTE_E_CANCELLED: return "cancelled by the token callback";
    case WASTE_E_BUSY: return "another owner holds this container";
    }
    return "unknown waste status";
}

const char *waste_version(void) { return ENGINE_VERSION; }

int waste_version_number(void) { return ENGINE_VERSION_NUMBER; }

/* Names the kernels this process runs (simd.h): they are chosen at run time. */
const char *waste_build_info(void) {
#define BUILD_INFO(kernels)                                                                        \
    "waste reference engine " ENGINE_VERSION ": C11, batched prefill, " kernels " kernels, pthreads, " \
    "container waste-ref v1, state v2"
    switch (wsimd_level()) {
    case WSIMD_AVX512: return BUILD_INFO("AVX-512");
    case WSIMD_AVX2: return BUILD_INFO("AVX2");
    default: return BUILD_INFO("plain C");
    }
#undef BUILD_INFO
}

/* ------------------------------------------------------------ error detail */

static void clear_detail(waste_ctx *ctx) {
    ctx->has_detail = 0;
    ctx->detail[0] = '\0';
}

static void clear_thread_detail(void) {
    thread_has_detail = 0;
    thread_detail[0] = '\0';
}

/* Mark a failure on ctx; callers write the specific text into
 * ctx->detail first, the generic text stands in when they did not. */
static waste_status ctx_fail(waste_ctx *ctx, waste_status st) {
    if (st != WASTE_OK) {
        if (ctx->detail[0] == '\0') snprintf(ctx->detail, sizeof ctx->detail, "%s", waste_strerror(st));
        ctx->has_detail = 1;
    }
    return st;
}

static waste_status thread_fail(waste_status st) {
    if (st != WASTE_OK) {
        if (thread_detail[0] == '\0')
            snprintf(thread_detail, sizeof thread_detail, "%s", waste_strerror(st));
        thread_has_detail = 1;
    }
    return st;
}

const char *waste_error_detail(const waste_ctx *ctx) {
    if (!ctx) return thread_has_detail ? thread_detail : NULL;
    return ctx->has_detail ? ctx->detail : NULL;
}

/* --------------------------------------------------------------- defaults */

void waste_cfg_init(waste_cfg *cfg) {
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->cache_policy = WASTE_CACHE_LFRU;
    cfg->use_direct_io = 1;
}

void waste_gen_params_init(waste_gen_params *p) {
    if (!p) return;
    memset(p, 0, sizeof *p);
    p->top_p = 1.0f;
    p->max_tokens = 256;
}

uint64_t waste_physical_ram(void) { return wsys_physical_ram(); }

uint64_t waste_usable_ram(void) { return wsys_usable_ram(); }

/* --------------------------------------------------------------- planning */

static uint64_t all_experts_bytes(const wmanifest *m) {
    return (uint64_t)wmanifest_moe_layers(m) * m->n_experts * wmanifest_record_stride(m);
}

/* The image queue may hold at most one context's worth of embeddings. */
static uint64_t media_queue_bytes(const wmanifest *m, uint32_t ctx) {
    return (uint64_t)ctx * m->hidden * sizeof(float);
}

/* The plan from the manifest, the bank headers and (with_vision) vision.json
 * alone.  Without vision a damaged tower does not keep the text model shut. */
static waste_status plan(const char *dir, const wmanifest *m, uint32_t ctx, int with_vision,
                         waste_memplan *out, char *err, size_t errcap) {
    for (uint32_t l = m->n_dense_layers; l < m->n_layers; l++) {
        waste_status st = wbank_check(dir, m, l, err, errcap);
        if (st != WASTE_OK) return st;
    }
    uint64_t tower = 0;
    waste_status st = with_vision ? wvision_plan(dir, m->hidden, &tower, err, errcap) : WASTE_OK;
    if (st != WASTE_OK) return st;
    waste_memplan p = {0};
    p.trunk_bytes = wmanifest_trunk_bytes(m);
    p.state_bytes = wstate_kv_bytes(m, ctx);
    p.scratch_bytes = wstate_scratch_bytes(m, ctx);
    p.min_expert_cache = wmanifest_record_stride(m);
    p.floor_bytes = p.trunk_bytes + p.state_bytes + p.scratch_bytes + p.min_expert_cache;
    p.recommended_bytes = p.floor_bytes + all_experts_bytes(m);
    p.vision_bytes = tower ? tower + media_queue_bytes(m, ctx) : 0;
    p.working_set_bytes = (uint64_t)m->top_k * wmanifest_moe_layers(m) * wmanifest_record_stride(m);
    *out = p;
    return WASTE_OK;
}

/* The context a plan or an open uses: ctx_tokens, or by default 4096 (the
 * container's context_length when that is smaller).  A context above the
 * declared context_length is refused: the model was never trained to attend
 * that far, and a host asking for candidates learns the maximum from it. */
static waste_status resolve_ctx(const wmanifest *m, uint32_t ctx_tokens, uint32_t *ctx, char *err,
                                size_t errcap) {
    uint32_t most = m->context_length;
    *ctx = ctx_tokens ? ctx_tokens : most && most < DEFAULT_CTX ? most : DEFAULT_CTX;
    if (most && *ctx > most)
        return wdetail(err, errcap, WASTE_E_ARG,
                       "a %u-token context is above the model's context_length of %u", *ctx, most);
    return WASTE_OK;
}

waste_status waste_plan_memory(const char *model_path, uint32_t ctx_tokens,
                               waste_memplan *out) {
    clear_thread_detail();
    if (!model_path || !out) {
        snprintf(thread_detail, sizeof thread_detail, "waste_plan_memory: NULL argument");
        return thread_fail(WASTE_E_ARG);
    }
    wmanifest m;
    uint32_t ctx = 0;
    waste_status st = wmanifest_load(model_path, &m, thread_detail, sizeof thread_detail);
    if (st == WASTE_OK) st = resolve_ctx(&m, ctx_tokens, &ctx, thread_detail, sizeof thread_detail);
    if (st == WASTE_OK) st = plan(model_path, &m, ctx, 1, out, thread_detail, sizeof thread_detail);
    return thread_fail(st);
}

/* ------------------------------------------------------------------- open */

/* Settle the budget and the cache size it leaves.  Budget 0: everything
 * when it fits in half of usable RAM, never less than the floor. */
static waste_status resolve_budget(const waste_memplan *p, const wmanifest *m, uint64_t budget,
                                   int vision, waste_memplan *used, uint32_t *capacity, char *err,
                                   size_t errcap) {
    uint64_t vision_bytes = vision ? p->vision_bytes : 0;
    uint64_t need = p->floor_bytes + vision_bytes, stride = wmanifest_record_stride(m);
    uint64_t total = (uint64_t)wmanifest_moe_layers(m) * m->n_experts;
    if (budget == 0) {
        uint64_t usable = wsys_usable_ram(), half = usable / 2, all = p->recommended_bytes + vision_bytes;
        if (usable && need > usable)
            return wdetail(err, errcap, WASTE_E_RAM_BUDGET,
                           "the model needs at least %llu bytes; this process may use %llu",
                           (unsigned long long)need, (unsigned long long)usable);
        budget = all < half || !usable ? all : half;
        if (budget < need) budget = need;
    }
    if (budget < need)
        return wdetail(err, errcap, WASTE_E_RAM_BUDGET,
                       "budget %llu bytes is below the floor of %llu bytes%s",
                       (unsigned long long)budget, (unsigned long long)need,
                       vision ? " (vision included)" : "");
    uint64_t records = 1 + (budget - need) / stride;
    *capacity = (uint32_t)(records < total ? records : total);
    *used = *p;
    used->recommended_bytes = p->floor_bytes - p->min_expert_cache + (uint64_t)*capacity * stride;
    used->vision_bytes = vision_bytes;
    return WASTE_OK;
}

static waste_status lock_container(waste_ctx *ctx, char *err, size_t errcap) {
    char path[PATH_MAX_LEN + 32];
    snprintf(path, sizeof path, "%s/manifest.json", ctx->dir);
    ctx->lock_fd = open(path, O_RDONLY | O_CLOEXEC);
    if (ctx->lock_fd < 0) return wdetail(err, errcap, WASTE_E_IO, "%s: %s", path, strerror(errno));
    if (flock(ctx->lock_fd, LOCK_EX | LOCK_NB) != 0)
        return wdetail(err, errcap, errno == EWOULDBLOCK ? WASTE_E_BUSY : WASTE_E_IO,
                       "%s: exclusive lock %s", path,
                       errno == EWOULDBLOCK ? "is held by another owner" : strerror(errno));
    return WASTE_OK;
}

static waste_status load_tokenizer(waste_ctx *ctx, char *err, size_t errcap) {
    const wtok_options opt = {ctx->m.vocab_size, ctx->m.pretokenizer, ctx->m.unk_token};
    waste_status st = wtok_load_with(ctx->dir, &opt, &ctx->tok, err, errcap);
    if (st != WASTE_OK) return st;
    const struct { const char *key, *text; int32_t *id; int required; } names[] = {
        {"bos_token", ctx->m.bos_token, &ctx->bos, 1},
        {"eos_token", ctx->m.eos_token, &ctx->eos, 1},
        {"media_pad_token", ctx->m.media_pad_token, &ctx->media_pad, ctx->m.media_pad_token[0] != 0},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].id = names[i].required ? wtok_special_id(ctx->tok, names[i].text) : -1;
        if (names[i].required && *names[i].id < 0)
            return wdetail(err, errcap, WASTE_E_FORMAT, "manifest %s \"%s\" is not in specials.json",
                           names[i].key, names[i].text);
    }
    return WASTE_OK;
}

/* Fingerprint for state files: manifest, trunk weights, engine format. */
static uint32_t model_fingerprint(const wmanifest *m, const wweights *w) {
    uint32_t parts[3] = {m->crc, w->trunk_crc, CONTAINER_VERSION};
    return (uint32_t)crc32(0L, (const Bytef *)parts, sizeof parts);
}

static waste_status configure_threads(waste_ctx *ctx, const waste_cfg *cfg, char *err, size_t errcap) {
    if (cfg->n_threads < 0)
        return wdetail(err, errcap, WASTE_E_ARG, "n_threads %d is negative", cfg->n_threads);
    if (cfg->cache_policy != WASTE_CACHE_LFRU && cfg->cache_policy != WASTE_CACHE_LRU)
        return wdetail(err, errcap, WASTE_E_ARG, "cache_policy %d is neither LFRU (0) nor LRU (1)",
                       cfg->cache_policy);
    if (cfg->cpu_list) {
        waste_status st = wsys_parse_cpu_list(cfg->cpu_list, &ctx->cpus, err, errcap);
        if (st != WASTE_OK) return st;
    }
    int n = cfg->n_threads ? cfg->n_threads : ctx->cpus.n ? ctx->cpus.n : wsys_available_cpus();
    ctx->pool = wpool_open(n, &ctx->cpus);
    if (!ctx->pool) return wdetail(err, errcap, WASTE_E_OOM, "out of memory for the thread pool");
    return WASTE_OK;
}

static void quant_name(wquant q, char *out, size_t cap) {
    if (q.kind == WQ_Q8) snprintf(out, cap, "Q8G%u", q.group);
    else snprintf(out, cap, "%s", q.kind == WQ_Q4_1 ? "Q4_1" : "F32");
}

/* "experts Q8G32, trunk F32", plus the embeddings when they differ. */
static void describe_quant(const wmanifest *m, char *out, size_t cap) {
    char experts[16], trunk[16], embed[16];
    quant_name(m->expert_q, experts, sizeof experts);
    quant_name(m->weight_q, trunk, sizeof trunk);
    quant_name(m->embed_q, embed, sizeof embed);
    if (strcmp(trunk, embed) == 0) snprintf(out, cap, "experts %s, trunk %s", experts, trunk);
    else snprintf(out, cap, "experts %s, trunk %s, embeddings %s", experts, trunk, embed);
}

static waste_status open_ctx(waste_ctx *ctx, const char *model_path, const waste_cfg *cfg, char *err,
                             size_t errcap) {
    waste_status st;
    const char *verify_env = getenv("WASTE_VERIFY"), *delay_env = getenv("WASTE_DELAY_MS");
    int verify = cfg->verify_records || (verify_env && strcmp(verify_env, "1") == 0);
    uint32_t ctx_tokens = 0, capacity = 0;
    waste_memplan p;

    if (strlen(model_path) >= sizeof ctx->dir)
        return wdetail(err, errcap, WASTE_E_ARG, "model path is too long");
    snprintf(ctx->dir, sizeof ctx->dir, "%s", model_path);
    if (cfg->usage_path && strlen(cfg->usage_path) >= sizeof ctx->usage_path)
        return wdetail(err, errcap, WASTE_E_ARG, "usage_path is too long");
    if (cfg->usage_path) snprintf(ctx->usage_path, sizeof ctx->usage_path, "%s", cfg->usage_path);
    else snprintf(ctx->usage_path, sizeof ctx->usage_path, "%.4080s/usage.waste", model_path);

#define TRY(call) do { if ((st = (call)) != WASTE_OK) return st; } while (0)
    TRY(configure_threads(ctx, cfg, err, errcap));
    TRY(wmanifest_load(ctx->dir, &ctx->m, err, errcap));
    TRY(resolve_ctx(&ctx->m, cfg->ctx_tokens, &ctx_tokens, err, errcap));
    TRY(plan(ctx->dir, &ctx->m, ctx_tokens, cfg->vision, &p, err, errcap));
    if (cfg->vision && p.vision_bytes == 0)
        return wdetail(err, errcap, WASTE_E_UNSUPPORTED, "vision=1 but %s has no vision tower", ctx->dir);
    TRY(resolve_budget(&p, &ctx->m, cfg->ram_budget_bytes, cfg->vision, &ctx->used, &capacity, err, errcap));
    if (cfg->exclusive_open) TRY(lock_container(ctx, err, errcap));
    TRY(load_tokenizer(ctx, err, errcap));
    TRY(wweights_load(&ctx->w, ctx->dir, &ctx->m, err, errcap));
    if (wstate_init(&ctx->s, &ctx->m, ctx_tokens) != WASTE_OK)
        return wdetail(err, errcap, WASTE_E_OOM, "out of memory for a %u-token state", ctx_tokens);
    TRY(wexperts_open(&ctx->x, ctx->dir, &ctx->m, capacity, cfg->cache_policy, cfg->use_direct_io,
                      verify, err, errcap));
    if (cfg->vision) TRY(wvision_load(ctx->dir, ctx->m.hidden, &ctx->vision, err, errcap));
#undef TRY
    wexperts_warm(&ctx->x, ctx->usage_path);
    ctx->delay_ms = delay_env ? strtod(delay_env, NULL) : 0;
    if (!(ctx->delay_ms > 0 && ctx->delay_ms < 60e3)) ctx->delay_ms = 0;
    wmedia_init(&ctx->media, ctx->m.hidden, cfg->vision ? ctx_tokens : 0);
    ctx->fingerprint = model_fingerprint(&ctx->m, &ctx->w);
    describe_quant(&ctx->m, ctx->quant_summary, sizeof ctx->quant_summary);
    return WASTE_OK;
}

waste_status waste_open(const char *model_path, const waste_cfg *cfg, waste_ctx **out) {
    clear_thread_detail();
    if (!out || !model_path) {
        snprintf(thread_detail, sizeof thread_detail, "waste_open: NULL %s", out ? "model_path" : "out");
        return thread_fail(WASTE_E_ARG);
    }
    *out = NULL;
    waste_cfg defaults;
    waste_cfg_init(&defaults);
    waste_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return thread_fail(WASTE_E_OOM);
    ctx->lock_fd = -1;
    waste_status st = open_ctx(ctx, model_path, cfg ? cfg : &defaults, thread_detail, sizeof thread_detail);
    if (st != WASTE_OK) {
        waste_close(ctx);
        return thread_fail(st);
    }
    *out = ctx;
    return WASTE_OK;
}

void waste_close(waste_ctx *ctx) {
    if (!ctx) return;
    wmedia_clear(&ctx->media);
    if (ctx->vision) wvision_free(ctx->vision);
    wpool_close(ctx->pool);
    wexperts_close(&ctx->x);
    wstate_free(&ctx->s);
    wweights_free(&ctx->w);
    if (ctx->tok) wtok_free(ctx->tok);
    if (ctx->lock_fd >= 0) close(ctx->lock_fd); /* releases the flock */
    free(ctx);
}

waste_status waste_memory_used(const waste_ctx *ctx, waste_memplan *out) {
    if (!ctx || !out) return WASTE_E_ARG;
    *out = ctx->used;
    return WASTE_OK;
}

/* -------------------------------------------------------------- tokenizer */

static waste_status tokenize(waste_ctx *ctx, const char *text, int markup, int add_bos, int32_t *out,
                             size_t cap, size_t *n_out) {
    if (!ctx) return WASTE_E_ARG;
    clear_detail(ctx);
    if (!text || !n_out || (!out && cap > 0)) {
        snprintf(ctx->detail, sizeof ctx->detail, "tokenize: NULL argument");
        return ctx_fail(ctx, WASTE_E_ARG);
    }
    waste_status st = wtok_encode(ctx->tok, text, markup, add_bos, ctx->bos, out, cap, n_out);
    if (st == WASTE_E_ARG)
        snprintf(ctx->detail, sizeof ctx->detail, "output holds %zu tokens, the text needs %zu", cap, *n_out);
    return ctx_fail(ctx, st);
}

waste_status waste_tokenize(waste_ctx *ctx, const char *text, int add_bos, int32_t *out,
                            size_t cap, size_t *n_out) {
    return tokenize(ctx, text, 0, add_bos, out, cap, n_out);
}

waste_status waste_tokenize_markup(waste_ctx *ctx, const char *text, int add_bos,
                                   int32_t *out, size_t cap, size_t *n_out) {
    return tokenize(ctx, text, 1, add_bos, out, cap, n_out);
}

waste_status waste_detokenize(waste_ctx *ctx, const int32_t *tokens, size_t n, char *out,
                              size_t cap, size_t *n_out) {
    if (!ctx) return WASTE_E_ARG;
    clear_detail(ctx);
    if ((!tokens && n > 0) || !n_out || (!out && cap > 0)) {
        snprintf(ctx->detail, sizeof ctx->detail, "detokenize: NULL argument");
        return ctx_fail(ctx, WASTE_E_ARG);
    }
    size_t need = 0, len;
    for (size_t i = 0; i < n; i++) {
        if (!wtok_piece(ctx->tok, tokens[i], &len)) {
            snprintf(ctx->detail, sizeof ctx->detail, "token %zu: id %d is not in the vocabulary", i,
                     tokens[i]);
            return ctx_fail(ctx, WASTE_E_ARG);
        }
        need += len;
    }
    *n_out = need;
    if (need + 1 > cap) {
        snprintf(ctx->detail, sizeof ctx->detail, "output holds %zu bytes, the text needs %zu plus NUL",
                 cap, need);
        return ctx_fail(ctx, WASTE_E_ARG);
    }
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *piece = wtok_piece(ctx->tok, tokens[i], &len);
        memcpy(out + w, piece, len);
        w += len;
    }
    out[w] = '\0';
    return WASTE_OK;
}

/* ----------------------------------------------------------------- images */

waste_status waste_image_dimensions(const char *path, int *w, int *h) {
    clear_thread_detail();
    if (!path || !w || !h) {
        snprintf(thread_detail, sizeof thread_detail, "waste_image_dimensions: NULL argument");
        return thread_fail(WASTE_E_ARG);
    }
    int iw, ih;
    waste_status st = wimg_dimensions(path, &iw, &ih, thread_detail, sizeof thread_detail);
    if (st == WASTE_OK) *w = iw, *h = ih;
    return thread_fail(st);
}

waste_status waste_image_add(waste_ctx *ctx, const char *path, size_t *n_tokens_out) {
    if (!ctx) return WASTE_E_ARG;
    clear_detail(ctx);
    if (!path) {
        snprintf(ctx->detail, sizeof ctx->detail, "waste_image_add: NULL path");
        return ctx_fail(ctx, WASTE_E_ARG);
    }
    if (!ctx->vision) {
        snprintf(ctx->detail, sizeof ctx->detail, "images need the vision tower: open with vision=1");
        return ctx_fail(ctx, WASTE_E_UNSUPPORTED);
    }
    wimg img = {0};
    float *embeds = NULL;
    size_t n = 0;
    waste_status st = wimg_decode(path, &img, ctx->detail, sizeof ctx->detail);
    if (st == WASTE_OK) st = wvision_encode(ctx->vision, &img, &embeds, &n, ctx->detail, sizeof ctx->detail);
    wimg_free(&img);
    if (st == WASTE_OK) st = wmedia_push(&ctx->media, embeds, n, ctx->detail, sizeof ctx->detail);
    if (st != WASTE_OK) {
        free(embeds);
        return ctx_fail(ctx, st);
    }
    if (n_tokens_out) *n_tokens_out = n;
    return WASTE_OK;
}

/* Whether two int32 arrays share memory.  Expansion writes ahead of where it
 * reads, so an aliased output would silently overwrite input not yet read. */
static int arrays_overlap(const int32_t *a, size_t na, const int32_t *b, size_t nb) {
    if (na == 0 || nb == 0) return 0;
    uintptr_t a0 = (uintptr_t)a, a1 = a0 + na * sizeof *a, b0 = (uintptr_t)b, b1 = b0 + nb * sizeof *b;
    return a0 < b1 && b0 < a1;
}

waste_status waste_image_expand(waste_ctx *ctx, const int32_t *tokens, size_t n, int32_t *out,
                                size_t cap, size_t *n_out) {
    if (!ctx) return WASTE_E_ARG;
    clear_detail(ctx);
    if ((!tokens && n > 0) || !n_out || (!out && cap > 0)) {
        snprintf(ctx->detail, sizeof ctx->detail, "waste_image_expand: NULL argument");
        return ctx_fail(ctx, WASTE_E_ARG);
    }
    if (arrays_overlap(tokens, n, out, cap)) {
        snprintf(ctx->detail, sizeof ctx->detail, "waste_image_expand: out must not alias tokens");
        return ctx_fail(ctx, WASTE_E_ARG);
    }
    return ctx_fail(ctx, wmedia_expand(&ctx->media, ctx->media_pad, tokens, n, out, cap, n_out,
                                       ctx->detail, sizeof ctx->detail));
}

void waste_image_clear(waste_ctx *ctx) {
    if (ctx) wmedia_clear(&ctx->media);
}

/* ------------------------------------------------------------- evaluation */

/* Tokens must be ids of the vocabulary and fit after the current position
 * with `reserve` positions to spare; checked before anything runs. */
static waste_status check_input(waste_ctx *ctx, const int32_t *tokens, size_t n, uint32_t reserve,
                                const char *what) {
    if (!tokens || n == 0) {
        snprintf(ctx->detail, sizeof ctx->detail, "%s: empty input (n must be at least 1)", what);
        return WASTE_E_ARG;
    }
    if (n > ctx->s.ctx || ctx->s.pos + n + reserve > ctx->s.ctx) {
        snprintf(ctx->detail, sizeof ctx->detail,
                 "%s: %zu tokens at position %u would end at position %llu, past the context ceiling "
                 "of %u%s",
                 what, n, ctx->s.pos, (unsigned long long)ctx->s.pos + n + reserve, ctx->s.ctx,
                 reserve ? " (one position kept for the first generated token)" : "");
        return WASTE_E_ARG;
    }
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= ctx->m.vocab_size) {
            snprintf(ctx->detail, sizeof ctx->detail, "%s: token %zu (id %d) is outside the vocabulary of %u",
                     what, i, tokens[i], ctx->m.vocab_size);
            return WASTE_E_ARG;
        }
    return WASTE_OK;
}

/* Tokens [0, n) of a batch (n <= s.batch) into the model's input rows: a
 * media pad takes the next queued image row, any other token its embedding. */
static waste_status eval_batch(waste_ctx *ctx, const int32_t *tokens, size_t n, int want_logits) {
    for (size_t i = 0; i < n; i++) {
        float *row = ctx->s.x + i * ctx->m.hidden;
        if (tokens[i] != ctx->media_pad || !wmedia_take_row(&ctx->media, row))
            wmodel_embed(&ctx->w, tokens[i], row);
    }
    return wmodel_forward(&ctx->m, &ctx->w, &ctx->s, ctx->pool, &ctx->x, n, want_logits,
                          ctx->detail, sizeof ctx->detail);
}

/* Evaluate n tokens in batches; logits for the last.  WASTE_DELAY_MS
 * sleeps once per token, batched or not. */
static waste_status eval_tokens(waste_ctx *ctx, const int32_t *tokens, size_t n) {
    for (size_t done = 0; done < n;) {
        size_t step = n - done < ctx->s.batch ? n - done : ctx->s.batch;
        waste_status st = eval_batch(ctx, tokens + done, step, done + step == n);
        if (st != WASTE_OK) return st;
        done += step;
    }
    wsys_sleep_ms(ctx->delay_ms * (double)n);
    return WASTE_OK;
}

/* Compute runs on the listed CPUs only: the calling thread joins them for
 * the duration of a call and gets its own mask back afterwards. */
static void pin_caller(const waste_ctx *ctx, wsys_mask *saved) {
    saved->valid = 0;
    if (ctx->cpus.n == 0) return;
    wsys_mask mask;
    wsys_mask_get(saved);
    wsys_mask_of(&ctx->cpus, -1, &mask);
    wsys_mask_apply(&mask);
}

waste_status waste_eval(waste_ctx *ctx, const int32_t *tokens, size_t n,
                        const float **logits_out, size_t *vocab_out) {
    if (!ctx) return WASTE_E_ARG;
    clear_detail(ctx);
    waste_status st = check_input(ctx, tokens, n, 0, "waste_eval");
    if (st != WASTE_OK) return ctx_fail(ctx, st);
    double t0 = wsys_now_ms();
    wsys_mask saved;
    pin_caller(ctx, &saved);
    st = eval_tokens(ctx, tokens, n);
    wsys_mask_apply(&saved);
    ctx->ms_total += wsys_now_ms() - t0;
    if (st != WASTE_OK) return ctx_fail(ctx, st);
    if (logits_out) *logits_out = ctx->s.logits;
    if (vocab_out) *vocab_out = ctx->m.vocab_size;
    return WASTE_OK;
}

static int is_stop(const waste_gen_params *p, int32_t token, int32_t eos) {
    if (token == eos) return 1;
    for (size_t i = 0; i < p->n_stop; i++)
        if (p->stop_tokens[i] == token) return 1;
    return 0;
}

static waste_status check_params(waste_ctx *ctx, const waste_gen_params *p) {
    if (!(p->temperature >= 0.0f) || !isfinite(p->temperature) || !(p->top_p >= 0.0f) ||
        p->top_k < 0 || (p->n_stop > 0 && !p->stop_tokens)) {
        snprintf(ctx->detail, sizeof ctx->detail,
                 "generation parameters: temperature %g, top_p %g, top_k %d, n_stop %zu are not valid",
                 (double)p->temperature, (double)p->top_p, p->top_k, p->n_stop);
        return WASTE_E_ARG;
    }
    return WASTE_OK;
}

/* Sample, evaluate and deliver tokens until a stop, the cap, the ceiling
 * or the callback ends it. */
static waste_status generate_loop(waste_ctx *ctx, const waste_gen_params *p, waste_token_cb cb,
                                  void *user, double t_start) {
    wrng rng;
    wrng_seed(&rng, p->seed);
    double t_token = t_start;
    for (uint32_t i = 0; i < p->max_tokens; i++) {
        if (ctx->s.pos >= ctx->s.ctx) {
            snprintf(ctx->detail, sizeof ctx->detail,
                     "context full: all %u positions used after %u generated tokens", ctx->s.ctx, i);
            ctx->has_detail = 1;
            return WASTE_OK;
        }
        WPROF_START(step);
        waste_token_info info = {.token_index = i};
        WPROF_START(sampled);
        info.token = wsample(ctx->s.logits, ctx->m.vocab_size, p, &rng, ctx->s.sampler, &info.logprob);
        WPROF_ADD(WPROF_SAMPLE, sampled);
        waste_status st = eval_tokens(ctx, &info.token, 1);
        if (st != WASTE_OK) return st;
        double now = wsys_now_ms();
        info.experts_hit = (uint32_t)ctx->x.token.hits;
        info.experts_missed = (uint32_t)ctx->x.token.misses;
        info.bytes_read = ctx->x.token.bytes_read;
        info.ms_io = ctx->x.token.ms_io;
        info.ms_total = now - t_token;
        ctx->x.token = (wexpert_counters){0};
        t_token = now;
        ctx->tokens_generated++;
        size_t len = 0;
        const uint8_t *piece = wtok_piece(ctx->tok, info.token, &len);
        char text[256], *buf = len < sizeof text ? text : malloc(len + 1);
        if (!buf) return WASTE_E_OOM;
        memcpy(buf, piece ? (const char *)piece : "", piece ? len : 0);
        buf[piece ? len : 0] = '\0';
        WPROF_START(called);
        int stop_now = cb ? cb(&info, buf, user) : 0;
        WPROF_ADD(WPROF_CALLBACK, called);
        if (buf != text) free(buf);
        WPROF_ADD(WPROF_STEP, step);
        if (stop_now) {
            snprintf(ctx->detail, sizeof ctx->detail, "the token callback stopped generation after %u tokens",
                     i + 1);
            return WASTE_E_CANCELLED;
        }
        if (is_stop(p, info.token, ctx->eos)) return WASTE_OK;
    }
    return WASTE_OK;
}

waste_status waste_generate(waste_ctx *ctx, const int32_t *prompt, size_t n,
                            const waste_gen_params *params, waste_token_cb cb, void *user) {
    if (!ctx) return WASTE_E_ARG;
    clear_detail(ctx);
    waste_gen_params defaults;
    waste_gen_params_init(&defaults);
    const waste_gen_params *p = params ? params : &defaults;
    waste_status st = check_params(ctx, p);
    if (st == WASTE_OK) st = check_input(ctx, prompt, n, 1, "waste_generate");
    if (st != WASTE_OK) return ctx_fail(ctx, st);

    double t0 = wsys_now_ms();
    wsys_mask saved;
    pin_caller(ctx, &saved);
    ctx->x.token = (wexpert_counters){0};
    st = eval_tokens(ctx, prompt, n);
    WPROF_DECODING(1);
    if (st == WASTE_OK) st = generate_loop(ctx, p, cb, user, t0);
    WPROF_DECODING(0);
    wsys_mask_apply(&saved);
    ctx->ms_total += wsys_now_ms() - t0;
    return st == WASTE_OK ? WASTE_OK : ctx_fail(ctx, st);
}

/* ------------------------------------------------------------------ state */

waste_status waste_state_save(waste_ctx *ctx, const char *path) {
    if (!ctx) return WASTE_E_ARG;
    clear_detail(ctx);
    if (!path) {
        snprintf(ctx->detail, sizeof ctx->detail, "waste_state_save: NULL path");
        return ctx_fail(ctx, WASTE_E_ARG);
    }
    return ctx_fail(ctx, wcheckpoint_save(path, ctx->fingerprint, &ctx->m, &ctx->s, ctx->detail,
                                          sizeof ctx->detail));
}

waste_status waste_state_load(waste_ctx *ctx, const char *path) {
    if (!ctx) return WASTE_E_ARG;
    clear_detail(ctx);
    if (!path) {
        snprintf(ctx->detail, sizeof ctx->detail, "waste_state_load: NULL path");
        return ctx_fail(ctx, WASTE_E_ARG);
    }
    wmedia_clear(&ctx->media);
    return ctx_fail(ctx, wcheckpoint_load(path, ctx->fingerprint, &ctx->m, &ctx->s, ctx->detail,
                                          sizeof ctx->detail));
}

void waste_state_reset(waste_ctx *ctx) {
    if (!ctx) return;
    ctx->s.pos = 0;
    wmedia_clear(&ctx->media);
}

/* ---------------------------------------------------------- introspection */

waste_status waste_model_get_info(const waste_ctx *ctx, waste_model_info *out) {
    if (!ctx || !out) return WASTE_E_ARG;
    const wmanifest *m = &ctx->m;
    *out = (waste_model_info){
        .n_layers = m->n_layers,
        .n_experts = m->n_experts,
        .top_k = m->top_k,
        .hidden = m->hidden,
        .ctx_max = ctx->s.ctx,
        .params_total = wmanifest_params_total(m),
        .params_active = wmanifest_params_active(m),
        .arch = m->arch,
        .quant_summary = ctx->quant_summary,
    };
    return WASTE_OK;
}

waste_status waste_get_stats(const waste_ctx *ctx, waste_stats *out) {
    if (!ctx || !out) return WASTE_E_ARG;
    *out = (waste_stats){
        .tokens_generated = ctx->tokens_generated,
        .experts_hit = ctx->x.total.hits,
        .experts_missed = ctx->x.total.misses,
        .bytes_read = ctx->x.total.bytes_read,
        .sec_total = ctx->ms_total / 1e3,
        .sec_io = ctx->x.total.ms_io / 1e3,
        .direct_io = wexperts_direct_io(&ctx->x),
    };
    return WASTE_OK;
}

waste_status waste_save_usage(waste_ctx *ctx) {
    if (!ctx) return WASTE_E_ARG;
    clear_detail(ctx);
    return ctx_fail(ctx, wexperts_save_usage(&ctx->x, ctx->usage_path, ctx->detail, sizeof ctx->detail));
}

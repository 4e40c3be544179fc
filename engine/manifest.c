#include "manifest.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "detail.h"
#include "json.h"
#include <zlib.h>

/* Limits that keep every derived size far from overflow and every
 * allocation sane before any file size is compared. */
#define MAX_HIDDEN 65536
#define MAX_VOCAB (1 << 24)
#define MAX_LAYERS 1024
#define MAX_EXPERTS 65536
#define MAX_FFN (1 << 20)

static waste_status get_u32(const json_value *root, const char *key, int64_t min, int64_t max,
                            uint32_t *out, char *err, size_t errcap) {
    const json_value *v = json_get(root, key);
    int64_t n;
    if (!v) return wdetail(err, errcap, WASTE_E_FORMAT, "manifest.json: missing \"%s\"", key);
    if (!json_int(v, min, max, &n))
        return wdetail(err, errcap, WASTE_E_FORMAT,
                       "manifest.json: \"%s\" must be an integer in %lld..%lld", key,
                       (long long)min, (long long)max);
    *out = (uint32_t)n;
    return WASTE_OK;
}

static waste_status get_float(const json_value *root, const char *key, double min, double max,
                              float *out, char *err, size_t errcap) {
    double d;
    if (!json_number(json_get(root, key), &d) || !(d > min && d < max))
        return wdetail(err, errcap, WASTE_E_FORMAT,
                       "manifest.json: \"%s\" must be a number in (%g, %g)", key, min, max);
    *out = (float)d;
    return WASTE_OK;
}

static waste_status get_name(const json_value *root, const char *key, int required, char *out,
                             char *err, size_t errcap) {
    const json_value *v = json_get(root, key);
    size_t len = 0;
    const char *s = json_string(v, &len);
    if (!v && !required) {
        out[0] = '\0';
        return WASTE_OK;
    }
    if (!s || len == 0 || len >= WM_NAME_MAX || strlen(s) != len)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                       "manifest.json: \"%s\" must be a non-empty string under %d bytes", key,
                       WM_NAME_MAX);
    memcpy(out, s, len + 1);
    return WASTE_OK;
}

/* "f32", "q8g<G>" or "q4_1"; the group must divide every row of the
 * matrices stored that way (each of the `n_rows` lengths in rows[]). */
static int parse_quant_text(const char *q, const uint32_t *rows, size_t n_rows, wquant *out) {
    unsigned group = 0;
    char tail;
    if (!q) return 0;
    if (strcmp(q, "f32") == 0) {
        *out = (wquant){WQ_F32, 0};
        return 1;
    }
    if (strcmp(q, "q4_1") == 0) *out = (wquant){WQ_Q4_1, 32};
    else if (sscanf(q, "q8g%u%c", &group, &tail) == 1 && group > 0 && group <= 4096)
        *out = (wquant){WQ_Q8, group};
    else
        return 0;
    for (size_t i = 0; i < n_rows; i++)
        if (rows[i] % out->group != 0) return 0;
    return 1;
}

static waste_status parse_quant(const json_value *root, const char *key, const char *fallback,
                                const uint32_t *rows, size_t n_rows, wquant *out, char *err,
                                size_t errcap) {
    const json_value *v = json_get(root, key);
    const char *q = v ? json_string(v, NULL) : fallback;
    if (parse_quant_text(q, rows, n_rows, out)) return WASTE_OK;
    return wdetail(err, errcap, WASTE_E_FORMAT,
                   "manifest.json: \"%s\" must be \"f32\", \"q4_1\" or \"q8g<G>\" with the group "
                   "dividing every row it quantises", key);
}

/* A string key with a fixed set of values; absent means the first. */
static waste_status get_choice(const json_value *root, const char *key, const char *const *choices,
                               int n_choices, int *out, char *err, size_t errcap) {
    const json_value *v = json_get(root, key);
    const char *text = v ? json_string(v, NULL) : choices[0];
    for (int i = 0; text && i < n_choices; i++)
        if (strcmp(text, choices[i]) == 0) {
            *out = i;
            return WASTE_OK;
        }
    return wdetail(err, errcap, WASTE_E_FORMAT, "manifest.json: \"%s\" must be \"%s\"%s%s%s", key,
                   choices[0], n_choices > 1 ? " or \"" : "", n_choices > 1 ? choices[1] : "",
                   n_choices > 1 ? "\"" : "");
}

static waste_status get_flag(const json_value *root, const char *key, int *out, char *err,
                             size_t errcap) {
    const json_value *v = json_get(root, key);
    *out = 0;
    if (!v || json_bool(v, out)) return WASTE_OK;
    return wdetail(err, errcap, WASTE_E_FORMAT, "manifest.json: \"%s\" must be true or false", key);
}

/* The keys a llama container adds, and the shape its layout implies. */
static waste_status parse_layout(const json_value *root, wmanifest *m, char *err, size_t errcap) {
    static const char *const rope_styles[] = {"adjacent"};
    static const char *const pretokenizers[] = {"default", "smollm"};
    int rope_style;
    waste_status st;
    m->n_kv_heads = m->n_heads;
    if (json_get(root, "n_kv_heads") &&
        (st = get_u32(root, "n_kv_heads", 1, m->n_heads, &m->n_kv_heads, err, errcap)) != WASTE_OK)
        return st;
    if (m->n_heads % m->n_kv_heads != 0)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                       "manifest.json: n_kv_heads (%u) must divide n_heads (%u)", m->n_kv_heads,
                       m->n_heads);
    if ((st = get_choice(root, "rope_style", rope_styles, 1, &rope_style, err, errcap)) != WASTE_OK ||
        (st = get_choice(root, "pretokenizer", pretokenizers, 2, &m->pretokenizer, err, errcap)) !=
            WASTE_OK ||
        (st = get_flag(root, "tied_embeddings", &m->tied_embeddings, err, errcap)) != WASTE_OK)
        return st;
    m->llama = strcmp(m->arch, "llama") == 0;
    if (m->llama && (m->n_experts != 1 || m->n_dense_layers != 0 || m->shared_expert))
        return wdetail(err, errcap, WASTE_E_FORMAT,
                       "manifest.json: arch \"llama\" has one expert per layer, no dense layers and "
                       "no shared expert");
    return WASTE_OK;
}

static waste_status parse_quants(const json_value *root, wmanifest *m, char *err, size_t errcap) {
    const uint32_t expert_rows[] = {m->hidden, m->expert_ffn}, trunk_rows[] = {m->hidden};
    waste_status st = parse_quant(root, "expert_quant", NULL, expert_rows, 2, &m->expert_q, err, errcap);
    if (st == WASTE_OK)
        st = parse_quant(root, "weight_quant", "f32", trunk_rows, 1, &m->weight_q, err, errcap);
    if (st == WASTE_OK)
        st = parse_quant(root, "embed_quant", "f32", trunk_rows, 1, &m->embed_q, err, errcap);
    return st;
}

static waste_status check_header(const json_value *root, char *err, size_t errcap) {
    const char *format = json_string(json_get(root, "format"), NULL);
    int64_t version;
    if (!format || strcmp(format, "waste-ref") != 0)
        return wdetail(err, errcap, WASTE_E_FORMAT, "manifest.json: \"format\" is not \"waste-ref\"");
    if (!json_int(json_get(root, "version"), 1, 1, &version))
        return wdetail(err, errcap, WASTE_E_FORMAT, "manifest.json: unsupported \"version\" (want 1)");
    return WASTE_OK;
}

static waste_status parse(const json_value *root, wmanifest *m, char *err, size_t errcap) {
    waste_status st;
    int shared;
    if (!root || root->type != JSON_OBJECT)
        return wdetail(err, errcap, WASTE_E_FORMAT, "manifest.json: not a JSON object");
#define TRY(call) do { if ((st = (call)) != WASTE_OK) return st; } while (0)
    TRY(check_header(root, err, errcap));
    TRY(get_name(root, "arch", 1, m->arch, err, errcap));
    TRY(get_u32(root, "vocab_size", 1, MAX_VOCAB, &m->vocab_size, err, errcap));
    TRY(get_u32(root, "hidden", 2, MAX_HIDDEN, &m->hidden, err, errcap));
    TRY(get_u32(root, "n_layers", 1, MAX_LAYERS, &m->n_layers, err, errcap));
    /* at least one MoE layer: that is what the engine is for */
    TRY(get_u32(root, "n_dense_layers", 0, m->n_layers - 1, &m->n_dense_layers, err, errcap));
    TRY(get_u32(root, "n_heads", 1, MAX_HIDDEN, &m->n_heads, err, errcap));
    TRY(get_u32(root, "head_dim", 2, MAX_HIDDEN, &m->head_dim, err, errcap));
    TRY(get_u32(root, "dense_ffn", 1, MAX_FFN, &m->dense_ffn, err, errcap));
    TRY(get_u32(root, "n_experts", 1, MAX_EXPERTS, &m->n_experts, err, errcap));
    TRY(get_u32(root, "top_k", 1, m->n_experts < WM_MAX_TOP_K ? m->n_experts : WM_MAX_TOP_K, &m->top_k, err, errcap));
    TRY(get_u32(root, "expert_ffn", 1, MAX_FFN, &m->expert_ffn, err, errcap));
    TRY(get_float(root, "rope_theta", 0.0, 1e12, &m->rope_theta, err, errcap));
    TRY(get_float(root, "norm_eps", 0.0, 1.0, &m->norm_eps, err, errcap));
    TRY(get_name(root, "bos_token", 1, m->bos_token, err, errcap));
    TRY(get_name(root, "eos_token", 1, m->eos_token, err, errcap));
    TRY(get_name(root, "media_pad_token", 0, m->media_pad_token, err, errcap));
    TRY(get_name(root, "unk_token", 0, m->unk_token, err, errcap));
    TRY(parse_quants(root, m, err, errcap));
    m->context_length = 0;
    if (json_get(root, "context_length"))
        TRY(get_u32(root, "context_length", 1, UINT32_MAX, &m->context_length, err, errcap));
    if (!json_bool(json_get(root, "shared_expert"), &shared))
        return wdetail(err, errcap, WASTE_E_FORMAT, "manifest.json: \"shared_expert\" must be true or false");
    m->shared_expert = shared;
    TRY(parse_layout(root, m, err, errcap));
#undef TRY
    if ((uint64_t)m->n_heads * m->head_dim != m->hidden)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                       "manifest.json: n_heads (%u) * head_dim (%u) != hidden (%u)", m->n_heads,
                       m->head_dim, m->hidden);
    if (m->head_dim % 2 != 0)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                       "manifest.json: head_dim (%u) must be even for rotary pairs", m->head_dim);
    return WASTE_OK;
}

waste_status wmanifest_load(const char *dir, wmanifest *m, char *err, size_t errcap) {
    char path[4096];
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return wdetail(err, errcap, WASTE_E_IO, "%s: %s", path, strerror(errno));
    /* A manifest is a few hundred bytes; refuse anything that is not. */
    char text[65536];
    size_t len = fread(text, 1, sizeof text, f);
    int too_big = !feof(f);
    fclose(f);
    if (too_big) return wdetail(err, errcap, WASTE_E_FORMAT, "%s: larger than 64 KiB", path);

    char jerr[256];
    json_value *root = json_parse(text, len, jerr, sizeof jerr);
    if (!root) return wdetail(err, errcap, WASTE_E_FORMAT, "manifest.json: %s", jerr);
    wmanifest parsed;
    memset(&parsed, 0, sizeof parsed);
    waste_status st = parse(root, &parsed, err, errcap);
    json_free(root);
    if (st != WASTE_OK) return st;
    parsed.crc = (uint32_t)crc32(0L, (const Bytef *)text, (uInt)len);
    *m = parsed;
    return WASTE_OK;
}

uint32_t wmanifest_moe_layers(const wmanifest *m) { return m->n_layers - m->n_dense_layers; }

static uint64_t swiglu_params(uint64_t hidden, uint64_t ffn) { return 3 * hidden * ffn; }

uint64_t wquant_bytes(wquant q, uint64_t rows, uint64_t cols) {
    uint64_t n = rows * cols;
    switch (q.kind) {
    case WQ_Q8: return n + 4 * (n / q.group);         /* codes, scales */
    case WQ_Q4_1: return n / 2 + 8 * (n / q.group);   /* nibbles, scales, minima */
    default: return 4 * n;
    }
}

uint32_t wmanifest_kv_dim(const wmanifest *m) { return m->n_kv_heads * m->head_dim; }

/* Sizes of one layer's trunk tensors, in FORMAT.md's order: weight count
 * and bytes are accumulated together so the two can never disagree. */
static void layer_trunk(const wmanifest *m, uint32_t layer, uint64_t *params, uint64_t *bytes) {
    uint64_t h = m->hidden, kv = wmanifest_kv_dim(m);
    const wquant f32 = {WQ_F32, 0};
    const struct { wquant q; uint64_t rows, cols; } t[] = {
        {f32, 1, h},                /* attn_norm */
        {m->weight_q, h, h},        /* wq */
        {m->weight_q, kv, h},       /* wk */
        {m->weight_q, kv, h},       /* wv */
        {m->weight_q, h, h},        /* wo */
        {f32, 1, h},                /* ffn_norm */
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        *params += t[i].rows * t[i].cols;
        *bytes += wquant_bytes(t[i].q, t[i].rows, t[i].cols);
    }
    uint64_t ffn = 0, rest = 0;
    if (layer < m->n_dense_layers) ffn = swiglu_params(h, m->dense_ffn);
    else {
        if (!m->llama) rest = (uint64_t)m->n_experts * h; /* router */
        if (m->shared_expert) ffn = swiglu_params(h, m->expert_ffn);
    }
    *params += ffn + rest;
    *bytes += 4 * (ffn + rest);
}

static void trunk_sizes(const wmanifest *m, uint64_t *params, uint64_t *bytes) {
    uint64_t h = m->hidden, table = (uint64_t)m->vocab_size * h;
    uint64_t table_bytes = wquant_bytes(m->embed_q, m->vocab_size, h);
    int heads = m->tied_embeddings ? 1 : 2; /* tok_embed, lm_head */
    *params = heads * table + h;            /* + final_norm */
    *bytes = heads * table_bytes + 4 * h;
    for (uint32_t l = 0; l < m->n_layers; l++) layer_trunk(m, l, params, bytes);
}

uint64_t wmanifest_trunk_params(const wmanifest *m) {
    uint64_t params, bytes;
    trunk_sizes(m, &params, &bytes);
    return params;
}

uint64_t wmanifest_trunk_bytes(const wmanifest *m) {
    uint64_t params, bytes;
    trunk_sizes(m, &params, &bytes);
    return bytes;
}

uint64_t wmanifest_payload_bytes(const wmanifest *m) {
    return 2 * wquant_bytes(m->expert_q, m->expert_ffn, m->hidden) +
           wquant_bytes(m->expert_q, m->hidden, m->expert_ffn);
}

uint64_t wmanifest_record_stride(const wmanifest *m) {
    uint64_t raw = WM_RECORD_HEADER + wmanifest_payload_bytes(m);
    return (raw + WM_PAGE - 1) / WM_PAGE * WM_PAGE;
}

uint64_t wmanifest_params_total(const wmanifest *m) {
    return wmanifest_trunk_params(m) +
           (uint64_t)wmanifest_moe_layers(m) * m->n_experts * swiglu_params(m->hidden, m->expert_ffn);
}

/* A token reads one embedding row, not the whole table (unless it is also
 * the output head). */
uint64_t wmanifest_params_active(const wmanifest *m) {
    uint64_t h = m->hidden, unread = m->tied_embeddings ? 0 : (uint64_t)m->vocab_size * h - h;
    return wmanifest_trunk_params(m) - unread +
           (uint64_t)wmanifest_moe_layers(m) * m->top_k * swiglu_params(h, m->expert_ffn);
}

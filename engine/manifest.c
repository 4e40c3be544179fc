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

static waste_status parse_quant(const json_value *root, wmanifest *m, char *err, size_t errcap) {
    const char *q = json_string(json_get(root, "expert_quant"), NULL);
    unsigned group = 0;
    char tail;
    if (q && strcmp(q, "f32") == 0) {
        m->quant_group = 0;
        return WASTE_OK;
    }
    if (q && sscanf(q, "q8g%u%c", &group, &tail) == 1 && group > 0 && group <= 4096 &&
        m->hidden % group == 0 && m->expert_ffn % group == 0) {
        m->quant_group = group;
        return WASTE_OK;
    }
    return wdetail(err, errcap, WASTE_E_FORMAT,
                   "manifest.json: \"expert_quant\" must be \"f32\" or \"q8g<G>\" with G dividing "
                   "hidden and expert_ffn");
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
    TRY(parse_quant(root, m, err, errcap));
#undef TRY
    if (!json_bool(json_get(root, "shared_expert"), &shared))
        return wdetail(err, errcap, WASTE_E_FORMAT, "manifest.json: \"shared_expert\" must be true or false");
    m->shared_expert = shared;
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

/* Weights of one layer outside the experts. */
static uint64_t layer_trunk_floats(const wmanifest *m, uint32_t layer) {
    uint64_t h = m->hidden;
    uint64_t n = 2 * h + 4 * h * h; /* norms + attention */
    if (layer < m->n_dense_layers) return n + swiglu_params(h, m->dense_ffn);
    n += (uint64_t)m->n_experts * h;
    if (m->shared_expert) n += swiglu_params(h, m->expert_ffn);
    return n;
}

uint64_t wmanifest_trunk_floats(const wmanifest *m) {
    uint64_t h = m->hidden;
    uint64_t n = 2 * (uint64_t)m->vocab_size * h + h; /* embeddings, lm_head, final norm */
    for (uint32_t l = 0; l < m->n_layers; l++) n += layer_trunk_floats(m, l);
    return n;
}

uint64_t wmanifest_payload_bytes(const wmanifest *m) {
    uint64_t weights = swiglu_params(m->hidden, m->expert_ffn);
    if (m->quant_group == 0) return 4 * weights;
    return weights + 4 * (weights / m->quant_group);
}

uint64_t wmanifest_record_stride(const wmanifest *m) {
    uint64_t raw = WM_RECORD_HEADER + wmanifest_payload_bytes(m);
    return (raw + WM_PAGE - 1) / WM_PAGE * WM_PAGE;
}

uint64_t wmanifest_params_total(const wmanifest *m) {
    return wmanifest_trunk_floats(m) +
           (uint64_t)wmanifest_moe_layers(m) * m->n_experts * swiglu_params(m->hidden, m->expert_ffn);
}

/* A token reads one embedding row, not the whole table. */
uint64_t wmanifest_params_active(const wmanifest *m) {
    uint64_t h = m->hidden;
    return wmanifest_trunk_floats(m) - (uint64_t)m->vocab_size * h + h +
           (uint64_t)wmanifest_moe_layers(m) * m->top_k * swiglu_params(h, m->expert_ffn);
}

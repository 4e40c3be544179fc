/*
 * tokenizer.c -- byte-level BPE (tiktoken-style ranks) plus special tokens,
 * following FORMAT.md: a fixed pre-tokenizer, then inside each pre-token the
 * adjacent pair whose concatenation has the lowest rank is merged until no
 * pair is in the vocabulary.
 *
 * Every token's bytes live in one arena; a hash map finds the rank of a byte
 * string without copying it (a candidate merge is always a contiguous slice
 * of the pre-token).  The merge loop uses a heap of candidate pairs with lazy
 * invalidation, so a pre-token of n bytes costs O(n log n): a 50 KB run of
 * letters is one pre-token and must not go quadratic.
 */
#include "tokenizer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "detail.h"
#include "json.h"
#include "manifest.h"
#include "unicode.h"

enum { KIND_NONE = 0, KIND_BPE = 1, KIND_SPECIAL = 2 };

struct wtok {
    uint32_t vocab_size;
    uint8_t *arena;          /* every token's bytes, back to back */
    size_t arena_len, arena_cap;
    uint32_t *offset;        /* [vocab_size] start of id's bytes in arena */
    uint32_t *length;        /* [vocab_size] byte count */
    uint8_t *kind;           /* [vocab_size] KIND_* */
    int32_t *slots;          /* open-addressing map bytes -> BPE rank, -1 empty */
    size_t n_slots;          /* power of two */
    int32_t byte_rank[256];  /* rank of each single byte */
    int32_t *specials;       /* ids of special tokens, in file order */
    size_t n_specials;
    uint8_t special_first[256]; /* 1 when some special's text starts with this byte */
    int pretokenizer;        /* WPRE_* */
    uint64_t *merge_keys;    /* tokenizer.merges: open-addressing map (left, right) + 1 */
    int32_t *merge_prio;     /*   -> its line number, the merge's priority */
    size_t merge_slots;      /* power of two; 0 without tokenizer.merges */
};

/* ---------------------------------------------------------------- errors */

/* ------------------------------------------------------------ file input */

static waste_status read_file(const char *dir, const char *name, char **buf, size_t *len,
                              char *err, size_t errcap) {
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path)
        return wdetail(err, errcap, WASTE_E_ARG, "container path too long");
    return read_whole_file(path, buf, len, err, errcap);
}

/* ------------------------------------------------------------- hash map */

static uint64_t hash_bytes(const uint8_t *s, size_t n) {
    uint64_t h = 1469598103934665603ull;  /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h;
}

/* The BPE rank of bytes s[0..n), or -1. */
static int32_t rank_of(const wtok *t, const uint8_t *s, size_t n) {
    size_t mask = t->n_slots - 1;
    for (size_t i = hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t id = t->slots[i];
        if (id < 0) return -1;
        if (t->length[id] == n && memcmp(t->arena + t->offset[id], s, n) == 0) return id;
    }
}

/* Inserts BPE id; 0 when the same bytes already have a rank. */
static int map_insert(wtok *t, int32_t id) {
    const uint8_t *s = t->arena + t->offset[id];
    size_t n = t->length[id], mask = t->n_slots - 1;
    for (size_t i = hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t other = t->slots[i];
        if (other < 0) { t->slots[i] = id; return 1; }
        if (t->length[other] == n && memcmp(t->arena + t->offset[other], s, n) == 0) return 0;
    }
}

/* ---------------------------------------------------------------- arena */

static int arena_add(wtok *t, int32_t id, const uint8_t *s, size_t n) {
    if (t->arena_len + n > t->arena_cap) {
        size_t cap = t->arena_cap ? t->arena_cap : 4096;
        while (cap < t->arena_len + n) cap *= 2;
        if (cap > UINT32_MAX) return 0;
        uint8_t *grown = realloc(t->arena, cap);
        if (!grown) return 0;
        t->arena = grown;
        t->arena_cap = cap;
    }
    memcpy(t->arena + t->arena_len, s, n);
    t->offset[id] = (uint32_t)t->arena_len;
    t->length[id] = (uint32_t)n;
    t->arena_len += n;
    return 1;
}

/* ------------------------------------------------------- tokenizer.model */

static int b64_value(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Strict standard base64 (padded).  Decodes into out (room for n*3/4 bytes);
 * returns the byte count or -1. */
static long b64_decode(const char *s, size_t n, uint8_t *out) {
    if (n == 0 || n % 4 != 0) return -1;
    long len = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            unsigned char c = (unsigned char)s[i + k];
            if (c == '=' && i + 4 == n && k >= 2) { v[k] = 0; pad++; continue; }
            if (pad || (v[k] = b64_value(c)) < 0) return -1;  /* data after '=' */
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[len++] = (uint8_t)(w >> 16);
        if (pad < 2) out[len++] = (uint8_t)(w >> 8);
        if (pad < 1) out[len++] = (uint8_t)w;
    }
    return len;
}

/* One "<base64> <rank>" line. */
static waste_status load_rank_line(wtok *t, const char *line, size_t n, size_t lineno,
                                   uint8_t *scratch, char *err, size_t errcap) {
    const char *sp = memchr(line, ' ', n);
    if (!sp || sp == line || sp + 1 == line + n) {
        snprintf(err, errcap, "tokenizer.model line %zu: expected \"<base64> <rank>\"", lineno);
        return WASTE_E_FORMAT;
    }
    uint64_t rank = 0;
    for (const char *c = sp + 1; c < line + n; c++) {
        if (*c < '0' || *c > '9' || rank > UINT32_MAX) {
            snprintf(err, errcap, "tokenizer.model line %zu: bad rank", lineno);
            return WASTE_E_FORMAT;
        }
        rank = rank * 10 + (uint64_t)(*c - '0');
    }
    if (rank >= t->vocab_size) {
        snprintf(err, errcap, "tokenizer.model line %zu: rank %llu >= vocab_size %u", lineno,
                 (unsigned long long)rank, t->vocab_size);
        return WASTE_E_FORMAT;
    }
    int32_t id = (int32_t)rank;
    if (t->kind[id] != KIND_NONE) {
        snprintf(err, errcap, "tokenizer.model line %zu: duplicate rank %d", lineno, id);
        return WASTE_E_FORMAT;
    }
    long len = b64_decode(line, (size_t)(sp - line), scratch);
    if (len <= 0) {
        snprintf(err, errcap, "tokenizer.model line %zu: bad base64", lineno);
        return WASTE_E_FORMAT;
    }
    if (!arena_add(t, id, scratch, (size_t)len)) return wdetail(err, errcap, WASTE_E_OOM, "out of memory");
    if (!map_insert(t, id)) {
        snprintf(err, errcap, "tokenizer.model line %zu: the same bytes have two ranks", lineno);
        return WASTE_E_FORMAT;
    }
    t->kind[id] = KIND_BPE;
    if (len == 1) t->byte_rank[scratch[0]] = id;
    return WASTE_OK;
}

static waste_status load_ranks(wtok *t, const char *dir, char *err, size_t errcap) {
    char *text;
    size_t len;
    waste_status st = read_file(dir, "tokenizer.model", &text, &len, err, errcap);
    if (st != WASTE_OK) return st;
    /* Each line decodes to fewer bytes than it has characters. */
    uint8_t *scratch = malloc(len + 1);
    if (!scratch) { free(text); return wdetail(err, errcap, WASTE_E_OOM, "out of memory"); }
    size_t lineno = 0;
    for (size_t pos = 0; pos < len && st == WASTE_OK;) {
        const char *nl = memchr(text + pos, '\n', len - pos);
        size_t end = nl ? (size_t)(nl - text) : len, n = end - pos;
        lineno++;
        if (n && text[pos + n - 1] == '\r') n--;
        if (n) st = load_rank_line(t, text + pos, n, lineno, scratch, err, errcap);
        pos = end + 1;
    }
    free(scratch);
    free(text);
    return st;
}

/* Every byte encodes: as its own token, or as the unknown token. */
static waste_status check_bytes(wtok *t, const char *unk, char *err, size_t errcap) {
    int32_t unk_id = unk[0] ? wtok_special_id(t, unk) : -1;
    if (unk[0] && unk_id < 0)
        return wdetail(err, errcap, WASTE_E_FORMAT, "manifest unk_token \"%s\" is not in specials.json",
                       unk);
    for (int b = 0; b < 256; b++)
        if (t->byte_rank[b] < 0) {
            if (unk_id < 0) {
                snprintf(err, errcap, "tokenizer.model: no rank for the single byte 0x%02x", b);
                return WASTE_E_FORMAT;
            }
            t->byte_rank[b] = unk_id;
        }
    return WASTE_OK;
}

/* ---------------------------------------------------------- specials.json */

static waste_status load_special(wtok *t, const json_value *item, size_t index,
                                 char *err, size_t errcap) {
    int64_t id;
    size_t len;
    const char *text = json_string(json_get(item, "text"), &len);
    if (!json_int(json_get(item, "id"), 0, (int64_t)t->vocab_size - 1, &id)) {
        snprintf(err, errcap, "specials.json item %zu: \"id\" missing or not an integer below "
                 "vocab_size %u", index, t->vocab_size);
        return WASTE_E_FORMAT;
    }
    if (!text || len == 0 || strlen(text) != len) {
        snprintf(err, errcap, "specials.json item %zu: \"text\" missing, empty or not a string",
                 index);
        return WASTE_E_FORMAT;
    }
    if (t->kind[id] != KIND_NONE) {
        snprintf(err, errcap, "specials.json item %zu: id %lld is already taken", index,
                 (long long)id);
        return WASTE_E_FORMAT;
    }
    if (!arena_add(t, (int32_t)id, (const uint8_t *)text, len))
        return wdetail(err, errcap, WASTE_E_OOM, "out of memory");
    t->kind[id] = KIND_SPECIAL;
    t->specials[t->n_specials++] = (int32_t)id;
    t->special_first[(unsigned char)text[0]] = 1;
    return WASTE_OK;
}

/* A special's text, for sorting them. */
typedef struct {
    const uint8_t *text;
    uint32_t len;
} special_text;

static int compare_special_texts(const void *a, const void *b) {
    const special_text *x = a, *y = b;
    int c = memcmp(x->text, y->text, x->len < y->len ? x->len : y->len);
    return c ? c : (x->len > y->len) - (x->len < y->len);
}

/* No text may name two specials.  Sorted, so a hostile file with a million
 * specials is checked in O(n log n), not by comparing every pair. */
static waste_status check_special_texts_unique(const wtok *t, char *err, size_t errcap) {
    if (t->n_specials < 2) return WASTE_OK;
    special_text *sorted = malloc(t->n_specials * sizeof *sorted);
    if (!sorted) return wdetail(err, errcap, WASTE_E_OOM, "out of memory");
    for (size_t i = 0; i < t->n_specials; i++) {
        int32_t id = t->specials[i];
        sorted[i] = (special_text){t->arena + t->offset[id], t->length[id]};
    }
    qsort(sorted, t->n_specials, sizeof *sorted, compare_special_texts);
    waste_status st = WASTE_OK;
    for (size_t i = 1; i < t->n_specials && st == WASTE_OK; i++)
        if (compare_special_texts(&sorted[i - 1], &sorted[i]) == 0) {
            snprintf(err, errcap, "specials.json: text %.*s listed twice",
                     (int)(sorted[i].len < 64 ? sorted[i].len : 64), (const char *)sorted[i].text);
            st = WASTE_E_FORMAT;
        }
    free(sorted);
    return st;
}

static waste_status load_specials(wtok *t, const char *dir, char *err, size_t errcap) {
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/specials.json", dir) >= sizeof path)
        return wdetail(err, errcap, WASTE_E_ARG, "container path too long");
    json_value *root;
    waste_status st = json_load_file(path, &root, err, errcap);
    if (st != WASTE_OK) return st;
    if (root->type != JSON_ARRAY) {
        json_free(root);
        return wdetail(err, errcap, WASTE_E_FORMAT, "specials.json: not a JSON array");
    }
    t->specials = malloc((json_count(root) + 1) * sizeof *t->specials);
    if (!t->specials) st = wdetail(err, errcap, WASTE_E_OOM, "out of memory");
    for (size_t i = 0; i < json_count(root) && st == WASTE_OK; i++)
        st = load_special(t, json_at(root, i), i, err, errcap);
    json_free(root);
    return st == WASTE_OK ? check_special_texts_unique(t, err, errcap) : st;
}

/* Every id below vocab_size is a rank or a special (FORMAT.md): the model
 * can sample any of them, and each must have bytes to hand the host. */
static waste_status check_every_id_defined(const wtok *t, char *err, size_t errcap) {
    for (uint32_t id = 0; id < t->vocab_size; id++)
        if (t->kind[id] == KIND_NONE) {
            snprintf(err, errcap, "id %u is below vocab_size %u but is neither a rank in "
                     "tokenizer.model nor in specials.json", id, t->vocab_size);
            return WASTE_E_FORMAT;
        }
    return WASTE_OK;
}

/* ------------------------------------------------------ tokenizer.merges */

static uint64_t merge_key(int32_t left, int32_t right) {
    return ((uint64_t)(uint32_t)left << 32 | (uint32_t)right) + 1; /* 0 marks an empty slot */
}

/* The priority of merging token left with token right, or -1. */
static int32_t merge_priority(const wtok *t, int32_t left, int32_t right) {
    uint64_t key = merge_key(left, right);
    size_t mask = t->merge_slots - 1;
    for (size_t i = (size_t)(key * 0x9E3779B97F4A7C15ull >> 20) & mask;; i = (i + 1) & mask) {
        if (t->merge_keys[i] == 0) return -1;
        if (t->merge_keys[i] == key) return t->merge_prio[i];
    }
}

/* One "<left id> <right id>" line: both BPE tokens whose concatenation is one. */
static waste_status load_merge_line(wtok *t, const char *line, size_t n, int32_t prio,
                                    uint8_t *scratch, char *err, size_t errcap) {
    unsigned long ids[2];
    char text[64], tail;
    if (n >= sizeof text) n = sizeof text - 1;
    memcpy(text, line, n);
    text[n] = '\0';
    if (sscanf(text, "%lu %lu%c", &ids[0], &ids[1], &tail) != 2 || ids[0] >= t->vocab_size ||
        ids[1] >= t->vocab_size || t->kind[ids[0]] != KIND_BPE || t->kind[ids[1]] != KIND_BPE)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                       "tokenizer.merges line %d: expected \"<left id> <right id>\" of two BPE tokens",
                       prio + 1);
    size_t a = t->length[ids[0]], b = t->length[ids[1]];
    memcpy(scratch, t->arena + t->offset[ids[0]], a);
    memcpy(scratch + a, t->arena + t->offset[ids[1]], b);
    if (rank_of(t, scratch, a + b) < 0)
        return wdetail(err, errcap, WASTE_E_FORMAT,
                       "tokenizer.merges line %d: tokens %lu and %lu do not merge into a token",
                       prio + 1, ids[0], ids[1]);
    uint64_t key = merge_key((int32_t)ids[0], (int32_t)ids[1]);
    size_t mask = t->merge_slots - 1;
    for (size_t i = (size_t)(key * 0x9E3779B97F4A7C15ull >> 20) & mask;; i = (i + 1) & mask) {
        if (t->merge_keys[i] == key)
            return wdetail(err, errcap, WASTE_E_FORMAT, "tokenizer.merges line %d: repeats a merge",
                           prio + 1);
        if (t->merge_keys[i] == 0) {
            t->merge_keys[i] = key;
            t->merge_prio[i] = prio;
            return WASTE_OK;
        }
    }
}

/* Optional: without the file, merges go by the rank of their result. */
static waste_status load_merges(wtok *t, const char *dir, char *err, size_t errcap) {
    char path[4096], *text;
    size_t len, lines = 0, longest = 0;
    if ((size_t)snprintf(path, sizeof path, "%s/tokenizer.merges", dir) >= sizeof path)
        return wdetail(err, errcap, WASTE_E_ARG, "container path too long");
    FILE *probe = fopen(path, "rb");
    if (!probe) return WASTE_OK;
    fclose(probe);
    waste_status st = read_whole_file(path, &text, &len, err, errcap);
    if (st != WASTE_OK) return st;
    for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
    for (uint32_t id = 0; id < t->vocab_size; id++)
        if (t->length[id] > longest) longest = t->length[id];
    t->merge_slots = 1;
    while (t->merge_slots < 2 * (lines + 1)) t->merge_slots *= 2;
    t->merge_keys = calloc(t->merge_slots, sizeof *t->merge_keys);
    t->merge_prio = malloc(t->merge_slots * sizeof *t->merge_prio);
    uint8_t *scratch = malloc(2 * longest + 1);
    if (!t->merge_keys || !t->merge_prio || !scratch || lines >= INT32_MAX)
        st = wdetail(err, errcap, WASTE_E_OOM, "out of memory for %zu merges", lines);
    int32_t prio = 0;
    for (size_t pos = 0; pos < len && st == WASTE_OK; prio++) {
        const char *nl = memchr(text + pos, '\n', len - pos);
        size_t end = nl ? (size_t)(nl - text) : len;
        st = load_merge_line(t, text + pos, end - pos, prio, scratch, err, errcap);
        pos = end + 1;
    }
    free(scratch);
    free(text);
    return st;
}

/* ------------------------------------------------------------ load/free */

waste_status wtok_load(const char *dir, uint32_t vocab_size, wtok **out, char *err, size_t errcap) {
    const wtok_options defaults = {vocab_size, WPRE_DEFAULT, ""};
    return wtok_load_with(dir, &defaults, out, err, errcap);
}

waste_status wtok_load_with(const char *dir, const wtok_options *opt, wtok **out, char *err,
                            size_t errcap) {
    uint32_t vocab_size = opt->vocab_size;
    *out = NULL;
    if (!dir || vocab_size < 256 || vocab_size > (1u << 24))
        return wdetail(err, errcap, WASTE_E_FORMAT, "tokenizer: vocab_size out of range");
    wtok *t = calloc(1, sizeof *t);
    if (!t) return wdetail(err, errcap, WASTE_E_OOM, "out of memory");
    t->vocab_size = vocab_size;
    t->pretokenizer = opt->pretokenizer;
    t->n_slots = 1;
    while (t->n_slots < 2 * (size_t)vocab_size) t->n_slots *= 2;
    t->offset = calloc(vocab_size, sizeof *t->offset);
    t->length = calloc(vocab_size, sizeof *t->length);
    t->kind = calloc(vocab_size, sizeof *t->kind);
    t->slots = malloc(t->n_slots * sizeof *t->slots);
    if (!t->offset || !t->length || !t->kind || !t->slots) {
        wtok_free(t);
        return wdetail(err, errcap, WASTE_E_OOM, "out of memory");
    }
    memset(t->slots, 0xff, t->n_slots * sizeof *t->slots);  /* all -1 */
    for (int b = 0; b < 256; b++) t->byte_rank[b] = -1;
    waste_status st = load_ranks(t, dir, err, errcap);
    if (st == WASTE_OK) st = load_specials(t, dir, err, errcap);
    if (st == WASTE_OK) st = check_bytes(t, opt->unk, err, errcap);
    if (st == WASTE_OK) st = check_every_id_defined(t, err, errcap);
    if (st == WASTE_OK) st = load_merges(t, dir, err, errcap);
    if (st != WASTE_OK) {
        wtok_free(t);
        return st;
    }
    *out = t;
    return WASTE_OK;
}

void wtok_free(wtok *t) {
    if (!t) return;
    free(t->arena);
    free(t->offset);
    free(t->length);
    free(t->kind);
    free(t->slots);
    free(t->specials);
    free(t->merge_keys);
    free(t->merge_prio);
    free(t);
}

/* ------------------------------------------------------------- encoding */

/* Collects ids; counts past cap so the caller learns the size it needs. */
typedef struct {
    int32_t *out;
    size_t cap, n;
} sink;

static void emit(sink *s, int32_t id) {
    if (s->n < s->cap) s->out[s->n] = id;
    s->n++;
}

/* A candidate merge: the symbols starting at pos (left_len bytes) and right
 * after it (right_len bytes).  Stale once either symbol has changed. */
typedef struct {
    int32_t rank;
    uint32_t pos, left_len, right_len;
} pair;

typedef struct {
    uint32_t *len;   /* [n] length of the symbol starting at byte i, 0 inside one */
    uint32_t *prev;  /* [n] start of the previous symbol (valid at symbol starts) */
    pair *heap;      /* [3n]: n-1 initial pairs, at most 2 more per merge */
    size_t cap;      /* n the buffers hold */
} scratch;

static int pair_less(const pair *a, const pair *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(pair *h, size_t *n, pair p) {
    size_t i = (*n)++;
    while (i > 0 && pair_less(&p, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = p;
}

static pair heap_pop(pair *h, size_t *n) {
    pair top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && pair_less(&h[c + 1], &h[c])) c++;
        if (!pair_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

static int scratch_reserve(scratch *s, size_t n) {
    if (n <= s->cap) return 1;
    uint32_t *len = realloc(s->len, n * sizeof *len);
    if (len) s->len = len;
    uint32_t *prev = realloc(s->prev, n * sizeof *prev);
    if (prev) s->prev = prev;
    pair *heap = realloc(s->heap, 3 * n * sizeof *heap);
    if (heap) s->heap = heap;
    if (!len || !prev || !heap) return 0;
    s->cap = n;
    return 1;
}

/* Pushes the pair starting at symbol pos when it may merge: with
 * tokenizer.merges when that lists the pair (its priority is the line
 * number), else when the concatenation is a token (its rank). */
static void push_pair(const wtok *t, const uint8_t *p, size_t n, scratch *s, size_t *hn,
                      uint32_t pos) {
    uint32_t l = s->len[pos];
    if (pos + l >= n) return;
    uint32_t r = s->len[pos + l];
    int32_t rank = t->merge_slots
                       ? merge_priority(t, rank_of(t, p + pos, l), rank_of(t, p + pos + l, r))
                       : rank_of(t, p + pos, (size_t)l + r);
    if (rank >= 0) heap_push(s->heap, hn, (pair){rank, pos, l, r});
}

static waste_status bpe_piece(const wtok *t, const uint8_t *p, size_t n, scratch *s, sink *out) {
    if (n == 1) {
        emit(out, t->byte_rank[p[0]]);
        return WASTE_OK;
    }
    /* Common case: the pre-token is itself a token.  Merge lists (as in
     * Hugging Face's BPE) do not take that shortcut: a token may be
     * unreachable by its merges. */
    int32_t whole = t->merge_slots ? -1 : rank_of(t, p, n);
    if (whole >= 0) {
        emit(out, whole);
        return WASTE_OK;
    }
    if (n > UINT32_MAX / 4 || !scratch_reserve(s, n)) return WASTE_E_OOM;
    size_t hn = 0;
    for (uint32_t i = 0; i < n; i++) {
        s->len[i] = 1;
        s->prev[i] = i - 1;  /* unused at i == 0 */
    }
    for (uint32_t i = 0; i + 1 < n; i++) push_pair(t, p, n, s, &hn, i);
    while (hn) {
        pair m = heap_pop(s->heap, &hn);
        if (s->len[m.pos] != m.left_len || s->len[m.pos + m.left_len] != m.right_len) continue;
        uint32_t right = m.pos + m.left_len, merged = m.left_len + m.right_len;
        s->len[right] = 0;
        s->len[m.pos] = merged;
        if (m.pos + merged < n) s->prev[m.pos + merged] = m.pos;
        if (m.pos > 0) push_pair(t, p, n, s, &hn, s->prev[m.pos]);
        push_pair(t, p, n, s, &hn, m.pos);
    }
    for (uint32_t i = 0; i < n; i += s->len[i]) {
        int32_t id = s->len[i] == 1 ? t->byte_rank[p[i]] : rank_of(t, p + i, s->len[i]);
        emit(out, id);
    }
    return WASTE_OK;
}

static int is_space(uint8_t c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}
static int is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
static int is_letter(uint8_t c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c >= 0x80;
}
static int is_other(uint8_t c) { return !is_space(c) && !is_digit(c) && !is_letter(c); }

/* Length of the pre-token at p[0..n), by FORMAT.md's four rules in order. */
static size_t pretoken_len(const uint8_t *p, size_t n) {
    size_t j = (p[0] == ' ' && n > 1) ? 1 : 0;
    if (is_letter(p[j])) {
        while (j < n && is_letter(p[j])) j++;
    } else if (is_digit(p[j])) {
        size_t end = j + 3 < n ? j + 3 : n;
        while (j < end && is_digit(p[j])) j++;
    } else if (is_other(p[j])) {
        while (j < n && is_other(p[j])) j++;
    } else {
        j = 0;
        while (j < n && is_space(p[j])) j++;
        /* A run of spaces gives its last ' ' to the word that follows. */
        if (j < n && j > 1 && p[j - 1] == ' ') j--;
    }
    return j;
}

/* The code point at p (1 to 4 bytes); a byte that does not start valid
 * UTF-8 stands alone as a code point of no class. */
static size_t utf8_next(const uint8_t *p, size_t n, uint32_t *cp) {
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    size_t len = p[0] < 0x80 ? 1 : (p[0] >> 5) == 6 ? 2 : (p[0] >> 4) == 14 ? 3 : (p[0] >> 3) == 30 ? 4 : 0;
    uint32_t c = len == 1 ? p[0] : len == 2 ? p[0] & 0x1F : len == 3 ? p[0] & 0x0F : p[0] & 0x07;
    if (len == 0 || len > n) goto invalid;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80) goto invalid;
        c = c << 6 | (p[i] & 0x3F);
    }
    if (c < min_cp[len] || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) goto invalid;
    *cp = c;
    return len;
invalid:
    *cp = UINT32_MAX;
    return 1;
}

static int uni_is_other(uint32_t c) {
    return !wuni_is_space(c) && !wuni_is_letter(c) && !wuni_is_number(c);
}

/* Bytes from p that are all of one class (test) and within n. */
static size_t run_of(const uint8_t *p, size_t n, int (*test)(uint32_t)) {
    size_t k = 0;
    while (k < n) {
        uint32_t c;
        size_t len = utf8_next(p + k, n - k, &c);
        if (!test(c)) break;
        k += len;
    }
    return k;
}

/* One match of GPT-2's pattern  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
 * ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+  at p, within a piece of n bytes. */
static size_t gpt2_match(const uint8_t *p, size_t n) {
    if (p[0] == '\'' && n >= 2) {
        if (memchr("stmd", p[1], 4)) return 2;
        if (n >= 3 && (memcmp(p + 1, "re", 2) == 0 || memcmp(p + 1, "ve", 2) == 0 ||
                       memcmp(p + 1, "ll", 2) == 0))
            return 3;
    }
    size_t skip = p[0] == ' ' && n > 1 ? 1 : 0;
    uint32_t c;
    utf8_next(p + skip, n - skip, &c);
    if (wuni_is_letter(c)) return skip + run_of(p + skip, n - skip, wuni_is_letter);
    if (wuni_is_number(c)) return skip + run_of(p + skip, n - skip, wuni_is_number);
    if (uni_is_other(c)) return skip + run_of(p + skip, n - skip, uni_is_other);
    /* White space: all of it at the piece's end, else all but its last
     * character, which then starts the next match (unless it is alone). */
    size_t k = 0, last = 0;
    while (k < n) {
        size_t len = utf8_next(p + k, n - k, &c);
        if (!wuni_is_space(c)) break;
        last = len;
        k += len;
    }
    return k == n || k == last ? k : k - last;
}

/* smollm: every number character is a pre-token of its own; the text
 * between them is split by gpt2_match. */
static waste_status encode_smollm(const wtok *t, const uint8_t *p, size_t n, scratch *s,
                                  sink *out) {
    size_t i = 0;
    waste_status st = WASTE_OK;
    while (i < n && st == WASTE_OK) {
        uint32_t c;
        size_t len = utf8_next(p + i, n - i, &c), end = i;
        if (wuni_is_number(c)) {
            st = bpe_piece(t, p + i, len, s, out);
            i += len;
            continue;
        }
        while (end < n) {
            size_t step = utf8_next(p + end, n - end, &c);
            if (wuni_is_number(c)) break;
            end += step;
        }
        while (i < end && st == WASTE_OK) {
            size_t m = gpt2_match(p + i, end - i);
            st = bpe_piece(t, p + i, m, s, out);
            i += m;
        }
    }
    return st;
}

static waste_status encode_plain(const wtok *t, const uint8_t *p, size_t n, scratch *s,
                                 sink *out) {
    if (t->pretokenizer == WPRE_SMOLLM) return encode_smollm(t, p, n, s, out);
    while (n) {
        size_t len = pretoken_len(p, n);
        waste_status st = bpe_piece(t, p, len, s, out);
        if (st != WASTE_OK) return st;
        p += len;
        n -= len;
    }
    return WASTE_OK;
}

/* The special whose text starts at p (longest wins), or -1. */
static int32_t special_at(const wtok *t, const uint8_t *p, size_t n, size_t *match_len) {
    int32_t best = -1;
    size_t best_len = 0;
    if (!t->special_first[p[0]]) return -1;
    for (size_t i = 0; i < t->n_specials; i++) {
        int32_t id = t->specials[i];
        size_t len = t->length[id];
        if (len > best_len && len <= n && memcmp(p, t->arena + t->offset[id], len) == 0) {
            best = id;
            best_len = len;
        }
    }
    *match_len = best_len;
    return best;
}

waste_status wtok_encode(const wtok *t, const char *text, int markup, int add_bos,
                         int32_t bos_id, int32_t *out, size_t cap, size_t *n_out) {
    if (!t || !text || (!out && cap) || !n_out) return WASTE_E_ARG;
    sink s = {out, cap, 0};
    scratch sc = {0};
    waste_status st = WASTE_OK;
    const uint8_t *p = (const uint8_t *)text;
    size_t n = strlen(text), plain = 0;
    if (add_bos && bos_id >= 0) emit(&s, bos_id);
    for (size_t i = 0; markup && i < n && st == WASTE_OK;) {
        size_t len;
        int32_t id = special_at(t, p + i, n - i, &len);
        if (id < 0) { i++; continue; }
        st = encode_plain(t, p + plain, i - plain, &sc, &s);
        emit(&s, id);
        i += len;
        plain = i;
    }
    if (st == WASTE_OK) st = encode_plain(t, p + plain, n - plain, &sc, &s);
    free(sc.len);
    free(sc.prev);
    free(sc.heap);
    *n_out = s.n;
    if (st == WASTE_OK && s.n > cap) return WASTE_E_ARG;
    return st;
}

/* --------------------------------------------------------------- lookup */

const uint8_t *wtok_piece(const wtok *t, int32_t id, size_t *len) {
    if (!t || id < 0 || (uint32_t)id >= t->vocab_size || t->kind[id] == KIND_NONE) return NULL;
    if (len) *len = t->length[id];
    return t->arena + t->offset[id];
}

int32_t wtok_special_id(const wtok *t, const char *text) {
    if (!t || !text) return -1;
    size_t n = strlen(text);
    for (size_t i = 0; i < t->n_specials; i++) {
        int32_t id = t->specials[i];
        if (t->length[id] == n && memcmp(t->arena + t->offset[id], text, n) == 0) return id;
    }
    return -1;
}

int wtok_is_special(const wtok *t, int32_t id) {
    return t && id >= 0 && (uint32_t)id < t->vocab_size && t->kind[id] == KIND_SPECIAL;
}

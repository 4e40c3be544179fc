/*
 * json.c -- recursive-descent JSON reader (RFC 8259) into a json_value tree.
 * Strict: no comments, no trailing commas, no NaN; control characters in
 * strings and lone surrogates are errors, since a metadata file that bends
 * the grammar is more likely damaged than clever.
 */
#include "json.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *s;
    size_t len, pos;
    char *err;
    size_t errcap;
    int failed;
} parser;

static void fail(parser *p, const char *fmt, ...) {
    if (p->failed) return;  /* keep the first, most specific reason */
    p->failed = 1;
    if (!p->err || p->errcap == 0) return;
    char msg[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(p->err, p->errcap, "json: %s at byte %zu", msg, p->pos);
}

static void skip_ws(parser *p) {
    while (p->pos < p->len) {
        char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static int peek(const parser *p) { return p->pos < p->len ? (unsigned char)p->s[p->pos] : -1; }

static int literal(parser *p, const char *word) {
    size_t n = strlen(word);
    if (p->len - p->pos < n || memcmp(p->s + p->pos, word, n) != 0) {
        fail(p, "unexpected token");
        return 0;
    }
    p->pos += n;
    return 1;
}

static int hex4(parser *p, unsigned *out) {
    if (p->len - p->pos < 4) { fail(p, "truncated \\u escape"); return 0; }
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p->s[p->pos++];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else { fail(p, "bad hex digit in \\u escape"); return 0; }
    }
    *out = v;
    return 1;
}

static size_t put_utf8(char *dst, unsigned cp) {
    if (cp < 0x80) { dst[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        dst[0] = (char)(0xC0 | (cp >> 6));
        dst[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char)(0xE0 | (cp >> 12));
        dst[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    dst[0] = (char)(0xF0 | (cp >> 18));
    dst[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    dst[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    dst[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* One \uXXXX escape (or a surrogate pair of them) -> a code point. */
static int unicode_escape(parser *p, unsigned *cp) {
    unsigned hi, lo;
    if (!hex4(p, &hi)) return 0;
    if (hi >= 0xDC00 && hi <= 0xDFFF) { fail(p, "lone low surrogate"); return 0; }
    if (hi < 0xD800 || hi > 0xDBFF) { *cp = hi; return 1; }
    if (p->len - p->pos < 2 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u') {
        fail(p, "lone high surrogate");
        return 0;
    }
    p->pos += 2;
    if (!hex4(p, &lo)) return 0;
    if (lo < 0xDC00 || lo > 0xDFFF) { fail(p, "bad low surrogate"); return 0; }
    *cp = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
    return 1;
}

/* Parses a string starting at its opening quote.  The decoded text is never
 * longer than the source, so one allocation of the source length suffices. */
static char *parse_string(parser *p, size_t *out_len) {
    p->pos++;  /* opening quote */
    size_t start = p->pos;
    while (p->pos < p->len && p->s[p->pos] != '"') p->pos += (p->s[p->pos] == '\\') ? 2 : 1;
    if (p->pos >= p->len) { fail(p, "unterminated string"); return NULL; }
    size_t end = p->pos;
    char *buf = malloc(end - start + 1);
    if (!buf) { fail(p, "out of memory"); return NULL; }
    size_t n = 0;
    p->pos = start;
    while (p->pos < end) {
        unsigned char c = (unsigned char)p->s[p->pos++];
        if (c < 0x20) { fail(p, "control character in string"); free(buf); return NULL; }
        if (c != '\\') { buf[n++] = (char)c; continue; }
        char e = p->s[p->pos++];
        unsigned cp;
        switch (e) {
        case '"': buf[n++] = '"'; break;
        case '\\': buf[n++] = '\\'; break;
        case '/': buf[n++] = '/'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case 'u':
            if (!unicode_escape(p, &cp)) { free(buf); return NULL; }
            n += put_utf8(buf + n, cp);
            break;
        default: fail(p, "bad escape"); free(buf); return NULL;
        }
    }
    p->pos = end + 1;
    buf[n] = '\0';
    *out_len = n;
    return buf;
}

static int is_digit(int c) { return c >= '0' && c <= '9'; }

/* Checks the JSON number grammar, then converts with strtod on a bounded
 * copy (the input is not NUL-terminated). */
static int parse_number(parser *p, double *out) {
    size_t start = p->pos;
    if (peek(p) == '-') p->pos++;
    if (peek(p) == '0') p->pos++;
    else if (is_digit(peek(p))) while (is_digit(peek(p))) p->pos++;
    else { fail(p, "bad number"); return 0; }
    if (peek(p) == '.') {
        p->pos++;
        if (!is_digit(peek(p))) { fail(p, "bad number fraction"); return 0; }
        while (is_digit(peek(p))) p->pos++;
    }
    if (peek(p) == 'e' || peek(p) == 'E') {
        p->pos++;
        if (peek(p) == '+' || peek(p) == '-') p->pos++;
        if (!is_digit(peek(p))) { fail(p, "bad number exponent"); return 0; }
        while (is_digit(peek(p))) p->pos++;
    }
    char tmp[64];
    size_t n = p->pos - start;
    if (n >= sizeof tmp) { fail(p, "number too long"); return 0; }
    memcpy(tmp, p->s + start, n);
    tmp[n] = '\0';
    errno = 0;
    *out = strtod(tmp, NULL);
    if (errno == ERANGE && (*out > 1.0 || *out < -1.0)) { fail(p, "number out of range"); return 0; }
    return 1;
}

static void free_children(json_value *v);

static int parse_value(parser *p, json_value *v, int depth);

/* Appends one zeroed child to v->items, growing geometrically. */
static json_value *push_child(parser *p, json_value *v, size_t *cap) {
    if (v->len == *cap) {
        size_t ncap = *cap ? *cap * 2 : 4;
        json_value *grown = realloc(v->items, ncap * sizeof *grown);
        if (!grown) { fail(p, "out of memory"); return NULL; }
        v->items = grown;
        *cap = ncap;
    }
    json_value *child = &v->items[v->len++];
    memset(child, 0, sizeof *child);
    return child;
}

static int parse_array(parser *p, json_value *v, int depth) {
    size_t cap = 0;
    v->type = JSON_ARRAY;
    p->pos++;
    skip_ws(p);
    if (peek(p) == ']') { p->pos++; return 1; }
    for (;;) {
        json_value *item = push_child(p, v, &cap);
        if (!item || !parse_value(p, item, depth + 1)) return 0;
        skip_ws(p);
        int c = peek(p);
        p->pos++;
        if (c == ']') return 1;
        if (c != ',') { p->pos--; fail(p, "expected ',' or ']'"); return 0; }
    }
}

static int compare_keys(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Refuse an object that names a member twice.  Sorting the names keeps this
 * O(n log n): a per-member lookup would make a hostile file with a million
 * members take hours. */
static int check_unique_keys(parser *p, const json_value *v) {
    if (v->len < 2) return 1;
    const char **keys = malloc(v->len * sizeof *keys);
    if (!keys) { fail(p, "out of memory"); return 0; }
    for (size_t i = 0; i < v->len; i++) keys[i] = v->items[i].key;
    qsort(keys, v->len, sizeof *keys, compare_keys);
    const char *dup = NULL;
    for (size_t i = 1; i < v->len && !dup; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0) dup = keys[i];
    if (dup) fail(p, "duplicate member name \"%.40s\"", dup);
    free(keys);
    return dup == NULL;
}

static int parse_object(parser *p, json_value *v, int depth) {
    size_t cap = 0;
    v->type = JSON_OBJECT;
    p->pos++;
    skip_ws(p);
    if (peek(p) == '}') { p->pos++; return 1; }
    for (;;) {
        skip_ws(p);
        if (peek(p) != '"') { fail(p, "expected a member name"); return 0; }
        size_t key_len;
        char *key = parse_string(p, &key_len);
        if (!key) return 0;
        if (strlen(key) != key_len) {
            fail(p, "member name \"%.40s\" contains a NUL", key);
            free(key);
            return 0;
        }
        json_value *member = push_child(p, v, &cap);
        if (!member) { free(key); return 0; }
        member->key = key;
        skip_ws(p);
        if (peek(p) != ':') { fail(p, "expected ':'"); return 0; }
        p->pos++;
        if (!parse_value(p, member, depth + 1)) return 0;
        skip_ws(p);
        int c = peek(p);
        p->pos++;
        if (c == '}') return check_unique_keys(p, v);
        if (c != ',') { p->pos--; fail(p, "expected ',' or '}'"); return 0; }
    }
}

static int parse_value(parser *p, json_value *v, int depth) {
    if (depth >= JSON_MAX_DEPTH) { fail(p, "nested deeper than %d", JSON_MAX_DEPTH); return 0; }
    skip_ws(p);
    switch (peek(p)) {
    case '{': return parse_object(p, v, depth);
    case '[': return parse_array(p, v, depth);
    case '"':
        v->type = JSON_STRING;
        v->str = parse_string(p, &v->len);
        return v->str != NULL;
    case 't': v->type = JSON_BOOL; v->number = 1; return literal(p, "true");
    case 'f': v->type = JSON_BOOL; v->number = 0; return literal(p, "false");
    case 'n': v->type = JSON_NULL; return literal(p, "null");
    case -1: fail(p, "unexpected end of input"); return 0;
    default:
        if (peek(p) != '-' && !is_digit(peek(p))) { fail(p, "unexpected character"); return 0; }
        v->type = JSON_NUMBER;
        return parse_number(p, &v->number);
    }
}

json_value *json_parse(const char *text, size_t len, char *err, size_t errcap) {
    parser p = {text, len, 0, err, errcap, 0};
    json_value *root = calloc(1, sizeof *root);
    if (!root) {
        fail(&p, "out of memory");
        return NULL;
    }
    if (parse_value(&p, root, 0)) {
        skip_ws(&p);
        if (p.pos == p.len) return root;
        fail(&p, "trailing characters");
    }
    json_free(root);
    return NULL;
}

waste_status read_whole_file(const char *path, char **buf, size_t *len, char *err, size_t errcap) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errcap, "cannot open %s: %s", path, strerror(errno));
        return WASTE_E_IO;
    }
    size_t cap = 4096, n = 0;
    char *data = malloc(cap);
    while (data) {
        n += fread(data + n, 1, cap - n, f);
        if (n < cap) break;
        char *grown = realloc(data, cap * 2);
        if (!grown) { free(data); data = NULL; break; }
        data = grown;
        cap *= 2;
    }
    int read_error = ferror(f);
    fclose(f);
    if (!data) { snprintf(err, errcap, "out of memory reading %s", path); return WASTE_E_OOM; }
    if (read_error) {
        free(data);
        snprintf(err, errcap, "cannot read %s", path);
        return WASTE_E_IO;
    }
    *buf = data;
    *len = n;
    return WASTE_OK;
}

waste_status json_load_file(const char *path, json_value **out, char *err, size_t errcap) {
    *out = NULL;
    char *buf;
    size_t n;
    waste_status st = read_whole_file(path, &buf, &n, err, errcap);
    if (st != WASTE_OK) return st;
    char why[200] = "";
    *out = json_parse(buf, n, why, sizeof why);
    free(buf);
    if (*out) return WASTE_OK;
    snprintf(err, errcap, "%s: %s", path, why);
    return strstr(why, "out of memory") ? WASTE_E_OOM : WASTE_E_FORMAT;
}

static void free_children(json_value *v) {
    for (size_t i = 0; i < v->len && v->items; i++) {
        free_children(&v->items[i]);
        free(v->items[i].key);
    }
    free(v->items);
    free(v->str);
}

void json_free(json_value *v) {
    if (!v) return;
    free_children(v);
    free(v);
}

const json_value *json_get(const json_value *v, const char *key) {
    if (!v || v->type != JSON_OBJECT) return NULL;
    for (size_t i = 0; i < v->len; i++)
        if (v->items[i].key && strcmp(v->items[i].key, key) == 0) return &v->items[i];
    return NULL;
}

const json_value *json_at(const json_value *v, size_t i) {
    if (!v || v->type != JSON_ARRAY || i >= v->len) return NULL;
    return &v->items[i];
}

size_t json_count(const json_value *v) {
    return v && (v->type == JSON_ARRAY || v->type == JSON_OBJECT) ? v->len : 0;
}

const char *json_string(const json_value *v, size_t *len) {
    if (!v || v->type != JSON_STRING) return NULL;
    if (len) *len = v->len;
    return v->str;
}

int json_number(const json_value *v, double *out) {
    if (!v || v->type != JSON_NUMBER) return 0;
    *out = v->number;
    return 1;
}

int json_int(const json_value *v, int64_t min, int64_t max, int64_t *out) {
    double d;
    /* Range first: converting an out-of-range double to int64_t is undefined. */
    if (!json_number(v, &d) || !(d >= (double)min && d <= (double)max)) return 0;
    if (d <= -9.2e18 || d >= 9.2e18 || d != (double)(int64_t)d) return 0;
    *out = (int64_t)d;
    return 1;
}

int json_bool(const json_value *v, int *out) {
    if (!v || v->type != JSON_BOOL) return 0;
    *out = (int)v->number;
    return 1;
}

/*
 * json.h -- a small DOM-style JSON reader for the container's metadata files
 * (manifest.json, specials.json, vision.json).  Internal to the engine.
 *
 * json_parse builds a tree that the caller owns and frees with json_free.
 * The accessors are NULL-safe: asking a missing or wrongly typed node gives
 * NULL / 0, so a lookup chain needs one check at the end, not one per step.
 */
#ifndef WASTE_JSON_H
#define WASTE_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "waste.h"

#define JSON_MAX_DEPTH 64

typedef enum {
    JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT
} json_type;

typedef struct json_value json_value;
struct json_value {
    json_type type;
    char *key;          /* member name when this value sits in an object, else NULL */
    double number;      /* JSON_NUMBER; JSON_BOOL: 0 or 1 */
    char *str;          /* JSON_STRING: UTF-8, NUL-terminated (len bytes) */
    size_t len;         /* string bytes, or the number of items/members */
    json_value *items;  /* JSON_ARRAY / JSON_OBJECT: len children, in file order */
};

/* Parse len bytes of JSON text (one value, surrounding whitespace allowed).
 * Returns NULL on malformed input (reason and byte offset in err), on
 * nesting deeper than JSON_MAX_DEPTH, on duplicate object keys, or when out
 * of memory (err says so). */
json_value *json_parse(const char *text, size_t len, char *err, size_t errcap);

/* Read a whole file into a malloc'd buffer (the caller frees; not
 * NUL-terminated).  Errors: WASTE_E_IO (cannot open or read), WASTE_E_OOM. */
waste_status read_whole_file(const char *path, char **buf, size_t *len, char *err, size_t errcap);

/* Read and parse a whole file.  WASTE_E_IO when it cannot be read,
 * WASTE_E_FORMAT when it is not valid JSON, WASTE_E_OOM. */
waste_status json_load_file(const char *path, json_value **out, char *err, size_t errcap);

void json_free(json_value *v);

/* Object member by name, or NULL (also when v is not an object). */
const json_value *json_get(const json_value *v, const char *key);

/* Array item i, or NULL (also when v is not an array). */
const json_value *json_at(const json_value *v, size_t i);

/* Items of an array or members of an object; 0 for anything else. */
size_t json_count(const json_value *v);

/* The string's bytes (NUL-terminated), or NULL when v is not a string.
 * len (optional) receives the byte length. */
const char *json_string(const json_value *v, size_t *len);

/* 1 and *out when v is a number, else 0. */
int json_number(const json_value *v, double *out);

/* 1 and *out when v is a whole number within [min, max], else 0. */
int json_int(const json_value *v, int64_t min, int64_t max, int64_t *out);

/* 1 and *out (0 or 1) when v is true/false, else 0. */
int json_bool(const json_value *v, int *out);

#endif

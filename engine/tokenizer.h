/*
 * tokenizer.h -- byte-level BPE over a container's tokenizer.model and
 * specials.json (see FORMAT.md).  Internal to the engine.
 *
 * Errors follow waste.h: functions return a waste_status and, on failure,
 * write a specific reason into err (errcap bytes, always NUL-terminated).
 */
#ifndef WASTE_TOKENIZER_H
#define WASTE_TOKENIZER_H

#include "manifest.h"
#include "waste.h"

typedef struct wtok wtok;

typedef struct {
    uint32_t vocab_size; /* the manifest's: every rank and special id is below it */
    int pretokenizer;    /* WPRE_* (manifest.h) */
    const char *unk;     /* a special's text that stands for a byte without a token; "" for none */
} wtok_options;

/* Load <dir>/tokenizer.model, <dir>/specials.json and, when present,
 * <dir>/tokenizer.merges.  Without an unk token every byte needs a token.
 * Errors: WASTE_E_IO (missing file), WASTE_E_FORMAT (bad line, duplicate or
 * out-of-range id, missing single-byte ranks, bad or repeated special, an id
 * below vocab_size that neither file defines, a bad merge, an unk that is no
 * special), WASTE_E_OOM. */
waste_status wtok_load_with(const char *dir, const wtok_options *opt, wtok **out, char *err,
                            size_t errcap);

/* wtok_load_with the default pre-tokenizer and no unk token. */
waste_status wtok_load(const char *dir, uint32_t vocab_size, wtok **out, char *err, size_t errcap);

void wtok_free(wtok *tok);

/* Encode text (NUL-terminated).  markup != 0 recognises specials' exact
 * texts; markup == 0 never yields a special id.  add_bos prepends bos_id
 * (ignored when bos_id < 0).  On a short buffer: WASTE_E_ARG with the needed
 * count in *n_out (the ids that fit are written). */
waste_status wtok_encode(const wtok *tok, const char *text, int markup,
                         int add_bos, int32_t bos_id, int32_t *out,
                         size_t cap, size_t *n_out);

/* The raw bytes of token id (a special's text for a special), or NULL for
 * an id that is not in the vocabulary. */
const uint8_t *wtok_piece(const wtok *tok, int32_t id, size_t *len);

/* The id of a special token given its exact text, or -1. */
int32_t wtok_special_id(const wtok *tok, const char *text);

/* Non-zero when id is a special token. */
int wtok_is_special(const wtok *tok, int32_t id);

#endif

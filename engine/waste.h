/*
 * waste.h -- the libwaste C ABI, version 1 (engine 0.6.x).
 *
 * libwaste is a library first: every host (the `serve` HTTP server, test
 * suites, benchmarks) drives a model through the functions below.  This file
 * is the reference engine's copy of the ABI that WARP's production libwaste
 * also implements, so a host built against it runs either library unchanged.
 *
 * Struct field order and types are part of the ABI: ctypes hosts mirror them
 * by position.  Never reorder, insert or retype a field.
 *
 * Conventions that hold for every function unless its comment says otherwise:
 *   - A function returning waste_status returns WASTE_OK (0) on success and a
 *     negative code on failure; output parameters are left untouched on
 *     failure.
 *   - On failure, waste_error_detail() returns a specific, human-readable
 *     reason (the generic reason is waste_strerror(status)).
 *   - Strings returned as `const char *` are owned by the library (static, or
 *     by the context for as long as it is open); hosts never free them.
 *   - A waste_ctx is NOT thread-safe: serialize every call on one context.
 *     Distinct contexts are independent and may run at once: each has
 *     compute threads of its own (waste_cfg.n_threads).
 */
#ifndef WASTE_H
#define WASTE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WASTE_API_VERSION 1

/* Marks the exported functions: the library is built with hidden
 * visibility so only the waste_* API leaves it. */
#if defined(__GNUC__) || defined(__clang__)
#define WASTE_API __attribute__((visibility("default")))
#else
#define WASTE_API
#endif

/* ------------------------------------------------------------------ status */

typedef enum {
    WASTE_OK = 0,
    WASTE_E_IO = -1,          /* file missing, short read, bad checksum */
    WASTE_E_FORMAT = -2,      /* container malformed or wrong version */
    WASTE_E_RAM_BUDGET = -3,  /* budget below the model's floor */
    WASTE_E_OOM = -4,         /* allocation failed */
    WASTE_E_ARG = -5,         /* bad argument; prompt does not fit; buffer too small */
    WASTE_E_UNSUPPORTED = -6, /* feature not built in or not in this container */
    WASTE_E_CANCELLED = -7,   /* the token callback asked to stop */
    WASTE_E_BUSY = -8         /* another process owns this container */
} waste_status;

/* Static text for a status; never NULL (unknown codes get a generic text). */
WASTE_API const char *waste_strerror(waste_status status);

/* ------------------------------------------------------- version and build */

/* Engine version string, e.g. "0.6.0".  Static. */
WASTE_API const char *waste_version(void);

/* MAJOR*10000 + MINOR*100 + PATCH, e.g. 0.6.0 -> 600. */
WASTE_API int waste_version_number(void);

/* One human line: backend, SIMD, container format version.  Never NULL. */
WASTE_API const char *waste_build_info(void);

/* ----------------------------------------------------------------- structs */

typedef struct waste_ctx waste_ctx; /* opaque; one open model */

/* Memory plan, in bytes.  floor = trunk + state + scratch + min_expert_cache
 * is the hard minimum; recommended = floor + a cache worth having. */
typedef struct {
    uint64_t trunk_bytes;       /* resident weights that are not experts */
    uint64_t state_bytes;       /* conversation state (KV cache) at ctx_tokens */
    uint64_t scratch_bytes;     /* activations, logits, I/O buffers */
    uint64_t min_expert_cache;  /* the smallest expert cache that works */
    uint64_t floor_bytes;       /* the hard minimum budget */
    uint64_t recommended_bytes; /* floor + a cache worth having */
    uint64_t vision_bytes;      /* what vision=1 adds; 0 without a tower */
    uint64_t working_set_bytes; /* one token's expert traffic */
} waste_memplan;

typedef enum { WASTE_CACHE_LFRU = 0, WASTE_CACHE_LRU = 1 } waste_cache_policy;

typedef struct {
    uint64_t ram_budget_bytes; /* hard ceiling on engine allocations; 0 = engine picks */
    uint32_t ctx_tokens;       /* longest sequence (prompt + generation); 0 = 4096, or the
                                  container's context_length when smaller */
    int n_threads;             /* this context's compute threads, the caller's included; 0 = one
                                  per core (or per listed CPU).  Contexts that run at once
                                  should share the cores out between them */
    const char *cpu_list;      /* "0-5" / "0-2,6-8"; NULL = unrestricted */
    int cache_policy;          /* waste_cache_policy */
    int use_direct_io;         /* bypass the page cache for expert reads */
    int vision;                /* load the vision tower */
    int verify_records;        /* crc32-check every expert record read */
    const char *usage_path;    /* learned hotlist; NULL = <model>/usage.waste */
    int exclusive_open;        /* single-process ownership; competitor -> WASTE_E_BUSY */
} waste_cfg;

/* Fill *cfg with defaults (LFRU, direct I/O on, everything else 0/NULL).
 * Always call it before setting fields. */
WASTE_API void waste_cfg_init(waste_cfg *cfg);

typedef struct {
    float temperature;          /* 0 = greedy */
    float top_p;                /* nucleus mass; 1 = off */
    int top_k;                  /* 0 = off */
    uint64_t seed;              /* same seed + same state -> same tokens */
    uint32_t max_tokens;        /* generation cap */
    const char *grammar;        /* GBNF text or NULL; declared, ignored */
    const int32_t *stop_tokens; /* ids that end generation (after the callback) */
    size_t n_stop;
} waste_gen_params;

/* Fill *p with defaults: temperature 0, top_p 1, top_k 0, seed 0,
 * max_tokens 256, no grammar, no stop tokens. */
WASTE_API void waste_gen_params_init(waste_gen_params *p);

/* Handed to the token callback for every generated token.  The counters and
 * times are that token's; the first token's also include evaluating the
 * prompt passed to this waste_generate (its time to first token). */
typedef struct {
    uint32_t token_index;    /* 0 for the first generated token */
    int32_t token;
    float logprob;           /* log-probability of the sampled token */
    uint32_t experts_hit;    /* this token's expert cache hits */
    uint32_t experts_missed; /* this token's expert cache misses */
    uint64_t bytes_read;     /* this token's expert bytes read from disk */
    double ms_total;         /* this token's wall time */
    double ms_io;            /* of which expert reads */
} waste_token_info;

typedef struct {
    uint32_t n_layers;
    uint32_t n_experts;
    uint32_t top_k;
    uint32_t hidden;
    uint32_t ctx_max;        /* the context this ctx was opened with */
    uint64_t params_total;
    uint64_t params_active;  /* per token */
    const char *arch;        /* e.g. "kimi-k3"; owned by the ctx */
    const char *quant_summary;
} waste_model_info;

/* experts_hit and experts_missed count expert records fetched through the
 * expert cache: an engine that evaluates a prompt in batches fetches each
 * expert once per batch for all the tokens routed to it. */
typedef struct {
    uint64_t tokens_generated;
    uint64_t experts_hit;
    uint64_t experts_missed;
    uint64_t bytes_read;
    double sec_total;
    double sec_io;
    int direct_io;           /* 0 when some bank could not bypass the page cache */
} waste_stats;

/* ------------------------------------------------------ lifecycle, planning */

/* Plan memory for model_path at ctx_tokens (0 = 4096, or the container's
 * context_length when smaller) without loading any weights: only
 * manifest.json, the bank headers and sizes and vision.json are read.
 * Errors: WASTE_E_IO (missing files), WASTE_E_FORMAT (malformed manifest or
 * bank header), WASTE_E_ARG (NULL arguments; a ctx_tokens above the
 * container's context_length, which error_detail names).  A host finds the
 * largest context a model takes by asking for candidates. */
WASTE_API waste_status waste_plan_memory(const char *model_path, uint32_t ctx_tokens,
                                         waste_memplan *out);

/* Open a container.  cfg may be NULL for defaults.  On success *out owns the
 * model until waste_close.  Errors: WASTE_E_IO, WASTE_E_FORMAT,
 * WASTE_E_RAM_BUDGET (budget below the floor), WASTE_E_OOM, WASTE_E_ARG
 * (malformed cpu_list, a CPU this process may not use, bad config, a
 * ctx_tokens above the container's context_length),
 * WASTE_E_UNSUPPORTED (vision=1 without a tower; binding unavailable),
 * WASTE_E_BUSY (exclusive_open and another owner holds the container).
 * On failure *out is NULL and waste_error_detail(NULL) tells why.
 * Two environment variables are read here, by the reference engine only:
 * WASTE_VERIFY=1 forces verify_records on; WASTE_DELAY_MS=x (0 < x < 60000)
 * adds x milliseconds of sleep per evaluated token, prompt or generated, so
 * that tests can run the engine at a slow model's clock (K3 prefills about
 * 0.47 tokens/s: x = 2128).  The delay counts in ms_total and sec_total.
 * WASTE_NO_AVX2=1, read once per process at the first evaluation, keeps the
 * reference engine's kernels on their plain C path (for tests). */
WASTE_API waste_status waste_open(const char *model_path, const waste_cfg *cfg,
                                  waste_ctx **out);

/* Close and free everything the ctx owns.  NULL is a no-op. */
WASTE_API void waste_close(waste_ctx *ctx);

/* What this ctx actually resolved, in plan terms: the plan's trunk, state,
 * scratch, min_expert_cache, floor and working set at the opened context;
 * recommended_bytes = trunk + state + scratch + the expert cache actually
 * allocated (so cache records = (recommended - floor + min_expert_cache) /
 * min_expert_cache); vision_bytes = what the loaded tower and its image
 * queue reserve, 0 without vision. */
WASTE_API waste_status waste_memory_used(const waste_ctx *ctx, waste_memplan *out);

/* Specific text for the last failure on ctx, or NULL when there is none.
 * Also set after a successful waste_generate that stopped because the
 * context filled.  With ctx == NULL: the last failed waste_open or
 * waste_plan_memory on the calling thread.  Valid until the next call on
 * the same ctx (or thread). */
WASTE_API const char *waste_error_detail(const waste_ctx *ctx);

/* Physical RAM, and the RAM this process may use (cgroup limits applied). */
WASTE_API uint64_t waste_physical_ram(void);
WASTE_API uint64_t waste_usable_ram(void);

/* --------------------------------------------------------------- tokenizer */

/* Ordinary text -> ids.  A "<|...|>" inside text becomes the ordinary tokens
 * it is spelled with, never a special token.  add_bos prepends the BOS token.
 * On a short buffer: WASTE_E_ARG with the needed count in *n_out. */
WASTE_API waste_status waste_tokenize(waste_ctx *ctx, const char *text, int add_bos,
                                      int32_t *out, size_t cap, size_t *n_out);

/* As waste_tokenize, but the container's special tokens are recognised.
 * Only structure the host itself wrote may go here. */
WASTE_API waste_status waste_tokenize_markup(waste_ctx *ctx, const char *text, int add_bos,
                                             int32_t *out, size_t cap, size_t *n_out);

/* Ids -> bytes, NUL-terminated.  On a short buffer: WASTE_E_ARG with the
 * needed byte count (without the NUL) in *n_out.  Unknown id: WASTE_E_ARG. */
WASTE_API waste_status waste_detokenize(waste_ctx *ctx, const int32_t *tokens, size_t n,
                                        char *out, size_t cap, size_t *n_out);

/* ------------------------------------------------------------------ images */

/* Width and height from the file's header (PNG, JPEG, GIF, WebP); no ctx.
 * Errors: WASTE_E_IO (unreadable), WASTE_E_FORMAT (not an image, truncated,
 * absurd dimensions). */
WASTE_API waste_status waste_image_dimensions(const char *path, int *w, int *h);

/* Decode, encode and queue one image; *n_tokens_out = positions it takes.
 * Errors: WASTE_E_UNSUPPORTED (no tower, or a format this build cannot
 * decode), WASTE_E_IO, WASTE_E_FORMAT (malformed or hostile file). */
WASTE_API waste_status waste_image_add(waste_ctx *ctx, const char *path, size_t *n_tokens_out);

/* Copy tokens to out, replacing each media placeholder token (in queue
 * order) by as many copies as its image needs.  out must not alias tokens.
 * Errors: WASTE_E_ARG (more placeholders than queued images; out overlapping
 * tokens; short buffer, with the needed count in *n_out). */
WASTE_API waste_status waste_image_expand(waste_ctx *ctx, const int32_t *tokens, size_t n,
                                          int32_t *out, size_t cap, size_t *n_out);

/* Drop the image queue. */
WASTE_API void waste_image_clear(waste_ctx *ctx);

/* -------------------------------------------------------------- generation */

/* Called for every generated token, after it has been evaluated into the
 * state.  piece is that token's raw bytes, NUL-terminated, not necessarily
 * valid UTF-8 on its own.  Return 0 to continue, non-zero to stop.
 * The callback may call waste_tokenize, waste_tokenize_markup and
 * waste_detokenize on the same ctx (they touch only the caller's buffer and
 * the error detail, which waste_generate sets after its last callback); any
 * other call on the ctx from inside it is undefined. */
typedef int (*waste_token_cb)(const waste_token_info *info, const char *piece,
                              void *user);

/* Append prompt (n >= 1) to the state, then sample up to max_tokens tokens.
 * A stop token or EOS is handed to the callback and then ends generation.
 * Errors: WASTE_E_ARG (n == 0; the prompt does not fit, keeping one position
 * for the first sampled token -- nothing is evaluated, error_detail names the
 * position and the ceiling), WASTE_E_CANCELLED (the callback returned
 * non-zero), WASTE_E_IO (an expert record could not be read or failed its
 * check).  Reaching the context ceiling mid-answer returns WASTE_OK with
 * error_detail set.  After any failure call waste_state_reset. */
WASTE_API waste_status waste_generate(waste_ctx *ctx, const int32_t *prompt, size_t n,
                                      const waste_gen_params *params, waste_token_cb cb,
                                      void *user);

/* Append tokens (n >= 1) without sampling; *logits_out points at the last
 * position's logits (owned by ctx, valid until the next call), *vocab_out is
 * their count.  Errors: WASTE_E_ARG (n == 0, does not fit), WASTE_E_IO.
 * The reference engine evaluates the tokens in batches of up to 512
 * positions: each weight, and each expert the batch's tokens chose, is read
 * once per batch (one hit or miss in waste_stats), and the logits are the
 * same bits however the tokens are split across calls. */
WASTE_API waste_status waste_eval(waste_ctx *ctx, const int32_t *tokens, size_t n,
                                  const float **logits_out, size_t *vocab_out);

/* ---------------------------------------------------- conversation state */

/* Checkpoint the whole session (position included) to path, atomically. */
WASTE_API waste_status waste_state_save(waste_ctx *ctx, const char *path);

/* Restore a checkpoint.  Another model's state, or a damaged file, is
 * WASTE_E_FORMAT and leaves the state reset; a state longer than this ctx's
 * context is WASTE_E_ARG. */
WASTE_API waste_status waste_state_load(waste_ctx *ctx, const char *path);

/* Back to an empty conversation; also drops the image queue. */
WASTE_API void waste_state_reset(waste_ctx *ctx);

/* ----------------------------------------------------------- introspection */

WASTE_API waste_status waste_model_get_info(const waste_ctx *ctx, waste_model_info *out);
WASTE_API waste_status waste_get_stats(const waste_ctx *ctx, waste_stats *out);

/* Persist the learned hotlist to the usage path (atomically).  The next
 * waste_open with the same path pre-loads the most used experts. */
WASTE_API waste_status waste_save_usage(waste_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif /* WASTE_H */

/*
 * manifest.h -- the container's manifest.json (FORMAT.md) and every size
 * that follows from it.  Loading it reads nothing but the manifest.
 */
#ifndef WASTE_MANIFEST_H
#define WASTE_MANIFEST_H

#include <stddef.h>
#include <stdint.h>
#include "waste.h"

#define WM_PAGE 4096u
#define WM_RECORD_HEADER 64u
#define WM_NAME_MAX 64
#define WM_MAX_TOP_K 64

/* How a weight matrix is stored (FORMAT.md, "Weight formats"). */
enum { WQ_F32 = 0, WQ_Q8 = 1, WQ_Q4_1 = 2 };

typedef struct {
    int kind;       /* WQ_* */
    uint32_t group; /* elements per scale: 0 for f32, G for q8g<G>, 32 for q4_1 */
} wquant;

/* Pre-tokenizers (FORMAT.md, "tokenizer.model and specials.json"). */
enum { WPRE_DEFAULT = 0, WPRE_SMOLLM = 1 };

typedef struct {
    char arch[WM_NAME_MAX];
    int llama;      /* arch "llama": one always-selected expert per layer, no router */
    uint32_t vocab_size, hidden, n_layers, n_dense_layers;
    uint32_t n_heads, n_kv_heads, head_dim, dense_ffn;
    uint32_t n_experts, top_k, expert_ffn;
    int shared_expert;
    float rope_theta, norm_eps;
    wquant expert_q;     /* the experts' matrices */
    wquant weight_q;     /* the trunk's attention matrices */
    wquant embed_q;      /* tok_embed and lm_head */
    int tied_embeddings; /* lm_head is tok_embed, not stored twice */
    int pretokenizer;    /* WPRE_* */
    char bos_token[WM_NAME_MAX], eos_token[WM_NAME_MAX];
    char media_pad_token[WM_NAME_MAX]; /* "" when the container has none */
    char unk_token[WM_NAME_MAX];       /* stands for a byte without a token; "" for none */
    uint32_t context_length;           /* the longest sequence the model takes; 0: not declared */
    uint32_t crc;                      /* crc32 of the manifest file's bytes */
} wmanifest;

/* Read and validate <dir>/manifest.json.  WASTE_E_IO when missing,
 * WASTE_E_FORMAT for any missing key, wrong type or absurd dimension. */
waste_status wmanifest_load(const char *dir, wmanifest *m, char *err, size_t errcap);

uint32_t wmanifest_moe_layers(const wmanifest *m);

/* Bytes of a rows x cols matrix stored as q. */
uint64_t wquant_bytes(wquant q, uint64_t rows, uint64_t cols);

/* Width of one position's keys (and values): n_kv_heads * head_dim. */
uint32_t wmanifest_kv_dim(const wmanifest *m);

/* trunk.bin's weight count and its size in bytes, in FORMAT.md's order. */
uint64_t wmanifest_trunk_params(const wmanifest *m);
uint64_t wmanifest_trunk_bytes(const wmanifest *m);

/* Bytes of one expert's payload (w1, w3, w2 in the expert format). */
uint64_t wmanifest_payload_bytes(const wmanifest *m);

/* Record stride in a bank: header + payload rounded up to a page. */
uint64_t wmanifest_record_stride(const wmanifest *m);

/* Total parameter count, and the count one token touches. */
uint64_t wmanifest_params_total(const wmanifest *m);
uint64_t wmanifest_params_active(const wmanifest *m);

#endif

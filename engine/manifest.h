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

typedef struct {
    char arch[WM_NAME_MAX];
    uint32_t vocab_size, hidden, n_layers, n_dense_layers;
    uint32_t n_heads, head_dim, dense_ffn;
    uint32_t n_experts, top_k, expert_ffn;
    int shared_expert;
    float rope_theta, norm_eps;
    uint32_t quant_group; /* 0 = f32 experts, else q8g<quant_group> */
    char bos_token[WM_NAME_MAX], eos_token[WM_NAME_MAX];
    char media_pad_token[WM_NAME_MAX]; /* "" when the container has none */
    uint32_t crc;                      /* crc32 of the manifest file's bytes */
} wmanifest;

/* Read and validate <dir>/manifest.json.  WASTE_E_IO when missing,
 * WASTE_E_FORMAT for any missing key, wrong type or absurd dimension. */
waste_status wmanifest_load(const char *dir, wmanifest *m, char *err, size_t errcap);

uint32_t wmanifest_moe_layers(const wmanifest *m);

/* trunk.bin size in floats, in FORMAT.md's tensor order. */
uint64_t wmanifest_trunk_floats(const wmanifest *m);

/* Bytes of one expert's payload (w1, w3, w2 in the expert format). */
uint64_t wmanifest_payload_bytes(const wmanifest *m);

/* Record stride in a bank: header + payload rounded up to a page. */
uint64_t wmanifest_record_stride(const wmanifest *m);

/* Total parameter count, and the count one token touches. */
uint64_t wmanifest_params_total(const wmanifest *m);
uint64_t wmanifest_params_active(const wmanifest *m);

#endif

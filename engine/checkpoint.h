/*
 * checkpoint.h -- saving and restoring the conversation state.
 *
 * File (little-endian): "WSTA", u32 version = 3, u32 model fingerprint,
 * u32 n_layers, u32 kv_dim, u32 positions, then per layer the keys and then
 * the values of the filled positions (f16, half.h), each as the cache holds
 * them: key/value head by head, [n_kv_heads][positions][head_dim]; then u32
 * crc32 of all the bytes before it.  Older versions are refused, never
 * misread: version 1 (engine 0.6.0) laid each position's heads side by side,
 * [positions][kv_dim], and version 2 (0.6.1) held f32.
 */
#ifndef WASTE_CHECKPOINT_H
#define WASTE_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include "manifest.h"
#include "model.h"

/* Write atomically (temp file in the same directory, then rename). */
waste_status wcheckpoint_save(const char *path, uint32_t fingerprint, const wmanifest *m,
                              const wstate *s, char *err, size_t errcap);

/* Restore into s.  Another model's file or a damaged one: WASTE_E_FORMAT;
 * more positions than s holds: WASTE_E_ARG.  On any failure s is left
 * empty (pos 0). */
waste_status wcheckpoint_load(const char *path, uint32_t fingerprint, const wmanifest *m, wstate *s,
                              char *err, size_t errcap);

#endif

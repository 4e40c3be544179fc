/*
 * prof.h -- where a decoded token's time goes, per operation: a build of
 * the engine with -DWASTE_PROFILE only (make build/libwaste-profile.so,
 * bench/decode_profile.py).  In every other build the macros are empty and
 * nothing is timed.
 *
 * Only the steps of waste_generate's loop after the prompt are counted
 * (wprof_decoding), each operation's wall time on the calling thread, a
 * whole threaded job included.  At exit the totals go as one JSON object to
 * the file named by WASTE_PROFILE (stderr without it).
 */
#ifndef WASTE_PROF_H
#define WASTE_PROF_H

#include <stdint.h>

typedef enum {
    WPROF_MATMUL_Q4_1, /* weight matrices by stored format */
    WPROF_MATMUL_Q8,
    WPROF_MATMUL_F32,
    WPROF_QUANTIZE, /* the int16 activation codes of a matmul's input */
    WPROF_ATTENTION,
    WPROF_KV_STORE,
    WPROF_NORM,
    WPROF_ROPE,
    WPROF_SWIGLU,
    WPROF_RESIDUAL,
    WPROF_SAMPLE,
    WPROF_CALLBACK, /* the caller's token callback (Python, through ctypes) */
    WPROF_STEP,     /* one whole token: sampling, forward pass, callback */
    /* Inside the pool's jobs, on every thread (not part of the step's sum):
     * a chunk's fn on the caller and on a helper, the caller waiting after
     * its last chunk for the helpers to leave, and a helper's delay from the
     * job's opening to its joining it. */
    WPROF_CHUNK_CALLER,
    WPROF_CHUNK_HELPER,
    WPROF_JOB_WAIT,
    WPROF_HELPER_JOIN,
    WPROF_KINDS
} wprof_kind;

#ifdef WASTE_PROFILE
uint64_t wprof_now(void);
void wprof_add(wprof_kind kind, uint64_t since);
void wprof_decoding(int on);
#define WPROF_START(name) uint64_t name = wprof_now()
#define WPROF_STAMP(lvalue) ((lvalue) = wprof_now()) /* a start another thread adds from */
#define WPROF_ADD(kind, since) wprof_add(kind, since)
#define WPROF_DECODING(on) wprof_decoding(on)
#else
#define WPROF_START(name) ((void)0)
#define WPROF_STAMP(lvalue) ((void)0)
#define WPROF_ADD(kind, since) ((void)0)
#define WPROF_DECODING(on) ((void)0)
#endif

#endif

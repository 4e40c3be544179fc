/*
 * sys.h -- what the engine asks of the operating system: RAM and cgroup
 * limits, the clock, CPU lists and thread placement.
 */
#ifndef WASTE_SYS_H
#define WASTE_SYS_H

#include <stddef.h>
#include <stdint.h>
#include "waste.h"

#define WSYS_MAX_CPUS 1024

uint64_t wsys_physical_ram(void);

/* Physical RAM lowered by a cgroup v2 memory.max or v1 limit_in_bytes. */
uint64_t wsys_usable_ram(void);

/* Monotonic milliseconds. */
double wsys_now_ms(void);

/* Sleep for ms milliseconds (no-op for ms <= 0); resumes after signals. */
void wsys_sleep_ms(double ms);

/* CPUs this process may run on (its affinity mask), at least 1. */
int wsys_available_cpus(void);

typedef struct {
    int n;
    int ids[WSYS_MAX_CPUS];
} wcpus;

/* Parse "0-5" / "0-2,6-8" into ascending, de-duplicated ids and check that
 * this process may use each one.  Malformed or forbidden: WASTE_E_ARG;
 * a platform without thread binding: WASTE_E_UNSUPPORTED. */
waste_status wsys_parse_cpu_list(const char *text, wcpus *out, char *err, size_t errcap);

/* A thread's CPU mask, kept as plain bits so this header needs no
 * platform types. */
typedef struct {
    int valid;
    uint64_t bits[WSYS_MAX_CPUS / 64];
} wsys_mask;

/* The calling thread's current mask (valid = 0 where unsupported). */
void wsys_mask_get(wsys_mask *out);

/* The mask of one listed CPU (index >= 0, taken modulo cpus->n) or of every
 * listed CPU (index < 0). */
void wsys_mask_of(const wcpus *cpus, int index, wsys_mask *out);

/* Move the calling thread onto mask; best effort, ignores invalid masks. */
void wsys_mask_apply(const wsys_mask *mask);

#endif

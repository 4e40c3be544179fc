#include "sys.h"

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "detail.h"

uint64_t wsys_physical_ram(void) {
    long pages = sysconf(_SC_PHYS_PAGES);
    long page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return 0;
    return (uint64_t)pages * (uint64_t)page;
}

/* A cgroup limit file holds a byte count, or "max" / a huge number when
 * unlimited; returns 0 for "no limit here". */
static uint64_t read_limit(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char buf[64] = {0};
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    if (!isdigit((unsigned char)buf[0])) return 0;
    unsigned long long v = strtoull(buf, NULL, 10);
    return v >= (1ull << 62) ? 0 : (uint64_t)v;
}

uint64_t wsys_usable_ram(void) {
    uint64_t ram = wsys_physical_ram();
    static const char *limits[] = {
        "/sys/fs/cgroup/memory.max",                   /* cgroup v2 */
        "/sys/fs/cgroup/memory/memory.limit_in_bytes", /* cgroup v1 */
    };
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        uint64_t lim = read_limit(limits[i]);
        if (lim && (ram == 0 || lim < ram)) ram = lim;
    }
    return ram;
}

double wsys_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

void wsys_sleep_ms(double ms) {
    if (!(ms > 0)) return;
    struct timespec left = {.tv_sec = (time_t)(ms / 1e3), .tv_nsec = (long)(fmod(ms, 1e3) * 1e6)};
    while (nanosleep(&left, &left) != 0) {}
}

#ifdef __linux__

int wsys_available_cpus(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    int n = CPU_COUNT(&set);
    return n > 0 ? n : 1;
}

static int process_may_use(int cpu) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    return cpu < CPU_SETSIZE && CPU_ISSET(cpu, &set);
}

void wsys_mask_get(wsys_mask *out) {
    memset(out, 0, sizeof *out);
    cpu_set_t set;
    if (pthread_getaffinity_np(pthread_self(), sizeof set, &set) != 0) return;
    for (int c = 0; c < WSYS_MAX_CPUS && c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set)) out->bits[c / 64] |= 1ull << (c % 64);
    out->valid = 1;
}

void wsys_mask_apply(const wsys_mask *mask) {
    if (!mask->valid) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c = 0; c < WSYS_MAX_CPUS && c < CPU_SETSIZE; c++)
        if (mask->bits[c / 64] >> (c % 64) & 1) CPU_SET(c, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

#else /* no thread binding on this platform */

int wsys_available_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int process_may_use(int cpu) { return cpu < wsys_available_cpus(); }

void wsys_mask_get(wsys_mask *out) { memset(out, 0, sizeof *out); }

void wsys_mask_apply(const wsys_mask *mask) { (void)mask; }

#endif

void wsys_mask_of(const wcpus *cpus, int index, wsys_mask *out) {
    memset(out, 0, sizeof *out);
    if (cpus->n == 0) return;
    for (int i = 0; i < cpus->n; i++) {
        if (index >= 0 && i != index % cpus->n) continue;
        out->bits[cpus->ids[i] / 64] |= 1ull << (cpus->ids[i] % 64);
    }
    out->valid = 1;
}

/* One decimal CPU number; advances *p past it. */
static int parse_cpu(const char **p, int *cpu) {
    if (!isdigit((unsigned char)**p)) return 0;
    long v = 0;
    while (isdigit((unsigned char)**p)) {
        v = v * 10 + (**p - '0');
        if (v >= WSYS_MAX_CPUS) return 0;
        (*p)++;
    }
    *cpu = (int)v;
    return 1;
}

waste_status wsys_parse_cpu_list(const char *text, wcpus *out, char *err, size_t errcap) {
    uint8_t seen[WSYS_MAX_CPUS] = {0};
    const char *p = text;
    if (*p == '\0') return wdetail(err, errcap, WASTE_E_ARG, "cpu_list is empty");
    for (;;) {
        int lo, hi;
        if (!parse_cpu(&p, &lo))
            return wdetail(err, errcap, WASTE_E_ARG,
                           "cpu_list \"%s\": expected a CPU number (0..%d) at offset %d",
                           text, WSYS_MAX_CPUS - 1, (int)(p - text));
        hi = lo;
        if (*p == '-') {
            p++;
            if (!parse_cpu(&p, &hi))
                return wdetail(err, errcap, WASTE_E_ARG,
                               "cpu_list \"%s\": expected a range end at offset %d", text,
                               (int)(p - text));
            if (hi < lo)
                return wdetail(err, errcap, WASTE_E_ARG,
                               "cpu_list \"%s\": range %d-%d runs backwards", text, lo, hi);
        }
        for (int c = lo; c <= hi; c++) seen[c] = 1;
        if (*p == '\0') break;
        if (*p != ',')
            return wdetail(err, errcap, WASTE_E_ARG, "cpu_list \"%s\": unexpected '%c' at offset %d",
                           text, *p, (int)(p - text));
        p++;
    }
#ifndef __linux__
    return wdetail(err, errcap, WASTE_E_UNSUPPORTED, "cpu_list: thread binding is not available on this platform");
#endif
    out->n = 0;
    for (int c = 0; c < WSYS_MAX_CPUS; c++) {
        if (!seen[c]) continue;
        if (!process_may_use(c))
            return wdetail(err, errcap, WASTE_E_ARG,
                           "cpu_list \"%s\": CPU %d is not available to this process", text, c);
        out->ids[out->n++] = c;
    }
    return WASTE_OK;
}

/*
 * detail.h -- writing a failure's specific reason into a caller's buffer.
 * Every internal module reports errors as (status, text); this keeps the
 * formatting in one place.
 */
#ifndef WASTE_DETAIL_H
#define WASTE_DETAIL_H

#include <stddef.h>
#include "waste.h"

/* printf into err (errcap bytes, always NUL-terminated when errcap > 0) and
 * return status, so a failure is one line: `return wdetail(err, cap, ...)`. */
waste_status wdetail(char *err, size_t errcap, waste_status status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif

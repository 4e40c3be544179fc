#include "detail.h"

#include <stdarg.h>
#include <stdio.h>

waste_status wdetail(char *err, size_t errcap, waste_status status, const char *fmt, ...) {
    if (err && errcap > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errcap, fmt, ap);
        va_end(ap);
    }
    return status;
}

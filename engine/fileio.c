#include "fileio.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "detail.h"

FILE *wfile_begin(const char *path, char *tmp, size_t tmpcap, char *err, size_t errcap) {
    if ((size_t)snprintf(tmp, tmpcap, "%s.tmp.%ld", path, (long)getpid()) >= tmpcap) {
        wdetail(err, errcap, WASTE_E_IO, "%s: path too long", path);
        return NULL;
    }
    FILE *f = fopen(tmp, "wb");
    if (!f) wdetail(err, errcap, WASTE_E_IO, "%s: %s", tmp, strerror(errno));
    return f;
}

waste_status wfile_commit(FILE *f, const char *tmp, const char *path, int ok, char *err,
                          size_t errcap) {
    int saved = ok ? 0 : errno; /* why the caller's writes failed, if they did */
    if (ok && (fflush(f) != 0 || fsync(fileno(f)) != 0)) {
        ok = 0;
        saved = errno;
    }
    if (fclose(f) != 0 && ok) {
        ok = 0;
        saved = errno;
    }
    if (ok && rename(tmp, path) != 0) {
        ok = 0;
        saved = errno;
    }
    if (ok) return WASTE_OK;
    unlink(tmp);
    return wdetail(err, errcap, WASTE_E_IO, "%s: cannot write: %s", path,
                   saved ? strerror(saved) : "write failed");
}

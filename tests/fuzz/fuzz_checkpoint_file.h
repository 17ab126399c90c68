/* The checkpoint targets read files, as --resume does: each input is written to one file in a
 * private directory (on /dev/shm when there is one) that the loader then opens. */
#ifndef DDP_FUZZ_CHECKPOINT_FILE_H
#define DDP_FUZZ_CHECKPOINT_FILE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char fuzz_dir[256], fuzz_path[300];

/* Makes the directory and removes it at exit. */
static void fuzz_remove_dir(void)
{
    unlink(fuzz_path);
    rmdir(fuzz_dir);
}

static inline int fuzz_file_init(const char *name)
{
    struct stat st;
    const char *base = stat("/dev/shm", &st) == 0 ? "/dev/shm" : "/tmp";
    snprintf(fuzz_dir, sizeof fuzz_dir, "%s/%s.XXXXXX", base, name);
    if (!mkdtemp(fuzz_dir)) return -1;
    snprintf(fuzz_path, sizeof fuzz_path, "%s/ck", fuzz_dir);
    atexit(fuzz_remove_dir);
    return 0;
}

static inline void fuzz_file_write(const uint8_t *data, size_t size)
{
    FILE *f = fopen(fuzz_path, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0) {
        perror(fuzz_path);
        abort();
    }
}

#endif

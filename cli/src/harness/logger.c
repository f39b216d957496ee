/* The logger the harness hands to net plugins. NCCL's logger is printf-like and variadic
 * (ncclDebugLogger_t); stable Rust can call a C variadic function but not define one, so this
 * one C function takes the varargs, formats them with vsnprintf exactly as NCCL's own logger
 * does, and passes the finished line to the sink the harness installed. */

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

/* One line, like NCCL's own buffer: longer lines are cut (vsnprintf never overruns). */
#define LOSSY_HARNESS_LINE 4096

typedef void (*lossy_harness_sink)(int level, const char *file, int line, const char *text);

static lossy_harness_sink sink;

/* Installs the sink; called once, before the logger is handed to any plugin. */
void lossy_harness_set_log_sink(lossy_harness_sink s) { sink = s; }

void lossy_harness_logger(int level, unsigned long flags, const char *file, int line,
                          const char *fmt, ...) {
    (void)flags;
    lossy_harness_sink s = sink;
    if (s == NULL || fmt == NULL) {
        return;
    }
    char text[LOSSY_HARNESS_LINE];
    va_list args;
    va_start(args, fmt);
    int n = vsnprintf(text, sizeof text, fmt, args);
    va_end(args);
    if (n < 0) {
        return;
    }
    s(level, file, line, text);
}

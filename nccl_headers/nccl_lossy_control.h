/*
 * nccl-net-lossy: run-time control of the plugin from the training process.
 *
 * The plugin library exports these functions next to its ncclNetPlugin_v* tables. Call them
 * through the same library NCCL loaded (e.g. Python's ctypes.CDLL on the path given in
 * NCCL_NET_PLUGIN, which returns the already-loaded copy). All are thread-safe and cheap;
 * the data path reads the values they set once per message.
 */
#ifndef NCCL_NET_LOSSY_CONTROL_H
#define NCCL_NET_LOSSY_CONTROL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version of this control API; bumped when a function changes. */
#define NCCL_LOSSY_CONTROL_VERSION 3

/* Training phases that profile rules can match (`phase = "forward"` ...). */
#define NCCL_LOSSY_PHASE_ANY 0
#define NCCL_LOSSY_PHASE_FORWARD 1
#define NCCL_LOSSY_PHASE_BACKWARD 2

/* Returns NCCL_LOSSY_CONTROL_VERSION. */
int ncclLossyControlVersion(void);

/* Turns loss injection on (non-zero) or off (0) for this process. Returns 0. */
int ncclLossySetEnabled(int enabled);

/* Sets the training phase (one of NCCL_LOSSY_PHASE_*). Returns 0, or -1 for an unknown phase. */
int ncclLossySetPhase(int phase);

/* Sets the training step that rules with a `steps` window match. Returns 0. */
int ncclLossySetStep(uint64_t step);

/* Writes this process's statistics as a NUL-terminated JSON document into buf (at most cap
 * bytes including the NUL). Returns the document's length without the NUL, so a caller can
 * retry with a larger buffer when the return value is >= cap; -1 on error. */
int64_t ncclLossyStatsJson(char* buf, size_t cap);

/* Writes the statistics file into NCCL_LOSSY_STATS now. Returns 0 on success, 1 when
 * NCCL_LOSSY_STATS is not set, -1 on error (logged). */
int ncclLossyWriteStats(void);

/* Wrap mode: a copy of this library that loads another copy as its inner plugin calls this on
 * the inner one before init, so that the inner copy only carries bytes (sockets, no loss, no
 * statistics files, never wraps in turn). Not for training scripts. Returns 0. */
int ncclLossyInnerMode(void);

/* Loads a profile exactly as the plugin would (path NULL: the embedded default; overrides
 * NULL or NCCL_LOSSY_SET text) and writes a NUL-terminated JSON answer into buf, like
 * ncclLossyStatsJson: {"ok": true, "origin", "summary", "corrupts_data", "lossless",
 * "profile", "intra_node_through_net", "intra_node_transports"} or {"ok": false, "error": "<file:line: key: what is
 * allowed>"}. Lets launchers decide the protocol guard without parsing profiles themselves,
 * and names the NCCL variables that send the traffic between GPUs of one node through the
 * plugin (version 3). Added in version 2. */
int64_t ncclLossyCheckProfile(const char* path, const char* overrides, char* buf, size_t cap);

/* Writes this process's trace file now (the messages recorded so far; NCCL_LOSSY_TRACE or the
 * profile's `trace` names the directory) and its path, NUL-terminated, into buf, like
 * ncclLossyStatsJson. Returns the path's length without the NUL, 0 when this process traces
 * nothing (no trace directory, or no communicator made yet), -1 on error (logged). Lets a
 * profiler merge the trace of a window while NCCL's connections stay open. Added in version 3. */
int64_t ncclLossyWriteTrace(char* buf, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* NCCL_NET_LOSSY_CONTROL_H */

/*
 * nccl-net-lossy: the NCCL tuner-plugin ABI (versions 2 to 6), as far as this project uses it.
 *
 * NCCL looks for `ncclTunerPlugin_vN` inside the net plugin's library when no separate tuner
 * library is configured. We export a tuner that rules out the LL and LL128 protocols while a
 * data-corrupting loss effect is active: those protocols carry flags inside the payload, and
 * a receiving GPU waits forever for flags that a lost packet zeroed or never delivered.
 * Layouts follow NCCL's published tuner interface; change nothing without checking it.
 */
#ifndef NCCL_NET_LOSSY_NCCL_TUNER_H
#define NCCL_NET_LOSSY_NCCL_TUNER_H

#include "nccl_net.h"

/* Collective kinds as NCCL numbers them (stable from NCCL 2.27 on for the first seven). */
typedef int ncclFunc_t;

/* Protocol columns of the cost table. */
#define NCCL_LOSSY_PROTO_LL 0
#define NCCL_LOSSY_PROTO_LL128 1
#define NCCL_LOSSY_PROTO_SIMPLE 2
/* Algorithm row used when a v2 tuner must name one: ring. */
#define NCCL_LOSSY_ALGO_RING 1
/* Cost-table value NCCL uses for "this algorithm/protocol pair is not allowed". */
#define NCCL_LOSSY_ALGO_PROTO_IGNORE (-1.0f)

/* Opaque to us: NVLink domain facts and NCCL's tuning constants (v5, v6). */
typedef struct ncclNvlDomainInfo_v5_t ncclNvlDomainInfo_v5_t;
typedef struct ncclTunerConstants_v5_t ncclTunerConstants_v5_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int collNetSupport,
                              int nvlsSupport, int numPipeOps, int* algorithm, int* protocol, int* nChannels);
  ncclResult_t (*destroy)(void* context);
} ncclTuner_v2_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int* nChannels);
  ncclResult_t (*destroy)(void* context);
} ncclTuner_v3_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*destroy)(void* context);
} ncclTuner_v4_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,
                       ncclNvlDomainInfo_v5_t* nvlDomainInfo, ncclTunerConstants_v5_t* constants);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*finalize)(void* context);
} ncclTuner_v5_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,
                       ncclNvlDomainInfo_v5_t* nvlDomainInfo, ncclTunerConstants_v5_t* constants);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*finalize)(void* context);
  ncclResult_t (*getChunkSize)(void* context, ncclFunc_t collType, size_t nBytes, int algo, int proto,
                               int nChannels, size_t* chunkSize);
} ncclTuner_v6_t;

#endif /* NCCL_NET_LOSSY_NCCL_TUNER_H */

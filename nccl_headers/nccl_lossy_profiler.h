/*
 * nccl-net-lossy: what the plugin reports through NCCL's net profiler callback.
 *
 * Since net-plugin v10, NCCL hands `init` a profiler callback and every `isend` a profiler
 * handle (`phandle`). When both are non-NULL, the plugin reports each message it sends as one
 * event: a START call when `isend` posts the message, carrying the descriptor below, and a
 * STOP call when the `test` that sees it done returns. NCCL passes the descriptor to the
 * profiler plugin's startEvent as the `data` of a net-plugin event, next to the `id` below;
 * the descriptor lives only during the START call (copy what you keep).
 * build.rs turns this file into Rust types with bindgen.
 */
#ifndef NCCL_NET_LOSSY_PROFILER_H
#define NCCL_NET_LOSSY_PROFILER_H

#include <stdint.h>

/* The callback's `type` argument (NCCL's ncclProfilerNetEventStart / ncclProfilerNetEventStop). */
#define NCCL_LOSSY_NET_EVENT_START 0
#define NCCL_LOSSY_NET_EVENT_STOP 1

/* The callback's `pluginId`: the source of the event in the bits above 16 (NCCL's own plugins
 * use 1 << 16 for IB and 2 << 16 for Socket; "LS" here), the descriptor's version below. */
#define NCCL_LOSSY_PROFILER_NET_TYPE 0x4C530000u
#define NCCL_LOSSY_PROFILER_NET_VER 1
#define NCCL_LOSSY_PROFILER_NET_ID (NCCL_LOSSY_PROFILER_NET_TYPE | NCCL_LOSSY_PROFILER_NET_VER)

/* Event types (the descriptor's `type`). */
#define NCCL_LOSSY_PROFILE_MESSAGE 1

/* What the profile does to a lost packet (`effect`). */
#define NCCL_LOSSY_EFFECT_ZERO 0
#define NCCL_LOSSY_EFFECT_STALE 1
#define NCCL_LOSSY_EFFECT_RETRANSMIT 2
#define NCCL_LOSSY_EFFECT_BITFLIP 3

/* One sent message (type NCCL_LOSSY_PROFILE_MESSAGE). */
typedef struct {
  uint64_t commId;            /* communicator id from init (v11+; 0 for v10) */
  uint32_t connection;        /* connection index within the communicator's context */
  int32_t peer;               /* the receiver's rank, -1 when unknown */
  uint32_t op;                /* collective as setNetAttr reported it (1 << ncclFunc_t), 0 if never */
  uint32_t phase;             /* NCCL_LOSSY_PHASE_* of the control API at isend */
  uint64_t step;              /* training step of the control API at isend */
  uint64_t bytes;             /* message size */
  uint64_t packets;           /* packets of the profile's mtu the message was cut into */
  uint64_t lostPackets;       /* packets the profile lost */
  uint64_t lossEvents;        /* runs of consecutive lost packets (bursts) */
  uint32_t effect;            /* NCCL_LOSSY_EFFECT_* */
  uint32_t reserved;          /* 0 */
  uint64_t retransmitDelayNs; /* delay `retransmit` added, 0 for the other effects */
} ncclLossyProfilerNetMessage_v1_t;

/* The descriptor passed as the callback's `extData` at START: an event type, then the event. */
typedef struct {
  uint8_t type; /* NCCL_LOSSY_PROFILE_MESSAGE */
  union {
    ncclLossyProfilerNetMessage_v1_t message;
  };
} ncclLossyProfilerNetDescr_v1_t;

#endif

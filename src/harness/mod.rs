//! A CPU harness that drives the built plugin library exactly as NCCL's proxy does.

//! A CPU harness that drives the built plugin library exactly as NCCL's proxy does.
//!
//! - [`library`]: finding and opening the built library, and its control API;
//! - [`plugin_client`]: a safe API over the plugin crate's net-plugin client, shaped like
//!   NCCL's proxy uses it (with [`library`], the only `unsafe` in the harness);
//! - [`bootstrap`]: a tiny TCP rendezvous that all-gathers connection handles and barriers;
//! - [`net`]: ring links (to rank + 1, from rank - 1) over the plugin or over raw TCP;
//! - [`collectives`]: ring all-reduce, all-gather and reduce-scatter, verified bit-exact;
//! - [`launch`] and [`worker`]: N local processes, one rank each, reporting JSON;
//! - [`cluster`]: one rank of a job a cluster launcher (torchrun, mpirun, srun) started;
//! - [`scratch`]: fresh temporary directories, removed when dropped.

pub mod bootstrap;
pub mod cluster;
pub mod collectives;
pub mod launch;
pub mod library;
pub mod net;
pub mod plugin_client;
pub mod scratch;
pub mod worker;

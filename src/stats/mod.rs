//! Loss statistics: counters and histograms of what each connection lost.

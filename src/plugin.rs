//! The safe core behind every ABI version: contexts, connections and requests.

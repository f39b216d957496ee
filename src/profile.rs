//! Loss profiles: the TOML schema, environment overrides and the embedded default.

//! Reading the plugin's environment variables in one place: a value that is not UTF-8 is an
//! error naming the variable, never taken as unset (a run that asked to wrap a plugin must not
//! silently run over sockets; docs/transport.md).

use crate::error::{Error, Result};

/// The value of the variable `name`: `None` when it is unset, an error naming it when its
/// value is not UTF-8.
pub fn var(name: &str) -> Result<Option<String>> {
    match std::env::var_os(name) {
        None => Ok(None),
        Some(value) => value.into_string().map(Some).map_err(|_| {
            Error::invalid_argument(format!(
                "{name} is not valid UTF-8: give it a UTF-8 value, or unset it"
            ))
        }),
    }
}

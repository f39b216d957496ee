//! Our own TCP transport: several sockets per connection, driven by background threads.
//! (Placeholder until the socket transport lands.)

use crate::transport::{Connector, DeviceProps, Listener, Transport, WireHandle};
use crate::{Error, Result};

/// The TCP socket transport.
pub struct SocketTransport;

impl SocketTransport {
    /// Builds the transport from the environment.
    pub fn from_env() -> Result<SocketTransport> {
        Err(Error::system("socket transport not built yet"))
    }
}

impl Transport for SocketTransport {
    fn device_count(&self) -> usize {
        0
    }
    fn properties(&self, dev: usize) -> Result<DeviceProps> {
        Err(Error::invalid_argument(format!("no device {dev}")))
    }
    fn listen(&self, _dev: usize, _handle: &mut WireHandle) -> Result<Box<dyn Listener>> {
        Err(Error::system("not built"))
    }
    fn connect(&self, _dev: usize, _handle: &WireHandle) -> Result<Box<dyn Connector>> {
        Err(Error::system("not built"))
    }
}

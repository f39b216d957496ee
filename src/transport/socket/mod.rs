//! Our own TCP transport: several sockets per connection, driven by background threads.

//! Detectors end to end, on what they must do: naming the process behind a relay
//! hop without a `port_map` (`relay_hop`), one-sided leaks whose other end vanished without a
//! FIN (`one_sided`), and naming processes, not threads (`process_name`).

mod one_sided;
mod process_name;
mod relay_hop;

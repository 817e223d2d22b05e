//! Safety under faults (issue 16): each fault reproduced for real (a lying quota endpoint, a
//! huge body, absurd config values, unusable token files, sockets nobody owns, pins removed
//! under the daemon, foreign objects under the pin root, a load failing half-way) and checked
//! where a user sees it: exit codes and messages, `ss`, the audit log, the API, the log.

mod config;
mod pins;
mod quota;

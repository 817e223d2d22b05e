//! Safety under faults (issue 16): each fault reproduced for real, asserted on what a user sees.

mod pins;

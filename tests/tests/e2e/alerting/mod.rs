//! connreap with the real alerting stack users run next to it (Debian packages).

mod alertmanager;

//! A running process's watch over its state tracker.
//!
//! The tracker (the tracepoint's link and its maps) lives as long as its pins: this process reads
//! the maps through fds it opened at start and holds no reference to the link. So `connreap
//! unpin`, or anything else removing the pins, while a daemon runs detaches the tracker silently:
//! no more transitions, every age a lower bound. Each scan, [`Kernel::check_tracker`] opens the
//! link's pin and the state map's pin (a few syscalls). When they are gone it re-attaches: pins
//! the maps it holds again, clears the state table (records from before the gap could give a
//! socket that closed and was replaced meanwhile a wrong exact age) and loads and attaches the
//! tracker over those maps, as a first load would. When that fails (the root unusable, another
//! connreap's tracker pinned there now, the load lock busy), the scan reports the tracker
//! detached — an ERROR logged once, a problem on /healthz — and the next scan tries again.
use std::path::PathBuf;

use aya::{
    maps::{Array, Map, MapData},
    programs::links::PinnedLink,
};
use connreap_ebpf::StateSet;

use super::{host, load::SHARED_MAPS, memory::MapMemory, pins, Kernel, KernelError};

/// What [`Kernel::check_tracker`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TrackerStatus {
    /// Attached through this process's pins.
    #[default]
    Attached,
    /// It had been detached and is attached again now (transitions in between were missed).
    Reattached,
    /// Detached, and re-attaching failed: why.
    Detached(String),
}

impl TrackerStatus {
    /// The problem /healthz names, if any.
    pub fn problem(&self) -> Option<&str> {
        match self {
            TrackerStatus::Detached(why) => Some(why),
            _ => None,
        }
    }
}

/// What the watch keeps between scans.
pub(super) struct Watch {
    /// The kernel's id of the state map this process reads (None: unknown, not compared).
    state_id: Option<u32>,
    /// The problem last logged, so a lasting one is logged once.
    logged: Option<String>,
}

impl Watch {
    pub(super) fn new(memory: &MapMemory) -> Watch {
        Watch {
            state_id: memory.get("state").and_then(map_id),
            logged: None,
        }
    }
}

fn map_id(map: &MapData) -> Option<u32> {
    map.info().ok().map(|i| i.id())
}

/// Why re-attaching failed.
#[derive(Debug, thiserror::Error)]
enum ReattachError {
    #[error("another connreap holds the load lock; trying again at the next scan")]
    Busy,
    #[error("{} now holds another tracker's map (another connreap pinned a new tracker after ours was removed): restart this process to use it", .0.display())]
    Replaced(PathBuf),
    #[error("this process holds no fd of the map {0}")]
    NotHeld(&'static str),
    #[error("cannot clear the state table")]
    Clear(#[source] aya::maps::MapError),
    #[error("cannot clear the state table: cannot duplicate its fd")]
    ClearFd(#[source] std::io::Error),
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

impl Kernel {
    /// Whether the state tracker is still attached through this process's pins; re-attaches it
    /// when its pins were removed. Cheap when all is well (opens two pins).
    pub fn check_tracker(&mut self) -> TrackerStatus {
        let Some(fault) = self.tracker_fault() else {
            if self.tracker.logged.take().is_some() {
                tracing::info!(pin_dir = %self.pin_dir.display(), "state tracker attached again");
            }
            return TrackerStatus::Attached;
        };
        match self.reattach() {
            Ok(()) => {
                self.tracker.logged = None;
                tracing::warn!(
                    pin_dir = %self.pin_dir.display(),
                    "state tracker was detached ({fault}; `connreap unpin`?): re-attached it with a cleared state table; transitions in between were missed, so a socket shows an exact age again from its next state change"
                );
                TrackerStatus::Reattached
            }
            Err(e) => {
                let why = format!(
                    "state tracker detached ({fault}), ages are lower bounds and transitions are not seen; re-attaching failed: {:#}",
                    anyhow::Error::new(e)
                );
                if self.tracker.logged.as_deref() != Some(why.as_str()) {
                    tracing::error!(pin_dir = %self.pin_dir.display(), "{why}");
                    self.tracker.logged = Some(why.clone());
                }
                TrackerStatus::Detached(why)
            }
        }
    }

    /// Why the tracker is not attached through the pins with this process's maps, if it is not.
    fn tracker_fault(&self) -> Option<String> {
        let link = self.pin_dir.join("link");
        if PinnedLink::from_pin(&link).is_err() {
            return Some(format!("its link pin {} is gone", link.display()));
        }
        let ours = self.tracker.state_id?;
        let state = self.pin_dir.join("state");
        match MapData::from_pin(&state).ok().as_ref().and_then(map_id) {
            Some(id) if id == ours => None,
            Some(_) => Some(format!(
                "{} holds another tracker's state map",
                state.display()
            )),
            None => Some(format!("its state map pin {} is gone", state.display())),
        }
    }

    /// Pin this process's maps again and attach a tracker over them (under the load lock; what
    /// this makes is removed again if a step fails).
    fn reattach(&mut self) -> Result<(), ReattachError> {
        let _lock = host::try_load_lock().map_err(|_| ReattachError::Busy)?;
        // Not `prepare_pin_dir`: another build's directory stays (an upgraded CLI's tracker
        // next to this older daemon's), instead of the two removing each other's.
        let dir = pins::create_pin_dir(&pins::pin_root()?)?;
        debug_assert_eq!(dir, self.pin_dir);
        let before = pins::existing_pins(&dir);
        self.repin_and_attach().inspect_err(|_| {
            pins::clean_failed_load(&dir, &before);
        })
    }

    fn repin_and_attach(&mut self) -> Result<(), ReattachError> {
        let dir = self.pin_dir.clone();
        for (_, pin) in SHARED_MAPS {
            let map = self.memory.get(pin).ok_or(ReattachError::NotHeld(pin))?;
            let path = dir.join(pin);
            match MapData::from_pin(&path) {
                Ok(pinned) if map_id(&pinned) == map_id(map) => {}
                Ok(_) => return Err(ReattachError::Replaced(path)),
                Err(_) => map.pin(&path).map_err(KernelError::pin(&path))?,
            }
        }
        let link_alive = PinnedLink::from_pin(dir.join("link")).is_ok();
        if !link_alive {
            // No tracker writes the table now: records from before the gap go.
            self.clear_state()?;
        }
        let complete = [
            "link",
            "iter_tcp",
            "iter_task_file",
            "iter_netns_socks",
            "flush",
        ]
        .iter()
        .all(|p| dir.join(p).exists());
        if !complete {
            // Reuses the maps just pinned; attaches the tracker unless a link is alive.
            Kernel::load_object(&dir, self.verbose, self.set_bits)?;
        }
        Ok(())
    }

    /// Zero every set of the state table this process reads.
    fn clear_state(&self) -> Result<(), ReattachError> {
        let held = self
            .memory
            .get("state")
            .ok_or(ReattachError::NotHeld("state"))?;
        let fd = std::os::fd::AsFd::as_fd(held.fd())
            .try_clone_to_owned()
            .map_err(ReattachError::ClearFd)?;
        let map = MapData::from_fd(fd).map_err(ReattachError::Clear)?;
        let mut table: Array<MapData, StateSet> =
            Array::try_from(Map::Array(map)).map_err(ReattachError::Clear)?;
        let empty = StateSet::default();
        for set in 0..1u32 << self.set_bits {
            table.set(set, empty, 0).map_err(ReattachError::Clear)?;
        }
        Ok(())
    }
}

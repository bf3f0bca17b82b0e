//! The save/restore contract every device implements for snapshots (Firecracker's `Persist` is
//! the model). `save` yields plain serialisable state (each device folder's `persist.rs`);
//! `restore` rebuilds the live device from that state plus what the new process provides
//! (guest memory, interrupt lines, host backends). State comes from a snapshot file, so
//! `restore` validates it like any untrusted input.

use serde::de::DeserializeOwned;
use serde::Serialize;

pub trait Persist: Sized {
    /// Plain data: no fds, no pointers.
    type State: Serialize + DeserializeOwned;
    /// What a restore needs besides the state.
    type ConstructorArgs;
    type Error: std::error::Error;

    fn save(&self) -> Self::State;

    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}

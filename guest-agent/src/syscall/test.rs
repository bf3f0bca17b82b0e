//! The recording [`Syscall`] for unit tests: remembers every call, fails mounts on request.

use std::{
    io,
    path::{Path, PathBuf},
    sync::Mutex,
};

use nix::mount::MsFlags;

use super::Syscall;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Mount { source: Option<String>, target: PathBuf, fstype: Option<String>, flags: MsFlags, data: Option<String> },
    Umount(PathBuf),
    Mkdir(PathBuf),
    Symlink(PathBuf, PathBuf),
    Write(PathBuf, Vec<u8>),
    Subreaper,
    Hostname(String),
    Clock(i64),
    Entropy(usize),
    Mknod { path: PathBuf, major: u64, minor: u64, mode: u32 },
    PivotRoot(PathBuf),
}

#[derive(Default)]
pub struct RecordingSyscall {
    calls: Mutex<Vec<Call>>,
    fail_mount_target: Option<(PathBuf, i32)>,
}

impl RecordingSyscall {
    pub fn failing_mount(target: &str, errno: i32) -> Self {
        Self { fail_mount_target: Some((target.into(), errno)), ..Default::default() }
    }
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
    fn rec(&self, c: Call) {
        self.calls.lock().unwrap().push(c);
    }
}

impl Syscall for RecordingSyscall {
    fn mount(
        &self,
        source: Option<&str>,
        target: &Path,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<&str>,
    ) -> io::Result<()> {
        self.rec(Call::Mount {
            source: source.map(Into::into),
            target: target.into(),
            fstype: fstype.map(Into::into),
            flags,
            data: data.map(Into::into),
        });
        if let Some((t, errno)) = &self.fail_mount_target {
            if t == target {
                return Err(io::Error::from_raw_os_error(*errno));
            }
        }
        Ok(())
    }
    fn umount(&self, target: &Path) -> io::Result<()> {
        self.rec(Call::Umount(target.into()));
        Ok(())
    }
    fn mkdir_all(&self, path: &Path) -> io::Result<()> {
        self.rec(Call::Mkdir(path.into()));
        Ok(())
    }
    fn symlink(&self, target: &Path, link: &Path) -> io::Result<()> {
        self.rec(Call::Symlink(target.into(), link.into()));
        Ok(())
    }
    fn write_file(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        self.rec(Call::Write(path.into(), data.to_vec()));
        Ok(())
    }
    fn set_child_subreaper(&self) -> io::Result<()> {
        self.rec(Call::Subreaper);
        Ok(())
    }
    fn sethostname(&self, name: &str) -> io::Result<()> {
        self.rec(Call::Hostname(name.into()));
        Ok(())
    }
    fn set_realtime_clock(&self, unix_nanos: i64) -> io::Result<()> {
        self.rec(Call::Clock(unix_nanos));
        Ok(())
    }
    fn add_entropy(&self, seed: &[u8]) -> io::Result<()> {
        self.rec(Call::Entropy(seed.len()));
        Ok(())
    }
    fn mknod_char(&self, path: &Path, major: u64, minor: u64, mode: u32) -> io::Result<()> {
        self.rec(Call::Mknod { path: path.into(), major, minor, mode });
        Ok(())
    }
    fn pivot_root(&self, new_root: &Path) -> io::Result<()> {
        self.rec(Call::PivotRoot(new_root.into()));
        Ok(())
    }
}

//! Crash-safe file operations: readers (containerd, the shim, a rerun of the installer) see the old bytes or the
//! new bytes, never a half-written file.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{io, Result};
use crate::failpoint::FailPoints;

/// Fixed suffix (not per-PID) so a rerun finds and removes what an interrupted run left behind.
pub const TEMP_SUFFIX: &str = ".bulkhead-tmp";

pub fn temp_path(dest: &Path) -> PathBuf {
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    dest.with_file_name(format!(".{name}{TEMP_SUFFIX}"))
}

/// Write `bytes` to a temp file next to `dest`, fsync it, rename it over `dest`, fsync the directory.
pub fn atomic_write(dest: &Path, bytes: &[u8], mode: u32, fp: &FailPoints) -> Result<()> {
    let tmp = temp_path(dest);
    {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)
            .map_err(io("create", &tmp))?;
        f.write_all(bytes).map_err(io("write", &tmp))?;
        f.set_permissions(fs::Permissions::from_mode(mode)).map_err(io("chmod", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
    }
    fp.check("artifact-temp-written")?;
    fs::rename(&tmp, dest).map_err(io("rename", dest))?;
    sync_parent(dest)
}

/// Like `atomic_write` but streams from a source file (artifacts can be tens of MiB).
pub fn atomic_copy(src: &Path, dest: &Path, mode: u32, fp: &FailPoints) -> Result<()> {
    let tmp = temp_path(dest);
    {
        let mut input = File::open(src).map_err(io("open", src))?;
        let mut out = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)
            .map_err(io("create", &tmp))?;
        std::io::copy(&mut input, &mut out).map_err(io("copy to", &tmp))?;
        out.set_permissions(fs::Permissions::from_mode(mode)).map_err(io("chmod", &tmp))?;
        out.sync_all().map_err(io("fsync", &tmp))?;
    }
    fp.check("artifact-temp-written")?;
    fs::rename(&tmp, dest).map_err(io("rename", dest))?;
    sync_parent(dest)
}

/// Point `link` at `target` atomically: build the new symlink beside it, then rename over the old one.
pub fn atomic_symlink(target: &Path, link: &Path) -> Result<()> {
    let tmp = temp_path(link);
    remove_if_exists(&tmp)?;
    std::os::unix::fs::symlink(target, &tmp).map_err(io("symlink", &tmp))?;
    fs::rename(&tmp, link).map_err(io("rename", link))?;
    sync_parent(link)
}

pub fn sync_parent(path: &Path) -> Result<()> {
    if let Some(dir) = path.parent() {
        File::open(dir).and_then(|d| d.sync_all()).map_err(io("fsync dir", dir))?;
    }
    Ok(())
}

/// Remove a file or symlink; absent is success (idempotent).
pub fn remove_if_exists(path: &Path) -> Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io("remove", path)(e)),
    }
}

/// Read a file; absent is `None`.
pub fn read_opt(path: &Path) -> Result<Option<Vec<u8>>> {
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io("read", path)(e)),
    }
}

/// Same bytes and same permission bits? Compared by streaming, so large artifacts are not held in memory.
pub fn same_file_content(a: &Path, b: &Path, mode: u32) -> Result<bool> {
    let (ma, mb) = match (fs::metadata(a), fs::metadata(b)) {
        (Ok(ma), Ok(mb)) => (ma, mb),
        _ => return Ok(false),
    };
    if ma.len() != mb.len() || mb.permissions().mode() & 0o7777 != mode {
        return Ok(false);
    }
    let mut fa = File::open(a).map_err(io("open", a))?;
    let mut fb = File::open(b).map_err(io("open", b))?;
    let (mut ba, mut bb) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    loop {
        let n = read_full(&mut fa, &mut ba).map_err(io("read", a))?;
        let m = read_full(&mut fb, &mut bb).map_err(io("read", b))?;
        if n != m || ba[..n] != bb[..m] {
            return Ok(false);
        }
        if n == 0 {
            return Ok(true);
        }
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Remove temp files an interrupted run left in `dir`.
pub fn clean_temps(dir: &Path) -> Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io("read dir", dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io("read dir", dir))?;
        if entry.file_name().to_string_lossy().ends_with(TEMP_SUFFIX) {
            let p = entry.path();
            remove_if_exists(&p)?;
            tracing::info!(path = %p.display(), "removed temp file left by an interrupted run");
        }
    }
    Ok(())
}

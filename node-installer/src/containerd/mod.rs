//! containerd wiring: a drop-in file that registers the handler, and an `imports` entry in the user's config only
//! when no existing import already loads the drop-in. The user's file is never re-serialised; when we add the
//! imports entry we first keep its original bytes, and uninstall puts those bytes back.

pub mod dropin;
pub mod imports;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use toml::{Table, Value};

use crate::error::{io, Error, Result};
use crate::failpoint::FailPoints;
use crate::fsutil;
use crate::node_paths::{NodePaths, HANDLER};

/// Sorts after other drop-ins so that, under 1.x's "last import wins" merge, our CRI table is the one kept.
pub const DROPIN_NAME: &str = "zz-bulkhead.toml";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigVersion {
    /// containerd 1.6 / 1.7.
    V2,
    /// containerd 2.x.
    V3,
}

impl ConfigVersion {
    pub fn number(self) -> i64 {
        match self {
            ConfigVersion::V2 => 2,
            ConfigVersion::V3 => 3,
        }
    }

    /// The plugin that owns `containerd.runtimes`.
    pub fn cri_runtime_plugin(self) -> &'static str {
        match self {
            ConfigVersion::V2 => "io.containerd.grpc.v1.cri",
            ConfigVersion::V3 => "io.containerd.cri.v1.runtime",
        }
    }
}

pub fn detect_version(doc: &Table) -> Result<ConfigVersion, String> {
    match doc.get("version").and_then(Value::as_integer) {
        Some(2) => Ok(ConfigVersion::V2),
        Some(3) => Ok(ConfigVersion::V3),
        Some(n) => Err(format!("config version {n} is not supported (need 2 for containerd 1.6/1.7, 3 for 2.x)")),
        None => Err("config has no `version` key (version 1 is not supported; use version = 2 or 3)".into()),
    }
}

/// Files in the state directory (under the install prefix, so uninstall removes them last).
pub struct StateFiles {
    /// Original bytes of the user's config, kept only when we add an imports entry.
    pub backup: PathBuf,
    /// Present between a config change and a successful containerd restart.
    pub restart_pending: PathBuf,
    /// Host path of the drop-in we wrote.
    pub dropin: PathBuf,
    /// Present when we created the drop-in directory (uninstall then removes it if empty).
    pub created_dir: PathBuf,
}

impl StateFiles {
    pub fn new(layout: &NodePaths) -> Self {
        let d = layout.state_dir();
        Self {
            backup: d.join("containerd-config.toml.orig"),
            restart_pending: d.join("restart-pending"),
            dropin: d.join("dropin-path"),
            created_dir: d.join("dropin-dir-created"),
        }
    }
}

/// Where the drop-in goes and whether the user's config needs our imports entry.
#[derive(Debug)]
struct Plan {
    version: ConfigVersion,
    /// Drop-in as containerd sees it.
    view: PathBuf,
    /// Drop-in as we see it.
    host: PathBuf,
    needs_import: bool,
    dropin_text: String,
}

fn cfg_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Config { path: path.to_path_buf(), msg: msg.into() }
}

fn read_config(layout: &NodePaths) -> Result<(Vec<u8>, String, Table)> {
    let path = layout.config_file();
    let bytes = fsutil::read_opt(&path)?
        .ok_or_else(|| cfg_err(&path, "missing: bulkhead needs the node's containerd config to wire its handler"))?;
    let text = String::from_utf8(bytes.clone()).map_err(|_| cfg_err(&path, "not UTF-8"))?;
    let doc = imports::parse(&text).map_err(|m| cfg_err(&path, m))?;
    Ok((bytes, text, doc))
}

fn plan(layout: &NodePaths, doc: &Table) -> Result<Plan> {
    let cfg = layout.config_file();
    let version = detect_version(doc).map_err(|m| cfg_err(&cfg, m))?;
    let view_cfg = layout.view(&layout.containerd_config);
    let view_dir = view_cfg.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("/"));
    let entries = imports::list(doc);
    // Reuse a directory an existing glob import already loads (AL2023 ships /etc/containerd/config.d/*.toml).
    let covered = entries.iter().find_map(|e| {
        if !imports::is_glob(e) {
            return None;
        }
        let dir = imports::resolve(e, &view_dir).parent()?.to_path_buf();
        let candidate = dir.join(DROPIN_NAME);
        imports::covers(e, &view_dir, &candidate).then_some(candidate)
    });
    let (view, needs_import) = match covered {
        Some(v) => (v, false),
        None => {
            let v = view_dir.join("conf.d").join(DROPIN_NAME);
            let present = entries.iter().any(|e| imports::covers(e, &view_dir, &v));
            (v, !present)
        }
    };
    let host = layout
        .host_from_view(&view)
        .ok_or_else(|| cfg_err(&cfg, format!("drop-in {} is outside the host root", view.display())))?;
    let effective = match version {
        ConfigVersion::V2 => effective_cri_v2(layout, doc, &view_dir, &view)?,
        ConfigVersion::V3 => None,
    };
    let entry = dropin::RuntimeEntry {
        handler: HANDLER.into(),
        shim_path: layout.view_shim().display().to_string(),
        config_path: layout.view_shim_config().display().to_string(),
    };
    let dropin_text = dropin::render(version, effective.as_ref(), &entry).map_err(|m| cfg_err(&cfg, m))?;
    Ok(Plan { version, view, host, needs_import, dropin_text })
}

/// The CRI plugin table containerd 1.x would use without us: the main file's, replaced wholesale by each import
/// that sets it, in import order (globs sorted, as Go's filepath.Glob does). Our own drop-in is skipped.
fn effective_cri_v2(layout: &NodePaths, doc: &Table, view_dir: &Path, ours: &Path) -> Result<Option<Table>> {
    let key = ConfigVersion::V2.cri_runtime_plugin();
    let pick = |d: &Table| d.get("plugins").and_then(|p| p.get(key)).and_then(Value::as_table).cloned();
    let mut effective = pick(doc);
    for entry in imports::list(doc) {
        for view in expand(layout, &entry, view_dir)? {
            if view == ours {
                continue;
            }
            let Some(host) = layout.host_from_view(&view) else { continue };
            let Some(bytes) = fsutil::read_opt(&host)? else { continue };
            let text = String::from_utf8_lossy(&bytes);
            let imported = imports::parse(&text).map_err(|m| cfg_err(&host, m))?;
            if let Some(t) = pick(&imported) {
                tracing::info!(import = %view.display(), "CRI settings taken from import");
                effective = Some(t);
            }
        }
    }
    Ok(effective)
}

/// Expand one import entry into files (view paths). Globs are supported in the last component only.
fn expand(layout: &NodePaths, entry: &str, view_dir: &Path) -> Result<Vec<PathBuf>> {
    let resolved = imports::resolve(entry, view_dir);
    if !imports::is_glob(entry) {
        return Ok(vec![resolved]);
    }
    let (Some(dir), Some(pat)) = (resolved.parent(), resolved.file_name()) else { return Ok(vec![]) };
    let Some(host_dir) = layout.host_from_view(dir) else { return Ok(vec![]) };
    let mut out = vec![];
    if let Ok(rd) = fs::read_dir(&host_dir) {
        for e in rd.flatten() {
            let name = e.file_name();
            if imports::fnmatch(pat.to_string_lossy().as_bytes(), name.to_string_lossy().as_bytes()) {
                out.push(dir.join(name));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn mark_restart(state: &StateFiles, fp: &FailPoints) -> Result<()> {
    if !state.restart_pending.exists() {
        let dir = state.restart_pending.parent().map(Path::to_path_buf).unwrap_or_default();
        fs::create_dir_all(&dir).map_err(io("create dir", &dir))?;
        fsutil::atomic_write(&state.restart_pending, b"", 0o644, fp)?;
        tracing::info!(marker = %state.restart_pending.display(), "containerd restart marked pending");
    }
    fp.check("restart-marked")
}

/// Install the drop-in and, if needed, the imports entry. Returns the config version wired.
pub fn install(layout: &NodePaths, fp: &FailPoints) -> Result<ConfigVersion> {
    let cfg = layout.config_file();
    let (bytes, text, doc) = read_config(layout)?;
    let p = plan(layout, &doc)?;
    let state = StateFiles::new(layout);
    tracing::info!(config = %cfg.display(), version = p.version.number(), dropin = %p.view.display(), "containerd config detected");

    let dropin_current = fsutil::read_opt(&p.host)?;
    let dropin_stale = dropin_current.as_deref() != Some(p.dropin_text.as_bytes());
    if dropin_stale || p.needs_import {
        mark_restart(&state, fp)?;
    }
    if dropin_stale {
        let dir = p.host.parent().map(Path::to_path_buf).unwrap_or_default();
        if !dir.exists() {
            // Recorded before creating, so an interrupted run still knows the directory is ours.
            fsutil::atomic_write(&state.created_dir, dir.display().to_string().as_bytes(), 0o644, fp)?;
            fs::create_dir_all(&dir).map_err(io("create dir", &dir))?;
            tracing::info!(dir = %dir.display(), "created drop-in directory");
        }
        fsutil::atomic_write(&state.dropin, p.host.display().to_string().as_bytes(), 0o644, fp)?;
        fsutil::atomic_write(&p.host, p.dropin_text.as_bytes(), 0o644, fp)?;
        tracing::info!(dropin = %p.host.display(), "drop-in written");
    } else {
        tracing::info!(dropin = %p.host.display(), "drop-in up to date");
    }
    fp.check("dropin-written")?;

    if p.needs_import {
        let entry = p.view.display().to_string();
        let new = imports::add(&text, &entry).map_err(|m| cfg_err(&cfg, m))?;
        // The config does not import us, so its bytes now are the user's original: (re)take the backup.
        fsutil::atomic_write(&state.backup, &bytes, 0o600, fp)?;
        tracing::info!(backup = %state.backup.display(), "original containerd config saved");
        fp.check("config-backup-written")?;
        let mode = fs::metadata(&cfg).map(|m| m.permissions().mode() & 0o7777).unwrap_or(0o644);
        fsutil::atomic_write(&cfg, new.as_bytes(), mode, fp)?;
        tracing::info!(config = %cfg.display(), import = %entry, "imports entry added");
    } else {
        tracing::info!(config = %cfg.display(), "imports already load the drop-in; config untouched");
    }
    fp.check("config-written")?;
    Ok(p.version)
}

/// Remove the drop-in and our imports entry, restoring the original bytes when nobody changed the file since.
pub fn uninstall(layout: &NodePaths, fp: &FailPoints) -> Result<()> {
    let state = StateFiles::new(layout);
    let cfg = layout.config_file();

    let dropin = match fsutil::read_opt(&state.dropin)? {
        Some(p) => Some(PathBuf::from(String::from_utf8_lossy(&p).into_owned())),
        None => read_config(layout).ok().and_then(|(_, _, doc)| plan(layout, &doc).ok()).map(|p| p.host),
    };
    if let Some(d) = dropin.filter(|d| d.exists()) {
        mark_restart(&state, fp)?;
        fsutil::remove_if_exists(&d)?;
        fsutil::sync_parent(&d)?;
        tracing::info!(dropin = %d.display(), "drop-in removed");
    }
    if let Some(dir) = fsutil::read_opt(&state.created_dir)? {
        let dir = PathBuf::from(String::from_utf8_lossy(&dir).into_owned());
        // Only if empty: the user may have put their own drop-ins there since.
        if fs::remove_dir(&dir).is_ok() {
            tracing::info!(dir = %dir.display(), "removed drop-in directory");
        }
    }
    fp.check("uninstall-dropin-removed")?;

    let current = fsutil::read_opt(&cfg)?;
    let backup = fsutil::read_opt(&state.backup)?;
    let view_dropin = layout.view(&layout.containerd_config).parent().map(|d| d.join("conf.d").join(DROPIN_NAME));
    let entry = view_dropin.map(|p| p.display().to_string()).unwrap_or_default();
    match (current, backup) {
        (Some(cur), Some(orig)) => {
            let cur_text = String::from_utf8_lossy(&cur).into_owned();
            let orig_text = String::from_utf8_lossy(&orig).into_owned();
            let ours = imports::add(&orig_text, &entry).ok();
            if cur == orig {
                tracing::info!(config = %cfg.display(), "containerd config already original");
            } else if ours.as_deref() == Some(cur_text.as_str()) {
                mark_restart(&state, fp)?;
                let mode = fs::metadata(&cfg).map(|m| m.permissions().mode() & 0o7777).unwrap_or(0o644);
                fsutil::atomic_write(&cfg, &orig, mode, fp)?;
                tracing::info!(config = %cfg.display(), "containerd config restored byte for byte");
            } else {
                remove_entry_in_place(&state, &cfg, &cur_text, &entry, fp)?;
            }
        }
        (Some(cur), None) => {
            let cur_text = String::from_utf8_lossy(&cur).into_owned();
            let doc = imports::parse(&cur_text).map_err(|m| cfg_err(&cfg, m))?;
            if imports::list(&doc).contains(&entry) {
                remove_entry_in_place(&state, &cfg, &cur_text, &entry, fp)?;
            }
        }
        (None, _) => tracing::warn!(config = %cfg.display(), "containerd config missing; nothing to restore"),
    }
    fp.check("uninstall-config-restored")
}

/// Someone edited the config after we did: keep their edits, take out only our entry.
fn remove_entry_in_place(state: &StateFiles, cfg: &Path, text: &str, entry: &str, fp: &FailPoints) -> Result<()> {
    let new = imports::remove(text, entry).map_err(|m| cfg_err(cfg, m))?;
    if new != text {
        mark_restart(state, fp)?;
        let mode = fs::metadata(cfg).map(|m| m.permissions().mode() & 0o7777).unwrap_or(0o644);
        fsutil::atomic_write(cfg, new.as_bytes(), mode, fp)?;
        tracing::warn!(config = %cfg.display(), import = entry, "config changed since install; removed only our imports entry");
    }
    Ok(())
}

pub fn restart_pending(layout: &NodePaths) -> bool {
    StateFiles::new(layout).restart_pending.exists()
}

pub fn clear_restart_pending(layout: &NodePaths) -> Result<()> {
    let p = StateFiles::new(layout).restart_pending;
    if fsutil::remove_if_exists(&p)? {
        tracing::info!(marker = %p.display(), "containerd restart no longer pending");
    }
    Ok(())
}

#[cfg(test)]
mod tests;

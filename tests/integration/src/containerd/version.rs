//! Which containerd a test runs on: the system's 1.6 (Debian 12's package), or the 1.7 and 2.1 that `make setup`
//! unpacks into the cache (`scripts/setup.sh`: `$BULKHEAD_CACHE/containerd-<line>/`, and sid's runc 1.3 for 2.1).
//! A run's default comes from `BULKHEAD_CONTAINERD`; the `*_on_containerd_<x>_<y>` test binaries fix theirs by name.

use std::path::PathBuf;

/// The environment setting that picks the containerd of a run (`1.6`, `1.7` or `2.1`; default `1.6`).
pub const ENV: &str = "BULKHEAD_CONTAINERD";

/// A containerd release line the tests know how to start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ContainerdVersion {
    /// Debian 12's `containerd` package, on PATH.
    V1_6,
    /// trixie's package, unpacked by `make setup`.
    V1_7,
    /// sid's package, unpacked by `make setup`; its runc runtime uses sid's runc 1.3.
    V2_1,
}

impl ContainerdVersion {
    pub const ALL: [ContainerdVersion; 3] = [Self::V1_6, Self::V1_7, Self::V2_1];

    /// `"1.6"`, `"1.7"` or `"2.1"`.
    pub fn line(self) -> &'static str {
        match self {
            Self::V1_6 => "1.6",
            Self::V1_7 => "1.7",
            Self::V2_1 => "2.1",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|v| v.line() == s.trim()).ok_or_else(|| {
            let lines: Vec<&str> = Self::ALL.iter().map(|v| v.line()).collect();
            format!("{ENV}={s:?}: want one of {}", lines.join(", "))
        })
    }

    /// This run's default: `BULKHEAD_CONTAINERD`, else 1.6.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(ENV) {
            Ok(s) if !s.is_empty() => Self::parse(&s),
            _ => Ok(Self::V1_6),
        }
    }

    /// The version for the test binary (crate) named `crate_name` (pass `env!("CARGO_CRATE_NAME")`): a
    /// `<suite>_on_containerd_2_1` twin runs on 2.1 whatever the environment says; any other binary on
    /// [`ContainerdVersion::from_env`]. An invalid setting panics: a test must not quietly run on another version.
    pub fn for_test_binary(crate_name: &str) -> Self {
        for v in Self::ALL {
            if crate_name.ends_with(&format!("_on_containerd_{}", v.line().replace('.', "_"))) {
                return v;
            }
        }
        Self::from_env().unwrap_or_else(|e| panic!("{e}"))
    }

    /// The config format this version reads: 2 (1.6, 1.7) or 3 (2.x, CRI split into
    /// `io.containerd.cri.v1.{runtime,images}` plus `io.containerd.grpc.v1.cri` for the stream server).
    pub fn config_format(self) -> u8 {
        match self {
            Self::V1_6 | Self::V1_7 => 2,
            Self::V2_1 => 3,
        }
    }

    /// The directory holding this version's `containerd`, `ctr` and `containerd-shim-runc-v2`; `None` for the
    /// system's 1.6, found on PATH.
    pub fn bin_dir(self) -> Option<PathBuf> {
        match self {
            Self::V1_6 => None,
            Self::V1_7 | Self::V2_1 => Some(cache_dir().join(format!("containerd-{}", self.line())).join("usr/bin")),
        }
    }

    pub fn containerd(self) -> PathBuf {
        self.bin_dir().map_or_else(|| "containerd".into(), |d| d.join("containerd"))
    }

    pub fn ctr(self) -> PathBuf {
        self.bin_dir().map_or_else(|| "ctr".into(), |d| d.join("ctr"))
    }

    /// The runc binary this version's runc runtime gets as `BinaryName`; `None`: runc on PATH (the system's 1.1).
    /// 2.1 is developed and tested against runc 1.3 (its `script/setup/runc-version`).
    pub fn runc(self) -> Option<PathBuf> {
        match self {
            Self::V2_1 => Some(cache_dir().join("runc-1.3/usr/sbin/runc")),
            Self::V1_6 | Self::V1_7 => None,
        }
    }

    /// Why this version cannot be started here (its unpacked binaries are missing), or `None`.
    pub fn missing(self) -> Option<String> {
        let mut need: Vec<PathBuf> = self.bin_dir().map(|_| vec![self.containerd(), self.ctr()]).unwrap_or_default();
        need.extend(self.runc());
        need.iter()
            .find(|p| !p.is_file())
            .map(|p| format!("containerd {} needs {} (run `make setup`)", self.line(), p.display()))
    }
}

impl Default for ContainerdVersion {
    /// [`ContainerdVersion::from_env`]; an invalid `BULKHEAD_CONTAINERD` panics (a test must fail, not silently
    /// run on another version).
    fn default() -> Self {
        Self::from_env().unwrap_or_else(|e| panic!("{e}"))
    }
}

impl std::fmt::Display for ContainerdVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.line())
    }
}

/// `$BULKHEAD_CACHE`, default /var/cache/bulkhead (as `scripts/setup.sh`).
fn cache_dir() -> PathBuf {
    std::env::var_os("BULKHEAD_CACHE").map_or_else(|| PathBuf::from("/var/cache/bulkhead"), PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twins_are_picked_by_binary_name() {
        assert_eq!(ContainerdVersion::for_test_binary("shim_e2e_on_containerd_2_1"), ContainerdVersion::V2_1);
        assert_eq!(ContainerdVersion::for_test_binary("shim_e2e_on_containerd_1_7"), ContainerdVersion::V1_7);
        assert_eq!(ContainerdVersion::parse("2.1"), Ok(ContainerdVersion::V2_1));
        assert!(ContainerdVersion::parse("2.0").unwrap_err().contains("1.6, 1.7, 2.1"));
    }

    #[test]
    fn only_2x_reads_config_version_3() {
        let formats: Vec<u8> = ContainerdVersion::ALL.iter().map(|v| v.config_format()).collect();
        assert_eq!(formats, vec![2, 2, 3]);
        assert_eq!(ContainerdVersion::V1_6.containerd(), PathBuf::from("containerd"));
        assert!(ContainerdVersion::V2_1.runc().is_some_and(|r| r.ends_with("runc-1.3/usr/sbin/runc")));
    }
}

//! The VM configuration the shim hands us as JSON, and its validation.
//!
//! Parsing is strict (`deny_unknown_fields`) so a typo in the shim fails loudly instead of being
//! ignored; `VmConfig::validate` turns the raw document into a `ValidConfig` the rest of the VMM
//! can trust.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::bounded::{read_bounded, BoundedReadError};
use crate::ifname::check_ifname;
use crate::memory::Mib;

/// Upper bounds that keep a bad config from asking for absurd resources.
pub const MAX_VCPUS: u8 = 32;
pub const MIN_MEM: Mib = Mib(8);
pub const MAX_MEM: Mib = Mib(64 * 1024);
pub const MAX_BLOCK_DEVICES: usize = 8;
pub const MAX_CMDLINE_LEN: usize = 2048;
pub const MAX_FS_DEVICES: usize = 4;
pub const MAX_NET_DEVICES: usize = 4;
/// virtio-fs tags are at most 36 bytes (virtio spec 5.11.4).
pub const MAX_FS_TAG_LEN: usize = 36;
/// Linux interface names are at most 15 bytes (IFNAMSIZ - 1).
pub use crate::ifname::MAX_IFNAME_LEN;
/// Largest config document we accept (bytes).
pub const MAX_CONFIG_BYTES: u64 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum VmConfigError {
    #[error("cannot read config {path}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config is larger than {MAX_CONFIG_BYTES} bytes")]
    TooLarge,
    #[error("config is not valid JSON for a VM")]
    Parse(#[from] serde_json::Error),
    #[error("config names neither `kernel` nor `raw_guest`; exactly one is required")]
    NoBootSource,
    #[error("config names both `kernel` and `raw_guest`; exactly one is allowed")]
    TwoBootSources,
    #[error("`initramfs` and `cmdline` only apply to a `kernel` boot")]
    LinuxOnlyField,
    #[error("vcpus must be 1..={MAX_VCPUS}, got {0}")]
    Vcpus(u8),
    #[error("mem_mib must be {}..={}, got {}", MIN_MEM.0, MAX_MEM.0, .0.0)]
    Memory(Mib),
    #[error("{what} {path}: {reason}")]
    Path { what: &'static str, path: PathBuf, reason: String },
    #[error("vsock guest_cid must be >= 3 and < 2^32-1, got {0}")]
    GuestCid(u64),
    #[error("at most {MAX_BLOCK_DEVICES} block devices, got {0}")]
    TooManyBlock(usize),
    #[error("cmdline is longer than {MAX_CMDLINE_LEN} bytes")]
    CmdlineTooLong,
    #[error("raw_guest load_addr {0:#x} is outside 1 MiB..guest memory")]
    RawLoadAddr(u64),
    #[error("fs device: {0}")]
    Fs(String),
    #[error("net device: {0}")]
    Net(String),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// ELF vmlinux or bzImage.
    #[serde(default)]
    pub kernel: Option<PathBuf>,
    #[serde(default)]
    pub initramfs: Option<PathBuf>,
    #[serde(default)]
    pub cmdline: Option<String>,
    /// A test guest: flat code or a static ELF started directly in 64-bit long mode.
    #[serde(default)]
    pub raw_guest: Option<RawGuestConfig>,
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    #[serde(default = "default_mem")]
    pub mem_mib: Mib,
    /// Where the 8250 output goes; without it, serial output is dropped.
    #[serde(default)]
    pub serial_log: Option<PathBuf>,
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    #[serde(default)]
    pub block: Vec<BlockConfig>,
    /// vhost-user-fs devices (virtio-fs), each backed by a vhost-user backend such as virtiofsd.
    #[serde(default)]
    pub fs: Vec<FsConfig>,
    /// virtio-net devices, each on a host tap device.
    #[serde(default)]
    pub net: Vec<NetConfig>,
    #[serde(default)]
    pub api_socket: Option<PathBuf>,
    /// A virtio-balloon device for free page reporting; absent (as in every older document)
    /// means none.
    #[serde(default)]
    pub balloon: Option<BalloonConfig>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawGuestConfig {
    pub image: PathBuf,
    #[serde(default)]
    pub format: RawFormat,
    /// Load address for `flat` images (ELF images carry their own).
    #[serde(default = "default_raw_load")]
    pub load_addr: u64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum RawFormat {
    #[default]
    Elf,
    Flat,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    pub uds_path: PathBuf,
    pub guest_cid: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BlockConfig {
    pub path: PathBuf,
    #[serde(default)]
    pub read_only: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FsConfig {
    /// The tag the guest mounts (`mount -t virtiofs <tag> /dir`), 1..=36 bytes.
    pub tag: String,
    /// The vhost-user backend's Unix socket (virtiofsd `--socket-path`).
    pub socket: PathBuf,
    /// Size of each request queue.
    #[serde(default = "default_fs_queue_size")]
    pub queue_size: u16,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// Name of an existing tap device (in the VMM's network namespace).
    pub tap: String,
    /// The guest NIC's MAC address, `aa:bb:cc:dd:ee:ff`.
    pub mac: String,
    /// MTU offered to the guest in the config space.
    #[serde(default)]
    pub mtu: Option<u16>,
    /// Token-bucket limits per direction; absent means unlimited.
    #[serde(default)]
    pub rate_limiter: Option<NetRateLimiterConfig>,
    /// The link state the device reports (virtio-net's status). `down` is for a template's VM,
    /// whose tap has no network: a restore attaches the run's own tap, raises the link and
    /// tells the guest with a config interrupt, as the virtio spec has a device do.
    #[serde(default)]
    pub link: LinkState,
}

/// [`NetConfig::link`].
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LinkState {
    #[default]
    Up,
    Down,
}

/// The virtio-balloon device. Free page reporting: the guest's kernel reports pages it freed and
/// the VMM gives them back to the host. Its target (the API's `balloon` request, 0 at boot) asks
/// the guest to hold memory in it, which the VMM gives back too: the shim sizes a VM's memory
/// with it. No statistics queue, free page hinting or page poisoning.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct BalloonConfig {
    /// Offer VIRTIO_BALLOON_F_REPORTING. Without it the device has only its inflate and deflate
    /// queues, which the guest uses only when the API sets a target.
    #[serde(default)]
    pub free_page_reporting: bool,
}

/// Rate limits of one net device, per direction.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct NetRateLimiterConfig {
    /// Frames the guest receives (tap -> guest).
    #[serde(default)]
    pub rx: Option<RateLimiterConfig>,
    /// Frames the guest sends (guest -> tap).
    #[serde(default)]
    pub tx: Option<RateLimiterConfig>,
}

/// A bandwidth bucket (bytes) and an operations bucket (frames); either may be absent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct RateLimiterConfig {
    #[serde(default)]
    pub bandwidth: Option<TokenBucketConfig>,
    #[serde(default)]
    pub ops: Option<TokenBucketConfig>,
}

/// A token bucket holding `size` tokens that refills completely in `refill_time_ms`, plus a
/// one-time burst that is spent first and never refills.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TokenBucketConfig {
    pub size: u64,
    #[serde(default)]
    pub one_time_burst: u64,
    pub refill_time_ms: u64,
}

/// Longest refill period a token bucket may have (one hour).
pub const MAX_REFILL_TIME_MS: u64 = 3_600_000;

impl TokenBucketConfig {
    fn check(&self, what: &str) -> Result<(), VmConfigError> {
        if self.size == 0 {
            return Err(VmConfigError::Net(format!("{what}: size must be at least 1")));
        }
        if !(1..=MAX_REFILL_TIME_MS).contains(&self.refill_time_ms) {
            return Err(VmConfigError::Net(format!("{what}: refill_time_ms must be 1..={MAX_REFILL_TIME_MS}")));
        }
        Ok(())
    }
}

impl NetRateLimiterConfig {
    fn check(&self) -> Result<(), VmConfigError> {
        for (dir, limiter) in [("rx", &self.rx), ("tx", &self.tx)] {
            let Some(l) = limiter else { continue };
            for (kind, bucket) in [("bandwidth", &l.bandwidth), ("ops", &l.ops)] {
                if let Some(b) = bucket {
                    b.check(&format!("rate_limiter.{dir}.{kind}"))?;
                }
            }
        }
        Ok(())
    }
}

fn default_fs_queue_size() -> u16 {
    1024
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

fn default_vcpus() -> u8 {
    1
}
fn default_mem() -> Mib {
    Mib(128)
}
fn default_raw_load() -> u64 {
    0x10_0000
}

/// The guest kernel has neither modules nor PCI, so no `nomodule` or `pci=off`: the kernel hands a
/// word it does not know to /init (as an argument, or with `=` as an environment variable).
/// `no_timer_check`: on a loaded host the vCPU may not run during the kernel's IO-APIC timer
/// check, which then panics ("IO-APIC + timer doesn't work!"); Firecracker and Kata skip it too.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 i8042.noaux no_timer_check";

/// What we boot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum BootSource {
    Linux { kernel: PathBuf, initramfs: Option<PathBuf>, cmdline: String },
    Raw(RawGuestConfig),
}

/// A config that passed validation. Serialisable because a snapshot records the config its VM
/// was built from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidConfig {
    pub boot: BootSource,
    pub vcpus: u8,
    pub mem_bytes: u64,
    pub serial_log: Option<PathBuf>,
    pub vsock: Option<VsockConfig>,
    pub block: Vec<BlockConfig>,
    pub fs: Vec<FsConfig>,
    pub net: Vec<NetConfig>,
    pub api_socket: Option<PathBuf>,
    pub balloon: Option<BalloonConfig>,
}

impl VmConfig {
    pub fn from_json(text: &str) -> Result<Self, VmConfigError> {
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(VmConfigError::TooLarge);
        }
        Ok(serde_json::from_str(text)?)
    }

    pub fn from_file(path: &Path) -> Result<Self, VmConfigError> {
        Self::from_json(&read_document(path)?)
    }

    pub fn validate(self) -> Result<ValidConfig, VmConfigError> {
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(VmConfigError::Vcpus(self.vcpus));
        }
        let mem_bytes = match self.mem_mib.bytes() {
            Some(bytes) if (MIN_MEM..=MAX_MEM).contains(&self.mem_mib) => bytes,
            _ => return Err(VmConfigError::Memory(self.mem_mib)),
        };
        let boot = match (self.kernel, self.raw_guest) {
            (None, None) => return Err(VmConfigError::NoBootSource),
            (Some(_), Some(_)) => return Err(VmConfigError::TwoBootSources),
            (Some(kernel), None) => {
                readable_file("kernel", &kernel)?;
                if let Some(initrd) = &self.initramfs {
                    readable_file("initramfs", initrd)?;
                }
                let cmdline = self.cmdline.unwrap_or_else(|| DEFAULT_CMDLINE.to_string());
                if cmdline.len() > MAX_CMDLINE_LEN {
                    return Err(VmConfigError::CmdlineTooLong);
                }
                BootSource::Linux { kernel, initramfs: self.initramfs, cmdline }
            }
            (None, Some(raw)) => {
                if self.initramfs.is_some() || self.cmdline.is_some() {
                    return Err(VmConfigError::LinuxOnlyField);
                }
                readable_file("raw_guest image", &raw.image)?;
                if raw.load_addr < 0x10_0000 || raw.load_addr >= mem_bytes {
                    return Err(VmConfigError::RawLoadAddr(raw.load_addr));
                }
                BootSource::Raw(raw)
            }
        };
        if let Some(v) = &self.vsock {
            if v.guest_cid < 3 || v.guest_cid >= u64::from(u32::MAX) {
                return Err(VmConfigError::GuestCid(v.guest_cid));
            }
            parent_dir_exists("vsock uds_path", &v.uds_path)?;
        }
        if self.block.len() > MAX_BLOCK_DEVICES {
            return Err(VmConfigError::TooManyBlock(self.block.len()));
        }
        for b in &self.block {
            readable_file("block device", &b.path)?;
        }
        if self.fs.len() > MAX_FS_DEVICES {
            return Err(VmConfigError::Fs(format!("at most {MAX_FS_DEVICES} devices, got {}", self.fs.len())));
        }
        for f in &self.fs {
            if f.tag.is_empty() || f.tag.len() > MAX_FS_TAG_LEN {
                return Err(VmConfigError::Fs(format!("tag {:?} must be 1..={MAX_FS_TAG_LEN} bytes", f.tag)));
            }
            if !f.queue_size.is_power_of_two() || f.queue_size > 32768 {
                return Err(VmConfigError::Fs(format!(
                    "queue_size {} must be a power of two up to 32768",
                    f.queue_size
                )));
            }
            parent_dir_exists("fs socket", &f.socket)?;
        }
        if self.net.len() > MAX_NET_DEVICES {
            return Err(VmConfigError::Net(format!("at most {MAX_NET_DEVICES} devices, got {}", self.net.len())));
        }
        for n in &self.net {
            check_tap_name(&n.tap)?;
            match parse_mac(&n.mac) {
                Some(mac) if mac[0] & 1 == 0 => {}
                _ => {
                    return Err(VmConfigError::Net(format!(
                        "mac {:?} is not a unicast aa:bb:cc:dd:ee:ff address",
                        n.mac
                    )))
                }
            }
            if n.mtu.is_some_and(|m| !(68..=65535).contains(&m)) {
                return Err(VmConfigError::Net(format!("mtu {:?} must be 68..=65535", n.mtu)));
            }
            if let Some(r) = &n.rate_limiter {
                r.check()?;
            }
        }
        if let Some(p) = &self.serial_log {
            parent_dir_exists("serial_log", p)?;
        }
        if let Some(p) = &self.api_socket {
            parent_dir_exists("api_socket", p)?;
        }
        Ok(ValidConfig {
            boot,
            vcpus: self.vcpus,
            mem_bytes,
            serial_log: self.serial_log,
            vsock: self.vsock,
            block: self.block,
            fs: self.fs,
            net: self.net,
            api_socket: self.api_socket,
            // A bool has nothing left to check once it parsed (and unknown fields were refused).
            balloon: self.balloon,
        })
    }
}

/// A config document's text (the VM config, a restore's run settings), at most
/// [`MAX_CONFIG_BYTES`].
pub(crate) fn read_document(path: &Path) -> Result<String, VmConfigError> {
    read_bounded(path, MAX_CONFIG_BYTES).map_err(|e| match e {
        BoundedReadError::Io(source) => VmConfigError::Read { path: path.to_owned(), source },
        BoundedReadError::TooLarge { .. } => VmConfigError::TooLarge,
    })
}

/// A tap's name, by the one rule for interface names ([`check_ifname`]).
pub(crate) fn check_tap_name(tap: &str) -> Result<(), VmConfigError> {
    check_ifname(tap).map_err(|e| VmConfigError::Net(format!("tap name {tap:?} is not a valid interface name: it {e}")))
}

pub(crate) fn readable_file(what: &'static str, path: &Path) -> Result<(), VmConfigError> {
    let err = |reason: String| VmConfigError::Path { what, path: path.to_owned(), reason };
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    if !meta.is_file() {
        return Err(err("is not a regular file".into()));
    }
    Ok(())
}

pub(crate) fn parent_dir_exists(what: &'static str, path: &Path) -> Result<(), VmConfigError> {
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(VmConfigError::Path {
            what,
            path: path.to_owned(),
            reason: "parent directory does not exist".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel_file() -> tempfile::NamedTempFile {
        tempfile::NamedTempFile::new().unwrap()
    }

    #[test]
    fn default_cmdline_skips_the_io_apic_timer_check() {
        // Without it a guest on a loaded host can panic in its IO-APIC timer check.
        assert!(DEFAULT_CMDLINE.split(' ').any(|w| w == "no_timer_check"), "{DEFAULT_CMDLINE}");
    }

    #[test]
    fn minimal_linux_config_validates_with_defaults() {
        let k = kernel_file();
        let json = format!(r#"{{"kernel": "{}"}}"#, k.path().display());
        let cfg = VmConfig::from_json(&json).unwrap().validate().unwrap();
        assert_eq!(cfg.vcpus, 1);
        assert_eq!(cfg.mem_bytes, 128 << 20);
        match cfg.boot {
            BootSource::Linux { cmdline, .. } => assert_eq!(cmdline, DEFAULT_CMDLINE),
            other => panic!("unexpected boot {other:?}"),
        }
    }

    #[test]
    fn unknown_field_is_rejected() {
        let err = VmConfig::from_json(r#"{"kernal": "/x"}"#).unwrap_err();
        let cause = std::error::Error::source(&err).map(|s| s.to_string()).unwrap_or_default();
        assert!(cause.contains("unknown field `kernal`"), "{err}: {cause}");
    }

    #[test]
    fn bad_values_give_clear_errors() {
        let k = kernel_file();
        let p = k.path().display();
        let cases = [
            (format!(r#"{{"kernel":"{p}","vcpus":0}}"#), "vcpus"),
            (format!(r#"{{"kernel":"{p}","mem_mib":1}}"#), "mem_mib"),
            (format!(r#"{{"kernel":"{p}","vsock":{{"uds_path":"/tmp/v","guest_cid":2}}}}"#), "guest_cid"),
            (r#"{"kernel":"/nonexistent/vmlinux"}"#.to_string(), "kernel"),
            (r#"{}"#.to_string(), "neither"),
            (format!(r#"{{"kernel":"{p}","raw_guest":{{"image":"{p}"}}}}"#), "both"),
            (format!(r#"{{"kernel":"{p}","api_socket":"/nonexistent/dir/api"}}"#), "parent"),
        ];
        for (json, needle) in cases {
            let err = VmConfig::from_json(&json).and_then(|c| c.validate()).unwrap_err();
            assert!(err.to_string().contains(needle), "{json}: {err}");
        }
    }

    #[test]
    fn fs_and_net_devices_are_checked() {
        let k = kernel_file();
        let p = k.path().display();
        let ok = format!(
            r#"{{"kernel":"{p}","fs":[{{"tag":"rootfs","socket":"/tmp/fs.sock"}}],"net":[{{"tap":"tap0","mac":"02:00:00:00:00:01","mtu":1500}}]}}"#
        );
        let cfg = VmConfig::from_json(&ok).unwrap().validate().unwrap();
        assert_eq!(cfg.fs[0].queue_size, 1024);
        assert_eq!(cfg.net[0].tap, "tap0");
        assert_eq!(cfg.net[0].rate_limiter, None, "rate limiting is off by default");
        let limited = format!(
            r#"{{"kernel":"{p}","net":[{{"tap":"tap0","mac":"02:00:00:00:00:01","rate_limiter":{{"tx":{{"bandwidth":{{"size":1000,"refill_time_ms":100}}}}}}}}]}}"#
        );
        let cfg = VmConfig::from_json(&limited).unwrap().validate().unwrap();
        let tx = cfg.net[0].rate_limiter.as_ref().and_then(|r| r.tx.as_ref()).unwrap();
        assert_eq!(tx.bandwidth, Some(TokenBucketConfig { size: 1000, one_time_burst: 0, refill_time_ms: 100 }));
        assert_eq!(tx.ops, None);
        let cases = [
            (format!(r#"{{"kernel":"{p}","fs":[{{"tag":"","socket":"/tmp/s"}}]}}"#), "tag"),
            (format!(r#"{{"kernel":"{p}","fs":[{{"tag":"t","socket":"/tmp/s","queue_size":3}}]}}"#), "queue_size"),
            (format!(r#"{{"kernel":"{p}","net":[{{"tap":"a/b","mac":"02:00:00:00:00:01"}}]}}"#), "tap"),
            (format!(r#"{{"kernel":"{p}","net":[{{"tap":"t","mac":"01:00:00:00:00:01"}}]}}"#), "unicast"),
            (format!(r#"{{"kernel":"{p}","net":[{{"tap":"t","mac":"02:00:00:00:00"}}]}}"#), "mac"),
            (
                format!(
                    r#"{{"kernel":"{p}","net":[{{"tap":"t","mac":"02:00:00:00:00:01","rate_limiter":{{"tx":{{"ops":{{"size":0,"refill_time_ms":10}}}}}}}}]}}"#
                ),
                "rate_limiter.tx.ops: size",
            ),
            (
                format!(
                    r#"{{"kernel":"{p}","net":[{{"tap":"t","mac":"02:00:00:00:00:01","rate_limiter":{{"rx":{{"bandwidth":{{"size":5,"refill_time_ms":0}}}}}}}}]}}"#
                ),
                "rate_limiter.rx.bandwidth: refill_time_ms",
            ),
        ];
        for (json, needle) in cases {
            let err = VmConfig::from_json(&json).and_then(|c| c.validate()).unwrap_err();
            assert!(err.to_string().contains(needle), "{json}: {err}");
        }
        assert_eq!(parse_mac("aa:BB:0c:dd:ee:ff"), Some([0xaa, 0xbb, 0x0c, 0xdd, 0xee, 0xff]));
        assert_eq!(parse_mac("aa:bb:cc:dd:ee:ff:00"), None);
    }

    #[test]
    fn the_balloon_is_optional_strict_and_off_unless_asked_for() {
        let k = kernel_file();
        let p = k.path().display();
        let cfg = VmConfig::from_json(&format!(r#"{{"kernel":"{p}"}}"#)).unwrap().validate().unwrap();
        assert_eq!(cfg.balloon, None, "a document without the field (every older one) has no balloon");
        let on = format!(r#"{{"kernel":"{p}","balloon":{{"free_page_reporting":true}}}}"#);
        let cfg = VmConfig::from_json(&on).unwrap().validate().unwrap();
        assert_eq!(cfg.balloon, Some(BalloonConfig { free_page_reporting: true }));
        let bare = format!(r#"{{"kernel":"{p}","balloon":{{}}}}"#);
        let cfg = VmConfig::from_json(&bare).unwrap().validate().unwrap();
        assert_eq!(cfg.balloon, Some(BalloonConfig { free_page_reporting: false }), "reporting only when asked for");
        for bad in [
            format!(r#"{{"kernel":"{p}","balloon":{{"free_page_reportin":true}}}}"#),
            format!(r#"{{"kernel":"{p}","balloon":{{"free_page_reporting":"yes"}}}}"#),
            format!(r#"{{"kernel":"{p}","balloon":{{"free_page_reporting":true,"size_mib":64}}}}"#),
            format!(r#"{{"kernel":"{p}","balloon":true}}"#),
        ] {
            assert!(VmConfig::from_json(&bad).is_err(), "{bad}");
        }
        let doc = serde_json::to_string(&VmConfig::from_json(&on).unwrap()).unwrap();
        assert!(doc.contains(r#""balloon":{"free_page_reporting":true}"#), "{doc}");
    }

    #[test]
    fn oversized_config_is_rejected() {
        let big = format!(r#"{{"cmdline":"{}"}}"#, "x".repeat(MAX_CONFIG_BYTES as usize));
        assert!(matches!(VmConfig::from_json(&big), Err(VmConfigError::TooLarge)));
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("vm.json");
        std::fs::write(&file, &big).unwrap();
        assert!(matches!(VmConfig::from_file(&file), Err(VmConfigError::TooLarge)));
        assert!(matches!(VmConfig::from_file(&dir.path().join("none")), Err(VmConfigError::Read { .. })));
    }
}

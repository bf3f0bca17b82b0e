//! Shim configuration: a TOML file named by the runtime options (`ConfigPath`, Kata's convention)
//! or found by [`config_path`].
//!
//! Every table uses `deny_unknown_fields`, so a typo is an error naming the key, reported at Create.

use std::path::{Path, PathBuf};

use bulkhead_vmm_api::memory::Mib;
use serde::{Deserialize, Serialize};

/// Where the config lives when containerd passes no `ConfigPath` and nothing else names one.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/bulkhead/config.toml";

/// The node installer's config (the `current` release).
pub const INSTALLED_CONFIG_PATH: &str = "/opt/bulkhead/current/config.toml";

/// Names the config file when the runtime options carry no `ConfigPath` (containerd's shim
/// manager `env`; a 2.x runtime with `sandboxer = "shim"` can have no options at all).
pub const CONFIG_ENV: &str = "BULKHEAD_CONFIG";

/// The config file to read: `ConfigPath` from the runtime options, else `$BULKHEAD_CONFIG`, else
/// the installed release's config where one exists, else [`DEFAULT_CONFIG_PATH`].
pub fn config_path(from_options: Option<String>) -> PathBuf {
    from_options.or_else(|| std::env::var(CONFIG_ENV).ok().filter(|p| !p.is_empty())).map(PathBuf::from).unwrap_or_else(
        || {
            if Path::new(INSTALLED_CONFIG_PATH).exists() {
                PathBuf::from(INSTALLED_CONFIG_PATH)
            } else {
                PathBuf::from(DEFAULT_CONFIG_PATH)
            }
        },
    )
}

/// Upper bound for the config file; anything larger is not a config file.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("bulkhead config {path}: cannot read: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("bulkhead config {path}: larger than {MAX_CONFIG_BYTES} bytes")]
    TooLarge { path: PathBuf },
    #[error("bulkhead config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("bulkhead config {path}: {field}: {message}")]
    Invalid { path: PathBuf, field: &'static str, message: String },
}

/// Which sandbox backend runs the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The product: one microVM per pod.
    Vm,
    /// The agent as PID 1 of fresh namespaces on the host. No VM isolation.
    Namespace,
}

impl Backend {
    /// The name the config file uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Vm => "vm",
            Backend::Namespace => "namespace",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `vm` or `namespace`. Defaults to `vm`: the namespace backend must be chosen explicitly.
    #[serde(default = "default_backend")]
    pub backend: Backend,
    /// Directory for per-pod state (agent socket, launcher pid file, agent state, rootfs mount points).
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// Log level of the shim (`error`, `warn`, `info`, `debug`, `trace`).
    #[serde(default = "default_log_level")]
    pub log_level: String,
    #[serde(default)]
    pub agent: AgentConfig,
    #[serde(default)]
    pub namespace: NamespaceConfig,
    #[serde(default)]
    pub vm: VmSettings,
    #[serde(default)]
    pub network: NetworkConfig,
    #[serde(default)]
    pub emptydir: EmptyDirConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// How long the sandbox start may wait for the agent to answer, in milliseconds.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Deadline for one control RPC to the agent, in milliseconds (waits for exit are not bounded).
    #[serde(default = "default_rpc_timeout_ms")]
    pub rpc_timeout_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceConfig {
    /// Path of the `bulkhead-agent` binary run as PID 1 of the pod's namespaces.
    #[serde(default = "default_agent_path")]
    pub agent_path: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSettings {
    /// The `bulkhead-vmm` binary, started as root; it jails itself.
    #[serde(default = "default_vmm_path")]
    pub vmm_path: PathBuf,
    /// The guest kernel (ELF vmlinux or bzImage).
    #[serde(default = "default_kernel_path")]
    pub kernel_path: PathBuf,
    /// The initramfs with the agent as /init.
    #[serde(default = "default_initramfs_path")]
    pub initramfs_path: PathBuf,
    /// virtiofsd, one per pod, serving the pod's shared directory (rootfs and volumes).
    #[serde(default = "default_virtiofsd_path")]
    pub virtiofsd_path: PathBuf,
    /// vCPUs of a pod that sets no CPU limit.
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    /// vCPUs a pod's VM boots with to grow into (in-place resize): it gets the larger of its own
    /// vCPUs and this, with only its own online. 0: none beyond its own.
    #[serde(default)]
    pub max_vcpus: u8,
    /// Memory every VM has to grow into (in-place resize), in MiB: a VM gets the larger of its
    /// pod's memory and this, and its balloon holds the difference until a resize asks for it.
    /// 0: none beyond the pod's.
    #[serde(default)]
    pub max_memory_mib: Mib,
    /// Guest memory of a pod that sets no memory limit; for a pod that does, what the guest
    /// kernel and agent get on top of it.
    #[serde(default = "default_memory_mib")]
    pub memory_mib: Mib,
    /// The ids pods' VMMs run as: each pod's VMM gets a uid and gid (the same number) of its own
    /// from `jail_id_first` .. `jail_id_first + jail_id_count`, so one that escaped its jail
    /// cannot signal or trace another's. Keep the range clear of the node's users and of
    /// user-namespace ranges (/etc/subuid).
    #[serde(default = "default_jail_id_first")]
    pub jail_id_first: u32,
    #[serde(default = "default_jail_id_count")]
    pub jail_id_count: u32,
    /// The snapshot template cache (warm pods): root's, read-only to the VMMs.
    #[serde(default = "default_template_dir")]
    pub template_dir: PathBuf,
    /// The template store's ceiling: at most this many templates...
    #[serde(default = "default_template_max_count")]
    pub template_max_count: u32,
    /// ...using at most this much disk (allocated blocks; a quantity such as `"32Gi"`). Before
    /// each build, templates of other node files, templates unused for
    /// `template_max_idle_days`, then the least recently used go until the new one fits; if it
    /// still does not (the rest are busy), the pod boots cold.
    #[serde(default = "default_template_max_size")]
    pub template_max_size: ByteSize,
    #[serde(default = "default_template_max_idle_days")]
    pub template_max_idle_days: u32,
    /// How a pod's VM starts: restored from a template (`warm`), booted (`cold`), or `auto`
    /// (the default): warm where the host runs ordinary guests on `bulkhead-vmm` (the probe says
    /// VMX or SVM), cold elsewhere. Warm pods with the real guest are proven in the emulated
    /// AMD-V node (`tests/node`, `network_e2e::restored_vm_pods_are_each_their_own_on_bulkhead_vmm`).
    #[serde(default)]
    pub start: VmStart,
}

/// [`VmSettings::start`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmStart {
    #[default]
    Auto,
    Warm,
    Cold,
}

impl VmStart {
    /// Whether pods restore from templates on this host.
    pub fn warm_here(self) -> bool {
        match self {
            VmStart::Warm => true,
            VmStart::Cold => false,
            VmStart::Auto => bulkhead_vmm_api::probe::KvmKind::probe().ordinary_guests().is_ok(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkConfig {
    /// Let pods reach the cloud metadata endpoint (169.254.169.254, fd00:ec2::254). Off by
    /// default: the shim drops that traffic in the pod's network namespace.
    #[serde(default)]
    pub allow_metadata: bool,
}

/// The pods' metrics sockets (`<state_dir>/.metrics`, [`crate::metrics::dir`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// The group that may read the pods' metrics: the node exporter runs as an unprivileged
    /// user with this group (the DaemonSet's `supplementalGroups`), and nothing else of the
    /// pods' state is open to it.
    #[serde(default = "default_metrics_gid")]
    pub gid: u32,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self { gid: default_metrics_gid() }
    }
}

fn default_metrics_gid() -> u32 {
    DEFAULT_METRICS_GID
}

/// The metrics group unless the config names another (the exporter's port, 9464).
pub const DEFAULT_METRICS_GID: u32 = 9464;

/// Smallest emptyDir size limit the shim enforces: below it, ext4's own metadata would leave
/// the volume next to no room (1 MiB keeps about 90% of itself free).
pub const MIN_EMPTYDIR_BYTES: u64 = 1 << 20;
/// Largest emptyDir size limit accepted anywhere (annotation or config): 16 TiB, a sanity bound
/// well inside what ext4 and a loop device take.
pub const MAX_EMPTYDIR_BYTES: u64 = 16 << 40;

/// A size written as a Kubernetes quantity (`"1Gi"`, `"500M"`), held in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        crate::quantity::parse_bytes(&text).map(ByteSize).map_err(serde::de::Error::custom)
    }
}

/// Size limits of pods' emptyDir volumes, enforced where the data lives (`sandbox/emptydir`):
/// a limited emptyDir is an ext4 image of exactly its limit, loop-mounted for the pod.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmptyDirConfig {
    /// The limit of every disk-backed emptyDir whose pod names none for it (the
    /// `bulkhead.io/emptydir-size-limits` annotation). None: such emptyDirs stay unlimited, as
    /// with runc (kubelet's eviction is all that bounds them).
    #[serde(default)]
    pub default_size_limit: Option<ByteSize>,
    /// No emptyDir may be larger: a pod annotation above it is refused at RunPodSandbox.
    #[serde(default)]
    pub max_size_limit: Option<ByteSize>,
    /// `mkfs.ext4` (e2fsprogs), run by the shim on the host to format a new emptyDir image.
    #[serde(default = "default_mkfs_path")]
    pub mkfs_path: PathBuf,
}

impl Default for EmptyDirConfig {
    fn default() -> Self {
        Self { default_size_limit: None, max_size_limit: None, mkfs_path: default_mkfs_path() }
    }
}

fn default_mkfs_path() -> PathBuf {
    PathBuf::from("/sbin/mkfs.ext4")
}

fn default_backend() -> Backend {
    Backend::Vm
}
fn default_state_dir() -> PathBuf {
    PathBuf::from("/run/bulkhead")
}
fn default_log_level() -> String {
    "info".into()
}
fn default_connect_timeout_ms() -> u64 {
    5_000
}
fn default_rpc_timeout_ms() -> u64 {
    10_000
}
fn default_agent_path() -> PathBuf {
    PathBuf::from("/usr/local/bin/bulkhead-agent")
}
fn default_vmm_path() -> PathBuf {
    PathBuf::from("/usr/local/bin/bulkhead-vmm")
}
fn default_template_max_count() -> u32 {
    32
}
fn default_template_max_size() -> ByteSize {
    ByteSize(32 << 30)
}
fn default_template_max_idle_days() -> u32 {
    14
}
fn default_template_dir() -> PathBuf {
    PathBuf::from("/var/lib/bulkhead/templates")
}
fn default_kernel_path() -> PathBuf {
    PathBuf::from("/usr/share/bulkhead/vmlinux")
}
fn default_initramfs_path() -> PathBuf {
    PathBuf::from("/usr/share/bulkhead/initramfs.cpio.gz")
}
fn default_virtiofsd_path() -> PathBuf {
    PathBuf::from("/usr/local/bin/virtiofsd")
}
fn default_vcpus() -> u8 {
    1
}
fn default_memory_mib() -> Mib {
    Mib(256)
}
fn default_jail_id_first() -> u32 {
    1_900_000_000
}
fn default_jail_id_count() -> u32 {
    65_536
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self { connect_timeout_ms: default_connect_timeout_ms(), rpc_timeout_ms: default_rpc_timeout_ms() }
    }
}
impl Default for NamespaceConfig {
    fn default() -> Self {
        Self { agent_path: default_agent_path() }
    }
}
impl Default for VmSettings {
    fn default() -> Self {
        Self {
            vmm_path: default_vmm_path(),
            kernel_path: default_kernel_path(),
            initramfs_path: default_initramfs_path(),
            virtiofsd_path: default_virtiofsd_path(),
            vcpus: default_vcpus(),
            max_vcpus: 0,
            max_memory_mib: Mib(0),
            memory_mib: default_memory_mib(),
            jail_id_first: default_jail_id_first(),
            jail_id_count: default_jail_id_count(),
            template_dir: default_template_dir(),
            template_max_count: default_template_max_count(),
            template_max_size: default_template_max_size(),
            template_max_idle_days: default_template_max_idle_days(),
            start: VmStart::default(),
        }
    }
}

impl Config {
    /// Reads and validates the config at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        use std::io::Read;
        let file = std::fs::File::open(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        let mut text = String::new();
        file.take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|source| ConfigError::Read { path: path.into(), source })?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(ConfigError::TooLarge { path: path.into() });
        }
        Self::parse(path, &text)
    }

    /// Parses and validates config text; `path` only labels errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.into(),
            message: e.message().to_string() + &span_hint(text, e.span()),
        })?;
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let invalid =
            |field, message: &str| ConfigError::Invalid { path: path.into(), field, message: message.to_string() };
        if !self.state_dir.is_absolute() {
            return Err(invalid("state_dir", "must be an absolute path"));
        }
        if !["error", "warn", "info", "debug", "trace"].contains(&self.log_level.as_str()) {
            return Err(invalid("log_level", "must be one of error, warn, info, debug, trace"));
        }
        if self.agent.connect_timeout_ms == 0 || self.agent.connect_timeout_ms > 600_000 {
            return Err(invalid("agent.connect_timeout_ms", "must be between 1 and 600000"));
        }
        if self.agent.rpc_timeout_ms == 0 || self.agent.rpc_timeout_ms > 600_000 {
            return Err(invalid("agent.rpc_timeout_ms", "must be between 1 and 600000"));
        }
        if !self.namespace.agent_path.is_absolute() {
            return Err(invalid("namespace.agent_path", "must be an absolute path"));
        }
        use bulkhead_vmm_api::config::{MAX_MEM, MAX_VCPUS};
        for (field, path) in [
            ("vm.vmm_path", &self.vm.vmm_path),
            ("vm.kernel_path", &self.vm.kernel_path),
            ("vm.initramfs_path", &self.vm.initramfs_path),
            ("vm.virtiofsd_path", &self.vm.virtiofsd_path),
            ("vm.template_dir", &self.vm.template_dir),
        ] {
            if !path.is_absolute() {
                return Err(invalid(field, "must be an absolute path"));
            }
        }
        if self.vm.vcpus == 0 || self.vm.vcpus > MAX_VCPUS {
            return Err(invalid("vm.vcpus", &format!("must be between 1 and {MAX_VCPUS}")));
        }
        if self.vm.max_vcpus > MAX_VCPUS {
            return Err(invalid("vm.max_vcpus", &format!("must be at most {MAX_VCPUS} (0: no vCPUs to grow into)")));
        }
        if self.vm.memory_mib < Mib(64) || self.vm.memory_mib > MAX_MEM {
            return Err(invalid("vm.memory_mib", &format!("must be between 64 and {}", MAX_MEM.get())));
        }
        if self.vm.max_memory_mib > MAX_MEM {
            let why = format!("must be at most {} (0: no memory to grow into)", MAX_MEM.get());
            return Err(invalid("vm.max_memory_mib", &why));
        }
        if self.vm.template_max_count == 0 || self.vm.template_max_count > 10_000 {
            return Err(invalid("vm.template_max_count", "must be between 1 and 10000"));
        }
        if self.vm.template_max_size.0 < 64 << 20 {
            return Err(invalid("vm.template_max_size", "must be at least 64Mi"));
        }
        if self.vm.template_max_idle_days == 0 {
            return Err(invalid("vm.template_max_idle_days", "must be at least 1"));
        }
        if self.metrics.gid == 0 {
            return Err(invalid("metrics.gid", "must not be 0: the exporter's group would be root's"));
        }
        let bounds = format!(
            "must be between {} and {}",
            crate::quantity::format_bytes(MIN_EMPTYDIR_BYTES),
            crate::quantity::format_bytes(MAX_EMPTYDIR_BYTES)
        );
        for (field, size) in [
            ("emptydir.default_size_limit", self.emptydir.default_size_limit),
            ("emptydir.max_size_limit", self.emptydir.max_size_limit),
        ] {
            if size.is_some_and(|ByteSize(b)| !(MIN_EMPTYDIR_BYTES..=MAX_EMPTYDIR_BYTES).contains(&b)) {
                return Err(invalid(field, &bounds));
            }
        }
        if let (Some(ByteSize(default)), Some(ByteSize(max))) =
            (self.emptydir.default_size_limit, self.emptydir.max_size_limit)
        {
            if default > max {
                return Err(invalid("emptydir.default_size_limit", "must not be larger than emptydir.max_size_limit"));
            }
        }
        if !self.emptydir.mkfs_path.is_absolute() {
            return Err(invalid("emptydir.mkfs_path", "must be an absolute path"));
        }
        let last = u64::from(self.vm.jail_id_first) + u64::from(self.vm.jail_id_count);
        if self.vm.jail_id_first == 0 || self.vm.jail_id_count == 0 || last >= u64::from(u32::MAX) {
            return Err(invalid(
                "vm.jail_id_first/jail_id_count",
                "must name at least one id, never 0 (root) nor 4294967295 (-1)",
            ));
        }
        Ok(())
    }
}

/// " (line N)" for a TOML error span, so the operator finds the bad key quickly.
fn span_hint(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    match span {
        Some(span) if span.start <= text.len() => {
            let line = text[..span.start].matches('\n').count() + 1;
            format!(" (line {line})")
        }
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("/test/config.toml"), text)
    }

    #[test]
    fn empty_config_defaults_to_vm_backend() {
        let config = parse("").unwrap();
        assert_eq!(config.backend, Backend::Vm);
        assert_eq!(config.state_dir, PathBuf::from("/run/bulkhead"));
    }

    #[test]
    fn namespace_backend_is_explicit() {
        let config = parse("backend = \"namespace\"\n[namespace]\nagent_path = \"/bin/agent\"\n").unwrap();
        assert_eq!(config.backend, Backend::Namespace);
        assert_eq!(config.namespace.agent_path, PathBuf::from("/bin/agent"));
    }

    #[test]
    fn unknown_key_is_named() {
        let err = parse("backend = \"namespace\"\nbakend = 1\n").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("bakend"), "{text}");
        assert!(text.contains("line 2"), "{text}");
    }

    #[test]
    fn unknown_key_in_table_is_named() {
        let err = parse("[vm]\nvcpu = 2\n").unwrap_err();
        assert!(err.to_string().contains("vcpu"), "{err}");
    }

    #[test]
    fn bad_backend_value_is_an_error() {
        let err = parse("backend = \"firecracker\"\n").unwrap_err();
        assert!(err.to_string().contains("firecracker"), "{err}");
    }

    #[test]
    fn bad_values_name_the_field() {
        let err = parse("[vm]\nvcpus = 0\n").unwrap_err();
        assert!(err.to_string().contains("vm.vcpus"), "{err}");
        let err = parse("[vm]\nvcpus = 33\n").unwrap_err();
        assert!(err.to_string().contains("vm.vcpus"), "{err}");
        for bad in ["jail_id_first = 0", "jail_id_count = 0", "jail_id_first = 4294967000\njail_id_count = 1000"] {
            let err = parse(&format!("[vm]\n{bad}\n")).unwrap_err();
            assert!(err.to_string().contains("jail_id_first/jail_id_count"), "{bad}: {err}");
        }
        let err = parse("[vm]\nkernel_path = \"vmlinux\"\n").unwrap_err();
        assert!(err.to_string().contains("vm.kernel_path"), "{err}");
        let err = parse("state_dir = \"relative\"\n").unwrap_err();
        assert!(err.to_string().contains("state_dir"), "{err}");
        let err = parse("log_level = \"loud\"\n").unwrap_err();
        assert!(err.to_string().contains("log_level"), "{err}");
    }

    #[test]
    fn missing_file_is_a_clear_error() {
        let err = Config::load(Path::new("/nonexistent/bulkhead.toml")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/bulkhead.toml"), "{err}");
    }

    #[test]
    fn example_config_parses() {
        let text = include_str!("../config.example.toml");
        let config = parse(text).unwrap();
        assert_eq!(config.backend, Backend::Namespace);
        assert!(!config.network.allow_metadata);
        assert_eq!(config.vm.start, VmStart::Auto);
        assert_eq!(config.vm, VmSettings { kernel_path: config.vm.kernel_path.clone(), ..VmSettings::default() });
    }

    #[test]
    fn the_template_ceiling_is_checked() {
        let vm = parse("[vm]\ntemplate_max_count = 4\ntemplate_max_size = \"10Gi\"\ntemplate_max_idle_days = 2\n")
            .unwrap()
            .vm;
        assert_eq!((vm.template_max_count, vm.template_max_size.0, vm.template_max_idle_days), (4, 10 << 30, 2));
        for (bad, field) in [
            ("template_max_count = 0", "vm.template_max_count"),
            ("template_max_size = \"1Mi\"", "vm.template_max_size"),
            ("template_max_idle_days = 0", "vm.template_max_idle_days"),
        ] {
            let err = parse(&format!("[vm]\n{bad}\n")).unwrap_err().to_string();
            assert!(err.contains(field), "{bad}: {err}");
        }
    }

    #[test]
    fn vm_start_is_warm_cold_or_auto_and_nothing_else() {
        assert_eq!(parse("").unwrap().vm.start, VmStart::Auto, "warm where the probe says VMX or SVM");
        assert_eq!(parse("[vm]\nstart = \"cold\"\n").unwrap().vm.start, VmStart::Cold);
        assert_eq!(parse("[vm]\nstart = \"warm\"\n").unwrap().vm.start, VmStart::Warm);
        assert!(VmStart::Warm.warm_here() && !VmStart::Cold.warm_here());
        let err = parse("[vm]\nstart = \"sometimes\"\n").unwrap_err().to_string();
        assert!(err.contains("sometimes") && err.contains("warm"), "{err}");
    }

    #[test]
    fn emptydir_limits_are_quantities_within_bounds() {
        let config = parse("").unwrap();
        assert_eq!(config.emptydir, EmptyDirConfig::default(), "unlimited unless configured");
        let config = parse("[emptydir]\ndefault_size_limit = \"1Gi\"\nmax_size_limit = \"100G\"\n").unwrap();
        assert_eq!(config.emptydir.default_size_limit, Some(ByteSize(1 << 30)));
        assert_eq!(config.emptydir.max_size_limit, Some(ByteSize(100_000_000_000)));
        for (bad, named) in [
            ("default_size_limit = \"1 Gi\"", "line 2"),
            ("default_size_limit = 1073741824", "line 2"),
            ("default_size_limit = \"-1Gi\"", "negative"),
            ("max_size_limit = \"500m\"", "milli"),
            ("default_size_limit = \"512Ki\"", "emptydir.default_size_limit"),
            ("max_size_limit = \"17Ti\"", "emptydir.max_size_limit"),
            ("default_size_limit = \"2Gi\"\nmax_size_limit = \"1Gi\"", "emptydir.default_size_limit"),
            ("mkfs_path = \"mkfs.ext4\"", "emptydir.mkfs_path"),
            ("size_limit = \"1Gi\"", "size_limit"),
        ] {
            let err = parse(&format!("[emptydir]\n{bad}\n")).unwrap_err();
            assert!(err.to_string().contains(named), "{bad}: {err}");
        }
    }

    #[test]
    fn metadata_is_blocked_unless_allowed_explicitly() {
        assert!(!parse("").unwrap().network.allow_metadata);
        assert!(parse("[network]\nallow_metadata = true\n").unwrap().network.allow_metadata);
        let err = parse("[network]\nallow_metadata = \"yes\"\n").unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
    }

    #[test]
    fn the_metrics_group_defaults_to_9464_and_is_never_roots() {
        assert_eq!(parse("").unwrap().metrics.gid, 9464);
        assert_eq!(parse("[metrics]\ngid = 1234\n").unwrap().metrics.gid, 1234);
        let err = parse("[metrics]\ngid = 0\n").unwrap_err();
        assert!(err.to_string().contains("metrics.gid"), "{err}");
    }
}

//! Pre-building the `vm` backend's snapshot templates for the node's common pod shapes once an
//! install is complete (warm pods, issue 22), so that the first warm pod of each shape restores
//! instead of building. Off unless shapes are given (`--prebuild-templates`); worth it where pods
//! start warm (`vm.start`). At uninstall every template of the cache goes (`template rm --all`).
//!
//! Each shape is one `bulkhead-ctl template build` of the installed version, run on the host
//! (through `--host-exec`, e.g. nsenter into PID 1's namespaces, as the restart command is) and
//! bounded by [`BUILD_TIMEOUT`]. Best effort: a failure is logged and the install stands (a pod
//! then builds its template on first use, or boots cold). A template already there is returned,
//! not rebuilt, so every converge may ask again; a new release's files give new keys.

use std::time::Duration;

use crate::bounded::Stop;
use crate::error::{Error, Result};
use crate::node_paths::{NodePaths, CTL_BINARY};

/// How long one template build may take (a real guest boots to its agent and its memory is
/// written out; the shim's own bound on a build is 120 s, plus the wait for another build).
pub const BUILD_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a build told to stop (the installer's SIGTERM) may take to remove its VM before it
/// is killed (then the next build of its key removes what is left).
pub const STOP_GRACE: Duration = Duration::from_secs(20);
/// More shapes than this is a typo, not a node's common shapes.
const MAX_SHAPES: usize = 16;
/// More NICs than a pod network gives a VM.
const MAX_NICS: usize = 8;

/// One template to build: the shim config's default shape where a field is `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateShape {
    pub vcpus: Option<u8>,
    pub memory_mib: Option<u32>,
    /// A NIC of each MTU: pods with a network (one per CNI interface); none for host-network pods.
    pub nic_mtus: Vec<u16>,
}

impl TemplateShape {
    /// `bulkhead-ctl` arguments after `--config <file>`.
    pub fn ctl_args(&self) -> Vec<String> {
        let mut args = vec!["template".to_string(), "build".to_string()];
        if let Some(v) = self.vcpus {
            args.extend(["--vcpus".into(), v.to_string()]);
        }
        if let Some(m) = self.memory_mib {
            args.extend(["--memory-mib".into(), m.to_string()]);
        }
        for mtu in &self.nic_mtus {
            args.extend(["--nic-mtu".into(), mtu.to_string()]);
        }
        args
    }
}

/// Parses a comma-separated list of shapes: `default` (the shim config's vCPUs and memory) or
/// `<vCPUs>x<memory MiB>`, each followed by `/<MTU>` for each NIC. `default,default/9001,2x2048/9001`
/// is host-network pods, and pod-network pods (one CNI interface of MTU 9001) of the default
/// shape and of 2 vCPUs with 2048 MiB. An empty list builds nothing.
pub fn parse_shapes(text: &str) -> Result<Vec<TemplateShape>> {
    let bad = |entry: &str, why: &str| Error::Setting(format!("template shape {entry:?}: {why}"));
    let entries: Vec<&str> = text.split(',').map(str::trim).filter(|e| !e.is_empty()).collect();
    if entries.len() > MAX_SHAPES {
        return Err(Error::Setting(format!("{} template shapes; at most {MAX_SHAPES}", entries.len())));
    }
    let mut shapes = Vec::new();
    for entry in entries {
        let mut parts = entry.split('/');
        let base = parts.next().unwrap_or_default();
        let (vcpus, memory_mib) = if base == "default" {
            (None, None)
        } else {
            let (v, m) = base.split_once('x').ok_or_else(|| bad(entry, "expected `default` or <vCPUs>x<MiB>"))?;
            let v: u8 = v.parse().map_err(|_| bad(entry, "vCPUs must be 1..=255"))?;
            let m: u32 = m.parse().map_err(|_| bad(entry, "memory must be a number of MiB"))?;
            if v == 0 || m == 0 {
                return Err(bad(entry, "a VM needs at least one vCPU and 1 MiB"));
            }
            (Some(v), Some(m))
        };
        let nic_mtus = parts
            .map(|mtu| match mtu.parse::<u16>() {
                Ok(mtu) if mtu >= 68 => Ok(mtu),
                _ => Err(bad(entry, "a NIC MTU is 68..=65535")),
            })
            .collect::<Result<Vec<u16>>>()?;
        if nic_mtus.len() > MAX_NICS {
            return Err(bad(entry, &format!("at most {MAX_NICS} NICs")));
        }
        let shape = TemplateShape { vcpus, memory_mib, nic_mtus };
        if !shapes.contains(&shape) {
            shapes.push(shape);
        }
    }
    Ok(shapes)
}

/// The node's snapshot templates, as the installer handles them.
#[derive(Debug, Clone)]
pub struct Templates {
    /// Built once the node is ready.
    pub shapes: Vec<TemplateShape>,
    /// Prefix that runs a command on the host (empty: run it here).
    pub host_exec: Vec<String>,
    /// The bound on each `bulkhead-ctl` run.
    pub timeout: Duration,
}

impl Default for Templates {
    /// No pre-builds; removal at uninstall still runs, bounded.
    fn default() -> Self {
        Self { shapes: Vec::new(), host_exec: Vec::new(), timeout: BUILD_TIMEOUT }
    }
}

impl Templates {
    /// Builds each shape's template with the installed `bulkhead-ctl` and shim config (as the
    /// host sees them); returns how many are there now. Logs each outcome; never fails. Once
    /// `stop` is requested the build under way is asked to end (SIGTERM) and no other starts.
    pub fn prebuild(&self, layout: &NodePaths, stop: &Stop) -> usize {
        let mut ready = 0;
        for shape in &self.shapes {
            if stop.requested() {
                tracing::info!("template pre-builds stopped on request");
                break;
            }
            ready += usize::from(self.ctl(layout, shape.ctl_args(), "template ready", stop));
        }
        ready
    }

    /// At uninstall: removes every template of the installed shim config's cache (pods may have
    /// built some without pre-builds), so no guest memory files stay on the node. Best effort;
    /// nothing to do without an installed `bulkhead-ctl`.
    pub fn remove_all(&self, layout: &NodePaths) {
        if layout.current_link().join(CTL_BINARY).is_file() {
            let args = ["template", "rm", "--all"].map(String::from).to_vec();
            self.ctl(layout, args, "templates removed", &Stop::default());
        }
    }

    /// Runs the installed `bulkhead-ctl --config <installed shim config> <args>` on the host;
    /// whether it succeeded (logged either way).
    fn ctl(&self, layout: &NodePaths, args: Vec<String>, done: &str, stop: &Stop) -> bool {
        let mut argv = self.host_exec.clone();
        argv.extend([layout.view_ctl().display().to_string(), "--config".into()]);
        argv.push(layout.view_shim_config().display().to_string());
        argv.extend(args);
        match crate::bounded::run_stoppable(&argv, self.timeout, true, stop, STOP_GRACE) {
            Ok(finished) if finished.status.success() => {
                tracing::info!(command = ?argv, output = %finished.stdout.trim(), "{done}");
                true
            }
            Ok(finished) => {
                tracing::warn!(
                    command = ?argv, status = %finished.status, stderr = %finished.stderr.trim(),
                    "bulkhead-ctl failed; pods build their template on first use or boot cold"
                );
                false
            }
            Err(e) => {
                tracing::warn!(command = ?argv, error = %e, "bulkhead-ctl failed");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    fn write_exec(path: &Path, text: &str) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A node under `dir` whose installed `bulkhead-ctl` is the shell script `script`.
    fn node_with_ctl(dir: &Path, script: &str) -> NodePaths {
        let layout = NodePaths::new(dir, dir);
        let ctl = layout.view_ctl();
        std::fs::create_dir_all(ctl.parent().unwrap()).unwrap();
        write_exec(&ctl, script);
        layout
    }

    #[test]
    fn shapes_parse_with_their_nics_and_defaults() {
        let shapes = parse_shapes(" default, default/9001 ,2x2048/9001/1500,default").unwrap();
        assert_eq!(
            shapes,
            [
                TemplateShape { vcpus: None, memory_mib: None, nic_mtus: vec![] },
                TemplateShape { vcpus: None, memory_mib: None, nic_mtus: vec![9001] },
                TemplateShape { vcpus: Some(2), memory_mib: Some(2048), nic_mtus: vec![9001, 1500] },
            ],
            "a repeated shape is built once"
        );
        assert_eq!(
            shapes[2].ctl_args(),
            ["template", "build", "--vcpus", "2", "--memory-mib", "2048", "--nic-mtu", "9001", "--nic-mtu", "1500"]
        );
        assert_eq!(shapes[0].ctl_args(), ["template", "build"]);
        assert!(parse_shapes("").unwrap().is_empty());
    }

    #[test]
    fn a_bad_shape_is_named_with_what_is_wrong() {
        for (text, why) in [
            ("2", "expected `default`"),
            ("0x512", "at least one vCPU"),
            ("2x0", "at least one vCPU"),
            ("300x512", "vCPUs must be"),
            ("2xlots", "memory must be"),
            ("default/9", "NIC MTU"),
            ("default/70000", "NIC MTU"),
            ("default/", "NIC MTU"),
            ("default/1500/1500/1500/1500/1500/1500/1500/1500/1500", "at most 8 NICs"),
        ] {
            let err = parse_shapes(text).unwrap_err().to_string();
            assert!(err.contains(why) && err.contains(&format!("{text:?}")), "{text}: {err}");
        }
        let many = vec!["default"; 17].join(",");
        assert!(parse_shapes(&many).unwrap_err().to_string().contains("at most 16"));
    }

    #[test]
    fn each_shape_runs_the_installed_ctl_through_the_host_exec_prefix_and_failures_do_not_stop_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let layout = NodePaths::new(dir.path(), dir.path());
        let calls = dir.path().join("calls");
        // The host-exec prefix is a script that records the command it was given, then runs it.
        let exec = dir.path().join("host-exec");
        write_exec(&exec, &format!("#!/bin/sh\necho \"$*\" >> {}\nexec \"$@\"\n", calls.display()));
        let ctl = layout.view_ctl();
        std::fs::create_dir_all(ctl.parent().unwrap()).unwrap();
        // The 2-vCPU build fails; the others succeed.
        write_exec(
            &ctl,
            "#!/bin/sh\ncase \"$*\" in *--vcpus\\ 2*) echo 'no kvm' >&2; exit 1;; esac\necho \"template k: $*\"\n",
        );
        let prebuild = Templates {
            shapes: parse_shapes("default,2x512,1x256/1500").unwrap(),
            host_exec: vec![exec.display().to_string()],
            timeout: Duration::from_secs(10),
        };
        assert_eq!(prebuild.prebuild(&layout, &Stop::default()), 2);
        let calls = std::fs::read_to_string(&calls).unwrap();
        let lines: Vec<&str> = calls.lines().collect();
        assert_eq!(lines.len(), 3, "{calls}");
        let config = layout.view_shim_config();
        assert_eq!(lines[0], format!("{} --config {} template build", ctl.display(), config.display()));
        assert!(lines[2].ends_with("template build --vcpus 1 --memory-mib 256 --nic-mtu 1500"), "{calls}");
    }

    #[test]
    fn a_stop_ends_the_build_under_way_and_starts_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let calls = dir.path().join("calls");
        // Each build records its start, and its SIGTERM when it gets one.
        let script = format!(
            "#!/bin/sh\necho start >> {0}\ntrap 'echo term >> {0}; exit 1' TERM\nsleep 30 & wait\n",
            calls.display()
        );
        let layout = node_with_ctl(dir.path(), &script);
        let prebuild = Templates {
            shapes: parse_shapes("default,2x512").unwrap(),
            host_exec: vec![],
            timeout: Duration::from_secs(60),
        };
        let stop = Stop::default();
        let asked = stop.clone();
        let calls_seen = calls.clone();
        std::thread::spawn(move || {
            while !std::fs::read_to_string(&calls_seen).is_ok_and(|c| c.contains("start")) {
                std::thread::sleep(Duration::from_millis(20));
            }
            asked.request();
        });
        let started = std::time::Instant::now();
        assert_eq!(prebuild.prebuild(&layout, &stop), 0);
        assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
        assert_eq!(std::fs::read_to_string(&calls).unwrap(), "start\nterm\n", "one build, stopped; none after it");
    }

    #[test]
    fn a_build_that_hangs_is_cut_at_its_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let layout = node_with_ctl(dir.path(), "#!/bin/sh\nexec sleep 30\n");
        let prebuild = Templates {
            shapes: parse_shapes("default").unwrap(),
            host_exec: vec![],
            timeout: Duration::from_millis(300),
        };
        let started = std::time::Instant::now();
        assert_eq!(prebuild.prebuild(&layout, &Stop::default()), 0);
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}

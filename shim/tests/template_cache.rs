//! The snapshot template cache (issue 22's template manager): keying, atomic publication, one
//! build for many pods, and what happens to a corrupt template. The builder here writes files
//! shaped like a VMM snapshot (a small state file, a larger memory file); booting a real VM into
//! a template is the builder's job and is tested with it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bulkhead_shim::sandbox::vm::template::{
    backoff, build, build_unless, obtain, obtain_at, ColdReason, KeyInputs, KeySources, Listed, Lookup, Obtained,
    TemplateBuilder, TemplateStore, BACKOFF_BASE, BUILD_TIMEOUT,
};
use bulkhead_vmm_api::memory::Mib;

/// Larger than what a lookup hashes, as guest memory is.
const MEMORY_BYTES: usize = 5 << 20;

struct FakeBuilder {
    builds: AtomicUsize,
    delay: Duration,
    fail: bool,
}

impl FakeBuilder {
    fn new(delay: Duration) -> Arc<Self> {
        Arc::new(Self { builds: AtomicUsize::new(0), delay, fail: false })
    }

    fn failing() -> Arc<Self> {
        Arc::new(Self { builds: AtomicUsize::new(0), delay: Duration::ZERO, fail: true })
    }
}

#[async_trait]
impl TemplateBuilder for FakeBuilder {
    async fn build(&self, inputs: &KeyInputs, dir: &Path) -> Result<(), String> {
        self.builds.fetch_add(1, Ordering::SeqCst);
        std::fs::write(dir.join("state"), format!("vcpus={} memory={}", inputs.vcpus, inputs.memory_mib.get()))
            .unwrap();
        tokio::time::sleep(self.delay).await;
        if self.fail {
            return Err("the VM did not reach agent-ready".into());
        }
        std::fs::write(dir.join("memory"), vec![7u8; MEMORY_BYTES]).unwrap();
        Ok(())
    }

    async fn discard(&self, _: &KeyInputs) {}
}

struct Fixture {
    _dir: tempfile::TempDir,
    store: TemplateStore,
    inputs: KeyInputs,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    for name in ["vmlinux", "initramfs", "bulkhead-vmm"] {
        std::fs::write(dir.path().join(name), name).unwrap();
    }
    let store = TemplateStore::open(&dir.path().join("templates")).unwrap();
    let sources = KeySources {
        kernel: &dir.path().join("vmlinux"),
        initramfs: &dir.path().join("initramfs"),
        vmm: &dir.path().join("bulkhead-vmm"),
        vcpus: 1,
        memory_mib: Mib(256),
        nic_mtus: &[],
    };
    let inputs = KeyInputs::of(&sources, Some(&store.digests_dir())).unwrap();
    Fixture { _dir: dir, store, inputs }
}

const WAIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn a_built_template_is_sealed_read_only_and_found_by_its_key() {
    let f = fixture();
    let builder = FakeBuilder::new(Duration::ZERO);
    let Obtained::Built(t) = obtain(&f.store, &f.inputs, builder.as_ref(), WAIT).await else { panic!("not built") };
    assert_eq!(t.key, f.inputs.key());
    assert_eq!(t.dir, f.store.root().join(t.key.as_str()));
    let names: Vec<&str> = t.manifest.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["memory", "state"]);
    for file in ["memory", "state", "template.json"] {
        let meta = std::fs::metadata(t.dir.join(file)).unwrap();
        assert_eq!(meta.uid(), nix::unistd::geteuid().as_raw(), "{file}");
        assert_eq!(meta.permissions().mode() & 0o777, 0o400, "{file} is read-only, and its owner's alone");
    }
    for dir in [f.store.root(), t.dir.as_path()] {
        let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", dir.display());
    }
    let Obtained::Ready(again) = obtain(&f.store, &f.inputs, builder.as_ref(), WAIT).await else { panic!("not ready") };
    assert_eq!(again, t);
    assert_eq!(builder.builds.load(Ordering::SeqCst), 1);
    let staging_left = std::fs::read_dir(f.store.root())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with(".staging-"))
        .count();
    assert_eq!(staging_left, 0);
}

/// Runs `f` on a thread of its own whose credentials are nobody's, no groups (raw system calls
/// change only the calling thread's; glibc's wrappers would change every thread's).
fn as_nobody<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        // SAFETY: raw setgroups/setresgid/setresuid on this thread only, with plain integers and
        // no list; every result is checked.
        unsafe {
            assert_eq!(libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()), 0);
            assert_eq!(libc::syscall(libc::SYS_setresgid, 65534, 65534, 65534), 0);
            assert_eq!(libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534), 0);
        }
        f()
    })
    .join()
    .unwrap()
}

/// A template's memory image holds what every warm pod of its key shares: no local user but
/// root reads it, wherever the store lives and whatever the umask was.
#[tokio::test]
async fn nobody_can_read_a_template() {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED: nobody_can_read_a_template: needs root");
        return;
    }
    let f = fixture();
    // Every directory above the store open to all, as /var/lib is.
    std::fs::set_permissions(f._dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let Obtained::Built(t) = obtain(&f.store, &f.inputs, FakeBuilder::new(Duration::ZERO).as_ref(), WAIT).await else {
        panic!("not built")
    };
    let (root, dir) = (f.store.root().to_path_buf(), t.dir.clone());
    let (listed_root, listed, read) = as_nobody(move || {
        (std::fs::read_dir(&root).is_ok(), std::fs::read_dir(&dir).is_ok(), std::fs::read(dir.join("memory")).is_ok())
    });
    assert!(
        !listed_root && !listed && !read,
        "nobody listed the store ({listed_root}), the template ({listed}) or read its memory ({read})"
    );
    // Even reached past the directories (a descriptor leaked, a bind mount), the files are root's alone.
    let memory = std::fs::metadata(t.dir.join("memory")).unwrap();
    assert_eq!(memory.permissions().mode() & 0o077, 0);
}

/// A builder that never finishes; says whether the key was locked when its VM was discarded.
struct Hung {
    store_root: std::path::PathBuf,
    discarded_locked: std::sync::Mutex<Vec<bool>>,
}

#[async_trait]
impl TemplateBuilder for Hung {
    async fn build(&self, _: &KeyInputs, _: &Path) -> Result<(), String> {
        tokio::time::sleep(BUILD_TIMEOUT * 2).await;
        Ok(())
    }

    async fn discard(&self, inputs: &KeyInputs) {
        // flock locks conflict between open files of one process too.
        let free = TemplateStore::open(&self.store_root).unwrap().try_lock(&inputs.key()).unwrap().is_some();
        self.discarded_locked.lock().unwrap().push(!free);
    }
}

/// A build still running at the store's bound is cut: its VM is discarded while the key is still
/// locked, and nothing of it is published or staged. (Paused time: the 300 s pass at once.)
#[tokio::test(start_paused = true)]
async fn a_build_past_its_bound_is_discarded_under_the_lock_and_leaves_nothing() {
    let f = fixture();
    let hung = Hung { store_root: f.store.root().to_path_buf(), discarded_locked: Default::default() };
    let err = build(&f.store, &f.inputs, &hung, WAIT).await.unwrap_err().to_string();
    assert!(err.contains("not done within"), "{err}");
    assert_eq!(*hung.discarded_locked.lock().unwrap(), [true], "one discard, under the key's lock");
    assert!(matches!(f.store.lookup(&f.inputs.key()), Lookup::Missing));
    let left: Vec<_> = std::fs::read_dir(f.store.root())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".staging-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(f.store.try_lock(&f.inputs.key()).unwrap().is_some(), "the lock went with the build");
}

/// A build told to stop (ctl's SIGTERM) ends at once the same way, saying why.
#[tokio::test(start_paused = true)]
async fn a_build_told_to_stop_is_discarded_under_the_lock_and_says_why() {
    let f = fixture();
    let hung = Hung { store_root: f.store.root().to_path_buf(), discarded_locked: Default::default() };
    let stop = async {
        tokio::time::sleep(Duration::from_secs(10)).await;
        "SIGTERM".to_string()
    };
    let err = build_unless(&f.store, &f.inputs, &hung, WAIT, stop).await.unwrap_err().to_string();
    assert!(err.contains("SIGTERM") && err.contains("stopped before it published"), "{err}");
    assert_eq!(*hung.discarded_locked.lock().unwrap(), [true]);
    assert!(matches!(f.store.lookup(&f.inputs.key()), Lookup::Missing));
    assert!(f.store.try_lock(&f.inputs.key()).unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_pods_asking_at_once_cause_one_build() {
    let f = Arc::new(fixture());
    let builder = FakeBuilder::new(Duration::from_millis(400));
    let mut pods = Vec::new();
    for _ in 0..5 {
        let (f, builder) = (f.clone(), builder.clone());
        pods.push(tokio::spawn(async move { obtain(&f.store, &f.inputs, builder.as_ref(), WAIT).await }));
    }
    let (mut built, mut ready) = (0, 0);
    for pod in pods {
        match pod.await.unwrap() {
            Obtained::Built(_) => built += 1,
            Obtained::Ready(_) => ready += 1,
            Obtained::Cold(why) => panic!("a pod booted cold: {why}"),
        }
    }
    assert_eq!((built, ready), (1, 4));
    assert_eq!(builder.builds.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_pod_that_cannot_wait_for_another_build_boots_cold() {
    let f = Arc::new(fixture());
    let slow = FakeBuilder::new(Duration::from_secs(3));
    let building = {
        let (f, slow) = (f.clone(), slow.clone());
        tokio::spawn(async move { obtain(&f.store, &f.inputs, slow.as_ref(), WAIT).await })
    };
    while slow.builds.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let impatient = FakeBuilder::new(Duration::ZERO);
    let got = obtain(&f.store, &f.inputs, impatient.as_ref(), Duration::from_millis(100)).await;
    assert!(matches!(got, Obtained::Cold(ColdReason::StillBuilding { .. })), "{got:?}");
    assert_eq!(impatient.builds.load(Ordering::SeqCst), 0);
    assert!(matches!(building.await.unwrap(), Obtained::Built(_)));
}

#[tokio::test]
async fn a_failed_build_leaves_nothing_and_its_waiters_boot_cold_without_building_again() {
    let f = Arc::new(fixture());
    let failing = Arc::new(FakeBuilder { builds: AtomicUsize::new(0), delay: Duration::from_millis(300), fail: true });
    let first = {
        let (f, failing) = (f.clone(), failing.clone());
        tokio::spawn(async move { obtain(&f.store, &f.inputs, failing.as_ref(), WAIT).await })
    };
    while failing.builds.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let waiter = FakeBuilder::new(Duration::ZERO);
    let second = obtain(&f.store, &f.inputs, waiter.as_ref(), WAIT).await;
    assert!(matches!(second, Obtained::Cold(ColdReason::BuiltElsewhereFailed)), "{second:?}");
    let first = first.await.unwrap();
    assert!(
        matches!(&first, Obtained::Cold(ColdReason::BuildFailed { error }) if error.contains("agent-ready")),
        "{first:?}"
    );
    assert_eq!(waiter.builds.load(Ordering::SeqCst), 0);
    assert!(matches!(f.store.lookup(&f.inputs.key()), Lookup::Missing));
    assert!(f.store.list().unwrap().is_empty(), "no staging directory left: {:?}", f.store.list().unwrap());
    // A later pod boots cold at once; one after the backoff tries again.
    let later = FakeBuilder::new(Duration::ZERO);
    let got = obtain(&f.store, &f.inputs, later.as_ref(), WAIT).await;
    assert!(matches!(got, Obtained::Cold(ColdReason::BackingOff { .. })), "{got:?}");
    let after_backoff = SystemTime::now() + BACKOFF_BASE + Duration::from_secs(1);
    assert!(matches!(obtain_at(&f.store, &f.inputs, later.as_ref(), WAIT, after_backoff).await, Obtained::Built(_)));
}

/// After a failed build, pods of the key boot cold at once, without waiting and without building,
/// and say why; once the backoff has passed a pod builds again, each failure in a row doubling the
/// backoff; a build that publishes clears the record. (The time is handed in: no test waits
/// minutes.)
#[tokio::test]
async fn after_a_failed_build_pods_boot_cold_at_once_until_the_backoff_has_passed() {
    let f = fixture();
    let key = f.inputs.key();
    let failing = FakeBuilder::failing();
    let got = obtain(&f.store, &f.inputs, failing.as_ref(), WAIT).await;
    assert!(matches!(got, Obtained::Cold(ColdReason::BuildFailed { .. })), "{got:?}");
    let recorded = backoff::last(&f.store, &key).expect("the failure is recorded");
    assert_eq!(recorded.failures, 1);
    assert!(recorded.error.contains("agent-ready"), "{recorded:?}");

    // The next pods: cold at once, no build, no wait for the key's lock; the log line says why.
    let good = FakeBuilder::new(Duration::ZERO);
    let held = f.store.try_lock(&key).unwrap().expect("free");
    for _ in 0..3 {
        let got = obtain(&f.store, &f.inputs, good.as_ref(), WAIT).await;
        let Obtained::Cold(why @ ColdReason::BackingOff { failures: 1, .. }) = got else { panic!("{got:?}") };
        let said = why.to_string();
        assert!(said.contains("template build failed") && said.contains("next try in"), "{said}");
        assert!(!why.wants_rebuild());
    }
    assert_eq!(good.builds.load(Ordering::SeqCst), 0);
    drop(held);

    // Past the first backoff a pod builds again; it fails again and the backoff doubles.
    let t0 = SystemTime::now();
    let later = t0 + BACKOFF_BASE + Duration::from_secs(1);
    let got = obtain_at(&f.store, &f.inputs, failing.as_ref(), WAIT, later).await;
    assert!(matches!(got, Obtained::Cold(ColdReason::BuildFailed { .. })), "{got:?}");
    assert_eq!(failing.builds.load(Ordering::SeqCst), 2);
    assert_eq!(backoff::last(&f.store, &key).unwrap().failures, 2);
    let got = obtain_at(&f.store, &f.inputs, good.as_ref(), WAIT, later).await;
    assert!(matches!(got, Obtained::Cold(ColdReason::BackingOff { failures: 2, .. })), "{got:?}");
    assert_eq!(good.builds.load(Ordering::SeqCst), 0);

    // Past that one a build publishes, the record goes, and pods are warm.
    let much_later = t0 + 2 * BACKOFF_BASE + Duration::from_secs(2);
    let got = obtain_at(&f.store, &f.inputs, good.as_ref(), WAIT, much_later).await;
    assert!(matches!(got, Obtained::Built(_)), "{got:?}");
    assert_eq!(backoff::last(&f.store, &key), None, "a published build clears the record");
    assert!(matches!(obtain(&f.store, &f.inputs, good.as_ref(), WAIT).await, Obtained::Ready(_)));
}

/// An operator's `bulkhead-ctl template build` is not held off, and its success clears the record.
#[tokio::test]
async fn an_explicit_build_ignores_the_backoff_and_clears_it() {
    let f = fixture();
    let got = obtain(&f.store, &f.inputs, FakeBuilder::failing().as_ref(), WAIT).await;
    assert!(matches!(got, Obtained::Cold(ColdReason::BuildFailed { .. })), "{got:?}");
    let good = FakeBuilder::new(Duration::ZERO);
    build(&f.store, &f.inputs, good.as_ref(), WAIT).await.unwrap();
    assert_eq!(backoff::last(&f.store, &f.inputs.key()), None);
    assert!(matches!(obtain(&f.store, &f.inputs, good.as_ref(), WAIT).await, Obtained::Ready(_)));
}

/// A builder process killed mid-build (SIGKILL, holding the key's flock and having written part
/// of a snapshot) leaves a staging directory that no lookup loads; the next pod is not blocked
/// by the dead lock, sweeps the remains, and builds.
#[tokio::test]
async fn a_build_killed_midway_leaves_no_template_that_loads() {
    let f = fixture();
    let key = f.inputs.key();
    let lock = f.store.root().join(".locks").join(format!("{key}.lock"));
    let staging = f.store.root().join(format!(".staging-{key}-999999-1"));
    let script = format!(
        "mkdir {s} && head -c 1000 /dev/zero > {s}/memory && echo partial > {s}/state && echo ready && exec sleep 600",
        s = staging.display()
    );
    // flock(1) holds the lock (-o: its command does not inherit it), in a process group of its
    // own so that the whole build dies at once.
    let mut child = Command::new("flock")
        .arg("-o")
        .arg(&lock)
        .args(["sh", "-c", &script])
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("util-linux flock");
    let mut ready = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut ready).unwrap();
    assert_eq!(ready.trim(), "ready");
    assert!(f.store.try_lock(&key).unwrap().is_none(), "the builder holds the lock");
    assert!(matches!(f.store.lookup(&key), Lookup::Missing), "a build in progress is not a template");
    assert!(matches!(f.store.list().unwrap().as_slice(), [Listed::Building { pid: 999999, .. }]));
    nix::sys::signal::killpg(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    child.wait().unwrap();
    let builder = FakeBuilder::new(Duration::ZERO);
    let got = obtain(&f.store, &f.inputs, builder.as_ref(), WAIT).await;
    assert!(matches!(got, Obtained::Built(_)), "{got:?}");
    assert!(!staging.exists(), "the dead build's staging directory was swept");
}

/// Each way a template can go bad makes the next pod boot cold and moves it aside; a rebuild
/// then serves the pod after.
#[tokio::test]
async fn a_corrupt_template_leads_to_a_cold_boot_and_a_rebuild() {
    type Corrupt = fn(&Path);
    let cases: [(&str, Corrupt, &str); 7] = [
        ("flipped byte in a small file", |d| flip(&d.join("state")), "digest"),
        ("truncated memory", |d| truncate(&d.join("memory"), 4096), "bytes"),
        ("a file missing", |d| std::fs::remove_file(d.join("state")).unwrap(), "missing"),
        ("an unexpected file", |d| std::fs::write(d.join("extra"), "x").unwrap(), "unexpected"),
        (
            "a writable file",
            |d| std::fs::set_permissions(d.join("state"), PermissionsExt::from_mode(0o666)).unwrap(),
            "writable",
        ),
        (
            "a link in place of a file",
            |d| {
                std::fs::remove_file(d.join("state")).unwrap();
                std::os::unix::fs::symlink("/etc/hostname", d.join("state")).unwrap();
            },
            "state",
        ),
        (
            "a manifest that is not JSON",
            |d| {
                let m = d.join("template.json");
                std::fs::set_permissions(&m, PermissionsExt::from_mode(0o644)).unwrap();
                std::fs::write(&m, "{").unwrap();
                std::fs::set_permissions(&m, PermissionsExt::from_mode(0o444)).unwrap();
            },
            "template.json",
        ),
    ];
    for (what, corrupt, says) in cases {
        let f = fixture();
        let builder = FakeBuilder::new(Duration::ZERO);
        let Obtained::Built(t) = obtain(&f.store, &f.inputs, builder.as_ref(), WAIT).await else { panic!("{what}") };
        corrupt(&t.dir);
        let got = obtain(&f.store, &f.inputs, builder.as_ref(), WAIT).await;
        let Obtained::Cold(why) = got else { panic!("{what}: {got:?}") };
        assert!(why.wants_rebuild(), "{what}: {why}");
        assert!(why.to_string().contains(says), "{what}: {why}");
        assert!(!t.dir.exists(), "{what}: moved aside");
        let quarantined: Vec<_> = std::fs::read_dir(f.store.root().join(".quarantine")).unwrap().collect();
        assert_eq!(quarantined.len(), 1, "{what}");
        let reason = quarantined[0].as_ref().unwrap().path().join("reason.txt");
        assert!(std::fs::read_to_string(reason).unwrap().contains(says), "{what}");
        // The background rebuild, then a warm pod.
        build(&f.store, &f.inputs, builder.as_ref(), WAIT).await.unwrap();
        assert!(matches!(obtain(&f.store, &f.inputs, builder.as_ref(), WAIT).await, Obtained::Ready(_)), "{what}");
        assert_eq!(builder.builds.load(Ordering::SeqCst), 2, "{what}");
    }
}

#[tokio::test]
async fn a_template_of_other_inputs_is_not_restored() {
    let f = fixture();
    let builder = FakeBuilder::new(Duration::ZERO);
    let Obtained::Built(t) = obtain(&f.store, &f.inputs, builder.as_ref(), WAIT).await else { panic!() };
    // Another shape's key: the first template is not it.
    let mut bigger = f.inputs.clone();
    bigger.memory_mib = Mib(512);
    assert!(matches!(f.store.lookup(&bigger.key()), Lookup::Missing));
    // A template directory renamed to another key fails its manifest check.
    std::fs::rename(&t.dir, f.store.root().join(bigger.key().as_str())).unwrap();
    let Lookup::Unusable { reason } = f.store.lookup(&bigger.key()) else { panic!("renamed template loaded") };
    assert!(reason.contains("do not give"), "{reason}");
}

#[test]
fn a_store_root_others_can_write_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("templates");
    std::fs::create_dir(&root).unwrap();
    std::fs::set_permissions(&root, PermissionsExt::from_mode(0o777)).unwrap();
    let err = TemplateStore::open(&root).unwrap_err().to_string();
    assert!(err.contains("writable by no one else"), "{err}");
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(dir.path(), &link).unwrap();
    let err = TemplateStore::open(&link).unwrap_err().to_string();
    assert!(err.contains("a link"), "{err}");
}

fn flip(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[0] ^= 0xff;
    std::fs::set_permissions(path, PermissionsExt::from_mode(0o644)).unwrap();
    std::fs::write(path, bytes).unwrap();
    std::fs::set_permissions(path, PermissionsExt::from_mode(0o444)).unwrap();
}

fn truncate(path: &Path, len: u64) {
    std::fs::set_permissions(path, PermissionsExt::from_mode(0o644)).unwrap();
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len).unwrap();
    std::fs::set_permissions(path, PermissionsExt::from_mode(0o444)).unwrap();
}

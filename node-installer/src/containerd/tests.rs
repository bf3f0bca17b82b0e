use super::*;

fn scratch(config: &str) -> (tempfile::TempDir, NodePaths) {
    let d = tempfile::tempdir().unwrap();
    fs::create_dir_all(d.path().join("etc/containerd")).unwrap();
    fs::create_dir_all(d.path().join("opt")).unwrap();
    fs::write(d.path().join("etc/containerd/config.toml"), config).unwrap();
    let l = NodePaths::new(d.path(), d.path());
    (d, l)
}

fn files(root: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = vec![];
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                out.push((p.clone(), vec![]));
                stack.push(p);
            } else {
                out.push((p.clone(), fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

const V3: &str = "version = 3\n\n[plugins.'io.containerd.cri.v1.images']\n  snapshotter = \"overlayfs\"\n";

#[test]
fn v3_install_writes_dropin_and_import_then_uninstall_restores_bytes() {
    let (d, l) = scratch(V3);
    let before = files(d.path());
    let fp = FailPoints::none();
    assert_eq!(install(&l, &fp).unwrap(), ConfigVersion::V3);
    let dropin = d.path().join("etc/containerd/conf.d").join(DROPIN_NAME);
    let text = fs::read_to_string(&dropin).unwrap();
    assert!(text.contains("[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.bulkhead]"), "{text}");
    assert!(!text.contains("io.containerd.grpc.v1.cri"), "v3 drop-in must not use the 1.x plugin id");
    let cfg = fs::read_to_string(l.config_file()).unwrap();
    let doc = imports::parse(&cfg).unwrap();
    assert_eq!(imports::list(&doc), vec![dropin.display().to_string()]);
    assert!(cfg.ends_with(V3.split_once('\n').unwrap().1), "user's settings kept verbatim: {cfg}");
    assert!(restart_pending(&l));
    clear_restart_pending(&l).unwrap();

    // Second run: nothing to do.
    install(&l, &fp).unwrap();
    assert!(!restart_pending(&l));

    uninstall(&l, &fp).unwrap();
    assert!(restart_pending(&l));
    fs::remove_dir_all(l.install_dir()).unwrap();
    assert_eq!(files(d.path()), before);
}

#[test]
fn v3_glob_import_dir_is_reused_without_touching_config() {
    let cfg = "version = 3\nimports = [\"/etc/containerd/config.d/*.toml\"]\n";
    let (d, mut l) = scratch(cfg);
    l.view_root = PathBuf::from("/");
    // view "/" maps to host root d: host_from_view strips "/".
    install(&l, &FailPoints::none()).unwrap();
    assert!(d.path().join("etc/containerd/config.d").join(DROPIN_NAME).exists());
    assert_eq!(fs::read_to_string(l.config_file()).unwrap(), cfg);
    assert!(!StateFiles::new(&l).backup.exists());
    uninstall(&l, &FailPoints::none()).unwrap();
    assert!(!d.path().join("etc/containerd/config.d").exists(), "directory we created is removed");
    assert_eq!(fs::read_to_string(l.config_file()).unwrap(), cfg);
}

#[test]
fn v3_shim_path_in_dropin_uses_view_root() {
    let (_d, mut l) = scratch(V3);
    l.view_root = PathBuf::from("/");
    install(&l, &FailPoints::none()).unwrap();
    let text = fs::read_to_string(l.host(Path::new("/etc/containerd/conf.d")).join(DROPIN_NAME)).unwrap();
    assert!(text.contains("runtime_path = \"/opt/bulkhead/current/containerd-shim-bulkhead-v2\""), "{text}");
    assert!(!text.contains("ConfigPath"), "the shim finds the installed config itself: {text}");
    let cfg = fs::read_to_string(l.config_file()).unwrap();
    assert!(cfg.contains("imports = [\"/etc/containerd/conf.d/zz-bulkhead.toml\"]"), "{cfg}");
}

#[test]
fn v2_dropin_mirrors_cri_table_of_main_and_later_imports() {
    let main = "version = 2\nimports = [\"/etc/containerd/extra/*.toml\"]\n\
                [plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"main\"\n";
    let (d, mut l) = scratch(main);
    l.view_root = PathBuf::from("/");
    fs::create_dir_all(d.path().join("etc/containerd/extra")).unwrap();
    fs::write(
        d.path().join("etc/containerd/extra/a.toml"),
        "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"import\"\n",
    )
    .unwrap();
    install(&l, &FailPoints::none()).unwrap();
    // Covered by the glob: lands in extra/ and needs no config edit.
    let text = fs::read_to_string(d.path().join("etc/containerd/extra").join(DROPIN_NAME)).unwrap();
    assert!(text.contains("sandbox_image = \"import\""), "{text}");
    assert_eq!(fs::read_to_string(l.config_file()).unwrap(), main);
}

#[test]
fn user_edit_after_install_is_kept_on_uninstall() {
    let (_d, l) = scratch(V3);
    install(&l, &FailPoints::none()).unwrap();
    let cfg = l.config_file();
    let edited = format!("{}\n[debug]\n  level = \"debug\"\n", fs::read_to_string(&cfg).unwrap());
    fs::write(&cfg, &edited).unwrap();
    uninstall(&l, &FailPoints::none()).unwrap();
    let after = fs::read_to_string(&cfg).unwrap();
    assert_eq!(after, format!("{}\n[debug]\n  level = \"debug\"\n", V3));
}

#[test]
fn unsupported_versions_are_refused_with_reason() {
    for (cfg, want) in [("root = \"/x\"\n", "no `version`"), ("version = 1\n", "version 1")] {
        let (_d, l) = scratch(cfg);
        let err = install(&l, &FailPoints::none()).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
}

#[test]
fn missing_config_is_an_error_not_a_new_file() {
    let d = tempfile::tempdir().unwrap();
    let l = NodePaths::new(d.path(), d.path());
    assert!(install(&l, &FailPoints::none()).is_err());
    assert!(!l.config_file().exists());
}

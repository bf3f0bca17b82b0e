//! Rendering of the drop-in file that registers the `bulkhead` runtime handler.
//!
//! Version 2 (containerd 1.6/1.7): containerd merges imports per plugin, *replacing* a plugin's whole table
//! (containerd/containerd#5837; measured on 1.6.20: a drop-in holding only our runtime drops the user's
//! sandbox_image, restrict_oom_score_adj and even the default `runc` runtime). So the v2 drop-in carries the
//! effective CRI table of the user's files, unchanged, plus our runtime.
//!
//! Version 3 (containerd 2.x): plugin tables are merged key by key, so the drop-in holds only our runtime.

use toml::{Table, Value};

use super::ConfigVersion;

pub const HEADER: &str = "# Managed by bulkhead-node-installer; removed on uninstall. Do not edit:\n\
# the installer rewrites this file when the CRI settings it mirrors change.\n";

/// What the handler needs, as containerd sees the paths.
#[derive(Clone, Debug)]
pub struct RuntimeEntry {
    pub handler: String,
    pub shim_path: String,
    pub config_path: String,
}

fn table(pairs: Vec<(&str, Value)>) -> Table {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

fn runtime_table(version: ConfigVersion, e: &RuntimeEntry) -> Table {
    let runtime_type = match version {
        // containerd 1.6.20 ignores runtime_path; an absolute path in runtime_type is exec'd as is.
        ConfigVersion::V2 => e.shim_path.clone(),
        ConfigVersion::V3 => "io.containerd.bulkhead.v2".to_string(),
    };
    let mut t = table(vec![
        ("runtime_type", Value::String(runtime_type)),
        // 1.7 and 2.x honour runtime_path; 1.6 accepts and ignores it.
        ("runtime_path", Value::String(e.shim_path.clone())),
        // A VM must not receive every host device when a pod is privileged.
        ("privileged_without_host_devices", Value::Boolean(true)),
        ("pod_annotations", Value::Array(vec![Value::String("bulkhead.io/*".into())])),
    ]);
    // containerd 2.x starts a user-namespaced (hostUsers: false) container only on a handler without runtime
    // options: it writes the console's owner into them as runc's, and fails on any other type. The shim reads
    // the installed release's config by itself when none is named, so 2.x gets no options where that is the one.
    let shim_finds_it = e.config_path == crate::node_paths::SHIM_DEFAULT_CONFIG;
    if version == ConfigVersion::V2 || !shim_finds_it {
        t.insert("options".into(), Value::Table(table(vec![("ConfigPath", Value::String(e.config_path.clone()))])));
    }
    if version == ConfigVersion::V3 {
        t.insert("sandboxer".into(), Value::String("podsandbox".into()));
    }
    t
}

fn child<'a>(t: &'a mut Table, key: &str) -> Result<&'a mut Table, String> {
    t.entry(key.to_string())
        .or_insert_with(|| Value::Table(Table::new()))
        .as_table_mut()
        .ok_or_else(|| format!("{key} is not a table"))
}

/// `effective_cri`: for version 2, the CRI plugin table as containerd would see it without us (None if the user
/// sets nothing). Ignored for version 3.
pub fn render(version: ConfigVersion, effective_cri: Option<&Table>, e: &RuntimeEntry) -> Result<String, String> {
    let mut plugin = match version {
        ConfigVersion::V2 => effective_cri.cloned().unwrap_or_default(),
        ConfigVersion::V3 => Table::new(),
    };
    let default_runtime = plugin
        .get("containerd")
        .and_then(|c| c.get("default_runtime_name"))
        .and_then(Value::as_str)
        .unwrap_or("runc")
        .to_string();
    let ctd = child(&mut plugin, "containerd")?;
    let had_runtimes = ctd.contains_key("runtimes");
    let runtimes = child(ctd, "runtimes")?;
    if version == ConfigVersion::V2 && !had_runtimes && default_runtime == "runc" {
        // The user relied on containerd's built-in runc; our runtimes table would replace it, so restate it.
        runtimes.insert(
            "runc".into(),
            Value::Table(table(vec![("runtime_type", Value::String("io.containerd.runc.v2".into()))])),
        );
    }
    runtimes.insert(e.handler.clone(), Value::Table(runtime_table(version, e)));
    let mut plugins = Table::new();
    plugins.insert(version.cri_runtime_plugin().into(), Value::Table(plugin));
    let doc = table(vec![("version", Value::Integer(version.number())), ("plugins", Value::Table(plugins))]);
    let body = toml::to_string(&doc).map_err(|e| format!("render drop-in: {e}"))?;
    Ok(format!("{HEADER}{body}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> RuntimeEntry {
        RuntimeEntry {
            handler: "bulkhead".into(),
            shim_path: "/opt/bulkhead/current/containerd-shim-bulkhead-v2".into(),
            config_path: "/opt/bulkhead/current/config.toml".into(),
        }
    }

    fn runtime<'a>(doc: &'a Table, plugin: &str, name: &str) -> Option<&'a Value> {
        doc.get("plugins")?.get(plugin)?.get("containerd")?.get("runtimes")?.get(name)
    }

    #[test]
    fn v3_dropin_holds_only_our_runtime_under_the_2x_plugin() {
        let text = render(ConfigVersion::V3, None, &entry()).unwrap();
        assert!(text.starts_with(HEADER));
        let doc: Table = text.parse().unwrap();
        assert_eq!(doc.get("version").and_then(Value::as_integer), Some(3));
        let plugins = doc.get("plugins").and_then(Value::as_table).unwrap();
        assert_eq!(plugins.keys().collect::<Vec<_>>(), vec!["io.containerd.cri.v1.runtime"]);
        let rt = runtime(&doc, "io.containerd.cri.v1.runtime", "bulkhead").unwrap();
        assert_eq!(rt.get("runtime_type").and_then(Value::as_str), Some("io.containerd.bulkhead.v2"));
        assert_eq!(rt.get("runtime_path").and_then(Value::as_str), Some(entry().shim_path.as_str()));
        assert_eq!(rt.get("sandboxer").and_then(Value::as_str), Some("podsandbox"));
        // No options: the shim finds the installed config itself, and 2.x runs hostUsers: false pods only so.
        assert!(rt.get("options").is_none(), "{text}");
        let elsewhere = RuntimeEntry { config_path: "/etc/bulkhead/config.toml".into(), ..entry() };
        let doc: Table = render(ConfigVersion::V3, None, &elsewhere).unwrap().parse().unwrap();
        let rt = runtime(&doc, "io.containerd.cri.v1.runtime", "bulkhead").unwrap();
        assert_eq!(
            rt.get("options").and_then(|o| o.get("ConfigPath")).and_then(Value::as_str),
            Some("/etc/bulkhead/config.toml"),
            "a config the shim would not find is named"
        );
        // Deep merge in 2.x: restating runc would override the user's runc options, so v3 never does.
        assert!(runtime(&doc, "io.containerd.cri.v1.runtime", "runc").is_none());
        let cri = plugins.get("io.containerd.cri.v1.runtime").unwrap().as_table().unwrap();
        assert_eq!(cri.keys().collect::<Vec<_>>(), vec!["containerd"]);
    }

    #[test]
    fn the_config_the_shim_finds_by_itself_is_the_shims_own_default() {
        assert_eq!(crate::node_paths::SHIM_DEFAULT_CONFIG, bulkhead_shim::config::INSTALLED_CONFIG_PATH);
    }

    #[test]
    fn v3_ignores_effective_table() {
        let user: Table = "sandbox_image = \"x\"".parse().unwrap();
        assert_eq!(render(ConfigVersion::V3, Some(&user), &entry()), render(ConfigVersion::V3, None, &entry()));
    }

    #[test]
    fn v3_rendering_is_stable_and_parses_as_containerd_2_config() {
        let a = render(ConfigVersion::V3, None, &entry()).unwrap();
        assert_eq!(a, render(ConfigVersion::V3, None, &entry()).unwrap());
        assert!(a.contains("[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.bulkhead]"), "{a}");
        assert!(!a.contains("options"), "{a}");
    }

    #[test]
    fn v2_mirrors_user_cri_settings_and_adds_runtime() {
        let user: Table = "sandbox_image = \"p:1\"\nrestrict_oom_score_adj = true\n[containerd.runtimes.runc]\n\
                           runtime_type = \"io.containerd.runc.v2\"\n[containerd.runtimes.runc.options]\nSystemdCgroup = true\n"
            .parse()
            .unwrap();
        let doc: Table = render(ConfigVersion::V2, Some(&user), &entry()).unwrap().parse().unwrap();
        assert_eq!(doc.get("version").and_then(Value::as_integer), Some(2));
        let cri = doc.get("plugins").and_then(|p| p.get("io.containerd.grpc.v1.cri")).unwrap();
        assert_eq!(cri.get("sandbox_image").and_then(Value::as_str), Some("p:1"));
        assert_eq!(cri.get("restrict_oom_score_adj").and_then(Value::as_bool), Some(true));
        let runc = runtime(&doc, "io.containerd.grpc.v1.cri", "runc").unwrap();
        assert_eq!(runc.get("options").and_then(|o| o.get("SystemdCgroup")).and_then(Value::as_bool), Some(true));
        let rt = runtime(&doc, "io.containerd.grpc.v1.cri", "bulkhead").unwrap();
        assert_eq!(rt.get("runtime_type").and_then(Value::as_str), Some(entry().shim_path.as_str()));
    }

    #[test]
    fn v2_restates_default_runc_when_user_defines_no_runtimes() {
        let doc: Table = render(ConfigVersion::V2, None, &entry()).unwrap().parse().unwrap();
        let runc = runtime(&doc, "io.containerd.grpc.v1.cri", "runc").unwrap();
        assert_eq!(runc.get("runtime_type").and_then(Value::as_str), Some("io.containerd.runc.v2"));
    }
}

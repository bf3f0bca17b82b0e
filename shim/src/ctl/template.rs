//! `bulkhead-ctl template ls|build|rm|gc`: the node's snapshot template cache (`vm.template_dir`).
//! `ls` checks each template as a pod's lookup would; `build` boots and snapshots one through
//! the same lock and store a pod's build uses; `rm` takes the key's lock, so it never removes a
//! template while a shim publishes it (a VMM restored from one keeps its open files); `gc` runs
//! the collection pass a build runs (other node files', idle, then least recently used beyond
//! the ceiling).

use std::time::{Duration, Instant, SystemTime};

use bulkhead_vmm_api::memory::Mib;
use serde_json::json;

use super::error::{CtlError, Outcome};
use crate::config::Config;
use crate::sandbox::vm::template::{
    collect, KeyInputs, KeySources, Listed, Room, TemplateKey, TemplateStore, BUILD_TIMEOUT,
};
use crate::sandbox::vm::template_builder::VmTemplateBuilder;

/// How long `rm` waits for a build of the same key to finish.
const RM_WAIT: Duration = Duration::from_secs(30);

fn open(config: &Config) -> Result<TemplateStore, CtlError> {
    crate::sandbox::vm::warm::open_store(&config.vm).map_err(|e| CtlError::Failed(e.to_string()))
}

/// One collection pass now, within the config's ceiling.
pub fn gc(config: &Config) -> Result<Outcome, CtlError> {
    if !config.vm.template_dir.exists() {
        let text = format!("no templates: {} does not exist\n", config.vm.template_dir.display());
        return Ok(Outcome { json: json!({ "removed": [] }), text, ok: true });
    }
    let failed = |e: &dyn std::fmt::Display| CtlError::Failed(e.to_string());
    let store = open(config)?;
    // The node's current files (the shape does not matter to a pass).
    let sources = KeySources::of_config(&config.vm, config.vm.vcpus, config.vm.memory_mib, &[]);
    let current = KeyInputs::of(&sources, Some(&store.digests_dir())).map_err(|e| failed(&e))?;
    let pass =
        collect(&store, &current, store.ceiling(), Room::default(), SystemTime::now()).map_err(|e| failed(&e))?;
    let mut text: String = pass
        .removed
        .iter()
        .map(|r| format!("removed {} ({} MiB): {}\n", r.key.short(), r.bytes >> 20, r.why))
        .collect();
    let ceiling = store.ceiling();
    text += &format!(
        "kept {} templates, {} MiB (ceiling {} templates, {} MiB, {} days unused)\n",
        pass.kept,
        pass.kept_bytes >> 20,
        ceiling.max_templates,
        ceiling.max_bytes >> 20,
        ceiling.max_idle.as_secs() / 86_400
    );
    let removed: Vec<_> =
        pass.removed.iter().map(|r| json!({ "key": r.key, "bytes": r.bytes, "why": r.why.to_string() })).collect();
    let json = json!({ "removed": removed, "kept": pass.kept, "kept_bytes": pass.kept_bytes, "fits": pass.fits });
    Ok(Outcome { json, text, ok: true })
}

pub fn ls(config: &Config) -> Result<Outcome, CtlError> {
    let store = open(config)?;
    let rows = store.list().map_err(|e| CtlError::Failed(e.to_string()))?;
    let mut text = format!(
        "{:<14} {:<9} {:>5} {:>8} {:>10} {:>10}  {}\n",
        "KEY", "STATE", "VCPUS", "MEM_MIB", "NIC_MTUS", "MIB", "DETAIL"
    );
    for row in &rows {
        text += &match row {
            Listed::Ready { key, bytes, created_unix, vcpus, memory_mib, nic_mtus } => {
                let nics = nic_mtus.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
                format!(
                    "{:<14} {:<9} {vcpus:>5} {:>8} {:>10} {:>10.1}  created {created_unix}\n",
                    key.short(),
                    "ready",
                    memory_mib.get(),
                    if nics.is_empty() { "-" } else { &nics },
                    *bytes as f64 / (1 << 20) as f64
                )
            }
            Listed::Unusable { name, reason } => format!(
                "{:<14} {:<9} {:>5} {:>8} {:>10} {:>10}  {reason}\n",
                short(name),
                "unusable",
                "-",
                "-",
                "-",
                "-"
            ),
            Listed::Building { key, pid } => format!(
                "{:<14} {:<9} {:>5} {:>8} {:>10} {:>10}  pid {pid}\n",
                short(key),
                "building",
                "-",
                "-",
                "-",
                "-"
            ),
        };
    }
    if rows.is_empty() {
        text += &format!("(no templates in {})\n", store.root().display());
    }
    let ok = !rows.iter().any(|r| matches!(r, Listed::Unusable { .. }));
    Ok(Outcome { json: json!({ "dir": store.root(), "templates": rows }), text, ok })
}

/// Builds the template of the config's files and the given (or the config's) VM shape, with a
/// NIC of each MTU in `nic_mtus` (what pods with a network need; none for host-network pods).
pub async fn build(
    config: Config,
    vcpus: Option<u8>,
    memory_mib: Option<u64>,
    nic_mtus: &[u16],
) -> Result<Outcome, CtlError> {
    let failed = |e: &dyn std::fmt::Display| CtlError::Failed(e.to_string());
    let store = open(&config)?;
    let (vcpus, memory) = (vcpus.unwrap_or(config.vm.vcpus), memory_mib.map_or(config.vm.memory_mib, Mib));
    if vcpus == 0 || memory == Mib(0) {
        return Err(CtlError::Failed("a template VM needs at least one vCPU and 1 MiB of memory".into()));
    }
    if let Some(bad) = nic_mtus.iter().find(|m| **m < 68) {
        return Err(CtlError::Failed(format!("NIC MTU {bad}: a guest NIC takes 68..=65535")));
    }
    let sources = KeySources::of_config(&config.vm, vcpus, memory, nic_mtus);
    let inputs = KeyInputs::of(&sources, Some(&store.digests_dir())).map_err(|e| failed(&e))?;
    let started = Instant::now();
    let builder = VmTemplateBuilder::new(std::sync::Arc::new(config));
    // Another build of the key (a pod's) may hold the lock for as long as a build may take.
    // SIGTERM (an installer told to stop) or Ctrl-C ends the build, and its VM, at once.
    let signal = first_signal()?;
    let template = crate::sandbox::vm::template::build_unless(&store, &inputs, &builder, BUILD_TIMEOUT, signal)
        .await
        .map_err(|e| failed(&e))?;
    let nics = match nic_mtus {
        [] => "no NIC".to_string(),
        mtus => format!("NIC MTUs {}", mtus.iter().map(u16::to_string).collect::<Vec<_>>().join(",")),
    };
    let text = format!(
        "template {} ({vcpus} vCPUs, {} MiB, {nics}): {} MiB in {} ({:.1} s)\n",
        template.key,
        memory.get(),
        template.bytes() >> 20,
        template.dir.display(),
        started.elapsed().as_secs_f64()
    );
    let json = json!({
        "key": template.key,
        "dir": template.dir,
        "vcpus": vcpus,
        "memory_mib": memory,
        "nic_mtus": nic_mtus,
        "bytes": template.bytes(),
        "created_unix": template.manifest.created_unix,
    });
    Ok(Outcome { json, text, ok: true })
}

/// The name of the first of SIGTERM and SIGINT to come (handlers installed now).
fn first_signal() -> Result<impl std::future::Future<Output = String>, CtlError> {
    use tokio::signal::unix::{signal, SignalKind};
    let handler = |kind, name: &str| signal(kind).map_err(|e| CtlError::Failed(format!("{name} handler: {e}")));
    let (mut term, mut int) =
        (handler(SignalKind::terminate(), "SIGTERM")?, handler(SignalKind::interrupt(), "SIGINT")?);
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM".to_string(),
            _ = int.recv() => "SIGINT".to_string(),
        }
    })
}

fn short(name: &str) -> &str {
    name.get(..12).unwrap_or(name)
}

/// Removes the templates named by `keys` (full keys or unique prefixes), or all with `all`.
pub async fn rm(config: &Config, keys: &[String], all: bool) -> Result<Outcome, CtlError> {
    // Nothing to remove from a cache never made (an uninstall asks on every node), and no reason to make it.
    if all && keys.is_empty() && !config.vm.template_dir.exists() {
        let text = format!("no templates: {} does not exist\n", config.vm.template_dir.display());
        return Ok(Outcome { json: json!({ "removed": [] }), text, ok: true });
    }
    let store = open(config)?;
    let known: Vec<TemplateKey> = store
        .list()
        .map_err(|e| CtlError::Failed(e.to_string()))?
        .into_iter()
        .filter_map(|row| match row {
            Listed::Ready { key, .. } => Some(key),
            Listed::Unusable { name, .. } => TemplateKey::parse(&name).ok(),
            Listed::Building { .. } => None,
        })
        .collect();
    let chosen: Vec<TemplateKey> = if all {
        if !keys.is_empty() {
            return Err(CtlError::Failed("give template keys or --all, not both".into()));
        }
        known
    } else {
        if keys.is_empty() {
            return Err(CtlError::Failed("name the templates to remove (a key or a unique prefix), or --all".into()));
        }
        let mut chosen = Vec::new();
        for query in keys {
            let matches: Vec<&TemplateKey> = known.iter().filter(|k| k.as_str().starts_with(query.as_str())).collect();
            match matches.as_slice() {
                [one] => chosen.push((*one).clone()),
                [] => {
                    return Err(CtlError::Failed(format!(
                        "no template matches {query:?} in {}",
                        store.root().display()
                    )))
                }
                many => {
                    let names: Vec<&str> = many.iter().map(|k| k.short()).collect();
                    return Err(CtlError::Ambiguous { query: query.clone(), matches: names.join(", ") });
                }
            }
        }
        chosen
    };
    let mut removed = Vec::new();
    for key in &chosen {
        let started = Instant::now();
        let lock = loop {
            match store.try_lock(key).map_err(|e| CtlError::Failed(e.to_string()))? {
                Some(lock) => break lock,
                None if started.elapsed() >= RM_WAIT => {
                    return Err(CtlError::Failed(format!(
                        "template {key} is being built; try again (waited {RM_WAIT:?})"
                    )))
                }
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        if store.remove(key, &lock).map_err(|e| CtlError::Failed(e.to_string()))? {
            removed.push(key.clone());
        }
    }
    let text = removed.iter().map(|k| format!("removed {k}\n")).collect::<String>();
    Ok(Outcome { json: json!({ "removed": removed }), text, ok: true })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::sandbox::vm::template::{build, KeyInputs, TemplateBuilder};

    struct Files;

    #[async_trait::async_trait]
    impl TemplateBuilder for Files {
        async fn build(&self, _: &KeyInputs, dir: &Path) -> Result<(), String> {
            std::fs::write(dir.join("state"), "s").map_err(|e| e.to_string())
        }

        async fn discard(&self, _: &KeyInputs) {}
    }

    fn inputs(memory_mib: u64) -> KeyInputs {
        let digest = "0".repeat(64);
        KeyInputs {
            kernel_sha256: digest.clone(),
            initramfs_sha256: digest.clone(),
            vmm_sha256: digest,
            vcpus: 1,
            memory_mib: Mib(memory_mib),
            nic_mtus: if memory_mib == 512 { vec![1500] } else { vec![] },
            agent_protocol: 1,
        }
    }

    #[tokio::test]
    async fn ls_checks_each_template_and_rm_takes_unique_prefixes() {
        let dir = tempfile::tempdir().unwrap();
        let text = format!("[vm]\ntemplate_dir = {:?}\n", dir.path().join("templates"));
        let config = Config::parse(Path::new("test.toml"), &text).unwrap();
        let store = TemplateStore::open(&config.vm.template_dir).unwrap();
        let (a, b) = (inputs(256), inputs(512));
        build(&store, &a, &Files, Duration::from_secs(5)).await.unwrap();
        build(&store, &b, &Files, Duration::from_secs(5)).await.unwrap();

        let listed = ls(&config).unwrap();
        assert!(listed.ok);
        assert_eq!(listed.json["templates"].as_array().unwrap().len(), 2);
        assert!(listed.text.contains(a.key().short()) && listed.text.contains("ready"), "{}", listed.text);
        let nics: Vec<_> = listed.json["templates"].as_array().unwrap().iter().map(|t| t["nic_mtus"].clone()).collect();
        assert!(nics.contains(&serde_json::json!([1500])) && nics.contains(&serde_json::json!([])), "{nics:?}");

        // A template someone tampered with is listed as unusable, and ls fails.
        std::fs::write(store.root().join(b.key().as_str()).join("extra"), "x").unwrap();
        let listed = ls(&config).unwrap();
        assert!(!listed.ok);
        assert!(listed.text.contains("unusable"), "{}", listed.text);

        assert!(rm(&config, &[], false).await.is_err(), "nothing named");
        assert!(rm(&config, &["zz".into()], false).await.is_err(), "no match");
        assert!(rm(&config, &[a.key().as_str().into()], true).await.is_err(), "keys and --all");
        let removed = rm(&config, &[a.key().as_str()[..12].into()], false).await.unwrap();
        assert_eq!(removed.json["removed"][0], a.key().as_str());
        assert!(!store.root().join(a.key().as_str()).exists());
        let removed = rm(&config, &[], true).await.unwrap();
        assert_eq!(removed.json["removed"][0], b.key().as_str(), "--all removes unusable ones too");
        assert!(ls(&config).unwrap().json["templates"].as_array().unwrap().is_empty());
    }

    #[tokio::test]
    async fn rm_all_of_a_cache_never_made_does_not_make_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("templates");
        let config = Config::parse(Path::new("test.toml"), &format!("[vm]\ntemplate_dir = {missing:?}\n")).unwrap();
        let removed = rm(&config, &[], true).await.unwrap();
        assert!(removed.ok && removed.json["removed"].as_array().unwrap().is_empty());
        assert!(!missing.exists());
    }
}

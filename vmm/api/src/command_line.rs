//! The VMM's command line, as a type: what the shim (and the benches) start a VMM with, what
//! `bulkhead-vmm` reads (its clap parser is checked against [`VmmCommand::to_args`]) and what the
//! QEMU stand-in parses ([`VmmCommand::parse`]). Nobody else spells the flags.
//!
//! ```text
//! --config <vm.json>                                  boot
//! --restore <snapshot dir> --restore-config <json>    restore, paused or running as the JSON says
//! --prepare <snapshot dir> --api-socket <socket>      prepare a restore, finished on the API's `restore`
//! [--jail <jail.json>] [--log-json]                   with any of them
//! --probe                                             alone: the host probe
//! ```

use std::path::{Path, PathBuf};

const CONFIG: &str = "--config";
const RESTORE: &str = "--restore";
const RESTORE_CONFIG: &str = "--restore-config";
const PREPARE: &str = "--prepare";
const API_SOCKET: &str = "--api-socket";
const JAIL: &str = "--jail";
const LOG_JSON: &str = "--log-json";
const PROBE: &str = "--probe";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CommandLineError {
    #[error("{0} needs a value")]
    MissingValue(&'static str),
    #[error("unknown argument {0:?}")]
    Unknown(String),
    #[error("{0} given twice")]
    Twice(&'static str),
    #[error("{0} and {1} cannot be combined")]
    Conflict(&'static str, &'static str),
    #[error("{0} needs {1}")]
    Needs(&'static str, &'static str),
    #[error("nothing to do: give --config, --restore or --prepare (or --probe)")]
    NothingToDo,
}

/// What the VMM starts by doing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    Boot { config: PathBuf },
    Restore { snapshot: PathBuf, restore_config: PathBuf },
    Prepare { snapshot: PathBuf, api_socket: PathBuf },
}

/// A VMM run: what it starts by doing, confined by `jail` if given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmCommand {
    pub start: Start,
    pub jail: Option<PathBuf>,
    pub log_json: bool,
}

/// What a VMM is invoked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invocation {
    Probe,
    Run(VmmCommand),
}

impl VmmCommand {
    /// The arguments after the VMM's path.
    pub fn to_args(&self) -> Vec<String> {
        let path = |p: &Path| p.display().to_string();
        let mut args = match &self.start {
            Start::Boot { config } => vec![CONFIG.to_string(), path(config)],
            Start::Restore { snapshot, restore_config } => {
                vec![RESTORE.to_string(), path(snapshot), RESTORE_CONFIG.to_string(), path(restore_config)]
            }
            Start::Prepare { snapshot, api_socket } => {
                vec![PREPARE.to_string(), path(snapshot), API_SOCKET.to_string(), path(api_socket)]
            }
        };
        if let Some(jail) = &self.jail {
            args.extend(jail_identity(jail));
        }
        if self.log_json {
            args.push(LOG_JSON.to_string());
        }
        args
    }

    /// Reads the arguments after the VMM's path.
    pub fn parse(args: &[String]) -> Result<Invocation, CommandLineError> {
        let mut values: [(&'static str, Option<PathBuf>); 6] = [
            (CONFIG, None),
            (RESTORE, None),
            (RESTORE_CONFIG, None),
            (PREPARE, None),
            (API_SOCKET, None),
            (JAIL, None),
        ];
        let (mut log_json, mut probe) = (false, false);
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                LOG_JSON => log_json = true,
                PROBE => probe = true,
                other => {
                    let slot = values
                        .iter_mut()
                        .find(|(flag, _)| *flag == other)
                        .ok_or_else(|| CommandLineError::Unknown(other.to_string()))?;
                    if slot.1.is_some() {
                        return Err(CommandLineError::Twice(slot.0));
                    }
                    let value = it.next().ok_or(CommandLineError::MissingValue(slot.0))?;
                    slot.1 = Some(PathBuf::from(value));
                }
            }
        }
        let [(_, config), (_, restore), (_, restore_config), (_, prepare), (_, api_socket), (_, jail)] = values;
        if probe {
            let given = [(CONFIG, &config), (RESTORE, &restore), (PREPARE, &prepare), (JAIL, &jail)];
            if let Some((flag, _)) = given.iter().find(|(_, v)| v.is_some()) {
                return Err(CommandLineError::Conflict(PROBE, flag));
            }
            return Ok(Invocation::Probe);
        }
        let start = match (config, restore, prepare) {
            (Some(config), None, None) => Start::Boot { config },
            (None, Some(snapshot), None) => Start::Restore {
                snapshot,
                restore_config: restore_config.ok_or(CommandLineError::Needs(RESTORE, RESTORE_CONFIG))?,
            },
            (None, None, Some(snapshot)) => {
                Start::Prepare { snapshot, api_socket: api_socket.ok_or(CommandLineError::Needs(PREPARE, API_SOCKET))? }
            }
            (None, None, None) => return Err(CommandLineError::NothingToDo),
            (Some(_), Some(_), _) => return Err(CommandLineError::Conflict(CONFIG, RESTORE)),
            (Some(_), _, Some(_)) => return Err(CommandLineError::Conflict(CONFIG, PREPARE)),
            (_, Some(_), Some(_)) => return Err(CommandLineError::Conflict(RESTORE, PREPARE)),
        };
        Ok(Invocation::Run(VmmCommand { start, jail, log_json }))
    }
}

/// One of each start form, with sample paths: for tests that must cover every form (here, and
/// the VMM's check that its clap parser reads what [`VmmCommand::to_args`] writes).
pub fn every_start_form() -> [Start; 3] {
    [
        Start::Boot { config: "/run/vm.json".into() },
        Start::Restore { snapshot: "/snapshot".into(), restore_config: "/run/restore.json".into() },
        Start::Prepare { snapshot: "/snapshot".into(), api_socket: "/run/api.sock".into() },
    ]
}

/// The part of a jailed VMM's command line that names its jail document: a pod's alone, so
/// `delete` recognises the pod's VMM by it.
pub fn jail_identity(jail: &Path) -> [String; 2] {
    [JAIL.to_string(), jail.display().to_string()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn every_form_reads_back_as_written() {
        for start in every_start_form() {
            for jail in [None, Some(PathBuf::from("/a/jail.json"))] {
                for log_json in [false, true] {
                    let command = VmmCommand { start: start.clone(), jail: jail.clone(), log_json };
                    assert_eq!(VmmCommand::parse(&command.to_args()), Ok(Invocation::Run(command.clone())));
                }
            }
        }
        assert_eq!(VmmCommand::parse(&args(&["--probe"])), Ok(Invocation::Probe));
        assert_eq!(jail_identity(Path::new("/a/jail.json")), ["--jail", "/a/jail.json"]);
    }

    #[test]
    fn malformed_command_lines_say_what_is_wrong() {
        let cases: [(&[&str], CommandLineError); 9] = [
            (&[], CommandLineError::NothingToDo),
            (&["--config"], CommandLineError::MissingValue(CONFIG)),
            (&["--config", "a", "--config", "b"], CommandLineError::Twice(CONFIG)),
            (&["--config", "a", "--restore", "d"], CommandLineError::Conflict(CONFIG, RESTORE)),
            (&["--restore", "d", "--prepare", "d"], CommandLineError::Conflict(RESTORE, PREPARE)),
            (&["--restore", "d"], CommandLineError::Needs(RESTORE, RESTORE_CONFIG)),
            (&["--prepare", "d"], CommandLineError::Needs(PREPARE, API_SOCKET)),
            (&["--probe", "--jail", "j"], CommandLineError::Conflict(PROBE, JAIL)),
            (&["--config", "a", "--cpus"], CommandLineError::Unknown("--cpus".into())),
        ];
        for (words, want) in cases {
            assert_eq!(VmmCommand::parse(&args(words)), Err(want), "{words:?}");
        }
    }
}

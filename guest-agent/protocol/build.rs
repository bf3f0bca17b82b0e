//! Generates the protobuf messages and the async ttrpc client/server for `proto/agent.proto`.
use std::{env, fs, path::PathBuf};

use ttrpc_codegen::{Codegen, Customize, ProtobufCustomize};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(env::var("OUT_DIR")?);
    let gen_dir = out.join("gen");
    fs::create_dir_all(&gen_dir)?;
    println!("cargo:rerun-if-changed=proto/agent.proto");

    Codegen::new()
        .out_dir(&gen_dir)
        .inputs(["proto/agent.proto"])
        .include("proto")
        .rust_protobuf()
        .customize(Customize { async_all: true, ..Default::default() })
        .rust_protobuf_customize(ProtobufCustomize::default().gen_mod_rs(false))
        .run()?;

    // `include!` cannot take inner attributes or inner doc comments, so strip them; lib.rs
    // puts the equivalent `#[allow]`s on the wrapping modules.
    for name in ["agent.rs", "agent_ttrpc.rs"] {
        let src = fs::read_to_string(gen_dir.join(name))?;
        let cleaned: String = src
            .lines()
            .filter(|l| !l.trim_start().starts_with("#!["))
            .map(|l| match l.strip_prefix("//!") {
                Some(rest) => format!("//{rest}\n"),
                None => format!("{l}\n"),
            })
            .collect();
        fs::write(out.join(name), cleaned)?;
    }
    Ok(())
}

//! The workspace's `rust-version` holds for what `Cargo.lock` builds: no
//! locked package (a dependency of any member, any feature, dev-dependencies
//! included, since the tests build them too) declares a newer Rust than the
//! workspace does. Only one toolchain runs here, so the workspace's own code
//! is held to it by clippy's `incompatible_msrv` lint (in `.ci/run`, with
//! `-D warnings`), and its dependencies by this test. `cargo update` keeps
//! to it by itself (`.cargo/config.toml`: `incompatible-rust-versions =
//! "fallback"`); a new dependency, or one taken with `--precise`, that
//! needs a newer Rust fails here until `rust-version` is raised (with a
//! Migrating note) or the dependency is held back.

use std::process::Command;

/// `"1.85"`, `"1.86.0"` as `(major, minor)`: patch releases never raise what
/// a crate needs in practice, and Cargo compares them the same way here.
fn version(text: &str) -> (u32, u32) {
    let mut parts = text
        .split('.')
        .map(|p| p.parse::<u32>().expect("a numeric version"));
    let major = parts.next().expect("a major version");
    (major, parts.next().unwrap_or(0))
}

#[test]
fn no_locked_package_needs_a_newer_rust_than_the_workspace_declares() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--all-features",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let members: Vec<&str> = meta["workspace_members"]
        .as_array()
        .expect("workspace members")
        .iter()
        .map(|m| m.as_str().expect("a member id"))
        .collect();
    let declared = packages
        .iter()
        .find(|p| p["name"] == "idem" && members.contains(&p["id"].as_str().unwrap_or("")))
        .and_then(|p| p["rust_version"].as_str())
        .expect("the idem package declares rust-version");
    let declared = version(declared);

    let mut over = Vec::new();
    for p in packages {
        let id = p["id"].as_str().unwrap_or("");
        let Some(needs) = p["rust_version"].as_str() else {
            continue;
        };
        if members.contains(&id) {
            assert_eq!(
                version(needs),
                declared,
                "{}: a member's rust-version differs",
                p["name"]
            );
        } else if version(needs) > declared {
            over.push(format!(
                "{} {} needs {needs}",
                p["name"].as_str().unwrap_or("?"),
                p["version"].as_str().unwrap_or("?")
            ));
        }
    }
    assert!(
        over.is_empty(),
        "rust-version = {}.{} in Cargo.toml, but the lock holds packages that need more: {over:?}",
        declared.0,
        declared.1
    );
    // The check reads real data: the lock holds dozens of packages that declare one.
    let declaring = packages
        .iter()
        .filter(|p| p["rust_version"].is_string())
        .count();
    assert!(
        declaring > 20,
        "only {declaring} packages declare a rust-version"
    );
}

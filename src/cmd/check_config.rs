//! `idemgate check-config`: the config as it will run, the environment
//! variables it skipped as Kubernetes service links (names only), its
//! warnings, the file-descriptor plan and (`--connect`) one line per store
//! reached.

use crate::config::Config;
use std::process::ExitCode;

pub fn run(path: &std::path::Path, cfg: &Config, connect: bool) -> ExitCode {
    outln!("{}: ok\n{}", path.display(), cfg);
    // Read from the environment `cfg` was loaded with: this process's.
    let links = crate::config::skipped_service_links();
    if !links.is_empty() {
        outln!(
            "skipped    {} (Kubernetes service-link variables, not settings: enableServiceLinks: false in the pod spec stops them)",
            links.join(", ")
        );
    }
    for w in cfg.warnings() {
        outln!("warning: {w}");
    }
    // What `serve` would do with this process's limits.
    match crate::server::fd_limit::preview(cfg) {
        Ok(plan) if plan.lowered() => outln!("warning: {plan}"),
        Ok(plan) => outln!("{plan}"),
        Err(e) => outln!("warning: cannot read the file-descriptor limit: {e}"),
    }
    if !connect {
        return ExitCode::SUCCESS;
    }
    super::exit(super::block_on(async {
        let reached = crate::store::check_connect(cfg)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect: {e}"))?;
        for line in reached {
            outln!("connect: {line}");
        }
        Ok(())
    }))
}

//! `idem`: the operator's command line for a database idem uses. See
//! `docs/operations.md`.
//!
//! Exit codes: 0 done (every check ok or warn); 1 a check failed, a record,
//! event or job was not found or not in the state asked for, or an error
//! (the database unreachable, a bad URL; one line on stderr); 2 a usage error.

mod args;
mod output;
mod run;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // A bug must still end in one line, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let line = info.to_string().replace('\n', " ");
        // `println!` panics when stdout fails: a reader that stopped
        // reading (`| head`) is no error of ours; anything else (a full
        // disk) is one line and exit 1, never a panic's 101.
        if line.contains("failed printing to stdout") {
            if line.contains("Broken pipe") {
                std::process::exit(0);
            }
            eprintln!("idem: could not write the output: {line}");
            std::process::exit(1);
        }
        eprintln!("idem: internal error: {line}");
    }));
    let cli = args::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run::run(&cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("idem: {}", one_line(e.as_ref()));
            ExitCode::from(1)
        }
    }
}

/// An error and its sources, on one line.
fn one_line(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = s.source();
    }
    line.split_whitespace().collect::<Vec<_>>().join(" ")
}

//! `idem`: the operator's command line for a database idem uses. See
//! `docs/operations.md`.
//!
//! Exit codes: 0 done (every check ok or warn); 1 a check failed, a record,
//! event or job was not found or not in the state asked for, or an error
//! (the database unreachable, a bad URL; one line on stderr); 2 a usage error.

mod args;
mod context;
mod doctor;
mod key;
mod output;
mod queues;
mod run;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // A bug must still end in one line, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let line = output::clean(&info.to_string().replace('\n', " "));
        // Every output goes through `output::write_out`, which returns its
        // error; should a `print!` fail all the same, say what failed, not
        // where it panicked.
        if let Some((_, why)) = line.split_once("failed printing to stdout: ") {
            if why.contains("Broken pipe") {
                std::process::exit(0);
            }
            eprintln!("idem: could not write the output: {why}");
            std::process::exit(1);
        }
        eprintln!("idem: internal error: {line}");
    }));
    let cli = args::Cli::parse();
    if let Err(e) = cli.check() {
        e.exit();
    }
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
            let pipe = std::io::ErrorKind::BrokenPipe;
            if matches!(e.downcast_ref(), Some(output::OutputError(io)) if io.kind() == pipe) {
                // The reader stopped reading (`| head`): no error of ours.
                return ExitCode::SUCCESS;
            }
            eprintln!("idem: {}", one_line(e.as_ref()));
            ExitCode::from(1)
        }
    }
}

/// An error and its sources, on one line, control characters escaped (an
/// error may quote stored data).
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
    output::clean(&line.split_whitespace().collect::<Vec<_>>().join(" "))
}

//! The `strata` command line: `strata demo`, `bench`, `train-demo`, `inspect` (a checkpoint's
//! tensors and a memory plan), `load` (a checkpoint into a store), and a model's `generate`,
//! `chat`, `finetune` and `serve`. The commands live in [`cli`], a module of this binary built
//! on the library's public API (`strata::...`); this only parses the flags and dispatches.

use std::io::Write as _;
use std::process::ExitCode;

use clap::Parser;
use cli::{Cli, Cmd};

mod cli;

fn main() -> ExitCode {
    let args = Cli::parse();
    cli::init_logging(args.verbose);
    // Under a file-size limit a write that crosses it fails with EFBIG (an error naming the
    // file) instead of the process dying by SIGXFSZ.
    if let Err(e) = strata::ignore_file_size_signal() {
        tracing::warn!("cannot ignore SIGXFSZ: {e}");
    }
    let res = match args.cmd {
        Cmd::Demo(a) => cli::demo::run(a),
        Cmd::Bench(a) => cli::bench::run(a),
        Cmd::TrainDemo(a) => cli::train::run_demo(&a),
        Cmd::Inspect(a) => cli::inspect::run(a),
        Cmd::Load(a) => cli::load::run(a),
        #[cfg(feature = "text")]
        Cmd::Generate(a) => cli::generate::run(*a).map_err(anyhow::Error::from_boxed),
        #[cfg(feature = "text")]
        Cmd::Chat(a) => cli::chat::run(*a).map_err(anyhow::Error::from_boxed),
        #[cfg(feature = "text")]
        Cmd::Finetune(a) => match cli::finetune::run(*a) {
            Ok(cli::finetune::Ended::Done) => Ok(()),
            Ok(cli::finetune::Ended::Interrupted) => return ExitCode::from(130),
            Err(e) => Err(anyhow::Error::from_boxed(e)),
        },
        #[cfg(feature = "serve")]
        Cmd::Serve(a) => cli::serve::run(*a).map_err(anyhow::Error::from_boxed),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout went away (`strata inspect ... | head`): nothing is wrong.
        Err(e) if e.chain().any(cli::is_broken_pipe) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

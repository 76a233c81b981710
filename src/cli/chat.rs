//! `strata chat`: an interactive conversation with a model, out of core: each line you type is
//! a user message, the model's chat template renders the whole conversation, and the answer is
//! streamed as it is generated. `/reset` starts over (the system message kept), `/exit` or
//! end of input (Ctrl-D) ends. Ctrl-C during an answer stops that answer (what it said so far
//! stays in the conversation) and comes back to the prompt; Ctrl-C at the prompt, or a second
//! one during an answer, exits with status 130.
//!
//! ```text
//! strata chat --model HuggingFaceTB/SmolLM2-135M-Instruct --device-budget 64MiB
//! ```

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::cli::model::{Llm, ModelFlags};
use strata::candle::text::{Message, TextStream};
use strata::candle::{generate_batch, Sampling};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `strata chat`'s flags.
#[derive(clap::Args, Debug, Clone)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelFlags,
    /// A system message that starts the conversation.
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// New tokens an answer at most.
    #[arg(long, default_value_t = 512)]
    pub max_new: usize,
    /// Positions the conversation may hold (default: the model's max_position_embeddings, at
    /// most 4096).
    #[arg(long)]
    pub context: Option<usize>,
    /// Sampled answers at this temperature (greedy without it, or with 0).
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f64>,
    /// Sample among the K likeliest tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample among the likeliest tokens whose probabilities add up to P.
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f64>,
    /// The sampler's seed (each answer starts from it).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs `strata chat`: reads lines from standard input until `/exit` or its end.
pub fn run(args: ChatArgs) -> Res<()> {
    let sampling = Sampling::from_flags(args.temperature, args.top_k, args.top_p, args.seed)?;
    let probe = crate::cli::model::resolve(&args.model.model)?;
    let config = probe.llama_config(args.model.config.as_deref())?;
    let context = args.context.unwrap_or(config.max_position_embeddings.min(4096));
    if context > config.max_position_embeddings || context < 2 {
        return Err(format!(
            "--context {context}: from 2 to the model's max_position_embeddings {}",
            config.max_position_embeddings
        )
        .into());
    }
    let llm = Llm::load(&args.model, context, "a smaller --context")?;
    let Some(template) = &llm.text.template else {
        return Err("the model has no chat template (tokenizer_config.json's chat_template): \
                    a base model; use `strata generate --prompt TEXT`"
            .into());
    };
    eprintln!("{}", llm.summary);
    eprintln!(
        "type a message and Enter; /reset starts over, /exit (or Ctrl-D) ends; Ctrl-C stops an \
         answer, or at the prompt ends"
    );
    let ctrl_c = CtrlC::register()?;
    let mut history: Vec<Message> = Vec::new();
    if let Some(s) = &args.system {
        history.push(Message::new("system", s));
    }
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        eprint!("> ");
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            eprintln!();
            return Ok(());
        }
        let msg = line.trim();
        match msg {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/reset" => {
                history.truncate(usize::from(args.system.is_some()));
                eprintln!("(the conversation starts over)");
                continue;
            }
            m if m.starts_with('/') => {
                eprintln!("commands: /reset starts over, /exit ends");
                continue;
            }
            _ => {}
        }
        history.push(Message::new("user", msg));
        let ids = llm.text.tokenizer.encode(&template.render(&history, true)?, false)?;
        if ids.len() >= context {
            history.pop();
            eprintln!(
                "(the conversation is {} tokens, past the context of {context}: /reset, or a \
                 larger --context)",
                ids.len()
            );
            continue;
        }
        let max_new = args.max_new.min(context - ids.len() + 1);
        let mut stream = TextStream::new(&llm.text.tokenizer);
        let mut failed = None;
        let mut said = Vec::new();
        ctrl_c.answering();
        let out = generate_batch(&llm.model, &[&ids], max_new, &sampling, &llm.text.eos, |_, t| {
            if ctrl_c.interrupted() {
                candle_core::bail!("stopped by Ctrl-C");
            }
            said.push(t);
            // An end token, or an id past the tokenizer's vocabulary (a model's padded one):
            // no text.
            if llm.text.eos.contains(&t) || t as usize >= llm.text.tokenizer.vocab_size() {
                return Ok(());
            }
            if let Some(piece) = stream.push(t)? {
                let mut o = std::io::stdout().lock();
                if let Err(e) = o.write_all(piece.as_bytes()).and_then(|()| o.flush()) {
                    failed = Some(e);
                    candle_core::bail!("stdout closed");
                }
            }
            Ok(())
        });
        let stopped_by_user = out.is_err() && ctrl_c.interrupted();
        ctrl_c.prompting();
        if let Some(e) = failed {
            return Err(e.into());
        }
        let (tokens, finished) = match out {
            Err(_) if stopped_by_user => (said, false),
            out => {
                let out = out?.pop().ok_or("no sequence generated")?;
                (out.tokens, out.stopped)
            }
        };
        let rest = stream.finish()?;
        crate::cli::print(&format!("{rest}\n"))?;
        let vocab = llm.text.tokenizer.vocab_size();
        let answer: Vec<u32> = tokens
            .iter()
            .copied()
            .filter(|&t| !llm.text.eos.contains(&t) && (t as usize) < vocab)
            .collect();
        history.push(Message::new("assistant", llm.text.tokenizer.decode(&answer, true)?));
        if stopped_by_user {
            eprintln!("(stopped by Ctrl-C; Ctrl-C again at the prompt ends)");
        } else if !finished {
            eprintln!("(stopped at --max-new {max_new})");
        }
    }
}

/// What Ctrl-C does: during an answer, the first stops it ([`CtrlC::interrupted`]); at the
/// prompt, or a second during an answer, the process exits with 130 (128 + SIGINT, as a shell
/// reports it).
struct CtrlC {
    /// A SIGINT now exits.
    exit_next: Arc<AtomicBool>,
    /// A SIGINT came since the answer began.
    interrupted: Arc<AtomicBool>,
}

impl CtrlC {
    fn register() -> Res<CtrlC> {
        use signal_hook::consts::SIGINT;
        let c = CtrlC {
            exit_next: Arc::new(AtomicBool::new(true)),
            interrupted: Arc::new(AtomicBool::new(false)),
        };
        // In this order: the exit is decided before this signal arms it for the next.
        signal_hook::flag::register_conditional_shutdown(SIGINT, 130, Arc::clone(&c.exit_next))?;
        signal_hook::flag::register(SIGINT, Arc::clone(&c.exit_next))?;
        signal_hook::flag::register(SIGINT, Arc::clone(&c.interrupted))?;
        Ok(c)
    }

    fn answering(&self) {
        self.interrupted.store(false, Ordering::SeqCst);
        self.exit_next.store(false, Ordering::SeqCst);
    }

    fn prompting(&self) {
        self.exit_next.store(true, Ordering::SeqCst);
    }

    fn interrupted(&self) -> bool {
        self.interrupted.load(Ordering::SeqCst)
    }
}

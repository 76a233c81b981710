//! The flag scanner behind [`MlpConfig::parse`](crate::apps::mlp::MlpConfig::parse) and
//! [`TrainConfig::parse`](crate::apps::train::TrainConfig::parse): `--flag value` pairs and value-less
//! switches, with errors that name the flag and end with the usage line.

use std::str::FromStr;

use crate::error::{Error, Result};
use crate::types::parse_size;

/// Command-line arguments, read a flag at a time.
pub(crate) struct Flags<I> {
    args: I,
    usage: &'static str,
    switches: &'static [&'static str],
}

/// One flag and its value (empty for a switch).
#[derive(Debug)]
pub(crate) struct Flag {
    pub(crate) name: String,
    pub(crate) value: String,
    usage: &'static str,
}

impl<I: Iterator<Item = String>> Flags<I> {
    /// `switches` are the flags that take no value.
    pub(crate) fn new(args: I, usage: &'static str, switches: &'static [&'static str]) -> Flags<I> {
        Flags { args, usage, switches }
    }

    /// The next flag; an error when a flag that takes a value is last.
    pub(crate) fn next_flag(&mut self) -> Option<Result<Flag>> {
        let name = self.args.next()?;
        let value = if self.switches.contains(&name.as_str()) {
            String::new()
        } else {
            match self.args.next() {
                Some(v) => v,
                None => {
                    let f = Flag { name, value: "<missing>".into(), usage: self.usage };
                    return Some(Err(f.bad()));
                }
            }
        };
        Some(Ok(Flag { name, value, usage: self.usage }))
    }
}

impl Flag {
    /// "this value of this flag is wrong".
    pub(crate) fn bad(&self) -> Error {
        Error::InvalidArgument(format!("{} {:?} ({})", self.name, self.value, self.usage))
    }

    /// "no such flag".
    pub(crate) fn unknown(&self) -> Error {
        Error::InvalidArgument(format!("unknown flag {} ({})", self.name, self.usage))
    }

    /// The value parsed as `T`.
    pub(crate) fn parsed<T: FromStr>(&self) -> Result<T> {
        self.value.parse().map_err(|_| self.bad())
    }

    /// The value as a count.
    pub(crate) fn num(&self) -> Result<usize> {
        self.parsed()
    }

    /// The value as a size with units (`1GiB`, `24KiB`).
    pub(crate) fn size(&self) -> Result<u64> {
        parse_size(&self.value)
    }

    /// The value as one of `choices` (word, meaning).
    pub(crate) fn choice<T: Copy>(&self, choices: &[(&str, T)]) -> Result<T> {
        choices.iter().find(|(w, _)| *w == self.value).map(|&(_, t)| t).ok_or_else(|| self.bad())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(args: &[&str]) -> Flags<impl Iterator<Item = String>> {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        Flags::new(args.into_iter(), "USAGE", &["--host"])
    }

    #[test]
    fn pairs_switches_and_errors() {
        let mut f = flags(&["--layers", "4", "--host", "--mode", "x", "--rows"]);
        let a = f.next_flag().unwrap().unwrap();
        assert_eq!((a.name.as_str(), a.num().unwrap()), ("--layers", 4));
        let h = f.next_flag().unwrap().unwrap();
        assert_eq!((h.name.as_str(), h.value.as_str()), ("--host", ""));
        let m = f.next_flag().unwrap().unwrap();
        let e = m.choice(&[("forward", 1), ("train", 2)]).unwrap_err().to_string();
        assert!(e.contains("--mode \"x\"") && e.contains("USAGE"), "{e}");
        let r = f.next_flag().unwrap().unwrap_err().to_string();
        assert!(r.contains("--rows \"<missing>\""), "{r}");
        assert!(f.next_flag().is_none());
        assert!(m.unknown().to_string().contains("unknown flag --mode"));
    }
}

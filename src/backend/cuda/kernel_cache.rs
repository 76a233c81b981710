//! NVRTC's output kept on disk, so that the processes of one GPU run compile each program once:
//! with `STRATA_KERNEL_CACHE=DIR` set, a program's PTX is looked up in `DIR` before NVRTC
//! compiles it, and written there after (`benches/gpu/run lease` sets it for the call: each
//! candle process would otherwise compile `cuda/fused.cu` again, about 6 s an element type).
//! Unset, nothing is read or written.
//!
//! An entry is named by a hash of everything the PTX depends on: the source, the compile
//! options (the virtual architecture among them) and NVRTC's version. Its first line repeats a
//! second hash of the same material, the PTX's length and its CRC-32, and a read checks all
//! three: an entry that does not match (another key under the same name, a truncated or
//! garbled file, one that cannot be read) is compiled again and rewritten, never an error.
//! Entries are written whole or not at all (a temporary file in `DIR`, renamed over the
//! entry), so a process reading beside one writing sees the old entry, the new one or none. A
//! cache that cannot be written (a read-only or missing folder) only costs the compile.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The variable naming the cache's folder.
pub(crate) const ENV: &str = "STRATA_KERNEL_CACHE";
/// The first word of an entry (its format's version).
const MAGIC: &str = "strata-ptx/1";

/// What a compile through the cache did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// No cache (the variable unset, or NVRTC's version unknown): compiled.
    Off,
    /// Read from the cache: nothing compiled.
    Hit,
    /// Not in the cache, or its entry did not check: compiled (and written, where the folder
    /// takes it).
    Miss,
}

/// The key of a program: (the entry's name, the check its first line holds). Each field is
/// hashed with its length before it, so that no two lists of fields hash the same bytes.
fn key(source: &str, options: &[String], nvrtc: (i32, i32)) -> (u64, u32) {
    let mut fnv = Fnv::new();
    let mut crc = crc32fast::Hasher::new();
    let version = format!("nvrtc {}.{}", nvrtc.0, nvrtc.1);
    let fields = std::iter::once(version.as_str())
        .chain(options.iter().map(String::as_str))
        .chain(std::iter::once(source));
    for f in fields {
        for bytes in [&(f.len() as u64).to_le_bytes()[..], f.as_bytes()] {
            fnv.write(bytes);
            crc.update(bytes);
        }
    }
    (fnv.0, crc.finalize())
}

/// FNV-1a, 64 bits: the same on every machine and Rust release (std's hasher promises neither).
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The entry of `name` in `dir`.
fn entry(dir: &Path, name: u64) -> PathBuf {
    dir.join(format!("{name:016x}.ptx"))
}

/// The PTX an entry's bytes hold, if they are an entry of key check `check`, whole.
fn parse(bytes: &[u8], check: u32) -> Option<String> {
    let text = std::str::from_utf8(bytes).ok()?;
    let (head, ptx) = text.split_once('\n')?;
    let want = format!(
        "{MAGIC} key={check:08x} len={} crc={:08x}",
        ptx.len(),
        crc32fast::hash(ptx.as_bytes())
    );
    (head == want).then(|| ptx.to_string())
}

/// Writes the entry whole or not at all: a temporary file in `dir`, renamed over `path`.
fn write_entry(dir: &Path, path: &Path, check: u32, ptx: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    let head = format!(
        "{MAGIC} key={check:08x} len={} crc={:08x}\n",
        ptx.len(),
        crc32fast::hash(ptx.as_bytes())
    );
    tmp.write_all(head.as_bytes())?;
    tmp.write_all(ptx.as_bytes())?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// The PTX of `source` compiled with `options` by NVRTC `nvrtc` (its version; `None`: unknown,
/// no cache), through the cache in `dir` (`None`: no cache): read from there when an entry
/// checks, else `compile`d and written there. Only `compile`'s error is returned: the cache's
/// own failures cost a compile at most.
pub(crate) fn compile_with<E>(
    dir: Option<&Path>,
    source: &str,
    options: &[String],
    nvrtc: Option<(i32, i32)>,
    compile: impl FnOnce() -> std::result::Result<String, E>,
) -> std::result::Result<(String, Outcome), E> {
    let (Some(dir), Some(version)) = (dir, nvrtc) else {
        return compile().map(|ptx| (ptx, Outcome::Off));
    };
    let (name, check) = key(source, options, version);
    let path = entry(dir, name);
    match std::fs::read(&path) {
        Ok(bytes) => match parse(&bytes, check) {
            Some(ptx) => return Ok((ptx, Outcome::Hit)),
            None => {
                tracing::warn!(path = %path.display(), "a kernel cache entry does not check: compiled again")
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "a kernel cache entry cannot be read: compiled again")
        }
    }
    let ptx = compile()?;
    if let Err(e) = write_entry(dir, &path, check, &ptx) {
        tracing::warn!(path = %path.display(), error = %e, "the kernel cache cannot be written");
    }
    Ok((ptx, Outcome::Miss))
}

/// NVRTC's version (major, minor), or `None` when it cannot be asked. The caller has checked
/// that the library loads ([`super::lib_present`]).
fn nvrtc_version() -> Option<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through the pointers, which point to the two locals
    // above, live for the call; the library was found before (cudarc's loader would panic
    // without it, which the callers' `lib_present` check rules out).
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// `source` compiled to PTX by NVRTC for the virtual architecture `arch` (`compute_90`),
/// through the cache `STRATA_KERNEL_CACHE` names when it is set. NVRTC must load (the caller
/// checks [`super::lib_present`]); the error is NVRTC's message (its log on a compile error).
pub(crate) fn compile_ptx(
    source: &str,
    arch: &str,
) -> std::result::Result<(String, Outcome), String> {
    compile_ptx_in(std::env::var_os(ENV).as_deref().map(Path::new), source, arch)
}

/// [`compile_ptx`] with the cache in `dir` (`None`: none).
pub(crate) fn compile_ptx_in(
    dir: Option<&Path>,
    source: &str,
    arch: &str,
) -> std::result::Result<(String, Outcome), String> {
    let options = vec![format!("--gpu-architecture={arch}")];
    let version = dir.and_then(|_| nvrtc_version());
    compile_with(dir, source, &options, version, || {
        let opts = cudarc::nvrtc::CompileOptions { options: options.clone(), ..Default::default() };
        cudarc::nvrtc::compile_ptx_with_opts(source, opts)
            .map(|ptx| ptx.to_src())
            .map_err(|e| e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    const V: Option<(i32, i32)> = Some((13, 0));

    fn opts(arch: &str) -> Vec<String> {
        vec![format!("--gpu-architecture={arch}")]
    }

    /// A compile that counts its calls and returns `ptx`.
    fn counted<'a>(
        calls: &'a Cell<u32>,
        ptx: &'a str,
    ) -> impl FnOnce() -> Result<String, String> + 'a {
        move || {
            calls.set(calls.get() + 1);
            Ok(ptx.to_string())
        }
    }

    #[test]
    fn the_key_covers_source_options_and_nvrtc_version() {
        let base = key("src", &opts("compute_90"), (13, 0));
        assert_eq!(base, key("src", &opts("compute_90"), (13, 0)), "the same inputs, the same key");
        for other in [
            key("src2", &opts("compute_90"), (13, 0)),
            key("src", &opts("compute_80"), (13, 0)),
            key("src", &opts("compute_90"), (13, 1)),
            key("src", &opts("compute_90"), (12, 9)),
            key("src", &[], (13, 0)),
        ] {
            assert_ne!(base.0, other.0);
            assert_ne!(base.1, other.1);
        }
        // Fields are delimited by their lengths: moving a byte between two fields changes it.
        assert_ne!(key("b", &["a".into()], (1, 0)).0, key("", &["ab".into()], (1, 0)).0);
        // FNV-1a's published value for "a" (the same hash on every machine and release).
        let mut f = Fnv::new();
        f.write(b"a");
        assert_eq!(f.0, 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn a_second_compile_reads_the_entry_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let calls = Cell::new(0);
        let o = opts("compute_90");
        let first = compile_with(Some(dir.path()), "src", &o, V, counted(&calls, "PTX 1")).unwrap();
        assert_eq!(first, ("PTX 1".to_string(), Outcome::Miss));
        let again = compile_with(Some(dir.path()), "src", &o, V, counted(&calls, "other")).unwrap();
        assert_eq!(again, ("PTX 1".to_string(), Outcome::Hit));
        assert_eq!(calls.get(), 1, "the second compile was not run");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(
            names,
            [format!("{:016x}.ptx", key("src", &o, (13, 0)).0)],
            "one entry, no temp file"
        );
        // Another NVRTC, another entry: compiled.
        let newer =
            compile_with(Some(dir.path()), "src", &o, Some((13, 1)), counted(&calls, "PTX 2"));
        assert_eq!(newer.unwrap(), ("PTX 2".to_string(), Outcome::Miss));
    }

    #[test]
    fn a_corrupt_or_foreign_entry_is_compiled_again_and_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let o = opts("compute_90");
        let calls = Cell::new(0);
        compile_with(Some(dir.path()), "src", &o, V, counted(&calls, "PTX")).unwrap();
        let path = entry(dir.path(), key("src", &o, (13, 0)).0);
        let good = std::fs::read(&path).unwrap();
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        let mut foreign = good.clone();
        foreign[MAGIC.len() + 5] ^= 1; // the key check's first hex digit
        for bad in [
            good[..good.len() - 1].to_vec(), // truncated
            flipped,                         // a flipped bit in the PTX
            foreign,                         // another key's entry under this name
            b"\xff\xfe not text".to_vec(),
            Vec::new(),
        ] {
            std::fs::write(&path, &bad).unwrap();
            let before = calls.get();
            let r = compile_with(Some(dir.path()), "src", &o, V, counted(&calls, "PTX")).unwrap();
            assert_eq!(r, ("PTX".to_string(), Outcome::Miss));
            assert_eq!(calls.get(), before + 1, "compiled again");
            assert_eq!(std::fs::read(&path).unwrap(), good, "rewritten whole");
        }
        // An entry that cannot be read (a folder in its place): compiled, not an error.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let r = compile_with(Some(dir.path()), "src", &o, V, counted(&calls, "PTX")).unwrap();
        assert_eq!(r.1, Outcome::Miss);
    }

    #[test]
    fn no_cache_a_cache_that_cannot_be_written_and_compile_errors() {
        let calls = Cell::new(0);
        let o = opts("compute_90");
        let off = compile_with(None, "src", &o, V, counted(&calls, "PTX")).unwrap();
        assert_eq!(off.1, Outcome::Off);
        let dir = tempfile::tempdir().unwrap();
        let unknown =
            compile_with(Some(dir.path()), "src", &o, None, counted(&calls, "PTX")).unwrap();
        assert_eq!(unknown.1, Outcome::Off, "NVRTC's version unknown: no cache");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // A file where the folder should be: the PTX all the same.
        let file = dir.path().join("not-a-folder");
        std::fs::write(&file, b"x").unwrap();
        let r = compile_with(Some(&file), "src", &o, V, counted(&calls, "PTX")).unwrap();
        assert_eq!(r, ("PTX".to_string(), Outcome::Miss));
        // A compile error is returned and not cached.
        let err = compile_with(Some(dir.path()), "bad", &o, V, || Err::<String, _>("syntax"));
        assert_eq!(err, Err("syntax"));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "only the file made above");
    }

    /// The real NVRTC through the cache: the second compile of a program is a hit with the same
    /// PTX. Without NVRTC a SKIP line, or a failure under `STRATA_REQUIRE_NVRTC=1` (CI).
    #[test]
    fn kernel_cache_second_nvrtc_compile_is_a_hit() {
        if !super::super::lib_present(super::super::Lib::Nvrtc) {
            assert!(
                std::env::var("STRATA_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "STRATA_REQUIRE_NVRTC=1 but no libnvrtc.so loads"
            );
            let _ = writeln!(
                std::io::stderr(),
                "SKIP kernel_cache_second_nvrtc_compile_is_a_hit: no libnvrtc.so"
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let src = include_str!("../../../cuda/verify.cu");
        let (first, o1) = compile_ptx_in(Some(dir.path()), src, "compute_90").unwrap();
        let (second, o2) = compile_ptx_in(Some(dir.path()), src, "compute_90").unwrap();
        assert_eq!((o1, o2), (Outcome::Miss, Outcome::Hit));
        assert_eq!(first, second);
        assert!(first.contains(".entry strata_checksum("), "PTX of verify.cu");
        assert!(nvrtc_version().is_some_and(|(major, _)| major >= 11));
    }
}

//! Paths that name something other than a regular file (a FIFO, a socket, a device, a
//! directory where a file is expected) are refused with [`Error::NotAFile`] before anything is
//! read: as the checkpoint itself, as a sharded checkpoint's index, as a shard an index names,
//! as a checkpoint's file in a directory, and as a save's target.
//!
//! A FIFO used to block the load forever (reading it waits for a writer): every load here runs
//! on its own thread under a deadline, so that a regression fails instead of hanging the suite.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use strata::{DType, Error, LoadOptions, Store};

/// How long a refusal may take: it reads nothing, so anything near this is a hang.
const DEADLINE: Duration = Duration::from_secs(20);

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call, which only reads it.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o644) };
    assert_eq!(rc, 0, "mkfifo {}: {}", path.display(), std::io::Error::last_os_error());
}

/// Loads `path` on another thread; the load's error, or a failure if it hangs or succeeds.
fn load_error(path: &Path) -> Error {
    let (tx, rx) = mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let store = Store::builder().host_backend().build().unwrap();
        let _ = tx.send(store.load_checkpoint(&p, LoadOptions::default()).map(|l| l.len()));
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(Err(e)) => e,
        Ok(Ok(n)) => panic!("{}: loaded {n} tensors, expected a refusal", path.display()),
        Err(_) => panic!("{}: the load hung (still blocked after {DEADLINE:?})", path.display()),
    }
}

/// Asserts that `e` refuses `path` as `what`.
fn refused(e: &Error, path: &Path, what: &str) {
    match e {
        Error::NotAFile { path: p, what: w } => {
            assert_eq!(p, path, "{e}");
            assert_eq!(*w, what, "{e}");
            let msg = e.to_string();
            assert!(msg.contains("not a regular file") && msg.contains(what), "{msg}");
        }
        other => panic!("{}: expected NotAFile ({what}), got {other:?}", path.display()),
    }
}

/// A one-tensor safetensors file at `path`.
fn write_file(path: &Path, name: &str) {
    let src = Store::builder().host_backend().build().unwrap();
    let id = src.put(name, DType::F32, &[2], &[1u8; 8]).unwrap();
    src.save_safetensors(path, &[id]).unwrap();
}

/// A sharded checkpoint of two shards and its index in `dir`; returns the index's path and the
/// second shard's.
fn write_sharded(dir: &Path) -> (PathBuf, PathBuf) {
    let a = dir.join("model-00001-of-00002.safetensors");
    let b = dir.join("model-00002-of-00002.safetensors");
    write_file(&a, "a");
    write_file(&b, "b");
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    (index, b)
}

#[test]
fn a_fifo_as_the_checkpoint_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.safetensors");
    mkfifo(&fifo);
    refused(&load_error(&fifo), &fifo, "a FIFO");
}

#[test]
fn a_fifo_as_the_index_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let (index, _) = write_sharded(dir.path());
    std::fs::remove_file(&index).unwrap();
    mkfifo(&index);
    // By its path, and through its directory.
    refused(&load_error(&index), &index, "a FIFO");
    refused(&load_error(dir.path()), &index, "a FIFO");
}

#[test]
fn a_fifo_as_a_shard_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let (index, shard) = write_sharded(dir.path());
    std::fs::remove_file(&shard).unwrap();
    mkfifo(&shard);
    refused(&load_error(&index), &shard, "a FIFO");
    refused(&load_error(dir.path()), &shard, "a FIFO");
}

#[test]
fn a_fifo_among_a_directorys_files_is_refused_not_skipped() {
    let dir = tempfile::tempdir().unwrap();
    write_file(&dir.path().join("a.safetensors"), "a");
    let fifo = dir.path().join("b.safetensors");
    mkfifo(&fifo);
    // Skipping it would load the checkpoint without b's tensors.
    refused(&load_error(dir.path()), &fifo, "a FIFO");
    // A file of another name is none of the checkpoint's: still left alone.
    std::fs::remove_file(&fifo).unwrap();
    mkfifo(&dir.path().join("notes.txt"));
    let store = Store::builder().host_backend().build().unwrap();
    assert_eq!(store.load_checkpoint(dir.path(), LoadOptions::default()).unwrap().len(), 1);
}

#[test]
fn sockets_devices_and_directories_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("socket.safetensors");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    refused(&load_error(&socket), &socket, "a socket");
    // Devices, through a link as a download cache would make one: /dev/zero would read forever.
    for dev in ["/dev/null", "/dev/zero"] {
        let link = dir.path().join(format!("{}.safetensors", &dev[5..]));
        std::os::unix::fs::symlink(dev, &link).unwrap();
        refused(&load_error(&link), &link, "a character device");
    }
    // A shard that is a directory.
    let sharded = dir.path().join("sharded");
    std::fs::create_dir(&sharded).unwrap();
    let (index, shard) = write_sharded(&sharded);
    std::fs::remove_file(&shard).unwrap();
    std::fs::create_dir(&shard).unwrap();
    refused(&load_error(&index), &shard, "a directory");
}

#[test]
fn a_save_onto_a_fifo_or_a_device_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder().host_backend().build().unwrap();
    let id = store.put("w", DType::F32, &[2], &[0u8; 8]).unwrap();
    let fifo = dir.path().join("out.safetensors");
    mkfifo(&fifo);
    let e = store.save_safetensors(&fifo, &[id]).unwrap_err();
    refused(&e, &fifo, "a FIFO");
    let null = dir.path().join("null.safetensors");
    std::os::unix::fs::symlink("/dev/null", &null).unwrap();
    let e = store.save_safetensors(&null, &[id]).unwrap_err();
    refused(&e, Path::new("/dev/null"), "a character device");
}

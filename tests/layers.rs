//! The layering check: every `crate::` path in `src/` names a module of its own layer or of a
//! layer below it, by the layer table in `docs/layers.md` (the one place the table lives:
//! `lib.rs` includes it in the crate docs and `docs/architecture.md` must show it as written).
//!
//! Paths are read from the code with comments and string literals left out; a path to an item
//! `lib.rs` re-exports (`crate::Store`) counts as a path to the module it comes from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const TABLE: &str = include_str!("../docs/layers.md");

/// The layers, top first, each with the top-level modules of `src/` it holds (`cli`, `lib`, ...).
fn layers() -> Vec<(String, Vec<String>)> {
    TABLE
        .lines()
        .skip(2)
        .filter(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let mods = cells[2]
                .split(',')
                .map(|m| m.trim().trim_matches('`').trim_end_matches('/').trim_end_matches(".rs"))
                .map(str::to_string)
                .collect();
            (cells[1].to_string(), mods)
        })
        .collect()
}

/// The code of a Rust file without comments, string and char literals (replaced by spaces).
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            }
            b'r' if b.get(i + 1) == Some(&b'"') || (b.get(i + 1) == Some(&b'#')) => {
                // A raw string: r"..." or r#"..."#.
                let start = i;
                i += 1;
                let mut hashes = 0;
                while b.get(i) == Some(&b'#') {
                    hashes += 1;
                    i += 1;
                }
                if b.get(i) != Some(&b'"') || (start > 0 && is_ident(b[start - 1])) {
                    out.push('r');
                    i = start + 1;
                    continue;
                }
                i += 1;
                let end: Vec<u8> =
                    std::iter::once(b'"').chain(std::iter::repeat_n(b'#', hashes)).collect();
                while i < b.len() && !b[i..].starts_with(&end) {
                    i += 1;
                }
                i += end.len();
                out.push(' ');
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push(' ');
            }
            b'\'' if b.get(i + 2) == Some(&b'\'') || (b.get(i + 1) == Some(&b'\\')) => {
                // A char literal ('a', '\n', '\''); a lifetime ('a) is left alone.
                i += 1;
                while i < b.len() && b[i] != b'\'' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push(' ');
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The first segment of every `crate::` path in `code`: `crate::a::b` gives `a`, and
/// `use crate::{a, b::c, d}` gives `a`, `b`, `d`.
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = code.as_bytes();
    let mut from = 0;
    while let Some(at) = code[from..].find("crate::") {
        let start = from + at;
        from = start + 7;
        if start > 0 && (is_ident(b[start - 1]) || b[start - 1] == b'$') {
            continue;
        }
        let rest = code[from..].trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level names of a brace group (nested groups belong to their first name).
            let mut depth = 0;
            let mut name = String::new();
            let mut take = true;
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        if !name.is_empty() {
                            out.push(std::mem::take(&mut name));
                        }
                        take = true;
                    }
                    c if depth == 0 && take && (c.is_alphanumeric() || c == '_') => name.push(c),
                    _ if depth == 0 && !name.is_empty() => take = false,
                    _ => {}
                }
            }
            if !name.is_empty() {
                out.push(name);
            }
        } else {
            let name: String =
                rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                out.push(name);
            }
        }
    }
    out
}

/// `lib.rs`'s re-exports: a root name (`Store`, `format_size`) to the module it comes from.
fn root_names(lib: &str) -> BTreeMap<String, String> {
    let code = code_only(lib);
    let mut names = BTreeMap::new();
    for stmt in code.split(';') {
        let s = stmt.trim();
        let Some(path) = s.strip_prefix("pub use ") else { continue };
        let path = path.trim().trim_start_matches("crate::");
        let (module, items) = match path.split_once("::") {
            Some(x) => x,
            None => continue,
        };
        let items = items.trim();
        let list: Vec<&str> = match items.rsplit_once("::") {
            Some((_, last)) => vec![last],
            None => vec![items],
        };
        for item in list {
            for name in item.trim_matches(|c| c == '{' || c == '}').split(',') {
                let name = name.split_whitespace().last().unwrap_or("").to_string();
                if !name.is_empty() {
                    names.insert(name, module.to_string());
                }
            }
        }
    }
    // Functions defined in lib.rs itself, by the layer of what they call.
    for (f, module) in [
        ("cuda_device_count", "backend"),
        ("ignore_file_size_signal", "tiers"),
        ("disk_space_available", "tiers"),
    ] {
        names.insert(f.into(), module.into());
    }
    names
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every import of a higher layer, as `file: layer imports module (layer)`.
fn violations() -> (Vec<String>, BTreeMap<(String, String), usize>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let layers = layers();
    let layer_of =
        |module: &str| layers.iter().position(|(_, mods)| mods.iter().any(|m| m == module));
    let lib = std::fs::read_to_string(root.join("lib.rs")).unwrap();
    let roots = root_names(&lib);
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut bad = Vec::new();
    let mut graph = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&root).unwrap().to_string_lossy().into_owned();
        let top = rel.split('/').next().unwrap().trim_end_matches(".rs").to_string();
        let mine = layer_of(&top)
            .unwrap_or_else(|| panic!("{rel}: module {top} is in no layer of docs/layers.md"));
        let code = code_only(&std::fs::read_to_string(&f).unwrap());
        for name in crate_paths(&code) {
            let module = if layer_of(&name).is_some() {
                name.clone()
            } else if let Some(mut m) = roots.get(&name).cloned() {
                // A re-export of a re-export (`pub use placement::policy;`, then `policy::X`).
                while layer_of(&m).is_none() {
                    m = roots.get(&m).cloned().unwrap_or_else(|| {
                        panic!("lib.rs re-exports {name} from {m}, a module in no layer")
                    });
                }
                m
            } else if top == "lib" {
                continue; // lib.rs names its own modules' items
            } else {
                panic!("{rel}: crate::{name} is neither a module nor a re-export of lib.rs");
            };
            let theirs = layer_of(&module).unwrap();
            *graph.entry((layers[mine].0.clone(), layers[theirs].0.clone())).or_insert(0) += 1;
            if theirs < mine {
                bad.push(format!(
                    "{rel} ({}) imports crate::{name}, of {} ({}), a higher layer",
                    layers[mine].0, module, layers[theirs].0
                ));
            }
        }
    }
    bad.sort();
    bad.dedup();
    (bad, graph)
}

#[test]
fn no_layer_imports_a_higher_one() {
    let (bad, graph) = violations();
    if std::env::var_os("STRATA_LAYERS_GRAPH").is_some() {
        for ((from, to), n) in &graph {
            if from != to {
                println!("{from} -> {to}: {n}");
            }
        }
    }
    assert!(
        bad.is_empty(),
        "imports against the layer order (docs/layers.md):\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_module_is_in_the_table_and_the_docs_show_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let layers = layers();
    let mut tops: Vec<String> = std::fs::read_dir(root.join("src"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    tops.sort();
    for t in &tops {
        assert!(
            layers.iter().any(|(_, m)| m.contains(t)),
            "src/{t} is in no layer of docs/layers.md"
        );
    }
    for (name, mods) in &layers {
        for m in mods {
            assert!(tops.contains(m), "docs/layers.md: layer {name} names {m}, which src/ lacks");
        }
    }
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    assert!(lib.contains("include_str!(\"../docs/layers.md\")"), "lib.rs must show the table");
    let arch = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    assert!(
        arch.contains(TABLE.trim()),
        "docs/architecture.md must show docs/layers.md as written"
    );
}

#[test]
fn the_reader_finds_paths_and_skips_comments_and_strings() {
    let code = code_only(
        "use crate::{a, b::{c, d}, e as f};\n// crate::x\nlet s = \"crate::y\"; crate::g::h();\n\
         /* crate::z */ let r = r#\"crate::w\"#; let c = 'x'; fn f<'a>() {} crate::k;",
    );
    assert_eq!(crate_paths(&code), ["a", "b", "e", "g", "k"]);
    let roots =
        root_names("pub use api::{Store, StoreBuilder};\npub use types::{format_size, DType};");
    assert_eq!(roots["Store"], "api");
    assert_eq!(roots["format_size"], "types");
}

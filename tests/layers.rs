//! The layering check: every path in `src/` from one file to another names a file of its own
//! layer or of a layer below it, by the layer table in `docs/layers.md` (the one place the table
//! lives: `lib.rs` includes it in the crate docs and `docs/architecture.md` must show it as
//! written). Each layer is a folder of `src/` (or a root file: `lib.rs`, `main.rs`).
//!
//! Three rules:
//! - **call order**: no file names a file of a higher layer;
//! - **named skips**: a layer that names a layer other than the one directly below it (or the
//!   bottom one, which its row says every layer may use) is listed in [`SKIPS`] with the reason;
//! - **no two-file circle**: no two files of one layer name each other, unless listed in
//!   [`CIRCLES`] with the reason. Each such pair is one concern in two files, or a shared piece
//!   that belongs below both.
//!
//! Paths are read from the code with comments and string literals left out: `crate::` and
//! `super::` paths (`super::` from the module the file, or an inline `mod` in it, is), and in the
//! binary's files (`main.rs` and the modules it declares) `strata::` paths, which name the
//! library. A path names the deepest file it reaches (`crate::migrate::room::alloc` names
//! `migrate/room.rs`, `crate::migrate::State` names `migrate/mod.rs`, which re-exports it). In the
//! library a path to an item `lib.rs` re-exports (`crate::Store`) names the file that item's path
//! in `lib.rs` reaches; the binary, which sees only the public API, names `lib.rs` for such an
//! item, and a public module's file for a path into it (`strata::optim::Sgd`). A module's own
//! children named without a prefix (`mod copy; use copy::Done;`) are its parts, not imports.
//!
//! Beside the layers, one home per item: every public item of the library has one public path
//! ([`every_public_item_has_one_path`]), read from the same code (`pub mod`, `pub` items and
//! `pub use` re-exports, followed through `use`s to the file that defines the item).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const TABLE: &str = include_str!("../docs/layers.md");

/// The layer skips the code makes on purpose: (layer, the layer it names, why). Any other skip
/// fails the check, and so does an entry here that no path makes any more.
const SKIPS: &[(&str, &str, &str)] = &[
    (
        "command line",
        "compute",
        "`train-demo` and `bench` run the optimizer, the MLP's GEMMs, plans and probes: no candle",
    ),
    ("command line", "public API", "every command opens a store; `demo`, `load` need no more"),
    ("candle", "public API", "the models read and write store tensors through views and streams"),
    ("candle", "tiers", "a trainer's and an adapter's files are opened as user files are"),
    ("candle", "backend", "the fused ops and the device AdamW launch through checked launchers"),
    ("compute", "tiers", "`plan` reads a checkpoint's header as the tier reads user files"),
    ("compute", "backend", "the GEMMs, kernels, optimizer and probes launch through the backend"),
    ("public API", "placement", "the builder makes the policy a store runs"),
    ("public API", "residency", "the builder makes the records; views and hints read a tensor's"),
    ("public API", "tiers", "the builder reserves the tiers; tensor files are the Disk tier's"),
    (
        "public API",
        "backend",
        "the builder picks the backend; streams and views hand out its handles",
    ),
    ("migration", "residency", "migration commits what it moved to the records"),
    ("migration", "tiers", "migration allocates, copies and frees tier memory"),
    ("migration", "backend", "migration issues copies on the backend's streams, waits for events"),
    ("placement", "tiers", "decisions read the tiers' books: what fits where"),
    (
        "residency",
        "backend",
        "a replica's flight and a stream's last use hold the backend's events",
    ),
];

/// Two-file circles kept on purpose: (file, file, why), each pair in alphabetical order.
const CIRCLES: &[(&str, &str, &str)] = &[(
    "base/error.rs",
    "base/types.rs",
    "the error names the tiers, ids and dtypes it is about, and parsing a tier or a dtype, \
     or sizing a tensor of a shape, fails with it: one vocabulary in two files",
)];

/// The layers, top first, each with the entries of `src/` it holds (`cli`, `main`, `lib`, ...:
/// a folder without its `/`, a file without its `.rs`).
fn layers(table: &str) -> Vec<(String, Vec<String>)> {
    table
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

/// A path read from a `use` tree or an expression: its segments, and the name it binds (the
/// last segment, or the `as` name).
type UsePath = (Vec<String>, String);

/// The paths of the use tree (or the path of an expression) at the start of `rest`, each
/// after `prefix`: `a::{b, c::d as e}` gives `a::b` and `a::c::d` (bound as `e`); `a::b::<T>`
/// and `a::b(..)` give `a::b`.
fn use_tree(rest: &str, prefix: &[String], out: &mut Vec<UsePath>) -> usize {
    let b = rest.as_bytes();
    let mut i = 0;
    let mut segs = prefix.to_vec();
    loop {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if b.get(i) == Some(&b'{') {
            i += 1;
            loop {
                while i < b.len() && (b[i].is_ascii_whitespace() || b[i] == b',') {
                    i += 1;
                }
                if i >= b.len() || b[i] == b'}' {
                    return i + 1;
                }
                i += use_tree(&rest[i..], &segs, out);
            }
        }
        let start = i;
        while i < b.len() && is_ident(b[i]) {
            i += 1;
        }
        if i == start {
            // `*`, or nothing: the path so far.
            if b.get(i) == Some(&b'*') {
                i += 1;
            }
            if segs.len() > prefix.len() {
                let last = segs.last().cloned().unwrap_or_default();
                out.push((segs, last));
            }
            return i;
        }
        segs.push(rest[start..i].to_string());
        let after = rest[i..].trim_start();
        if let Some(more) = after.strip_prefix("::") {
            if !more.trim_start().starts_with('<') {
                i = rest.len() - more.len();
                continue;
            }
        }
        let mut name = segs.last().cloned().unwrap_or_default();
        if let Some(alias) = after.strip_prefix("as ") {
            let alias = alias.trim_start();
            let n: String =
                alias.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            i = rest.len() - alias.len() + n.len();
            name = n;
        }
        out.push((segs, name));
        return i;
    }
}

/// Every path in `code` that starts with `prefix::` (`crate`, `super`, `strata`), with its
/// offset; `super::super::` counts as one prefix of two.
fn paths_after(code: &str, prefix: &str) -> Vec<(usize, usize, Vec<String>)> {
    let mut out = Vec::new();
    let b = code.as_bytes();
    let head = format!("{prefix}::");
    let mut from = 0;
    while let Some(at) = code[from..].find(&head) {
        let start = from + at;
        from = start + head.len();
        if start > 0 && (is_ident(b[start - 1]) || b[start - 1] == b'$' || b[start - 1] == b':') {
            continue;
        }
        let mut ups = 1;
        while code[from..].starts_with(&head) {
            ups += 1;
            from += head.len();
        }
        let mut found = Vec::new();
        from += use_tree(&code[from..], &[], &mut found);
        out.extend(found.into_iter().map(|(p, _)| (start, ups, p)));
    }
    out
}

/// The first segment of every `crate::` path in `code`: `crate::a::b` gives `a`, and
/// `use crate::{a, b::c, d}` gives `a`, `b`, `d` (a nested group belongs to its first name).
fn crate_paths(code: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut group = None;
    for (start, _, p) in paths_after(code, "crate") {
        if group == Some(start) && out.last() == Some(&p[0]) {
            continue;
        }
        group = Some(start);
        out.push(p[0].clone());
    }
    out
}

/// `lib.rs`'s re-exports: a root name (`Store`, `optim`) to the path it re-exports
/// (`api::Store`, `compute::optim`).
fn root_names(lib: &str) -> BTreeMap<String, Vec<String>> {
    let code = code_only(lib);
    let mut names = BTreeMap::new();
    for stmt in code.split(';') {
        let Some(at) = stmt.find("pub use ") else { continue };
        let tree = stmt[at + 8..].trim().trim_start_matches("crate::");
        let mut found = Vec::new();
        use_tree(tree, &[], &mut found);
        for (path, name) in found {
            names.insert(name, path);
        }
    }
    names
}

/// The files of a tree of sources, by their path under `src/`, each as code only.
type Files = BTreeMap<String, String>;

/// The file of module `segs` (`["migrate", "room"]`): `migrate/room.rs` or `migrate/room/mod.rs`.
fn module_file(files: &Files, segs: &[String]) -> Option<String> {
    let stem = segs.join("/");
    [format!("{stem}.rs"), format!("{stem}/mod.rs")].into_iter().find(|f| files.contains_key(f))
}

/// The deepest file `segs` reaches from the root; `None` when not even its first segment is a
/// module.
fn deepest_file(files: &Files, segs: &[String]) -> Option<String> {
    (1..=segs.len()).rev().find_map(|n| module_file(files, &segs[..n]))
}

/// The module a file is (`migrate/room.rs` is `migrate::room`; `lib.rs` and `main.rs` the root).
fn module_of(rel: &str) -> Vec<String> {
    if rel == "lib.rs" || rel == "main.rs" {
        return Vec::new();
    }
    let mut segs: Vec<String> =
        rel.trim_end_matches(".rs").split('/').map(str::to_string).collect();
    if segs.last().is_some_and(|s| s == "mod") {
        segs.pop();
    }
    segs
}

/// The inline modules (`mod tests { ... }`) of `code`: their name and the range of their body.
fn inline_mods(code: &str) -> Vec<(String, std::ops::Range<usize>)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("mod ") {
        let start = from + at;
        from = start + 4;
        if start > 0 && is_ident(b[start - 1]) {
            continue;
        }
        let rest = code[from..].trim_start();
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let after = rest[name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('{') {
            continue;
        }
        let open = code.len() - after.len();
        let mut depth = 0;
        let end = (open..b.len())
            .find(|&i| {
                match b[i] {
                    b'{' => depth += 1,
                    b'}' => depth -= 1,
                    _ => {}
                }
                depth == 0
            })
            .unwrap_or(b.len());
        out.push((name, open..end));
    }
    out
}

/// What a tree of sources imports: which file each file names, and against which rules.
#[derive(Debug, Default)]
struct Report {
    /// Imports of a higher layer.
    against_order: Vec<String>,
    /// Layer skips not in the skip table.
    unlisted_skips: Vec<String>,
    /// Two-file circles not in the circle table.
    circles: Vec<String>,
    /// Entries of the skip or circle table that nothing uses.
    stale: Vec<String>,
    /// (layer, layer it names): the count of paths.
    graph: BTreeMap<(String, String), usize>,
}

/// Whether `root` (the code of `lib.rs` or `main.rs`) defines an item `name` itself.
fn defines(root: &str, name: &str) -> bool {
    ["fn", "struct", "enum", "const", "static", "type", "trait", "macro_rules!"]
        .iter()
        .any(|kw| root.contains(&format!("{kw} {name}")))
}

/// The file a path names, from the root of the library (`crate::` in the library, `strata::` in
/// the binary) or of the binary (`crate::` in the binary's files): the deepest module file it
/// reaches, through `lib.rs`'s re-exports where it starts with one (a re-export of a re-export,
/// `pub use a::m;` and then `pub use m::X;`, takes two); the root file for an item the
/// root defines itself; `None` for an external crate `lib.rs` re-exports (`cudarc`).
fn file_named(
    files: &Files,
    roots: &BTreeMap<String, Vec<String>>,
    root: &str,
    path: &[String],
) -> Result<Option<String>, String> {
    let mut segs = path.to_vec();
    for _ in 0..4 {
        if let Some(f) = deepest_file(files, &segs) {
            return Ok(Some(f));
        }
        match roots.get(&segs[0]) {
            Some(to) if to[..] != segs[..1] => {
                segs = to.iter().chain(&segs[1..]).cloned().collect();
            }
            Some(_) => return Ok(None),
            None => break,
        }
    }
    if files.get(root).is_some_and(|code| defines(code, &segs[0])) {
        return Ok(Some(root.to_string()));
    }
    Err(format!("no file of src/ for the path {}", path.join("::")))
}

/// The file a path of the binary into the library (`strata::...`) names. The binary sees the
/// public API: an item `lib.rs` re-exports or defines (`strata::Store`, `strata::DType`) names
/// `lib.rs`; a path into a public module names that module's file (`strata::optim::Sgd` names
/// `compute/optim/mod.rs`, `strata::candle::text::Tokenizer` names `candle/text.rs`).
fn public_file(
    files: &Files,
    roots: &BTreeMap<String, Vec<String>>,
    path: &[String],
) -> Result<Option<String>, String> {
    let module = |segs: &[String]| module_file(files, segs).is_some();
    match roots.get(&path[0]) {
        _ if module(&path[..1]) => file_named(files, roots, "lib.rs", path),
        Some(to) if module(to) => file_named(files, roots, "lib.rs", path),
        Some(to) if to[..] == path[..1] => Ok(None),
        Some(_) => Ok(Some("lib.rs".into())),
        None if files.get("lib.rs").is_some_and(|code| defines(code, &path[0])) => {
            Ok(Some("lib.rs".into()))
        }
        None => Err(format!("strata::{} is not in the library's public API", path.join("::"))),
    }
}

/// The modules a root file declares from files of their own (`mod cli;`, not `mod tests { .. }`).
fn file_mods(code: &str) -> BTreeSet<String> {
    code.split(';')
        .filter_map(|stmt| {
            let s = stmt.trim_end();
            let at = s.rfind("mod ")?;
            let name = s[at + 4..].trim();
            let ok = !name.is_empty()
                && name.bytes().all(is_ident)
                && (at == 0 || !is_ident(s.as_bytes()[at - 1]));
            ok.then(|| name.to_string())
        })
        .collect()
}

/// Checks `files` (the code of every file under `src/`) against `table` and the allowed skips
/// and circles.
fn check(
    table: &str,
    files: &Files,
    skips: &[(&str, &str, &str)],
    allowed_circles: &[(&str, &str, &str)],
) -> Report {
    let layers = layers(table);
    let bottom = layers.len() - 1;
    let top_of =
        |rel: &str| rel.split('/').next().unwrap_or(rel).trim_end_matches(".rs").to_string();
    let layer_of = |rel: &str| {
        let top = top_of(rel);
        layers
            .iter()
            .position(|(_, m)| m.contains(&top))
            .unwrap_or_else(|| panic!("src/{rel}: {top} is in no layer of docs/layers.md"))
    };
    let lib_roots = files.get("lib.rs").map(|l| root_names(l)).unwrap_or_default();
    let no_roots = BTreeMap::new();
    // The binary: main.rs and the modules it declares (`mod cli;`).
    let binary: BTreeSet<String> = files
        .get("main.rs")
        .map(|m| {
            let mut mods: BTreeSet<String> = file_mods(m);
            mods.insert("main".into());
            mods
        })
        .unwrap_or_default();
    let mut edges: BTreeSet<(String, String)> = BTreeSet::new();
    let mut report = Report::default();
    let mut used_skips = BTreeSet::new();
    for (rel, code) in files {
        if rel == "lib.rs" {
            continue; // the root names its own modules
        }
        let in_binary = binary.contains(&top_of(rel));
        let mut named = Vec::new();
        let name = |roots, root: &str, p: &[String]| {
            file_named(files, roots, root, p).unwrap_or_else(|e| panic!("src/{rel}: {e}"))
        };
        for (_, _, p) in paths_after(code, "crate") {
            named.extend(if in_binary {
                name(&no_roots, "main.rs", &p)
            } else {
                name(&lib_roots, "lib.rs", &p)
            });
        }
        if in_binary {
            for (_, _, p) in paths_after(code, "strata") {
                named.extend(
                    public_file(files, &lib_roots, &p).unwrap_or_else(|e| panic!("src/{rel}: {e}")),
                );
            }
        }
        let me = module_of(rel);
        let inline = inline_mods(code);
        for (at, ups, p) in paths_after(code, "super") {
            let mut module = me.clone();
            module.extend(inline.iter().filter(|(_, r)| r.contains(&at)).map(|(n, _)| n.clone()));
            if ups > module.len() {
                continue;
            }
            module.truncate(module.len() - ups);
            module.extend(p);
            named.extend(deepest_file(files, &module));
        }
        let mine = layer_of(rel);
        for to in named {
            if &to == rel {
                continue;
            }
            let theirs = layer_of(&to);
            let (a, b) = (&layers[mine].0, &layers[theirs].0);
            *report.graph.entry((a.clone(), b.clone())).or_insert(0) += 1;
            if theirs < mine {
                report.against_order.push(format!("{rel} ({a}) names {to} ({b}), a higher layer"));
            } else if theirs > mine + 1 && theirs != bottom {
                if skips.iter().any(|(x, y, _)| x == a && y == b) {
                    used_skips.insert((a.clone(), b.clone()));
                } else {
                    report.unlisted_skips.push(format!(
                        "{rel} ({a}) names {to} ({b}): a skip of the layer order not in SKIPS"
                    ));
                }
            }
            if theirs == mine {
                edges.insert((rel.clone(), to));
            }
        }
    }
    let mut used_circles = BTreeSet::new();
    for (a, b) in &edges {
        if a < b && edges.contains(&(b.clone(), a.clone())) {
            if allowed_circles.iter().any(|(x, y, _)| x == a && y == b) {
                used_circles.insert((a.clone(), b.clone()));
            } else {
                report.circles.push(format!("{a} and {b} name each other"));
            }
        }
    }
    for (a, b, _) in skips {
        if !used_skips.contains(&(a.to_string(), b.to_string())) {
            report.stale.push(format!("SKIPS lists {a} -> {b}, which no path makes"));
        }
    }
    for (a, b, _) in allowed_circles {
        if !used_circles.contains(&(a.to_string(), b.to_string())) {
            report
                .stale
                .push(format!("CIRCLES lists {a} and {b}, which no longer name each other"));
        }
    }
    report.against_order.sort();
    report.against_order.dedup();
    report.unlisted_skips.sort();
    report.unlisted_skips.dedup();
    report
}

/// The code of every Rust file under `dir`, by its path under it.
fn read_tree(dir: &Path, under: &str, out: &mut Files) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let rel = if under.is_empty() { name } else { format!("{under}/{name}") };
        if p.is_dir() {
            read_tree(&p, &rel, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.insert(rel, code_only(&std::fs::read_to_string(&p).unwrap()));
        }
    }
}

fn src() -> Files {
    let mut files = Files::new();
    read_tree(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), "", &mut files);
    files
}

#[test]
fn the_layers_keep_their_order_skips_are_named_and_no_two_files_circle() {
    let report = check(TABLE, &src(), SKIPS, CIRCLES);
    if std::env::var_os("STRATA_LAYERS_GRAPH").is_some() {
        for ((from, to), n) in &report.graph {
            if from != to {
                println!("{from} -> {to}: {n}");
            }
        }
    }
    let mut bad = Vec::new();
    for (what, list) in [
        ("imports against the layer order", &report.against_order),
        ("layer skips not named in SKIPS", &report.unlisted_skips),
        ("two-file circles (move the shared piece below both, or into one)", &report.circles),
        ("allow-list entries nothing needs", &report.stale),
    ] {
        if !list.is_empty() {
            bad.push(format!("{what} (docs/layers.md, tests/layers.rs):\n{}", list.join("\n")));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n\n"));
}

#[test]
fn every_module_is_in_the_table_and_the_docs_show_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let layers = layers(TABLE);
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
    assert_eq!(roots["Store"], ["api", "Store"]);
    assert_eq!(roots["format_size"], ["types", "format_size"]);
    // Whole paths, through groups, turbofish and renames; `super::` counted.
    let paths: Vec<_> = paths_after(
        "use crate::m::{x::{Y, Z as W}, v}; crate::q::r::<u8>(); super::super::s::T;",
        "crate",
    )
    .into_iter()
    .map(|(_, _, p)| p.join("::"))
    .collect();
    assert_eq!(paths, ["m::x::Y", "m::x::Z", "m::v", "q::r"]);
    let sup = paths_after("let a = super::super::s::T; use super::{t, u::V};", "super");
    let sup: Vec<_> = sup.into_iter().map(|(_, ups, p)| (ups, p.join("::"))).collect();
    assert_eq!(sup, [(2, "s::T".to_string()), (1, "t".into()), (1, "u::V".into())]);
}

/// A small tree of sources, for the rules' own tests: a binary above four layers.
const TOY_TABLE: &str = "| layer | where | what |\n|---|---|---|\n\
    | cmd | `cmd/`, `main.rs` | |\n| top | `top/`, `lib.rs` | |\n| mid | `mid/` | |\n\
    | low | `low/` | |\n| bottom | `bottom/` | |\n";

fn toy(files: &[(&str, &str)]) -> Files {
    let mut tree: Files =
        [("lib.rs", "mod top; mod mid; mod low; mod bottom; pub use low::thing::Thing;")]
            .into_iter()
            .chain(files.iter().copied())
            .map(|(f, c)| (f.to_string(), code_only(c)))
            .collect();
    for m in ["top/mod.rs", "mid/mod.rs", "low/mod.rs", "bottom/mod.rs", "low/thing.rs"] {
        tree.entry(m.into()).or_default();
    }
    tree
}

#[test]
fn a_two_file_circle_fails_unless_allowed() {
    // Through `super::` from an inline test module, and a `crate::` path: a circle.
    let files = toy(&[
        ("mid/a.rs", "use crate::mid::b::f; mod tests { use super::super::b::g; }"),
        ("mid/b.rs", "fn g() { super::a::h(); }"),
        ("mid/c.rs", "use crate::mid::a::h;"),
    ]);
    let r = check(TOY_TABLE, &files, &[], &[]);
    assert_eq!(r.circles, ["mid/a.rs and mid/b.rs name each other"]);
    let allowed = [("mid/a.rs", "mid/b.rs", "why")];
    let r = check(TOY_TABLE, &files, &[], &allowed);
    assert!(r.circles.is_empty() && r.stale.is_empty(), "{r:?}");
    // One direction only: no circle, and the allowance is stale.
    let files = toy(&[("mid/a.rs", "use crate::mid::b::f;"), ("mid/b.rs", "")]);
    let r = check(TOY_TABLE, &files, &[], &allowed);
    assert!(r.circles.is_empty());
    assert_eq!(r.stale.len(), 1, "{r:?}");
}

#[test]
fn a_layer_skip_fails_unless_named() {
    // top -> low (through lib.rs's re-export) skips mid; anything may name the bottom layer.
    let files = toy(&[
        ("top/x.rs", "use crate::Thing; use crate::bottom::B;"),
        ("mid/y.rs", "crate::low::f();"),
    ]);
    let r = check(TOY_TABLE, &files, &[], &[]);
    assert_eq!(r.unlisted_skips.len(), 1, "{r:?}");
    assert!(r.unlisted_skips[0].starts_with("top/x.rs (top) names low/thing.rs (low)"));
    let r = check(TOY_TABLE, &files, &[("top", "low", "why")], &[]);
    assert!(r.unlisted_skips.is_empty() && r.stale.is_empty(), "{r:?}");
    // Upwards is against the order, whatever the skip table says.
    let files = toy(&[("low/z.rs", "use crate::mid::M;")]);
    let r = check(TOY_TABLE, &files, &[("top", "low", "why")], &[]);
    assert_eq!(r.against_order.len(), 1, "{r:?}");
    assert_eq!(r.stale.len(), 1, "{r:?}");
}

#[test]
fn the_binary_names_the_library_by_its_public_paths() {
    // main.rs and the module it declares are the binary. `strata::Thing`, an item lib.rs
    // re-exports, is the public API's (lib.rs, in the layer below); `crate::` is the binary's.
    let files = toy(&[
        ("main.rs", "mod cmd; fn main() { cmd::run(); }"),
        ("cmd/mod.rs", "use strata::Thing; pub fn run() { crate::cmd::go::now(); }"),
        ("cmd/go.rs", "pub fn now() {}"),
    ]);
    let r = check(TOY_TABLE, &files, &[], &[]);
    assert!(r.unlisted_skips.is_empty() && r.against_order.is_empty(), "{r:?}");
    assert_eq!(r.graph.get(&("cmd".into(), "top".into())), Some(&1), "{r:?}");
    // A path into a module of a lower layer is that layer's: a skip.
    let files = toy(&[("main.rs", "mod cmd;"), ("cmd/mod.rs", "fn f() { strata::low::f(); }")]);
    let r = check(TOY_TABLE, &files, &[], &[]);
    assert_eq!(r.unlisted_skips.len(), 1, "{r:?}");
    assert!(r.unlisted_skips[0].starts_with("cmd/mod.rs (cmd) names low/mod.rs (low)"), "{r:?}");
}

/// The statements at the top level of a file's code (outside every block): each item's head up
/// to its body or its `;`, a `use` whole.
fn top_statements(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut depth, mut in_use) = (0usize, 0usize);
    for c in code.chars() {
        if depth > 0 {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            continue;
        }
        match c {
            ';' => {
                out.push(std::mem::take(&mut cur));
                in_use = 0;
            }
            '{' if head(&cur).1.starts_with("use ") => {
                in_use += 1;
                cur.push(c);
            }
            '}' if in_use > 0 => {
                in_use -= 1;
                cur.push(c);
            }
            '{' => {
                out.push(std::mem::take(&mut cur));
                depth = 1;
            }
            c => cur.push(c),
        }
    }
    out
}

/// A top-level statement's visibility (`pub`, `pub(crate)`, or empty) and the rest, its
/// attributes left out.
fn head(stmt: &str) -> (&str, &str) {
    let mut s = stmt.trim_start();
    while s.starts_with('#') {
        let Some(end) = s.find(']') else { break };
        s = s[end + 1..].trim_start();
    }
    let vis_len = if s.starts_with("pub(") {
        s.find(')').map_or(0, |e| e + 1)
    } else if s.starts_with("pub ") {
        3
    } else {
        0
    };
    (&s[..vis_len], s[vis_len..].trim_start())
}

/// What a library path names: an item (the file that defines it, and its name), or a module.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Def {
    Item(String, String),
    Module(Vec<String>),
}

/// The name a top-level statement defines and whether it is a module: `pub struct X` gives
/// `X`; `None` for a `use`, an `impl` and the like.
fn defined(rest: &str) -> Option<(String, bool)> {
    let mut words =
        rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).filter(|w| !w.is_empty());
    let mut w = words.next()?;
    while matches!(w, "unsafe" | "async" | "extern") || (w == "const" && rest.contains("const fn"))
    {
        w = words.next()?;
    }
    let kinds = ["fn", "struct", "enum", "trait", "type", "const", "static", "union", "mod"];
    kinds.contains(&w).then(|| words.next().map(|n| (n.to_string(), w == "mod")))?
}

/// The file of library module `module` (`lib.rs` for the root).
fn library_file(files: &Files, module: &[String]) -> Option<String> {
    if module.is_empty() {
        return Some("lib.rs".into());
    }
    module_file(files, module)
}

/// What `path`, written in library module `module`, names: through `crate::`, `self::`,
/// `super::`, child modules and the `use`s it passes; `None` for a path out of the crate.
fn resolve(files: &Files, module: &[String], path: &[String], hops: usize) -> Option<Def> {
    let mut at: Vec<String> = module.to_vec();
    let mut segs = path;
    match segs.first().map(String::as_str) {
        Some("crate") => (at, segs) = (Vec::new(), &segs[1..]),
        Some("self") => segs = &segs[1..],
        _ => {}
    }
    while segs.first().is_some_and(|s| s == "super") {
        at.pop();
        segs = &segs[1..];
    }
    if hops > 16 {
        return None;
    }
    for (k, seg) in segs.iter().enumerate() {
        let last = k + 1 == segs.len();
        let file = library_file(files, &at)?;
        let stmts = top_statements(files.get(&file)?);
        let own = stmts.iter().find_map(|s| defined(head(s).1).filter(|(n, _)| n == seg));
        match own {
            Some((_, true)) => at.push(seg.clone()),
            Some((n, false)) if last => return Some(Def::Item(file, n)),
            Some(_) => return None,
            None => {
                let via = stmts.iter().filter(|s| head(s).1.starts_with("use ")).find_map(|s| {
                    let mut found = Vec::new();
                    use_tree(&head(s).1[4..], &[], &mut found);
                    found.into_iter().find(|(_, name)| name == seg).map(|(p, _)| p)
                })?;
                match resolve(files, &at, &via, hops + 1)? {
                    Def::Module(m) => at = m,
                    item if last => return Some(item),
                    _ => return None,
                }
            }
        }
    }
    Some(Def::Module(at))
}

/// Every public path of the library's items and modules, from module `module` (public as
/// `public`) down: what each module defines `pub`, and what it re-exports `pub use`.
fn public_paths(
    files: &Files,
    module: &[String],
    public: &str,
    out: &mut BTreeMap<Def, BTreeSet<String>>,
) {
    let Some(code) = library_file(files, module).and_then(|f| files.get(&f)) else { return };
    for stmt in top_statements(code) {
        let (vis, rest) = head(&stmt);
        if vis != "pub" {
            continue;
        }
        if let Some(tree) = rest.strip_prefix("use ") {
            let mut found = Vec::new();
            use_tree(tree, &[], &mut found);
            for (path, name) in found {
                let Some(def) = resolve(files, module, &path, 0) else { continue };
                let at = format!("{public}::{name}");
                if let Def::Module(m) = &def {
                    if out.get(&def).is_none_or(|p| !p.contains(&at)) {
                        public_paths(files, m, &at, out);
                    }
                }
                out.entry(def).or_default().insert(at);
            }
        } else if let Some((name, is_mod)) = defined(rest) {
            let at = format!("{public}::{name}");
            if is_mod {
                let child: Vec<String> = module.iter().cloned().chain([name]).collect();
                public_paths(files, &child, &at, out);
                out.entry(Def::Module(child)).or_default().insert(at);
            } else if let Some(file) = library_file(files, module) {
                out.entry(Def::Item(file, name)).or_default().insert(at);
            }
        }
    }
}

/// One home per item: every public item and module of the library is reachable by one public
/// path (`strata::X` or `strata::m::X`, never both), so that a reader meets each concept under
/// one name. A public module's items are reached through it; the root (or a parent module)
/// re-exports only items of private modules.
#[test]
fn every_public_item_has_one_path() {
    let files = src();
    let mut paths = BTreeMap::new();
    public_paths(&files, &[], "strata", &mut paths);
    assert!(paths.len() > 100, "the reader found only {} public items", paths.len());
    for known in ["strata::Store", "strata::plan::plan", "strata::candle::TrainConfig"] {
        assert!(paths.values().any(|p| p.contains(known)), "{known} not found");
    }
    let twice: Vec<String> = paths
        .values()
        .filter(|p| p.len() > 1)
        .map(|p| p.iter().cloned().collect::<Vec<_>>().join(" and "))
        .collect();
    assert!(twice.is_empty(), "items with two public paths (keep one):\n{}", twice.join("\n"));
}

#[test]
fn the_path_reader_finds_two_paths_to_one_item() {
    let files: Files = [
        (
            "lib.rs",
            "pub mod m; mod hidden; pub use m::X; pub use hidden::Y; pub use hidden::inner;",
        ),
        ("m.rs", "pub struct X; pub(crate) struct Z; impl X { pub fn f() {} }"),
        ("hidden.rs", "pub struct Y; pub mod inner { pub fn g() {} } pub use crate::m::X as W;"),
    ]
    .into_iter()
    .map(|(f, c)| (f.to_string(), code_only(c)))
    .collect();
    let mut paths = BTreeMap::new();
    public_paths(&files, &[], "s", &mut paths);
    let x = &paths[&Def::Item("m.rs".into(), "X".into())];
    assert_eq!(x.iter().collect::<Vec<_>>(), ["s::X", "s::m::X"]);
    assert_eq!(paths[&Def::Item("hidden.rs".into(), "Y".into())].len(), 1);
    assert!(!paths.contains_key(&Def::Item("m.rs".into(), "Z".into())));
    assert!(paths.keys().all(|d| !matches!(d, Def::Item(_, n) if n == "f" || n == "g")));
}

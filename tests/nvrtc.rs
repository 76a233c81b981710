//! Every CUDA C source of the project (`cuda/*.cu`) compiles with NVRTC, as strata compiles it
//! at run time (with `cuda/bf16.cuh` prepended where the source uses it), for the A100's and
//! the H100's virtual architectures, and the PTX has every kernel the Rust side launches. No GPU
//! is needed, only the NVRTC library: a CUDA toolkit's, or PyPI's `nvidia-cuda-nvrtc-cu12`
//! wheel's (its `nvidia/cuda_nvrtc/lib` on `LD_LIBRARY_PATH`). Without it the test prints a
//! SKIP line and passes, unless `STRATA_REQUIRE_NVRTC=1` (CI), which makes that a failure.

use std::ffi::CString;
use std::io::Write;
use std::path::Path;

/// Whether a libnvrtc can be loaded under one of the names cudarc tries.
fn nvrtc_present() -> bool {
    ["libnvrtc.so", "libnvrtc.so.12", "libnvrtc.so.11", "libnvrtc.so.1"].iter().any(|name| {
        let c = CString::new(*name).expect("no NUL in a literal");
        // SAFETY: `c` is a NUL-terminated file name; dlopen returns null (nothing to release)
        // or a handle that is closed at once. Loading NVRTC runs no code of ours.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            !h.is_null() && libc::dlclose(h) == 0
        }
    })
}

/// The kernels of `cuda/fused.cu` that `src/candle/fused/cuda.rs` launches.
fn fused_kernels() -> Vec<String> {
    let mut v = Vec::new();
    for t in ["f32", "bf16", "f16"] {
        for w in ["d64", "d128", "d256"] {
            for k in ["fwd", "dq", "dkdv"] {
                v.push(format!("strata_attn_{k}_{t}_{w}"));
            }
        }
        for k in [
            "attn_delta",
            "rms_fwd",
            "rms_dx",
            "rms_dw_partial",
            "rms_dw_sum",
            "rope",
            "swiglu_fwd",
            "swiglu_bwd",
            "grad_acc",
            "grad_index_add",
        ] {
            v.push(format!("strata_{k}_{t}"));
        }
    }
    v
}

/// The names of the `extern "C" __global__` functions written out in `src` (not those a macro
/// pastes together).
fn literal_kernels(src: &str) -> Vec<String> {
    src.split("extern \"C\" __global__ void ")
        .skip(1)
        .filter_map(|rest| {
            let name: String =
                rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let next = rest[name.len()..].chars().next();
            (!name.is_empty() && next == Some('(')).then_some(name)
        })
        .collect()
}

/// A program to compile: its name, its source as strata compiles it, the kernels it must have.
struct Program {
    name: String,
    source: String,
    kernels: Vec<String>,
}

/// Every program strata compiles from `cuda/`: each `.cu` file (with `bf16.cuh` prepended where
/// it uses it); `fused.cu` once per element type, as `src/candle/fused/cuda.rs` compiles it.
fn programs() -> Vec<Program> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let bf16 = std::fs::read_to_string(dir.join("bf16.cuh")).unwrap();
    let mut sources: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    assert!(sources.len() >= 5, "{sources:?}");
    let mut v = Vec::new();
    for path in &sources {
        let src = std::fs::read_to_string(path).unwrap();
        let uses_bf16 = src.contains("bf16_to_f32(") || src.contains("f32_to_bf16(");
        let full = if uses_bf16 { format!("{bf16}{src}") } else { src.clone() };
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let literal = literal_kernels(&src);
        if name == "fused.cu" {
            for t in ["f32", "bf16", "f16"] {
                let mut kernels = literal.clone();
                kernels.extend(
                    fused_kernels().into_iter().filter(|k| {
                        k.ends_with(&format!("_{t}")) || k.contains(&format!("_{t}_d"))
                    }),
                );
                v.push(Program {
                    name: format!("{name} ({t})"),
                    source: format!("#define STRATA_ELEM_{t}\n{full}"),
                    kernels,
                });
            }
        } else {
            assert!(!literal.is_empty(), "{name}: no kernel found");
            v.push(Program { name, source: full, kernels: literal });
        }
    }
    v
}

#[test]
fn every_kernel_source_compiles_with_nvrtc() {
    if !nvrtc_present() {
        assert!(
            std::env::var("STRATA_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "STRATA_REQUIRE_NVRTC=1 but no libnvrtc.so loads: install nvidia-cuda-nvrtc-cu12 \
             and put its nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH"
        );
        // Past the test harness's capture, so the line shows in a passing run.
        let _ = writeln!(
            std::io::stderr(),
            "SKIP every_kernel_source_compiles_with_nvrtc: no libnvrtc.so on this machine"
        );
        return;
    }
    let programs = programs();
    let fused: usize = programs.iter().filter(|p| p.name.starts_with("fused.cu")).count();
    assert_eq!(fused, 3);
    // Each program and architecture on a thread of its own: NVRTC compiles programs in parallel.
    std::thread::scope(|s| {
        let runs: Vec<_> = programs
            .iter()
            .flat_map(|p| ["compute_80", "compute_90"].map(|arch| (p, arch)))
            .map(|(p, arch)| {
                s.spawn(move || {
                    let t0 = std::time::Instant::now();
                    let opts = cudarc::nvrtc::CompileOptions {
                        options: vec![format!("--gpu-architecture={arch}")],
                        ..Default::default()
                    };
                    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&p.source, opts)
                        .unwrap_or_else(|e| panic!("{} for {arch}: {e:?}", p.name))
                        .to_src();
                    for k in &p.kernels {
                        assert!(
                            ptx.contains(&format!(".entry {k}(")),
                            "{} for {arch}: no kernel {k} in the PTX",
                            p.name
                        );
                    }
                    format!(
                        "{} ({arch}): {} kernels, {} bytes of PTX, {:.1} s",
                        p.name,
                        p.kernels.len(),
                        ptx.len(),
                        t0.elapsed().as_secs_f64()
                    )
                })
            })
            .collect();
        for r in runs {
            println!("{}", r.join().expect("a compile thread"));
        }
    });
}

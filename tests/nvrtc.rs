//! Every CUDA C program strata compiles (`cuda/*.cu`, with `cuda/bf16.cuh` prepended where the
//! source uses it, `cuda/fused.cu` once per element type) compiles with NVRTC for the A100's
//! and the H100's virtual architectures, through the library's own list and compile path
//! (`strata::kernels::compile_sources`). No GPU is needed, only the NVRTC library: a CUDA
//! toolkit's, or PyPI's `nvidia-cuda-nvrtc-cu12` wheel's (its `nvidia/cuda_nvrtc/lib` on
//! `LD_LIBRARY_PATH`). Without it the test prints a SKIP line and passes, unless
//! `STRATA_REQUIRE_NVRTC=1` (CI), which makes that a failure. That the PTX has every kernel the
//! fused ops' launchers load is the library's unit test
//! `every_kernel_the_launchers_load_is_in_the_ptx` (`cargo test --lib`).

use std::io::Write;

/// The file names of `cuda/*.cu`.
fn cu_files() -> Vec<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    assert!(files.len() >= 5, "{files:?}");
    files
}

#[test]
fn every_kernel_source_compiles_with_nvrtc() {
    // Each architecture on a thread of its own: NVRTC compiles programs in parallel.
    let runs: Vec<_> = ["compute_80", "compute_90"]
        .map(|arch| {
            std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                (arch, strata::kernels::compile_sources(arch), t0.elapsed())
            })
        })
        .into_iter()
        .map(|t| t.join().expect("a compile thread"))
        .collect();
    for (arch, results, took) in runs {
        let results = match results {
            Ok(r) => r,
            Err(e) => {
                assert!(
                    std::env::var("STRATA_REQUIRE_NVRTC").as_deref() != Ok("1"),
                    "STRATA_REQUIRE_NVRTC=1 but {e}: install nvidia-cuda-nvrtc-cu12 and put its \
                     nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH"
                );
                // Past the test harness's capture, so the line shows in a passing run.
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIP every_kernel_source_compiles_with_nvrtc: {e}"
                );
                return;
            }
        };
        let names: Vec<_> = results.iter().map(|(name, _)| *name).collect();
        for file in cu_files() {
            let must = format!("cuda/{file}");
            assert!(
                names.iter().any(|n| n.starts_with(&must)),
                "{must} is not compiled: {names:?}"
            );
        }
        for t in ["f32", "bf16", "f16"] {
            let must = format!("cuda/fused.cu ({t})");
            assert!(names.contains(&must.as_str()), "{must} is not compiled: {names:?}");
        }
        for (name, r) in &results {
            if let Err(log) = r {
                panic!("{name} for {arch}: {log}");
            }
        }
        println!("{arch}: {} programs in {:.1} s", results.len(), took.as_secs_f64());
    }
}

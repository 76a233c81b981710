#!/usr/bin/env python3
"""The lease's own rules, checked without a GPU (`run --host lease` runs this; about a second):

- the decisive checks (attention, the 7B step, the CUDA test binaries) fit in the lease's budget
  less its headroom, and no lease raises another check above them;
- the lease never asks the trainer for another machine's plan (`--machine h100` on an H200);
- reports name the GPU the run saw, and the import files them under it; no fixed label or note
  of a GPU run (report.py's, run's) names a GPU, which on another GPU would mislabel the report;
- the probe picks the CUDA 13 libraries, the Python packages' (PyTorch's wheels) before the CUDA
  install's, links the unversioned names cudarc opens, and writes the library path before it
  asks nvidia-smi;
- the attention and training parsers read what the lease's programs print;
- `run prepare`'s cost lines.

  python3 benches/gpu/test_lease.py [-v]

Python 3 standard library only.
"""
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ledger as lg  # noqa: E402
import probe as pb  # noqa: E402
import report as rp  # noqa: E402


class Budget(unittest.TestCase):
    def setUp(self):
        self.ledger = lg.load()

    def test_the_decisive_checks_fit_in_the_budget(self):
        self.assertIsNone(lg.over_budget(self.ledger))

    def test_a_box_too_many_fails_the_check(self):
        over = copy.deepcopy(self.ledger)
        lease = over["lease"]
        room = lg.decisive_room(lease)
        must = [c for c in over["checks"] if c["lease"] and c["priority"] <= lease["decisive_priority"]]
        self.assertTrue(must, "no decisive check")
        must[-1]["box_s"] += room - sum(c["box_s"] for c in must) + 1
        why = lg.over_budget(over)
        self.assertIsNotNone(why)
        self.assertIn(must[-1]["id"], why)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "ledger.json")
            with open(path, "w") as f:
                json.dump(over, f)
            p = subprocess.run([sys.executable, os.path.join(HERE, "ledger.py"), "--ledger", path, "check"],
                               capture_output=True, text=True)
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("would never start", p.stderr)

    def test_the_headroom_is_kept_free_of_the_decisive_boxes(self):
        l2 = copy.deepcopy(self.ledger)
        lease = l2["lease"]
        must = sum(c["box_s"] for c in l2["checks"] if c["lease"] and c["priority"] <= lease["decisive_priority"])
        lease["headroom_s"] = lease["budget_s"] - lease["reserve_s"] - lease["setup_s"] - must
        self.assertIsNone(lg.over_budget(l2))
        lease["headroom_s"] += 1
        self.assertIn("of headroom", lg.over_budget(l2))
        lease["headroom_s"] = "20"
        self.assertTrue(lg.validate(l2))

    def test_attention_then_7b_then_tests_lead_the_plan(self):
        order = [c["id"] for c, _, _ in lg.plan(self.ledger)]
        self.assertEqual(order[:2], ["fused-attention-sdpa", "candle-7b-block"])
        decisive = self.ledger["lease"]["decisive_priority"]
        n = sum(1 for c in self.ledger["checks"] if c["lease"] and c["priority"] <= decisive)
        for cid in order[:n]:
            c = next(x for x in self.ledger["checks"] if x["id"] == cid)
            self.assertLessEqual(c["priority"], decisive, f"{cid} before a decisive check")

    def test_leases_sat_out_never_raise_a_check_above_the_decisive_ones(self):
        l2 = copy.deepcopy(self.ledger)
        l2["leases"] = [{"date": f"2027-01-{d:02d}T00:00:00Z", "commit": "x", "report": "r"} for d in range(1, 11)]
        decisive = l2["lease"]["decisive_priority"]
        seen_other = False
        for c, _, _ in lg.plan(l2):
            if c["priority"] > decisive:
                seen_other = True
            elif seen_other and c["priority"] <= decisive:
                # A decisive check may sit after another only when it is up to date.
                self.assertEqual(lg.standing(c)[0], lg.CURRENT, c["id"])


class Machine(unittest.TestCase):
    def test_the_decisive_runs_of_the_first_checks_are_never_starved(self):
        # The 7B check runs its out-of-core step before the twins; the attention check keeps
        # PyTorch's share of its box from the candidates, and keeps --kernel list's words.
        with open(os.path.join(HERE, "run")) as f:
            code = f.read()
        b7 = code[code.index("check_candle_7b_block() {"):]
        b7 = b7[:b7.index("\n}\n")]
        self.assertLess(b7.index("step candle-7b-ooc "), b7.index("candle-7b-twin-recompute candle-train"))
        self.assertLess(b7.index("step candle-7b-ooc "), b7.index("step candle-7b-twin "))
        fa = code[code.index("check_fused_attention_sdpa() {"):]
        fa = fa[:fa.index("\n}\n")]
        cut, cands = fa.index("limit_at=$(( box_end - share ))"), fa.index('step "fused-attn-')
        back, sdpa = fa.index("limit_at=$box_end"), fa.index("sdpa fused-attention")
        self.assertLess(cut, cands)
        self.assertLess(cands, back)
        self.assertLess(back, sdpa)
        self.assertNotIn("--kernel list 2>/dev/null", fa)

    def test_the_lease_asks_for_no_other_machines_plan(self):
        with open(os.path.join(HERE, "run")) as f:
            code = [line.split("#", 1)[0] for line in f]
        self.assertFalse([line for line in code if "--machine" in line],
                         "benches/gpu/run passes --machine: the plan would be another GPU's")

    def report(self, gpu, figs, notes=()):
        return {"schema": rp.SCHEMA, "stage": "lease", "title": "t", "commit": "c", "date": "2026-11-29T00:00:00Z",
                "machine": {"gpu": gpu, "description": gpu or "no GPU", "name": (gpu or "").split(",")[0]},
                "host": False, "simulated": False, "figures": figs, "steps": [], "notes": list(notes)}

    def fig(self, name, note=None, simulated=False):
        f = {"name": name, "value": 1.0, "unit": "ms", "command": "x", "verdict": "measured", "group": "g"}
        if note:
            f["note"] = note
        if simulated:
            f["simulated"] = True
        return f

    def test_an_h200_run_that_reads_as_h100_is_invalid(self):
        gpu = "NVIDIA H200, 143771 MiB, 580.159.04, 5, 16"
        bad = rp.validate(self.report(gpu, [self.fig("7B step, the plan's H100 floor")]))
        self.assertTrue(any("names H100" in e for e in bad), bad)
        self.assertTrue(rp.validate(self.report(gpu, [self.fig("x", note="at the H100's rates")])))
        self.assertTrue(rp.validate(self.report(gpu, [self.fig("x")], notes=["measured on the H100"])))
        self.assertEqual(rp.validate(self.report(gpu, [self.fig("7B step on the H200")])), [])
        self.assertEqual(rp.validate(self.report(gpu, [self.fig("--simulate h100", simulated=True)])), [])
        self.assertEqual(rp.validate(self.report("NVIDIA H100 PCIe, 81559 MiB", [self.fig("on the H100")])), [])

    def test_a_mislabelled_report_is_written_all_the_same(self):
        r = self.report("NVIDIA H200, 143771 MiB", [self.fig("on the H100")])
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "report-lease.json")
            rp.write_report(r, path)  # the figures come back; `check` and the import refuse it
            with open(path) as f:
                self.assertTrue(rp.mislabels(json.load(f)))

    def test_a_training_step_parsed_on_an_h200_names_no_other_gpu(self):
        # The trainer's step line with MegaTrain's count: its figures' names and notes are fixed
        # texts of report.py, which must not name a GPU as the one the run was on.
        line = ("step {i}/3: loss 5.5  lr 1e-3  grad norm 1.0  8000 tokens/s  300.0 TFLOPS  (280.0 as 6 × "
                "parameters × tokens)  (900.0 ms)  optimizer 10.00 ms (hidden 9.00, exposed 1.00)  "
                "floor 800.0 ms (compute): step / floor 1.{i}5")
        text = ("attention: cuDNN's fused SDPA on the tensor cores (/x/libstrata_attn.so (cuDNN 9.19.0))\n"
                + "\n".join(line.format(i=i) for i in (1, 2, 3))
                + "\nattention ran: cuDNN's fused SDPA for 1 × 32 heads (backward workspace 256.0 MiB)\n5.5\n")
        step = {"name": "candle-7b-ooc", "kind": "candle-train", "status": "ok", "command": "x", "log": "l",
                "meta": {"label": "4 blocks (hidden 4096 intermediate 11008, vocab 256) out of core",
                         "group": "training at the 7B block shape", "target": ">=400", "target_text": "≥ 400 TFLOPS",
                         "peer_key": "candle:7b-twin-recompute", "peer_target": ">=0.95",
                         "peer_what": "the recomputing twin", "beside_key": "candle:7b-twin",
                         "beside_what": "the twin without recompute"}}
        figs = rp.figures_from_text(text, step, ".")
        self.assertTrue(any("6 × parameters × tokens" in f["name"] for f in figs), [f["name"] for f in figs])
        r = self.report("NVIDIA H200, 143771 MiB, 580.159.04, 5, 16", figs)
        self.assertEqual(rp.mislabels(r), [])
        self.assertEqual(rp.validate(r), [])

    def test_the_runs_texts_name_no_gpu_outside_the_simulated_rows(self):
        # Labels and notes the run gives a GPU run's steps and report (comments and the host-only
        # simulate stage aside): a GPU model named there would make an H200's report mislabelled.
        with open(os.path.join(HERE, "run")) as f:
            lines = f.read().splitlines()
        bad, simulate = [], False
        for n, line in enumerate(lines, 1):
            code = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
            if code.startswith("stage_simulate() {"):
                simulate = True
            elif simulate and code.startswith("}"):
                simulate = False
            elif not simulate and "--simulate" not in code and rp.GPU_MODEL.search(code.upper()):
                bad.append(f"run:{n}: {line.strip()}")
        self.assertEqual(bad, [])

    def test_the_import_files_an_h200_run_under_h200(self):
        r = self.report("NVIDIA H200, 143771 MiB, 580.159.04, 5, 16", [])
        self.assertEqual(lg.gpu_short(r), "h200")
        self.assertEqual(pb.short_name("NVIDIA H200"), "h200")
        self.assertEqual(pb.short_name("NVIDIA H100 80GB HBM3"), "h100")
        self.assertIsNone(pb.short_name(None))


class Probe(unittest.TestCase):
    def test_cuda_13_first_then_the_newest_and_links_for_cudarc(self):
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "a"), os.path.join(d, "b")
            os.makedirs(a)
            os.makedirs(b)
            for path in [f"{a}/libcublas.so.12", f"{a}/libcublas.so.12.9.1", f"{b}/libcublas.so.13",
                         f"{b}/libcublas.so.13.1.0", f"{a}/libnvrtc.so.12", f"{a}/libcudnn.so.8",
                         f"{b}/libcudnn.so.10", f"{b}/libcurand.so", f"{b}/libcublasLt.so.13.txt"]:
                open(path, "w").close()
            f = pb.find("cublas", "13", [a, b], {})
            self.assertEqual(f["chosen"], f"{b}/libcublas.so.13")
            self.assertTrue(f["major_ok"])
            self.assertEqual(len(f["found"]), 4)
            f = pb.find("nvrtc", "13", [a, b], {})
            self.assertEqual((f["chosen"], f["major_ok"]), (f"{a}/libnvrtc.so.12", False))
            f = pb.find("cudnn", "9", [a, b], {})
            self.assertEqual(f["chosen"], f"{b}/libcudnn.so.10", "no .so.9: the newest")
            f = pb.find("curand", "13", [a, b], {})
            self.assertIsNone(f["chosen"], "only the bare name: nothing to load by version")
            self.assertIsNone(pb.find("cublasLt", "13", [a, b], {})["chosen"])
            self.assertEqual(pb.find("cublas", "13", [], {"libcublas.so.13": f"{b}/libcublas.so.13"})["chosen"],
                             f"{b}/libcublas.so.13")

    def test_the_python_packages_libraries_come_before_the_cuda_installs(self):
        # PyTorch runs with the lease's library path: its wheels' CUDA 13 must win over the
        # install's (another minor version of it).
        with tempfile.TemporaryDirectory() as d:
            wheel, install = os.path.join(d, "nvidia", "cu13", "lib"), os.path.join(d, "cuda-13.0", "lib64")
            for x in (wheel, install):
                os.makedirs(x)
                open(os.path.join(x, "libcublas.so.13"), "w").close()
            old = os.environ.pop("LD_LIBRARY_PATH", None)
            try:
                dirs = pb.search_dirs([wheel], system=(install,))
            finally:
                if old is not None:
                    os.environ["LD_LIBRARY_PATH"] = old
            self.assertEqual(dirs, [wheel, install])
            self.assertEqual(pb.find("cublas", "13", dirs, {})["chosen"], os.path.join(wheel, "libcublas.so.13"))

    def test_the_library_path_is_written_before_nvidia_smi_is_asked(self):
        with tempfile.TemporaryDirectory() as d:
            env, js, seen = os.path.join(d, "probe.env"), os.path.join(d, "probe.json"), {}

            def gpu():  # what a slow nvidia-smi would find written already
                seen["env"] = open(env).read() if os.path.exists(env) else None
                seen["json"] = os.path.exists(js)
                return {"error": "not asked in this test"}
            real, pb.gpu = pb.gpu, gpu
            try:
                r = pb.probe(links=os.path.join(d, "libs"), json_path=js, env_path=env)
            finally:
                pb.gpu = real
            self.assertTrue((seen["env"] or "").startswith("export LD_LIBRARY_PATH="), seen)
            self.assertIn(os.path.join(d, "libs"), seen["env"])
            self.assertTrue(seen["json"])
            self.assertEqual(r["gpu"], {"error": "not asked in this test"})

    def test_the_probe_runs_in_seconds_and_says_what_it_found(self):
        with tempfile.TemporaryDirectory() as d:
            r = pb.probe(links=os.path.join(d, "libs"))
        self.assertLess(r["seconds"], 5)
        self.assertEqual(set(r["libraries"]), {name for name, _, _ in pb.LIBS})
        self.assertTrue(r["ld_library_path"].startswith(os.path.join(d, "libs")))
        self.assertTrue(any(line.startswith("LD_LIBRARY_PATH=") for line in pb.summary(r)))


class Parsers(unittest.TestCase):
    def test_attention_candidates_against_torch_and_the_reference(self):
        strata = json.dumps({"bench": "strata-fused-attention", "device": "cuda", "dtype": "bf16", "seq": 2048,
                             "fwd_ms": 1.0, "fwd_bwd_ms": 3.0, "fwd_tflops": 100.0, "fwd_bwd_tflops": 120.0})
        step = {"name": "fused-attn-default-2048", "meta": {"label": "strata", "key": "fused-attn:default:2048",
                                                            "peer_key": "sdpa:2048"}}
        figs = rp.parse_fused_attention(strata, step)
        self.assertEqual([f["unit"] for f in figs], ["ms", "TFLOPS"])
        errs = {f"{p}err_{n}": 1e-3 for p in ("", "ref_", "torch_ref_") for n in ("o", "dq", "dk", "dv")}
        lines = [json.dumps(dict(errs, peer="torch-sdpa", candidate=c, device="cuda", dtype="bf16", seq=2048,
                                 heads=32, kv_heads=32, head_dim=128, window=None, fwd_ms=0.5, fwd_bwd_ms=1.5,
                                 fwd_tflops=200.0, fwd_bwd_tflops=240.0)) for c in ("default", "flash")]
        figs += rp.parse_fused_attention("\n".join(lines), {"name": "sdpa", "meta": {}})
        torch = [f for f in figs if f.get("key") == "sdpa:2048"]
        self.assertEqual(len(torch), 1, "torch timed once a shape")
        errors = [f for f in figs if f["unit"] == "relative"]
        self.assertEqual([f["name"].split(",")[0] for f in errors], ["default", "flash"])
        self.assertTrue(all("f32 reference" in f["name"] for f in errors))
        for f in figs:
            f["verdict"] = rp.judge(f, "ok")
        rp.link_peers(figs)
        self.assertEqual(figs[0]["peer_ratio"], 2.0, "strata's 3 ms against torch's 1.5")

    def test_the_out_of_core_step_against_its_floor_and_both_twins(self):
        line = ("step {i}/3: loss 5.5  lr 1e-3  grad norm 1.0  8000 tokens/s  300.0 TFLOPS  (900.0 ms)  moved [d]  "
                "stall 0.10 ms  optimizer 10.00 ms (hidden 9.00, exposed 1.00)  floor 800.0 ms (compute): "
                "step / floor 1.{i}5")
        text = ("attention: cuDNN's fused SDPA on the tensor cores (/x/libstrata_attn.so (cuDNN 9.19.0))\n"
                + "\n".join(line.format(i=i) for i in (1, 2, 3))
                + "\nattention ran: cuDNN's fused SDPA for 1 × 32 heads (backward workspace 256.0 MiB)\n5.5\n")
        step = {"name": "candle-7b-ooc", "meta": {"label": "ooc", "peer_key": "candle:7b-twin-recompute",
                                                   "peer_target": ">=0.95", "peer_what": "the recomputing twin",
                                                   "beside_key": "candle:7b-twin",
                                                   "beside_what": "the twin without recompute"}}
        figs = rp.parse_candle_train(text, step)
        names = [f["name"] for f in figs]
        self.assertIn("ooc: TFLOPS against the recomputing twin", names)
        self.assertIn("ooc: TFLOPS against the twin without recompute (beside)", names)
        floor = next(f for f in figs if f["name"] == "ooc: a step against its floor")
        self.assertEqual(floor["value"], 1.35)
        self.assertIn("floor 800.0 ms (compute)", floor["note"])
        tflops = next(f for f in figs if f["name"] == "ooc: model TFLOPS")
        self.assertIn("attention: cuDNN's fused SDPA", tflops["note"], "the kernel the blocks were to run")
        self.assertIn("attention ran: cuDNN's fused SDPA for 1 × 32 heads", tflops["note"], "what they ran")


class Cost(unittest.TestCase):
    def test_prepare_prints_what_the_call_carries_and_its_wall_time(self):
        lease = lg.load()["lease"]
        lines = lg.cost_lines(lease, 14 << 20, 3 << 20)
        self.assertIn("17.0 MiB of the 64.0 MiB", lines[0])
        self.assertIn(f"about {lease['start_s'] + lease['budget_s'] + 10} s", lines[1])
        self.assertIn("TOO MUCH", lg.cost_lines(lease, 60 << 20, 5 << 20)[0])
        p = subprocess.run([sys.executable, os.path.join(HERE, "ledger.py"), "cost", "--carried", "1048576",
                            "--tree", "1048576"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(re.search(r"2\.0 MiB of the 64\.0 MiB", p.stdout), p.stdout)


if __name__ == "__main__":
    unittest.main()
